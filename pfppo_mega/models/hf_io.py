"""Hugging Face Llama checkpoints <-> megatron-core GPTModel (local layer spec) state dicts.

Name map (layer i; H hidden, nh query heads, ng key/value groups, d = H / nh, F ffn):

    model.embed_tokens.weight                  [V, H]   embedding.word_embeddings.weight
    model.layers.i.input_layernorm.weight      [H]      decoder.layers.i.input_layernorm.weight
    model.layers.i.self_attn.{q,k,v}_proj      see QKV  decoder.layers.i.self_attention.linear_qkv.weight
    model.layers.i.self_attn.o_proj.weight     [H, H]   decoder.layers.i.self_attention.linear_proj.weight
    model.layers.i.post_attention_layernorm    [H]      decoder.layers.i.pre_mlp_layernorm.weight
    model.layers.i.mlp.{gate,up}_proj.weight   [F, H]   decoder.layers.i.mlp.linear_fc1.weight = [gate; up]  [2F, H]
    model.layers.i.mlp.down_proj.weight        [H, F]   decoder.layers.i.mlp.linear_fc2.weight
    model.norm.weight                          [H]      decoder.final_layernorm.weight
    lm_head.weight (absent when tied)          [V, H]   output_layer.weight (absent when tied)

QKV: megatron views linear_qkv's output as [ng, (nh/ng + 2) * d], i.e. for each key/value group
g the rows are the group's nh/ng query heads, then its key head, then its value head:

    linear_qkv = stack_g [ q_proj[g*(nh/ng)*d : (g+1)*(nh/ng)*d]; k_proj[g*d:(g+1)*d]; v_proj[g*d:(g+1)*d] ]

Both sides use rotate-half RoPE, so q/k need no permutation. Conversions work on full
(tensor-parallel size 1) tensors; loading into / reading from a model is implemented for
tp = pp = 1 only and says so otherwise.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from pfppo_mega.config.tree import ModelConfig
from pfppo_mega.models.gpt import unwrap

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


# ----------------------------------------------------------------------------- config


def _require_dir(path: str | os.PathLike) -> Path:
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"checkpoint directory {str(p)!r} does not exist")
    if not p.is_dir():
        raise NotADirectoryError(f"checkpoint path {str(p)!r} is not a directory")
    return p


def _read_json(file: Path) -> Any:
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{str(file)!r} is not valid JSON: {e}") from None


def read_hf_config(path: str | os.PathLike) -> dict:
    """The parsed config.json of checkpoint directory ``path``."""
    file = _require_dir(path) / CONFIG_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{str(file)!r} is missing: a Hugging Face checkpoint needs {CONFIG_FILE}")
    cfg = _read_json(file)
    if not isinstance(cfg, dict):
        raise ValueError(f"{str(file)!r} must hold a JSON object, found {type(cfg).__name__}")
    return cfg


def _rope_theta(hf: dict) -> tuple[Optional[float], Optional[str]]:
    """(rope_theta, rope_type) from transformers 5 `rope_parameters` or 4.x `rope_theta`/`rope_scaling`."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    return theta, rope_type


# ModelConfig field -> (config.json key, default when the key is absent; _REQUIRED = none)
_REQUIRED = object()
_HF_KEYS: dict[str, tuple[str, Any]] = {
    "num_layers": ("num_hidden_layers", _REQUIRED),
    "hidden_size": ("hidden_size", _REQUIRED),
    "ffn_hidden_size": ("intermediate_size", _REQUIRED),
    "num_attention_heads": ("num_attention_heads", _REQUIRED),
    "num_query_groups": ("num_key_value_heads", None),  # None: = num_attention_heads
    "vocab_size": ("vocab_size", _REQUIRED),
    "max_position_embeddings": ("max_position_embeddings", _REQUIRED),
    "norm_epsilon": ("rms_norm_eps", 1e-6),
    "tie_word_embeddings": ("tie_word_embeddings", False),
}


