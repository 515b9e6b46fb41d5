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
real tokens, and a padded query attends to itself alone so no softmax row is empty. Generation's
prefill (`LlamaDecoder.prefill`) computes no padding: the matmuls run on the prompts' tokens packed
into one sequence, attention runs row by row, and each row's keys/values land in its left-padded
cache slots.

q/k/v of a layer are one matmul, and gate/up one: their Hugging Face-named parameters are row views
of one fused weight (`qkv_weight` [(H + 2G) * D, E], `gate_up_weight` [2 * F, E]), so an in-place
copy into a named parameter (a refit, load_state_dict) updates the fused weight. Never rebind
those parameters (`.to()`, `load_state_dict(assign=True)`): build the decoder on its device.

`LlamaDecoder.pack()` adds oneDNN-prepacked copies of the matmul weights (CPU, fp32;
pfppo_mega.compat.onednn): ~2x the matmul rate of F.linear on this project's CPU, at the price of a
second copy of the weights. On fp32 CPU tensors the RMSNorms, RoPE and SwiGLU run as the fused kernels
of pfppo_mega.kernels.layers (one pass each instead of 3-8 torch ops; the formulas above are their
fallback). A pack is a snapshot: after any write to the weights call `unpack()`
(the engine does, in its weight-update hooks) or the decoder keeps computing with the old ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pfppo_mega.compat import onednn
from pfppo_mega.families import DecoderShape, RopeScaling, rope_inv_freq
from pfppo_mega.kernels import layers as kl


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


