"""Megatron layout rules, as arithmetic: rank coordinates, process groups, parameter shapes.

Rank order is megatron's default "tp-cp-ep-dp-pp" (cp = ep = 1 here):

    rank = tp_rank + tp * (dp_rank + dp * pp_rank)

so a tensor-parallel group is ``tp`` consecutive ranks (one node when tp = GPUs per node), data
parallel strides by ``tp`` and pipeline stages are the outermost factor.

Parameter shapes per rank follow megatron-core 0.16.1's GPTModel with the local layer spec
(the spec ``pfppo_mega.models.gpt`` builds), names as in ``model.named_parameters()``:

    embedding.word_embeddings.weight               [ceil(V/tp), h]    first stage (V padded to a
                                                                      multiple of tp, as pfppo_mega.models does)
    decoder.layers.{i}.input_layernorm.weight      [h]                i = 0 .. L/pp - 1 (local)
    decoder.layers.{i}.self_attention.linear_qkv   [(a + 2g) d / tp, h]   column parallel
    decoder.layers.{i}.self_attention.linear_proj  [h, a d / tp]          row parallel
    decoder.layers.{i}.self_attention.{q,k}_layernorm.weight  [d]    Qwen3's q/k RMSNorm (replicated)
    decoder.layers.{i}.pre_mlp_layernorm.weight    [h]
    decoder.layers.{i}.mlp.linear_fc1.weight       [2 f / tp, h]      [gate; up], column parallel
    decoder.layers.{i}.mlp.linear_fc2.weight       [h, f / tp]        row parallel
    decoder.final_layernorm.weight                 [h]                last stage
    output_layer.weight                            [ceil(V/tp), h]    last stage, LM head (absent when
                                                                      tied and pp = 1: the embedding serves)
                                                   [1, h]             critic value head (replicated)

h = hidden_size, f = ffn_hidden_size, a = attention heads, g = query groups (KV heads),
d = head_dim (h / a unless the checkpoint sets it, as Qwen3 does), V = vocab_size, L = num_layers.
RoPE scaling adds no parameters. Only the standard library is imported here.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Literal, Optional

Head = Literal["lm", "value"]


@dataclass(frozen=True)
class ModelShape:
    """The dimensions that size a Llama-style decoder."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    vocab_size: int
    tie_word_embeddings: bool
    kv_channels: Optional[int] = None  # head_dim when the checkpoint sets one (None: h / a)
    qk_norm: bool = False              # per-head q/k RMSNorm (Qwen3)

    @property
    def head_dim(self) -> int:
        return self.kv_channels if self.kv_channels is not None else self.hidden_size // self.num_attention_heads

    @classmethod
    def from_model_config(cls, model, arch=None) -> "ModelShape":
        """From a ``pfppo_mega.config.tree.ModelConfig`` whose shape fields are all set, and the
        checkpoint's ``pfppo_mega.families.Architecture`` (None: plain Llama)."""
        missing = [k for k in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                               "num_query_groups", "vocab_size", "tie_word_embeddings")
                   if getattr(model, k) is None]
        if missing:
            raise ValueError(f"model shape incomplete (unset: {', '.join(missing)}); the planner needs "
                             "every shape field in the config's model section")
        return cls(model.num_layers, model.hidden_size, model.ffn_hidden_size,
                   model.num_attention_heads, model.num_query_groups, model.vocab_size,
                   bool(model.tie_word_embeddings),
                   None if arch is None else arch.head_dim, bool(arch is not None and arch.qk_norm))


