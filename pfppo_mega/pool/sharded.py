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

import hashlib
from concurrent.futures import Future
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist

from pfppo_mega.pool.snapshots import Snapshot, SnapshotPool, check_host_memory
from pfppo_mega.rollout.source import WeightSource
from pfppo_mega.rollout.weights import (Bucket, BucketReceiver, BucketSpec, WeightLayout, WeightUpdateError,
                                        bucket_checksum, fingerprint, new_wire, pack_fingerprint, wire_flat,
                                        wire_nbytes, write_trailer)

NONE = "bucket.none"  # the placeholder a rank keeps when the node has more ranks than buckets


def _index(name: str) -> int:
    return int(name.split(".", 1)[1])


class ShardedSnapshotPool(SnapshotPool):
    """pool_size snapshots in ``layout``, bucket k kept by ``node_ranks[k % len(node_ranks)]``.

    rank: this process's global rank; node_ranks: the global ranks of this node, in order (the
    same list on every rank of the node). check_memory: the first capture checks that the NODE
    has room for pool_size x layout bytes (on the node's first rank; every rank raises).

    A kept bucket is stored as its wire buffer (weights.new_wire: the bytes, then the trailer with
    version and producer checksum), so a switch broadcasts it without a copy; ``snapshot.tensors``
    holds ("bucket.<k>", wire) pairs. A capture reuses the buffers of the snapshot it evicts.
    """

    def __init__(self, pool_size: int, layout: WeightLayout, *, rank: int, node_ranks: list[int],
                 pin_memory: Optional[bool] = None, check_memory: bool = True,
                 log: Callable[[str], None] = print) -> None:
        super().__init__(pool_size, pin_memory=pin_memory, checksum="fingerprint", check_memory=False, log=log)
        if rank not in node_ranks:
            raise ValueError(f"rank {rank} is not among its node's ranks {node_ranks}")
        self.layout, self.rank, self.node_ranks = layout, rank, list(node_ranks)
        self.check_node_memory = check_memory
        self._producer_checksums: dict[int, dict[int, str]] = {}  # version -> bucket index -> checksum
        self.stream_checksums: dict[int, str] = {}  # version -> stream checksum of the whole snapshot
        self._specs: dict[int, BucketSpec] = {}  # bucket index -> spec, for the buckets this rank keeps
        self._hold: Optional[Future] = None  # a background checkpoint still writing the kept buffers

    def keeper(self, spec: BucketSpec) -> int:
        return self.node_ranks[spec.index % len(self.node_ranks)]

    # ---------------------------------------------------------------------------- capture
    def _make_room(self, version: int) -> dict[int, torch.Tensor]:
        """Drop the snapshot a capture of ``version`` replaces (the same version, else the oldest
        when full) and hand back its buffers (bucket index -> wire) for reuse."""
        if self.check_node_memory and not self._snapshots and self.rank == self.node_ranks[0]:
            check_host_memory(self.pool_size, self.layout.nbytes)
        slot = next((i for i, s in enumerate(self._snapshots) if s.version == version), None)
        if slot is None and len(self._snapshots) >= self.pool_size:
            slot = 0
        if slot is None:
            return {}
        old = self._snapshots.pop(slot)
        if self._hold is not None and not self._hold.done():
            return {}  # a checkpoint is writing these very buffers: fresh ones for this capture
        reuse = {_index(n): t for n, t in old.tensors if n != NONE}
        old.tensors = []  # its buffers now belong to the new snapshot
        return reuse

    def capture_from(self, source: WeightSource, plan: list[BucketSpec],
                     group: Optional[dist.ProcessGroup] = None) -> Snapshot:
        """Snapshot ``source`` (every rank of ``group`` calls this): each bucket is broadcast from its
        owner straight into its keeper's pool buffer (or packed there when the keeper owns it) and
        fingerprinted once -- no unpack copy. Other ranks only pass the bytes on."""
        reuse = self._make_room(source.version)
        wires: dict[int, torch.Tensor] = {}

        def dest(spec: BucketSpec) -> Optional[torch.Tensor]:
            if self.keeper(spec) != self.rank:
                return None
            wire = reuse.pop(spec.index, None)
            if wire is None or wire.numel() != wire_nbytes(spec.nbytes):
                wire = new_wire(spec.nbytes, pin=self.pin_memory)
            wires[spec.index] = wire
            return wire

        return self._capture(source.version, source.buckets(plan, group, dest=dest), wires)

    def capture(self, version: int, buckets: Iterable[Bucket]) -> Snapshot:
        """Keep this rank's share of a stream of buckets (every rank of the node sees the whole
        stream); each kept bucket is copied into the pool and fingerprinted in the same pass."""
        return self._capture(version, buckets, {}, reuse=self._make_room(version))

    def _capture(self, version: int, buckets: Iterable[Bucket], wires: dict[int, torch.Tensor],
                 reuse: Optional[dict[int, torch.Tensor]] = None) -> Snapshot:
        receiver = BucketReceiver(self.layout, version)
        kept: list[tuple[str, torch.Tensor]] = []
        checksums: dict[int, str] = {}
        for bucket in buckets:
            spec = bucket.spec
            receiver.accept(bucket, verify=False, views=False)  # the layout; kept bytes are verified below
            if self.keeper(spec) != self.rank:
                continue
            wire = wires.get(spec.index)
            if wire is not None and bucket.wire is wire:  # landed in place
                if bucket.fingerprint is not None:  # packed here: its checksum was made from this very pass
                    self._keep(spec, wire, bucket.checksum, kept, checksums)
                    continue
                fp = fingerprint(bucket.flat)  # received: one read pass
            else:  # copied in, fingerprinted in the same pass
                wire = (reuse or {}).pop(spec.index, None)
                if wire is None or wire.numel() != wire_nbytes(spec.nbytes):
                    wire = new_wire(spec.nbytes, pin=self.pin_memory)
                fp = pack_fingerprint(wire_flat(wire, spec), [bucket.flat.to(wire.device)])
                write_trailer(wire, bucket.version, bucket.checksum)
            if bucket_checksum(spec, version, wire_flat(wire, spec), fp) != bucket.checksum:
                raise WeightUpdateError(
                    f"pool capture of version {version}: bucket {spec.index} ({spec.names[0]} ..) from rank "
                    f"{bucket.source_rank} failed its checksum; corrupt bytes refused")
            self._keep(spec, wire, bucket.checksum, kept, checksums)
        stream = receiver.finish()
        if not kept:  # more ranks than buckets: this rank keeps nothing of this snapshot
            kept = [(NONE, torch.zeros(0, dtype=torch.uint8))]
        snap = Snapshot(version=version, tensors=kept, checksum=_digest(checksums),
                        nbytes=sum(self._specs[i].nbytes for i in checksums))
        self._snapshots.append(snap)
        self._producer_checksums = {v: c for v, c in self._producer_checksums.items() if v in self.versions}
        self._producer_checksums[version] = checksums
        self.stream_checksums = {v: c for v, c in self.stream_checksums.items() if v in self.versions}
        self.stream_checksums[version] = stream  # what an engine holding exactly this snapshot reports
        return snap

    def _keep(self, spec: BucketSpec, wire: torch.Tensor, checksum: str, kept: list, checksums: dict) -> None:
        self._specs[spec.index] = spec
        kept.append((f"bucket.{spec.index}", wire))
        checksums[spec.index] = checksum

    def add(self, version: int, named_tensors) -> Snapshot:
        raise TypeError("ShardedSnapshotPool keeps bucket streams: use capture_from(source, plan, group) "
                        "or capture(version, buckets)")

    # ----------------------------------------------------------------------- integrity
    def verify(self, snapshot: Snapshot) -> bool:
        """True when every shard this rank keeps of ``snapshot`` still matches its producer's checksum
        (one read pass over the shard bytes)."""
        checksums = self._producer_checksums.get(snapshot.version, {})
        for name, wire in snapshot.tensors:
            if name == NONE:
                continue
            spec = self._specs[_index(name)]
            if bucket_checksum(spec, snapshot.version, wire_flat(wire, spec)) != checksums.get(spec.index):
                return False
        return True

    # ----------------------------------------------------------------------- checkpoint
    def hold_buffers(self, until: Future) -> None:
        """A background checkpoint writes the kept buffers as they are (no host copy): until `until`
        is done, a capture allocates new buffers instead of reusing those of the snapshot it evicts
        (at most one snapshot's share more host memory, and only while the write lasts)."""
        self._hold = until

    def state_meta(self) -> dict:
        """SnapshotPool's state; each snapshot's checksum is recomputed over its stored buffers (the
        'fingerprint' method, which SnapshotPool.from_state checks)."""
        from pfppo_mega.pool.snapshots import compute_checksum

        meta = super().state_meta()
        for entry, snap in zip(meta["snapshots"], self._snapshots):
            entry["checksum"] = compute_checksum(snap.tensors, "fingerprint")
        return meta

    def adopt(self, restored: SnapshotPool, plan: list[BucketSpec]) -> None:
        """Take the snapshots of a pool rebuilt from a checkpoint (SnapshotPool.from_state, which
        verified every buffer against its saved checksum) as this rank's shards of ``plan``; the
        producer checksums are recomputed from those verified bytes. Raises ValueError when the
        checkpoint holds another rank's shards."""
        mine = {f"bucket.{s.index}": s for s in plan if self.keeper(s) == self.rank}
        want = sorted(mine) or [NONE]
        self._snapshots, self._producer_checksums = [], {}
        for snap in restored.snapshots:
            names = [n for n, _ in snap.tensors]
            if sorted(names) != want:
                raise ValueError(f"pool checkpoint: snapshot {snap.version} on rank {self.rank} holds {names[:3]}.., "
                                 f"this rank keeps {want[:3]}.. (saved with another rank layout)")
            checksums: dict[int, str] = {}
            for name, wire in snap.tensors:
                if name == NONE:
                    continue
                spec = mine[name]
                if wire.dtype != torch.uint8 or wire.numel() != wire_nbytes(spec.nbytes):
                    raise ValueError(f"pool checkpoint: snapshot {snap.version} {name} holds {wire.numel()} x "
                                     f"{wire.dtype}, expected {wire_nbytes(spec.nbytes)} x torch.uint8 "
                                     f"(a bucket and its trailer)")
                checksums[spec.index] = bucket_checksum(spec, snap.version, wire_flat(wire, spec))
                write_trailer(wire, snap.version, checksums[spec.index])
                self._specs[spec.index] = spec
            self._snapshots.append(Snapshot(version=snap.version, tensors=list(snap.tensors),
                                            checksum=_digest(checksums), stats=snap.stats,
                                            nbytes=sum(mine[n].nbytes for n, _ in snap.tensors if n != NONE)))
            self._producer_checksums[snap.version] = checksums
        self.stream_checksums = {}  # unknown after a restore: the first switch to each snapshot reloads
        self.n_corrupt = restored.n_corrupt

    def source(self, version: int) -> "PoolSnapshot":
        """The weight source of snapshot ``version`` (KeyError when not held)."""
        return PoolSnapshot(self, self._snapshots[self._index(version)])

    def bytes_per_node(self) -> int:
        """What the node holds for the whole pool: one copy of each snapshot."""
        return len(self) * self.layout.nbytes


