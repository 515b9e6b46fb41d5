"""Each new version's weight file from a trainer of any layout (TP x PP x DP): the full Hugging Face
layout in the engine's checksummed buckets (weightfile.py), written once, by global rank 0.

The engine's bucket plan never crosses a pipeline stage (rollout.live.LiveWeights). A bucket of
stage p is produced by that stage's owner (tp 0 of data-parallel replica 0), which gathers its TP
shards (one ``gather`` on the TP group) and unshards and renames them. Rank 0 (tp = pp = dp = 0)
packs the buckets it owns (stage 0) straight into their place in a shared mapping of the file; every
other stage's owner sends its buckets to rank 0 point to point (rollout.refit.send_bucket), received
straight into their place (recv_bucket). Then the path is broadcast from rank 0. Other replicas
produce nothing: their weights are equal after the all-reduced update.

Every rank makes the same calls whatever fails: a producer that raises still sends its bucket,
flagged (the receiver raises naming it); rank 0, when its file fails, still takes its part in the
rest of the plan (the TP gathers, the other stages' sends); and every rank takes part in the final
broadcast, which tells the others whether rank 0 wrote the file. So a failure is a named error on
every rank at once, never a rank left waiting for a collective the others skipped.
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist

from pfppo_mega.parallel import comm_device
from pfppo_mega.rollout.refit import recv_bucket, send_bucket
from pfppo_mega.rollout.weights import new_wire


class WeightExportError(RuntimeError):
    """A version's weight file was not written on a multi-rank trainer; raised on every rank (the
    message names the rank that failed first, where it is known)."""


def write_version(sync, files, version: int) -> str:
    """The actor's current weights as version ``version``'s file; its path on every rank.
    sync: the trainer's EngineSync (plan, refit groups, live weights); files: rank 0's WeightFiles
    (None on the other ranks). One process: packed straight into the file, no collective."""
    live, group = sync.live(version), sync.groups.world
    if group is None:
        return files.pack(version, sync.plan, live.produce)
    me = dist.get_rank()
    mine = _write_on_rank0(live, sync.plan, files, version, group) if me == 0 else None  # path or _Failed
    error = None if me == 0 else _produce_all(live, sync.plan, me, group)
    box = [mine]
    dist.broadcast_object_list(box, src=0, group=group)  # rank 0's path, or its failure, to every rank
    if error is not None:
        raise WeightExportError(f"version {version}'s weight file: rank {me} failed: "
                                f"{type(error).__name__}: {error}") from error
    if isinstance(box[0], _Failed):
        raise WeightExportError(f"version {version}'s weight file was not written: rank 0: {box[0].why}")
    return box[0]


class _Failed:
    """Rank 0's answer in the final broadcast when it did not write the file (picklable)."""

    def __init__(self, why: str) -> None:
        self.why = why


def _write_on_rank0(live, plan, files, version: int, group):
    """Rank 0: pack the file (its own buckets in place, the others received in place). Returns the
    path, or a _Failed after taking its part in the rest of the plan."""
    consumed: set[int] = set()

    def produce(spec, wire):
        consumed.add(spec.index)
        src = live.owner(spec)
        return live.produce(spec, wire) if src == 0 else recv_bucket(spec, src=src, group=group, out=wire)

    try:
        return files.pack(version, plan, produce)
    except Exception as e:
        _drain(live, [s for s in plan if s.index not in consumed], group)
        return _Failed(f"{type(e).__name__}: {e}")


def _drain(live, rest, group) -> None:
    """Rank 0 after its file failed: the rest of the plan's calls (its TP gathers, every other
    stage's send), results dropped, so no other rank waits for it."""
    for spec in rest:
        src = live.owner(spec)
        try:
            if src == 0:
                live.produce(spec)
            else:
                recv_bucket(spec, src=src, group=group, out=new_wire(spec.nbytes, comm_device(group)))
        except Exception:
            pass  # already failing: the first error is the one reported


def _produce_all(live, plan, me: int, group) -> Optional[Exception]:
    """A rank other than 0: every bucket of the plan (its TP gathers), each one it owns sent to rank
    0, flagged when its produce failed. Returns the first failure (raised after the broadcast)."""
    first: Optional[Exception] = None
    for spec in plan:
        bucket, error = None, None
        try:
            bucket = live.produce(spec)
        except Exception as e:
            error = e
            first = first or e
        if me == live.owner(spec):
            send_bucket(bucket, spec, dst=0, group=group, error=error)
    return first
