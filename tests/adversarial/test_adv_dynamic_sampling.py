"""Dynamic sampling without a round limit (issue 40): algorithm.filter_groups.max_num_gen_batches = 0
(verl's "unlimited") drew prompts forever when no group could ever be kept (every group's rewards
agree). A rank still short that keeps no group over a full pass over its prompts now stops the run
with SamplingStalled naming the rounds, the groups kept and the key to change; slow progress (a
group now and then) still finishes.

The pass logic runs on the real collector (build_collector) over a real FilePrompts with a stand-in
rollout; the wiring runs once through the real trainer (test_trainer's tiny SFT checkpoint, the
generated task, its bound lowered), with the rounds counted so that a hang fails instead of blocking.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_trainer import _cfg, sft_dir  # noqa: E402,F401  (the tiny SFT checkpoint fixture)

from pfppo_mega.config import load_config_dict  # noqa: E402
from pfppo_mega.data.files import FilePrompts  # noqa: E402
from pfppo_mega.trainer import collect  # noqa: E402
from pfppo_mega.trainer.batch import RolloutBatch, ScoredBatch  # noqa: E402
from pfppo_mega.types import Sample  # noqa: E402

N = 4  # samples per prompt


class Hang(Exception):
    pass


class StandIn:
    """The rollout and score functions the collector is given: group 0 of a round disagrees (is kept) only
    on the rounds `kept_on` says; past 1000 rounds it raises Hang (a hang fails instead of blocking)."""

    def __init__(self, kept_on=lambda rnd: False):
        self.kept_on, self.rounds = kept_on, 0

    def rollout(self, samples):
        self.rounds += 1
        if self.rounds > 1000:
            raise Hang("1000 rounds")
        B = len(samples) * N
        rb = RolloutBatch(samples=[s for s in samples for _ in range(N)], prompt_ids=[[1]] * B,
                          responses=torch.zeros(B, 1, dtype=torch.long), response_mask=torch.ones(B, 1),
                          behav_logp=torch.zeros(B, 1), finished=torch.ones(B, dtype=torch.bool),
                          versions=torch.zeros(B, dtype=torch.long), texts=[""] * B,
                          group_ids=torch.arange(len(samples)).repeat_interleave(N))
        return rb, {}

    def score(self, rb):
        r = torch.zeros(len(rb.texts))
        if self.kept_on(self.rounds):
            r[1] = 1.0  # group 0 disagrees: kept
        return ScoredBatch(rollout=rb, raw_scores=r, scores=r, n_bad_rewards=0)


def _collector(rows: int, max_rounds: int = 0):
    cfg = load_config_dict({"actor_rollout": {"model_path": "/nonexistent/model", "n_samples_per_prompt": N},
                            "algorithm": {"adv_estimator": "grpo",
                                          "filter_groups": {"enable": True, "max_num_gen_batches": max_rounds}}})
    samples = [Sample(prompt_ids=(1, 2, i), data_source="d", ground_truth="g", extra_info={}) for i in range(rows)]
    prompts = FilePrompts(samples, seed=0, shuffle=True)
    return collect.build_collector(cfg, prompts=prompts, log=lambda *_: None, pad_id=0), prompts


@contextmanager
def _no_timer(_name):  # the collector times its phases
    yield


def test_no_group_kept_over_a_full_pass_stops_with_the_key():
    c, prompts = _collector(rows=10)
    fake = StandIn()
    with pytest.raises(collect.SamplingStalled) as e:
        c.collect(prompts.next_batch(4), rollout=fake.rollout, score=fake.score, timer=_no_timer)
    msg = str(e.value)
    # 10 rows, 4 prompts a round: a pass is 3 rounds; it stops after the third without progress
    assert fake.rounds == 3
    assert ("after 3 rounds" in msg and "(this rank has kept 0)" in msg and "of its 4 prompt groups" in msg
            and "a full pass over the training prompts (10 on this rank)" in msg
            and "algorithm.filter_groups.max_num_gen_batches > 0" in msg), msg


def test_slow_progress_still_finishes():
    c, prompts = _collector(rows=8)  # a pass: 2 rounds; a group kept every 2nd round never stalls
    fake = StandIn(kept_on=lambda rnd: rnd % 2 == 0)
    out, stats = c.collect(prompts.next_batch(4), rollout=fake.rollout, score=fake.score, timer=_no_timer)
    assert stats["dapo/rounds"] == 8 and stats["dapo/kept_groups"] == 4 and stats["dapo/filled_groups"] == 0


def test_a_round_limit_is_left_as_it_was():
    c, prompts = _collector(rows=4, max_rounds=5)  # bounded: filled after 5 rounds, as before
    fake = StandIn()
    _, stats = c.collect(prompts.next_batch(4), rollout=fake.rollout, score=fake.score, timer=_no_timer)
    assert stats["dapo/rounds"] == 5 and stats["dapo/filled_groups"] == 4


def test_the_trainer_stops_a_step_that_can_keep_nothing(sft_dir, tmp_path, monkeypatch):  # noqa: F811
    """The generated task (no pass over data): the bound IDLE_ROUNDS_GENERATED, lowered to 3 here."""
    from pfppo_mega.trainer.loop import PPOTrainer

    monkeypatch.setattr(collect, "IDLE_ROUNDS_GENERATED", 3, raising=False)
    cfg = _cfg(tmp_path, sft_dir, actor_rollout={"n_samples_per_prompt": N},
               training={"rollout_batch_size": 16, "batch_size": 32, "total_training_steps": 2},
               algorithm={"adv_estimator": "grpo", "filter_groups": {"enable": True, "max_num_gen_batches": 0}})
    tr = PPOTrainer(cfg, log=lambda *_: None)
    score, rounds = tr.score, []

    def agreeing(rb):  # every group's rewards agree: nothing can ever be kept
        rounds.append(1)
        if len(rounds) > 50:  # the reward guard's own timers rule out an alarm here
            raise Hang("50 rounds and still sampling")
        sb = score(rb)
        sb.raw_scores = torch.zeros_like(sb.raw_scores)
        return sb

    tr.score = agreeing
    with pytest.raises(collect.SamplingStalled, match=r"after 3 rounds a rank still short of its 16 prompt "
                                                          r"groups \(this rank has kept 0\).*IDLE_ROUNDS_GENERATED"):
        tr.train_step()
