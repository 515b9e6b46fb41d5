"""Hugging Face Llama / Qwen2 / Qwen3 / Mistral checkpoints <-> megatron-core GPTModel (local layer
spec), any TP x PP. The tensor shapes on both sides are pfppo_mega.families.DecoderShape's
(``hf_shapes``, ``megatron_shapes``); the family comes from config.json.

Name map (layer i; H hidden, nh query heads, ng key/value groups, d = head_dim (H / nh unless
config.json sets it), F ffn):

    model.embed_tokens.weight                  [V, H]   embedding.word_embeddings.weight
    model.layers.i.input_layernorm.weight      [H]      decoder.layers.i.input_layernorm.weight
    model.layers.i.self_attn.{q,k,v}_proj      see QKV  decoder.layers.i.self_attention.linear_qkv.weight
    model.layers.i.self_attn.{q,k,v}_proj.bias see QKV  decoder.layers.i.self_attention.linear_qkv.bias (Qwen2)
    model.layers.i.self_attn.{q,k}_norm.weight [d]      decoder.layers.i.self_attention.{q,k}_layernorm.weight (Qwen3)
    model.layers.i.self_attn.o_proj.weight     [H, nh*d] decoder.layers.i.self_attention.linear_proj.weight
    model.layers.i.post_attention_layernorm    [H]      decoder.layers.i.pre_mlp_layernorm.weight
    model.layers.i.mlp.{gate,up}_proj.weight   [F, H]   decoder.layers.i.mlp.linear_fc1.weight = [gate; up]  [2F, H]
    model.layers.i.mlp.down_proj.weight        [H, F]   decoder.layers.i.mlp.linear_fc2.weight
    model.norm.weight                          [H]      decoder.final_layernorm.weight
    lm_head.weight (absent when tied)          [V, H]   output_layer.weight (absent when tied, pp = 1)

QKV: megatron views linear_qkv's output as [ng, (nh/ng + 2) * d], i.e. for each key/value group
g the rows are the group's nh/ng query heads, then its key head, then its value head:

    linear_qkv = stack_g [ q_proj[g*(nh/ng)*d : (g+1)*(nh/ng)*d]; k_proj[g*d:(g+1)*d]; v_proj[g*d:(g+1)*d] ]

(the q/k/v biases are fused the same way). Both sides use rotate-half RoPE, so q/k need no
permutation.

Layouts: the functions that take a model (``load_actor_from_hf``, ``gather_hf_weights``,
``export_hf``) work at the layout of megatron's parallel state. On import each rank reads only
the tensors of its pipeline stage and keeps its tensor-parallel slice (``reshard``: fused QKV
split by query groups, fc1 as cat(gate shard, up shard), o_proj / down_proj split on the input
dim, embedding / LM head split on the vocabulary padded to a multiple of tp with zero rows). A
tied LM head at pp > 1 is loaded into both the first stage's embedding and the last stage's
output_layer (megatron keeps them equal by all-reducing their gradients). On export the slices
are all-gathered over the tensor-parallel group and each stage's tensors broadcast over the
pipeline group, so every rank ends with the full HF tensors; rank 0 writes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from pfppo_mega.config.tree import ConfigError, ModelConfig
from pfppo_mega.families import (
    Architecture, DecoderShape, Head, ModelDirError, ModelFileMissing, architecture_from_hf,
)
from pfppo_mega.models import lora, reshard
from pfppo_mega.models.gpt import CriticModel, unwrap
from pfppo_mega.models.reshard import Split, Stage, fuse_qkv, split_qkv  # noqa: F401  (hf_io.fuse_qkv / split_qkv: their old home)

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


# ----------------------------------------------------------------------------- config


def _require_dir(path: str | os.PathLike) -> Path:
    p = Path(path)
    if not p.exists():
        raise ModelFileMissing(f"checkpoint directory {str(p)!r} does not exist")
    if not p.is_dir():
        raise ModelDirError(f"checkpoint path {str(p)!r} is not a directory")
    return p


def _read_json(file: Path) -> Any:
    try:
        return json.loads(file.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ModelDirError(f"{str(file)!r} is not valid JSON: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except (json.JSONDecodeError, RecursionError) as e:
        raise ModelDirError(f"{str(file)!r} is not valid JSON: {e}") from None
    except OSError as e:
        raise ModelDirError(f"{str(file)!r} cannot be read: {e.strerror or e}") from None


def read_hf_config(path: str | os.PathLike) -> dict:
    """The parsed config.json of checkpoint directory ``path``."""
    file = _require_dir(path) / CONFIG_FILE
    if not file.is_file():
        raise ModelFileMissing(f"{str(file)!r} is missing: a Hugging Face checkpoint needs {CONFIG_FILE}")
    cfg = _read_json(file)
    if not isinstance(cfg, dict):
        raise ModelDirError(f"{str(file)!r} must hold a JSON object, found {type(cfg).__name__}")
    return cfg


def qkv_bias_from_hf(hf_cfg: dict) -> bool:
    """True when the checkpoint's q/k/v projections carry biases (Qwen2)."""
    return architecture_from_hf(hf_cfg).qkv_bias


