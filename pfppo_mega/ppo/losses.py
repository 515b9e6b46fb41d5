"""PPO clipped policy loss, clipped value loss, loss aggregation, log-prob and entropy helpers."""

from dataclasses import dataclass

import torch

from pfppo_mega.ppo.masked import check_same_shape, masked_mean, masked_sum

from pfppo_mega.constants import LOSS_AGG_MODES, LOG_RATIO_LIMIT as _LOG_RATIO_LIMIT


def agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, *, mode: str,
             loss_scale_factor: float | None = None) -> torch.Tensor:
    """Reduce a per-token loss [B, T] to a scalar over the real tokens, as verl 0.9.1's agg_loss
    (verl/trainer/ppo/core_algos.py) with dp_size = 1 and this batch as the global batch:

        token-mean              = sum_{b,t} l*m / sum_{b,t} m
        seq-mean-token-sum      = mean over rows with >= 1 token of sum_t l*m
        seq-mean-token-mean     = mean over rows with >= 1 token of (sum_t l*m / sum_t m)
        seq-mean-token-sum-norm = sum_{b,t} l*m / global_batch_size / loss_scale_factor   (Dr.GRPO)
                                  global_batch_size = rows with >= 1 token (verl's default),
                                  loss_scale_factor None = T, the padded length (verl's default;
                                  the trainer passes a constant, max_response_length)

    verl 0.9.1 computes the last one per data-parallel rank as sum / global_batch_size * dp_size
    / loss_scale_factor with global_batch_size the optimizer step's rows over all ranks, and DDP
    averages the ranks' gradients: the step minimises (sum over all its rows of sum_t l*m) /
    (its rows x loss_scale_factor). The engine's share_scale (local rows / global rows) turns this
    local aggregate into its share of that (pfppo_mega.models.passes).

    An all-masked batch gives 0, still connected to loss_mat (its gradient is 0, not missing).
    The normalisers are local to this batch; a data-parallel caller rescales if it wants a
    global token mean.
    """
    check_same_shape("agg_loss", loss_mat=loss_mat, mask=mask)
    if mode == "token-mean":
        return masked_mean(loss_mat, mask)
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"agg_loss: mode={mode!r} is not one of {LOSS_AGG_MODES}")
    c = 1.0
    if mode == "seq-mean-token-sum-norm":
        c = loss_mat.shape[-1] if loss_scale_factor is None else loss_scale_factor
        if not c > 0:
            raise ValueError(f"agg_loss: loss_scale_factor={loss_scale_factor} must be > 0")
    row_sum = masked_sum(loss_mat, mask, dim=1)  # [B]
    row_count = masked_sum(torch.ones_like(loss_mat), mask, dim=1)  # [B]
    row_has_tokens = row_count > 0  # [B]
    if mode == "seq-mean-token-mean":
        per_row = row_sum / row_count.clamp(min=1.0)
    else:  # seq-mean-token-sum(-norm): rows without a token add 0 to the sum, so the row mean is it
        per_row = row_sum
    loss = masked_mean(per_row, row_has_tokens)
    return loss if c == 1.0 else loss / c


@dataclass
class PolicyLossOutput:
    """loss: scalar to backprop. The rest are detached 0-dim metrics over real tokens."""

    loss: torch.Tensor
    pg_clipfrac: torch.Tensor  # fraction where the ratio clip is active (pg2 > pg1)
    pg_clipfrac_lower: torch.Tensor  # fraction where the dual clip is active (A < 0 only)
    approx_kl: torch.Tensor  # k3 estimate of KL(pi_old || pi_theta)
    is_weight_mean: torch.Tensor  # mean behaviour importance weight (1 when none given)


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    dual_clip_c: float | None = None,
    loss_agg_mode: str = "token-mean",
    is_weights: torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> PolicyLossOutput:
    """PPO clipped surrogate (Schulman et al. 2017) with asymmetric clip and optional dual clip.

        log_ratio = clamp(logp - old_logp, -20, 20)     (keeps exp finite; gradient 0 beyond)
        ratio     = exp(log_ratio)
        pg1 = -A * ratio
        pg2 = -A * clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
        pg  = max(pg1, pg2)
        pg  = min(pg, -A * c)  where A < 0             (dual clip, Ye et al. 2020; needs c > 1)
        pg  = pg * is_weights                           (detached off-policy correction weights)
        loss = agg_loss(pg, mask, mode=loss_agg_mode)

    Metrics (masked means over real tokens, detached):
        pg_clipfrac       = mean[pg2 > pg1]
        pg_clipfrac_lower = mean[A < 0 and max(pg1, pg2) > -A * c]
        approx_kl         = mean[ratio - 1 - log_ratio]   (k3 of KL(pi_old || pi_theta), >= 0)
        is_weight_mean    = mean[is_weights]

    logp (with grad), old_logp, advantages, mask, is_weights: [B, T].
    """
    check_same_shape(
        "policy_loss", logp=logp, old_logp=old_logp, advantages=advantages, mask=mask
    )
    if not 0.0 <= clip_ratio_low < 1.0:
        raise ValueError(f"policy_loss: clip_ratio_low={clip_ratio_low} must be in [0, 1)")
    if clip_ratio_high < 0.0:
        raise ValueError(f"policy_loss: clip_ratio_high={clip_ratio_high} must be >= 0")
    if dual_clip_c is not None and not dual_clip_c > 1.0:
        raise ValueError(
            f"policy_loss: dual_clip_c={dual_clip_c} must be > 1 (it bounds the loss at -A*c "
            "for A < 0, which must lie above the ratio clip)"
        )

    adv = advantages.detach()
    log_ratio = (logp - old_logp.detach()).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)  # [B, T]
    ratio = torch.exp(log_ratio)
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    pg = torch.maximum(pg1, pg2)  # [B, T]
    clip_active = pg2 > pg1
    if dual_clip_c is None:
        dual_active = torch.zeros_like(clip_active)
    else:
        pg3 = -adv * dual_clip_c
        dual_active = (adv < 0) & (pg > pg3)
        pg = torch.where(dual_active, pg3, pg)
    if is_weights is None:
        is_weights = torch.ones_like(pg)
    else:
        check_same_shape("policy_loss", logp=logp, is_weights=is_weights)
        is_weights = is_weights.detach().to(pg.dtype)
        pg = pg * is_weights

    loss = agg_loss(pg, mask, mode=loss_agg_mode, loss_scale_factor=loss_scale_factor)
    with torch.no_grad():
        return PolicyLossOutput(
            loss=loss,
            pg_clipfrac=masked_mean(clip_active.to(pg.dtype), mask),
            pg_clipfrac_lower=masked_mean(dual_active.to(pg.dtype), mask),
            approx_kl=masked_mean(torch.expm1(log_ratio) - log_ratio, mask),
            is_weight_mean=masked_mean(is_weights, mask),
        )


