"""LoRA on megatron's tensor-parallel linears (model.lora): adapters, merged weights, PEFT files.

A targeted linear y = x W^T keeps W frozen and learns y = x W^T + s * (x A^T) B^T, s = alpha / rank,
A [r, in], B [out, r]; B starts at zero, so step 0 computes the base model exactly. The adapters sit
on the decoder layers' four linears (constants.LORA_LINEARS): linear_qkv and linear_fc1 are fused
(q/k/v rows interleaved per query group; [gate; up]), and each takes ONE adapter over its whole
output, so q/k/v (gate/up) share A and own their rows of B. The config refuses a subset of a fused
linear's projections by name (config.tree.lora_target_problem).

Tensor parallelism (any TP; PP places whole layers, so it needs nothing):

    column-parallel (linear_qkv, linear_fc1): x [S, b, in] is whole on every rank
        A [r, in] replicated, B [out/tp, r] split like W's rows (GLU rows for fc1)
        h = x A^T [S, b, r] -> copy_to_tp (identity; backward all-reduces dL/dh, whose
        per-rank part covers only this rank's output rows) -> out_local = s * h B_local^T
    row-parallel (linear_proj, linear_fc2): x [S, b, in/tp] is this rank's slice
        A [r, in/tp] split like W's columns, B [out, r] replicated
        h = reduce_from_tp(x A_local^T) (all-reduce of the r-wide partial sums) -> s * h B^T

so A's (column) and B's (row) gradients come out whole and equal on every rank, as a replicated
parameter's must. The adapter is added by a forward hook on the linear (its output is (y, bias));
the base weights keep their names, and the adapters are parameters of the linear named
``lora_A`` / ``lora_B`` (``decoder.layers.3.mlp.linear_fc1.lora_B``), so checkpoints and the
distributed optimizer see them like any other parameter, and HF import / export and refit skip
them (``is_adapter``) and read ``merged`` weights instead: W + s * B A, formed on each rank from
its own shards (column: B_local A; row: B A_local), which are exactly the shards of the merged W.

Initialisation: A from a generator seeded per (seed, layer, linear), made whole and then cut to
this rank's shard, so every layout starts from the same adapter (the TP test compares TP1 with TP2).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch
from torch import Tensor

from pfppo_mega import constants as C
from pfppo_mega.config.tree import LoraConfig, lora_targets
from pfppo_mega.models import reshard

A_NAME, B_NAME = "lora_A", "lora_B"
_OWNER = {"linear_qkv": "self_attention", "linear_proj": "self_attention", "linear_fc1": "mlp", "linear_fc2": "mlp"}
_COLUMN = ("linear_qkv", "linear_fc1")  # the rest are row-parallel
HF_OWNER = {"linear_qkv": "self_attn", "linear_proj": "self_attn", "linear_fc1": "mlp", "linear_fc2": "mlp"}


class LoraError(ValueError):
    """A LoRA setting or adapter file that cannot be applied; names the key, tensor or file."""


@dataclass(frozen=True)
class LoraSpec:
    """What the actor's adapters are: rank, scale numerator, the megatron linears, exclusions, init."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    exclude: tuple[str, ...] = ()
    init_a: str = "kaiming"

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def of(cls, cfg: LoraConfig) -> "LoraSpec":
        return cls(rank=cfg.rank, alpha=float(cfg.alpha), targets=lora_targets(list(cfg.target_modules)),
                   exclude=tuple(cfg.exclude_modules), init_a=cfg.init_a)

    def excluded(self, layer: int, linear: str) -> bool:
        names = [f"decoder.layers.{layer}.{_OWNER[linear]}.{linear}",
                 *(f"model.layers.{layer}.{HF_OWNER[linear]}.{p}" for p in C.LORA_HF_PARTS[linear])]
        hits = [any(re.search(pat, n) for pat in self.exclude) for n in names]
        if hits[0] or all(hits[1:]):
            return True
        if any(hits[1:]):
            raise LoraError(f"model.lora.exclude_modules {list(self.exclude)} excludes part of the fused "
                            f"{names[0]} ({', '.join(n for n, h in zip(names[1:], hits[1:]) if h)}): its one "
                            f"adapter covers {', '.join(C.LORA_HF_PARTS[linear])}; exclude all of them or none")
        return False


