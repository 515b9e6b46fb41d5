"""Pure-torch math of log-prob and entropy over a vocabulary split into shards.

A shard is logits [N, Vs] whose column 0 is global vocabulary entry ``vocab_start``; columns
whose global index is >= ``vocab_size`` are padding (megatron pads the vocabulary to a multiple
of tp * make_vocab_size_divisible_by) and count as -inf. The softmax is over y = x / T. Each
shard reduces its rows to four partials (all [N] float32):

    m = max_v y_v,  s = sum_v e^{y_v - m},  u = sum_v e^{y_v - m} (y_v - m),
    target = y_label if the label lies in this shard, else 0

which combine exactly at a common reference M >= m (rescale_partials), so that summing over the
shards and finishing gives the full-vocabulary result:

    logp = target - (M + log S),  H = log S - U / S

The backward needs no partials from other shards, only the combined M, log S and H:

    d/dx_v = (g [v == label] - p_v (g + h (log p_v + H))) / T,  log p_v = (y_v - M) - log S

This module is the torch backend's implementation (and the reference for the fused kernels,
pfppo_mega/kernels/ops.py); pfppo_mega.kernels.vocab_parallel adds the collectives.
"""

from dataclasses import dataclass

import torch


@dataclass
class LogProbPartials:
    """Per-row softmax partials of one vocab shard, all [N] float32:

    max = m = max_v y_v,  sumexp = sum_v e^{y_v - m},  sumexp_shifted = sum_v e^{y_v - m} (y_v - m),
    target = y_label when the label lies in this shard, else 0.
    """

    max: torch.Tensor
    sumexp: torch.Tensor
    sumexp_shifted: torch.Tensor
    target: torch.Tensor


@dataclass
class LogProbCombined:
    """Log-prob and entropy of the full vocabulary, and lse = max + log_sumexp kept in two
    parts (the backward needs them), all [N] float32."""

    logp: torch.Tensor
    entropy: torch.Tensor
    max: torch.Tensor
    log_sumexp: torch.Tensor


def valid_columns(width: int, vocab_start: int, vocab_size: int | None) -> int:
    """How many leading columns of a shard of `width` columns are vocabulary (the rest padding)."""
    if vocab_size is None:
        return width
    return min(width, max(0, vocab_size - vocab_start))


def check_labels(op: str, labels: torch.Tensor, high: int, what: str) -> None:
    """Labels of host tensors must lie in [0, high) (a device tensor is not read: no sync)."""
    if labels.device.type != "cpu" or labels.numel() == 0:
        return
    lo, hi = int(labels.min()), int(labels.max())
    if lo < 0 or hi >= high:
        bad = lo if lo < 0 else hi
        raise ValueError(f"{op}: label {bad} is outside [0, {what}) = [0, {high})")


def _scaled(x: torch.Tensor, vocab_start: int, vocab_size: int | None,
            temperature: float) -> torch.Tensor:
    """y = x[:, :valid] / T in float32 (padding columns dropped)."""
    y = x[:, :valid_columns(x.shape[1], vocab_start, vocab_size)].float()  # [N, valid]
    return y / temperature if temperature != 1.0 else y


