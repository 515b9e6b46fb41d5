"""Broadcast refit: move buckets from the ranks that own them to every rank of a process group.

Gloo on CPU, NCCL on GPUs (the group's backend decides; NCCL buckets live on the current CUDA
device). Per bucket ONE broadcast from its owner: the bucket's wire buffer, i.e. its bytes and a
32-byte trailer with the version and the producer's checksum (pfppo_mega.rollout.weights.new_wire).
Receivers rebuild the Bucket with the producer's checksum, so the engine's verification catches
bytes that were corrupt at the source (a pool shard) as well as in transit.

``broadcast_stream`` pipelines a plan: bucket k+1 is produced and in flight (async broadcast)
while the consumer applies bucket k (up to MAX_AHEAD buckets ahead within AHEAD_BYTES); a ring of
stream buffers, kept between the streams of one colocated frame (release_slots frees them: the
trainer calls it when the engine sleeps and after a pool capture), takes them, and a receiver that
gave a destination for a bucket (a pool keeping it) receives straight into it -- no unpack copy.
Who sends what to whom is written out in docs/refit.md.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from pfppo_mega.parallel import comm_device
from pfppo_mega.rollout.weights import (Bucket, BucketSpec, new_wire, read_trailer, wire_flat, wire_nbytes,
                                        write_trailer)


MAX_AHEAD = 3  # broadcasts in flight ahead of the bucket being used (latency hiding) ...
AHEAD_BYTES = 64 << 20  # ... within this many bytes of stream buffers (at least one bucket ahead)


def _send_wire(bucket: Optional[Bucket], spec: BucketSpec, slot: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The owner's wire for ``spec``: the bucket's own when it has one on the group's device, else
    packed into ``slot``; a trailer flagged 'none' when the owner produced no (or another) bucket."""
    if bucket is None or bucket.spec != spec:
        write_trailer(slot, -1, "", ok=False)
        return slot
    if bucket.wire is not None and bucket.wire.device == device:
        return bucket.wire
    wire_flat(slot, spec).copy_(bucket.flat)
    write_trailer(slot, bucket.version, bucket.checksum)
    return slot


def _received(wire: torch.Tensor, spec: BucketSpec, src: int, mine: Optional[Bucket], me: int) -> Bucket:
    version, flag, checksum = read_trailer(wire)
    if flag != 1:
        raise RuntimeError(f"refit: rank {src} owns bucket {spec.index} ({spec.names[0]} ..) but produced none")
    if me == src:  # the owner passes on its own bucket (fingerprint of its fresh bytes included)
        return mine
    return Bucket(spec, version, wire_flat(wire, spec), checksum, source_rank=src, wire=wire)


def broadcast_bucket(bucket: Optional[Bucket], spec: BucketSpec, version: int, *, src: int,
                     group: Optional[dist.ProcessGroup], out: Optional[torch.Tensor] = None) -> Bucket:
    """Every rank of ``group`` gets rank ``src``'s bucket for ``spec`` (``bucket`` is read on src only),
    in one broadcast. out: uint8 wire buffer of at least wire_nbytes(spec.nbytes) the receivers
    write into (a fresh one when None). The owner must hold a bucket; if it does not (a producer
    bug), it sends a trailer flagged 'none' that every receiver turns into a clear error."""
    device = comm_device(group)  # NCCL: the current CUDA device
    me = dist.get_rank()
    n = wire_nbytes(spec.nbytes)
    slot = out[:n] if out is not None else new_wire(spec.nbytes, device)
    wire = _send_wire(bucket, spec, slot, device) if me == src else slot
    dist.broadcast(wire, src=src, group=group)
    return _received(wire, spec, src, bucket, me)


def send_bucket(bucket: Optional[Bucket], spec: BucketSpec, *, dst: int, group: Optional[dist.ProcessGroup],
                error: Optional[BaseException] = None) -> None:
    """Point to point: the owner's bucket for ``spec`` to rank ``dst`` alone (recv_bucket there), as
    one wire buffer. A bucket that is None, of another spec, or came with ``error`` goes as a 'none'
    trailer, so the receiver raises instead of waiting for bytes that never come."""
    device = comm_device(group)
    slot = new_wire(spec.nbytes, device)
    wire = _send_wire(None if error is not None else bucket, spec, slot, device)
    dist.send(wire, dst=dst, group=group)


