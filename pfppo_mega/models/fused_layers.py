"""Fused decoder layers for the trainer's CPU path (``training.fused_layers``).

megatron's local layer spec builds every element-wise piece of a decoder layer out of several torch
ops, each a pass over memory, and their backwards out of more (RMSNorm: pow, mean, add, rsqrt, mul,
mul; SwiGLU: chunk, silu, mul and a cat of the two gradients; RoPE: cos, sin, chunk, neg, cat, mul,
mul, add and a cat; attention: a GQA repeat, baddbmm, masked softmax, bmm, permute). Measured on the
SmolLM2-135M shape at ~1,000-token micro-batches on 2 threads, fwd + bwd per layer: RMSNorm 7.3 ms
(two a layer), SwiGLU 12.2 ms, RoPE of q and k ~10.5 ms, attention 21.0 ms, against ~90 ms of the
layer's matmuls. With the fused pieces a layer does each in one pass: RMSNorm, SwiGLU and RoPE are the
kernels of pfppo_mega.kernels.layers (csrc/cpu/layers.cpp, forward and backward; their pure-torch
references are megatron's formulas), attention is torch's scaled_dot_product_attention (causal, GQA
without the repeat). Where a fused
piece cannot run (not a CPU fp32 tensor, the extension not built, a mask, packed sequences, mscale
or interleaved RoPE, context parallelism) it calls megatron's own code, so the model is the same
module either way; its parameters and their names do not change.

RoPE is applied by megatron's attention through the module-level function
``megatron.core.transformer.attention.apply_rotary_pos_emb``; ``install_rope()`` wraps that name
once per process. The wrapper takes the fused path only for a model built with fused layers (its
TransformerConfig carries ``pfppo_fused_layers``) and leaves every other call to megatron.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from pfppo_mega.kernels import layers as kl
from pfppo_mega.kernels.layers import swiglu, usable


# ----------------------------------------------------------------------------- megatron modules


class PlacedRMSNorm(torch.nn.RMSNorm):
    """megatron's norm (``build_module(spec, config=, hidden_size=, eps=)``): the torch.nn.RMSNorm
    that megatron's local spec builds (WrappedTorchNorm: the same ``weight``), made where and as
    megatron makes its linears: on ``torch.cuda.current_device()`` (the host under
    ``use_cpu_initialization``, as megatron's own layers) in ``params_dtype``. WrappedTorchNorm
    passes neither, so on a GPU its weights stayed on the host in fp32 (the first H200 run)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused) -> None:
        if config.normalization != "RMSNorm" or config.sequence_parallel:
            raise ValueError(f"{type(self).__name__}: needs normalization RMSNorm without sequence parallelism "
                             f"(got {config.normalization!r}, sequence_parallel={config.sequence_parallel})")
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        super().__init__(hidden_size, eps=eps, device=device, dtype=config.params_dtype)


class FusedRMSNorm(PlacedRMSNorm):
    """PlacedRMSNorm whose forward is the fused kernel (CPU fp32)."""

    def forward(self, x: Tensor) -> Tensor:
        if usable(x, self.weight):
            return kl.RMSNormFn.apply(x.contiguous(), self.weight, self.eps)
        return super().forward(x)


class FusedSwiGLU(torch.nn.Module):
    """MLP activation module (megatron's ``use_te_activation_func`` seam): takes fc1's whole
    [..., 2F] output and returns silu(gate) * up [..., F]."""

    def __init__(self, config=None, **_unused) -> None:
        super().__init__()

    def forward(self, h: Tensor) -> Tensor:
        return swiglu(h)


