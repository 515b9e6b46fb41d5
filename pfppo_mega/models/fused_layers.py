"""Fused decoder layers without Transformer Engine (``training.fused_layers``), on the CPU and on GPUs,
and the choice of layer spec (megatron's local layers, these, or TE's).

megatron's local layer spec builds every element-wise piece of a decoder layer out of several torch
ops, each a pass over memory, and their backwards out of more (RMSNorm: pow, mean, add, rsqrt, mul,
mul; SwiGLU: chunk, silu, mul and a cat of the two gradients; RoPE: cos, sin, chunk, neg, cat, mul,
mul, add and a cat; attention: a GQA repeat, baddbmm, masked softmax, bmm, permute). On a GPU its
``DotProductAttention`` also holds the b x heads x s^2 scores (fp32 softmax and a bf16 copy, saved
for backward) and rebuilds the causal mask in every layer. With the fused pieces a layer does each
in one pass where it can:

    piece      CPU, fp32                               CUDA (any float dtype)
    RMSNorm    csrc/cpu/layers.cpp (fwd + bwd)         torch.nn.functional.rms_norm (torch's own)
    SwiGLU     csrc/cpu/layers.cpp (fwd + bwd)         SwiGLUFn: saves its input only; backward
                                                       writes both halves of the gradient in place
    RoPE       csrc/cpu/layers.cpp (fwd = inverse)     RopeFn: cos / sin made once per forward,
                                                       not twice per layer; nothing else saved
    attention  scaled_dot_product_attention, causal, GQA without the repeat (enable_gqa), no mask
               tensor: on Hopper the flash or cuDNN backend, no s^2 buffer (the ledger's "fused")

Measured on the SmolLM2-135M shape at ~1,000-token micro-batches on 2 CPU threads (fwd + bwd per
layer): RMSNorm 7.3 ms (two a layer), SwiGLU 12.2 ms, RoPE of q and k ~10.5 ms, attention 21.0 ms,
against ~90 ms of the layer's matmuls (GPU figures: scripts/gpu_check.sh's speed step, docs).

The batches reaching the layers are right-padded rows [b, s] with positions 0..s-1 and no mask
(models.gpt.actor_logits; the token-budget plan of training.use_dynamic_bsz cuts each micro-batch
to its longest row, models.passes._plan), so causal attention alone keeps every real token from its
row's padding: no mask tensor and no packed (THD) layout is needed. Where a fused piece cannot run
(a mask or attention bias, packed sequences, mscale or interleaved RoPE, context parallelism,
dropout) it calls megatron's own code, so the model is the same module either way; its parameters
and their names do not change.

RoPE is applied by megatron's attention through the module-level function
``megatron.core.transformer.attention.apply_rotary_pos_emb``; ``install_rope()`` wraps that name
once per process. The wrapper takes the fused path only for a model built with fused layers (its
TransformerConfig carries ``pfppo_fused_layers``) and leaves every other call to megatron.

Transformer Engine (``model.layer_spec``): ``choose_layer_path`` decides, ``te_layer_spec`` builds
TE's layers with megatron's local parameter names (unfused norms: ``input_layernorm.weight``, not
TE's ``linear_qkv.layer_norm_weight``), so checkpoints and the Hugging Face mapping are the same
on either path. TE is imported only on a CUDA machine where it is installed.
"""

from __future__ import annotations

import copy
import importlib.util
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from pfppo_mega.kernels import layers as kl
from pfppo_mega.kernels.layers import usable

# ----------------------------------------------------------------------------- which layers

PATHS = ("local", "fused", "transformer_engine")  # megatron's local layers, this module's, TE's


def te_importable() -> bool:
    """Whether transformer_engine can be imported, found without importing it (importing it on a
    machine without CUDA fails or warns, and it pins its own torch)."""
    return importlib.util.find_spec("transformer_engine") is not None


