"""The LM head fused with log-prob and entropy: no [tokens, V] tensor, forward or backward.

Today's head (pfppo_mega.kernels.vocab_parallel after megatron's output layer) computes logits
[N, Vs] = hidden @ weight^T for every token at once, the log-prob kernel reads them, its backward
writes a gradient of the same size, and two more products read that (d hidden, d weight). At 16k
tokens x 152k vocabulary that is 10 GB per [N, V] tensor in fp32. Here the same math runs over
chunks of ``chunk_tokens`` rows:

    forward, per chunk c:   logits_c = hidden_c @ weight^T        [c, Vs]  (freed after the chunk)
                            partials_c = backend.partials(logits_c)  (m, s, u, target; [c] each)
    then, once for all rows: the two all-reduces of vocab_parallel (MAX of [N], SUM of [3, N]) over
                            the tensor-parallel group passed in -> logp, entropy, max, log-sum-exp
    backward, per chunk c:  logits_c recomputed, G_c = backend.shard_backward(logits_c)  [c, Vs]
                            d hidden_c = G_c @ weight                        [c, H]
                            d weight  += G_c^T @ hidden_c   (fp32 accumulator, or megatron DDP's
                                                             main_grad directly: see below)
                            then one all-reduce SUM of d hidden over the group (as megatron's
                            ColumnParallelLinear does for its input gradient)

so the peak is a few [c, Vs] tensors plus the [Vs, H] weight gradient, whatever N is. The
softmax statistics come from the kernels backend (``backend.logprob_entropy_partials`` and
``logprob_entropy_shard_backward``: the C++/OpenMP or CUDA kernels when built, shard_math
otherwise), the same calls today's path makes on the whole [N, Vs], so temperature, megatron's
vocabulary padding (rows of ``weight`` at global index >= vocab_size: never multiplied, zero
gradient) and the label of another rank's shard mean exactly what they mean there.

The price is one more product: the backward recomputes each chunk's logits (four [N, H] x [H, V]
products in all instead of three). The win is memory, and time wherever the [N, V] traffic
(allocation, page faults, reads and writes of 4 N V bytes per pass) costs more than a quarter of
the products: docs/perf.md has the measured figures (`pfppo bench head`).

Why chunked torch and not a C++ or Triton kernel here: the work is the four products, already
BLAS (oneDNN / MKL) on the CPU and cuBLAS on a GPU; the element-wise part per chunk is the
existing log-prob kernels (csrc/), which read the chunk once more while it is still warm. A
hand-written fused product + softmax (Triton on CUDA, as Liger-Kernel's fused linear cross entropy)
would save that read and the chunk's round trip to memory on a GPU: left for when a GPU is at hand
to measure it against this.

``grad_weight_into``: megatron DDP's fp32 ``main_grad`` of the weight (training.sparse_vocab_grads,
pfppo_mega.models.vocab_grads): the weight gradient is added there chunk by chunk and autograd gets
none (no dense [Vs, H] gradient per micro-batch); None: autograd gets the gradient in the weight's
dtype, accumulated in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from pfppo_mega.constants import MAX_HEAD_CHUNK_TOKENS
from pfppo_mega.kernels.backends import KernelBackend, TorchBackend
from pfppo_mega.kernels.shard_math import LogProbCombined, LogProbPartials, check_labels, valid_columns
from pfppo_mega.kernels.vocab_parallel import combine_over_group

DEFAULT_CHUNK_TOKENS = 128  # rows per chunk, as training.fused_head_chunk_tokens: [128, 151936] fp32 is 78 MB
MAX_CHUNK_TOKENS = MAX_HEAD_CHUNK_TOKENS
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _for_backend(logits: torch.Tensor) -> torch.Tensor:
    """The kernels take float32 / bfloat16: fp16 logits go to them in fp32, as megatron's Float16Module
    hands the unfused head's fp16 logits on in fp32 (and the gradient comes back to fp16 the same way)."""
    return logits.float() if logits.dtype == torch.float16 else logits


@dataclass(frozen=True)
class HeadOptions:
    """What the fused head needs besides its three tensors (see fused_linear_logprob_entropy)."""

    vocab_start: int
    vocab_size: int
    temperature: float
    group: Optional[dist.ProcessGroup]
    backend: KernelBackend
    chunk_tokens: int
    grad_weight_into: Optional[torch.Tensor]


def _spans(n: int, chunk: int) -> list[tuple[int, int]]:
    return [(s, min(s + chunk, n)) for s in range(0, n, chunk)]