def _sdpa_attention_class():
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    class SDPAttention(DotProductAttention):
        """megatron's local core attention; the causal, unmasked fp32 CPU case runs through
        torch's scaled_dot_product_attention (one kernel, no GQA repeat, no [b, np, s, s] buffer)."""

        def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                    attn_mask_type: Optional[AttnMaskType] = None, attention_bias: Optional[Tensor] = None,
                    packed_seq_params=None):
            mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
            plain = (attention_mask is None and attention_bias is None and packed_seq_params is None
                     and mask_type == AttnMaskType.causal and getattr(self, "softmax_offset", None) is None
                     and getattr(self.config, "window_size", None) is None
                     and usable(query, key, value) and query.shape[0] == key.shape[0])
            if not plain or (self.training and self.attention_dropout.p > 0):
                return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                       attention_bias=attention_bias, packed_seq_params=packed_seq_params)
            # [s, b, n, d] -> [b, n, s, d]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                                 enable_gqa=q.shape[1] != k.shape[1])  # [b, n, s, d]
            s, b = query.shape[0], query.shape[1]
            return out.permute(2, 0, 1, 3).reshape(s, b, self.hidden_size_per_partition)

    return SDPAttention


_SDPA = None


def sdpa_attention_class():
    """The SDPAttention class (built on first use: it subclasses a megatron class)."""
    global _SDPA
    if _SDPA is None:
        _SDPA = _sdpa_attention_class()
    return _SDPA


def layer_spec(spec):
    """megatron's local GPT layer spec -> the same spec with the fused pieces (a copy; the config
    must set ``use_te_activation_func`` for the MLP to call the activation module)."""
    import copy

    from megatron.core.transformer.spec_utils import ModuleSpec

    spec = copy.deepcopy(spec)
    sub = spec.submodules
    sub.input_layernorm = FusedRMSNorm
    sub.pre_mlp_layernorm = FusedRMSNorm
    attn = sub.self_attention.submodules
    attn.core_attention = sdpa_attention_class()
    if getattr(attn, "q_layernorm", None) is not None and not _is_identity(attn.q_layernorm):
        attn.q_layernorm = FusedRMSNorm
        attn.k_layernorm = FusedRMSNorm
    sub.mlp.submodules.activation_func = ModuleSpec(module=FusedSwiGLU)
    return spec


def placed_norms(spec):
    """megatron's local GPT layer spec -> a copy whose norms (input, pre-MLP, Qwen3's q/k) are
    PlacedRMSNorm: megatron's own layers otherwise, on the device and in the dtype of the model."""
    import copy

    spec = copy.deepcopy(spec)
    sub = spec.submodules
    sub.input_layernorm = PlacedRMSNorm
    sub.pre_mlp_layernorm = PlacedRMSNorm
    attn = sub.self_attention.submodules
    if getattr(attn, "q_layernorm", None) is not None and not _is_identity(attn.q_layernorm):
        attn.q_layernorm = PlacedRMSNorm
        attn.k_layernorm = PlacedRMSNorm
    return spec


def _is_identity(module) -> bool:
    from megatron.core.transformer.identity_op import IdentityOp

    return module is IdentityOp


# ----------------------------------------------------------------------------- RoPE hook

_installed = False


def install_rope() -> None:
    """Wrap megatron attention's ``apply_rotary_pos_emb`` (once per process; see the module docstring)."""
    global _installed
    if _installed:
        return
    from megatron.core.transformer import attention

    original = attention.apply_rotary_pos_emb

    def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None):
        S, D = t.shape[0], t.shape[-1]
        if (getattr(config, "pfppo_fused_layers", False) and cu_seqlens is None and mscale == 1.0
                and not config.rotary_interleaved and not config.multi_latent_attention
                and freqs.dim() == 4 and tuple(freqs.shape) == (S, 1, 1, D) and usable(t, freqs)
                and (cp_group is None or cp_group.size() == 1)):
            angles = freqs.reshape(S, D)
            return kl.RopeFn.apply(t.contiguous(), angles.cos(), angles.sin())
        return original(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group)

    apply_rotary_pos_emb.pfppo_original = original
    attention.apply_rotary_pos_emb = apply_rotary_pos_emb
    _installed = True
