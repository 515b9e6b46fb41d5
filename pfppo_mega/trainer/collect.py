"""How a step's scored rows are collected, chosen once from the config (algorithm.filter_groups):

    OneRound          rollout then score the step's prompts (every run without dynamic sampling);
    DynamicSampling   DAPO: drop prompt groups whose rewards all agree (no advantage for a group
                      estimator), draw more prompts and generate again until the batch is full,
                      at most max_num_gen_batches rounds; short after that, the batch is filled with
                      dropped groups (counted). Every rank takes part in every round (generation is
                      collective), until every rank is full.
"""

from __future__ import annotations

import torch

from pfppo_mega import parallel
from pfppo_mega.trainer.batch import ScoredBatch, concat_scored
from pfppo_mega.types import Sample


class OneRound:
    def collect(self, trainer, samples: list[Sample], timer) -> tuple[ScoredBatch, dict[str, float]]:
        with timer("rollout"):
            rb, stats = trainer.rollout(samples)
        with timer("score"):
            scored = trainer.score(rb)
        return scored, stats


def agreeing_groups(scored: ScoredBatch) -> torch.Tensor:
    """[groups] bool: every row of the group scored the same raw reward. Groups are 0..G-1."""
    g = scored.rollout.group_ids
    G = int(g.max()) + 1
    r = scored.raw_scores.double()
    lo = torch.full((G,), float("inf"), dtype=torch.float64, device=r.device).scatter_reduce(0, g, r, "amin")
    hi = torch.full((G,), float("-inf"), dtype=torch.float64, device=r.device).scatter_reduce(0, g, r, "amax")
    return lo == hi


class DynamicSampling:
    def __init__(self, *, max_rounds: int, next_batch, log) -> None:
        self.max_rounds, self.next_batch, self.log = max_rounds, next_batch, log

    def collect(self, trainer, samples: list[Sample], timer) -> tuple[ScoredBatch, dict[str, float]]:
        need = len(samples)                              # prompt groups this rank trains on
        kept: list[ScoredBatch] = []
        spare: list[ScoredBatch] = []
        stats: dict[str, float] = {}
        rounds = have = dropped = 0
        counts = [0, 0, 0]  # bad rewards, reward errors, timeouts over every round
        batch = samples
        while True:
            rounds += 1
            with timer("rollout"):
                rb, stats = trainer.rollout(batch)
            with timer("score"):
                scored = trainer.score(rb)
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
            full = parallel.world_min(int(have >= need)) == 1  # every rank has its batch
            if full or (self.max_rounds and rounds >= self.max_rounds):
                break
            batch = self.next_batch(need)
        filled = max(0, need - have)
        if filled:
            self.log(f"[pfppo] dynamic sampling: {filled} of {need} prompt groups still agree after {rounds} rounds "
                     f"(algorithm.filter_groups.max_num_gen_batches); filled with agreeing groups")
        out = concat_scored(kept + spare, pad_id=trainer.run.tokenizer.pad_id)
        rows = [i for i, g in enumerate(out.rollout.group_ids.tolist()) if g < need]  # the first `need` groups
        out = out.select(rows)
        out.n_bad_rewards, out.n_reward_errors, out.n_reward_timeouts = counts
        stats = {**stats, "dapo/rounds": float(rounds), "dapo/dropped_groups": float(dropped),
                 "dapo/kept_groups": float(min(have, need)), "dapo/filled_groups": float(filled)}
        return out, stats


def build_collector(cfg, *, prompts, log):
    fg = cfg.algorithm.filter_groups
    if not fg.enable:
        return OneRound()
    return DynamicSampling(max_rounds=fg.max_num_gen_batches, next_batch=prompts.next_batch, log=log)
