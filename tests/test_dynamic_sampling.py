"""DAPO's dynamic sampling (algorithm.filter_groups, trainer/collect.py): prompt groups whose rewards
all agree are dropped and more prompts generated until the batch is full, bounded; what was dropped
and how many rounds it took are logged."""

import pytest
import torch

from pfppo_mega.config import ConfigError
from pfppo_mega.trainer.batch import RolloutBatch, ScoredBatch
from pfppo_mega.trainer.collect import agreeing_groups
from pfppo_mega.trainer.loop import PPOTrainer

from test_trainer import _cfg, sft_dir  # noqa: F401  (the module's SFT checkpoint fixture)


def _agreeing_by_hand(sb: ScoredBatch) -> list[bool]:
    """Per group (in group-id order): do all its rewards agree? Written here, not agreeing_groups."""
    by_group: dict[int, set[float]] = {}
    for g, r in zip(sb.rollout.group_ids.tolist(), sb.scores.tolist()):
        by_group.setdefault(g, set()).add(r)
    return [len(by_group[g]) == 1 for g in sorted(by_group)]


def _scored(groups: list[int], rewards: list[float]) -> ScoredBatch:
    B = len(groups)
    rb = RolloutBatch(samples=[None] * B, prompt_ids=[[1]] * B, responses=torch.zeros(B, 1, dtype=torch.long),
                      response_mask=torch.ones(B, 1), behav_logp=torch.zeros(B, 1),
                      finished=torch.ones(B, dtype=torch.bool), versions=torch.zeros(B, dtype=torch.long),
                      texts=[""] * B, group_ids=torch.tensor(groups))
    r = torch.tensor(rewards)
    return ScoredBatch(rollout=rb, raw_scores=r, scores=r, n_bad_rewards=0)


def test_agreeing_groups():
    sb = _scored([0, 0, 1, 1, 2, 2, 3], [1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 2.0])
    assert agreeing_groups(sb).tolist() == [True, False, True, True]  # a group of one always agrees


def test_filter_groups_needs_groups(sft_dir, tmp_path):  # noqa: F811
    with pytest.raises(ConfigError, match=r"algorithm.filter_groups.enable = True: needs "
                                          r"actor_rollout.n_samples_per_prompt >= 2"):
        _cfg(tmp_path, sft_dir, algorithm={"filter_groups": {"enable": True}})


@pytest.mark.parametrize("max_rounds", [0, 1])
def test_the_trained_batch_holds_only_informative_groups(sft_dir, tmp_path, max_rounds):  # noqa: F811
    cfg = _cfg(tmp_path, sft_dir, actor_rollout={"n_samples_per_prompt": 4},
               training={"rollout_batch_size": 16, "batch_size": 32, "total_training_steps": 2},
               algorithm={"adv_estimator": "grpo", "filter_groups": {"enable": True, "max_num_gen_batches": max_rounds}})
    tr = PPOTrainer(cfg, log=lambda *_: None)
    seen = []
    filt = tr.filter
    tr.filter = lambda sb: (seen.append(sb), filt(sb))[1]
    metrics = [tr.train_step() for _ in range(2)]
    for sb, m in zip(seen, metrics):
        assert len(sb.scores) == 16 * 4 and sorted(set(sb.rollout.group_ids.tolist())) == list(range(16))
        agree = agreeing_groups(sb)
        assert int(agree.sum()) == m["dapo/filled_groups"], (agree.tolist(), m)
        assert m["dapo/kept_groups"] + m["dapo/filled_groups"] == 16
        if max_rounds == 1:
            assert m["dapo/rounds"] == 1
        print(f"max rounds {max_rounds}: rounds {m['dapo/rounds']:.0f}, dropped {m['dapo/dropped_groups']:.0f}, "
              f"kept {m['dapo/kept_groups']:.0f}, filled {m['dapo/filled_groups']:.0f}")
    if max_rounds == 0:  # unbounded: every group of the trained batch carries a signal
        assert all(m["dapo/filled_groups"] == 0 for m in metrics)


def test_a_dropped_group_is_counted_and_refilled_from_a_later_round(sft_dir, tmp_path):  # noqa: F811
    """Round 1 of step 1 is made to hold 3 agreeing groups (their rewards set to 0): they are dropped,
    a second round generates more prompts, and the trained batch is the first 8 informative groups of
    the rounds in order, none of them agreeing. Counts checked against the rounds recorded here."""
    cfg = _cfg(tmp_path, sft_dir, actor_rollout={"n_samples_per_prompt": 4},
               training={"rollout_batch_size": 8, "batch_size": 32, "total_training_steps": 1},
               algorithm={"adv_estimator": "grpo", "filter_groups": {"enable": True, "max_num_gen_batches": 0}})
    tr = PPOTrainer(cfg, log=lambda *_: None)
    rounds: list[ScoredBatch] = []
    score = tr.score

    def forced(rb):
        sb = score(rb)
        if not rounds:  # round 1: groups 0, 1, 2 agree (all four rewards 0); others keep their rewards
            force = sb.rollout.group_ids < 3                                   # [B]
            sb.scores = torch.where(force, torch.zeros_like(sb.scores), sb.scores)
            sb.raw_scores = torch.where(force, torch.zeros_like(sb.raw_scores), sb.raw_scores)
        rounds.append(sb)
        return sb
    tr.score = forced
    trained = []
    filt = tr.filter
    tr.filter = lambda sb: (trained.append(sb), filt(sb))[1]
    m = tr.train_step()

    agree = [_agreeing_by_hand(sb) for sb in rounds]
    assert agree[0][:3] == [True, True, True]
    assert m["dapo/rounds"] == len(rounds) >= 2
    assert m["dapo/dropped_groups"] == sum(map(sum, agree)) >= 3
    assert (m["dapo/kept_groups"], m["dapo/filled_groups"]) == (8, 0)
    # the trained batch: the informative groups of round 1, then of round 2, ..., the first 8 of them
    want: list[str] = []
    for sb, a in zip(rounds, agree):
        groups = sorted(set(sb.rollout.group_ids.tolist()))
        for g, agrees in zip(groups, a):
            if not agrees:
                want += [t for t, gi in zip(sb.rollout.texts, sb.rollout.group_ids.tolist()) if gi == g]
    got = trained[0]
    assert len(got.scores) == 8 * 4 and got.rollout.texts == want[:8 * 4]
    assert not any(_agreeing_by_hand(got))
