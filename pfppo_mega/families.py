"""The model families a Hugging Face checkpoint may come from, read from its config.json.

Imports only the standard library (torch inside ``rope_inv_freq``), so the trainer's models
(``pfppo_mega.models``), HF import / export, the built-in rollout engine (``pfppo_mega.rollout.llama``)
and the memory planner (``pfppo_mega.planning``, which runs without torch) read one description
of a checkpoint: ``DecoderShape``, its dimensions and its family's ``Architecture``. Everything
outside it is refused with the key, its value and what is supported (``ModelDirError``), never
approximated.

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
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Iterable, Literal, Mapping, Optional

if TYPE_CHECKING:
    import torch


class ModelDirError(ValueError):
    """A model directory that cannot be loaded as it is. The message names the file, the key or
    tensor, the value found and what is expected."""


class ModelFileMissing(ModelDirError, FileNotFoundError):
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
        raise ModelDirError(f"{file}: {key} = {value!r}: must be a positive integer")
    return value


def positive_float(hf: dict, key: str, *, file: str = "config.json", where: str = "") -> float:
    value = hf[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ModelDirError(f"{file}: {where}{key} = {value!r}: must be a finite number > 0")
    return float(value)


def boolean(hf: dict, key: str, *, file: str = "config.json") -> bool:
    value = hf[key]
    if not isinstance(value, bool):
        raise ModelDirError(f"{file}: {key} = {value!r}: must be true or false")
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
    import torch  # here, not at the top: the planner reads this module without torch

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
        except ModelDirError as e:
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
    """The Architecture of config.json ``hf``; ModelDirError listing every unsupported key
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
        raise ModelDirError("unsupported checkpoint architecture (config.json):\n"
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


# ----------------------------------------------------------------------------- the decoder's shape


Head = Literal["lm", "value"]  # output_layer: the actor's LM head, or the critic's value head [1, h]

# DecoderShape dimension -> (config.json key, default when the key is absent; _REQUIRED = none)
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


def _hf_dimensions(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The dimensions of config.json ``hf``, typed (ModelDirError naming the key, its value and the rule)."""
    values: dict[str, Any] = {}
    missing = []
    for name, (key, default) in _HF_KEYS.items():
        if key in hf and hf[key] is not None:
            values[name] = hf[key]
        elif default is _REQUIRED:
            missing.append(key)
        else:
            values[name] = default
    if missing:
        raise ModelDirError(f"config.json lacks required key(s): {', '.join(missing)}")
    if values["num_query_groups"] is None:
        values["num_query_groups"] = values["num_attention_heads"]
    typed = {**hf, **{_HF_KEYS[n][0]: v for n, v in values.items()}}
    for name, (key, _) in _HF_KEYS.items():
        check = {"norm_epsilon": positive_float, "tie_word_embeddings": boolean}.get(name, positive_int)
        values[name] = check(typed, key)
    values["rope_theta"] = positive_float({"rope_theta": rope_theta_of(hf)}, "rope_theta")
    heads, groups = values["num_attention_heads"], values["num_query_groups"]
    if heads % groups:
        raise ModelDirError(f"config.json: num_key_value_heads = {groups}: must divide num_attention_heads "
                              f"({heads}); each key/value head serves a whole group of query heads")
    return values


@dataclass(frozen=True)
class DecoderShape:
    """Every dimension of a checkpoint's decoder and its family (``arch``): the one description the
    model builder (pfppo_mega.models.gpt), HF import / export (pfppo_mega.models.hf_io), the memory
    planner (pfppo_mega.planning) and the built-in engine (pfppo_mega.rollout.llama) read. The
    dimensions are the shape fields of pfppo_mega.config.tree.ModelConfig, under the same names.

    h hidden_size, f ffn_hidden_size, a num_attention_heads, g num_query_groups (KV heads),
    d head_dim (h / a unless arch.head_dim), V vocab_size, L num_layers.
    """

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    vocab_size: int
    max_position_embeddings: int
    norm_epsilon: float
    tie_word_embeddings: bool
    rope_theta: float
    arch: Architecture = Architecture()

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                     "num_query_groups", "vocab_size", "max_position_embeddings", "head_dim"):
            value = getattr(self, name)
            if not value >= 1:
                raise ValueError(f"DecoderShape.{name}={value} must be >= 1")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(f"DecoderShape.num_attention_heads({self.num_attention_heads}) must be a multiple of "
                             f"num_query_groups({self.num_query_groups})")
        if self.head_dim % 2:
            raise ValueError(f"DecoderShape.head_dim={self.head_dim} must be even (RoPE pairs)")

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any]) -> "DecoderShape":
        """From config.json ``hf``: the dimensions typed first (the architecture checks compute with
        them), then the Architecture. ModelDirError names every key that is missing, mistyped or
        outside what this module supports (other families, RoPE types, narrow sliding windows, MoE)."""
        dims = _hf_dimensions(hf)
        return cls(**dims, arch=architecture_from_hf(hf))

    @classmethod
    def from_model_config(cls, model: Any, arch: Optional[Architecture] = None) -> "DecoderShape":
        """From a ``pfppo_mega.config.tree.ModelConfig`` whose shape fields are all set, and the
        checkpoint's Architecture (None: plain Llama)."""
        require_dimensions(model)
        dims = {name: getattr(model, name) for name in _DIMENSIONS}
        return cls(**{**dims, "tie_word_embeddings": bool(model.tie_word_embeddings)}, arch=arch or Architecture())

    def dimensions(self) -> dict[str, Any]:
        """The ModelConfig shape fields of this decoder."""
        return {name: getattr(self, name) for name in _DIMENSIONS}

    @property
    def head_dim(self) -> int:
        return self.arch.head_dim_of(self.hidden_size, self.num_attention_heads)

    def kv_heads(self, tp: int = 1) -> int:
        """Key/value heads on each of ``tp`` tensor-parallel ranks: g / tp (megatron needs tp | g);
        an inference engine past tp = g replicates them, one per rank."""
        return max(1, self.num_query_groups // tp)

    def qkv_rows(self, tp: int = 1) -> int:
        """Rows of megatron's fused linear_qkv on each of ``tp`` ranks: (a + 2g) d / tp."""
        return (self.num_attention_heads // tp + 2 * self.kv_heads(tp)) * self.head_dim

    def hf_config(self) -> dict[str, Any]:
        """config.json of this decoder without a dtype: the family's keys, the dimensions, head_dim
        and RoPE, so that transformers builds this architecture and from_hf_config reads it back."""
        config = {
            **self.arch.hf_fields(),
            **{key: getattr(self, name) for name, (key, _) in _HF_KEYS.items()},
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,  # read by transformers 4.x
            "rope_parameters": self.arch.rope.hf_parameters(self.rope_theta),  # transformers 5
        }
        if self.arch.rope.rope_type != "default":  # transformers 4.x reads the scaling from rope_scaling
            config["rope_scaling"] = {k: v for k, v in config["rope_parameters"].items() if k != "rope_theta"}
        return config

    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        """Hugging Face name -> shape of every weight, in module order (transformers' and
        pfppo_mega.rollout.llama's named_parameters); no lm_head.weight when tied."""
        h, f, d, V = self.hidden_size, self.ffn_hidden_size, self.head_dim, self.vocab_size
        q_rows, kv_rows = self.num_attention_heads * d, self.num_query_groups * d
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, h)}
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            for proj, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
                shapes[f"{p}self_attn.{proj}_proj.weight"] = (rows, h)
                if self.arch.qkv_bias:
                    shapes[f"{p}self_attn.{proj}_proj.bias"] = (rows,)
            shapes[p + "self_attn.o_proj.weight"] = (h, q_rows)
            if self.arch.qk_norm:
                shapes[p + "self_attn.q_norm.weight"] = (d,)
                shapes[p + "self_attn.k_norm.weight"] = (d,)
            shapes[p + "mlp.gate_proj.weight"] = (f, h)
            shapes[p + "mlp.up_proj.weight"] = (f, h)
            shapes[p + "mlp.down_proj.weight"] = (h, f)
            shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (V, h)
        return shapes

    def megatron_shapes(self, layers: Iterable[int], *, first: bool, last: bool, head: Optional[Head],
                        tp: int = 1, vocab_rows: Optional[int] = None) -> dict[str, tuple[int, ...]]:
        """Megatron name -> shape on each of ``tp`` tensor-parallel ranks (tp = 1: the full tensors) of
        every parameter of the GPTModel stage (megatron-core 0.16.1, local layer spec) that holds
        decoder ``layers``, the embedding when ``first``, and the final norm and ``head`` when
        ``last`` (None: no output_layer, an LM head tied at pp = 1). ``vocab_rows``: rows of the whole
        embedding / LM head, Vp (default: V padded to a multiple of tp, as pfppo_mega.models pads it).

            embedding.word_embeddings.weight               [Vp / tp, h]          split on the vocabulary
            decoder.layers.{i}.input_layernorm.weight      [h]                   replicated
            decoder.layers.{i}.self_attention.linear_qkv   [(a + 2g) d / tp, h]  column parallel (.bias: Qwen2)
            decoder.layers.{i}.self_attention.linear_proj  [h, a d / tp]         row parallel
            decoder.layers.{i}.self_attention.{q,k}_layernorm.weight  [d]       Qwen3's q/k RMSNorm
            decoder.layers.{i}.pre_mlp_layernorm.weight    [h]
            decoder.layers.{i}.mlp.linear_fc1.weight       [2 f / tp, h]         [gate; up], column parallel
            decoder.layers.{i}.mlp.linear_fc2.weight       [h, f / tp]           row parallel
            decoder.final_layernorm.weight                 [h]
            output_layer.weight                            [Vp / tp, h]          "lm"; "value": [1, h], replicated

        KV heads per rank: ``kv_heads(tp)``. RoPE scaling adds no parameters.
        """
        h, f, d, a = self.hidden_size, self.ffn_hidden_size, self.head_dim, self.num_attention_heads
        rows = (vocab_rows or -(-self.vocab_size // tp) * tp) // tp
        qkv = self.qkv_rows(tp)
        shapes: dict[str, tuple[int, ...]] = {}
        if first:
            shapes["embedding.word_embeddings.weight"] = (rows, h)
        for i in layers:
            m = f"decoder.layers.{i}."
            shapes[m + "input_layernorm.weight"] = (h,)
            shapes[m + "self_attention.linear_qkv.weight"] = (qkv, h)
            if self.arch.qkv_bias:
                shapes[m + "self_attention.linear_qkv.bias"] = (qkv,)
            shapes[m + "self_attention.linear_proj.weight"] = (h, a // tp * d)
            if self.arch.qk_norm:
                shapes[m + "self_attention.q_layernorm.weight"] = (d,)
                shapes[m + "self_attention.k_layernorm.weight"] = (d,)
            shapes[m + "pre_mlp_layernorm.weight"] = (h,)
            shapes[m + "mlp.linear_fc1.weight"] = (2 * (f // tp), h)
            shapes[m + "mlp.linear_fc2.weight"] = (h, f // tp)
        if last:
            shapes["decoder.final_layernorm.weight"] = (h,)
            if head is not None:
                shapes["output_layer.weight"] = (1, h) if head == "value" else (rows, h)
        return shapes


_DIMENSIONS = tuple(f.name for f in fields(DecoderShape) if f.name != "arch")


def require_dimensions(model: Any) -> None:
    """ValueError naming every dimension that ``model`` (a ModelConfig) leaves unset."""
    missing = [name for name in _DIMENSIONS if getattr(model, name) is None]
    if missing:
        raise ValueError(f"model config is incomplete (unset: {', '.join(missing)}); set them in the config's model "
                         f"section or fill them from the checkpoint with pfppo_mega.models.hf_io.model_config_from_hf")


def indivisible_dimensions(dims: Any, *, tp: int, pp: int) -> list[tuple[str, int, str, int]]:
    """(name, value, "tp" or "pp", its size) of every dimension of ``dims`` (a DecoderShape, or a
    complete ModelConfig: the same names) that megatron splits over tensor parallelism tp or
    pipeline parallelism pp and that tp or pp does not divide. The vocabulary needs none:
    pfppo_mega.models pads it to a multiple of tp."""
    rules = (("num_attention_heads", "tp", tp), ("num_query_groups", "tp", tp), ("ffn_hidden_size", "tp", tp),
             ("num_layers", "pp", pp))
    return [(name, getattr(dims, name), factor, size) for name, factor, size in rules if getattr(dims, name) % size]