def model_config_from_hf(hf_cfg: dict, base: ModelConfig) -> ModelConfig:
    """``base`` with every unset (None) shape field filled from config.json.

    A field set in ``base`` must equal the checkpoint's value: ValueError lists every field that
    differs with both values. Unsupported architectures (pfppo_mega.families: other families,
    biases the family has none of, sliding windows narrower than the context, RoPE types other than
    default / linear / llama3, MoE) are rejected with the key, its value and what is supported.
    What is not a ModelConfig field (family, biases, q/k norms, head_dim, RoPE scaling) is
    ``architecture_from_hf(hf_cfg)``: build the models with it.
    """
    ckpt = DecoderShape.from_hf_config(hf_cfg).dimensions()
    mismatched = [
        f"  - {field}: config {getattr(base, field)!r}, checkpoint {value!r}"
        for field, value in ckpt.items()
        if getattr(base, field) is not None and getattr(base, field) != value
    ]
    if mismatched:
        raise ModelDirError("model config differs from the checkpoint's config.json:\n" + "\n".join(mismatched))
    fill = {field: value for field, value in ckpt.items() if getattr(base, field) is None}
    try:
        return dataclasses.replace(base, **fill)
    except ConfigError as e:  # ModelConfig's own rules, broken by what config.json gave: named by its keys
        hf_key = {name: key for key, name in ModelConfig.ALIASES.items() if name in fill}
        raise ModelDirError("config.json: " + "; ".join(
            f"{hf_key.get(p.key, p.key)} = {p.value!r}: {p.rule}" for p in e.problems)) from None


# ----------------------------------------------------------------------------- tensors on disk


