"""The behaviour policy: which weights generate a step's rollout. Chosen once per run
(``algorithm.use_pf_ppo``); the loop calls it and never asks which one it has.

    CurrentPolicy      plain PPO: the current weights generate; the rollout after each update
                       refits the engine to them first.
    SnapshotPolicy     PF-PPO: a pool of recent snapshots; each prompt group (assign: group) or
                       the whole step (assign: step) samples one; the rows' importance weights
                       correct for the mixed behaviour policies; every snapshot_interval steps the
                       new weights are captured and the oldest evicted.

Each owns its rollout, its importance correction, its post-update work, its metrics and its
checkpoint state (the policy-loss variant is the builder's choice: trainer/policy_loss.py).
"""

from __future__ import annotations

import abc
import dataclasses
import time
import weakref
from typing import Any, Callable, Optional

import torch

from pfppo_mega import pool as pfpool
from pfppo_mega.pool.assignment import broadcast_assignment
from pfppo_mega.pool.correction import ISStats
from pfppo_mega.rollout.weights import WeightUpdateError
from pfppo_mega.trainer.batch import ExperienceBatch, RolloutBatch, ScoredBatch, concat_rollouts
from pfppo_mega.trainer.colocation.generation import Generation
from pfppo_mega.trainer.instruments import devicecheck
from pfppo_mega.types import Sample

Need = Callable[[bool, str], None]  # a checkpoint check: need(ok, what) raises CheckpointError


