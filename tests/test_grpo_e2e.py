"""GRPO (and Dr.GRPO, and verl's other losses) train end to end, with and without the PF-PPO pool:
no critic is built, the pool's is/* metrics are logged, rewards and losses are finite, and every
group the estimator sees holds the n samples of one prompt."""

import json
import math

import pytest
import torch

from pfppo_mega.registry import ADV_ESTIMATORS
from pfppo_mega.trainer.estimators import AdvantageEstimator, _grpo
from pfppo_mega.trainer.loop import PPOTrainer

from test_trainer import _cfg, sft_dir  # noqa: F401  (the module's SFT checkpoint fixture)

N = 4
SEEN: list[torch.Tensor] = []


@pytest.fixture
def watched_grpo():
    """grpo, recording the group ids each step's rows carry."""
    def compute(x, ctx):
        SEEN.append(x.group_ids.cpu())
        return _grpo(x, ctx)
    SEEN.clear()
    ADV_ESTIMATORS.register("grpo_watched", AdvantageEstimator("grpo_watched", needs_critic=False, compute=compute,
                                                               needs_groups=True))
    yield
    ADV_ESTIMATORS.unregister("grpo_watched")


def _train(tmp_path, sft_dir, **algorithm):  # noqa: F811
    sections = dict(algorithm={"use_pf_ppo": True, "pool": {"pool_size": 2, "snapshot_interval": 1}, **algorithm},
                    actor_rollout={"n_samples_per_prompt": N}, training={"rollout_batch_size": 16, "batch_size": 32,
                                                                          "total_training_steps": 3})
    tr = PPOTrainer(_cfg(tmp_path, sft_dir, **sections), log=lambda *_: None)
    assert tr.run.critic is None and tr.run.critic_opt is None
    res = tr.fit()
    return tr, [json.loads(line) for line in open(res.metrics_path)][1:]  # the step-0 eval record first


def test_grpo_with_the_pool_trains_without_a_critic(sft_dir, tmp_path, watched_grpo):  # noqa: F811
    tr, steps = _train(tmp_path, sft_dir, adv_estimator="grpo_watched")
    assert [s["step"] for s in steps] == [1, 2, 3]
    for s in steps:
        assert any(k.startswith("is/") for k in s), sorted(s)
        assert math.isfinite(s["reward/mean"]) and math.isfinite(s["policy/loss"])
        assert "critic/value_loss" not in s and "critic/grad_norm" not in s  # no critic step ran
        # a group's N rows share their prompt: the shared floor prefills it once (trainer/instruments/perf.py)
        assert 0 < s["perf/rollout_floor_shared_s"] < s["perf/rollout_floor_s"], s
    # groups: each prompt's n samples, all on this rank (every rank generates all n of its prompts)
    assert len(SEEN) == 3
    for ids in SEEN:
        _, counts = torch.unique(ids, return_counts=True)
        assert (counts == N).all() and len(ids) == 16 * N


@pytest.mark.parametrize("policy_loss", ["gspo", "cispo", "geo_mean", "clip_cov", "kl_cov", "gpg", "sapo"])
def test_verl_losses_train_with_the_pool(sft_dir, tmp_path, policy_loss):  # noqa: F811
    tr, steps = _train(tmp_path, sft_dir, adv_estimator="grpo", policy_loss=policy_loss)
    assert tr.run.policy_loss.name == policy_loss
    for s in steps:
        assert math.isfinite(s["policy/loss"]) and math.isfinite(s["policy/pg_loss"]) and "is/mean" in s


def test_dr_grpo_trains(sft_dir, tmp_path):  # noqa: F811
    tr, steps = _train(tmp_path, sft_dir, adv_estimator="grpo", norm_adv_by_std_in_grpo=False,
                       loss_agg_mode="seq-mean-token-sum-norm", use_pf_ppo=False)
    assert tr.run.policy_loss_params.loss_scale_factor == tr.run.cfg.algorithm.max_response_length
    for s in steps:
        assert math.isfinite(s["policy/loss"])
