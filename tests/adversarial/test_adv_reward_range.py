"""A reward beyond float32's range passed the NaN/inf guard as a Python float, became inf in the
trainer's float32 tensor, and every update was then skipped with a message that never named the
reward (issue 24.5). It is now a counted bad reward, named at the sample."""

import math

import pytest
import torch

from pfppo_mega.rewards.base import FLOAT32_MAX, judge


@pytest.mark.parametrize("value", [1e39, -1e39, 2.0 ** 200, float(2 ** 128), 3.5e38])
def test_a_reward_beyond_float32_is_a_counted_bad_reward(value):
    assert math.isfinite(value) and not math.isfinite(float(torch.tensor(value, dtype=torch.float32)))
    score, outcome, detail = judge("value", value)
    assert (score, outcome) == (0.0, "bad_rewards") and "beyond float32's range" in detail


@pytest.mark.parametrize("value", [0.0, -1.0, 1e38, FLOAT32_MAX, -FLOAT32_MAX])
def test_a_reward_float32_holds_passes(value):
    score, outcome, _ = judge("value", value)
    assert outcome == "ok" and score == value and math.isfinite(float(torch.tensor(score, dtype=torch.float32)))


def test_the_limit_is_float32s():
    assert FLOAT32_MAX == torch.finfo(torch.float32).max
