"""Policy-gradient losses beyond the clipped PPO surrogate, as verl defines them
(verl/trainer/ppo/core_algos.py, register_policy_loss): GSPO, SAPO, GPG, Clip-Cov, KL-Cov, GMPO
(geo_mean) and CISPO. Every one, and the aggregation (ppo.agg_loss), follows verl 0.9.1's
core_algos.py (read against the 0.9.1 wheel; docs/verl.md, "Losses", tables each and its differences).

Every function takes the current log-probs ``logp`` [B, T] (with gradient), the proximal ones
``old_logp`` [B, T], the advantages [B, T], the mask the loss is over [B, T] and keyword scalars,
and returns (loss, stats): a 0-dim aggregate and detached 0-dim metrics (``pg_clipfrac``,
``ppo_kl`` = mean(old_logp - logp), k1 as verl logs it, ``pg_clipfrac_lower``). ``is_weights``
[B, T] (detached behaviour importance weights, PF-PPO) multiply the per-token loss as verl's
rollout_is_weights do. ``AGG_MODE`` says which aggregation a loss uses when it does not take
``loss_agg_mode`` (the trainer scales a micro-batch's share by it).

Differences from verl 0.9.1, all at the edges: the token log-ratio is clamped to +-LOG_RATIO_LIMIT
in every loss but GSPO (verl clamps it in cispo and sapo too, and leaves clip_cov / kl_cov / geo_mean
unclamped: exp overflows first there; GSPO takes exp only of the sequence log-ratio, clamped at 10 as
verl does, so it needs no token clamp), and geo_mean averages over the step's rows with at least one
token (verl's torch.mean is over a micro-batch's rows, empty ones too).

Imports only torch and pfppo_mega.constants.
"""

from __future__ import annotations

import torch

from pfppo_mega.constants import LOG_RATIO_LIMIT
from pfppo_mega.ppo.losses import agg_loss
from pfppo_mega.ppo.masked import check_same_shape, masked_mean, zero_padding

Stats = dict[str, torch.Tensor]

# the aggregation of the losses that fix their own (verl ignores loss_agg_mode for them; verl 0.9.1's
# GSPO takes loss_agg_mode, so it is not here)
AGG_MODE = {"sapo": "seq-mean-token-mean", "geo_mean": "seq-mean-token-mean"}


def _log_ratio(logp, old_logp, mask):
    check_same_shape("policy loss", logp=logp, old_logp=old_logp, mask=mask)
    return zero_padding(logp - old_logp.detach(), mask).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)  # [B, T]


def _ratio(logp, old_logp, advantages, mask):
    """(log r, r, A detached), each [B, T]; log r is 0 on padding and clamped."""
    lr = _log_ratio(logp, old_logp, mask)
    return lr, torch.exp(lr), advantages.detach()


def _weighted(pg, is_weights):
    return pg if is_weights is None else pg * is_weights.detach().to(pg.dtype)


def _stats(log_ratio, mask, clipfrac, clipfrac_lower=None) -> Stats:
    with torch.no_grad():
        zero = torch.zeros((), dtype=log_ratio.dtype, device=log_ratio.device)
        return {"pg_clipfrac": clipfrac.detach(), "ppo_kl": masked_mean(-log_ratio.detach(), mask),
                "pg_clipfrac_lower": zero if clipfrac_lower is None else clipfrac_lower.detach()}


def gspo_loss(logp, old_logp, advantages, mask, *, clip_ratio_low, clip_ratio_high, loss_agg_mode="token-mean",
              loss_scale_factor=None, is_weights=None):
    """GSPO (Zheng et al. 2025) as verl 0.9.1: the sequence ratio s_i = exp(mean_t log_ratio_it), applied
    per token as sg[s_i] * pi / sg[pi] (the gradient is the sequence one, spread over the tokens);
    pg = max(-A s, -A clip(s, 1 - eps_low, 1 + eps_high)), aggregated with loss_agg_mode (verl's
    default token-mean). The token log-ratios are not clamped (as verl): exp is taken only of the
    sequence log-ratio, clamped at 10 (verl's clamp), and a very negative one underflows to 0."""
    check_same_shape("policy loss", logp=logp, old_logp=old_logp, mask=mask)
    lr = zero_padding(logp - old_logp.detach(), mask)                        # [B, T], 0 on padding
    m = mask.to(lr.dtype)
    seq = (lr * m).sum(-1) / m.sum(-1).clamp(min=1)                           # [B] mean token log-ratio
    log_s = (logp - logp.detach() + seq.detach()[:, None]).clamp(max=10.0)   # verl's clamp
    s = torch.exp(log_s)
    adv = advantages.detach()
    pg1 = -adv * s
    pg2 = -adv * s.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    pg = _weighted(torch.maximum(pg1, pg2), is_weights)
    loss = agg_loss(pg, mask, mode=loss_agg_mode, loss_scale_factor=loss_scale_factor)
    return loss, _stats(lr, mask, masked_mean((pg2 > pg1).to(lr.dtype), mask))


