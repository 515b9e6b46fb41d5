"""LiveWeights: the trainer's megatron TP x PP shards, resharded into an engine's layout bucket by bucket.

Bucket b holds whole fused groups of one pipeline stage p (the plan never crosses a stage
boundary). Its owner is the rank with (pp = p, tp = 0, dp = 0). To produce it, the ranks of that
rank's tensor-parallel group send their shards of the bucket's megatron tensors to it (one
``gather`` of a flat buffer on the TP group); the owner unshards them (pfppo_mega.models.reshard),
converts them to Hugging Face names (q/k/v split out of linear_qkv, gate/up out of linear_fc1,
vocabulary padding dropped), casts to the engine dtype and packs the bucket. Then the bucket is
broadcast from the owner to every rank (pfppo_mega.rollout.refit). No rank ever holds more than
one bucket of gathered weights; other data-parallel replicas send nothing.
"""

from __future__ import annotations

import re
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from pfppo_mega.models import lora, reshard
from pfppo_mega.rollout.source import WeightSource
from pfppo_mega.rollout.weights import Bucket, BucketSpec, WeightLayout, plan_buckets

_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# HF suffix of a layer tensor -> (megatron suffix, how to cut it out of the full megatron tensor)
_LAYER_RULES: dict[str, tuple[str, str]] = {
    "input_layernorm.weight": ("input_layernorm.weight", "same"),
    "self_attn.q_proj.weight": ("self_attention.linear_qkv.weight", "q"),
    "self_attn.k_proj.weight": ("self_attention.linear_qkv.weight", "k"),
    "self_attn.v_proj.weight": ("self_attention.linear_qkv.weight", "v"),
    "self_attn.q_proj.bias": ("self_attention.linear_qkv.bias", "q"),
    "self_attn.k_proj.bias": ("self_attention.linear_qkv.bias", "k"),
    "self_attn.v_proj.bias": ("self_attention.linear_qkv.bias", "v"),
    "self_attn.q_norm.weight": ("self_attention.q_layernorm.weight", "same"),  # Qwen3
    "self_attn.k_norm.weight": ("self_attention.k_layernorm.weight", "same"),
    "self_attn.o_proj.weight": ("self_attention.linear_proj.weight", "same"),
    "post_attention_layernorm.weight": ("pre_mlp_layernorm.weight", "same"),
    "mlp.gate_proj.weight": ("mlp.linear_fc1.weight", "gate"),
    "mlp.up_proj.weight": ("mlp.linear_fc1.weight", "up"),
    "mlp.down_proj.weight": ("mlp.linear_fc2.weight", "same"),
}


def megatron_source(hf_name: str, *, tied: bool) -> tuple[str, str]:
    """(global megatron name, cut) that HF tensor ``hf_name`` comes from."""
    if hf_name == "model.embed_tokens.weight":
        return "embedding.word_embeddings.weight", "vocab"
    if hf_name == "lm_head.weight":
        return ("embedding.word_embeddings.weight" if tied else "output_layer.weight"), "vocab"
    if hf_name == "model.norm.weight":
        return "decoder.final_layernorm.weight", "same"
    m = _HF_LAYER.match(hf_name)
    if m is None or m.group(2) not in _LAYER_RULES:
        raise KeyError(f"no megatron parameter maps to HF tensor {hf_name!r}")
    suffix, cut = _LAYER_RULES[m.group(2)]
    return f"decoder.layers.{m.group(1)}.{suffix}", cut


def stage_of(hf_name: str, num_layers: int, pp: int) -> int:
    """Pipeline stage that holds the megatron source of ``hf_name``."""
    if hf_name == "model.embed_tokens.weight":
        return 0
    m = _HF_LAYER.match(hf_name)
    if m is None:  # final norm, LM head
        return pp - 1
    return int(m.group(1)) // (num_layers // pp)


