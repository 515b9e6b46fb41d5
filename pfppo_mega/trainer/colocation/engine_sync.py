"""The trainer's side of the rollout seam: build the engine the config names, and move weights into it.

One object per trainer process (``EngineSync``) does every weight movement of a step through the
same call, ``engine.update_weights(source.buckets(plan, group), version)``:
  refit_live(v)       the actor's current megatron shards (LiveWeights), broadcast over the world
  capture(pool, v)    the same stream, kept by the PF-PPO pool (1/L of each snapshot per node rank)
  switch(pool, v)     a pool snapshot, broadcast from its keepers inside the node
and checks, after each generation, that every engine generated with the same version and weight
checksum (pfppo_mega.pool.assignment). See docs/refit.md.

Every collective of those movements runs on groups created here with their own bounded wait,
``actor_rollout.refit_timeout_s`` (RefitGroups): a rank that dies or stalls mid-refit makes the
others raise RefitTimeoutError (the refit, the weight version, the bucket reached, the key) after
at most that long, instead of waiting out the process group's default (30 min).
"""

from __future__ import annotations

import os
import re
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from pfppo_mega.parallel import comm_device
from pfppo_mega.registry import ROLLOUT_ENGINES
from pfppo_mega.rollout.base import EngineSetupError, RolloutEngine
from pfppo_mega.rollout.source import WeightSource
from pfppo_mega.rollout.weights import Bucket, BucketSpec, WeightUpdateError

TIMEOUT_KEY = "actor_rollout.refit_timeout_s"


class RefitTimeoutError(RuntimeError):
    """A collective of a refit or snapshot switch failed because a rank of its group died or stalled
    (the backend's timeout after actor_rollout.refit_timeout_s, or a connection the dead rank
    closed). Not a WeightUpdateError on purpose: no recovery (evict, push again) can run without
    that rank, so the run stops with this error."""


# what gloo / the TCP store / NCCL say when a peer is gone or silent (their errors are plain
# RuntimeErrors, or torch.distributed.DistError subclasses)
_LOST_PEER = re.compile(r"timed out|timeout|connection (?:reset|closed|refused)|read error|write error|broken pipe|"
                        r"pair closure|socket closed", re.IGNORECASE)


def lost_peer(error: BaseException) -> bool:
    """True when ``error`` is a collective failing because a rank of its group is gone or silent."""
    if isinstance(error, dist.DistError):
        return True
    return isinstance(error, RuntimeError) and bool(_LOST_PEER.search(str(error)))


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300] if text else ''}"


