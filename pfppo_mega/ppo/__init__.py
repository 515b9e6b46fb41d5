"""Pure-torch PPO / PF-PPO math: masked reductions, GAE, KL, losses, reward shaping, filtration.

Imports only torch; every function takes tensors and plain keyword scalars.
"""

from pfppo_mega.ppo.advantages import compute_gae
from pfppo_mega.ppo.filtration import REWEIGHT_METHODS, filtration_weights, resample_indices
from pfppo_mega.ppo.kl import KL_ESTIMATORS, apply_kl_penalty, kl_estimate
from pfppo_mega.ppo.losses import (
    LOSS_AGG_MODES,
    PolicyLossOutput,
    ValueLossOutput,
    agg_loss,
    entropy_from_logits,
    logprobs_from_logits,
    policy_loss,
    value_loss,
)
from pfppo_mega.ppo.masked import masked_mean, masked_sum, masked_var, masked_whiten
from pfppo_mega.ppo.rewards import (
    REWARD_SCALING,
    RunningMoments,
    check_finite_rewards,
    clip_rewards,
    length_penalty,
    overlong_penalty,
    quantile_clip,
    scale_rewards,
    scores_to_token_rewards,
)

__all__ = [
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "REWARD_SCALING",
    "REWEIGHT_METHODS",
    "PolicyLossOutput",
    "RunningMoments",
    "ValueLossOutput",
    "agg_loss",
    "apply_kl_penalty",
    "check_finite_rewards",
    "clip_rewards",
    "compute_gae",
    "entropy_from_logits",
    "filtration_weights",
    "kl_estimate",
    "length_penalty",
    "overlong_penalty",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "policy_loss",
    "quantile_clip",
    "resample_indices",
    "scale_rewards",
    "scores_to_token_rewards",
    "value_loss",
]