def sapo_loss(logp, old_logp, advantages, mask, *, tau_pos, tau_neg, is_weights=None):
    """SAPO (arXiv 2511.20347): a smooth gate instead of the clip, f(r) = sigmoid(tau (r - 1)) 4 / tau
    with tau = tau_pos where A > 0 else tau_neg; pg = -f(r) A, seq-mean-token-mean."""
    lr, r, adv = _ratio(logp, old_logp, advantages, mask)
    tau = torch.where(adv > 0, torch.full_like(r, tau_pos), torch.full_like(r, tau_neg))
    pg = _weighted(-torch.sigmoid(tau * (r - 1.0)) * (4.0 / tau) * adv, is_weights)
    loss = agg_loss(pg, mask, mode=AGG_MODE["sapo"])
    return loss, _stats(lr, mask, torch.zeros((), dtype=lr.dtype, device=lr.device))


def gpg_loss(logp, advantages, mask, *, loss_agg_mode, loss_scale_factor=None, is_weights=None):
    """GPG (Chu et al. 2025): plain policy gradient, pg = -logp A (no ratio, no clip)."""
    check_same_shape("gpg_loss", logp=logp, advantages=advantages, mask=mask)
    pg = _weighted(-logp * advantages.detach(), is_weights)
    loss = agg_loss(pg, mask, mode=loss_agg_mode, loss_scale_factor=loss_scale_factor)
    return loss, {}


def cispo_loss(logp, old_logp, advantages, mask, *, clip_ratio_low, clip_ratio_high, loss_agg_mode,
               loss_scale_factor=None, is_weights=None):
    """CISPO (MiniMax 2025): pg = -sg[clip(r, 1 - eps_low, 1 + eps_high)] A logp: the clipped ratio
    weights the REINFORCE gradient of every token (none is dropped)."""
    lr = _log_ratio(logp, old_logp, mask)
    r = torch.exp(lr)
    clipped = r.clamp(1 - clip_ratio_low, 1 + clip_ratio_high).detach()
    pg = _weighted(-clipped * advantages.detach() * logp, is_weights)
    loss = agg_loss(pg, mask, mode=loss_agg_mode, loss_scale_factor=loss_scale_factor)
    return loss, _stats(lr, mask, masked_mean((r != clipped).to(lr.dtype), mask))


def clip_cov_loss(logp, old_logp, advantages, mask, *, clip_ratio_low, clip_ratio_high, clip_cov_ratio,
                  clip_cov_lb, clip_cov_ub, loss_agg_mode, loss_scale_factor=None, is_weights=None,
                  generator: torch.Generator | None = None):
    """Clip-Cov (Cui et al. 2025): the clipped surrogate, and the gradient of a random
    max(1, int(clip_cov_ratio * tokens)) tokens whose covariance
    (A - mean A)(logp - mean logp) lies in (clip_cov_lb, clip_cov_ub) (and whose ratio the clip
    left alone) is cut (their loss set to 0). ``generator`` draws them (host, CPU)."""
    if not clip_cov_ratio > 0:
        raise ValueError(f"clip_cov_loss: clip_cov_ratio={clip_cov_ratio} must be > 0")
    lr, r, adv = _ratio(logp, old_logp, advantages, mask)
    real = mask.bool()
    pg1 = -adv * r
    pg2 = -adv * r.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    clip_by_origin = (pg2 > pg1) & real
    with torch.no_grad():
        cov = (adv - masked_mean(adv, mask)) * (logp.detach() - masked_mean(logp.detach(), mask))   # [B, T]
        eligible = (cov < clip_cov_ub) & (cov > clip_cov_lb) & real & ~clip_by_origin
        idx = torch.nonzero(eligible)                                         # [n, 2]
        clip_num = max(int(clip_cov_ratio * int(mask.sum().item())), 1)      # a host sync
        corr = torch.ones_like(adv)
        if len(idx):
            pick = idx[torch.randperm(len(idx), generator=generator)[:clip_num].to(idx.device)]
            corr[pick[:, 0], pick[:, 1]] = 0
    pg = _weighted(torch.maximum(pg1, pg2) * corr, is_weights)
    loss = agg_loss(pg, mask, mode=loss_agg_mode, loss_scale_factor=loss_scale_factor)
    return loss, _stats(lr, mask, masked_mean((corr == 0).to(lr.dtype), mask))