def _fuse(modules: list[nn.Linear], attr: str) -> torch.Tensor | None:
    """Concatenate the modules' ``attr`` (weight or bias) along dim 0 into one tensor and rebind each
    module's parameter to its row view of it. -> the fused tensor (None when the modules have none)."""
    parts = [getattr(m, attr) for m in modules]
    if parts[0] is None:
        return None
    fused = torch.cat([p.detach() for p in parts])
    row = 0
    for m, p in zip(modules, parts):
        setattr(m, attr, nn.Parameter(fused[row:row + p.shape[0]], requires_grad=False))
        row += p.shape[0]
    return fused


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., E] -> [..., E]
        if kl.usable(x, self.weight):  # fp32 on a CPU: one fused pass (pfppo_mega.kernels.layers)
            return kl.rms_norm(x, self.weight, self.eps)
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
    def __init__(self, shape: DecoderShape, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        E, D, eps = shape.hidden_size, shape.head_dim, shape.norm_epsilon
        self.num_heads, self.num_kv_heads, self.head_dim = shape.num_attention_heads, shape.num_query_groups, D
        bias = shape.arch.qkv_bias  # on q/k/v only (Qwen2); o_proj never has one
        kw = dict(dtype=dtype, device=device)
        self.q_proj = nn.Linear(E, self.num_heads * D, bias=bias, **kw)
        self.k_proj = nn.Linear(E, self.num_kv_heads * D, bias=bias, **kw)
        self.v_proj = nn.Linear(E, self.num_kv_heads * D, bias=bias, **kw)
        self.o_proj = nn.Linear(self.num_heads * D, E, bias=False, **kw)
        # one [(H + 2G) * D, E] matmul instead of three (plain attributes: not extra parameters)
        self.qkv_weight = _fuse([self.q_proj, self.k_proj, self.v_proj], "weight")
        self.qkv_bias = _fuse([self.q_proj, self.k_proj, self.v_proj], "bias")
        self.packed: dict[str, torch.Tensor] = {}  # oneDNN copies of qkv_weight / o_proj.weight (LlamaDecoder.pack)
        self.qk_norm = shape.arch.qk_norm  # per-head RMSNorm of queries and keys before RoPE (Qwen3)
        if self.qk_norm:
            self.q_norm = RMSNorm(D, eps, dtype, device)
            self.k_norm = RMSNorm(D, eps, dtype, device)

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, S, E] -> q [B, H, S, D], k and v [B, G, S, D], RoPE applied to q and k."""
        H, G, D = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = onednn.linear(x, self.qkv_weight, self.qkv_bias, self.packed.get("qkv"))
        q, k, v = qkv.split([H * D, G * D, G * D], dim=-1)
        q, k, v = q.unflatten(-1, (H, D)), k.unflatten(-1, (G, D)), v.unflatten(-1, (G, D))  # [B, S, *, D]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if kl.usable(q, cos):  # fp32 on a CPU: RoPE as one fused pass over [B * S, heads, D]
            B, S = q.shape[:2]
            c, s = cos.reshape(B * S, D), sin.reshape(B * S, D)  # [B, 1, S, D] -> [B * S, D]
            q = kl.rope(q.reshape(B * S, H, D), c, s).view(B, S, H, D)
            k = kl.rope(k.reshape(B * S, G, D), c, s).view(B, S, G, D)
            return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q = q * cos + rotate_half(q) * sin  # [B, H, S, D]
        k = k * cos + rotate_half(k) * sin  # [B, G, S, D]
        return q, k, v

    def _out(self, out: torch.Tensor) -> torch.Tensor:  # [B, H, S, D] -> [B, S, E]
        B, _, S, _ = out.shape
        out = out.transpose(1, 2).reshape(B, S, self.num_heads * self.head_dim)
        return onednn.linear(out, self.o_proj.weight, None, self.packed.get("o"))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor] | None,
                start: int) -> torch.Tensor:
        """x [B, S, E]; cos/sin [B, 1, S, D]; mask [B, 1, S, K] bool (True = may attend).

        kv: this layer's cache (k, v), each [B, G, max_len, D]; the new keys/values go to
        slots start..start+S-1 and the queries attend to slots 0..K-1 with K = start + S.
        Without a cache the queries attend to the S new keys only (start must be 0).
        """
        S = x.shape[1]
        q, k, v = self._qkv(x, cos, sin)
        if kv is not None:
            k_cache, v_cache = kv
            k_cache[:, :, start:start + S] = k
            v_cache[:, :, start:start + S] = v
            k, v = k_cache[:, :, :start + S], v_cache[:, :, :start + S]  # [B, G, K, D]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        return self._out(out)

    def forward_packed(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, lengths: list[int],
                       kv: tuple[torch.Tensor, torch.Tensor], end: int) -> torch.Tensor:
        """x [1, N, E]: B prompts packed (row b's tokens next, lengths[b] of them); cos/sin [1, 1, N, D].
        Each row attends causally to its own tokens; its keys/values go to cache slots
        end - lengths[b] .. end - 1 of cache row b (kv: each [B, G, max_len, D])."""
        q, k, v = self._qkv(x, cos, sin)  # [1, H | G, N, D]
        k_cache, v_cache = kv
        outs, row = [], 0
        for b, n in enumerate(lengths):
            kb, vb = k[:, :, row:row + n], v[:, :, row:row + n]  # [1, G, n, D]
            k_cache[b, :, end - n:end] = kb[0]
            v_cache[b, :, end - n:end] = vb[0]
            outs.append(F.scaled_dot_product_attention(q[:, :, row:row + n], kb, vb, is_causal=True,
                                                       enable_gqa=self.num_heads != self.num_kv_heads))
            row += n
        return self._out(torch.cat(outs, dim=2))  # [1, N, E]


class MLP(nn.Module):
    def __init__(self, shape: DecoderShape, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        E, F_ = shape.hidden_size, shape.ffn_hidden_size
        kw = dict(bias=False, dtype=dtype, device=device)
        self.gate_proj = nn.Linear(E, F_, **kw)
        self.up_proj = nn.Linear(E, F_, **kw)
        self.down_proj = nn.Linear(F_, E, **kw)
        self.gate_up_weight = _fuse([self.gate_proj, self.up_proj], "weight")  # [2F, E]: one matmul
        self.packed: dict[str, torch.Tensor] = {}  # oneDNN copies of gate_up_weight / down_proj.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, S, E] -> [B, S, E]
        h = onednn.linear(x, self.gate_up_weight, None, self.packed.get("gate_up"))  # [B, S, 2F]: gate, up
        return onednn.linear(kl.swiglu(h), self.down_proj.weight, None, self.packed.get("down"))


class DecoderLayer(nn.Module):
    def __init__(self, shape: DecoderShape, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.self_attn = Attention(shape, dtype, device)
        self.mlp = MLP(shape, dtype, device)
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.norm_epsilon, dtype, device)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.norm_epsilon, dtype, device)

    def forward(self, x, cos, sin, mask, kv, start):  # [B, S, E] -> [B, S, E]
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, kv, start)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_packed(self, x, cos, sin, lengths, kv, end):  # [1, N, E] -> [1, N, E]
        x = x + self.self_attn.forward_packed(self.input_layernorm(x), cos, sin, lengths, kv, end)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):
    """Holds the `model.*` parameters, so names match Hugging Face's LlamaModel."""

    def __init__(self, shape: DecoderShape, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(DecoderLayer(shape, dtype, device) for _ in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.norm_epsilon, dtype, device)


class LlamaDecoder(nn.Module):
    """Inference-only decoder; `named_parameters()` yields exactly shape.hf_shapes()."""

    def __init__(self, shape: DecoderShape, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.shape = shape
        self.model = _Body(shape, dtype, device)  # built on its device: .to() would unshare the fused weights
        if not shape.tie_word_embeddings:
            self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False, dtype=dtype, device=device)
        self.requires_grad_(False)
        self.packed: dict[str, torch.Tensor] = {}  # the LM head's oneDNN copy

    def pack(self, batch_hint: int) -> bool:
        """Make oneDNN-prepacked copies of every matmul weight (see the module docstring); -> whether
        it did (CPU fp32 with a torch that has the operators; otherwise the decoder stays on F.linear)."""
        weight = self.lm_head_weight()
        if weight.device.type != "cpu" or not onednn.available(weight.dtype):
            return False
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.packed = {"qkv": onednn.pack(attn.qkv_weight, batch_hint=batch_hint),
                           "o": onednn.pack(attn.o_proj.weight, batch_hint=batch_hint)}
            mlp.packed = {"gate_up": onednn.pack(mlp.gate_up_weight, batch_hint=batch_hint),
                          "down": onednn.pack(mlp.down_proj.weight, batch_hint=batch_hint)}
        self.packed = {"head": onednn.pack(weight, batch_hint=batch_hint)}
        return True

    def unpack(self) -> None:
        """Drop the packed copies: back to F.linear on the weights themselves."""
        for layer in self.model.layers:
            layer.self_attn.packed, layer.mlp.packed = {}, {}
        self.packed = {}

    def _head(self, x: torch.Tensor) -> torch.Tensor:  # [..., E] -> [..., V]
        return onednn.linear(self.model.norm(x), self.lm_head_weight(), None, self.packed.get("head"))

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
        return self._head(x)

    def prefill(self, prompts: list[list[int]], cache: KVCache, end: int) -> torch.Tensor:
        """Prompts (token ids, row b of the cache each) -> logits [B, V] at each prompt's last token.
        Row b's keys/values fill cache slots end - len(prompts[b]) .. end - 1 (the left-padded layout
        `forward` continues from); no padding is computed."""
        dev = self.model.embed_tokens.weight.device
        lengths = [len(p) for p in prompts]
        ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=dev)[None]  # [1, N]
        pos = torch.cat([torch.arange(n, device=dev) for n in lengths])[None]                  # [1, N]
        x = self.model.embed_tokens(ids)                                                       # [1, N, E]
        cos, sin = rope_cos_sin(pos, self.shape.head_dim, self.shape.rope_theta, x.dtype, self.shape.arch.rope)
        for i, layer in enumerate(self.model.layers):
            x = layer.forward_packed(x, cos, sin, lengths, (cache.k[i], cache.v[i]), end)
        last = torch.tensor(lengths, device=dev).cumsum(0) - 1                                 # [B]
        return self._head(x[0, last])                                                          # [B, V]


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