def is_adapter(name: str) -> bool:
    """Whether parameter ``name`` (any prefix) is a LoRA adapter."""
    return name.endswith("." + A_NAME) or name.endswith("." + B_NAME)


# ----------------------------------------------------------------------------- attaching


def _parallel_mode(linear: str) -> str:
    return "column" if linear in _COLUMN else "row"


def _init_a(shape: tuple[int, int], how: str, seed: int) -> Tensor:
    """A [r, in] in fp32 on the host, the same on every rank and layout."""
    g = torch.Generator().manual_seed(seed)
    r, fan_in = shape
    bound = 1.0 / math.sqrt(fan_in) if how == "kaiming" else math.sqrt(6.0 / (r + fan_in))  # kaiming a=sqrt(5)
    return (torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1).mul_(bound).float()


def _set_tp(param: torch.nn.Parameter, dim: Optional[int]) -> None:
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    if dim is not None:
        set_tensor_model_parallel_attributes(param, True, dim, 1)


def _layers(model: torch.nn.Module):
    """(global layer index, TransformerLayer) of this pipeline stage."""
    from pfppo_mega.models.gpt import unwrap

    for layer in unwrap(model).decoder.layers:
        yield layer.layer_number - 1, layer


def adapted(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """(local module name, linear) of every linear of ``model`` that carries an adapter."""
    from pfppo_mega.models.gpt import unwrap

    for name, module in unwrap(model).named_modules():
        if getattr(module, "lora_scale", None) is not None:
            yield name, module


def attach(model: torch.nn.Module, spec: LoraSpec, *, seed: int) -> int:
    """Put adapters on ``spec.targets`` of every decoder layer of this stage (an unwrapped GPTModel,
    before megatron DDP wraps it) and freeze every other parameter. Returns the number of adapters."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    rank = ps.get_tensor_model_parallel_rank() if ps.model_parallel_is_initialized() else 0
    if getattr(model.config, "sequence_parallel", False):
        raise LoraError("model.lora with parallel.sequence_parallel = true: the adapters take the whole "
                        "sequence; set parallel.sequence_parallel false")
    for p in model.parameters():
        p.requires_grad_(False)
    model.lora_spec = spec  # read by spec_of (exports)
    count = 0
    for index, layer in _layers(model):
        for t, linear in enumerate(spec.targets):
            if spec.excluded(index, linear):
                continue
            module = getattr(getattr(layer, _OWNER[linear]), linear)
            _attach_one(module, linear, spec, seed=seed * 1_000_003 + index * 16 + t, tp=tp, rank=rank)
            count += 1
    return count


def _attach_one(module: torch.nn.Module, linear: str, spec: LoraSpec, *, seed: int, tp: int, rank: int) -> None:
    w = module.weight                                              # [out/tp, in] or [out, in/tp]
    column = _parallel_mode(linear) == "column"
    out_full = w.shape[0] * (tp if column else 1)
    in_full = w.shape[1] * (1 if column else tp)
    a_full = _init_a((spec.rank, in_full), spec.init_a, seed)      # [r, in]
    split_a = reshard.Split.REPLICATED if column else reshard.Split.COLUMNS
    a = reshard.shard(a_full, split_a, tp, rank).to(device=w.device, dtype=w.dtype).contiguous()
    b = torch.zeros(out_full // tp if column else out_full, spec.rank, device=w.device, dtype=w.dtype)
    module.lora_A = torch.nn.Parameter(a)                         # [r, in] / [r, in/tp]
    module.lora_B = torch.nn.Parameter(b)                         # [out/tp, r] / [out, r]
    _set_tp(module.lora_A, None if column else 1)
    _set_tp(module.lora_B, 0 if column else None)
    module.lora_scale = spec.scale
    module.lora_mode = _parallel_mode(linear)
    module.lora_on = True
    module.register_forward_hook(_add_adapter)


def _add_adapter(module: torch.nn.Module, args: tuple, output):
    """Forward hook: (y, bias) -> (y + s * adapter(x), bias)."""
    if not module.lora_on:
        return None
    from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                        reduce_from_tensor_model_parallel_region)

    x = args[0]                                                    # [S, b, in] or [S, b, in/tp]
    y, bias = output
    h = torch.matmul(x, module.lora_A.t())                         # [S, b, r] (row: partial over tp)
    if module.lora_mode == "column":
        h = copy_to_tensor_model_parallel_region(h)
    else:
        h = reduce_from_tensor_model_parallel_region(h)
    return y + torch.matmul(h, module.lora_B.t()) * module.lora_scale, bias   # [S, b, out(/tp)]


@contextlib.contextmanager
def adapters_off(model: torch.nn.Module) -> Iterator[None]:
    """Within it, ``model`` computes its base weights alone (the reference policy)."""
    modules = [m for _, m in adapted(model)]
    for m in modules:
        m.lora_on = False
    try:
        yield
    finally:
        for m in modules:
            m.lora_on = True


def has_adapters(model: torch.nn.Module) -> bool:
    return next(adapted(model), None) is not None


def spec_of(model: torch.nn.Module) -> Optional[LoraSpec]:
    """The LoraSpec ``attach`` applied to ``model`` (any wrapper), or None."""
    from pfppo_mega.models.gpt import unwrap

    return getattr(unwrap(model), "lora_spec", None)


# ----------------------------------------------------------------------------- merged weights


def merged(module: torch.nn.Module) -> Tensor:
    """This rank's shard of W + s * B A (W's shape and dtype; computed in fp32); W itself while the
    adapters are off (``adapters_off``)."""
    w = module.weight.detach()
    if not module.lora_on:
        return w
    delta = module.lora_B.detach().float() @ module.lora_A.detach().float()   # [out(/tp), in(/tp)]
    return (w.float() + module.lora_scale * delta).to(w.dtype)


def effective_parameters(model: torch.nn.Module) -> Iterator[tuple[str, Tensor, bool]]:
    """(local name, detached tensor, tensor_model_parallel) of every base parameter of the unwrapped
    model, adapted weights merged; the adapters themselves left out. Without adapters: the parameters."""
    from pfppo_mega.models.gpt import unwrap

    target = unwrap(model)
    merged_of = {f"{n}.weight": m for n, m in adapted(target)}
    for name, p in target.named_parameters():
        if is_adapter(name):
            continue
        t = merged(merged_of[name]) if name in merged_of else p.detach()
        yield name, t, bool(getattr(p, "tensor_model_parallel", False))


def adapter_numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if is_adapter(n))


# ----------------------------------------------------------------------------- PEFT files

PEFT_WEIGHTS, PEFT_CONFIG = "adapter_model.safetensors", "adapter_config.json"
_PEFT_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.(lora_A|lora_B)"
                       r"(?:\.default)?\.weight$")


def read_peft_config(path: str | Path) -> dict:
    """adapter_config.json of a PEFT adapter directory (LoraError names what is wrong)."""
    d = Path(path)
    cfg_file, weights = d / PEFT_CONFIG, d / PEFT_WEIGHTS
    if not d.is_dir():
        raise LoraError(f"model.lora.adapter_path = {str(path)!r}: no such directory")
    for f in (cfg_file, weights):
        if not f.is_file():
            raise LoraError(f"model.lora.adapter_path = {str(path)!r}: {f.name} missing (a PEFT adapter has "
                            f"{PEFT_CONFIG} and {PEFT_WEIGHTS})")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoraError(f"{cfg_file}: not readable JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise LoraError(f"{cfg_file}: must hold a JSON object")
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise LoraError(f"{cfg_file}: peft_type = {cfg.get('peft_type')!r}; only LORA adapters load here")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise LoraError(f"{cfg_file}: r = {r!r} must be a positive int")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not alpha > 0:
        raise LoraError(f"{cfg_file}: lora_alpha = {alpha!r} must be a positive number")
    for key, off in (("use_rslora", False), ("use_dora", False), ("bias", "none"), ("fan_in_fan_out", False)):
        if cfg.get(key, off) not in (off, None):
            raise LoraError(f"{cfg_file}: {key} = {cfg[key]!r} is not supported here (only {off!r})")
    return cfg


def spec_for(cfg: LoraConfig) -> LoraSpec:
    """The spec of the run: the config's, or (rank 0 with an adapter_path) the adapter file's rank,
    alpha and target_modules. A config rank that differs from the file's is refused by name."""
    if cfg.adapter_path is None:
        return LoraSpec.of(cfg)
    peft = read_peft_config(cfg.adapter_path)
    if cfg.rank and cfg.rank != peft["r"]:
        raise LoraError(f"model.lora.rank = {cfg.rank} but the adapter {cfg.adapter_path!r} has r = {peft['r']}; "
                        f"set model.lora.rank to {peft['r']} (or 0 to take the adapter's)")
    if cfg.rank:
        return LoraSpec.of(cfg)
    targets = peft.get("target_modules") or [C.LORA_ALL]
    targets = [targets] if isinstance(targets, str) else list(targets)
    try:
        resolved = lora_targets(targets)
    except ValueError as e:
        raise LoraError(f"{cfg.adapter_path}/{PEFT_CONFIG}: {e}") from None
    exclude = peft.get("exclude_modules") or []
    exclude = [exclude] if isinstance(exclude, str) else list(exclude)
    return LoraSpec(rank=peft["r"], alpha=float(peft["lora_alpha"]), targets=resolved,
                    exclude=tuple(cfg.exclude_modules) + tuple(exclude), init_a=cfg.init_a)


