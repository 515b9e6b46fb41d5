"""Start-up checks of combinations no single config key can refuse (pfppo_mega/trainer/build.py).

Issue 40's sweep: a critic warm-up with an estimator that trains no critic (GRPO, RLOO, ... as
verl's GRPO scripts can carry trainer.critic_warmup) ran its warm-up steps updating nothing at all:
rollouts generated and scored, the policy unchanged, exit 0."""

from __future__ import annotations

import pytest

from pfppo_mega.config import load_config_dict
from pfppo_mega.registry import ADV_ESTIMATORS
from pfppo_mega.trainer.build import SetupError, check_critic_warmup


def _cfg(estimator: str, warm: int):
    return load_config_dict({"actor_rollout": {"model_path": "/x", "n_samples_per_prompt": 4},
                             "algorithm": {"adv_estimator": estimator},
                             "training": {"critic_warmup_steps": warm, "total_training_steps": 10}})


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus"])
def test_a_critic_warmup_without_a_critic_is_refused(estimator):
    assert not ADV_ESTIMATORS.get(estimator).needs_critic
    with pytest.raises(SetupError, match=rf"training.critic_warmup_steps \(verl: trainer.critic_warmup\) = 3, but "
                                         rf"algorithm.adv_estimator = '{estimator}' trains no critic: its first 3 "
                                         rf"step\(s\) would update nothing"):
        check_critic_warmup(_cfg(estimator, 3), ADV_ESTIMATORS.get(estimator))


@pytest.mark.parametrize("estimator,warm", [("gae", 3), ("grpo", 0)])
def test_a_warmup_with_a_critic_or_none_at_all_is_accepted(estimator, warm):
    check_critic_warmup(_cfg(estimator, warm), ADV_ESTIMATORS.get(estimator))