class CheckpointReader:
    """The tensors of a safetensors checkpoint, read one at a time: model.safetensors, or the
    shards listed in model.safetensors.index.json (model-0000x-of-0000y.safetensors).

    ``shape`` and ``dtype`` read only the file headers, so a checkpoint can be checked before any
    data is read. ``get`` refuses a tensor holding NaN or inf. Every problem is a ModelDirError
    naming the file and the tensor.
    """

    def __init__(self, path: str | os.PathLike):
        root = _require_dir(path)
        self.root = root
        index, single = root / INDEX_FILE, root / SINGLE_FILE
        if index.is_file():
            parsed = _read_json(index)
            weight_map = parsed.get("weight_map") if isinstance(parsed, dict) else None
            if (not isinstance(weight_map, dict) or not weight_map
                    or not all(isinstance(f, str) and _SAFE_NAME.match(f) for f in weight_map.values())):
                raise ModelDirError(f"{str(index)!r} has no 'weight_map' object mapping tensor names to "
                                      f"shard file names in the same directory")
            files = sorted(set(weight_map.values()))
            absent = [f for f in files if not (root / f).is_file()]
            if absent:
                raise ModelFileMissing(f"shard file(s) listed in {INDEX_FILE} are missing from "
                                            f"{str(root)!r}: {', '.join(absent)}")
        elif single.is_file():
            files, weight_map = [SINGLE_FILE], None
        else:
            found = sorted(p.name for p in root.iterdir())
            raise ModelFileMissing(
                f"no {SINGLE_FILE} or {INDEX_FILE} in {str(root)!r} (found: {', '.join(found) or 'nothing'}); "
                f"only safetensors checkpoints are supported")
        self._handles = {f: self._open(root / f) for f in files}
        self._file_of: dict[str, str] = {}
        for f, handle in self._handles.items():
            for name in handle.keys():
                if name in self._file_of:
                    raise ModelDirError(f"tensor {name!r} is stored twice: in {self._file_of[name]!r} and {f!r}")
                self._file_of[name] = f
        if weight_map is not None:
            lost = sorted(n for n, f in weight_map.items() if self._file_of.get(n) != f)
            if lost:
                raise ModelDirError(f"tensor(s) listed in {INDEX_FILE} are absent from their shards: "
                                      f"{', '.join(lost[:10])}")

    @staticmethod
    def _open(file: Path) -> Any:
        size = file.stat().st_size
        try:
            return safe_open(str(file), framework="pt")
        except Exception as e:  # safetensors raises its own SafetensorError (an Exception) for a bad file
            raise ModelDirError(f"{str(file)!r} ({size} bytes) is not a readable safetensors file "
                                  f"(zero-byte, truncated or corrupt?): {e}") from None

    def _where(self, name: str) -> str:
        return str(self.root / self._file_of[name])

    def names(self) -> list[str]:
        return list(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self._file_of[name]].get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The safetensors dtype code of ``name`` (F32, BF16, F16, F64, I64, ...), from the header."""
        return str(self._handles[self._file_of[name]].get_slice(name).get_dtype())

    def get(self, name: str) -> Tensor:
        if name not in self._file_of:
            raise ModelDirError(f"checkpoint {str(self.root)!r} lacks tensor {name!r}")
        try:
            t = self._handles[self._file_of[name]].get_tensor(name)
        except Exception as e:  # SafetensorError for data that cannot be read
            raise ModelDirError(f"{self._where(name)!r}: tensor {name!r} cannot be read: {e}") from None
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise ModelDirError(f"{self._where(name)!r}: tensor {name!r} {tuple(t.shape)} holds {bad} NaN/inf "
                                  f"value(s); a checkpoint's weights must be finite")
        return t


def load_hf_state_dict(path: str | os.PathLike) -> dict[str, Tensor]:
    """All tensors of a checkpoint (see CheckpointReader)."""
    reader = CheckpointReader(path)
    return {name: reader.get(name) for name in reader.names()}


# ----------------------------------------------------------------------------- name / layout conversion


_IGNORED = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")  # old transformers' RoPE cache
FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")  # safetensors codes of the weight dtypes a checkpoint may use


def _check_shapes(found: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]],
                  what: str, *, tied: bool = False) -> None:
    """Every expected tensor present with its shape, and nothing else (a rotary cache, and a
    redundant lm_head.weight when the embeddings are tied, are ignored)."""
    missing = [n for n in expected if n not in found]
    if missing:
        more = " ..." if len(missing) > 10 else ""
        raise ModelDirError(f"{what} lacks tensor(s): {', '.join(missing[:10])}{more}")
    unexpected = [n for n in found if n not in expected and not _IGNORED.match(n)
                  and not (tied and n == "lm_head.weight")]
    if unexpected:
        more = " ..." if len(unexpected) > 10 else ""
        raise ModelDirError(
            f"{what} holds unexpected tensor(s) that config.json does not describe (more layers than "
            f"num_hidden_layers, biases or norms the family has none of?): {', '.join(sorted(unexpected)[:10])}{more}")
    wrong = [f"  - {n}: expected {tuple(expected[n])}, found {tuple(found[n])}"
             for n in expected if tuple(found[n]) != tuple(expected[n])]
    if wrong:
        raise ModelDirError(f"{what} has tensor(s) of the wrong shape:\n" + "\n".join(wrong))


def _check_dtypes(found: Mapping[str, str], what: str) -> None:
    wrong = [f"  - {n}: {d}" for n, d in found.items() if d not in FLOAT_DTYPES]
    if wrong:
        raise ModelDirError(f"{what} has tensor(s) of a non-floating dtype (weights must be one of "
                              f"{', '.join(FLOAT_DTYPES)}; integers would truncate):\n" + "\n".join(wrong[:10]))


def _shapes(sd: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    return {n: tuple(t.shape) for n, t in sd.items() if isinstance(t, Tensor)}


def _stage_shapes(shape: DecoderShape, vocab_rows: int, stage: Stage,
                  head: Optional[Head]) -> dict[str, tuple[int, ...]]:
    """Global megatron name -> full (tp = 1) shape of every parameter pipeline ``stage`` holds."""
    return shape.megatron_shapes(stage.layers, first=stage.first, last=stage.last, head=head, vocab_rows=vocab_rows)


_LAYER_NAME = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def _megatron_tensor(name: str, get: Callable[[str], Tensor], shape: DecoderShape, vocab_rows: int) -> Tensor:
    """Full (tp = 1, vocab padded to vocab_rows) megatron tensor ``name`` from HF tensors ``get``."""
    if name == "embedding.word_embeddings.weight":
        return reshard.pad_rows(get("model.embed_tokens.weight"), vocab_rows)
    if name == "output_layer.weight":
        head = "model.embed_tokens.weight" if shape.tie_word_embeddings else "lm_head.weight"
        return reshard.pad_rows(get(head), vocab_rows)
    if name == "decoder.final_layernorm.weight":
        return get("model.norm.weight")
    m = _LAYER_NAME.match(name)
    if m is None:
        raise KeyError(f"no HF tensor maps to megatron parameter {name!r}")
    p, suffix = f"model.layers.{m.group(1)}.", m.group(2)
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = suffix.rsplit(".", 1)[1]
        return fuse_qkv(*(get(f"{p}self_attn.{x}_proj.{kind}") for x in "qkv"),
                        heads=shape.num_attention_heads, groups=shape.num_query_groups)
    if suffix == "mlp.linear_fc1.weight":
        return torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")], dim=0)
    plain = {
        "input_layernorm.weight": "input_layernorm.weight",
        "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
        "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
        "mlp.linear_fc2.weight": "mlp.down_proj.weight",
        "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
        "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    }
    if suffix not in plain:
        raise KeyError(f"no HF tensor maps to megatron parameter {name!r}")
    return get(p + plain[suffix])


def _lm_head(*, tied_here: bool) -> Optional[Head]:
    """The actor's output_layer: None where it is the embedding itself."""
    return None if tied_here else "lm"


def hf_to_megatron(hf_sd: Mapping[str, Tensor], model: ModelConfig, *,
                   arch: Architecture = Architecture()) -> dict[str, Tensor]:
    """HF tensors of family ``arch`` -> GPTModel (tp = pp = 1) state dict. Checks every HF tensor's
    presence and shape; ignores rotary caches and, when tied, a redundant lm_head.weight."""
    shape = DecoderShape.from_model_config(model, arch)
    tied, vocab = shape.tie_word_embeddings, shape.vocab_size
    _check_shapes(_shapes(hf_sd), shape.hf_shapes(), "HF state dict", tied=tied)
    names = _stage_shapes(shape, vocab, Stage(0, 1, shape.num_layers), _lm_head(tied_here=tied))
    return {n: _megatron_tensor(n, hf_sd.__getitem__, shape, vocab) for n in names}