def _parts_of(full: Tensor, linear: str, heads: int, groups: int) -> list[Tensor]:
    """The per-projection rows of a fused output [out, ...] (q, k, v / gate, up / the whole)."""
    if linear == "linear_qkv":
        return list(reshard.split_qkv(full, heads=heads, groups=groups))
    if linear == "linear_fc1":
        return list(full.chunk(2, dim=0))
    return [full]


def _part_rows(out: int, linear: str, heads: int, groups: int) -> list[int]:
    """Rows of each projection in a fused output of ``out`` rows."""
    if linear == "linear_qkv":
        d = out // (heads + 2 * groups)
        return [heads * d, groups * d, groups * d]
    return [out // 2] * 2 if linear == "linear_fc1" else [out]


def _fuse(parts: list[Tensor], linear: str, heads: int, groups: int) -> Tensor:
    if linear == "linear_qkv":
        return reshard.fuse_qkv(*parts, heads=heads, groups=groups)
    return torch.cat(parts, dim=0)


def peft_tensors(full: dict[str, Tensor], *, heads: int, groups: int) -> dict[str, Tensor]:
    """PEFT's adapter tensors from whole (tp = 1) adapters keyed by global megatron name
    (``decoder.layers.3.mlp.linear_fc1.lora_B``): each projection gets the shared A and its rows of B."""
    out: dict[str, Tensor] = {}
    for name, t in full.items():
        m = re.match(r"^decoder\.layers\.(\d+)\.\w+\.(\w+)\.(lora_A|lora_B)$", name)
        layer, linear, which = int(m.group(1)), m.group(2), m.group(3)
        parts = C.LORA_HF_PARTS[linear]
        pieces = [t] * len(parts) if which == A_NAME else _parts_of(t, linear, heads, groups)
        for part, piece in zip(parts, pieces):
            key = f"base_model.model.model.layers.{layer}.{HF_OWNER[linear]}.{part}.{which}.weight"
            out[key] = piece.contiguous().clone()
    return out


def fused_from_peft(tensors: dict[str, Tensor], spec: LoraSpec, *, num_layers: int, heads: int, groups: int,
                    shapes: dict[str, tuple[int, int]], where: str) -> dict[str, Tensor]:
    """Whole adapters keyed by global megatron name from PEFT tensors; LoraError names every key that is
    missing, unknown or misshapen, a rank other than spec.rank, and fused parts whose A differ.
    ``shapes``: linear -> (out, in) of the whole base weight."""
    by_key: dict[tuple[int, str, str], Tensor] = {}
    unknown = []
    for key, t in tensors.items():
        m = _PEFT_KEY.match(key)
        if m is None:
            unknown.append(key)
            continue
        by_key[(int(m.group(1)), m.group(3), m.group(4))] = t
    if unknown:
        raise LoraError(f"{where}: tensor(s) that are no LoRA adapter of a decoder linear: {unknown[:6]}"
                        + (f" ... {len(unknown) - 6} more" if len(unknown) > 6 else ""))
    wanted = [(i, linear) for i in range(num_layers) for linear in spec.targets if not spec.excluded(i, linear)]
    missing = [f"layer {i} {part}.{w}" for i, linear in wanted for part in C.LORA_HF_PARTS[linear]
               for w in (A_NAME, B_NAME) if (i, part, w) not in by_key]
    if missing:
        raise LoraError(f"{where}: missing adapter tensor(s) for the targets {list(spec.targets)}: {missing[:6]}"
                        + (f" ... {len(missing) - 6} more" if len(missing) > 6 else ""))
    expected_keys = {(i, part, w) for i, linear in wanted for part in C.LORA_HF_PARTS[linear] for w in (A_NAME, B_NAME)}
    extra = sorted(set(by_key) - expected_keys)
    if extra:
        raise LoraError(f"{where}: adapter tensor(s) outside the targets {list(spec.targets)} (layers 0.."
                        f"{num_layers - 1}): {[f'layer {i} {p}.{w}' for i, p, w in extra[:6]]}")
    out: dict[str, Tensor] = {}
    for i, linear in wanted:
        out_full, in_full = shapes[linear]
        parts = C.LORA_HF_PARTS[linear]
        b_rows = _part_rows(out_full, linear, heads, groups)
        a_list = [by_key[(i, p, A_NAME)] for p in parts]
        b_list = [by_key[(i, p, B_NAME)] for p in parts]
        for p, a, b, rows in zip(parts, a_list, b_list, b_rows):
            if a.dim() != 2 or b.dim() != 2:
                raise LoraError(f"{where}: layer {i} {p}: lora_A / lora_B must be 2-D, got {tuple(a.shape)} / "
                                f"{tuple(b.shape)}")
            if a.shape[0] != spec.rank or b.shape[1] != spec.rank:
                raise LoraError(f"{where}: layer {i} {p}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} are not "
                                f"of rank {spec.rank} (the run's: lora_A [r, in], lora_B [out, r])")
            if a.shape[1] != in_full or b.shape[0] != rows:
                raise LoraError(f"{where}: layer {i} {p}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)}, the "
                                f"base model wants ({spec.rank}, {in_full}) / ({rows}, {spec.rank})")
        if any(not torch.equal(a_list[0], a) for a in a_list[1:]):
            raise LoraError(f"{where}: layer {i}: {', '.join(parts)} have different lora_A; here megatron's fused "
                            f"{linear} takes one adapter whose A they share (as this trainer's own exports write); "
                            f"merge the adapter into the base (PEFT's merge_and_unload) and train from that")
        prefix = f"decoder.layers.{i}.{_OWNER[linear]}.{linear}"
        out[f"{prefix}.{A_NAME}"] = a_list[0].float()
        out[f"{prefix}.{B_NAME}"] = _fuse([b.float() for b in b_list], linear, heads, groups)
    return out


def base_shapes(model_cfg, head_dim: int) -> dict[str, tuple[int, int]]:
    """linear -> (out, in) of the whole base weight of a decoder layer."""
    h, f = model_cfg.hidden_size, model_cfg.ffn_hidden_size
    heads, groups = model_cfg.num_attention_heads, model_cfg.num_query_groups
    return {"linear_qkv": ((heads + 2 * groups) * head_dim, h), "linear_proj": (h, heads * head_dim),
            "linear_fc1": (2 * f, h), "linear_fc2": (h, f)}


def load_adapters(model: torch.nn.Module, full: dict[str, Tensor]) -> None:
    """Copy whole adapters (global megatron names) into this rank's shards of ``model``'s adapters."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    rank = ps.get_tensor_model_parallel_rank() if ps.model_parallel_is_initialized() else 0
    with torch.no_grad():
        for index, layer in _layers(model):
            for linear, owner in _OWNER.items():
                module = getattr(getattr(layer, owner), linear)
                if getattr(module, "lora_scale", None) is None:
                    continue
                prefix = f"decoder.layers.{index}.{owner}.{linear}"
                for which in (A_NAME, B_NAME):
                    name = f"{prefix}.{which}"
                    piece = reshard.shard(full[name], reshard.split_of(name), tp, rank)
                    getattr(module, which).copy_(piece)


def write_peft(out_dir: str | Path, tensors: dict[str, Tensor], spec: LoraSpec, *, base: str = "") -> None:
    """adapter_model.safetensors + adapter_config.json (PEFT's LoRA layout) into ``out_dir``."""
    from safetensors.torch import save_file

    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / PEFT_WEIGHTS))
    targets = [p for linear in spec.targets for p in C.LORA_HF_PARTS[linear]]
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank, "lora_alpha": spec.alpha,
           "target_modules": targets, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
           "use_rslora": False, "base_model_name_or_path": base}
    if spec.exclude:  # PEFT's key: a regular expression over module names (ours joined as alternatives)
        cfg["exclude_modules"] = "|".join(f"(?:{p})" for p in spec.exclude)
    (d / PEFT_CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")


def read_peft_tensors(path: str | Path) -> dict[str, Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    f = Path(path) / PEFT_WEIGHTS
    try:
        return load_file(str(f))
    except (SafetensorError, OSError, ValueError) as e:
        raise LoraError(f"{f}: not a readable safetensors file ({e})") from None


def _dims(model: torch.nn.Module) -> tuple[int, int, int, dict[str, tuple[int, int]]]:
    """(num_layers, heads, groups, linear -> whole (out, in)) of an unwrapped GPTModel."""
    c = model.config
    heads, groups, d = c.num_attention_heads, c.num_query_groups or c.num_attention_heads, c.kv_channels
    shapes = {"linear_qkv": ((heads + 2 * groups) * d, c.hidden_size), "linear_proj": (c.hidden_size, heads * d),
              "linear_fc1": (2 * c.ffn_hidden_size, c.hidden_size), "linear_fc2": (c.hidden_size, c.ffn_hidden_size)}
    return c.num_layers, heads, groups, shapes


def load_peft(model: torch.nn.Module, path: str | Path, spec: LoraSpec) -> None:
    """Load PEFT adapter directory ``path`` into the adapters ``attach`` put on ``model`` (every check
    before any copy; LoraError names the key, the shapes or the rank)."""
    from pfppo_mega.models.gpt import unwrap

    target = unwrap(model)
    layers, heads, groups, shapes = _dims(target)
    full = fused_from_peft(read_peft_tensors(path), spec, num_layers=layers, heads=heads, groups=groups,
                           shapes=shapes, where=f"model.lora.adapter_path {str(path)!r}")
    load_adapters(target, full)


def apply(model: torch.nn.Module, cfg: LoraConfig, *, seed: int) -> Optional[LoraSpec]:
    """model.lora on a freshly loaded actor (unwrapped, before wrap_ddp): adapters on, the base frozen,
    the adapter_path loaded. None (and nothing changed) when LoRA is off."""
    if not cfg.enabled:
        return None
    spec = spec_for(cfg)
    attach(model, spec, seed=seed)
    if cfg.adapter_path is not None:
        load_peft(model, cfg.adapter_path, spec)
    return spec


def gather_adapters(model: torch.nn.Module) -> dict[str, Tensor]:
    """Whole adapters keyed by global megatron name, on every rank of the model replica (collective over
    the tensor- and pipeline-parallel groups, like hf_io.gather_hf_weights)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from pfppo_mega.models.gpt import unwrap

    target = unwrap(model)
    on = ps.model_parallel_is_initialized()
    tp = ps.get_tensor_model_parallel_world_size() if on else 1
    pp = ps.get_pipeline_model_parallel_world_size() if on else 1
    local = {}
    for i, layer in _layers(target):
        for linear, owner in _OWNER.items():
            module = getattr(getattr(layer, owner), linear)
            if getattr(module, "lora_scale", None) is not None:
                for which in (A_NAME, B_NAME):
                    local[f"decoder.layers.{i}.{owner}.{linear}.{which}"] = getattr(module, which).detach()
    full = {}
    for name, t in local.items():
        split = reshard.split_of(name)
        if tp > 1 and split is not reshard.Split.REPLICATED:
            pieces = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(pieces, t.contiguous(), group=ps.get_tensor_model_parallel_group())
            t = reshard.unshard(pieces, split)
        full[name] = t.float().clone()
    if pp > 1:  # every stage's adapters on every rank of the pipeline group
        gathered: list = [None] * pp
        dist.all_gather_object(gathered, {k: v.cpu() for k, v in full.items()},
                               group=ps.get_pipeline_model_parallel_group())
        full = {k: v for part in gathered for k, v in part.items()}
    return full


def export_peft(model: torch.nn.Module, spec: LoraSpec, out_dir: str | Path, *, base: str = "") -> None:
    """Write ``model``'s adapters as a PEFT adapter directory (collective; global rank 0 writes)."""
    import torch.distributed as dist

    from pfppo_mega.models.gpt import unwrap

    _, heads, groups, _ = _dims(unwrap(model))
    full = gather_adapters(model)
    if not dist.is_initialized() or dist.get_rank() == 0:
        write_peft(out_dir, {k: v.cpu() for k, v in peft_tensors(full, heads=heads, groups=groups).items()}, spec,
                   base=base)
    if dist.is_initialized():
        dist.barrier()
