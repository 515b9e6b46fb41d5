"""Sequence-level reward shaping: cleaning, scaling, clipping, length penalty, token placement.

`scores` are one scalar per response, [B]. They become per-token rewards [B, T] on the last
real token of each response (`scores_to_token_rewards`), where a KL penalty may be added.
"""

import math

import torch

from pfppo_mega.constants import REWARD_SCALING
from pfppo_mega.ppo.masked import Gather, ReduceSum


class RunningMoments:
    """Running mean and variance of a scalar stream, merged batch by batch.

    Chan et al. parallel merge of (count, mean, M2) with M2 = sum (x - mean)^2:
        n = n_a + n_b,  d = mean_b - mean_a
        mean = mean_a + d * n_b / n
        M2   = M2_a + M2_b + d^2 * n_a * n_b / n
    var = M2 / (n - 1) (unbiased; 0 while n <= 1), std = sqrt(var). Kept as Python floats
    (float64) on the host, so state_dict() is plain data.
    """

    def __init__(self) -> None:
        self._count = 0
        self._mean = 0.0
        self._m2 = 0.0

    @property
    def count(self) -> int:
        return self._count

    @property
    def mean(self) -> float:
        return self._mean

    @property
    def var(self) -> float:
        return self._m2 / (self._count - 1) if self._count > 1 else 0.0

    @property
    def std(self) -> float:
        return math.sqrt(self.var)

    def update(self, x: torch.Tensor, *, reduce_sum: ReduceSum | None = None) -> None:
        """Merge the values of x (any shape, read as [N]) into the moments. Host sync (.item()).

        With reduce_sum (sums a tensor over the data-parallel ranks) the batch merged is the
        global one (every rank's x), so every rank holds the same moments whatever the DP size.
        """
        x = x.detach().reshape(-1).to(torch.float64)
        n_bad = int((~torch.isfinite(x)).sum().item())
        if n_bad:
            raise ValueError(
                f"RunningMoments.update: {n_bad} of {x.numel()} values are NaN/inf; moments only take "
                "finite values (clean them with check_finite_rewards first)"
            )
        if reduce_sum is None:
            n_b = x.numel()
            if n_b == 0:
                return
            mean_b = x.mean().item()
            m2_b = (x - mean_b).square().sum().item()
        else:
            total, count = reduce_sum(torch.stack([x.sum(), torch.tensor(float(x.numel()), dtype=x.dtype,
                                                                          device=x.device)]))
            n_b = int(count.item())
            if n_b == 0:
                return
            mean_b = (total / count).item()
            m2_b = reduce_sum((x - mean_b).square().sum()).item()
        n_a = self._count
        n = n_a + n_b
        delta = mean_b - self._mean
        self._mean += delta * n_b / n
        self._m2 += m2_b + delta * delta * n_a * n_b / n
        self._count = n

    def state_dict(self) -> dict[str, float]:
        return {"count": float(self._count), "mean": self._mean, "m2": self._m2}

    def load_state_dict(self, state: dict[str, float]) -> None:
        expected = {"count", "mean", "m2"}
        if set(state) != expected:
            raise ValueError(
                f"RunningMoments.load_state_dict: keys {sorted(state)} must be {sorted(expected)}"
            )
        count = float(state["count"])
        if count < 0 or count != int(count):
            raise ValueError(
                f"RunningMoments.load_state_dict: count={count} must be an integer >= 0"
            )
        self._count = int(count)
        self._mean = float(state["mean"])
        self._m2 = float(state["m2"])


def scale_rewards(
    scores: torch.Tensor,
    *,
    method: str,
    running: RunningMoments | None = None,
    eps: float = 1e-8,
    reduce_sum: ReduceSum | None = None,
) -> torch.Tensor:
    """Scale sequence scores [B] -> [B].

        none            s
        batch_zscore    (s - mean(s)) / std(s)             mean/std of this batch (unbiased std)
        running_zscore  (s - mu) / sigma                   running.update(s) first, then mu/sigma
                                                           of everything seen, this batch included
    The only place `running` is updated: callers must not update it themselves (once per batch).
    reduce_sum (sums a tensor over the data-parallel ranks; None: this rank's batch is the whole
    batch) makes "this batch" the global batch for both z-scores, so the result does not depend
    on the DP size. When the std is <= eps (one score, all scores equal, or a single value seen)
    the scores are only centred, never divided: no NaN/inf. running_zscore mutates `running`.
    """
    if method not in REWARD_SCALING:
        raise ValueError(f"scale_rewards: method={method!r} is not one of {REWARD_SCALING}")
    if scores.dim() != 1:
        raise ValueError(f"scale_rewards: scores.shape={tuple(scores.shape)} must be [B]")
    if method == "none":
        return scores
    if method == "batch_zscore":
        if reduce_sum is None:
            if scores.numel() == 0:
                return scores
            mean = scores.mean()
            std = scores.std(unbiased=True) if scores.numel() > 1 else torch.zeros_like(mean)
        else:
            total, n = reduce_sum(torch.stack([scores.sum(), torch.tensor(float(scores.numel()),
                                                                          dtype=scores.dtype, device=scores.device)]))
            mean = total / n.clamp(min=1.0)
            sq = reduce_sum((scores - mean).square().sum())
            std = (sq / (n - 1.0).clamp(min=1.0)).sqrt()
        denom = torch.where(std > eps, std, torch.ones_like(std))
        return (scores - mean) / denom
    if running is None:
        raise ValueError("scale_rewards: method='running_zscore' needs running=RunningMoments()")
    running.update(scores, reduce_sum=reduce_sum)
    centred = scores - running.mean
    return centred / running.std if running.std > eps else centred


