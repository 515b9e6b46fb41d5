"""Per-token KL estimators between the sampling policy and the reference policy.

Tokens are sampled from the policy pi, so with log_ratio = logp - ref_logp = log pi/pi_ref
(Schulman, "Approximating KL divergence", 2020):
    k1  = log_ratio                              unbiased for KL(pi || pi_ref), can be negative
    k2  = 0.5 * log_ratio^2                      biased, >= 0, low variance
    k3  = exp(-log_ratio) + log_ratio - 1        unbiased, >= 0, low variance
    abs = |log_ratio|
"""

import torch

from pfppo_mega.ppo.masked import check_same_shape, zero_padding

from pfppo_mega.constants import KL_ESTIMATORS, LOG_RATIO_LIMIT as _LOG_RATIO_LIMIT


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, *, estimator: str) -> torch.Tensor:
    """Per-token KL estimate (see module docstring), elementwise: [B, T] -> [B, T].

    For k3 the log-ratio is clamped to [-20, 20] before exp (gradient 0 beyond); k3 stays >= 0.
    """
    check_same_shape("kl_estimate", logp=logp, ref_logp=ref_logp)
    log_ratio = logp - ref_logp
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        neg = (-log_ratio).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)  # log pi_ref/pi
        return torch.expm1(neg) - neg  # exp(neg) - neg - 1, accurate near 0
    if estimator == "abs":
        return log_ratio.abs()
    raise ValueError(f"kl_estimate: estimator={estimator!r} is not one of {KL_ESTIMATORS}")


def apply_kl_penalty(
    token_rewards: torch.Tensor,
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    mask: torch.Tensor,
    *,
    kl_coeff: float,
    estimator: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reward shaped by a per-token KL penalty.

        kl_t = kl_estimate(logp_t, ref_logp_t)             on real tokens, 0 on padding
        r'_t = r_t - kl_coeff * kl_t                         on real tokens, 0 on padding

    token_rewards, logp, ref_logp, mask: [B, T]. Returns (penalised_rewards [B, T], kl [B, T]).
    logp is the log-prob under the policy that sampled the tokens (old policy at rollout time).
    """
    check_same_shape(
        "apply_kl_penalty", token_rewards=token_rewards, logp=logp, ref_logp=ref_logp, mask=mask
    )
    kl = zero_padding(kl_estimate(logp, ref_logp, estimator=estimator), mask)  # [B, T]
    penalised = zero_padding(token_rewards - kl_coeff * kl.to(token_rewards.dtype), mask)
    return penalised, kl
