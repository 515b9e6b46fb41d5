"""The model families a Hugging Face checkpoint may come from, read from its config.json.

Imports only torch and the standard library, so the trainer's models (``pfppo_mega.models``),
the built-in rollout engine (``pfppo_mega.rollout.llama``) and the memory planner read one
description of a checkpoint: ``Architecture``. Everything outside it is refused with the key,
its value and what is supported (``CheckpointError``), never approximated.

Supported, all pre-norm decoders with RMSNorm, SwiGLU MLP, rotate-half RoPE and grouped-query
attention, no biases other than those named:

    family   model_type  q/k/v bias  q/k RMSNorm  head_dim             sliding window
    llama    llama       no          no           any (default H/nh)   -
    qwen2    qwen2       yes         no           H/nh                 off, or >= the context
    qwen3    qwen3       no          yes          any (explicit)       off, or >= the context
    mistral  mistral     no          no           any (default H/nh)   null, or >= the context

RoPE (``rope_scaling`` / ``rope_parameters``): ``default``; ``linear`` (inv_freq / factor);
``llama3`` (Llama-3.1 / 3.3: low-frequency bands divided by ``factor``, high ones kept, a smooth
ramp between, set by ``low_freq_factor``, ``high_freq_factor`` and
``original_max_position_embeddings``). ``dynamic`` NTK is refused: its frequencies depend on
the length of the current batch, so a token's log-prob would change with padding and the
KV cache would mix two RoPE bases. ``yarn`` / ``longrope`` (they also rescale attention) and
MoE configs are refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch


class CheckpointError(ValueError):
    """A model directory that cannot be loaded as it is. The message names the file, the key or
    tensor, the value found and what is expected."""


class CheckpointFileMissing(CheckpointError, FileNotFoundError):
    """A file the checkpoint needs is absent (also a FileNotFoundError)."""


FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mistral": "MistralForCausalLM"}
ROPE_TYPES = ("default", "linear", "llama3")
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size",
             "num_experts_per_tok")


# ----------------------------------------------------------------------------- typed values


def positive_int(hf: dict, key: str, *, file: str = "config.json") -> int:
    value = hf[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CheckpointError(f"{file}: {key} = {value!r}: must be a positive integer")
    return value


def positive_float(hf: dict, key: str, *, file: str = "config.json", where: str = "") -> float:
    value = hf[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise CheckpointError(f"{file}: {where}{key} = {value!r}: must be a finite number > 0")
    return float(value)


def boolean(hf: dict, key: str, *, file: str = "config.json") -> bool:
    value = hf[key]
    if not isinstance(value, bool):
        raise CheckpointError(f"{file}: {key} = {value!r}: must be true or false")
    return value


# ----------------------------------------------------------------------------- RoPE


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE's inverse frequencies are scaled (see the module docstring)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: Optional[int] = None

    def hf_parameters(self, theta: float) -> dict[str, Any]:
        """The config.json ``rope_parameters`` (transformers 5) of this scaling."""
        out: dict[str, Any] = {"rope_type": self.rope_type, "rope_theta": theta}
        if self.rope_type in ("linear", "llama3"):
            out["factor"] = self.factor
        if self.rope_type == "llama3":
            out.update(low_freq_factor=self.low_freq_factor, high_freq_factor=self.high_freq_factor,
                       original_max_position_embeddings=self.original_max_position_embeddings)
        return out


def rope_inv_freq(head_dim: int, theta: float, rope: RopeScaling = RopeScaling(), *,
                  device: Optional[torch.device] = None) -> torch.Tensor:
    """inverse frequencies [head_dim / 2] (fp32, as transformers and megatron compute them):

        f_i = theta^(-2i / D)
        linear:  f_i / factor
        llama3:  wavelength w_i = 2 pi / f_i; with lo = orig / low_freq_factor and
                 hi = orig / high_freq_factor: w_i < hi keeps f_i, w_i > lo gives f_i / factor,
                 between them (1 - s) f_i / factor + s f_i with s = (orig / w_i - low) / (high - low)
    """
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv = 1.0 / (theta ** exponent)  # [D/2]
    if rope.rope_type == "linear":
        return inv / rope.factor
    if rope.rope_type == "llama3":
        orig, low, high, factor = (rope.original_max_position_embeddings, rope.low_freq_factor,
                                   rope.high_freq_factor, rope.factor)
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > orig / low, inv / factor, inv)
        smooth = (orig / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= orig / high) & (wavelen <= orig / low)
        return torch.where(medium, smoothed, scaled)
    return inv


# ----------------------------------------------------------------------------- the architecture


@dataclass(frozen=True)
class Architecture:
    """What a checkpoint's config.json says beyond the shapes of pfppo_mega's ModelConfig.

    head_dim: None = hidden_size / num_attention_heads. The default is plain Llama."""

    family: str = "llama"
    qkv_bias: bool = False
    qk_norm: bool = False
    head_dim: Optional[int] = None
    rope: RopeScaling = RopeScaling()

    def head_dim_of(self, hidden_size: int, num_attention_heads: int) -> int:
        return self.head_dim if self.head_dim is not None else hidden_size // num_attention_heads

    def hf_fields(self) -> dict[str, Any]:
        """config.json keys (besides the shapes and RoPE) that tell transformers this family."""
        out: dict[str, Any] = {"architectures": [ARCHITECTURES[self.family]], "model_type": self.family,
                               "hidden_act": "silu"}
        if self.family in ("llama", "qwen3", "mistral"):
            out["attention_bias"] = False
        if self.family == "llama":
            out["mlp_bias"] = False
        if self.family in ("qwen2", "qwen3"):
            out["use_sliding_window"] = False
        if self.family == "mistral":
            out["sliding_window"] = None
        return out


def _rope_from_hf(hf: dict, problems: list[str]) -> tuple[Any, RopeScaling]:
    """(rope_theta as found, RopeScaling) from transformers 5 ``rope_parameters`` or 4.x
    ``rope_theta`` + ``rope_scaling``; unsupported types and bad values go to ``problems``."""
    src: dict[str, Any] = {}
    types = {}
    for key in ("rope_scaling", "rope_parameters"):
        value = hf.get(key)
        if value is not None and not isinstance(value, dict):
            problems.append(f"{key} = {value!r}: must be an object or null")
        elif value:
            src.update(value)
            types[key] = value.get("rope_type") or value.get("type") or "default"
    if len(set(types.values())) > 1:
        problems.append(f"rope_scaling.rope_type = {types['rope_scaling']!r} and rope_parameters.rope_type = "
                        f"{types['rope_parameters']!r} disagree; give one of them")
        return src.get("rope_theta", hf.get("rope_theta", 10000.0)), RopeScaling()
    theta = src.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = src.get("rope_type") or src.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        why = {"dynamic": " (dynamic NTK changes the frequencies with the batch's length: log-probs would "
                          "depend on padding and the KV cache would mix two bases)",
               "yarn": " (YaRN also rescales attention)", "longrope": " (LongRoPE also rescales attention)"}
        problems.append(f"rope_type = {rope_type!r}: supported are {', '.join(map(repr, ROPE_TYPES))}"
                        f"{why.get(rope_type, '')}")
        return theta, RopeScaling()
    prf = src.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if prf not in (1, 1.0, None):
        problems.append(f"partial_rotary_factor = {prf!r}: only 1.0 (RoPE on the whole head) is supported")
    if rope_type == "default":
        return theta, RopeScaling()
    fields: dict[str, Any] = {}
    keys = ["factor"] + (["low_freq_factor", "high_freq_factor"] if rope_type == "llama3" else [])
    for key in keys:
        if key not in src:
            problems.append(f"rope_type = {rope_type!r} needs rope {key}")
            continue
        try:
            fields[key] = positive_float(src, key, where="rope ")
        except CheckpointError as e:
            problems.append(str(e).removeprefix("config.json: "))
    if rope_type == "llama3":
        orig = src.get("original_max_position_embeddings")
        if isinstance(orig, bool) or not isinstance(orig, int) or orig < 1:
            problems.append(f"rope original_max_position_embeddings = {orig!r}: llama3 scaling needs a positive integer")
        else:
            fields["original_max_position_embeddings"] = orig
        if len(fields) == 4 and fields["high_freq_factor"] <= fields["low_freq_factor"]:
            problems.append(f"rope high_freq_factor = {fields['high_freq_factor']!r}: must be > low_freq_factor "
                            f"({fields['low_freq_factor']!r})")
    if problems or len(fields) < len(keys) + (rope_type == "llama3"):
        return theta, RopeScaling()
    return theta, RopeScaling(rope_type, **fields)


def model_type_of(hf: dict) -> Optional[str]:
    model_type = hf.get("model_type")
    if model_type is None:
        archs = hf.get("architectures") or []
        model_type = next((t for t, a in ARCHITECTURES.items() if isinstance(archs, list) and a in archs), None)
    return model_type


def architecture_from_hf(hf: dict) -> Architecture:
    """The Architecture of config.json ``hf``; CheckpointError listing every unsupported key
    (with its value and what is supported) otherwise. Shapes are checked elsewhere
    (``pfppo_mega.models.hf_io.model_config_from_hf``)."""
    problems: list[str] = []
    family = model_type_of(hf)
    if family not in FAMILIES:
        if hf.get("model_type") is not None:
            problems.append(f"model_type = {hf['model_type']!r}: supported are {', '.join(map(repr, FAMILIES))}")
        else:
            problems.append(f"architectures = {hf.get('architectures')!r}: expected one of "
                            f"{', '.join(ARCHITECTURES.values())}")
    moe = [f"{k} = {hf[k]!r}" for k in _MOE_KEYS if hf.get(k) not in (None, 0, 1, False)]
    if moe:
        problems.append(f"{', '.join(moe)}: mixture-of-experts models are not supported (dense decoders only)")
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act = {hf['hidden_act']!r}: only 'silu' (SwiGLU) is supported")
    if family == "qwen2":
        no_bias = ("mlp_bias",)  # Qwen2 always has q/k/v biases and never an o_proj bias
    else:
        no_bias = ("attention_bias", "mlp_bias")  # attention_bias adds q/k/v and o_proj biases
    for key in no_bias:
        if hf.get(key, False) is not False:
            what = "attention biases (q/k/v and o_proj)" if key == "attention_bias" else "MLP biases"
            problems.append(f"{key} = {hf[key]!r}: {family or 'this family'} is supported without {what} "
                            f"only (must be false)")
    # A sliding window narrower than the context changes attention; one at least as wide does not.
    window = hf.get("sliding_window")
    if family in ("qwen2", "qwen3"):
        layer_types = hf.get("layer_types") or []
        sliding = hf.get("use_sliding_window", False) is True or (
            isinstance(layer_types, list) and "sliding_attention" in layer_types)
    else:
        sliding = family == "mistral" and window is not None
    context = hf.get("max_position_embeddings")
    if sliding and window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or not isinstance(context, int) or window < context:
            problems.append(f"sliding_window = {window!r}: smaller than the context (max_position_embeddings = "
                            f"{context!r}); only full attention is supported (sliding_window null or "
                            f">= max_position_embeddings)")
    theta, rope = _rope_from_hf(hf, problems)
    head_dim = hf.get("head_dim")
    if head_dim is not None:
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
            problems.append(f"head_dim = {head_dim!r}: must be a positive even integer (RoPE rotates pairs)")
            head_dim = None
        else:
            hidden, heads = hf.get("hidden_size"), hf.get("num_attention_heads")
            if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 and head_dim * heads == hidden:
                head_dim = None  # the default: stored as None so equal architectures compare equal
    if problems:
        raise CheckpointError("unsupported checkpoint architecture (config.json):\n"
                              + "\n".join(f"  - {p}" for p in problems))
    return Architecture(family=family, qkv_bias=family == "qwen2", qk_norm=family == "qwen3",
                        head_dim=head_dim, rope=rope)


def rope_theta_of(hf: dict) -> Any:
    """RoPE's base as config.json gives it (``rope_parameters.rope_theta`` or ``rope_theta``; 10000
    when absent), unchecked."""
    return _rope_from_hf(hf, [])[0]


def legacy_architecture(qkv_bias: bool) -> Architecture:
    """The Architecture the ``qkv_bias`` flag of earlier versions meant: Qwen2 when set, else Llama."""
    return Architecture(family="qwen2", qkv_bias=True) if qkv_bias else Architecture()