def _local_label(labels: torch.Tensor, vocab_start: int, valid: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(local column clamped into range [N], whether the label is in this shard [N])."""
    local = labels - vocab_start
    inside = (local >= 0) & (local < valid)
    return local.clamp(0, max(valid - 1, 0)), inside


def partials(x: torch.Tensor, labels: torch.Tensor, *, vocab_start: int, vocab_size: int | None,
             temperature: float) -> LogProbPartials:
    """The four partials of shard x [N, Vs] (float32/bfloat16/float64), labels [N] global."""
    y = _scaled(x, vocab_start, vocab_size, temperature)  # [N, valid]
    n, valid = y.shape
    if valid == 0:  # a shard of only padding contributes nothing
        zeros = y.new_zeros(n)
        return LogProbPartials(torch.full_like(zeros, float("-inf")), zeros, zeros.clone(), zeros.clone())
    m = y.amax(dim=1)  # [N]
    shifted = y - torch.where(torch.isfinite(m), m, torch.zeros_like(m))[:, None]  # [N, valid]
    e = torch.exp(shifted)
    zero = torch.zeros((), dtype=y.dtype)
    plogp = torch.where(e > 0, e * shifted, zero)  # -inf logits add 0, not 0 * -inf
    local, inside = _local_label(labels, vocab_start, valid)
    target = torch.where(inside, y.gather(1, local[:, None])[:, 0], zero)
    return LogProbPartials(m, e.sum(dim=1), plogp.sum(dim=1), target)


def rescale_partials(p: LogProbPartials, global_max: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(s', u') of one shard moved to the reference global_max M >= p.max:

        s' = s e^{m - M},   u' = e^{m - M} (u + (m - M) s)

    so that summing s', u' (and target) over shards gives the full-vocab sums. [N] each.
    """
    has_mass = p.sumexp > 0  # a shard of only -inf logits (or padding) contributes nothing
    shift = torch.where(has_mass, p.max - global_max, torch.zeros_like(p.max))
    scale = torch.where(has_mass, torch.exp(shift), torch.zeros_like(p.max))
    return p.sumexp * scale, (p.sumexp_shifted + shift * p.sumexp) * scale


def finish_partials(global_max: torch.Tensor, sumexp: torch.Tensor, sumexp_shifted: torch.Tensor,
                    target: torch.Tensor) -> LogProbCombined:
    """logp = target - (M + log S),  H = log S - U / S, from the reduced sums. [N] each."""
    log_s = torch.log(sumexp)
    return LogProbCombined(
        logp=target - (global_max + log_s),
        entropy=log_s - sumexp_shifted / sumexp,
        max=global_max,
        log_sumexp=log_s,
    )


def combine_partials(shards: list[LogProbPartials]) -> LogProbCombined:
    """Combine the partials of every vocab shard in one process (the process-group version is
    pfppo_mega.kernels.vocab_parallel)."""
    global_max = torch.stack([p.max for p in shards]).amax(dim=0)  # [N]
    sums = [rescale_partials(p, global_max) for p in shards]
    sumexp = torch.stack([s for s, _ in sums]).sum(dim=0)
    shifted = torch.stack([u for _, u in sums]).sum(dim=0)
    target = torch.stack([p.target for p in shards]).sum(dim=0)
    return finish_partials(global_max, sumexp, shifted, target)


def shard_grad(x: torch.Tensor, labels: torch.Tensor, *, vocab_start: int, vocab_size: int | None,
               temperature: float, combined: LogProbCombined, grad_logp: torch.Tensor,
               grad_entropy: torch.Tensor) -> torch.Tensor:
    """d loss / d x [N, Vs] in x.dtype (0 on padding columns) from the combined statistics and
    the output gradients g = grad_logp, h = grad_entropy [N]."""
    y = _scaled(x, vocab_start, vocab_size, temperature)  # [N, valid]
    valid = y.shape[1]
    g, h = grad_logp.float()[:, None], grad_entropy.float()[:, None]  # [N, 1]
    log_p = (y - combined.max[:, None]) - combined.log_sumexp[:, None]  # [N, valid]; -inf stays -inf
    p = torch.exp(log_p)
    zero = torch.zeros((), dtype=y.dtype)
    grad = torch.where(p > 0, -p * (g + h * (log_p + combined.entropy[:, None])), zero)
    local, inside = _local_label(labels, vocab_start, valid)
    if valid > 0:
        grad.scatter_add_(1, local[:, None], torch.where(inside, g[:, 0], zero)[:, None])
    if temperature != 1.0:
        grad = grad / temperature
    out = x.new_zeros(x.shape)  # [N, Vs]; padding columns stay 0
    out[:, :valid] = grad.to(x.dtype)
    return out
