"""The snapshot pool stored in the rollout layout, once per node, split across the node's ranks.

A snapshot here is the bucket stream of one weight version in the engines' layout (Hugging Face
names, engine dtype, whole fused groups per bucket). Bucket k of a snapshot is kept by exactly
one rank of each node: ``node_ranks[k % L]`` (L local ranks), as a private host copy (pinned on
GPUs) together with the checksum its producer computed. A node therefore holds
``pool_size x model bytes`` in total, each rank about 1/L of it -- not L full copies.

Switching the engines to snapshot v: ``pool.source(v).buckets(plan, group=node_group)``
broadcasts each bucket from its keeper to every rank of the node (never disk). The receivers
verify the producer's checksum, so a shard corrupted at rest on one rank is refused by every
engine with an error that names that rank.

Statistics, candidates and eviction are SnapshotPool's (a subclass): each rank's Snapshot holds
only its own shards (``bucket.<k>`` tensors), so checkpointing a rank's pool saves its shards.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist

from pfppo_mega.pool.snapshots import Snapshot, SnapshotPool, check_host_memory
from pfppo_mega.rollout.weights import Bucket, BucketReceiver, BucketSpec, WeightLayout, WeightSource


class ShardedSnapshotPool(SnapshotPool):
    """pool_size snapshots in ``layout``, bucket k kept by ``node_ranks[k % len(node_ranks)]``.

    rank: this process's global rank; node_ranks: the global ranks of this node, in order (the
    same list on every rank of the node). check_memory: the first capture checks that the NODE
    has room for pool_size x layout bytes (on the node's first rank; every rank raises).
    """

    def __init__(self, pool_size: int, layout: WeightLayout, *, rank: int, node_ranks: list[int],
                 pin_memory: Optional[bool] = None, check_memory: bool = True,
                 log: Callable[[str], None] = print) -> None:
        super().__init__(pool_size, pin_memory=pin_memory, check_memory=False, log=log)
        if rank not in node_ranks:
            raise ValueError(f"rank {rank} is not among its node's ranks {node_ranks}")
        self.layout, self.rank, self.node_ranks = layout, rank, list(node_ranks)
        self.check_node_memory = check_memory
        self._producer_checksums: dict[int, dict[int, str]] = {}  # version -> bucket index -> checksum
        self.stream_checksums: dict[int, str] = {}  # version -> stream checksum of the whole snapshot

    def keeper(self, spec: BucketSpec) -> int:
        return self.node_ranks[spec.index % len(self.node_ranks)]

    def capture(self, version: int, buckets: Iterable[Bucket]) -> Snapshot:
        """Keep this rank's share of a stream of buckets (every rank of the node sees the whole
        stream, e.g. the live refit broadcast); each bucket is verified before it is kept."""
        if self.check_node_memory and not self._snapshots and self.rank == self.node_ranks[0]:
            check_host_memory(self.pool_size, self.layout.nbytes)
        receiver = BucketReceiver(self.layout, version)
        kept: list[tuple[str, torch.Tensor]] = []
        checksums: dict[int, str] = {}
        for bucket in buckets:
            receiver.accept(bucket)
            if self.keeper(bucket.spec) == self.rank:
                # a received bucket sits in the stream's reused buffer: copy it now (add() copies
                # again into the pool's private host memory; a bucket this rank produced is its own)
                flat = bucket.flat if bucket.source_rank == self.rank else bucket.flat.to("cpu", copy=True)
                kept.append((f"bucket.{bucket.spec.index}", flat))
                checksums[bucket.spec.index] = bucket.checksum
        stream = receiver.finish()
        if not kept:  # more ranks than buckets: this rank keeps nothing of this snapshot
            kept = [("bucket.none", torch.zeros(0, dtype=self.layout.dtype))]
        snap = self.add(version, kept)  # SnapshotPool.add: eviction, private host copy, local checksum
        self._producer_checksums = {v: c for v, c in self._producer_checksums.items() if v in self.versions}
        self._producer_checksums[version] = checksums
        self.stream_checksums = {v: c for v, c in self.stream_checksums.items() if v in self.versions}
        self.stream_checksums[version] = stream  # what an engine holding exactly this snapshot reports
        return snap

    def adopt(self, restored: SnapshotPool, plan: list[BucketSpec]) -> None:
        """Take the snapshots of a pool rebuilt from a checkpoint (SnapshotPool.from_state, which
        verified every shard against its saved checksum) as this rank's shards of ``plan``; the
        producer checksums are recomputed from those verified bytes. Raises ValueError when the
        checkpoint holds another rank's shards."""
        from pfppo_mega.rollout.weights import bucket_checksum

        mine = {f"bucket.{s.index}": s for s in plan if self.keeper(s) == self.rank} or {"bucket.none": None}
        self._snapshots, self._producer_checksums = [], {}
        for snap in restored.snapshots:
            names = [n for n, _ in snap.tensors]
            if sorted(names) != sorted(mine):
                raise ValueError(f"pool checkpoint: snapshot {snap.version} on rank {self.rank} holds {names[:3]}.., "
                                 f"this rank keeps {sorted(mine)[:3]}.. (saved with another rank layout)")
            self._snapshots.append(snap)
            self._producer_checksums[snap.version] = {
                mine[n].index: bucket_checksum(mine[n], snap.version, t) for n, t in snap.tensors if mine[n] is not None}
        self.stream_checksums = {}  # unknown after a restore: the first switch to each snapshot reloads
        self.n_corrupt = restored.n_corrupt

    def source(self, version: int) -> "PoolSnapshot":
        """The weight source of snapshot ``version`` (KeyError when not held)."""
        return PoolSnapshot(self, self._snapshots[self._index(version)])

    def bytes_per_node(self) -> int:
        """What the node holds for the whole pool: one copy of each snapshot."""
        return len(self) * self.layout.nbytes


class PoolSnapshot(WeightSource):
    """Snapshot buckets, produced by the rank that keeps them (no copy) with their capture-time checksum."""

    def __init__(self, pool: ShardedSnapshotPool, snapshot: Snapshot) -> None:
        self.pool, self.snapshot, self.version = pool, snapshot, snapshot.version
        self.shards = dict(snapshot.tensors)
        self.checksums = pool._producer_checksums[snapshot.version]

    def owner(self, spec: BucketSpec) -> int:
        return self.pool.keeper(spec)

    def produce(self, spec: BucketSpec) -> Optional[Bucket]:
        if self.pool.keeper(spec) != self.pool.rank:
            return None
        flat = self.shards[f"bucket.{spec.index}"]
        return Bucket(spec, self.version, flat, self.checksums[spec.index], source_rank=self.pool.rank)


def node_ranks(local_world_size: int) -> list[int]:
    """Global ranks on this rank's node, assuming consecutive ranks per node (torchrun, srun)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    first = rank - rank % local_world_size
    return list(range(first, first + local_world_size))
