"""oneDNN-prepacked linears for inference on a CPU (the built-in rollout engine's matmuls).

On this project's CPU (an AMD EPYC with AVX-512; 2 cores) fp32 `torch.mm` / `F.linear` run through
MKL at 155-200 GFLOP/s on 1024 x 1024 matmuls, while oneDNN, which torch also ships, reaches
385-395 GFLOP/s on the same product once the weight is reordered into its blocked layout; on a
decode step's skinny matmuls (16 rows x 576 -> 3072) the prepacked weight streams at ~29 GB/s
against ~11 GB/s through F.linear (`pfppo bench kernels` does not cover this; docs/perf.md has the
commands). The reorder is a copy of the weight, so it pays only where one weight serves many
matmuls: a rollout engine between two refits.

The two torch operators used are internal (`torch.ops.mkldnn._reorder_linear_weight`,
`torch.ops.mkldnn._linear_pointwise`: what inductor's CPU freezing emits). They are reached only
here, checked once by `available()` (present, and exact against F.linear on a probe), and every
caller falls back to F.linear when they are not; tests/test_onednn.py fails loudly if the pinned
torch stops providing them.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


@functools.lru_cache(maxsize=None)
def available(dtype: torch.dtype = torch.float32) -> bool:
    """True when this torch can prepack ``dtype`` weights for oneDNN on the CPU and the packed
    product matches F.linear on a probe (max |diff| <= 1e-4 x the output's scale)."""
    if dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return False
    ops = getattr(torch.ops, "mkldnn", None)
    if ops is None or not hasattr(ops, "_reorder_linear_weight") or not hasattr(ops, "_linear_pointwise"):
        return False
    try:
        g = torch.Generator().manual_seed(0)
        w, x = torch.randn(48, 40, generator=g), torch.randn(3, 5, 40, generator=g)
        got = linear(x, w, None, pack(w, batch_hint=15))
    except RuntimeError:
        return False
    want = F.linear(x, w)
    return got.shape == want.shape and bool((got - want).abs().max() <= 1e-4 * want.abs().max())


def pack(weight: torch.Tensor, *, batch_hint: int) -> torch.Tensor:
    """weight [N, K] (F.linear's layout) -> oneDNN's blocked copy of it, laid out for products with
    about ``batch_hint`` rows (any row count works; the hint only picks the blocking)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), max(int(batch_hint), 1))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) [..., K] -> [..., N], through ``packed`` (pack(weight)) when given.
    ``weight`` is the dense original: the reference path, and the one taken without a pack."""
    if packed is None:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
