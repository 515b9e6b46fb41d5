"""Rollout split across every engine: each row of a step is generated once in the job.

The ranks of one model replica (its TP ranks and pipeline stages, same dp_rank) train on the same
rows. Without a split every one of them would run its engine on the same prompts (tp x pp / rollout
TP times the work, and nothing would check the copies agree). Instead:

    1. the replicas' requests (prompts, base seed) are exchanged; every rank checks every rank's
       against its replica leader's (a rank that disagrees is a named error, raised on all ranks at
       once, never a silent mix nor a leader left waiting);
    2. the job's rows, in dp_rank order, are cut into world / rollout_tp contiguous shares, one per
       engine (the rollout_tp consecutive ranks of one engine submit the same share);
    3. each engine generates its share, a call per replica segment in it, seeded row by row
       (row_seed(the job's seed, the row's index in the job's rows)), so a row's response does not
       depend on which engine drew it, nor on the DP size: every replica draws the same seed from
       the job's prompt stream, and a DP2 run's rows (replica 0's, then replica 1's) are a DP1
       run's rows in order;
    4. the shares are exchanged and every rank keeps its replica's rows, in order; copies of one
       share (the ranks of a rollout-TP engine) are hash-checked against each other.

The planning part (shares, segments) is plain Python; the exchange runs on the world group.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.distributed as dist

from pfppo_mega.rollout import SamplingParams
from pfppo_mega.rollout.base import RolloutOutput


class RolloutMismatchError(RuntimeError):
    """Ranks that must agree on a rollout (one replica's request, one engine's output) do not."""


def shares(rows: int, engines: int) -> list[tuple[int, int]]:
    """[lo, hi) of each engine's contiguous share of ``rows`` (the first rows % engines get one more)."""
    base, extra = divmod(rows, engines)
    out, lo = [], 0
    for e in range(engines):
        hi = lo + base + (e < extra)
        out.append((lo, hi))
        lo = hi
    return out


def segments(lo: int, hi: int, starts: list[int]) -> list[tuple[int, int, int]]:
    """The parts of global rows [lo, hi) per replica: (replica, first row in the replica, count).
    ``starts``: each replica's first global row, plus the total at the end."""
    out = []
    for d in range(len(starts) - 1):
        a, b = max(lo, starts[d]), min(hi, starts[d + 1])
        if a < b:
            out.append((d, a - starts[d], b - a))
    return out


@dataclass(frozen=True)
class SplitLayout:
    world: int
    rank: int
    rollout_tp: int
    dp_rank: int
    replica_leader: bool   # tp_rank == pp_rank == 0: its request stands for the replica

    @property
    def engines(self) -> int:
        return self.world // self.rollout_tp

    @property
    def engine(self) -> int:
        return self.rank // self.rollout_tp


def _digest(*tensors: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _pad(t: torch.Tensor, width: int, value) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)


@dataclass
class Share:
    """What this rank's engine generates: one (replica, first row, prompts, params) per segment."""

    calls: list[tuple[int, int, list[list[int]], SamplingParams]]


def check_requests(everyone: list, what: str) -> dict[int, tuple[list[list[int]], int]]:
    """{dp_rank: (prompts, seed)} of each replica's leader, from every rank's request (world rank
    order). Every rank checks every rank's request against its leader's, so a disagreement raises
    RolloutMismatchError on all ranks at once (a check of one's own request alone left the leader
    generating, waiting for its peers in the next collective)."""
    leaders = {d: (p, s) for d, lead, p, s in everyone if lead}
    for rank, (d, _, p, s) in enumerate(everyone):
        if d not in leaders:
            raise RolloutMismatchError(f"{what}: rank {rank} (dp_rank {d}) has no replica leader "
                                       f"(tp_rank = pp_rank = 0) among the ranks")
        if (p, s) != leaders[d]:
            lead_p, lead_s = leaders[d]
            what_differs = "seed" if p == lead_p else f"prompts ({_first_difference(p, lead_p)})"
            raise RolloutMismatchError(
                f"{what}: rank {rank}'s request differs from its replica's leader (dp_rank {d}) in its "
                f"{what_differs}; seeds {s} vs {lead_s}: the ranks of one replica must draw the same prompts and "
                f"seed (after a resume at another layout: every rank of a replica takes that replica's saved "
                f"stream)")
    return leaders


def _first_difference(a: list, b: list) -> str:
    if len(a) != len(b):
        return f"{len(a)} rows vs {len(b)}"
    i = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    return f"row {i} first"


