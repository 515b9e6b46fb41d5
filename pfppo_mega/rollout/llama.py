"""Pure-torch Llama / Qwen2 / Qwen3 / Mistral decoder for generation, parameters under Hugging Face names.

Notation: B batch, S query length, K key length (cache slots in use), H query heads,
G key/value heads (H % G == 0), D head_dim, E hidden_size, V vocab_size, L layers; the sizes and
the family's features are a pfppo_mega.families.DecoderShape.

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

import torch
import torch.nn.functional as F
from torch import nn

from pfppo_mega.families import DecoderShape, RopeScaling, rope_inv_freq


@dataclass
class KVCache:
    """Keys/values of every layer, preallocated for the whole generation."""

    k: torch.Tensor  # [L, B, G, max_len, D]
    v: torch.Tensor  # [L, B, G, max_len, D]

    @classmethod
    def allocate(cls, shape: DecoderShape, batch: int, max_len: int, *,
                 dtype: torch.dtype, device: torch.device) -> KVCache:
        size = (shape.num_layers, batch, shape.num_query_groups, max_len, shape.head_dim)
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
    def __init__(self, shape: DecoderShape, dtype: torch.dtype) -> None:
        super().__init__()
        E, D, eps = shape.hidden_size, shape.head_dim, shape.norm_epsilon
        self.num_heads, self.num_kv_heads, self.head_dim = shape.num_attention_heads, shape.num_query_groups, D
        bias = shape.arch.qkv_bias  # on q/k/v only (Qwen2); o_proj never has one
        self.q_proj = nn.Linear(E, self.num_heads * D, bias=bias, dtype=dtype)
        self.k_proj = nn.Linear(E, self.num_kv_heads * D, bias=bias, dtype=dtype)
        self.v_proj = nn.Linear(E, self.num_kv_heads * D, bias=bias, dtype=dtype)
        self.o_proj = nn.Linear(self.num_heads * D, E, bias=False, dtype=dtype)
        self.qk_norm = shape.arch.qk_norm  # per-head RMSNorm of queries and keys before RoPE (Qwen3)
        if self.qk_norm:
            self.q_norm = RMSNorm(D, eps, dtype)
            self.k_norm = RMSNorm(D, eps, dtype)

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
    def __init__(self, shape: DecoderShape, dtype: torch.dtype) -> None:
        super().__init__()
        E, F_ = shape.hidden_size, shape.ffn_hidden_size
        self.gate_proj = nn.Linear(E, F_, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(E, F_, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(F_, E, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, S, E] -> [B, S, E]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, shape: DecoderShape, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = Attention(shape, dtype)
        self.mlp = MLP(shape, dtype)
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.norm_epsilon, dtype)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.norm_epsilon, dtype)

    def forward(self, x, cos, sin, mask, kv, start):  # [B, S, E] -> [B, S, E]
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, kv, start)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):
    """Holds the `model.*` parameters, so names match Hugging Face's LlamaModel."""

    def __init__(self, shape: DecoderShape, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(shape, dtype) for _ in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.norm_epsilon, dtype)


class LlamaDecoder(nn.Module):
    """Inference-only decoder; `named_parameters()` yields exactly shape.hf_shapes()."""

    def __init__(self, shape: DecoderShape, dtype: torch.dtype = torch.float32,
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
        cos, sin = rope_cos_sin(position_ids, self.shape.head_dim, self.shape.rope_theta, x.dtype, self.shape.arch.rope)
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