def _digest(checksums: dict[int, str]) -> str:
    """A snapshot's in-memory checksum: its kept buckets' producer checksums, in index order."""
    digest = hashlib.blake2b(digest_size=16)
    for index in sorted(checksums):
        digest.update(f"{index}:{checksums[index]}|".encode())
    return f"producer:{digest.hexdigest()}"


class PoolSnapshot(WeightSource):
    """Snapshot buckets, produced by the rank that keeps them (no copy: the stored wire buffer is what
    is broadcast) with their capture-time checksum."""

    def __init__(self, pool: ShardedSnapshotPool, snapshot: Snapshot) -> None:
        self.pool, self.snapshot, self.version = pool, snapshot, snapshot.version
        self.shards = dict(snapshot.tensors)
        self.checksums = pool._producer_checksums[snapshot.version]

    def owner(self, spec: BucketSpec) -> int:
        return self.pool.keeper(spec)

    def produce(self, spec: BucketSpec, wire: Optional[torch.Tensor] = None) -> Optional[Bucket]:
        if self.pool.keeper(spec) != self.pool.rank:
            return None
        stored = self.shards[f"bucket.{spec.index}"]
        return Bucket(spec, self.version, wire_flat(stored, spec), self.checksums[spec.index],
                      source_rank=self.pool.rank, wire=stored)


def node_ranks(local_world_size: int) -> list[int]:
    """Global ranks on this rank's node, assuming consecutive ranks per node (torchrun, srun)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    first = rank - rank % local_world_size
    return list(range(first, first + local_world_size))