def _architecture_problems(hf: dict) -> list[str]:
    problems = []
    model_type = hf.get("model_type")
    archs = hf.get("architectures") or []
    if model_type is not None and model_type != "llama":
        problems.append(f"model_type = {model_type!r}: only 'llama' is supported")
    if model_type is None and "LlamaForCausalLM" not in archs:
        problems.append(f"architectures = {archs!r}: expected LlamaForCausalLM")
    for key, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if key in hf and hf[key] != want:
            problems.append(f"{key} = {hf[key]!r}: must be {want!r}")
    _, rope_type = _rope_theta(hf)
    if rope_type != "default":
        problems.append(f"rope type = {rope_type!r}: only unscaled ('default') RoPE is supported")
    heads, hidden = hf.get("num_attention_heads"), hf.get("hidden_size")
    head_dim = hf.get("head_dim")
    if head_dim is not None and heads and hidden and head_dim * heads != hidden:
        problems.append(f"head_dim = {head_dim}: must equal hidden_size / num_attention_heads"
                        f" = {hidden / heads}")
    return problems


def _checkpoint_values(hf: dict) -> dict[str, Any]:
    values: dict[str, Any] = {}
    missing = []
    for field, (key, default) in _HF_KEYS.items():
        if key in hf and hf[key] is not None:
            values[field] = hf[key]
        elif default is _REQUIRED:
            missing.append(key)
        else:
            values[field] = default
    if missing:
        raise ValueError(f"config.json lacks required key(s): {', '.join(missing)}")
    if values["num_query_groups"] is None:
        values["num_query_groups"] = values["num_attention_heads"]
    values["rope_theta"] = float(_rope_theta(hf)[0])
    values["tie_word_embeddings"] = bool(values["tie_word_embeddings"])
    return values


def model_config_from_hf(hf_cfg: dict, base: ModelConfig) -> ModelConfig:
    """``base`` with every unset (None) shape field filled from config.json.

    A field set in ``base`` must equal the checkpoint's value: ValueError lists every field that
    differs with both values. Unsupported architectures (non-llama, biases, scaled RoPE,
    head_dim != hidden_size / heads) are rejected with the reason.
    """
    problems = _architecture_problems(hf_cfg)
    if problems:
        raise ValueError("unsupported checkpoint architecture:\n" + "\n".join(f"  - {p}" for p in problems))
    ckpt = _checkpoint_values(hf_cfg)
    mismatched = [
        f"  - {field}: config {getattr(base, field)!r}, checkpoint {value!r}"
        for field, value in ckpt.items()
        if getattr(base, field) is not None and getattr(base, field) != value
    ]
    if mismatched:
        raise ValueError("model config differs from the checkpoint's config.json:\n" + "\n".join(mismatched))
    fill = {field: value for field, value in ckpt.items() if getattr(base, field) is None}
    return dataclasses.replace(base, **fill)


# ----------------------------------------------------------------------------- tensors on disk


def load_hf_state_dict(path: str | os.PathLike) -> dict[str, Tensor]:
    """All tensors of a checkpoint: model.safetensors, or the shards listed in
    model.safetensors.index.json (model-0000x-of-0000y.safetensors)."""
    root = _require_dir(path)
    index = root / INDEX_FILE
    single = root / SINGLE_FILE
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{str(index)!r} has no 'weight_map' object mapping tensor names to shard files")
        shards = sorted(set(weight_map.values()))
        absent = [s for s in shards if not (root / s).is_file()]
        if absent:
            raise FileNotFoundError(f"shard file(s) listed in {INDEX_FILE} are missing from "
                                    f"{str(root)!r}: {', '.join(absent)}")
        state: dict[str, Tensor] = {}
        for shard in shards:
            state.update(load_file(str(root / shard)))
        lost = sorted(set(weight_map) - set(state))
        if lost:
            raise ValueError(f"tensor(s) listed in {INDEX_FILE} are absent from their shards: "
                             f"{', '.join(lost[:10])}")
        return state
    if single.is_file():
        return load_file(str(single))
    found = sorted(p.name for p in root.iterdir())
    raise FileNotFoundError(
        f"no {SINGLE_FILE} or {INDEX_FILE} in {str(root)!r} (found: {', '.join(found) or 'nothing'}); "
        f"only safetensors checkpoints are supported"
    )


# ----------------------------------------------------------------------------- name / layout conversion


