"""The trainer's side of the rollout seam: build the engine the config names, and move weights into it.

One object per trainer process (``EngineSync``) does every weight movement of a step through the
same call, ``engine.update_weights(source.buckets(plan, group), version)``:
  refit_live(v)       the actor's current megatron shards (LiveWeights), broadcast over the world
  capture(pool, v)    the same stream, kept by the PF-PPO pool (1/L of each snapshot per node rank)
  switch(pool, v)     a pool snapshot, broadcast from its keepers inside the node
and checks, after each generation, that every engine generated with the same version and weight
checksum (pfppo_mega.pool.registry). See docs/refit.md.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from pfppo_mega.rollout.base import RolloutEngine
from pfppo_mega.rollout.weights import BucketSpec, WeightUpdateError

ENGINES = ("builtin", "vllm")


class EngineSetupError(ValueError):
    """The configured rollout engine cannot run in this job."""


def check_engine_config(cfg, *, world_size: int) -> None:
    """Every check of the engine choice that needs no engine: rollout TP vs the world size, what the
    engine supports, vLLM installed. Raises EngineSetupError naming the key, value and rule."""
    ar = cfg.actor_rollout
    rtp = ar.tensor_model_parallel_size
    if ar.engine not in ENGINES:
        raise EngineSetupError(f"actor_rollout.engine = {ar.engine!r}: allowed {ENGINES}")
    if ar.engine == "builtin" and rtp != 1:
        raise EngineSetupError(f"actor_rollout.tensor_model_parallel_size = {rtp}: the builtin engine runs "
                               f"one full copy per rank (allowed: 1); use engine: vllm for rollout TP > 1")
    if world_size % rtp:
        raise EngineSetupError(f"actor_rollout.tensor_model_parallel_size = {rtp} does not divide the world size "
                               f"({world_size}): each rollout engine spans rollout-TP ranks of the job")
    if ar.engine == "vllm":
        if ar.top_p < 1.0:
            raise EngineSetupError(
                f"actor_rollout.top_p = {ar.top_p} with engine: vllm: vLLM reports log-probs under the "
                f"renormalised nucleus, which the trainer's off-policy correction does not model; set "
                f"actor_rollout.top_p: 1.0 or engine: builtin")
        from pfppo_mega.rollout import vllm as rvllm

        why = rvllm.unavailable_reason()
        if why:
            raise EngineSetupError(f"actor_rollout.engine = 'vllm': {why}")


def build_engine(cfg, model_dir: Path, hf_cfg: dict, *, pad_token_id: int, world_size: int,
                 log: Callable[[str], None]) -> RolloutEngine:
    """The engine ``cfg.actor_rollout.engine`` names, with the refit bucket size of the config.
    vLLM is imported only here, only when it is named."""
    check_engine_config(cfg, world_size=world_size)
    ar = cfg.actor_rollout
    bucket_bytes = max(1, int(ar.refit_bucket_mb * 2 ** 20))
    if ar.engine == "builtin":
        from pfppo_mega.rollout import BuiltinEngine, LlamaShape

        return BuiltinEngine(LlamaShape.from_hf_config(hf_cfg), pad_token_id=pad_token_id,
                             bucket_bytes=bucket_bytes, log=log)
    from pfppo_mega.rollout import vllm as rvllm

    return rvllm.VLLMEngine(model_dir, pad_token_id=pad_token_id, tensor_parallel_size=ar.tensor_model_parallel_size,
                            seed=cfg.training.seed, bucket_bytes=bucket_bytes,
                            gpu_memory_utilization=ar.gpu_memory_utilization, log=log)


class EngineSync:
    """Weights into this rank's engine (see the module docstring).

    local_world_size: ranks per node (read before a vLLM engine is built: an in-process vLLM sets
    LOCAL_WORLD_SIZE to 1). One process group per node is created here (collective).
    """

    def __init__(self, engine: RolloutEngine, actor, model_cfg, *, local_world_size: Optional[int] = None,
                 log: Callable[[str], None] = print) -> None:
        from pfppo_mega.rollout.live import LiveWeights

        self.engine, self.actor, self.model_cfg, self.log = engine, actor, model_cfg, log
        self.distributed = dist.is_initialized() and dist.get_world_size() > 1
        self.world = dist.group.WORLD if self.distributed else None
        world = dist.get_world_size() if self.distributed else 1
        rank = dist.get_rank() if self.distributed else 0
        L = local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if world % L:
            raise EngineSetupError(f"LOCAL_WORLD_SIZE = {L} does not divide the world size ({world})")
        self.rank = rank
        self.node_ranks = list(range(rank - rank % L, rank - rank % L + L))
        self.node_group = self.world
        if self.distributed and L < world:
            groups = [dist.new_group(list(range(s, s + L))) for s in range(0, world, L)]  # collective
            self.node_group = groups[rank // L]
        self.layout = engine.weight_layout()
        # one plan for every stream: live, pool and switch (buckets never cross a pipeline stage)
        self.plan: list[BucketSpec] = LiveWeights(actor, model_cfg, self.layout, 0).plan(engine.bucket_bytes)
        self.last_refit_s = 0.0

    def _live(self, version: int):
        from pfppo_mega.rollout.live import LiveWeights

        return LiveWeights(self.actor, self.model_cfg, self.layout, version)

    def refit_live(self, version: int) -> float:
        """The actor's current weights into the engine as ``version``; returns the seconds taken."""
        t0 = time.perf_counter()
        self._update_everywhere(lambda: self.engine.update_weights(self._live(version).buckets(self.plan, self.world),
                                                                   version), f"refit to version {version}")
        self.last_refit_s = time.perf_counter() - t0
        return self.last_refit_s

    def _update_everywhere(self, update: Callable[[], None], what: str) -> None:
        """Run an engine update on every rank and agree on its outcome (one all-gather): when it
        failed anywhere, every rank raises WeightUpdateError naming the ranks, so all of them take
        the same recovery path (the stream itself never leaves a rank waiting: update_weights drains
        it after an error)."""
        error: Optional[WeightUpdateError] = None
        try:
            update()
        except WeightUpdateError as e:
            error = e
        bad = self.failing_ranks(error is None)
        if error is not None:
            raise error
        if bad:
            self.engine.invalidate()  # this rank's update went through, but the step must not use it
            raise WeightUpdateError(f"{what} refused on rank(s) {bad} (see their log); no engine keeps it")

    def failing_ranks(self, ok: bool, group=None) -> list[int]:
        """Global ranks of ``group`` (the world by default) whose ``ok`` is False (one all-gather)."""
        if not self.distributed:
            return [] if ok else [self.rank]
        from pfppo_mega.rollout.refit import group_device

        group = group or self.world
        ranks = dist.get_process_group_ranks(group)
        device = group_device(group)
        flags = [torch.zeros(1, dtype=torch.int64, device=device) for _ in ranks]
        dist.all_gather(flags, torch.tensor([0 if ok else 1], device=device), group=group)
        return [r for r, f in zip(ranks, flags) if int(f)]

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
        """Snapshot the actor's current weights into ``pool`` (each rank keeps its share)."""
        pool.capture_from(self._live(version), self.plan, self.world)

    def switch(self, pool, version: int) -> float:
        """Pool snapshot ``version`` into the engine (raises WeightUpdateError on a corrupt shard,
        on every rank alike: every engine verifies the same bytes). Nothing moves when the engine
        already holds exactly that snapshot (same version and stream checksum)."""
        t0 = time.perf_counter()
        held = pool.stream_checksums.get(version)
        if held and self.engine.weight_version == version and self.engine.weight_checksum == held:
            # the bytes need not move, but a shard that rotted in host memory is still refused
            bad = self.failing_ranks(pool.verify(pool.snapshots[pool.versions.index(version)]))
            if bad:
                raise WeightUpdateError(f"snapshot {version}: the shard kept by rank(s) {bad} failed its checksum; "
                                        f"corrupt bytes refused")
            return time.perf_counter() - t0
        self._update_everywhere(lambda: self.engine.update_weights(
            pool.source(version).buckets(self.plan, self.node_group), version), f"switch to snapshot {version}")
        return time.perf_counter() - t0

    def check_versions(self, what: str) -> None:
        from pfppo_mega.pool.registry import check_engine_versions

        check_engine_versions(self.engine.weight_version, self.engine.weight_checksum, what=what, group=self.world)
