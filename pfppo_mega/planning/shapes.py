"""Megatron layout rules, as arithmetic: rank coordinates, process groups, parameter shapes.

Rank order is megatron's default "tp-cp-ep-dp-pp" (cp = ep = 1 here):

    rank = tp_rank + tp * (dp_rank + dp * pp_rank)

so a tensor-parallel group is ``tp`` consecutive ranks (one node when tp = GPUs per node), data
parallel strides by ``tp`` and pipeline stages are the outermost factor.

Parameter shapes and counts per rank (pfppo_mega.ledger, re-exported here) are ``pfppo_mega.families.DecoderShape.megatron_shapes`` (megatron-core
0.16.1's GPTModel with the local layer spec that ``pfppo_mega.models.gpt`` builds), names as in
``model.named_parameters()``: layers i = 0 .. L/pp - 1 (local) on each stage, the embedding on the
first, the final norm and output_layer on the last (the LM head, absent when tied and pp = 1: the
embedding serves; or the critic's value head [1, h]). Only the standard library is imported here
(and ``pfppo_mega.families``, which imports torch only to compute RoPE frequencies).
"""

from __future__ import annotations

from dataclasses import dataclass

from pfppo_mega.families import DecoderShape, indivisible_dimensions
from pfppo_mega.ledger import (  # noqa: F401  (the counts live with the memory ledger; re-exported)
    Layout, count, engine_param_count, param_shapes, stage_layers, stage_param_count, total_param_count,
)


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