def accumulate(main: torch.Tensor, g: torch.Tensor, x: torch.Tensor) -> None:
    """main [V/tp, H] (fp32) += g^T [V/tp, N] @ x [N, H] (the head's weight gradient; also
    pfppo_mega.models.vocab_grads').

    On the CPU in main's dtype (fp32: the CPU has no fast bf16 GEMM, and the tests compare this path
    with megatron's in fp32). Elsewhere (a GPU) with bf16 / fp16 operands the product runs on the
    tensor cores in the operands' dtype (fp32 accumulation inside the GEMM, rounded once) and is
    added into the fp32 buffer: megatron's own weight gradient without its fused accumulation. An
    fp32 GEMM there (no TF32) cost an estimated 3-5 s per 70B step."""
    if main.device.type != "cpu" and g.dtype in (torch.bfloat16, torch.float16) and g.dtype != main.dtype:
        main.add_(torch.matmul(g.t(), x.to(g.dtype)))                               # [V/tp, H]
    else:
        main.addmm_(g.t().to(main.dtype), x.to(main.dtype))


class _FusedHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, opt: HeadOptions):
        n = hidden.shape[0]
        # The whole shard, padding rows too (the backend drops their columns): torch.matmul(x, weight.t()) of
        # the Parameter itself is what compat/onednn.py routes through its packs in the forward-only passes.
        x = hidden.to(weight.dtype)                                           # [N, H]
        shard = dict(vocab_start=opt.vocab_start, vocab_size=opt.vocab_size, temperature=opt.temperature)
        parts = torch.empty(4, n, dtype=torch.float32, device=hidden.device)  # m, s, u, target per row
        for s, e in _spans(n, opt.chunk_tokens):
            logits = _for_backend(torch.matmul(x[s:e], weight.t()))           # [c, Vs]
            p = opt.backend.logprob_entropy_partials(logits, labels[s:e], **shard)
            del logits
            for i, part in enumerate((p.max, p.sumexp, p.sumexp_shifted, p.target)):
                parts[i, s:e] = part
        out = combine_over_group(LogProbPartials(parts[0], parts[1], parts[2], parts[3]), opt.group)
        ctx.save_for_backward(hidden, weight, labels, out.max, out.log_sumexp, out.entropy)
        ctx.opt = opt
        ctx.set_materialize_grads(False)
        return out.logp, out.entropy

    @staticmethod
    def backward(ctx, grad_logp: Optional[torch.Tensor], grad_entropy: Optional[torch.Tensor]):
        hidden, weight, labels, row_max, log_sumexp, entropy = ctx.saved_tensors
        opt: HeadOptions = ctx.opt
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (grad_logp is None and grad_entropy is None) or not (need_x or need_w):
            return None, None, None, None
        n, h = hidden.shape
        zeros = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        g = grad_logp.float() if grad_logp is not None else zeros             # [N]
        gh = grad_entropy.float() if grad_entropy is not None else zeros      # [N]
        valid = valid_columns(weight.shape[0], opt.vocab_start, opt.vocab_size)
        w = weight[:max(valid, 1)]                                            # [valid, H]
        x = hidden.to(weight.dtype)                                           # [N, H]
        grad_x = torch.empty_like(x) if need_x else None                      # [N, H]
        into = opt.grad_weight_into
        full = None if into is not None or not need_w else torch.empty(weight.shape, dtype=torch.float32,
                                                                       device=weight.device)  # [Vs, H]
        if full is not None:
            full[w.shape[0]:].zero_()  # padding rows: no gradient
        acc = (into if into is not None else full)[:w.shape[0]] if need_w else None  # [valid, H]
        fresh = into is None  # the first chunk writes acc (no zero fill of [Vs, H] first); later ones add
        shard = dict(vocab_start=opt.vocab_start, vocab_size=opt.vocab_size, temperature=opt.temperature)
        # one block for every chunk's recomputed logits: a fresh [c, valid] per chunk is a fresh mapping (and its
        # page faults) each time on the CPU, where blocks past glibc's 32 MB mmap threshold are never reused
        block = x.new_empty(min(n, opt.chunk_tokens), w.shape[0])             # [c, valid]
        for s, e in _spans(n, opt.chunk_tokens):
            logits = torch.matmul(x[s:e], w.t(), out=block[:e - s])            # [c, valid], recomputed
            combined = LogProbCombined(None, entropy[s:e], row_max[s:e], log_sumexp[s:e])
            grad_logits = opt.backend.logprob_entropy_shard_backward(
                _for_backend(logits), labels[s:e], combined=combined, grad_logp=g[s:e], grad_entropy=gh[s:e],
                **shard)
            if x.dtype == torch.float16:  # back in the operands' dtype, as through Float16Module's cast
                grad_logits = grad_logits.to(torch.float16)
            del logits
            if grad_x is not None:
                torch.matmul(grad_logits, w, out=grad_x[s:e])                 # [c, H]
            if acc is not None and fresh:
                torch.matmul(grad_logits.t(), x[s:e].to(grad_logits.dtype), out=acc) if acc.dtype == grad_logits.dtype \
                    else acc.copy_(torch.matmul(grad_logits.t(), x[s:e].to(grad_logits.dtype)))
                fresh = False
            elif acc is not None:
                accumulate(acc, grad_logits, x[s:e])                         # [valid, H] += [valid, c] @ [c, H]
            del grad_logits
        if grad_x is not None and opt.group is not None:
            dist.all_reduce(grad_x, group=opt.group)  # each rank holds its vocab shard's share of d hidden
        grad_hidden = grad_x.to(hidden.dtype) if grad_x is not None else None
        grad_weight = full.to(weight.dtype) if full is not None else None  # None: it went into main_grad
        return grad_hidden, grad_weight, None, None