def choose_layer_path(layer_spec: str, *, fused_layers: bool, device_type: str, params_dtype: str,
                      te_available: bool) -> str:
    """The decoder layers a model gets (one of PATHS), from model.layer_spec, training.fused_layers,
    where the model lives and whether TE is installed (``te_available``; te_importable()).

    transformer_engine: TE's layers (models.gpt.check_features refuses it off CUDA or without TE);
    auto: TE's on CUDA where TE is installed, else as local;
    local: this module's fused layers when fused_layers is on and the model is on a GPU (any
    dtype) or fp32 on the CPU (the C++ kernels' dtype), else megatron's own layers."""
    if layer_spec == "transformer_engine" or (layer_spec == "auto" and device_type == "cuda" and te_available):
        return "transformer_engine"
    if layer_spec not in ("auto", "local"):
        raise ValueError(f"layer_spec({layer_spec!r}) must be one of 'local', 'transformer_engine', 'auto'")
    if fused_layers and (device_type == "cuda" or (device_type == "cpu" and params_dtype == "float32")):
        return "fused"
    return "local"


# ----------------------------------------------------------------------------- autograd (any device)


class SwiGLUFn(torch.autograd.Function):
    """silu(a) * b of h = [a | b] [..., 2F] -> [..., F], saving h alone (autograd's chain saves
    silu(a) besides: F more elements a token a layer); the backward writes d/da and d/db into one
    [..., 2F] tensor instead of concatenating them. Torch ops, so any device and dtype."""

    @staticmethod
    def forward(ctx, h: Tensor) -> Tensor:
        ctx.save_for_backward(h)
        a, b = h.chunk(2, dim=-1)
        return F.silu(a) * b

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        (h,) = ctx.saved_tensors
        a, b = h.chunk(2, dim=-1)
        sig = torch.sigmoid(a)
        grad_h = torch.empty_like(h)                      # [..., 2F]
        ga, gb = grad_h.chunk(2, dim=-1)
        silu = a * sig
        torch.mul(grad_y, silu, out=gb)                   # d/db = g silu(a)
        # d/da = g b sig (1 + a (1 - sig)) = g b (sig + silu - silu sig)
        torch.mul(grad_y * b, sig + silu * (1 - sig), out=ga)
        return grad_h


def _rotate_half(x: Tensor) -> Tensor:  # [x1, x2] -> [-x2, x1]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RopeFn(torch.autograd.Function):
    """megatron's rotate-half RoPE x cos + rotate_half(x) sin for x [S, ..., D] and cos / sin
    already in x's dtype and broadcastable ([S, 1, 1, D]); saves only cos and sin (shared by every
    layer). Backward: the transpose of rotate_half is [y1, y2] -> [y2, -y1]."""

    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        ctx.save_for_backward(cos, sin)
        return torch.addcmul(x * cos, _rotate_half(x), sin)

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        cos, sin = ctx.saved_tensors
        gs1, gs2 = (grad_y * sin).chunk(2, dim=-1)
        return torch.addcmul(torch.cat((gs2, -gs1), dim=-1), grad_y, cos), None, None


def swiglu(h: Tensor) -> Tensor:  # [..., 2F] -> [..., F]
    """The C++ kernel on CPU fp32, SwiGLUFn elsewhere."""
    if h.dim() < 1 or h.shape[-1] % 2:
        raise ValueError(f"swiglu: h [..., 2F] must have an even last dimension, got shape {tuple(h.shape)}")
    if usable(h):
        return kl.SwiGLUFn.apply(h.contiguous())
    return SwiGLUFn.apply(h)