class RefitGroups:
    """The process groups weights move over, each created with its own bounded wait
    (``timeout_s``, actor_rollout.refit_timeout_s) -- collective: every rank builds them together.

    world: every rank (live refit and capture streams; the agreement after an update);
    node:  the node's local_world_size ranks (pool switches; ``world`` when the job is one node);
    tp:    this rank's trainer tensor-parallel group (megatron's order: consecutive ranks), for the
           live producer's gather, when tp > 1.
    In a one-process world all are None (nothing is sent).
    """

    def __init__(self, timeout_s: float, *, local_world_size: int, tp: int = 1) -> None:
        if not timeout_s > 0:
            raise ValueError(f"{TIMEOUT_KEY} = {timeout_s}: must be > 0 (seconds)")
        self.timeout_s = float(timeout_s)
        self.world = self.node = self.tp = None
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return
        size, rank, L = dist.get_world_size(), dist.get_rank(), local_world_size
        if size % L or size % tp:
            raise EngineSetupError(f"LOCAL_WORLD_SIZE = {L} and trainer TP = {tp} must divide the world size ({size})")
        timeout = timedelta(seconds=self.timeout_s)
        self.world = dist.new_group(timeout=timeout)
        self.node = self.world
        if L < size:
            nodes = [dist.new_group(list(range(s, s + L)), timeout=timeout) for s in range(0, size, L)]
            self.node = nodes[rank // L]
        if tp > 1:
            tps = [dist.new_group(list(range(s, s + tp)), timeout=timeout) for s in range(0, size, tp)]
            self.tp = tps[rank // tp]


class WatchedSource(WeightSource):
    """``source`` whose bucket stream turns a lost rank (lost_peer) into RefitTimeoutError naming
    ``what``, the weight version, the bucket this rank was waiting for and the timeout key. Any
    other error passes through unchanged."""

    def __init__(self, source: WeightSource, what: str, timeout_s: float) -> None:
        self.source, self.what, self.timeout_s = source, what, timeout_s
        self.version = source.version

    def owner(self, spec: BucketSpec) -> int:
        return self.source.owner(spec)

    def produce(self, spec: BucketSpec, wire: Optional[torch.Tensor] = None) -> Optional[Bucket]:
        return self.source.produce(spec, wire)

    def buckets(self, plan: list[BucketSpec], group: Optional[dist.ProcessGroup] = None, dest=None):
        reached, t0 = 0, time.perf_counter()
        try:
            for bucket in self.source.buckets(plan, group, dest=dest):
                yield bucket
                reached += 1
        except Exception as e:
            if not lost_peer(e):
                raise
            spec = plan[reached] if reached < len(plan) else None
            where = f"bucket {reached} of {len(plan)} ({spec.names[0]} ..)" if spec else f"after all {len(plan)} buckets"
            raise RefitTimeoutError(
                f"{self.what} (weight version {self.version}): a rank of the refit group died or stalled; this rank "
                f"stopped at {where} after {time.perf_counter() - t0:.1f} s ({TIMEOUT_KEY} = {self.timeout_s:g} s: "
                f"raise it if a rank can legitimately lag that long). Cause: {_first_line(e)}") from e


def failing_ranks(ok: bool, group: Optional[dist.ProcessGroup], *, what: str = "",
                  timeout_s: Optional[float] = None) -> list[int]:
    """Global ranks of ``group`` whose ``ok`` is False (one all-gather; [] or [this rank] in one
    process). On a bounded refit group (timeout_s given), a lost rank raises RefitTimeoutError."""
    if group is None or dist.get_world_size(group) == 1:
        return [] if ok else [dist.get_rank() if dist.is_initialized() else 0]
    ranks = dist.get_process_group_ranks(group)
    device = comm_device(group)
    flags = [torch.zeros(1, dtype=torch.int64, device=device) for _ in ranks]
    t0 = time.perf_counter()
    try:
        dist.all_gather(flags, torch.tensor([0 if ok else 1], device=device), group=group)
    except Exception as e:
        if timeout_s is None or not lost_peer(e):
            raise
        raise RefitTimeoutError(
            f"{what}: a rank of the refit group died or stalled before the ranks agreed on its outcome (this "
            f"rank's part {'succeeded' if ok else 'failed'}; waited {time.perf_counter() - t0:.1f} s, "
            f"{TIMEOUT_KEY} = {timeout_s:g} s: raise it if a rank can legitimately lag that long). "
            f"Cause: {_first_line(e)}") from e
    return [r for r, f in zip(ranks, flags) if int(f)]


def update_everywhere(engine: RolloutEngine, source: WeightSource, plan: list[BucketSpec], version: int, *,
                      stream_group: Optional[dist.ProcessGroup], groups: RefitGroups, what: str) -> None:
    """``engine.update_weights`` with ``source``'s stream over ``stream_group`` on every rank, then
    one agreement over ``groups.world``: when the update failed anywhere, every rank raises
    WeightUpdateError naming the ranks, so all of them take the same recovery path (the stream never
    leaves a rank waiting: update_weights drains it after an error). A lost rank -- in the stream or
    in the agreement -- raises RefitTimeoutError within groups.timeout_s instead."""
    watched = WatchedSource(source, what, groups.timeout_s)
    error: Optional[WeightUpdateError] = None
    try:
        engine.update_weights(watched.buckets(plan, stream_group), version)
    except WeightUpdateError as e:
        lost = e.__cause__ if isinstance(e.__cause__, RefitTimeoutError) else None
        if lost is not None:  # the group is broken: no agreement can follow, the run stops
            raise lost
        error = e
    bad = failing_ranks(error is None, groups.world, what=what, timeout_s=groups.timeout_s)
    if error is not None:
        raise error
    if bad:
        engine.invalidate()  # this rank's update went through, but the step must not use it
        raise WeightUpdateError(f"{what} refused on rank(s) {bad} (see their log); no engine keeps it")


def check_engine_config(cfg, *, world_size: int) -> None:
    """Every check of the engine choice that needs no engine: the named engine's own (what it
    supports, its package installed), then rollout TP vs the world size. Raises EngineSetupError naming
    the key, value and rule."""
    ar = cfg.actor_rollout
    try:
        spec = ROLLOUT_ENGINES.get(ar.engine)
    except ValueError as e:
        raise EngineSetupError(str(e)) from None
    spec.check(cfg, world_size=world_size)
    rtp = ar.tensor_model_parallel_size
    if world_size % rtp:
        raise EngineSetupError(f"actor_rollout.tensor_model_parallel_size = {rtp} does not divide the world size "
                               f"({world_size}): each rollout engine spans rollout-TP ranks of the job")


def refit_bucket_bytes(cfg) -> int:
    return max(1, int(cfg.actor_rollout.refit_bucket_mb * 2 ** 20))


def build_engine(cfg, model_dir: Path, hf_cfg: dict, *, pad_token_id: int, world_size: int,
                 log: Callable[[str], None], device: Optional[torch.device] = None) -> RolloutEngine:
    """The engine ``cfg.actor_rollout.engine`` names (pfppo_mega.registry.ROLLOUT_ENGINES), with the
    refit bucket size of the config and max_model_len = rollout_max_model_len(cfg, hf_cfg), on
    ``device`` (the trainer's: the built-in engine lives there; vLLM places itself; default cpu).
    An engine's package (vLLM) is imported only when it is named."""
    check_engine_config(cfg, world_size=world_size)
    return ROLLOUT_ENGINES.get(cfg.actor_rollout.engine).build(
        cfg, model_dir, hf_cfg, pad_token_id=pad_token_id, bucket_bytes=refit_bucket_bytes(cfg),
        max_model_len=rollout_max_model_len(cfg, hf_cfg), device=device or torch.device("cpu"), log=log)


def rollout_max_model_len(cfg, hf_cfg: dict) -> int:
    """The longest sequence a rollout can reach, data.max_prompt_length + algorithm.max_response_length:
    vLLM's max_model_len (its default, the model's max_position_embeddings -- 131072 for Llama-3.3 --
    sizes the scheduler's limits and the CPU KV-cache bound for nothing). Refused when it exceeds the
    model's context."""
    prompt, response = cfg.data.max_prompt_length, cfg.algorithm.max_response_length
    context = int(hf_cfg["max_position_embeddings"])
    if prompt + response > context:
        raise EngineSetupError(
            f"data.max_prompt_length ({prompt}) + algorithm.max_response_length ({response}) = {prompt + response} "
            f"exceeds the model's context (max_position_embeddings = {context} in its config.json): lower either key")
    return prompt + response


class EngineSync:
    """Weights into this rank's engine (see the module docstring).

    local_world_size: ranks per node (read before a vLLM engine is built: an in-process vLLM sets
    LOCAL_WORLD_SIZE to 1). refit_timeout_s: the bounded wait of every refit collective
    (actor_rollout.refit_timeout_s). The refit's process groups (RefitGroups: world, node, trainer
    TP) are created here (collective). Buckets are planned at the engine's bucket_bytes.
    """

    def __init__(self, engine: RolloutEngine, actor, model_cfg, *, refit_timeout_s: float,
                 local_world_size: Optional[int] = None, log: Callable[[str], None] = print) -> None:
        from pfppo_mega.rollout.live import LiveWeights

        self.engine, self.actor, self.model_cfg, self.log = engine, actor, model_cfg, log
        self.distributed = dist.is_initialized() and dist.get_world_size() > 1
        self.world = dist.group.WORLD if self.distributed else None  # generation's agreements (unbounded)
        world = dist.get_world_size() if self.distributed else 1
        rank = dist.get_rank() if self.distributed else 0
        L = local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if world % L:
            raise EngineSetupError(f"LOCAL_WORLD_SIZE = {L} does not divide the world size ({world})")
        self.rank = rank
        self.node_ranks = list(range(rank - rank % L, rank - rank % L + L))
        self.layout = engine.weight_layout()
        live = LiveWeights(actor, model_cfg, self.layout, 0)
        self.groups = RefitGroups(refit_timeout_s, local_world_size=L, tp=live.tp)  # collective
        if live.tp_group is not None and self.groups.tp is not None:
            mine, theirs = dist.get_process_group_ranks(self.groups.tp), dist.get_process_group_ranks(live.tp_group)
            if mine != theirs:
                raise RuntimeError(f"rank {rank}: refit TP group {mine} differs from megatron's {theirs}")
        self.node_group = self.groups.node
        # one plan for every stream: live, pool and switch (buckets never cross a pipeline stage)
        self.plan: list[BucketSpec] = live.plan(engine.bucket_bytes)
        self.last_refit_s = 0.0
        self.weights_s = 0.0  # seconds of every refit and switch so far (the step reads its share)
        self.received = {"refit": 0, "switch": 0}  # weight bytes this rank's engine took (take_received)

    def live(self, version: int):
        """The actor's weights as ``version``'s buckets (LiveWeights), its TP gather on the refit's bounded group."""
        from pfppo_mega.rollout.live import LiveWeights

        live = LiveWeights(self.actor, self.model_cfg, self.layout, version)
        if self.groups.tp is not None:
            live.tp_group = self.groups.tp  # the producer's gather waits at most refit_timeout_s too
        return live

    def refit_live(self, version: int) -> float:
        """The actor's current weights into the engine as ``version``; returns the seconds taken."""
        t0 = time.perf_counter()
        update_everywhere(self.engine, self.live(version), self.plan, version, stream_group=self.groups.world,
                          groups=self.groups, what=f"refit to version {version}")
        self.received["refit"] += self.plan_bytes()
        self.last_refit_s = time.perf_counter() - t0
        self.weights_s += self.last_refit_s
        return self.last_refit_s

    def failing_ranks(self, ok: bool, group=None) -> list[int]:
        """Global ranks of ``group`` (the world by default) whose ``ok`` is False (one all-gather)."""
        if not self.distributed:
            return [] if ok else [self.rank]
        return failing_ranks(ok, group or self.world)

    def reload(self, pool, version: int, step: int) -> None:
        """Push ``version`` into every engine again, in full (after an engine failure): the live
        weights when version is the current step, else pool snapshot ``version``; both verified."""
        self.engine.invalidate()  # every rank takes the full update path (no 'already holds it' shortcut)
        if pool is not None and version != step and version in pool.versions:
            self.switch(pool, version)
        else:
            self.refit_live(step)

    def new_pool(self, pool_size: int):
        from pfppo_mega.pool.sharded import ShardedSnapshotPool

        return ShardedSnapshotPool(pool_size, self.layout, rank=self.rank, node_ranks=self.node_ranks,
                                   log=self.log)

    def capture(self, pool, version: int) -> None:
        """Snapshot the actor's current weights into ``pool`` (each rank keeps its share). It runs
        with the trainer on the device (after an update): the stream's buffers go when it ends."""
        try:
            pool.capture_from(WatchedSource(self.live(version), f"pool capture of version {version}",
                                            self.groups.timeout_s), self.plan, self.groups.world)
        finally:
            self.release_buffers()

    def release_buffers(self) -> int:
        """Free the refit stream's kept buffers (pfppo_mega.rollout.refit.release_slots): when the
        engine sleeps and after a capture, so they never sit beside the trainer's states (the ledger's
        "sleep"); the next refit or switch makes new ones. Returns the bytes freed."""
        from pfppo_mega.rollout.refit import release_slots

        return release_slots()

    def switch(self, pool, version: int) -> float:
        """Pool snapshot ``version`` into the engine (raises WeightUpdateError on a corrupt shard,
        on every rank alike: every engine verifies the same bytes). Nothing moves when the engine
        already holds exactly that snapshot (same version and stream checksum)."""
        t0 = time.perf_counter()
        held = pool.stream_checksums.get(version)
        if held and self.engine.weight_version == version and self.engine.weight_checksum == held:
            # the bytes need not move, but a shard that rotted in host memory is still refused
            bad = failing_ranks(pool.verify(pool.snapshots[pool.versions.index(version)]), self.groups.world,
                                what=f"check of snapshot {version}", timeout_s=self.groups.timeout_s)
            if bad:
                raise WeightUpdateError(f"snapshot {version}: the shard kept by rank(s) {bad} failed its checksum; "
                                        f"corrupt bytes refused")
            return time.perf_counter() - t0
        update_everywhere(self.engine, pool.source(version), self.plan, version, stream_group=self.node_group,
                          groups=self.groups, what=f"switch to snapshot {version}")
        self.received["switch"] += self.plan_bytes()
        secs = time.perf_counter() - t0
        self.weights_s += secs
        return secs

    def plan_bytes(self) -> int:
        """Weight bytes of one full update (every bucket of the plan)."""
        return sum(spec.nbytes for spec in self.plan)

    def take_received(self) -> dict[str, int]:
        """Weight bytes this rank's engine received (live refits, pool switches) since the last call."""
        out, self.received = self.received, {"refit": 0, "switch": 0}
        return out

    def check_versions(self, what: str) -> None:
        from pfppo_mega.pool.assignment import check_engine_versions

        check_engine_versions(self.engine.weight_version, self.engine.weight_checksum, what=what, group=self.world)
