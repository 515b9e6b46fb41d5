"""Policy filtration for PPO (PF-PPO, Zhang, Shen et al., arXiv 2409.06957).

The reward model is more reliable on some responses (the highest and lowest scored) than on
the rest, so PF-PPO trains on a filtered batch: responses are resampled, with replacement, with
probabilities computed from their scores, then the usual PPO update runs on the resampled batch.
The paper's strategies (per prompt, over its N responses): best-of-N, best-random (BR: the best
and one random response), best-worst (BW: the best and the worst). verl's `pf_ppo` applies
score-derived weights over the whole batch and resamples it (the batch size, with replacement);
both choices are the caller's: call filtration_weights on a prompt's group or on the whole batch.

Under verl's names, verl's exact weights (not normalised; s the scores [B], float dtype of s):
    pow         w_i = |s_i|^weight_pow
    max_min     w_i = 1 if s_i == max s or s_i == min s, else 0
    max_random  w_i = 0.4 if s_i == max s, else 0.1
    then        w = clamp(w + 1e-8, min=1e-8)      (never all zero: sampling always possible)
Note that verl's `pow` is not monotone in s for negative scores (|-3| > |1|).

Our variants, under their own names (normalised, w >= 0, sum w = 1, computed in float64):
    pow_minmax   w_i ∝ ((s_i - min s) / (max s - min s))^weight_pow      (all equal -> uniform)
                 Monotone in s and shift-invariant; the minimum gets 0 for weight_pow > 0.
    best_random  BR: the probability that a sample is one draw of the best-random pair, where
                 the pair is (the best, chosen uniformly among the k tied maxima; a uniform pick
                 among the B - 1 others) and each member is drawn with probability 1/2:
                   w_max   = 1/(2k) + (k - 1) / (2k(B - 1))     for each of the k maxima
                   w_other = 1 / (2(B - 1))
                 So a maximum never weighs less than another sample; all equal (k = B) ->
                 uniform; B = 1 -> [1]. With one maximum (k = 1): 1/2 on it and 1/(2(B-1)) on
                 each other sample (for B = 5 this equals verl's max_random normalised).
resample_indices draws from any of them (multinomial normalises).
"""

import torch

from pfppo_mega.constants import REWEIGHT_METHODS, VERL_REWEIGHT_METHODS

_VERL_FLOOR = 1e-8  # verl: clamp(w + 1e-8, min=1e-8)


def _check_scores(scores: torch.Tensor) -> None:
    if scores.dim() != 1 or scores.numel() == 0:
        raise ValueError(
            f"filtration_weights: scores.shape={tuple(scores.shape)} must be floating [B] with B >= 1"
        )
    n_bad = int((~torch.isfinite(scores)).sum().item())  # host sync
    if n_bad:
        raise ValueError(
            f"filtration_weights: {n_bad} of {scores.numel()} scores are NaN/inf; weights need "
            "finite scores (clean them with check_finite_rewards first)"
        )


@torch.no_grad()
def filtration_weights(scores: torch.Tensor, *, method: str, weight_pow: float) -> torch.Tensor:
    """Resampling weights [B] from scores [B] (see the module docstring for the formulas).

    verl's names: verl's values, in scores' floating dtype (float32 for integer scores). Ours:
    computed in float64, normalised, returned in scores' floating dtype. weight_pow is used by
    "pow" and "pow_minmax" only and must be >= 0 there.
    """
    if method not in REWEIGHT_METHODS:
        raise ValueError(f"filtration_weights: method={method!r} is not one of {REWEIGHT_METHODS}")
    _check_scores(scores)
    if method in ("pow", "pow_minmax") and weight_pow < 0:
        raise ValueError(f"filtration_weights: weight_pow={weight_pow} must be >= 0 for {method!r}")
    out_dtype = scores.dtype if scores.is_floating_point() else torch.float32
    if method in VERL_REWEIGHT_METHODS:
        s = scores.to(out_dtype)  # [B]
        if method == "pow":
            w = s.abs().pow(weight_pow)
        elif method == "max_min":
            w = ((s == s.max()) | (s == s.min())).to(out_dtype)
        else:  # max_random
            w = torch.where(s == s.max(), torch.full_like(s, 0.4), torch.full_like(s, 0.1))
        return torch.clamp(w + _VERL_FLOOR, min=_VERL_FLOOR)
    s = scores.to(torch.float64)  # [B]
    s_max, s_min = s.max(), s.min()
    is_max = s == s_max  # [B]
    ones = torch.ones_like(s)
    if method == "pow_minmax":
        spread = s_max - s_min
        # Scaled to [0, 1] first: the max gets 1, so the sum cannot underflow for a large pow.
        scaled = (s - s_min) / torch.where(spread > 0, spread, ones[0])
        raw = torch.where(spread > 0, scaled.pow(weight_pow), ones)
    else:  # best_random
        # Marginal of one draw of the BR pair: with prob 1/2 the best (uniform over the k tied
        # maxima), with prob 1/2 a uniform pick among the B - 1 samples other than that best.
        num = s.numel()
        if num == 1:
            raw = ones
        else:
            k = is_max.sum().to(torch.float64)
            w_max = 0.5 / k + 0.5 * (k - 1) / (k * (num - 1))
            raw = torch.where(is_max, w_max, 0.5 / (num - 1) * ones)
    return (raw / raw.sum()).to(out_dtype)


def resample_indices(
    weights: torch.Tensor, *, num_samples: int, generator: torch.Generator | None
) -> torch.Tensor:
    """num_samples indices drawn i.i.d. from Categorical(weights), with replacement.

    weights: [B], >= 0, finite, positive sum (need not be normalised) -> LongTensor [num_samples].
    Pass a seeded generator for reproducible draws. Floating weights only.
    """
    if weights.dim() != 1 or weights.numel() == 0 or not weights.is_floating_point():
        raise ValueError(
            f"resample_indices: weights ({weights.dtype}) of shape={tuple(weights.shape)} must be floating [B] with B >= 1"
        )
    if num_samples < 1:
        raise ValueError(f"resample_indices: num_samples={num_samples} must be >= 1")
    w = weights.detach().to(torch.float64)
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()) or not w.sum() > 0:
        raise ValueError(
            "resample_indices: weights must be finite, >= 0 and have a positive sum; "
            f"got min={w.min().item()}, sum={w.sum().item()}"
        )
    # Drawn in the weights' own dtype (verl draws from its float32 weights), validated in float64.
    return torch.multinomial(weights.detach(), num_samples, replacement=True, generator=generator)
