"""When PF-PPO is unlikely to pay: advice `pfppo validate` prints (stderr, exit status unchanged).

Only for a config with `algorithm.use_pf_ppo: true`. Each rule is a named threshold below; a
warning names the keys, their values and the reason, so a user can decide from the message alone.
These are warnings, not errors: a short run with the pool on is a legitimate test of the code.

The rules (per the PF-PPO article, "when not to use it"):

- budget:    total_training_steps < MIN_STEPS (200). The article expects the pool to pay only
             after ~100-200 steps; before that it is still filling and mostly holds near copies
             of the starting policy.
- diversity: rollout_batch_size < MIN_GROUPS_PER_SNAPSHOT (4) * pool_size. Snapshots are drawn
             per prompt group; with fewer than 4 groups per snapshot on average a step sees only
             a few of the pool's policies, and the per-snapshot statistics the kl / reward
             weightings read (pool/snapN/*) rest on a handful of samples. Only for `assign: group`: with
             `assign: step` a step sees one snapshot by design and the mixture is across steps.
- cost:      actor_rollout.engine vllm with pool.assign group and pool_size > 1. Each snapshot a
             step uses costs one weight reload through vLLM's reload path and one more generate
             call; `assign: step` draws one snapshot per step (at most one switch, which replaces
             plain PPO's push of the new weights). The measured step times of both on the demo
             are in docs/refit.md ("Measured"); what group assignment buys in learning is in
             docs/experiments/pool_step.
- fill:      pool_size * snapshot_interval > total_training_steps. The pool never holds
             pool_size snapshots as far apart as configured before the run ends.
- checkpoint: 0 < checkpoint.save_interval < pool.snapshot_interval. The article builds its
             pool from saved checkpoints; here the pool is captured in memory every
             snapshot_interval steps and each checkpoint stores the whole pool. Checkpoints more
             frequent than snapshots store the same pool again and again (pool_size model
             copies per save) without making snapshots differ more; to make them differ, raise
             snapshot_interval, not the checkpoint frequency.
"""

from __future__ import annotations

from dataclasses import dataclass

from pfppo_mega.config.tree import Config

MIN_STEPS = 200
MIN_GROUPS_PER_SNAPSHOT = 4


@dataclass(frozen=True)
class Advice:
    rule: str    # budget, diversity, fill, checkpoint, cost
    key: str     # the key to change first
    reason: str  # the values and the rule, one sentence

    def __str__(self) -> str:
        return f"{self.key}: {self.reason}"


def pf_ppo_advice(cfg: Config) -> list[Advice]:
    """The reasons PF-PPO is unlikely to pay with `cfg`; empty when the pool is off."""
    a, t = cfg.algorithm, cfg.training
    if not a.use_pf_ppo:
        return []
    size, interval, steps = a.pool.pool_size, a.pool.snapshot_interval, t.total_training_steps
    out = []
    if steps < MIN_STEPS:
        out.append(Advice("budget", "training.total_training_steps", (
            f"{steps} steps is under {MIN_STEPS}: PF-PPO pays after ~100-200 steps, before that the "
            f"pool is still warming up (plain PPO: algorithm.use_pf_ppo=false)")))
    if a.pool.assign == "group" and t.rollout_batch_size < MIN_GROUPS_PER_SNAPSHOT * size:
        out.append(Advice("diversity", "training.rollout_batch_size", (
            f"{t.rollout_batch_size} prompt groups per step for a pool of {size} is under "
            f"{MIN_GROUPS_PER_SNAPSHOT} per snapshot ({MIN_GROUPS_PER_SNAPSHOT * size}): a step sees few "
            f"of the pool's policies, so the pool adds little diversity; raise rollout_batch_size or "
            f"lower algorithm.pool.pool_size")))
    if size * interval > steps:
        out.append(Advice("fill", "algorithm.pool.pool_size", (
            f"pool_size {size} x snapshot_interval {interval} = {size * interval} steps to fill the "
            f"pool, more than total_training_steps {steps}: the run ends before the pool holds "
            f"{size} snapshots; lower pool_size or snapshot_interval")))
    if cfg.actor_rollout.engine == "vllm" and a.pool.assign == "group" and size > 1:
        out.append(Advice("cost", "algorithm.pool.assign", (
            f"group: each prompt group draws its own snapshot, so a step can use up to {size} snapshots, "
            f"each one vLLM weight reload and one more generate call; assign: step draws one per step "
            f"(at most one switch, in place of plain PPO's push of the new weights) -- step times and "
            f"what group assignment buys in learning: docs/refit.md, docs/experiments/pool_step")))
    save = cfg.checkpoint.save_interval
    if 0 < save < interval:
        out.append(Advice("checkpoint", "checkpoint.save_interval", (
            f"checkpoints every {save} steps, snapshots every {interval} (algorithm.pool.snapshot_interval): "
            f"consecutive checkpoints store the same pool ({size} model copies each) and do not make "
            f"snapshots differ; to make them differ raise snapshot_interval, and save at most once per "
            f"snapshot")))
    return out