def check_chunk_tokens(fn: str, chunk_tokens: object) -> int:
    """chunk_tokens must be an int in [1, MAX_CHUNK_TOKENS] (a bool is refused)."""
    if type(chunk_tokens) is not int or not 1 <= chunk_tokens <= MAX_CHUNK_TOKENS:
        raise ValueError(f"{fn}: chunk_tokens={chunk_tokens!r} must be an int in [1, {MAX_CHUNK_TOKENS}] "
                         f"(rows of the [chunk, V] logits computed at a time)")
    return chunk_tokens


def _check(fn: str, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, vocab_start: int,
           vocab_size: int, temperature: float, grad_weight_into: Optional[torch.Tensor]) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1] or weight.shape[0] < 1:
        raise ValueError(f"{fn}: hidden must be [N, H] and weight [V/tp, H] with the same H and V/tp >= 1; got "
                         f"hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}")
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"{fn}: labels must have shape [N] = [{hidden.shape[0]}] (one per row of hidden); got "
                         f"{list(labels.shape)}")
    if labels.dtype != torch.int64:
        raise TypeError(f"{fn}: labels must be int64 token ids, got {labels.dtype}")
    for name, t in (("hidden", hidden), ("weight", weight)):
        if t.dtype not in _DTYPES:
            raise TypeError(f"{fn}: {name} must be float32, bfloat16 or float16, got {t.dtype}")
    if len({hidden.device, weight.device, labels.device}) != 1:
        raise ValueError(f"{fn}: hidden ({hidden.device}), weight ({weight.device}) and labels ({labels.device}) "
                         f"must be on one device")
    if type(vocab_start) is not int or type(vocab_size) is not int or vocab_start < 0 or vocab_size < 1:
        raise ValueError(f"{fn}: vocab_start={vocab_start!r} must be an int >= 0 and vocab_size={vocab_size!r} "
                         f"an int >= 1")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not 0.0 < temperature < float("inf"):
        raise ValueError(f"{fn}: temperature={temperature!r} must be a finite number > 0")
    if grad_weight_into is not None and (grad_weight_into.shape != weight.shape
                                         or grad_weight_into.dtype != torch.float32
                                         or grad_weight_into.device != weight.device):
        raise ValueError(f"{fn}: grad_weight_into must be float32 {tuple(weight.shape)} on {weight.device} like "
                         f"weight; got {grad_weight_into.dtype} {tuple(grad_weight_into.shape)} on "
                         f"{grad_weight_into.device}")


def fused_linear_logprob_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    vocab_start: int = 0,
    vocab_size: Optional[int] = None,
    group: Optional[dist.ProcessGroup] = None,
    temperature: float = 1.0,
    backend: Optional[KernelBackend] = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    grad_weight_into: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp [N], entropy [N]) float32 of softmax(hidden @ W^T / temperature) over the unpadded
    vocabulary, W the whole head split over ``group`` (the tensor-parallel group, passed in; None: one
    shard), identical on every rank; vocab_parallel_logprob_entropy(hidden @ weight^T, ...) without
    the logits.

    hidden [N, H] float32/bfloat16/float16 (identical on every rank of the group: the response positions'
    final hidden states), weight [Vs, H] this rank's rows of the head (global rows vocab_start ..
    vocab_start + Vs; rows >= vocab_size are padding), labels [N] int64 global indices < vocab_size
    (None: Vs). Differentiable with respect to hidden and weight (see the module docstring for
    ``grad_weight_into``); never writes its inputs.
    """
    fn = "fused_linear_logprob_entropy"
    vocab_size = weight.shape[0] if vocab_size is None else vocab_size
    _check(fn, hidden, weight, labels, vocab_start=vocab_start, vocab_size=vocab_size, temperature=temperature,
           grad_weight_into=grad_weight_into)
    check_chunk_tokens(fn, chunk_tokens)
    check_labels(fn, labels, vocab_size, "vocab_size")  # host labels only: no device sync
    if group is not None and dist.get_world_size(group) == 1:
        group = None
    if group is None and vocab_start != 0:
        raise ValueError(f"{fn}: vocab_start={vocab_start} without a group: one shard is the whole vocabulary "
                         f"and starts at 0")
    if hidden.shape[0] == 0:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty + 0 * hidden.sum(), empty.clone()
    opt = HeadOptions(vocab_start=vocab_start, vocab_size=vocab_size, temperature=float(temperature), group=group,
                      backend=backend if backend is not None else TorchBackend(), chunk_tokens=chunk_tokens,
                      grad_weight_into=grad_weight_into)
    return _FusedHead.apply(hidden, weight, labels, opt)