def _get(full: Mapping[str, Any], name: str) -> Tensor:
    if name not in full or not isinstance(full[name], Tensor):
        raise KeyError(f"megatron state dict lacks tensor {name!r}")
    return full[name]


def _hf_embedding(full: Mapping[str, Any], shape: DecoderShape) -> Iterator[tuple[str, Tensor]]:
    yield "model.embed_tokens.weight", _get(full, "embedding.word_embeddings.weight")[:shape.vocab_size]


def _hf_layer(i: int, full: Mapping[str, Any], shape: DecoderShape) -> Iterator[tuple[str, Tensor]]:
    """Decoder layer i's HF tensors from its full (tp = 1, global-name) megatron tensors."""
    heads, groups = shape.num_attention_heads, shape.num_query_groups
    p, m = f"model.layers.{i}.", f"decoder.layers.{i}."
    yield p + "input_layernorm.weight", _get(full, m + "input_layernorm.weight")
    q, k, v = split_qkv(_get(full, m + "self_attention.linear_qkv.weight"), heads=heads, groups=groups)
    yield p + "self_attn.q_proj.weight", q
    yield p + "self_attn.k_proj.weight", k
    yield p + "self_attn.v_proj.weight", v
    if shape.arch.qkv_bias:
        qb, kb, vb = split_qkv(_get(full, m + "self_attention.linear_qkv.bias"), heads=heads, groups=groups)
        yield p + "self_attn.q_proj.bias", qb
        yield p + "self_attn.k_proj.bias", kb
        yield p + "self_attn.v_proj.bias", vb
    if shape.arch.qk_norm:
        yield p + "self_attn.q_norm.weight", _get(full, m + "self_attention.q_layernorm.weight")
        yield p + "self_attn.k_norm.weight", _get(full, m + "self_attention.k_layernorm.weight")
    yield p + "self_attn.o_proj.weight", _get(full, m + "self_attention.linear_proj.weight")
    yield p + "post_attention_layernorm.weight", _get(full, m + "pre_mlp_layernorm.weight")
    gate, up = torch.chunk(_get(full, m + "mlp.linear_fc1.weight"), 2, dim=0)
    yield p + "mlp.gate_proj.weight", gate
    yield p + "mlp.up_proj.weight", up
    yield p + "mlp.down_proj.weight", _get(full, m + "mlp.linear_fc2.weight")


def _hf_final(full: Mapping[str, Any], shape: DecoderShape) -> Iterator[tuple[str, Tensor]]:
    yield "model.norm.weight", _get(full, "decoder.final_layernorm.weight")
    if not shape.tie_word_embeddings:
        yield "lm_head.weight", _get(full, "output_layer.weight")[:shape.vocab_size]


def _iter_megatron_to_hf(full: Mapping[str, Any], shape: DecoderShape) -> Iterator[tuple[str, Tensor]]:
    """Full (tp = 1, global-name) megatron tensors -> HF tensors, in HF order, vocab unpadded."""
    yield from _hf_embedding(full, shape)
    for i in range(shape.num_layers):
        yield from _hf_layer(i, full, shape)
    yield from _hf_final(full, shape)


def megatron_to_hf(mcore_sd: Mapping[str, Any], model: ModelConfig, *,
                   arch: Architecture = Architecture()) -> dict[str, Tensor]:
    """GPTModel (tp = pp = 1) state dict -> HF tensors; tied weights appear once (embed_tokens).
    ``_extra_state`` entries are ignored. Checks the resulting shapes against ``model``."""
    shape = DecoderShape.from_model_config(model, arch)
    out = dict(_iter_megatron_to_hf(mcore_sd, shape))
    _check_shapes(_shapes(out), shape.hf_shapes(), "converted megatron state dict")
    return out


# ----------------------------------------------------------------------------- the layout of this rank


@dataclasses.dataclass(frozen=True)
class _Layout:
    tp: int
    tp_rank: int
    tp_group: Optional[dist.ProcessGroup]
    stage: Stage
    pp_group: Optional[dist.ProcessGroup]
    pp_ranks: tuple[int, ...]  # global rank of each pipeline stage in this rank's pipeline group


def _current_layout(num_layers: int) -> _Layout:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return _Layout(1, 0, None, Stage(0, 1, num_layers), None, (0,))
    pp_group = ps.get_pipeline_model_parallel_group()
    pp = ps.get_pipeline_model_parallel_world_size()
    return _Layout(
        tp=ps.get_tensor_model_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_group=ps.get_tensor_model_parallel_group(),
        stage=Stage(ps.get_pipeline_model_parallel_rank(), pp, num_layers),
        pp_group=pp_group,
        pp_ranks=tuple(dist.get_process_group_ranks(pp_group)) if pp > 1 else (dist.get_rank(),),
    )


def _module_shape(module: torch.nn.Module, model: ModelConfig) -> DecoderShape:
    """The shape of ``model`` in the family the module was built as; an actor's tying must match the config."""
    target = unwrap(module)
    tied = bool(target.share_embeddings_and_output_weights)
    if not isinstance(target, CriticModel) and tied != bool(model.tie_word_embeddings):
        raise ValueError(f"the model was built with tied embeddings = {tied} but the model config says "
                         f"tie_word_embeddings = {model.tie_word_embeddings}")
    return DecoderShape.from_model_config(model, module_architecture(target))


