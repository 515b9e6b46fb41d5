"""Weight sources: what produces the buckets (pfppo_mega.rollout.weights) of one weight version.

Two producers matter: the live trainer (pfppo_mega.rollout.live.LiveWeights) and a pool snapshot
(pfppo_mega.pool.sharded.PoolSnapshot); ``NamedTensorSource`` wraps a plain list of tensors.
Refit to the current policy and a switch to a behaviour snapshot are the same call::

    engine.update_weights(source.buckets(engine.bucket_plan()), source.version)

In several processes ``source.buckets(plan, group=g)`` broadcasts each bucket from the rank that
owns it to every rank of ``g`` (pfppo_mega.rollout.refit, which knows the bucket format only).
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist

from pfppo_mega.rollout.refit import broadcast_stream
from pfppo_mega.rollout.weights import Bucket, BucketSpec, WeightLayout, check_named_tensors


class WeightSource:
    """Produces the buckets of one weight ``version``.

    Subclasses say which rank owns each bucket (``owner``) and make it there (``produce``,
    called on every rank of the group in plan order -- a producer may run collectives in it --
    returning the bucket on the owner and None elsewhere; ``wire``, when given, is the buffer to
    pack into). ``buckets`` delivers every bucket to every rank: directly in one process, by
    broadcast from the owner over ``group`` otherwise (pfppo_mega.rollout.refit.broadcast_stream:
    one broadcast per bucket, the next one in flight while the current one is used).

    dest(spec): where this rank wants bucket ``spec``'s wire bytes to land (a pool's own buffer of
    wire_nbytes(spec.nbytes)), or None for a buffer of the stream's. A bucket in a stream buffer is
    valid until the next bucket is requested; one in a dest buffer stays.
    """

    version: int

    def owner(self, spec: BucketSpec) -> int:
        return 0

    def produce(self, spec: BucketSpec, wire: Optional[torch.Tensor] = None) -> Optional[Bucket]:
        raise NotImplementedError

    def buckets(self, plan: list[BucketSpec], group: Optional[dist.ProcessGroup] = None,
                dest: Optional[Callable[[BucketSpec], Optional[torch.Tensor]]] = None) -> Iterator[Bucket]:
        if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
            for spec in plan:
                bucket = self.produce(spec, None if dest is None else dest(spec))
                if bucket is None:
                    raise RuntimeError(f"{type(self).__name__} produced no bucket {spec.index} in one process")
                yield bucket
            return
        yield from broadcast_stream(self, plan, group, dest=dest)


class NamedTensorSource(WeightSource):
    """A full set of (name, tensor) pairs held by rank ``src`` -> buckets. src None: every rank
    holds them (no broadcast needed; each rank packs its own)."""

    def __init__(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, *,
                 layout: Optional[WeightLayout] = None, src: Optional[int] = None) -> None:
        self.version = version
        self.src = src
        self.tensors = (check_named_tensors(named_tensors, layout, version) if layout is not None
                        else dict(named_tensors))

    def owner(self, spec: BucketSpec) -> int:
        return self.src or 0

    def produce(self, spec: BucketSpec, wire: Optional[torch.Tensor] = None) -> Optional[Bucket]:
        rank = dist.get_rank() if dist.is_initialized() else 0
        if self.src is not None and rank != self.src:
            return None
        return Bucket.pack(spec, self.version, [self.tensors[n].to(spec.dtype) for n in spec.names],
                           source_rank=rank, wire=wire)
