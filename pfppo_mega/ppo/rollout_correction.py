"""verl 0.9.1's rollout correction (`algorithm.rollout_correction`, verl/trainer/ppo/rollout_corr_helper.py and
core_algos.compute_policy_loss_bypass_mode; facts read there, no code taken), pure torch.

The rollout engine's log-probs (pi_rollout) and the trainer's (pi_theta) differ (another kernel, another
dtype). With delta = log pi_theta - log pi_rollout per response token, clamped to +-SAFETY (20) before any exp:

    IS weights (rollout_is), detached:
        token     w_t = exp(delta_t)
        sequence  w_t = exp(sum_t' delta_t')           (one weight per row, on each of its tokens)
      then TIS (an upper bound u): min(w, u); IcePop (lower l and upper u): w where l <= w <= u, else 0;
      0 on padding. batch normalisation divides by the mean weight: over tokens (token) or over rows
      with a token (sequence).
    Rejection (rollout_rs), a token mask, every criterion must pass:
        k1 = -delta, k2 = delta^2 / 2, k3 = exp(delta) - 1 - delta    per token
        token_kN        the token's own value
        seq_sum_kN      the row's sum over its tokens      (every token of the row kept or dropped)
        seq_mean_kN     the row's mean over its tokens
        seq_max_k2/k3   the row's largest value
      k1 criteria keep log(lower) <= value <= log(upper); k2 / k3 keep value <= upper.
    Bypass losses (old = rollout log-probs), over the kept tokens:
        ppo_clip    the clipped surrogate with ratio pi_theta / pi_rollout, no IS weight (the ratio is it)
        reinforce   -w * A * log pi_theta
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from pfppo_mega.constants import ROLLOUT_IS_LEVELS as IS_LEVELS, ROLLOUT_RS_CRITERIA as RS_CRITERIA

SAFETY = 20.0  # verl's SAFETY_BOUND on log-ratios before exp


def is_weights(log_ratio: torch.Tensor, mask: torch.Tensor, *, level: str, upper: float,
               lower: Optional[float] = None) -> torch.Tensor:
    """Truncated (TIS: lower None) or IcePop (both bounds) rollout IS weights [B, T], 0 on padding,
    without gradient. log_ratio = log pi_theta - log pi_rollout [B, T]; mask [B, T] (0/1)."""
    if level not in IS_LEVELS:
        raise ValueError(f"is_weights: level={level!r} must be one of {IS_LEVELS}")
    _check_bounds("is_weights", lower, upper)
    m = mask.to(log_ratio.dtype)
    with torch.no_grad():
        if level == "token":
            raw = torch.exp(log_ratio.clamp(-SAFETY, SAFETY))                                # [B, T]
        else:
            row = (log_ratio * m).sum(dim=-1, keepdim=True).clamp(-SAFETY, SAFETY)          # [B, 1]
            raw = torch.exp(row).expand_as(log_ratio)                                         # [B, T]
        raw = raw * m
        if lower is None:
            return raw.clamp(max=upper)
        return torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))


def normalize_weights(w: torch.Tensor, mask: torch.Tensor, *, level: str) -> torch.Tensor:
    """w divided by its mean: over the tokens (token) or over the rows with a token (sequence: each
    row's weight once); unchanged when that mean is <= 1e-8 (verl's guard)."""
    m = mask.to(w.dtype)
    if level == "token":
        mean = (w * m).sum() / m.sum().clamp_min(1e-8)
    else:
        rows = m.sum(dim=-1)                                                                 # [B]
        per_row = (w * m).sum(dim=-1) / rows.clamp_min(1e-8)                                 # [B]
        has = (rows > 0).to(w.dtype)
        mean = (per_row * has).sum() / has.sum().clamp_min(1e-8)
    return w / mean if mean > 1e-8 else w


def rejection_mask(log_ratio: torch.Tensor, mask: torch.Tensor,
                   criteria: Sequence[tuple[str, Optional[float], float]]) -> torch.Tensor:
    """The tokens every criterion keeps, as mask's dtype [B, T] (0 on padding). criteria: (name, lower,
    upper) each; lower is read by the k1 criteria only (ratio bounds), the others keep value <= upper."""
    keep = mask.bool().clone()
    with torch.no_grad():
        d = log_ratio.clamp(-SAFETY, SAFETY)
        k = {"k1": -d, "k2": 0.5 * d * d, "k3": torch.exp(d) - 1.0 - d}                       # [B, T] each
        m = mask.to(d.dtype)
        for name, lower, upper in criteria:
            if name not in RS_CRITERIA:
                raise ValueError(f"rejection_mask: criterion {name!r} must be one of {RS_CRITERIA}")
            stat = _statistic(name, k[name[-2:]], m)
            if name.endswith("k1"):
                if lower is None:
                    raise ValueError(f"rejection_mask: {name} needs a lower bound")
                _check_bounds("rejection_mask", lower, upper)
                ok = (stat >= math.log(lower)) & (stat <= math.log(upper))
            else:
                _check_bounds("rejection_mask", None, upper)
                ok = stat <= upper
            keep &= ok
    return keep.to(mask.dtype)


def _statistic(name: str, values: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The criterion's value per token [B, T] (a row's value on each of its tokens)."""
    if name.startswith("token_"):
        return values
    if name.startswith("seq_sum_"):
        row = (values * m).sum(dim=-1)
    elif name.startswith("seq_mean_"):
        row = (values * m).sum(dim=-1) / m.sum(dim=-1).clamp_min(1e-8)
    else:  # seq_max_: the largest over the row's tokens (0 for a row without one)
        row = values.masked_fill(m == 0, float("-inf")).max(dim=-1).values
        row = torch.where(torch.isinf(row), torch.zeros_like(row), row)
    return row[:, None].expand_as(values)


def reinforce_loss_mat(logp: torch.Tensor, advantages: torch.Tensor, w: Optional[torch.Tensor]) -> torch.Tensor:
    """-w A log pi_theta per token [B, T] (w detached IS weights, or None: plain REINFORCE)."""
    out = -advantages * logp
    return out if w is None else out * w


def _check_bounds(fn: str, lower: Optional[float], upper: float) -> None:
    if not (isinstance(upper, (int, float)) and not isinstance(upper, bool) and math.isfinite(upper) and upper > 0):
        raise ValueError(f"{fn}: upper={upper!r} must be a finite number > 0")
    if lower is not None and not (isinstance(lower, (int, float)) and not isinstance(lower, bool)
                                  and math.isfinite(lower) and 0 < lower <= upper):
        raise ValueError(f"{fn}: lower={lower!r} must be a finite number in (0, upper={upper}]")
