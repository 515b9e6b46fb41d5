"""Fused element-wise pieces of a decoder layer (fp32 CPU kernels of pfppo_mega._C, csrc/cpu/layers.cpp),
each with its pure-torch reference; used by the trainer's layers (pfppo_mega.models.fused_layers) and
the built-in rollout engine (pfppo_mega.rollout.llama).

    rms_norm(x, w)  = w * x * r,  r = 1 / sqrt(mean(x^2) + eps)        pfppo::rms_norm (+ _backward)
    swiglu([a | b]) = silu(a) * b                                       pfppo::swiglu (+ _backward)
    rope(x, c, s)   = x * c + rotate_half(x) * s                        pfppo::rope (inverse: backward)
                      x [S, ..., D]; c, s [S, D] the angles' cos and sin; rotate_half([x1, x2]) = [-x2, x1]

The functions take the kernel where usable() (the extension built, float32 CPU tensors) and the
reference otherwise; the references are the formulas megatron's local layers compute, which the
tests hold the kernels to (tests/test_fused_layers.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from pfppo_mega.kernels import ops as kops


def usable(*tensors: Tensor) -> bool:
    """True when the fused kernels can take these tensors: the extension is built and every tensor
    is a float32 CPU tensor."""
    return kops.is_built() and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)


# ----------------------------------------------------------------------------- references


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:  # [..., E] -> [..., E]
    """torch.nn.RMSNorm's formula (megatron's WrappedTorchNorm)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def swiglu_reference(h: Tensor) -> Tensor:  # [..., 2F] -> [..., F]
    """megatron MLP's gated unit: the first half of fc1's output is the gate, the second the up."""
    a, b = torch.chunk(h, 2, dim=-1)
    return F.silu(a) * b


def rope_reference(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [S, ..., D], cos / sin [S, D] -> megatron's rotate-half RoPE (mscale 1, not interleaved)."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return x * cos.reshape(shape) + torch.cat((-x2, x1), dim=-1) * sin.reshape(shape)


# ----------------------------------------------------------------------------- autograd


class RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        y, rstd = torch.ops.pfppo.rms_norm(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        x, weight, rstd = ctx.saved_tensors
        gx, gw = torch.ops.pfppo.rms_norm_backward(grad_y.contiguous(), x, weight, rstd)
        return gx, gw, None


class SwiGLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: Tensor) -> Tensor:
        ctx.save_for_backward(h)
        return torch.ops.pfppo.swiglu(h)

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        (h,) = ctx.saved_tensors
        return torch.ops.pfppo.swiglu_backward(grad_y.contiguous(), h)


class RopeFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        ctx.save_for_backward(cos, sin)
        return torch.ops.pfppo.rope(x, cos, sin, False)

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        cos, sin = ctx.saved_tensors
        return torch.ops.pfppo.rope(grad_y.contiguous(), cos, sin, True), None, None


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dimension; fused where usable(), else the reference."""
    if usable(x, weight):
        return RMSNormFn.apply(x.contiguous(), weight, eps)
    return rms_norm_reference(x, weight, eps)


def swiglu(h: Tensor) -> Tensor:
    if usable(h):
        return SwiGLUFn.apply(h.contiguous())
    return swiglu_reference(h)


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [S, ..., D] rotated by cos / sin [S, D]; fused where usable(), else the reference."""
    if usable(x, cos, sin):
        return RopeFn.apply(x.contiguous(), cos.contiguous(), sin.contiguous())
    return rope_reference(x, cos, sin)