# ----------------------------------------------------------------------------- into a model


def module_architecture(module: torch.nn.Module) -> Architecture:
    """The Architecture a model was built with (pfppo_mega.models.gpt records it)."""
    return unwrap(module).architecture


def _model_config_of(path: str | os.PathLike) -> tuple[ModelConfig, Architecture]:
    hf_cfg = read_hf_config(path)
    return model_config_from_hf(hf_cfg, ModelConfig()), architecture_from_hf(hf_cfg)


def _load_into(module: torch.nn.Module, path: str | os.PathLike, *,
               skip_prefixes: tuple[str, ...] = (), score_head: bool = False) -> ModelConfig:
    """Copy this rank's slice of checkpoint ``path`` into ``module``. Every check (architecture,
    checkpoint tensor shapes from the file headers, the model's parameter names and shapes)
    runs before any tensor data is read. ``score_head``: a sequence-classification checkpoint
    (trunk without LM head + ``score.weight`` [1, H]) into a critic's trunk and value head."""
    cfg, arch = _model_config_of(path)
    if score_head:  # no LM head to tie or load: the trunk's shapes plus the score head
        cfg = dataclasses.replace(cfg, tie_word_embeddings=True)
        skip_prefixes = ("output_layer.",)
    target = unwrap(module)
    built = module_architecture(target)
    if built != arch:
        raise ModelDirError(f"checkpoint {str(path)!r} is {arch} but the model was built as {built}; "
                              f"build it with arch=hf_io.architecture_from_hf(config.json)"
                              + (" (has q/k/v biases but the model was built with qkv_bias=False)"
                                 if arch.qkv_bias and not built.qkv_bias else ""))
    shape = DecoderShape.from_model_config(cfg, arch)
    tied = shape.tie_word_embeddings
    layout = _current_layout(shape.num_layers)
    reader = CheckpointReader(path)
    expected_hf = shape.hf_shapes()
    if score_head:
        expected_hf[CRITIC_HEAD] = (1, shape.hidden_size)
    _check_shapes({n: reader.shape(n) for n in reader.names()}, expected_hf,
                  f"checkpoint {str(path)!r}", tied=tied)
    _check_dtypes({n: reader.dtype(n) for n in reader.names() if not _IGNORED.match(n)}, f"checkpoint {str(path)!r}")
    if tied and "lm_head.weight" in reader.names() and not torch.equal(
            reader.get("lm_head.weight"), reader.get("model.embed_tokens.weight")):
        raise ModelDirError(f"checkpoint {str(path)!r}: config.json says tie_word_embeddings = true but "
                              f"lm_head.weight differs from model.embed_tokens.weight (the LM head would be "
                              f"silently replaced by the embedding); set tie_word_embeddings to false")
    vocab_rows = reshard.padded_vocab_size(shape.vocab_size, layout.tp)
    stage = layout.stage
    full_shapes = _stage_shapes(shape, vocab_rows, stage, _lm_head(tied_here=tied and stage.first))
    expected = {stage.to_local(n): (n, reshard.shard_shape(full, reshard.split_of(n), layout.tp))
                for n, full in full_shapes.items()}
    params = {n: p for n, p in target.named_parameters()
              if not n.startswith(skip_prefixes) and not lora.is_adapter(n)}  # adapters: not in an HF checkpoint
    expected = {n: v for n, v in expected.items() if not n.startswith(skip_prefixes)}
    missing = [n for n in params if n not in expected]
    if missing:
        raise ModelDirError(f"model parameter(s) have no tensor in the checkpoint (tied / untied mismatch?): "
                       f"{', '.join(missing)}")
    unused = [n for n in expected if n not in params]
    if unused:
        raise ModelDirError(f"checkpoint tensor(s) have no parameter in the model "
                         f"(tied / untied mismatch?): {', '.join(unused)}")
    wrong = [f"  - {n}: model expects {tuple(p.shape)}, checkpoint gives {expected[n][1]}"
             for n, p in params.items() if tuple(p.shape) != expected[n][1]]
    if wrong:
        raise ModelDirError("checkpoint tensor shape(s) do not match the model:\n" + "\n".join(wrong))
    with torch.no_grad():
        for name, param in params.items():
            global_name = expected[name][0]
            full = _megatron_tensor(global_name, reader.get, shape, vocab_rows)
            param.copy_(reshard.shard(full, reshard.split_of(global_name), layout.tp, layout.tp_rank))
        if score_head and stage.last:  # the value head is replicated over tensor-parallel ranks
            target.output_layer.weight.copy_(reader.get(CRITIC_HEAD))
    return cfg


def load_actor_from_hf(model_module: torch.nn.Module, path: str | os.PathLike) -> ModelConfig:
    """Copy checkpoint ``path`` into an actor built by build_actor, at any TP x PP layout (this
    rank's slice); returns the checkpoint's ModelConfig. Every parameter must be covered with the
    right shape (errors name the tensor, the expected and the found shape)."""
    return _load_into(model_module, path)


def load_critic_trunk_from_hf(critic_module: torch.nn.Module, path: str | os.PathLike) -> ModelConfig:
    """Copy checkpoint ``path`` into a critic's trunk; the value head keeps its (zero) init and
    the checkpoint's LM head is not used."""
    return _load_into(critic_module, path, skip_prefixes=("output_layer.",))