def plan_share(layout: SplitLayout, prompts: list[list[int]], params: SamplingParams, *,
               group: Optional[dist.ProcessGroup] = None, what: str = "rollout") -> Share:
    """Exchange the replicas' requests (collective) and cut this engine's share out of the job's
    rows. ``params.seed`` is the job's seed for this call (the same on every replica)."""
    everyone: list = [None] * layout.world
    dist.all_gather_object(everyone, (layout.dp_rank, layout.replica_leader, prompts, params.seed), group=group)
    return share_of(layout.engine, layout.engines, check_requests(everyone, what), params)


def share_of(engine: int, engines: int, leaders: dict[int, tuple[list[list[int]], int]],
             params: SamplingParams) -> Share:
    """Engine ``engine``'s calls over the job's rows (``leaders``: {dp_rank: (prompts, seed)}, in
    dp_rank order): each call's rows are seeded by their index in the job's rows (row_offset), so
    a row's draw is the same at every DP size."""
    order = sorted(leaders)
    starts = [0]
    for d in order:
        starts.append(starts[-1] + len(leaders[d][0]))
    lo, hi = shares(starts[-1], engines)[engine]
    calls = []
    for k, first, count in segments(lo, hi, starts):
        p, seed = leaders[order[k]]
        calls.append((order[k], first, p[first:first + count],
                      replace(params, seed=seed, row_offset=starts[k] + first)))
    return Share(calls)


def assemble(layout: SplitLayout, share: Share, outputs: list[RolloutOutput], prompts: list[list[int]], *,
             pad_token_id: int, group: Optional[dist.ProcessGroup] = None, what: str = "rollout") -> RolloutOutput:
    """Exchange every engine's outputs (collective) and return this rank's replica's rows in order;
    the copies of one share (a rollout-TP engine's ranks) must be identical."""
    packed = [(d, first, o.responses.cpu(), o.response_mask.cpu(), o.logprobs.cpu(), o.lengths.cpu(),
               o.finished.cpu(), o.weight_version, o.weight_checksum)
              for (d, first, _, _), o in zip(share.calls, outputs)]
    shared: list = [None] * layout.world
    dist.all_gather_object(shared, (layout.engine, packed), group=group)
    by_engine: dict[int, list] = {}
    for engine, part in shared:
        if engine in by_engine and _share_digest(by_engine[engine]) != _share_digest(part):
            raise RolloutMismatchError(f"{what}: the ranks of rollout engine {engine} generated different rows "
                                       f"(rollout TP {layout.rollout_tp}); refusing to mix them")
        by_engine.setdefault(engine, part)
    pieces = [piece for part in by_engine.values() for piece in part]
    for d in sorted({piece[0] for piece in pieces}):  # every replica's, on every rank: all raise together
        versions = {(piece[7], piece[8]) for piece in pieces if piece[0] == d}
        if len(versions) != 1:
            raise RolloutMismatchError(f"{what}: the engines generated replica {d}'s rows with different weights "
                                       f"{sorted(versions)}")
    rows = sorted((piece for piece in pieces if piece[0] == layout.dp_rank), key=lambda piece: piece[1])
    if not prompts:  # a replica with no rows this call (a multi-turn step whose rows here are done)
        version, checksum = (pieces[0][7], pieces[0][8]) if pieces else (-1, "")
        empty = torch.zeros(0, 0)
        return RolloutOutput(prompts=[], responses=empty.long(), response_mask=empty, logprobs=empty,
                             lengths=torch.zeros(0, dtype=torch.long), finished=torch.zeros(0, dtype=torch.bool),
                             weight_version=version, weight_checksum=checksum)
    if not rows:
        raise RolloutMismatchError(f"{what}: no engine generated rows of replica {layout.dp_rank}")
    version, checksum = rows[0][7], rows[0][8]
    width = max(piece[2].shape[1] for piece in rows)

    def cat(i: int, fill) -> torch.Tensor:
        return torch.cat([_pad(piece[i], width, fill) for piece in rows])

    return RolloutOutput(prompts=[list(p) for p in prompts], responses=cat(2, pad_token_id),
                         response_mask=cat(3, 0.0), logprobs=cat(4, 0.0),
                         lengths=torch.cat([piece[5] for piece in rows]),
                         finished=torch.cat([piece[6] for piece in rows]),
                         weight_version=version, weight_checksum=checksum)


def _share_digest(part: list) -> str:
    return _digest(*[t for piece in part for t in piece[2:7]])
