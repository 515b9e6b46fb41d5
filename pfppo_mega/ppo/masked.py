"""Masked reductions over right-padded [B, T] response tensors.

`mask` is float or bool, 1 on real response tokens, 0 on padding. Padding values of `x` are
never read (selected away with `torch.where`, not multiplied by 0), so NaN/inf in padding cannot
leak into a result or its gradient. Every reduction over zero real tokens returns 0, never NaN.
"""

from typing import Callable

import torch

# Sums a tensor element-wise over the data-parallel ranks (the caller binds the process group);
# None means this rank's batch is the whole batch.
ReduceSum = Callable[[torch.Tensor], torch.Tensor]
# Concatenates a [n, ...] tensor over the data-parallel ranks along dim 0 (rank order).
Gather = Callable[[torch.Tensor], torch.Tensor]


def check_same_shape(fn: str, **tensors: torch.Tensor) -> None:
    """Raise ValueError unless every tensor has the shape of the first (names in the message)."""
    items = list(tensors.items())
    ref_name, ref = items[0]
    for name, t in items[1:]:
        if t.shape != ref.shape:
            raise ValueError(
                f"{fn}: {name}.shape={tuple(t.shape)} must equal "
                f"{ref_name}.shape={tuple(ref.shape)}"
            )


def zero_padding(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x with padding replaced by 0 (a select, not a multiply: NaN/inf padding stays out of the
    result and of the gradient)."""
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum_i x_i * m_i over all elements (dim=None, 0-dim result) or along `dim`.

    x, mask: same shape, e.g. [B, T]. For dim=1 the result is [B].
    """
    picked = zero_padding(x, mask)
    if dim is None:
        return picked.sum()
    return picked.sum(dim=dim)


def masked_mean(
    x: torch.Tensor, mask: torch.Tensor, dim: int | None = None, eps: float = 1e-8
) -> torch.Tensor:
    """sum(x * m) / max(sum(m), eps); 0 where sum(m) == 0.

    x, mask: same shape, e.g. [B, T]; dim=None -> 0-dim, dim=1 -> [B]. With a 0/1 mask the
    denominator is an integer count, so the mean is exact whenever at least one token is real.
    """
    total = masked_sum(x, mask, dim)
    count = masked_sum(torch.ones_like(x), mask, dim)
    return total / count.clamp(min=eps)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the real entries of x (all of them, 0-dim result).

    var = sum(m * (x - mean)^2) / n, times n / (n - 1) when unbiased; n = sum(m).
    n == 0 -> 0; unbiased with n == 1 -> 0 (no spread is observable from one value).
    """
    x = zero_padding(x, mask)
    mean = masked_mean(x, mask)
    centred_sq = (x - mean) ** 2
    n = masked_sum(torch.ones_like(x), mask)
    var = masked_sum(centred_sq, mask) / n.clamp(min=1.0)
    if unbiased:
        # n / (n - 1) for n >= 2; for n <= 1 var is already 0 and the factor is irrelevant.
        var = var * n / (n - 1.0).clamp(min=1.0)
    return var


def masked_whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    shift_mean: bool = True,
    eps: float = 1e-8,
    reduce_sum: ReduceSum | None = None,
) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the real entries of x; 0 at masked positions.

    x, mask: [B, T] -> [B, T]. mean and the unbiased var are taken over all real tokens of the
    batch: this rank's, or, with reduce_sum (a function summing a tensor over the data-parallel
    ranks, e.g. functools.partial(parallel.dp_sum, group=g)), of the global batch, so the result
    does not depend on how the batch is split (two reductions: sums first, then centred squares).
    shift_mean=False adds the mean back (scale only). A zero-variance batch gives x - mean == 0
    exactly, so the result is 0 (or the mean), never NaN/inf.
    """
    reduce_sum = reduce_sum or _identity
    x = zero_padding(x, mask)
    ones = torch.ones_like(x)
    total, n = reduce_sum(torch.stack([masked_sum(x, mask), masked_sum(ones, mask)])).unbind(0)
    mean = total / n.clamp(min=1e-8)
    sq = reduce_sum(masked_sum((x - mean) ** 2, mask))
    # unbiased: sum / n * n / (n - 1) for n >= 2 (the arithmetic of masked_var); 0 for n <= 1
    var = sq / n.clamp(min=1.0) * n / (n - 1.0).clamp(min=1.0)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return zero_padding(whitened, mask)


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t