@dataclass
class ValueLossOutput:
    """loss: scalar to backprop (caller multiplies by vf_coef); vf_clipfrac detached 0-dim."""

    loss: torch.Tensor
    vf_clipfrac: torch.Tensor  # fraction of real tokens where the clipped term is the larger


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    value_clip: float | None,
    loss_agg_mode: str = "token-mean",
    loss_scale_factor: float | None = None,
) -> ValueLossOutput:
    """Clipped value loss.

        V_clip = old_values + clamp(values - old_values, -c, c)
        l      = 0.5 * max((V - R)^2, (V_clip - R)^2)     with c = value_clip
        l      = 0.5 * (V - R)^2                          when value_clip is None
        loss   = agg_loss(l, mask, mode=loss_agg_mode)
        vf_clipfrac = mean over real tokens of [(V_clip - R)^2 > (V - R)^2]   (0 without clip)

    values (with grad), old_values, returns, mask: [B, T].
    """
    check_same_shape(
        "value_loss", values=values, old_values=old_values, returns=returns, mask=mask
    )
    returns = returns.detach()
    err_sq = (values - returns).square()  # [B, T]
    if value_clip is None:
        loss_mat = 0.5 * err_sq
        clip_active = torch.zeros_like(err_sq, dtype=torch.bool)
    else:
        if not value_clip > 0.0:
            raise ValueError(f"value_loss: value_clip={value_clip} must be > 0 (or None)")
        old_values = old_values.detach()
        v_clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
        err_sq_clipped = (v_clipped - returns).square()
        loss_mat = 0.5 * torch.maximum(err_sq, err_sq_clipped)
        clip_active = err_sq_clipped > err_sq
    loss = agg_loss(loss_mat, mask, mode=loss_agg_mode, loss_scale_factor=loss_scale_factor)
    with torch.no_grad():
        vf_clipfrac = masked_mean(clip_active.to(values.dtype), mask)
    return ValueLossOutput(loss=loss, vf_clipfrac=vf_clipfrac)


def _upcast(logits: torch.Tensor) -> torch.Tensor:
    """fp16/bf16 logits are reduced in fp32; fp32/fp64 are kept."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        return logits.float()
    return logits


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: [..., V] -> [...].

        H = -sum_v p_v * log p_v,   p = softmax(logits), log p = log_softmax(logits)

    Stable for large logits (log_softmax subtracts the max) and for -inf logits (masked vocab
    entries contribute 0 and get a 0 gradient, not NaN). fp16/bf16 inputs give an fp32 result.
    """
    logits = _upcast(logits)
    logp = torch.log_softmax(logits, dim=-1)  # [..., V]
    p = logp.exp()
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    finite_logp = torch.where(torch.isfinite(logp), logp, zero)
    return -(p * finite_logp).sum(dim=-1)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[label] over the last dim: logits [..., V], labels [...] -> [...].

        log p_y = (logits_y - m) - log sum_v exp(logits_v - m),   m = max_v logits_v

    Gathers before normalising, so no [..., V] log-softmax tensor is kept for backward.
    fp16/bf16 inputs give an fp32 result.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logprobs_from_logits: labels.shape={tuple(labels.shape)} must equal "
            f"logits.shape[:-1]={tuple(logits.shape[:-1])}"
        )
    logits = _upcast(logits)
    # Shift by the row max before both terms: (l_y - m) is exact where l_y - lse(l) would lose
    # the fractional part of a large lse in fp32. m is a constant for autograd (it cancels).
    row_max = logits.detach().amax(dim=-1, keepdim=True)  # [..., 1]
    shifted = logits - row_max  # [..., V]
    picked = shifted.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)  # [...]
    return picked - shifted.exp().sum(dim=-1).log()
