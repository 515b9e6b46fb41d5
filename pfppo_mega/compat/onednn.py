"""oneDNN-prepacked linears for inference on a CPU (the built-in rollout engine's matmuls).

On this project's CPU (an AMD EPYC with AVX-512; 2 cores) fp32 `torch.mm` / `F.linear` run through
MKL at 155-200 GFLOP/s on 1024 x 1024 matmuls, while oneDNN, which torch also ships, reaches
385-395 GFLOP/s on the same product once the weight is reordered into its blocked layout; on a
decode step's skinny matmuls (16 rows x 576 -> 3072) the prepacked weight streams at ~29 GB/s
against ~11 GB/s through F.linear (`pfppo bench kernels` does not cover this; docs/perf.md has the
commands). The reorder is a copy of the weight, so it pays only where one weight serves many
matmuls: a rollout engine between two refits.

The trainer's forward-only passes (old / reference log-probs, values) get the same products inside
`packed_weights()`: while such a pipeline schedule runs (the weights cannot change inside it), each
`torch.matmul(x, W.t())` of a linear's forward, W an nn.Parameter on the CPU in fp32, runs through a
pack of W made at its first use in the context and dropped at its exit. The compat layer's function
mode (compat/megatron_cpu.py) routes them here. Training schedules do not open the context: torch does
not consult function modes inside autograd's backward, so the backward's products stay on torch.mm
(which runs those shapes at 300-440 GFLOP/s here, as fast as oneDNN), and a micro-batch's forward has
too few rows per pack to repay the reorder (an actor step on the SmolLM2-135M shape took 11.1-11.4 s
with packs, 9.3-9.6 s without).

The two torch operators used are internal (`torch.ops.mkldnn._reorder_linear_weight`,
`torch.ops.mkldnn._linear_pointwise`: what inductor's CPU freezing emits). They are reached only
here, checked once by `available()` (present, and exact against F.linear on a probe), and every
caller falls back to F.linear when they are not; tests/test_onednn.py fails loudly if the pinned
torch stops providing them.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Iterator

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


# ----------------------------------------------------------------------------- megatron's linears

_state = threading.local()  # .packs: the open packed_weights() context's packs, or None


@contextlib.contextmanager
def packed_weights(keep: dict | None = None) -> Iterator[None]:
    """Route the calling thread's CPU fp32 matmuls against nn.Parameters through oneDNN packs made
    once in the context (see the module docstring). The caller guarantees that no weight changes
    inside; a weight whose version counter moved is repacked all the same. ``keep``: a dict that
    holds the packs past the context, for the next one to reuse (a frozen model's: see
    frozen_packs); None: made in the context and dropped at its exit."""
    if not available(torch.float32) or getattr(_state, "packs", None) is not None:  # nested: the outer one
        yield
        return
    _state.packs = {} if keep is None else keep
    try:
        yield
    finally:
        _state.packs = None


def frozen_packs(model: torch.nn.Module) -> dict | None:
    """The packs ``model`` keeps between its forward-only passes when none of its parameters can
    change through training (the reference policy: one reorder per process instead of one per
    step; a copy of its fp32 weights stays in memory). None for a trained model (its packs would
    be stale after each step) or where oneDNN is not used. Packs of weights the model no longer
    holds (replaced, not updated in place) are dropped; updated in place, they are remade."""
    params = list(model.parameters())
    if not available(torch.float32) or not params or any(p.requires_grad for p in params):
        return None
    keep = model.__dict__.setdefault("_onednn_packs", {})
    live = {id(p): p for p in params}
    for key in [k for k, entry in keep.items() if live.get(k[0]) is not entry[0]]:
        del keep[key]
    return keep


def routed_matmul(args: tuple, kwargs: dict | None) -> torch.Tensor | None:
    """torch.matmul(a, b) through a pack when inside packed_weights() and b is W.t() or W of an
    nn.Parameter W [N, K] (CPU, fp32, no autograd recording); None: not routed (the caller runs it)."""
    packs = getattr(_state, "packs", None)
    if packs is None or kwargs or len(args) != 2:
        return None
    x, b = args
    if not (isinstance(x, torch.Tensor) and isinstance(b, torch.Tensor)) or b.dim() != 2 or x.dim() < 2:
        return None
    if b.dtype != torch.float32 or x.dtype != torch.float32 or b.device.type != "cpu" or x.device.type != "cpu":
        return None
    if torch.is_grad_enabled() and (x.requires_grad or b.requires_grad):
        return None  # recorded by autograd: oneDNN's op has no derivative (inside an autograd.Function it is off)
    if isinstance(b, torch.nn.Parameter) and b.is_contiguous():
        weight, transposed = b, False        # grad_input = grad_output @ W   [.., N] @ [N, K]
    elif isinstance(b._base, torch.nn.Parameter) and b._base.is_contiguous() and b.shape == b._base.shape[::-1] \
            and b.stride() == (1, b._base.shape[1]):
        weight, transposed = b._base, True   # output = input @ W.t()        [.., K] @ [K, N]
    else:
        return None
    key = (id(weight), transposed)
    entry = packs.get(key)
    if entry is None or entry[1] != weight._version:
        dense = weight.detach() if transposed else weight.detach().t().contiguous()  # [out, in] for linear()
        entry = packs[key] = (weight, weight._version, dense, pack(dense, batch_hint=x.numel() // x.shape[-1]))
    return linear(x, entry[2], None, entry[3])
