"""The accuracy rule and the inputs shared by the kernel tests and the kernel benchmark.

Accuracy rule (flash-attention's): a kernel output may differ from the float64 reference by at
most twice what the pure-torch implementation at the same input dtype differs, plus one unit
of the output dtype at the reference's scale (the rounding of the output itself, which the
torch result may happen to avoid):

    max|kernel - ref64| <= 2 max|torch - ref64| + eps(kernel.dtype) max|ref64|
"""

import torch


def error_bound(kernel_out: torch.Tensor, torch_out: torch.Tensor, ref64: torch.Tensor) -> float:
    """The largest error the rule above allows kernel_out."""
    torch_err = (torch_out.double() - ref64).abs().max().item() if ref64.numel() else 0.0
    scale = ref64.abs().max().item() if ref64.numel() else 0.0
    return 2.0 * torch_err + torch.finfo(kernel_out.dtype).eps * scale


def assert_within_torch_error(
    name: str, kernel_out: torch.Tensor, torch_out: torch.Tensor, ref64: torch.Tensor
) -> None:
    """Raise AssertionError (with where and by how much) unless kernel_out obeys the rule."""
    assert kernel_out.shape == ref64.shape, (
        f"{name}: shape {tuple(kernel_out.shape)} != {tuple(ref64.shape)}"
    )
    if ref64.numel() == 0:
        return
    diff = (kernel_out.double() - ref64).abs()
    nan_ok = torch.isnan(kernel_out.double()) & torch.isnan(ref64)
    diff = torch.where(nan_ok, torch.zeros_like(diff), diff)
    bound = error_bound(kernel_out, torch_out, ref64)
    worst = int(torch.nan_to_num(diff, nan=float("inf")).argmax())
    err = diff.flatten()[worst].item()
    torch_err = (torch_out.double() - ref64).abs().max().item()
    got, want = kernel_out.flatten()[worst].item(), ref64.flatten()[worst].item()
    assert err <= bound, (
        f"{name}: max |kernel - fp64| = {err:.3e} at flat index {worst} "
        f"(kernel {got:.9g}, fp64 {want:.9g}) "
        f"> bound {bound:.3e} (torch {torch_out.dtype} error {torch_err:.3e})"
    )


def ragged_mask(
    rows: int, cols: int, *, seed: int, dtype: torch.dtype = torch.bool, holes: bool = False,
    empty_rows: bool = True,
) -> torch.Tensor:
    """[rows, cols] right-padded mask with random lengths in [0, cols] (row 0 full, row 1 empty
    when empty_rows and rows > 1). holes: also zero ~10% of tokens inside the rows."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, cols + 1, (rows,), generator=g)
    lengths[0] = cols
    if empty_rows and rows > 1:
        lengths[1] = 0
    mask = torch.arange(cols)[None, :] < lengths[:, None]  # [rows, cols]
    if holes:
        mask &= torch.rand(rows, cols, generator=g) > 0.1
    return mask.to(dtype)


def logits(
    rows: int, vocab: int, *, seed: int, dtype: torch.dtype, neg_inf: bool = False, device: str = "cpu"
) -> torch.Tensor:
    """[rows, vocab] logits ~ 4 N(0, 1) + 3 (an offset, so lse is far from 0). neg_inf: mask
    ~20% of the vocabulary of every row with -inf (never column 0). Drawn on ``device`` (a GPU draws
    16384 x 152064 in milliseconds where the host took most of a minute; the values differ by device)."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g, dtype=torch.float64, device=device) * 4.0 + 3.0
    if neg_inf:
        off = torch.rand(rows, vocab, generator=g, device=device) < 0.2
        off[:, 0] = False
        x = x.masked_fill(off, float("-inf"))
    return x.to(dtype)


def labels_for(logits_: torch.Tensor, *, seed: int) -> torch.Tensor:
    """[rows] int64 labels of finite logits, including column 0 and V - 1 when finite."""
    g = torch.Generator().manual_seed(seed)
    rows, vocab = logits_.shape
    labels = torch.randint(0, vocab, (rows,), generator=g)
    labels[0] = 0
    if rows > 1:
        labels[-1] = vocab - 1
    labels = labels.to(logits_.device)
    finite = torch.isfinite(logits_[torch.arange(rows), labels])
    return torch.where(finite, labels, torch.zeros_like(labels))


def policy_inputs(
    rows: int, cols: int, *, seed: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """logp, old_logp, advantages, is_weights [rows, cols] that exercise every branch of the
    clipped loss: log-ratios inside the clip range, outside it, above log(c) for the dual
    clip, beyond the +-20 clamp, exactly 0 (ratio 1: a tie of max(pg1, pg2)); advantages of
    both signs and exact zeros."""
    g = torch.Generator().manual_seed(seed)
    shape = (rows, cols)
    def uniform():
        return torch.rand(shape, generator=g, dtype=torch.float64)

    def normal():
        return torch.randn(shape, generator=g, dtype=torch.float64)

    logp = -5.0 * uniform()
    kind = torch.randint(0, 5, shape, generator=g)  # which branch each token exercises
    sign = torch.where(uniform() < 0.5, -1.0, 1.0)
    delta = 0.05 * normal()  # inside the clip range
    delta = torch.where(kind == 1, 0.5 * normal(), delta)  # clipped
    delta = torch.where(kind == 2, 1.5 + 3.0 * uniform(), delta)  # ratio > c = 3: dual clip
    delta = torch.where(kind == 3, sign * (20.5 + 5.0 * uniform()), delta)  # beyond +-20
    delta = torch.where(kind == 4, torch.zeros_like(delta), delta)  # ratio 1 exactly
    logp = logp.to(dtype)
    old_logp = (logp.double() - delta).to(dtype)
    old_logp = torch.where(kind == 4, logp, old_logp)
    advantages = normal()
    advantages = torch.where(uniform() < 0.1, torch.zeros_like(advantages), advantages)
    is_weights = 0.25 + 1.5 * uniform()
    return {
        "logp": logp,
        "old_logp": old_logp,
        "advantages": advantages.to(dtype),
        "is_weights": is_weights.to(dtype),
    }


def gae_inputs(rows: int, cols: int, *, seed: int, dtype: torch.dtype,
               device: str = "cpu") -> dict[str, torch.Tensor]:
    """rewards (sparse: mostly 0, a few +-1 and a terminal-like score) and values [rows, cols],
    drawn on ``device``."""
    g = torch.Generator(device=device).manual_seed(seed)
    shape = (rows, cols)
    sparse = torch.rand(shape, generator=g, device=device) < 0.2
    rewards = torch.randn(shape, generator=g, dtype=torch.float64, device=device) * sparse
    values = torch.randn(shape, generator=g, dtype=torch.float64, device=device) * 0.5
    return {"rewards": rewards.to(dtype), "values": values.to(dtype)}