def clip_rewards(scores: torch.Tensor, *, clip_range: float | None) -> torch.Tensor:
    """clamp(s, -c, c) with c = clip_range; None -> unchanged. Any shape."""
    if clip_range is None:
        return scores
    if not clip_range > 0.0:
        raise ValueError(f"clip_rewards: clip_range={clip_range} must be > 0 (or None)")
    return scores.clamp(-clip_range, clip_range)


def quantile_clip(
    scores: torch.Tensor, *, quantile: float | None, gather: Gather | None = None
) -> torch.Tensor:
    """clamp(s, Q(1 - q), Q(q)) with Q the empirical quantile of s (linear interpolation, as
    numpy's default) and q = quantile, e.g. 0.95 clips both tails at the 5% / 95% quantiles.

    scores: [B] -> [B]. None -> unchanged. q must be in [0.5, 1]; q = 1 is a no-op.
    gather (concatenates a tensor over the data-parallel ranks; None: this rank's batch is the
    whole batch) makes Q the quantile of the global batch, so the result does not depend on the
    DP size.
    """
    if quantile is None:
        return scores
    if not 0.5 <= quantile <= 1.0:
        raise ValueError(f"quantile_clip: quantile={quantile} must be in [0.5, 1] (or None)")
    if scores.dim() != 1:
        raise ValueError(f"quantile_clip: scores.shape={tuple(scores.shape)} must be [B]")
    work = scores if scores.dtype in (torch.float32, torch.float64) else scores.float()
    if gather is not None:
        work = gather(work)  # [B * dp]
    if work.numel() == 0:
        return scores
    qs = torch.tensor([1.0 - quantile, quantile], dtype=work.dtype, device=work.device)
    lo, hi = torch.quantile(work, qs)
    return torch.minimum(torch.maximum(scores, lo.to(scores.dtype)), hi.to(scores.dtype))


def overlong_penalty(
    scores: torch.Tensor, lengths: torch.Tensor, *, max_length: int, buffer_len: int, penalty_factor: float
) -> torch.Tensor:
    """DAPO's soft overlong punishment: nothing up to max_length - buffer_len tokens, then a linear
    penalty reaching -penalty_factor at max_length.  scores, lengths: [B] -> [B].

        s + min(0, -(length - (max_length - buffer_len)) / buffer_len * penalty_factor)
    """
    if scores.shape != lengths.shape:
        raise ValueError(f"overlong_penalty: lengths.shape={tuple(lengths.shape)} must equal "
                         f"scores.shape={tuple(scores.shape)}")
    if not 0 < buffer_len < max_length:
        raise ValueError(f"overlong_penalty: buffer_len={buffer_len} must be in (0, max_length={max_length})")
    exceed = lengths.to(scores.dtype) - (max_length - buffer_len)                      # [B]
    return scores + torch.clamp(-exceed / buffer_len * penalty_factor, max=0.0)


def length_penalty(
    scores: torch.Tensor, lengths: torch.Tensor, *, coef: float, max_length: int
) -> torch.Tensor:
    """s - coef * length / max_length.  scores, lengths: [B] -> [B]."""
    if scores.shape != lengths.shape:
        raise ValueError(
            f"length_penalty: lengths.shape={tuple(lengths.shape)} must equal "
            f"scores.shape={tuple(scores.shape)}"
        )
    if max_length <= 0:
        raise ValueError(f"length_penalty: max_length={max_length} must be > 0")
    return scores - coef * lengths.to(scores.dtype) / max_length


def scores_to_token_rewards(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence score on the last real token of its row.

        out[b, t] = scores[b]  if t == last real index of row b,  else 0

    scores: [B], mask: [B, T] -> [B, T] in scores' dtype. Rows with no real token get nothing.
    The last real index is found from the mask itself, not from a length.
    """
    if mask.dim() != 2 or scores.shape != mask.shape[:1]:
        raise ValueError(
            f"scores_to_token_rewards: scores.shape={tuple(scores.shape)}, "
            f"mask.shape={tuple(mask.shape)} must be [B] and [B, T]"
        )
    num_tokens = mask.shape[1]
    positions = torch.arange(1, num_tokens + 1, device=mask.device)  # [T] 1-based
    last_plus_one = (mask.bool() * positions).amax(dim=1, keepdim=True) if num_tokens else None
    out = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
    if last_plus_one is None:
        return out
    has_tokens = last_plus_one.squeeze(1) > 0  # [B]
    src = torch.where(has_tokens, scores, torch.zeros_like(scores)).unsqueeze(1)  # [B, 1]
    return out.scatter(1, (last_plus_one - 1).clamp(min=0), src)


def check_finite_rewards(scores: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Replace NaN/+inf/-inf by 0 and count them: returns (clean scores, n_bad). Host sync."""
    finite = torch.isfinite(scores)
    n_bad = int((~finite).sum().item())
    return torch.where(finite, scores, torch.zeros_like(scores)), n_bad