def load_score_model_from_hf(critic_module: torch.nn.Module, path: str | os.PathLike) -> ModelConfig:
    """Copy a one-label sequence-classification checkpoint (``*ForSequenceClassification``: the
    trunk without LM head, ``score.weight`` [1, H], no bias) into a critic built by build_critic:
    trunk and value head, at any TP x PP. Returns its ModelConfig (tie_word_embeddings is
    meaningless without an LM head and reads True). The caller checks num_labels and the
    architectures entry (pfppo_mega.rewards.model); a missing or misshapen score.weight or a
    score.bias is refused here too, by name (an lm_head.weight is ignored)."""
    if not isinstance(unwrap(critic_module), CriticModel):
        raise TypeError("load_score_model_from_hf loads into a CriticModel (gpt.build_critic)")
    return _load_into(critic_module, path, score_head=True)


# ----------------------------------------------------------------------------- out of a model


def _all_gather_tp(local: dict[str, Tensor], split_params: set[str], layout: _Layout) -> dict[str, Tensor]:
    """Full tensors from this rank's tensor-parallel slices (one all-gather of a flat buffer).
    split_params: the names megatron marks tensor_model_parallel; the rest are replicated."""
    names = [n for n in local if n in split_params]
    if layout.tp == 1 or not names:
        return dict(local)
    flat = torch.cat([local[n].reshape(-1) for n in names])
    gathered = [torch.empty_like(flat) for _ in range(layout.tp)]
    dist.all_gather(gathered, flat, group=layout.tp_group)
    out = dict(local)
    offset = 0
    for n in names:
        shape, numel = local[n].shape, local[n].numel()
        out[n] = reshard.unshard([g[offset:offset + numel].view(shape) for g in gathered], reshard.split_of(n))
        offset += numel
    return out


def _broadcast_stages(full: dict[str, Tensor], shape: DecoderShape, layout: _Layout, *, vocab_rows: int,
                      head: Optional[Head], dtype: torch.dtype, device: torch.device) -> dict[str, Tensor]:
    """Every stage's full tensors on every rank of the pipeline group: one broadcast per stage
    of a flat buffer whose layout all ranks derive from the config. ``head``: the last stage's
    output_layer to send (None for a tied LM head: the embedding stands for it)."""
    out = dict(full)
    for index, src in enumerate(layout.pp_ranks):
        stage = Stage(index, len(layout.pp_ranks), shape.num_layers)
        shapes = _stage_shapes(shape, vocab_rows, stage, head)
        numels = [math.prod(s) for s in shapes.values()]
        if index == layout.stage.index:
            flat = torch.cat([full[n].reshape(-1) for n in shapes])
        else:
            flat = torch.empty(sum(numels), dtype=dtype, device=device)
        dist.broadcast(flat, src=src, group=layout.pp_group)
        if index != layout.stage.index:
            for (name, size), piece in zip(shapes.items(), flat.split(numels)):
                out[name] = piece.view(size)
    return out


def _effective(target: torch.nn.Module, layout: _Layout) -> tuple[dict[str, Tensor], set[str]]:
    """Global name -> this rank's detached base tensor (LoRA-adapted weights merged, the adapters
    left out: models/lora.py), and the names split over tensor parallelism."""
    local, split = {}, set()
    for n, t, tp_split in lora.effective_parameters(target):
        name = layout.stage.to_global(n)
        local[name] = t
        if tp_split:
            split.add(name)
    return local, split


def _gather_full(module: torch.nn.Module, shape: DecoderShape) -> dict[str, Tensor]:
    """Global megatron name -> full (tp = 1, vocab padded) detached tensor, on every rank.
    At tp = pp = 1 these are views of the live parameters."""
    target = unwrap(module)
    layout = _current_layout(shape.num_layers)
    local, split_params = _effective(target, layout)
    dtypes = {t.dtype for t in local.values()}
    if len(dtypes) != 1:
        raise ValueError(f"model parameters mix dtypes {sorted(map(str, dtypes))}; expected one")
    full = _all_gather_tp(local, split_params, layout)
    if layout.stage.pp > 1:
        vocab_rows = reshard.padded_vocab_size(shape.vocab_size, layout.tp)
        head = "value" if isinstance(target, CriticModel) else _lm_head(tied_here=shape.tie_word_embeddings)
        full = _broadcast_stages(full, shape, layout, vocab_rows=vocab_rows, head=head,
                                 dtype=dtypes.pop(), device=next(iter(local.values())).device)
    return full


def gather_hf_weights(model_module: torch.nn.Module, model_cfg: ModelConfig) -> list[tuple[str, Tensor]]:
    """Every actor weight as (HF name, full tensor), in HF order, on every rank (collective over
    the tensor- and pipeline-parallel groups: all ranks of a model replica must call it).

    At tp = pp = 1 the tensors are detached views of the live parameters (q/k/v and gate/up are
    views into the fused megatron weights): copy them if kept across optimizer steps. Otherwise
    they are fresh. Tied weights appear once (embed_tokens); vocab padding is removed.
    """
    if isinstance(unwrap(model_module), CriticModel):
        raise TypeError("gather_hf_weights reads an actor; use gather_critic_weights for a CriticModel")
    shape = _module_shape(model_module, model_cfg)
    return list(_iter_megatron_to_hf(_gather_full(model_module, shape), shape))