@dataclasses.dataclass(frozen=True)
class _Dims:
    layers: int
    hidden: int
    heads: int
    groups: int
    ffn: int
    vocab: int
    tied: bool

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def q_per_group(self) -> int:
        return self.heads // self.groups

    @classmethod
    def of(cls, model: ModelConfig) -> "_Dims":
        missing = [k for k in ModelConfig.SHAPE_FIELDS if getattr(model, k) is None]
        if missing:
            raise ValueError(f"model config is incomplete (unset: {', '.join(missing)})")
        return cls(model.num_layers, model.hidden_size, model.num_attention_heads, model.num_query_groups,
                   model.ffn_hidden_size, model.vocab_size, bool(model.tie_word_embeddings))


def fuse_qkv(q: Tensor, k: Tensor, v: Tensor, *, heads: int, groups: int) -> Tensor:
    """[nh*d, H], [ng*d, H], [ng*d, H] -> megatron linear_qkv [ng*(nh/ng + 2)*d, H] (group-interleaved)."""
    hidden = q.shape[1]
    d = q.shape[0] // heads
    q = q.reshape(groups, heads // groups * d, hidden)
    k = k.reshape(groups, d, hidden)
    v = v.reshape(groups, d, hidden)
    return torch.cat([q, k, v], dim=1).reshape(-1, hidden)


def split_qkv(qkv: Tensor, *, heads: int, groups: int) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of fuse_qkv: linear_qkv [ng*(nh/ng + 2)*d, H] -> q [nh*d, H], k, v [ng*d, H]."""
    hidden = qkv.shape[1]
    d = qkv.shape[0] // (heads + 2 * groups)
    per_group = qkv.reshape(groups, (heads // groups + 2) * d, hidden)
    q, k, v = torch.split(per_group, [heads // groups * d, d, d], dim=1)
    return q.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden)


def _expected_hf_shapes(dims: _Dims) -> dict[str, tuple[int, ...]]:
    h, f, d = dims.hidden, dims.ffn, dims.head_dim
    shapes = {"model.embed_tokens.weight": (dims.vocab, h), "model.norm.weight": (h,)}
    if not dims.tied:
        shapes["lm_head.weight"] = (dims.vocab, h)
    for i in range(dims.layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (dims.heads * d, h),
            p + "self_attn.k_proj.weight": (dims.groups * d, h),
            p + "self_attn.v_proj.weight": (dims.groups * d, h),
            p + "self_attn.o_proj.weight": (h, dims.heads * d),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (f, h),
            p + "mlp.up_proj.weight": (f, h),
            p + "mlp.down_proj.weight": (h, f),
        })
    return shapes


def _check_shapes(sd: Mapping[str, Tensor], expected: Mapping[str, tuple[int, ...]], what: str) -> None:
    missing = [n for n in expected if n not in sd]
    if missing:
        more = " ..." if len(missing) > 10 else ""
        raise KeyError(f"{what} lacks tensor(s): {', '.join(missing[:10])}{more}")
    wrong = [f"  - {n}: expected {tuple(expected[n])}, found {tuple(sd[n].shape)}"
             for n in expected if tuple(sd[n].shape) != tuple(expected[n])]
    if wrong:
        raise ValueError(f"{what} has tensor(s) of the wrong shape:\n" + "\n".join(wrong))


def hf_to_megatron(hf_sd: Mapping[str, Tensor], model: ModelConfig) -> dict[str, Tensor]:
    """HF Llama tensors -> GPTModel (local spec, tp = 1) state dict. Checks every HF tensor's
    presence and shape; ignores rotary caches and, when tied, a redundant lm_head.weight."""
    dims = _Dims.of(model)
    _check_shapes(hf_sd, _expected_hf_shapes(dims), "HF state dict")
    out = {
        "embedding.word_embeddings.weight": hf_sd["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": hf_sd["model.norm.weight"],
    }
    if not dims.tied:
        out["output_layer.weight"] = hf_sd["lm_head.weight"]
    for i in range(dims.layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[m + "input_layernorm.weight"] = hf_sd[p + "input_layernorm.weight"]
        out[m + "self_attention.linear_qkv.weight"] = fuse_qkv(
            hf_sd[p + "self_attn.q_proj.weight"], hf_sd[p + "self_attn.k_proj.weight"],
            hf_sd[p + "self_attn.v_proj.weight"], heads=dims.heads, groups=dims.groups)
        out[m + "self_attention.linear_proj.weight"] = hf_sd[p + "self_attn.o_proj.weight"]
        out[m + "pre_mlp_layernorm.weight"] = hf_sd[p + "post_attention_layernorm.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat(
            [hf_sd[p + "mlp.gate_proj.weight"], hf_sd[p + "mlp.up_proj.weight"]], dim=0)
        out[m + "mlp.linear_fc2.weight"] = hf_sd[p + "mlp.down_proj.weight"]
    return out


def _iter_megatron_to_hf(mcore_sd: Mapping[str, Any], dims: _Dims) -> Iterator[tuple[str, Tensor]]:
    def get(name: str) -> Tensor:
        if name not in mcore_sd or not isinstance(mcore_sd[name], Tensor):
            raise KeyError(f"megatron state dict lacks tensor {name!r}")
        return mcore_sd[name]

    yield "model.embed_tokens.weight", get("embedding.word_embeddings.weight")
    for i in range(dims.layers):
        p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        yield p + "input_layernorm.weight", get(m + "input_layernorm.weight")
        q, k, v = split_qkv(get(m + "self_attention.linear_qkv.weight"), heads=dims.heads, groups=dims.groups)
        yield p + "self_attn.q_proj.weight", q
        yield p + "self_attn.k_proj.weight", k
        yield p + "self_attn.v_proj.weight", v
        yield p + "self_attn.o_proj.weight", get(m + "self_attention.linear_proj.weight")
        yield p + "post_attention_layernorm.weight", get(m + "pre_mlp_layernorm.weight")
        gate, up = torch.chunk(get(m + "mlp.linear_fc1.weight"), 2, dim=0)
        yield p + "mlp.gate_proj.weight", gate
        yield p + "mlp.up_proj.weight", up
        yield p + "mlp.down_proj.weight", get(m + "mlp.linear_fc2.weight")
    yield "model.norm.weight", get("decoder.final_layernorm.weight")
    if not dims.tied:
        yield "lm_head.weight", get("output_layer.weight")


def megatron_to_hf(mcore_sd: Mapping[str, Any], model: ModelConfig) -> dict[str, Tensor]:
    """GPTModel (tp = 1) state dict -> HF Llama tensors; tied weights appear once (embed_tokens).
    ``_extra_state`` entries are ignored. Checks the resulting shapes against ``model``."""
    dims = _Dims.of(model)
    out = dict(_iter_megatron_to_hf(mcore_sd, dims))
    _check_shapes(out, _expected_hf_shapes(dims), "converted megatron state dict")
    return out


def _require_single_rank_layout() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        tp = parallel_state.get_tensor_model_parallel_world_size()
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        if (tp, pp) != (1, 1):
            raise NotImplementedError(
                f"HF weight conversion of a model split over tp({tp}) * pp({pp}) ranks is not implemented; "
                f"only tp = pp = 1"
            )


def megatron_named_params_to_hf(model_module: torch.nn.Module,
                                model_cfg: ModelConfig) -> Iterator[tuple[str, Tensor]]:
    """Yield (HF name, tensor) for every actor weight, in HF order, for a rollout engine.

    Tensors are detached; norms, o_proj, down_proj, embeddings and lm_head are views of the
    live parameters (copy them if the consumer keeps them across optimizer steps); q/k/v and
    gate/up are views into the fused megatron weights. Tied weights are yielded once.
    """
    _require_single_rank_layout()
    sd = unwrap(model_module).state_dict(keep_vars=False)
    yield from _iter_megatron_to_hf(sd, _Dims.of(model_cfg))


# ----------------------------------------------------------------------------- into / out of a model


def _model_config_of(path: str | os.PathLike) -> ModelConfig:
    return model_config_from_hf(read_hf_config(path), ModelConfig())


def _copy_into(module: torch.nn.Module, mcore_sd: Mapping[str, Tensor], *,
               skip_prefixes: tuple[str, ...] = ()) -> None:
    _require_single_rank_layout()
    target = unwrap(module)
    params = {n: p for n, p in target.named_parameters() if not n.startswith(skip_prefixes)}
    missing = [n for n in params if n not in mcore_sd]
    if missing:
        raise KeyError(f"model parameter(s) have no tensor in the checkpoint: {', '.join(missing)}")
    wrong = [f"  - {n}: model expects {tuple(p.shape)}, checkpoint gives {tuple(mcore_sd[n].shape)}"
             for n, p in params.items() if tuple(p.shape) != tuple(mcore_sd[n].shape)]
    if wrong:
        raise ValueError("checkpoint tensor shape(s) do not match the model:\n" + "\n".join(wrong))
    unused = [n for n in mcore_sd if n not in params and not n.startswith(skip_prefixes)]
    if unused:
        raise ValueError(f"checkpoint tensor(s) have no parameter in the model "
                         f"(tied / untied mismatch?): {', '.join(unused)}")
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(mcore_sd[name].to(param.dtype))


def load_actor_from_hf(model_module: torch.nn.Module, path: str | os.PathLike) -> ModelConfig:
    """Copy checkpoint ``path`` into an actor built by build_actor; returns the checkpoint's
    ModelConfig. Every parameter must be covered with the right shape (errors name the tensor,
    the expected and the found shape)."""
    cfg = _model_config_of(path)
    _copy_into(model_module, hf_to_megatron(load_hf_state_dict(path), cfg))
    return cfg


def load_critic_trunk_from_hf(critic_module: torch.nn.Module, path: str | os.PathLike) -> ModelConfig:
    """Copy checkpoint ``path`` into a critic's trunk; the value head keeps its (zero) init and
    the checkpoint's LM head is not used."""
    cfg = _model_config_of(path)
    sd = hf_to_megatron(load_hf_state_dict(path), cfg)
    _copy_into(critic_module, sd, skip_prefixes=("output_layer.",))
    return cfg


_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


def hf_config_dict(model: ModelConfig, dtype: torch.dtype) -> dict[str, Any]:
    """config.json contents of a LlamaForCausalLM with the shape of ``model``."""
    dims = _Dims.of(model)
    dtype_name = _DTYPE_NAMES[dtype]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_size": dims.hidden,
        "intermediate_size": dims.ffn,
        "num_hidden_layers": dims.layers,
        "num_attention_heads": dims.heads,
        "num_key_value_heads": dims.groups,
        "head_dim": dims.head_dim,
        "vocab_size": dims.vocab,
        "max_position_embeddings": model.max_position_embeddings,
        "rms_norm_eps": model.norm_epsilon,
        "rope_theta": model.rope_theta,  # read by transformers 4.x
        "rope_parameters": {"rope_type": "default", "rope_theta": model.rope_theta},  # transformers 5
        "tie_word_embeddings": dims.tied,
        "dtype": dtype_name,
        "torch_dtype": dtype_name,
    }


