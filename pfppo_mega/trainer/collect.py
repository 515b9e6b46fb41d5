"""How a step's scored rows are collected, chosen once from the config (algorithm.filter_groups):

    OneRound          rollout then score the step's prompts (every run without dynamic sampling);
    DynamicSampling   DAPO: drop prompt groups whose rewards all agree (no advantage for a group
                      estimator), draw more prompts and generate again until the batch is full
                      (each round generates gen_batch_size prompts, verl's data.gen_batch_size;
                      the first rollout_batch_size groups kept are trained on),
                      at most max_num_gen_batches rounds; short after that, the batch is filled with
                      dropped groups (counted). Every rank takes part in every round (generation is
                      collective), until every rank is full. Unbounded (max_num_gen_batches = 0), a
                      rank still short that keeps no group over a full pass over its prompts stops
                      the run (SamplingStalled, on every rank together): more rounds would never end.

A collector is given the step's two phases as functions (rollout: prompts -> rows and their
statistics; score: rows -> scored rows) and the phase timer; it knows nothing of the trainer.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Callable, Protocol

import torch

from pfppo_mega import parallel
from pfppo_mega.trainer.batch import RolloutBatch, ScoredBatch, concat_scored
from pfppo_mega.types import Sample

Rollout = Callable[[list[Sample]], tuple[RolloutBatch, dict[str, float]]]
Score = Callable[[RolloutBatch], ScoredBatch]
Timer = Callable[[str], AbstractContextManager]  # timer(phase name): a frame timing that phase


class Collector(Protocol):
    """A step's scored rows from its prompts (OneRound, DynamicSampling, the asynchronous mode's)."""

    def collect(self, samples: list[Sample], *, rollout: Rollout, score: Score,
                timer: Timer) -> tuple[ScoredBatch, dict[str, float]]: ...

    def close(self) -> None:
        """End what the collector started outside this process (idempotent)."""


class OneRound:
    def collect(self, samples: list[Sample], *, rollout: Rollout, score: Score,
                timer: Timer) -> tuple[ScoredBatch, dict[str, float]]:
        with timer("rollout"):
            rb, stats = rollout(samples)
        with timer("score"):
            scored = score(rb)
        return scored, stats

    def close(self) -> None:
        """Nothing outside this process."""


def agreeing_groups(scored: ScoredBatch) -> torch.Tensor:
    """[groups] bool: every row of the group scored the same raw reward. Groups are 0..G-1."""
    g = scored.rollout.group_ids
    G = int(g.max()) + 1
    r = scored.raw_scores.double()
    lo = torch.full((G,), float("inf"), dtype=torch.float64, device=r.device).scatter_reduce(0, g, r, "amin")
    hi = torch.full((G,), float("-inf"), dtype=torch.float64, device=r.device).scatter_reduce(0, g, r, "amax")
    return lo == hi


class SamplingStalled(RuntimeError):
    """Unbounded dynamic sampling that can keep no group: the message names the rounds, the groups kept
    and the key to change. `pfppo train` exits non-zero with it (as with update.TrainingHalted)."""


# Unbounded sampling from a generated task (no pass over the data to measure progress by): a rank still
# short after this many rounds in a row without a kept group stops the run.
IDLE_ROUNDS_GENERATED = 100


class DynamicSampling:
    def __init__(self, *, max_rounds: int, next_batch, log, pad_id: int, rows_per_pass: int | None = None,
                 gen_rows: int | None = None) -> None:
        self.max_rounds, self.next_batch, self.log, self.pad_id = max_rounds, next_batch, log, pad_id
        self.gen_rows = gen_rows  # prompts this rank generates per round; None: the step's own count
        self.rows_per_pass = rows_per_pass  # prompts this rank sees in one pass over the data; None: generated

    def idle_limit(self, need: int) -> int:
        """Rounds in a row without a kept group after which an unbounded rank is stuck: one pass over its prompts."""
        if self.rows_per_pass is None:
            return IDLE_ROUNDS_GENERATED
        return max(1, -(-self.rows_per_pass // need))

    def halt_if_stuck(self, *, need: int, have: int, idle: int, rounds: int) -> None:
        """Collective (every rank calls it every unbounded round): SamplingStalled on every rank when any
        rank still short has kept no group for a full pass."""
        limit = self.idle_limit(max(need, self.gen_rows or need))  # prompts per round
        if parallel.world_min(int(not (have < need and idle >= limit))) == 1:
            return
        span = ("the bound for a generated task (IDLE_ROUNDS_GENERATED: it has no pass over data to wait for)"
                if self.rows_per_pass is None else
                f"a full pass over the training prompts ({self.rows_per_pass} on this rank)")
        raise SamplingStalled(
            f"dynamic sampling: after {rounds} rounds a rank still short of its {need} prompt groups (this rank has "
            f"kept {min(have, need)}) kept no group over {limit} rounds in a row = {span}: every group's rewards "
            f"agree (all right or all wrong), and algorithm.filter_groups.max_num_gen_batches = 0 (no bound) would "
            f"draw prompts forever. Set algorithm.filter_groups.max_num_gen_batches > 0 (a batch still short is "
            f"then filled with agreeing groups), or check the reward function and the data")

    def close(self) -> None:
        """Nothing outside this process."""

    def collect(self, samples: list[Sample], *, rollout: Rollout, score: Score,
                timer: Timer) -> tuple[ScoredBatch, dict[str, float]]:
        need = len(samples)                              # prompt groups this rank trains on
        kept: list[ScoredBatch] = []
        spare: list[ScoredBatch] = []
        stats: dict[str, float] = {}
        rounds = have = dropped = idle = 0               # idle: rounds in a row without a kept group
        counts = [0, 0, 0]  # bad rewards, reward errors, timeouts over every round
        gen = max(need, self.gen_rows or need)
        batch = samples + (self.next_batch(gen - need) if gen > need else [])  # round 1: the step's prompts first
        while True:
            rounds += 1
            with timer("rollout"):
                rb, stats = rollout(batch)
            with timer("score"):
                scored = score(rb)
            counts = [counts[0] + scored.n_bad_rewards, counts[1] + scored.n_reward_errors,
                      counts[2] + scored.n_reward_timeouts]
            agree = agreeing_groups(scored)                                    # [groups]
            rows_agree = agree[scored.rollout.group_ids]                       # [B]
            keep = [i for i, a in enumerate(rows_agree.tolist()) if not a]
            drop = [i for i, a in enumerate(rows_agree.tolist()) if a]
            if keep:
                kept.append(scored.select(keep))
            if drop:
                spare.append(scored.select(drop))
            have += int((~agree).sum())
            dropped += int(agree.sum())
            idle = 0 if keep else idle + 1
            full = parallel.world_min(int(have >= need)) == 1  # every rank has its batch
            if full or (self.max_rounds and rounds >= self.max_rounds):
                break
            if not self.max_rounds:
                self.halt_if_stuck(need=need, have=have, idle=idle, rounds=rounds)
            batch = self.next_batch(gen)
        filled = max(0, need - have)
        if filled:
            self.log(f"[pfppo] dynamic sampling: {filled} of {need} prompt groups still agree after {rounds} rounds "
                     f"(algorithm.filter_groups.max_num_gen_batches); filled with agreeing groups")
        out = concat_scored(kept + spare, pad_id=self.pad_id)
        rows = [i for i, g in enumerate(out.rollout.group_ids.tolist()) if g < need]  # the first `need` groups
        out = out.select(rows)
        out.n_bad_rewards, out.n_reward_errors, out.n_reward_timeouts = counts
        stats = {**stats, "dapo/rounds": float(rounds), "dapo/dropped_groups": float(dropped),
                 "dapo/kept_groups": float(min(have, need)), "dapo/filled_groups": float(filled)}
        return out, stats


def build_collector(cfg, *, prompts, log, pad_id: int, dp: int = 1) -> OneRound | DynamicSampling:
    fg = cfg.algorithm.filter_groups
    if not fg.enable:
        return OneRound()
    gen_rows = None if fg.gen_batch_size is None else fg.gen_batch_size // dp  # divisible: build.check_batch_split
    return DynamicSampling(max_rounds=fg.max_num_gen_batches, next_batch=prompts.next_batch, log=log, pad_id=pad_id,
                           rows_per_pass=prompts.rows_per_pass, gen_rows=gen_rows)