@dataclass(frozen=True)
class Layout:
    """Megatron parallel degrees; world size = tp * pp * dp."""

    tp: int
    pp: int
    dp: int

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @classmethod
    def for_world(cls, world_size: int, tp: int, pp: int) -> "Layout":
        if world_size % (tp * pp):
            raise ValueError(f"tp({tp}) * pp({pp}) = {tp * pp} does not divide the world size ({world_size})")
        return cls(tp, pp, world_size // (tp * pp))


@dataclass(frozen=True)
class RankCoords:
    rank: int
    tp_rank: int
    dp_rank: int
    pp_rank: int


def layout_problems(shape: ModelShape, layout: Layout) -> list[str]:
    """Divisibility rules megatron-core asserts when it builds the model; [] when all hold.

    The vocabulary needs none: pfppo_mega.models pads it to a multiple of tp (zero rows)."""
    s, tp, pp = shape, layout.tp, layout.pp
    rules = [
        (s.num_attention_heads, tp, "num_attention_heads", "tensor_model_parallel_size"),
        (s.num_query_groups, tp, "num_query_groups", "tensor_model_parallel_size"),
        (s.ffn_hidden_size, tp, "ffn_hidden_size", "tensor_model_parallel_size"),
        (s.num_layers, pp, "num_layers", "pipeline_model_parallel_size"),
    ]
    return [f"{name}({n}) must be divisible by {by}({k})" for n, k, name, by in rules if n % k]


def rank_coords(rank: int, layout: Layout) -> RankCoords:
    """Coordinates of ``rank`` under megatron's "tp-cp-ep-dp-pp" order."""
    if not 0 <= rank < layout.world_size:
        raise ValueError(f"rank({rank}) must be in [0, {layout.world_size}) for tp={layout.tp} "
                         f"pp={layout.pp} dp={layout.dp}")
    return RankCoords(rank, rank % layout.tp, (rank // layout.tp) % layout.dp,
                      rank // (layout.tp * layout.dp))


def rank_of(tp_rank: int, dp_rank: int, pp_rank: int, layout: Layout) -> int:
    return tp_rank + layout.tp * (dp_rank + layout.dp * pp_rank)


def group_ranks(rank: int, layout: Layout) -> dict[str, list[int]]:
    """The ranks of each megatron group that ``rank`` belongs to.

    tensor: same (dp, pp), all tp ranks; data: same (tp, pp); pipeline: same (tp, dp), all stages;
    embedding: first and last stage of that pipeline (they sync the embedding / LM head grads
    when the weights are tied; megatron builds the group in every case)."""
    c = rank_coords(rank, layout)
    pipeline = [rank_of(c.tp_rank, c.dp_rank, p, layout) for p in range(layout.pp)]
    return {
        "tensor": [rank_of(t, c.dp_rank, c.pp_rank, layout) for t in range(layout.tp)],
        "data": [rank_of(c.tp_rank, d, c.pp_rank, layout) for d in range(layout.dp)],
        "pipeline": pipeline,
        "embedding": sorted({pipeline[0], pipeline[-1]}),
    }


def stage_layers(num_layers: int, pp: int, pp_rank: int) -> range:
    """Global indices of the decoder layers on pipeline stage ``pp_rank`` (even split)."""
    per = num_layers // pp
    return range(pp_rank * per, (pp_rank + 1) * per)


def param_shapes(shape: ModelShape, tp: int, pp: int, pp_rank: int, head: Head = "lm") -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter a rank at (any tp rank, stage ``pp_rank``) holds.

    ``head`` "lm": the actor (LM head, tied or not); "value": the critic (ValueHead [1, h], never
    tied). Tensor-parallel ranks of one stage hold the same shapes."""
    s = shape
    h, d, a, g, f, V = s.hidden_size, s.head_dim, s.num_attention_heads, s.num_query_groups, s.ffn_hidden_size, s.vocab_size
    first, last = pp_rank == 0, pp_rank == pp - 1
    vocab_rows = -(-V // tp)  # V padded to a multiple of tp (pfppo_mega.models.reshard), split
    out: dict[str, tuple[int, ...]] = {}
    if first:
        out["embedding.word_embeddings.weight"] = (vocab_rows, h)
    for i in range(len(stage_layers(s.num_layers, pp, pp_rank))):
        p = f"decoder.layers.{i}."
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "self_attention.linear_proj.weight"] = (h, a * d // tp)
        out[p + "self_attention.linear_qkv.weight"] = ((a + 2 * g) * d // tp, h)
        if s.qk_norm:
            out[p + "self_attention.q_layernorm.weight"] = (d,)
            out[p + "self_attention.k_layernorm.weight"] = (d,)
        out[p + "pre_mlp_layernorm.weight"] = (h,)
        out[p + "mlp.linear_fc1.weight"] = (2 * f // tp, h)
        out[p + "mlp.linear_fc2.weight"] = (h, f // tp)
    if last:
        out["decoder.final_layernorm.weight"] = (h,)
        if head == "value":
            out["output_layer.weight"] = (1, h)
        elif not (s.tie_word_embeddings and pp == 1):
            out["output_layer.weight"] = (vocab_rows, h)  # untied head, or the tied copy on the last stage
    return out


def count(shapes: dict[str, tuple[int, ...]]) -> int:
    return sum(prod(v) for v in shapes.values())


def stage_param_count(shape: ModelShape, tp: int, pp: int, pp_rank: int, head: Head = "lm") -> int:
    """Parameters held by one rank of stage ``pp_rank``."""
    return count(param_shapes(shape, tp, pp, pp_rank, head))


def total_param_count(shape: ModelShape, head: Head = "lm") -> int:
    """Parameters of the whole model (tp = pp = 1)."""
    return stage_param_count(shape, 1, 1, 0, head)


def engine_param_count(shape: ModelShape, rollout_tp: int) -> int:
    """Parameters per GPU of a rollout engine with tensor parallelism ``rollout_tp`` and no pipeline.

    As megatron's tp = rollout_tp, pp = 1 layout, except that a vLLM-style engine replicates KV
    heads when rollout_tp > num_query_groups (each GPU keeps max(1, g / rollout_tp) of them).
    """
    s, rt = shape, rollout_tp
    h, d, a, f, V = s.hidden_size, s.head_dim, s.num_attention_heads, s.ffn_hidden_size, s.vocab_size
    kv = max(1, s.num_query_groups // rt)
    per_layer = 2 * h + (a // rt + 2 * kv) * d * h + h * (a // rt) * d + 3 * (f // rt) * h + 2 * d * s.qk_norm
    heads = -(-V // rt) * h * (1 if s.tie_word_embeddings else 2)  # vocab rows split, rounded up
    return s.num_layers * per_layer + heads + h