def _replace_dir(tmp: Path, out: Path) -> None:
    """Move finished ``tmp`` to ``out``. An existing ``out`` is renamed aside first and removed
    after, so ``out`` is at every moment either the old complete export or the new one (or,
    between the two renames, absent)."""
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, old / out.name)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)


def export_hf(model_module: torch.nn.Module, model: ModelConfig, out_dir: str | os.PathLike,
              tokenizer_files: Optional[Mapping[str, bytes]] = None, *,
              extra_config: Optional[Mapping[str, Any]] = None) -> Path:
    """Write the actor as a HF Llama checkpoint: config.json + model.safetensors (+ tokenizer files).

    Written into a temp dir beside ``out_dir`` and moved into place, so a crash never leaves a
    half-written export. Tensors are saved contiguous, tied weights once, in the parameter dtype.
    ``extra_config`` adds non-shape keys to config.json (e.g. bos_token_id, eos_token_id).
    """
    _require_single_rank_layout()
    out = Path(out_dir)
    converted = megatron_to_hf(unwrap(model_module).state_dict(), model)
    tensors = {n: t.detach().contiguous() for n, t in converted.items()}
    dtypes = {t.dtype for t in tensors.values()}
    if len(dtypes) != 1:
        raise ValueError(f"exported tensors mix dtypes {sorted(map(str, dtypes))}; "
                         f"expected one parameter dtype")
    config = hf_config_dict(model, dtypes.pop())
    for key, value in (extra_config or {}).items():
        if key in config:
            raise ValueError(f"extra_config key {key!r} would override a shape field of config.json")
        config[key] = value
    files = dict(tokenizer_files or {})
    bad = [n for n in files if not _SAFE_NAME.match(n) or n in (CONFIG_FILE, SINGLE_FILE, INDEX_FILE)]
    if bad:
        raise ValueError(f"tokenizer file name(s) {bad} must be plain file names other than the model files")

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        save_file(tensors, str(tmp / SINGLE_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