def kl_cov_loss(logp, old_logp, advantages, mask, *, kl_cov_ratio, ppo_kl_coef, loss_agg_mode,
                loss_scale_factor=None, is_weights=None):
    """KL-Cov (Cui et al. 2025): the unclipped surrogate -A r, plus ppo_kl_coef |log r| on the
    max(1, int(kl_cov_ratio * tokens)) tokens of largest covariance (A - mean A)(logp - mean logp).
    ``ppo_kl`` in its stats is mean |log r| (verl logs the absolute one here)."""
    if not kl_cov_ratio > 0:
        raise ValueError(f"kl_cov_loss: kl_cov_ratio={kl_cov_ratio} must be > 0")
    lr, r, adv = _ratio(logp, old_logp, advantages, mask)
    real = mask.bool()
    pg = -adv * r
    with torch.no_grad():
        flat_real = torch.nonzero(real.reshape(-1)).flatten()                # [n] token positions
        sel = torch.zeros(real.numel(), dtype=torch.bool, device=real.device)
        if flat_real.numel():
            a, lp = adv.reshape(-1)[flat_real], logp.detach().reshape(-1)[flat_real]
            cov = (a - a.mean()) * (lp - lp.mean())
            k = max(1, int(flat_real.numel() * kl_cov_ratio))
            sel[flat_real[torch.topk(cov, k, largest=True).indices]] = True
        sel = sel.reshape(real.shape)
    pg = torch.where(sel, pg + ppo_kl_coef * lr.abs(), pg)
    pg = _weighted(pg, is_weights)
    loss = agg_loss(pg, mask, mode=loss_agg_mode, loss_scale_factor=loss_scale_factor)
    st = _stats(lr, mask, torch.zeros((), dtype=lr.dtype, device=lr.device))
    st["ppo_kl"] = masked_mean(lr.detach().abs(), mask)
    del st["pg_clipfrac"], st["pg_clipfrac_lower"]
    return loss, st


def geo_mean_loss(logp, old_logp, advantages, mask, *, clip_ratio_low, clip_ratio_high, is_weights=None):
    """GMPO (Zhao et al. 2025): the geometric mean of the token ratios, clipped per token in log
    space, sgn(A) min(sgn(A) log r, sgn(A) clip(log r, -eps_low, eps_high)); row ratio
    R_i = exp(mean_t of that), row advantage = mean_t A; loss = mean over rows of -A_i R_i
    (IS weights enter as each row's geometric mean weight)."""
    lr = _log_ratio(logp, old_logp, mask)
    m = mask.to(lr.dtype)
    adv = advantages.detach()
    sgn = torch.sign(adv)
    lr_clamp = lr.clamp(-clip_ratio_low, clip_ratio_high)
    lr_min = sgn * torch.minimum(sgn * lr, sgn * lr_clamp)
    n = m.sum(-1)                                                              # [B]
    ratio = torch.exp((lr_min * m).sum(-1) / (n + 1e-8))                       # [B]
    row_adv = (adv * m).sum(-1) / (n + 1e-8)
    pg = -row_adv * ratio                                                      # [B]
    if is_weights is not None:
        w = is_weights.detach().to(lr.dtype)
        pg = pg * torch.exp((torch.log(w + 1e-10) * m).sum(-1) / (n + 1e-8))
    loss = masked_mean(pg, n > 0)
    clipped = (lr != lr_clamp).to(lr.dtype)
    return loss, _stats(lr, mask, masked_mean(clipped * (adv > 0), mask), masked_mean(clipped * (adv < 0), mask))