CRITIC_HEAD = "score.weight"  # [1, H], transformers' name for a sequence / token classification head


def gather_critic_weights(critic_module: torch.nn.Module, model_cfg: ModelConfig) -> list[tuple[str, Tensor]]:
    """The critic's trunk under HF names (no LM head) plus its value head as ``score.weight``
    [1, H], on every rank (same collective and view semantics as gather_hf_weights)."""
    if not isinstance(unwrap(critic_module), CriticModel):
        raise TypeError("gather_critic_weights reads a CriticModel")
    shape = _module_shape(critic_module, model_cfg)
    full = _gather_full(critic_module, shape)
    trunk = list(_iter_megatron_to_hf(full, dataclasses.replace(shape, tie_word_embeddings=True)))  # no lm_head
    return trunk + [(CRITIC_HEAD, full["output_layer.weight"])]


def megatron_named_params_to_hf(model_module: torch.nn.Module,
                                model_cfg: ModelConfig) -> Iterator[tuple[str, Tensor]]:
    """Yield (HF name, tensor) for every actor weight, in HF order, for a rollout engine
    (gather_hf_weights as an iterator; the same view / copy semantics)."""
    yield from gather_hf_weights(model_module, model_cfg)


# ----------------------------------------------------------------------------- export


_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


def hf_config_dict(model: ModelConfig, dtype: torch.dtype, arch: Architecture = Architecture()) -> dict[str, Any]:
    """config.json contents of the ``arch.family`` CausalLM shaped as ``model`` (RoPE scaling,
    head_dim and the family's bias / window keys included, so architecture_from_hf reads ``arch`` back)."""
    dtype_name = _DTYPE_NAMES[dtype]
    return {**DecoderShape.from_model_config(model, arch).hf_config(), "dtype": dtype_name, "torch_dtype": dtype_name}


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


DEFAULT_SHARD_BYTES = 4 << 30  # an export larger than this is split into shards + index


