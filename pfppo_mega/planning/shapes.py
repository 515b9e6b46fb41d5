"""Megatron layout rules, as arithmetic: rank coordinates, process groups, parameter shapes.

Rank order is megatron's default "tp-cp-ep-dp-pp" (cp = ep = 1 here):

    rank = tp_rank + tp * (dp_rank + dp * pp_rank)

so a tensor-parallel group is ``tp`` consecutive ranks (one node when tp = GPUs per node), data
parallel strides by ``tp`` and pipeline stages are the outermost factor.

Parameter shapes per rank are ``pfppo_mega.families.DecoderShape.megatron_shapes`` (megatron-core
0.16.1's GPTModel with the local layer spec that ``pfppo_mega.models.gpt`` builds), names as in
``model.named_parameters()``: layers i = 0 .. L/pp - 1 (local) on each stage, the embedding on the
first, the final norm and output_layer on the last (the LM head, absent when tied and pp = 1: the
embedding serves; or the critic's value head [1, h]). Only the standard library is imported here
(and ``pfppo_mega.families``, which imports torch only to compute RoPE frequencies).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from pfppo_mega.families import DecoderShape, Head, indivisible_dimensions


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


def layout_problems(shape: DecoderShape, layout: Layout) -> list[str]:
    """Divisibility rules megatron-core asserts when it builds the model; [] when all hold.

    The vocabulary needs none: pfppo_mega.models pads it to a multiple of tp (zero rows)."""
    by = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size"}
    return [f"{name}({n}) must be divisible by {by[factor]}({k})"
            for name, n, factor, k in indivisible_dimensions(shape, tp=layout.tp, pp=layout.pp)]


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


def param_shapes(shape: DecoderShape, tp: int, pp: int, pp_rank: int, head: Head = "lm") -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter a rank at (any tp rank, stage ``pp_rank``) holds.

    ``head`` "lm": the actor (LM head, tied or not); "value": the critic (ValueHead [1, h], never
    tied). Tensor-parallel ranks of one stage hold the same shapes."""
    local = range(len(stage_layers(shape.num_layers, pp, pp_rank)))
    output = "value" if head == "value" else (None if shape.tie_word_embeddings and pp == 1 else "lm")
    return shape.megatron_shapes(local, first=pp_rank == 0, last=pp_rank == pp - 1, head=output, tp=tp)


def count(shapes: dict[str, tuple[int, ...]]) -> int:
    return sum(prod(v) for v in shapes.values())


def stage_param_count(shape: DecoderShape, tp: int, pp: int, pp_rank: int, head: Head = "lm") -> int:
    """Parameters held by one rank of stage ``pp_rank``."""
    return count(param_shapes(shape, tp, pp, pp_rank, head))


def total_param_count(shape: DecoderShape, head: Head = "lm") -> int:
    """Parameters of the whole model (tp = pp = 1)."""
    return stage_param_count(shape, 1, 1, 0, head)


def engine_param_count(shape: DecoderShape, rollout_tp: int) -> int:
    """Parameters per GPU of a rollout engine with tensor parallelism ``rollout_tp`` and no pipeline.

    As megatron's tp = rollout_tp, pp = 1 layout, except that a vLLM-style engine replicates KV
    heads when rollout_tp > num_query_groups (each GPU keeps ``shape.kv_heads(rollout_tp)`` of them).
    """
    head = None if shape.tie_word_embeddings else "lm"
    return count(shape.megatron_shapes(range(shape.num_layers), first=True, last=True, head=head, tp=rollout_tp))