class LiveWeights(WeightSource):
    """The actor's current weights as buckets in ``layout`` (see the module docstring).

    actor: the (possibly DDP / Float16-wrapped) megatron GPTModel of this rank; model_cfg: its
    ModelConfig; tp/pp/dp ranks from megatron's parallel state. Call ``plan(bucket_bytes)`` for a
    bucket plan that respects stage boundaries and give the same plan to every rank.
    """

    def __init__(self, actor: torch.nn.Module, model_cfg, layout: WeightLayout, version: int) -> None:
        from megatron.core import parallel_state as ps

        from pfppo_mega.models.gpt import unwrap

        self.version, self.layout = version, layout
        self.tp = ps.get_tensor_model_parallel_world_size()
        self.pp = ps.get_pipeline_model_parallel_world_size()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        self.stage = reshard.Stage(ps.get_pipeline_model_parallel_rank(), self.pp, model_cfg.num_layers)
        self.tp_group = ps.get_tensor_model_parallel_group() if self.tp > 1 else None
        self.dp = ps.get_data_parallel_world_size()
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        expected = self.tp_rank + self.tp * (self.dp_rank + self.dp * self.stage.index)
        if self.rank != expected:
            raise RuntimeError(f"rank {self.rank} is not at tp_rank + tp * (dp_rank + dp * pp_rank) = {expected}: "
                               "LiveWeights assumes megatron's tp-cp-ep-dp-pp order")
        self.heads, self.groups = model_cfg.num_attention_heads, model_cfg.num_query_groups
        self.vocab, self.tied = model_cfg.vocab_size, bool(model_cfg.tie_word_embeddings)
        self.num_layers = model_cfg.num_layers
        self.actor = unwrap(actor)
        self.split_names = {self.stage.to_global(n) for n, p in self.actor.named_parameters()
                            if getattr(p, "tensor_model_parallel", False)}
        # LoRA: an adapted linear's weight is read merged (W + s B A of this rank's shards, models/lora.py)
        self.merged = {self.stage.to_global(f"{n}.weight"): m for n, m in lora.adapted(self.actor)}
        self.params = {self.stage.to_global(n): p for n, p in self.actor.named_parameters() if not lora.is_adapter(n)}

    def segment(self, hf_name: str) -> int:
        return stage_of(hf_name, self.num_layers, self.pp)

    def plan(self, bucket_bytes: int) -> list[BucketSpec]:
        return plan_buckets(self.layout, bucket_bytes, segment=self.segment)

    def owner(self, spec: BucketSpec) -> int:
        return self.tp * self.dp * self.segment(spec.names[0])  # (pp = stage, tp = 0, dp = 0)

    def produce(self, spec: BucketSpec, wire: Optional[Tensor] = None) -> Optional[Bucket]:
        if self.dp_rank != 0 or self.segment(spec.names[0]) != self.stage.index:
            return None
        sources = [megatron_source(n, tied=self.tied) for n in spec.names]
        mnames = list(dict.fromkeys(m for m, _ in sources))
        full = self._gather(mnames)
        if full is None:
            return None
        tensors = [self._cut(full[m], cut) for m, cut in sources]
        # q/k/v arrive as strided views of linear_qkv: the pack copies them once, straight into the bucket
        return Bucket.pack(spec, self.version, [t.to(spec.dtype) for t in tensors], source_rank=self.rank, wire=wire)

    def _gather(self, mnames: list[str]) -> Optional[dict[str, Tensor]]:
        """Full tensors of ``mnames`` on tp rank 0 (None on the other tp ranks)."""
        local = {m: lora.merged(self.merged[m]) if m in self.merged else self.params[m].detach() for m in mnames}
        split = [m for m in mnames if m in self.split_names]
        if self.tp == 1 or not split:
            return local if self.tp_rank == 0 else None
        flat = torch.cat([local[m].reshape(-1) for m in split])
        dst = self.rank - self.tp_rank
        pieces = [torch.empty_like(flat) for _ in range(self.tp)] if self.tp_rank == 0 else None
        dist.gather(flat, pieces, dst=dst, group=self.tp_group)
        if self.tp_rank != 0:
            return None
        out, offset = dict(local), 0
        for m in split:
            shape, numel = local[m].shape, local[m].numel()
            out[m] = reshard.unshard([p[offset:offset + numel].view(shape) for p in pieces], reshard.split_of(m))
            offset += numel
        return out

    def _cut(self, full: Tensor, cut: str) -> Tensor:
        if cut == "same":
            return full
        if cut == "vocab":
            return full[:self.vocab]
        if cut in ("gate", "up"):
            return full.chunk(2, dim=0)[0 if cut == "gate" else 1]
        # split_qkv's views before its reshape (which would copy): [groups, rows per group, ...]
        rest = tuple(full.shape[1:])
        d = full.shape[0] // (self.heads + 2 * self.groups)
        per_group = full.reshape(self.groups, (self.heads // self.groups + 2) * d, *rest)
        q, k, v = torch.split(per_group, [self.heads // self.groups * d, d, d], dim=1)
        return {"q": q, "k": k, "v": v}[cut]

