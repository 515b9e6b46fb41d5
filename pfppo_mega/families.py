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
