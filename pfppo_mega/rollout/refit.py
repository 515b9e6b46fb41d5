"""Broadcast refit: move a bucket from the rank that owns it to every rank of a process group.

Gloo on CPU, NCCL on GPUs (the group's backend decides; NCCL buckets live on the current CUDA
device). Per bucket, two broadcasts from the owner: a small header (version + the producer's
checksum, [1 + 32] int64) and the flat bytes. Receivers rebuild the Bucket with the producer's
checksum, so the engine's verification catches bytes that were corrupt at the source (a pool
shard) as well as in transit. Who sends what to whom is written out in docs/refit.md.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from pfppo_mega.rollout.weights import CHECKSUM_BYTES, Bucket, BucketSpec


def group_device(group: Optional[dist.ProcessGroup]) -> torch.device:
    """Where a group's collectives want their tensors: the current CUDA device for NCCL, else CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _header(version: int, checksum: str) -> torch.Tensor:
    return torch.tensor([version] + [ord(c) for c in checksum], dtype=torch.int64)


def broadcast_bucket(bucket: Optional[Bucket], spec: BucketSpec, version: int, *, src: int,
                     group: Optional[dist.ProcessGroup], out: Optional[torch.Tensor] = None) -> Bucket:
    """Every rank of ``group`` gets rank ``src``'s bucket for ``spec`` (``bucket`` is read on src only).
    out: [spec.numel] buffer the receivers write into (a fresh one when None).

    The owner must hold a bucket; if it does not (a producer bug), it sends an all-zero header
    that every receiver turns into a clear error instead of a hang.
    """
    device = group_device(group)
    me = dist.get_rank()
    if me == src:
        ok = bucket is not None and bucket.spec == spec
        header = _header(bucket.version, bucket.checksum) if ok else torch.zeros(1 + CHECKSUM_BYTES, dtype=torch.int64)
        header[0] = header[0] if ok else -1
        flat = bucket.flat.to(device) if ok else torch.zeros(spec.numel, dtype=spec.dtype, device=device)
    else:
        header = torch.empty(1 + CHECKSUM_BYTES, dtype=torch.int64)
        flat = out if out is not None else torch.empty(spec.numel, dtype=spec.dtype, device=device)
    header = header.to(device)
    dist.broadcast(header, src=src, group=group)
    dist.broadcast(flat, src=src, group=group)
    header = header.cpu()
    if int(header[0]) < 0:
        raise RuntimeError(f"refit: rank {src} owns bucket {spec.index} ({spec.names[0]} ..) but produced none")
    checksum = "".join(chr(int(c)) for c in header[1:])
    if me == src:  # the owner passes on its own tensor (no copy) with the producer's checksum
        return Bucket(spec, bucket.version, bucket.flat, bucket.checksum, source_rank=src)
    return Bucket(spec, int(header[0]), flat, checksum, source_rank=src)


def broadcast_flat(flat: torch.Tensor, *, src: int, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """One raw broadcast of a flat buffer (the benchmark's baseline for bucketed refit)."""
    dist.broadcast(flat, src=src, group=group)
    return flat