class BehaviourPolicy(abc.ABC):
    keeps_state = False    # a checkpoint holds its state (state_meta / state_tensors / load_state)
    refits_current = False  # the rollout starts by refitting the engine to the current weights

    @abc.abstractmethod
    def rollout(self, samples: list[Sample], step: int) -> tuple[RolloutBatch, dict[str, float]]:
        """n_samples_per_prompt responses per prompt, and this behaviour's rollout statistics."""

    def correction(self, old_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor,
                   on_policy: torch.Tensor, *, reduce_sum, reduce_max
                   ) -> tuple[Optional[torch.Tensor], torch.Tensor, Optional[ISStats]]:
        """(is_weights [B, T] or None, pg_mask [B, T], IS statistics or None) of the rows."""
        return None, mask, None

    @abc.abstractmethod
    def after_update(self, step: int) -> None:
        """The sync phase: the new weights ``step`` are where the next rollout reads them."""

    def metrics(self, scored: ScoredBatch, sb: ScoredBatch, eb: ExperienceBatch, step: int) -> dict[str, float]:
        return {}

    def host_bytes(self) -> int:
        """Host bytes this behaviour holds (the memory ledger's work record)."""
        return 0

    # checkpoint state (keeps_state)
    def state_meta(self) -> dict:
        raise NotImplementedError

    def state_tensors(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def load_state(self, meta: Any, tensors: dict[str, torch.Tensor], step: int, need: Need) -> None:
        raise NotImplementedError  # only called when keeps_state


class CurrentPolicy(BehaviourPolicy):
    refits_current = True  # inside the colocated frame, before the KV cache wakes (trainer/colocation/generation.py)

    def __init__(self, gen: Generation, *, n: int) -> None:
        self.gen, self.n = gen, n

    def rollout(self, samples: list[Sample], step: int) -> tuple[RolloutBatch, dict[str, float]]:
        rb = self.gen.generate(samples, self.n, step=step)
        return rb, self.gen.take_turn_metrics()

    def after_update(self, step: int) -> None:
        """Nothing here: the next generation (rollout, evaluation, probe) refits to ``step`` in its
        colocated frame, after the trainer's states have left the device."""


class SnapshotPolicy(BehaviourPolicy):
    """PF-PPO's pool (pfppo_mega.pool), sharded 1/L per node rank by EngineSync, starting with the
    current (initial) policy."""

    keeps_state = True

    def __init__(self, gen: Generation, pool_cfg, *, n: int, step: int, assign_gen: torch.Generator,
                 guards: dict[str, int], dp_rank: int, log: Callable[[str], None]) -> None:
        self.gen, self.cfg, self.n, self.assign_gen = gen, pool_cfg, n, assign_gen
        self.guards, self.dp_rank, self.log = guards, dp_rank, log
        self.pool = gen.sync.new_pool(pool_cfg.pool_size)
        gen.sync.capture(self.pool, step)
        # an engine failure with a snapshot: that snapshot again. Held weakly: gen <-> policy as a
        # cycle would keep the engine (an in-process vLLM and its process groups) alive past the
        # run until the garbage collector ran -- in the middle of the next run's build (pfppo compare)
        push_again = weakref.WeakMethod(self._push_again)
        gen.push_again = lambda version, step: push_again()(version, step)
        log(f"[pfppo] PF-PPO pool: {pool_cfg.pool_size} x {self.pool.bytes_per_snapshot / 1e6:.2f} MB snapshot "
            f"shards per rank in host memory ({self.pool.layout.nbytes / 1e6:.2f} MB per snapshot per node), "
            f"sampling={pool_cfg.sampling}, every {pool_cfg.snapshot_interval} steps")

    # ------------------------------------------------------------------ rollout

    def rollout(self, samples: list[Sample], step: int) -> tuple[RolloutBatch, dict[str, float]]:
        """Each prompt group (assign: group) or the whole step (step) samples a behaviour snapshot;
        groups are generated per snapshot so the engine switches weights at most once per snapshot
        used (from host memory, never disk)."""
        pc, n = self.cfg, self.n
        cands = self.pool.candidates(step, pc.include_current)
        probs = pfpool.snapshot_weights([c.version for c in cands], method=pc.sampling,
                                        temperature=pc.sampling_temperature, current_version=step,
                                        kl=[c.kl_to_current for c in cands],
                                        mean_reward=[c.mean_reward for c in cands])
        assign = pfpool.assign_snapshots(len(samples), probs, self.assign_gen, per=pc.assign)  # [groups]
        assign = broadcast_assignment(assign, len(assign), group=self.gen.sync.world)  # rank 0 decides
        parts, order, switch_s = [], [], 0.0
        used = pfpool.group_by_snapshot(assign)
        held = [k for k in used if cands[k].version == self.gen.engine.weight_version]  # first: no reload for it
        for k in held + [k for k in used if k not in held]:
            groups = used[k]
            t0 = time.perf_counter()
            self._load(cands[k], step)
            switch_s += time.perf_counter() - t0
            parts.append(self.gen.generate([samples[g] for g in groups], n, step=step, groups=groups))
            order += [g * n + j for g in groups for j in range(n)]
        stats = {"pool/switch_s": switch_s, "pool/snapshots_used": float(len(parts)),
                 "pool/size": float(len(self.pool))}
        for k, c in enumerate(cands):
            stats[f"pool/slot{k}/prob"] = float(probs[k])
        stats.update(self.gen.take_turn_metrics())
        return concat_rollouts(parts, order, pad_id=self.gen.tokenizer.pad_id), stats

    def _load(self, cand: "pfpool.Candidate", step: int) -> None:
        """Put a candidate behaviour policy into the engine (its rows then carry its version). A
        snapshot that fails its checksum is evicted (counted) and the current weights are used."""
        if cand.snapshot is not None:
            try:
                with devicecheck.paused():  # the engine seam: host wire buffers by design
                    self.gen.sync.switch(self.pool, cand.version)
                self.gen.record("switch")
                return
            except WeightUpdateError as e:  # every rank's engine refuses the same bytes: all evict alike
                self.pool.evict(cand.version)
                self.pool.n_corrupt += 1
                self.guards["corrupt_snapshots"] += int(self.dp_rank == 0)  # summed over DP by the loop
                self.log(f"[pfppo] snapshot {cand.version} refused ({e}); evicted, generating with the current "
                         f"weights instead")
                if len(self.pool) == 0:  # never leave the pool empty: re-seed it with the current policy
                    with self.gen.offload.on_device():  # the live weights, also while offloaded
                        self.gen.sync.capture(self.pool, step)
        self.gen.ensure_current(step)  # version == step: the engine holds the current weights

    def _push_again(self, version: int, step: int) -> None:
        """After an engine failure: snapshot ``version`` from the pool, or the live weights when it
        is the current step's (or no longer held)."""
        self.gen.sync.reload(self.pool, version, step)

    def host_bytes(self) -> int:
        """This rank's shards of the pool's snapshots."""
        return sum(t.numel() * t.element_size() for snap in self.pool.snapshots for _, t in snap.tensors)

    # ------------------------------------------------------------------ correction, sync

    def correction(self, old_logp, behav_logp, mask, on_policy, *, reduce_sum, reduce_max):
        return pfpool.behaviour_is_weights(old_logp, behav_logp, mask, mode=self.cfg.is_mode,
                                           is_clip=self.cfg.is_clip, on_policy=on_policy,
                                           reduce_sum=reduce_sum, reduce_max=reduce_max)  # global batch's stats

    def after_update(self, step: int) -> None:
        """Snapshot the new weights every snapshot_interval steps (the rollout loads whichever
        snapshot it samples)."""
        if pfpool.snapshot_due(step, self.cfg.snapshot_interval):
            with devicecheck.paused():  # snapshots live in host memory by design
                self.gen.sync.capture(self.pool, step)

    # ------------------------------------------------------------------ metrics

    def metrics(self, scored: ScoredBatch, sb: ScoredBatch, eb: ExperienceBatch, step: int) -> dict[str, float]:
        """Per-snapshot sample count, reward, KL to current, IS weights; feeds the pool's stats.
        Counts and rewards (which `sampling: reward` reads) come from every generated row (`scored`),
        the IS and KL statistics from the rows the update trained on (`sb`, `eb`). ``step`` is the
        step just finished."""
        pc = self.cfg
        m = eb.inputs.response_mask
        per = pfpool.per_snapshot_stats(sb.rollout.versions, sb.raw_scores, eb.is_weights, m, eb.behav_logp,
                                        eb.old_logp, is_clip=pc.is_clip, on_policy=eb.on_policy)
        out: dict[str, float] = {"pool/bytes": float(self.pool.bytes_total()),
                                 "guard/corrupt_snapshots": float(self.guards["corrupt_snapshots"])}
        agg = eb.is_stats
        out.update({"is/mean": agg.mean, "is/max": agg.max, "is/frac_truncated": agg.frac_truncated,
                    "is/ess": agg.ess})
        current = step - 1  # the version the rollout treated as current
        versions = scored.rollout.versions
        # Keyed by recency rank (snap0 = newest behaviour policy used this step), not by version,
        # so the curves stay comparable over a run.
        for rank, version in enumerate(sorted(set(versions.tolist()), reverse=True)):
            rows = versions == version
            st = per.get(version)  # None when filtration resampled none of its rows
            signal = (scored.honest if pc.reward_signal == "honest" and scored.honest is not None
                      else scored.raw_scores)
            self.pool.record_samples(version, signal[rows],
                                     kl_to_current=None if st is None else st.kl_to_current,
                                     current_version=current)
            out[f"pool/snap{rank}/age"] = float(current - version)
            stats = {} if st is None else dataclasses.asdict(st)
            stats.update(count=int(rows.sum()), reward_mean=float(scored.raw_scores[rows].double().mean()))
            for k, v in stats.items():
                if v is not None:
                    out[f"pool/snap{rank}/{k}"] = float(v)
        return out

    # ------------------------------------------------------------------ checkpoint state

    def state_meta(self) -> dict:
        return self.pool.state_meta()

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return self.pool.state_tensors()

    def load_state(self, meta: Any, tensors: dict[str, torch.Tensor], step: int, need: Need) -> None:
        """Rebuild the pool exactly (versions, stats, snapshots, checksums) from this rank's shards."""
        size = self.cfg.pool_size
        need(isinstance(meta, dict) and meta.get("pool_size") == size,
             f"pool pool_size = {meta.get('pool_size') if isinstance(meta, dict) else meta!r} must equal "
             f"algorithm.pool.pool_size ({size})")
        try:
            pool = pfpool.SnapshotPool.from_state(meta, tensors, log=self.log)
        except ValueError as e:
            need(False, f"pool.safetensors / state pool: {e}")
        need(all(v <= step for v in pool.versions), f"pool versions {pool.versions} must be <= step {step}")
        # the layout of the pool built from the live weights (no collective here: a rank that
        # refused earlier must not leave the others waiting in one)
        current = [(n, t.dtype, tuple(t.shape)) for n, t in self.pool.snapshots[0].tensors]
        held = [(n, t.dtype, tuple(t.shape)) for n, t in pool.snapshots[0].tensors]
        need(held == current, "pool snapshots do not have the model's layout (names, dtypes, shapes)")
        sharded = self.gen.sync.new_pool(size)
        try:
            sharded.adopt(pool, self.gen.sync.plan)
        except ValueError as e:
            need(False, str(e))
        self.pool = sharded
