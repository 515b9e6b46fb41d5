"""optimal_token_baseline: inputs of the wrong shape, or rows without sum_pi_squared, are named."""

import pytest
import torch

from pfppo_mega.ppo.outcome import optimal_token_baseline_advantages
from pfppo_mega.registry import ADV_ESTIMATORS
from pfppo_mega.trainer.estimators import AdvantageInputs

B, T = 3, 4
OK = dict(token_rewards=torch.zeros(B, T), mask=torch.ones(B, T), group_ids=torch.tensor([0, 0, 1]),
          old_logp=torch.zeros(B, T), sum_pi_squared=torch.ones(B, T))


@pytest.mark.parametrize("name,bad,fragment", [
    ("sum_pi_squared", torch.ones(B, T + 1), "sum_pi_squared"),
    ("old_logp", torch.zeros(B), "old_logp"),
    ("group_ids", torch.tensor([0, 1]), "group_ids must be [B] = [3]"),
])
def test_shapes_are_named(name, bad, fragment):
    kw = {**OK, name: bad}
    with pytest.raises(ValueError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        optimal_token_baseline_advantages(kw["token_rewards"], kw["mask"], kw["group_ids"], kw["old_logp"],
                                          kw["sum_pi_squared"])


def test_rows_without_sum_pi_squared_are_named():
    x = AdvantageInputs(token_rewards=OK["token_rewards"], mask=OK["mask"], values=None, group_ids=OK["group_ids"])
    with pytest.raises(ValueError, match="no sum_pi_squared"):
        ADV_ESTIMATORS.get("optimal_token_baseline").compute(x, None)
