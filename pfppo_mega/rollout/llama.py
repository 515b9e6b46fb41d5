"""Pure-torch Llama / Qwen2 / Qwen3 / Mistral decoder for generation, parameters under Hugging Face names.

Notation: B batch, S query length, K key length (cache slots in use), H query heads,
G key/value heads (H % G == 0), D head_dim, E hidden_size, V vocab_size, L layers.

Per layer (pre-norm; qn / kn the per-head q/k RMSNorms of Qwen3, identity otherwise):
    h = x + o_proj(attn(rope(qn(q_proj(n1(x)))), rope(kn(k_proj(n1(x)))), v_proj(n1(x))))
    y = h + down_proj(silu(gate_proj(n2(h))) * up_proj(n2(h)))
    rms_norm(x) = w * x / sqrt(mean(x^2) + eps)            (computed in fp32)
    rope(x)     = x * cos(p * f) + rotate_half(x) * sin(p * f),  f_i = theta^(-2i/D), scaled by
                  the checkpoint's RoPE type (pfppo_mega.families.rope_inv_freq)
    rotate_half([x1, x2]) = [-x2, x1]                        (Hugging Face convention)
logits = lm_head(norm(x_L)); lm_head shares embed_tokens.weight when tie_word_embeddings.

Ragged batches are left-padded: `key_valid` [B, K] marks real tokens, `position_ids` count only
real tokens, and a padded query attends to itself alone so no softmax row is empty.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from pfppo_mega.families import Architecture, RopeScaling, architecture_from_hf, rope_inv_freq, rope_theta_of


@dataclass(frozen=True)
class LlamaShape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    """Biases on q/k/v projections (Qwen2). o_proj never has a bias."""
    qk_norm: bool = False
    """Per-head RMSNorm of queries and keys before RoPE (Qwen3)."""
    rope: RopeScaling = RopeScaling()
    family: str = ""
    """model_type; "" = llama, or qwen2 when attention_bias."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not value >= 1:
                raise ValueError(f"LlamaShape.{name}={value} must be >= 1")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"LlamaShape.num_heads({self.num_heads}) must be a multiple of "
                f"num_kv_heads({self.num_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"LlamaShape.head_dim={self.head_dim} must be even (RoPE pairs)")

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> LlamaShape:
        """Read a Hugging Face config.json dict of a family pfppo_mega.families supports.

        Features this decoder does not implement (see families.architecture_from_hf: other RoPE
        types, sliding windows narrower than the context, biases the family has none of, MoE,
        activations other than silu) raise ValueError rather than load silently wrong.
        """
        config = dict(config)
        arch = architecture_from_hf(config)
        num_heads = config["num_attention_heads"]
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=arch.head_dim_of(config["hidden_size"], num_heads),
            rope_theta=float(rope_theta_of(config)),
            rms_norm_eps=float(config["rms_norm_eps"]),
            max_position_embeddings=config["max_position_embeddings"],
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=arch.qkv_bias,
            qk_norm=arch.qk_norm,
            rope=arch.rope,
            family=arch.family,
        )

    def architecture(self) -> Architecture:
        family = self.family or ("qwen2" if self.attention_bias else "llama")
        head_dim = None if self.head_dim * self.num_heads == self.hidden_size else self.head_dim
        return Architecture(family=family, qkv_bias=self.attention_bias, qk_norm=self.qk_norm,
                            head_dim=head_dim, rope=self.rope)

    def to_hf_config(self) -> dict[str, Any]:
        """A config.json dict that transformers loads as the same architecture."""
        return {
            **self.architecture().hf_fields(),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rope_parameters": self.rope.hf_parameters(self.rope_theta),
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
        }

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Hugging Face name -> shape of every weight the decoder owns, in model order."""
        E, D, F_ = self.hidden_size, self.head_dim, self.intermediate_size
        q_out, kv_out = self.num_heads * D, self.num_kv_heads * D
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, E)}
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            shapes[p + "self_attn.q_proj.weight"] = (q_out, E)
            if self.attention_bias:
                shapes[p + "self_attn.q_proj.bias"] = (q_out,)
            shapes[p + "self_attn.k_proj.weight"] = (kv_out, E)
            if self.attention_bias:
                shapes[p + "self_attn.k_proj.bias"] = (kv_out,)
            shapes[p + "self_attn.v_proj.weight"] = (kv_out, E)
            if self.attention_bias:
                shapes[p + "self_attn.v_proj.bias"] = (kv_out,)
            shapes[p + "self_attn.o_proj.weight"] = (E, q_out)
            if self.qk_norm:
                shapes[p + "self_attn.q_norm.weight"] = (D,)
                shapes[p + "self_attn.k_norm.weight"] = (D,)
            shapes[p + "mlp.gate_proj.weight"] = (F_, E)
            shapes[p + "mlp.up_proj.weight"] = (F_, E)
            shapes[p + "mlp.down_proj.weight"] = (E, F_)
            shapes[p + "input_layernorm.weight"] = (E,)
            shapes[p + "post_attention_layernorm.weight"] = (E,)
        shapes["model.norm.weight"] = (E,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, E)
        return shapes


@dataclass
class KVCache:
    """Keys/values of every layer, preallocated for the whole generation."""

    k: torch.Tensor  # [L, B, G, max_len, D]
    v: torch.Tensor  # [L, B, G, max_len, D]

    @classmethod
    def allocate(cls, shape: LlamaShape, batch: int, max_len: int, *,
                 dtype: torch.dtype, device: torch.device) -> KVCache:
        size = (shape.num_layers, batch, shape.num_kv_heads, max_len, shape.head_dim)
        return cls(torch.zeros(size, dtype=dtype, device=device),
                   torch.zeros(size, dtype=dtype, device=device))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., E] -> [..., E]
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype, rope: RopeScaling = RopeScaling()) -> tuple[torch.Tensor, torch.Tensor]:
    """position_ids [B, S] -> cos, sin [B, 1, S, D] (angles computed in fp32)."""
    inv_freq = rope_inv_freq(head_dim, theta, rope, device=position_ids.device)  # [D/2]
    angles = position_ids.float()[..., None] * inv_freq  # [B, S, D/2]
    emb = torch.cat((angles, angles), dim=-1)[:, None]  # [B, 1, S, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, shape: LlamaShape, dtype: torch.dtype) -> None:
        super().__init__()
        E, D = shape.hidden_size, shape.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, D
        bias = shape.attention_bias
        self.q_proj = nn.Linear(E, shape.num_heads * D, bias=bias, dtype=dtype)
        self.k_proj = nn.Linear(E, shape.num_kv_heads * D, bias=bias, dtype=dtype)
        self.v_proj = nn.Linear(E, shape.num_kv_heads * D, bias=bias, dtype=dtype)
        self.o_proj = nn.Linear(shape.num_heads * D, E, bias=False, dtype=dtype)
        if shape.qk_norm:
            self.q_norm = RMSNorm(D, shape.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(D, shape.rms_norm_eps, dtype)
        self.qk_norm = shape.qk_norm

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor] | None,
                start: int) -> torch.Tensor:
        """x [B, S, E]; cos/sin [B, 1, S, D]; mask [B, 1, S, K] bool (True = may attend).

        kv: this layer's cache (k, v), each [B, G, max_len, D]; the new keys/values go to
        slots start..start+S-1 and the queries attend to slots 0..K-1 with K = start + S.
        Without a cache the queries attend to the S new keys only (start must be 0).
        """
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.num_heads, self.head_dim)  # [B, S, H, D]
        k = self.k_proj(x).view(B, S, self.num_kv_heads, self.head_dim)  # [B, S, G, D]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin  # [B, H, S, D]
        k = k * cos + rotate_half(k) * sin  # [B, G, S, D]
        if kv is not None:
            k_cache, v_cache = kv
            k_cache[:, :, start:start + S] = k
            v_cache[:, :, start:start + S] = v
            k, v = k_cache[:, :, :start + S], v_cache[:, :, :start + S]  # [B, G, K, D]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(B, S, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, shape: LlamaShape, dtype: torch.dtype) -> None:
        super().__init__()
        E, F_ = shape.hidden_size, shape.intermediate_size
        self.gate_proj = nn.Linear(E, F_, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(E, F_, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(F_, E, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, S, E] -> [B, S, E]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, shape: LlamaShape, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = Attention(shape, dtype)
        self.mlp = MLP(shape, dtype)
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, dtype)

    def forward(self, x, cos, sin, mask, kv, start):  # [B, S, E] -> [B, S, E]
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, kv, start)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):
    """Holds the `model.*` parameters, so names match Hugging Face's LlamaModel."""

    def __init__(self, shape: LlamaShape, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(shape, dtype) for _ in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps, dtype)