class _AngleCache:
    """cos / sin of the last freqs tensor seen, per dtype: megatron hands every layer's q and k the
    same freqs [S, 1, 1, D] within a forward (2 x layers calls), so they are made once."""

    def __init__(self) -> None:
        self.freqs: Optional[Tensor] = None
        self.version = -1
        self.by_dtype: dict = {}

    def get(self, freqs: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        if freqs is not self.freqs or freqs._version != self.version:
            self.freqs, self.version, self.by_dtype = freqs, freqs._version, {}
        if dtype not in self.by_dtype:
            # megatron's _apply_rotary_pos_emb_bshd: cos / sin of the fp32 angles, cast to x's dtype
            self.by_dtype[dtype] = (freqs.cos().to(dtype), freqs.sin().to(dtype))
        return self.by_dtype[dtype]


_ANGLES = _AngleCache()


def rope(t: Tensor, freqs: Tensor) -> Tensor:
    """t [S, B, H, D] rotated by the angles freqs [S, 1, 1, D]: the C++ kernel on CPU fp32, RopeFn
    elsewhere."""
    S, D = t.shape[0], t.shape[-1]
    if t.dim() != 4 or D % 2 or tuple(freqs.shape) != (S, 1, 1, D):
        raise ValueError(f"rope: t must be [S, B, H, D] with D even and freqs [S, 1, 1, D]; got t "
                         f"{tuple(t.shape)}, freqs {tuple(freqs.shape)}")
    if usable(t, freqs):
        angles = freqs.reshape(S, D)
        return kl.RopeFn.apply(t.contiguous(), angles.cos(), angles.sin())
    if freqs.requires_grad:  # never in megatron (its angles are buffers); keep autograd's own chain
        return t * freqs.cos().to(t.dtype) + _rotate_half(t) * freqs.sin().to(t.dtype)
    cos, sin = _ANGLES.get(freqs, t.dtype)
    return RopeFn.apply(t, cos, sin)


# ----------------------------------------------------------------------------- megatron modules


class PlacedRMSNorm(torch.nn.RMSNorm):
    """megatron's norm (``build_module(spec, config=, hidden_size=, eps=)``): the torch.nn.RMSNorm
    that megatron's local spec builds (WrappedTorchNorm: the same ``weight``), made where and as
    megatron makes its linears: on ``torch.cuda.current_device()`` (the host under
    ``use_cpu_initialization``, as megatron's own layers) in ``params_dtype``. WrappedTorchNorm
    passes neither, so on a GPU its weights stayed on the host in fp32 (the first H200 run).
    Its forward is torch.nn.functional.rms_norm (one fused kernel on CUDA)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused) -> None:
        if config.normalization != "RMSNorm" or config.sequence_parallel:
            raise ValueError(f"{type(self).__name__}: needs normalization RMSNorm without sequence parallelism "
                             f"(got {config.normalization!r}, sequence_parallel={config.sequence_parallel})")
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        super().__init__(hidden_size, eps=eps, device=device, dtype=config.params_dtype)


class FusedRMSNorm(PlacedRMSNorm):
    """PlacedRMSNorm whose forward is the C++ kernel on CPU fp32 (F.rms_norm elsewhere)."""

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


SDPA_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def sdpa_takes(query: Tensor, key: Tensor, value: Tensor) -> bool:
    """Whether q / k / v [s, b, n, d] can go to scaled_dot_product_attention as the causal
    self-attention of a training forward: one float dtype and device, equal lengths (no KV cache)."""
    return (query.dtype in SDPA_DTYPES and key.dtype == value.dtype == query.dtype
            and key.device == value.device == query.device
            and query.shape[0] == key.shape[0] and query.shape[1] == key.shape[1])


def sdpa(query: Tensor, key: Tensor, value: Tensor, scale: Optional[float]) -> Tensor:
    """Causal attention of q [s, b, n, d] over k, v [s, b, g, d] (g divides n) -> [s, b, n d].
    No mask tensor (is_causal): the flash / cuDNN / CPU flash backends take it without an s^2
    buffer; GQA without repeating k and v (enable_gqa)."""
    if query.dim() != 4 or key.shape != value.shape or key.dim() != 4 or key.shape[:2] != query.shape[:2] \
            or key.shape[3] != query.shape[3] or key.shape[2] < 1 or query.shape[2] % key.shape[2]:
        raise ValueError(f"sdpa: query must be [s, b, n, d] and key / value [s, b, g, d] with g dividing n; got "
                         f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}")
    # megatron's value is a view of the fused QKV output [s, b, (n + 2g) d]: SDPA would keep all of it
    # for its backward; a copy of v (s b g d) lets it go
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value.contiguous()))  # [b, n|g, s, d]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])  # [b, n, s, d]
    s, b, n, d = query.shape
    return out.permute(2, 0, 1, 3).reshape(s, b, n * d)                  # [s, b, n d]


def _sdpa_attention_class():
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    class SDPAttention(DotProductAttention):
        """megatron's local core attention; the causal, unmasked case runs through torch's
        scaled_dot_product_attention (sdpa: one kernel, no GQA repeat, no [b, np, s, s] buffer)."""

        def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                    attn_mask_type: Optional[AttnMaskType] = None, attention_bias: Optional[Tensor] = None,
                    packed_seq_params=None):
            mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
            plain = (attention_mask is None and attention_bias is None and packed_seq_params is None
                     and mask_type == AttnMaskType.causal and getattr(self, "softmax_offset", None) is None
                     and getattr(self.config, "window_size", None) is None and sdpa_takes(query, key, value))
            if not plain or (self.training and self.attention_dropout.p > 0):
                return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                       attention_bias=attention_bias, packed_seq_params=packed_seq_params)
            out = sdpa(query, key, value, self.softmax_scale)                # [s, b, n d]
            if out.shape[-1] != self.hidden_size_per_partition:
                raise ValueError(f"SDPAttention: heads x head_dim ({out.shape[-1]}) != hidden_size_per_partition "
                                 f"({self.hidden_size_per_partition})")
            return out

    return SDPAttention


_SDPA = None


def sdpa_attention_class():
    """The SDPAttention class (built on first use: it subclasses a megatron class)."""
    global _SDPA
    if _SDPA is None:
        _SDPA = _sdpa_attention_class()
    return _SDPA


# ----------------------------------------------------------------------------- layer specs


def _norms(spec, norm) -> None:
    """Set every RMSNorm of a layer spec (input, pre-MLP, Qwen3's q / k) to ``norm``, in place."""
    sub = spec.submodules
    sub.input_layernorm = norm
    sub.pre_mlp_layernorm = norm
    attn = sub.self_attention.submodules
    if getattr(attn, "q_layernorm", None) is not None and not _is_identity(attn.q_layernorm):
        attn.q_layernorm = norm
        attn.k_layernorm = norm


def layer_spec(spec):
    """megatron's local GPT layer spec -> the same spec with the fused pieces (a copy; the config
    must set ``use_te_activation_func`` for the MLP to call the activation module)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    spec = copy.deepcopy(spec)
    _norms(spec, FusedRMSNorm)
    spec.submodules.self_attention.submodules.core_attention = sdpa_attention_class()
    spec.submodules.mlp.submodules.activation_func = ModuleSpec(module=FusedSwiGLU)
    return spec


def placed_norms(spec):
    """megatron's local GPT layer spec -> a copy whose norms (input, pre-MLP, Qwen3's q/k) are
    PlacedRMSNorm: megatron's own layers otherwise, on the device and in the dtype of the model."""
    spec = copy.deepcopy(spec)
    _norms(spec, PlacedRMSNorm)
    return spec


def te_layer_spec(spec):
    """megatron's local GPT layer spec -> TE's linears, norms and attention under the local spec's
    module names (a copy). Unlike megatron's get_gpt_layer_with_transformer_engine_spec the input
    norms stay separate modules (TE's LayerNormLinear would rename input_layernorm.weight to
    linear_qkv.layer_norm_weight), so the state dict's parameters and pfppo_mega.models.hf_io's
    mapping are the local spec's; TE adds its ``_extra_state`` entries (fp8 metadata, empty in
    bf16). The activation is FusedSwiGLU, RoPE TE's fused one (models.gpt sets apply_rope_fusion).
    Imports TE: call on a CUDA machine where te_importable()."""
    from megatron.core.extensions.transformer_engine import (
        TEColumnParallelLinear, TEDotProductAttention, TENorm, TERowParallelLinear,
    )

    spec = copy.deepcopy(spec)
    _norms(spec, TENorm)
    attn = spec.submodules.self_attention.submodules
    attn.linear_qkv, attn.core_attention, attn.linear_proj = TEColumnParallelLinear, TEDotProductAttention, \
        TERowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec

    mlp = spec.submodules.mlp.submodules
    mlp.linear_fc1, mlp.linear_fc2 = TEColumnParallelLinear, TERowParallelLinear
    mlp.activation_func = ModuleSpec(module=FusedSwiGLU)  # the config sets use_te_activation_func
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
                and freqs.dim() == 4 and tuple(freqs.shape) == (S, 1, 1, D) and t.dim() == 4
                and freqs.device == t.device and t.is_floating_point()
                and (cp_group is None or cp_group.size() == 1)):
            return rope(t, freqs)
        return original(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group)

    apply_rotary_pos_emb.pfppo_original = original
    attention.apply_rotary_pos_emb = apply_rotary_pos_emb
    _installed = True