def recv_bucket(spec: BucketSpec, *, src: int, group: Optional[dist.ProcessGroup], out: torch.Tensor) -> Bucket:
    """Rank ``src``'s bucket for ``spec`` (send_bucket there) into ``out`` (a uint8 wire buffer of
    wire_nbytes(spec.nbytes), e.g. its place in a weight file), checksum as the producer's. Received
    straight into ``out`` where it is on the group's device, else through a buffer there (NCCL)."""
    device = comm_device(group)
    n = wire_nbytes(spec.nbytes)
    wire = out[:n] if out.device == device else new_wire(spec.nbytes, device)
    dist.recv(wire, src=src, group=group)
    if wire.data_ptr() != out.data_ptr():
        out[:n].copy_(wire)
    return _received(out[:n], spec, src, None, dist.get_rank())


def broadcast_stream(source, plan: list[BucketSpec], group: dist.ProcessGroup,
                     dest: Optional[Callable[[BucketSpec], Optional[torch.Tensor]]] = None) -> Iterator[Bucket]:
    """Every bucket of ``plan`` from its owner to every rank of ``group``, in plan order, one async
    broadcast each, a few buckets ahead (see the module docstring). source: a WeightSource
    (pfppo_mega.rollout.source, which calls this from its ``buckets``): its owner(spec) and
    produce(spec, wire) are all this reads."""
    device = comm_device(group)  # NCCL: the current CUDA device
    me = dist.get_rank()
    size = max(wire_nbytes(s.nbytes) for s in plan)
    ahead = max(1, min(MAX_AHEAD, AHEAD_BYTES // size))  # buckets in flight beyond the one being used
    slots = _take_slots(device, size, ahead + 1)
    pending: deque = deque()

    def launch(k: int) -> None:
        spec = plan[k]
        src = source.owner(spec)
        target = dest(spec) if dest is not None else None
        slot = target if target is not None and target.device == device else slots[k % len(slots)][:wire_nbytes(spec.nbytes)]
        mine, error = None, None
        try:  # a producer may take part in collectives (e.g. a TP gather): every rank calls it
            mine = source.produce(spec, slot if me == src else None)
        except Exception as e:  # the owner still sends (a 'none' trailer): no rank is left waiting
            error = e
        wire = _send_wire(mine, spec, slot, device) if me == src else slot
        work = dist.broadcast(wire, src=src, group=group, async_op=True)
        pending.append((spec, src, wire, mine, target, error, work))

    try:
        for k in range(min(ahead, len(plan))):
            launch(k)
        for k in range(len(plan)):
            if k + ahead < len(plan):
                launch(k + ahead)  # into the slot of bucket k - 1, which the consumer is done with
            spec, src, wire, mine, target, error, work = pending.popleft()
            work.wait()
            if error is not None:
                raise error
            if target is not None and target is not wire:  # a dest on another device (pinned host pool)
                target.copy_(wire)
                wire = target
            yield _received(wire, spec, src, mine, me)
    finally:
        for item in pending:  # never leave a broadcast half-done behind a consumer that stopped
            item[-1].wait()
        _SLOTS.setdefault(device, slots)  # back for the next stream


# the stream buffers, kept between streams per device (fresh pages cost as much as the bytes): a
# stream takes them and puts them back when it ends; a stream started inside another gets new ones;
# release_slots drops them (the next stream makes new ones)
_SLOTS: dict[torch.device, list[torch.Tensor]] = {}


def held_slot_bytes() -> int:
    """Bytes of the stream buffers kept now (every device)."""
    return sum(t.numel() for slots in _SLOTS.values() for t in slots)  # uint8


def release_slots() -> int:
    """Drop the kept stream buffers of every device (their memory goes back to the allocator; on
    CUDA to torch's cache, which the trainer's reload reuses and TrainerOffload's empty_cache
    returns before the engine wakes). Returns the bytes dropped. A stream running now keeps its own
    ring and puts it back when it ends."""
    n = held_slot_bytes()
    _SLOTS.clear()
    return n


def _take_slots(device: torch.device, size: int, count: int) -> list[torch.Tensor]:
    slots = _SLOTS.pop(device, None)
    if slots is None or slots[0].numel() < size or len(slots) != count:
        slots = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(count)]
    return slots


def broadcast_flat(flat: torch.Tensor, *, src: int, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """One raw broadcast of a flat buffer (the benchmark's baseline for bucketed refit)."""
    dist.broadcast(flat, src=src, group=group)
    return flat
