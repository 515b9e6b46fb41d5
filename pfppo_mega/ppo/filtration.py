"""Policy filtration for PPO (PF-PPO, Zhang, Shen et al., arXiv 2409.06957).

The reward model is more reliable on some responses (the highest and lowest scored) than on
the rest, so PF-PPO trains on a filtered batch: responses are resampled, with replacement, with
probabilities computed from their scores, then the usual PPO update runs on the resampled batch.
The paper's strategies (per prompt, over its N responses): best-of-N, best-random (BR: the best
and one random response), best-worst (BW: the best and the worst). verl's `pf_ppo` applies
score-derived weights over the whole batch and resamples it; both choices are the caller's:
call filtration_weights on a prompt's group or on the whole batch.

What is implemented (w >= 0, sum w = 1, over the given scores s [B]):
    pow        w_i ∝ ((s_i - min s) / (max s - min s))^weight_pow      (all equal -> uniform)
               Monotone in s; the minimum gets 0 for weight_pow > 0. (verl uses |s_i|^p, which is
               not monotone for negative scores; the shift makes the weights shift-invariant.)
    max_min    BW: equal weight on every sample whose score equals max s or min s (ties
               included), 0 elsewhere (verl's indicator, normalised). All equal -> uniform.
    max_random BR: the probability that a sample is one draw of the best-random pair, where
               the pair is (the best, chosen uniformly among the k tied maxima; a uniform pick
               among the B - 1 others) and each member is drawn with probability 1/2:
                 w_max   = 1/(2k) + (k - 1) / (2k(B - 1))     for each of the k maxima
                 w_other = 1 / (2(B - 1))
               So a maximum never weighs less than another sample; all equal (k = B) -> uniform;
               B = 1 -> [1]. With one maximum (k = 1) this is 1/2 on it and 1/(2(B-1)) on each
               other sample, which for B = 5 equals verl's 0.4 / 0.1 weights normalised.
"""

import torch

REWEIGHT_METHODS = ("pow", "max_min", "max_random")


def _check_scores(scores: torch.Tensor) -> None:
    if scores.dim() != 1 or scores.numel() == 0:
        raise ValueError(
            f"filtration_weights: scores.shape={tuple(scores.shape)} must be [B] with B >= 1"
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

    Computed in float64, returned in scores' floating dtype (float32 for integer scores).
    weight_pow is used by "pow" only and must be >= 0 there.
    """
    if method not in REWEIGHT_METHODS:
        raise ValueError(f"filtration_weights: method={method!r} is not one of {REWEIGHT_METHODS}")
    _check_scores(scores)
    out_dtype = scores.dtype if scores.is_floating_point() else torch.float32
    s = scores.to(torch.float64)  # [B]
    s_max, s_min = s.max(), s.min()
    is_max = s == s_max  # [B]
    ones = torch.ones_like(s)
    if method == "pow":
        if weight_pow < 0:
            raise ValueError(f"filtration_weights: weight_pow={weight_pow} must be >= 0 for 'pow'")
        spread = s_max - s_min
        # Scaled to [0, 1] first: the max gets 1, so the sum cannot underflow for a large pow.
        scaled = (s - s_min) / torch.where(spread > 0, spread, ones[0])
        raw = torch.where(spread > 0, scaled.pow(weight_pow), ones)
    elif method == "max_min":
        raw = (is_max | (s == s_min)).to(torch.float64)
    else:  # max_random
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
    Pass a seeded generator for reproducible draws.
    """
    if weights.dim() != 1 or weights.numel() == 0:
        raise ValueError(
            f"resample_indices: weights.shape={tuple(weights.shape)} must be [B] with B >= 1"
        )
    if num_samples < 1:
        raise ValueError(f"resample_indices: num_samples={num_samples} must be >= 1")
    w = weights.detach().to(torch.float64)
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()) or not w.sum() > 0:
        raise ValueError(
            "resample_indices: weights must be finite, >= 0 and have a positive sum; "
            f"got min={w.min().item()}, sum={w.sum().item()}"
        )
    return torch.multinomial(w, num_samples, replacement=True, generator=generator)