class _ShardWriter:
    """Safetensors shards written as tensors arrive, in order: a shard is flushed once the next
    tensor would take it past ``limit`` bytes (a tensor larger than the limit gets its own shard).
    finish(): one shard -> model.safetensors; several -> model-0000x-of-0000y.safetensors and
    model.safetensors.index.json. Holds at most one shard on the host."""

    def __init__(self, folder: Path, limit: int) -> None:
        self.folder, self.limit = folder, limit
        self.pending: dict[str, Tensor] = {}
        self.size = self.total = 0
        self.files: list[str] = []
        self.weight_map: dict[str, str] = {}

    def add(self, name: str, t: Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if self.pending and self.size + nbytes > self.limit:
            self._flush()
        self.pending[name] = t
        self.size += nbytes
        self.total += nbytes

    def _flush(self) -> None:
        file = f".shard-{len(self.files):05d}.safetensors"
        save_file(self.pending, str(self.folder / file), metadata={"format": "pt"})
        self.weight_map.update({n: file for n in self.pending})
        self.files.append(file)
        self.pending, self.size = {}, 0

    def finish(self) -> None:
        if self.pending or not self.files:
            self._flush()
        if len(self.files) == 1:
            os.replace(self.folder / self.files[0], self.folder / SINGLE_FILE)
            return
        final = {f: f"model-{i + 1:05d}-of-{len(self.files):05d}.safetensors" for i, f in enumerate(self.files)}
        for f, name in final.items():
            os.replace(self.folder / f, self.folder / name)
        index = {"metadata": {"total_size": self.total}, "weight_map": {n: final[f] for n, f in self.weight_map.items()}}
        (self.folder / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _export_units(shape: DecoderShape, pp: int, vocab_rows: int):
    """(stage index, full megatron shapes, -> HF tensors) per unit of the export, in HF order:
    the embedding, each decoder layer, the final norm with the LM head (none when tied)."""
    per = shape.num_layers // pp
    yield 0, shape.megatron_shapes([], first=True, last=False, head=None, vocab_rows=vocab_rows), _hf_embedding
    for i in range(shape.num_layers):
        yield (i // per, shape.megatron_shapes([i], first=False, last=False, head=None),
               lambda full, shape, i=i: _hf_layer(i, full, shape))
    head = None if shape.tie_word_embeddings else "lm"
    yield pp - 1, shape.megatron_shapes([], first=False, last=True, head=head, vocab_rows=vocab_rows), _hf_final


def _dp_rank() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_rank() if ps.model_parallel_is_initialized() else 0


def _stream_units(module: torch.nn.Module, shape: DecoderShape, sink: Optional[Callable[[str, Tensor], None]]):
    """Every unit's full tensors, one unit at a time, to global rank 0 (which passes its HF tensors,
    on the host, to ``sink``; the other ranks pass None): the unit's stage all-gathers it over its
    tensor-parallel group, and that stage's tensor-parallel rank 0 sends it to rank 0. Only the
    first data-parallel replica takes part. Never more than one unit's full tensors on a device."""
    if _dp_rank() != 0:
        return
    target = unwrap(module)
    layout = _current_layout(shape.num_layers)
    local, split_params = _effective(target, layout)
    dtype, device = next(iter(local.values())).dtype, next(iter(local.values())).device
    rank = dist.get_rank() if dist.is_initialized() else 0
    vocab_rows = reshard.padded_vocab_size(shape.vocab_size, layout.tp)
    for index, shapes, to_hf in _export_units(shape, layout.stage.pp, vocab_rows):
        full = None
        if index == layout.stage.index:  # this stage holds the unit: gather it over TP
            full = _all_gather_tp({n: local[n] for n in shapes}, split_params, layout)
            if layout.tp_rank != 0:
                continue
            if rank != 0:
                dist.send(torch.cat([full[n].reshape(-1) for n in shapes]), dst=0)
                continue
        elif rank != 0:
            continue
        else:  # rank 0: the unit comes from the stage that holds it
            numels = [math.prod(x) for x in shapes.values()]
            flat = torch.empty(sum(numels), dtype=dtype, device=device)
            dist.recv(flat, src=layout.pp_ranks[index])
            full = {n: piece.view(size) for (n, size), piece in zip(shapes.items(), flat.split(numels))}
        for name, t in to_hf(full, shape):
            sink(name, _standalone(t.cpu()))


def _standalone(t: Tensor) -> Tensor:
    """A contiguous tensor owning its storage (safetensors refuses views sharing one)."""
    return t.clone(memory_format=torch.contiguous_format) if t._base is not None or not t.is_contiguous() else t


def export_hf(model_module: torch.nn.Module, model: ModelConfig, out_dir: str | os.PathLike,
              tokenizer_files: Optional[Mapping[str, bytes]] = None, *,
              extra_config: Optional[Mapping[str, Any]] = None,
              max_shard_bytes: Optional[int] = None) -> Path:
    """Write the actor as a HF checkpoint: config.json + weights (+ tokenizer files), from any layout.

    Collective when torch.distributed runs more than one rank: every rank calls it, the weights
    are gathered (gather_hf_weights), global rank 0 writes, and every rank returns once the write
    is done (or raises if it failed). Streamed: one unit (the embedding, a decoder layer, the
    final norm and head) at a time is gathered over its stage's tensor-parallel group and sent to
    rank 0, which writes it to the host shard it is filling -- never the whole model on one device
    or host. Written into a temp dir beside ``out_dir`` and moved into place, so a crash never
    leaves a half-written export. Weights go to model.safetensors, or to
    model-0000x-of-0000y.safetensors + model.safetensors.index.json when they exceed
    ``max_shard_bytes`` (default DEFAULT_SHARD_BYTES). Tied weights once, in the parameter dtype, vocab padding removed.
    ``extra_config`` adds non-shape keys to config.json (e.g. bos_token_id, eos_token_id).
    """
    out = Path(out_dir)
    if isinstance(unwrap(model_module), CriticModel):
        raise TypeError("export_hf writes an actor, got a CriticModel")
    shape = _module_shape(model_module, model)
    dtypes = {p.dtype for n, p in unwrap(model_module).named_parameters() if not lora.is_adapter(n)}
    if len(dtypes) != 1:
        raise ValueError(f"exported tensors mix dtypes {sorted(map(str, dtypes))}; "
                         f"expected one parameter dtype")
    config = hf_config_dict(model, dtypes.pop(), module_architecture(model_module))
    for key, value in (extra_config or {}).items():
        if key in config:
            raise ValueError(f"extra_config key {key!r} would override a shape field of config.json")
        config[key] = value
    files = dict(tokenizer_files or {})
    bad = [n for n in files if not _SAFE_NAME.match(n) or n in (CONFIG_FILE, SINGLE_FILE, INDEX_FILE)]
    if bad:
        raise ValueError(f"tokenizer file name(s) {bad} must be plain file names other than the model files")
    if max_shard_bytes is not None and max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes({max_shard_bytes}) must be >= 1 or None")

    distributed = dist.is_initialized() and dist.get_world_size() > 1
    writer = not distributed or dist.get_rank() == 0
    failure: Optional[BaseException] = None
    tmp, sink, shards = None, None, None
    if writer:
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
            os.chmod(tmp, 0o755)  # mkdtemp makes it private
            shards = _ShardWriter(tmp, max_shard_bytes or DEFAULT_SHARD_BYTES)
        except BaseException as e:  # re-raised below, after the other ranks have sent their units
            failure = e

    def write(name: str, t: Tensor) -> None:
        nonlocal failure
        if failure is None:  # after a failure the units are still received (no rank is left waiting)
            try:
                shards.add(name, t)
            except BaseException as e:
                failure = e

    _stream_units(model_module, shape, write if writer else None)
    if writer and failure is None:
        try:
            shards.finish()
            (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
            for name, data in files.items():
                (tmp / name).write_bytes(data)
            _replace_dir(tmp, out)
        except BaseException as e:
            failure = e
    if tmp is not None and failure is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    if distributed:
        status = [None if failure is None else f"{type(failure).__name__}: {failure}"]
        dist.broadcast_object_list(status, src=0)
        if status[0] is not None and failure is None:
            raise RuntimeError(f"HF export to {str(out)!r} failed on rank 0: {status[0]}")
    if failure is not None:
        raise failure
    return out