class LlamaDecoder(nn.Module):
    """Inference-only decoder; `named_parameters()` yields exactly shape.parameter_shapes()."""

    def __init__(self, shape: LlamaShape, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.shape = shape
        self.model = _Body(shape, dtype)
        if not shape.tie_word_embeddings:
            self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False, dtype=dtype)
        self.requires_grad_(False)
        self.to(device)

    def lm_head_weight(self) -> torch.Tensor:  # [V, E]
        if self.shape.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                mask: torch.Tensor, cache: KVCache | None = None, start: int = 0,
                last_only: bool = False) -> torch.Tensor:
        """input_ids, position_ids [B, S]; mask [B, 1, S, K] bool -> logits [B, S, V]
        (or [B, 1, V] for the last position when last_only). See Attention for cache/start."""
        x = self.model.embed_tokens(input_ids)  # [B, S, E]
        cos, sin = rope_cos_sin(position_ids, self.shape.head_dim, self.shape.rope_theta, x.dtype, self.shape.rope)
        for i, layer in enumerate(self.model.layers):
            kv = None if cache is None else (cache.k[i], cache.v[i])
            x = layer(x, cos, sin, mask, kv, start)
        if last_only:
            x = x[:, -1:]
        return F.linear(self.model.norm(x), self.lm_head_weight())


def positions_from_mask(key_valid: torch.Tensor) -> torch.Tensor:
    """key_valid [B, S] bool -> position ids [B, S]: index among the row's real tokens
    (padding gets the neighbouring value; it is never attended to)."""
    return (key_valid.long().cumsum(-1) - 1).clamp(min=0)


def prefill_mask(key_valid: torch.Tensor) -> torch.Tensor:
    """key_valid [B, S] bool -> [B, 1, S, S] bool: causal, real keys only, plus the diagonal so
    a padded query (attending to nothing real) still has a non-empty softmax row."""
    S = key_valid.shape[-1]
    idx = torch.arange(S, device=key_valid.device)
    causal = idx[None, :] <= idx[:, None]  # [S, S] (query, key)
    mask = causal & key_valid[:, None, :]  # [B, S, S]
    return (mask | (idx[None, :] == idx[:, None]))[:, None]
