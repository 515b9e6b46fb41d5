"""Token log-prob and entropy from logits split over the vocabulary, without gathering it.

Each tensor-parallel rank holds x [N, V/tp] = columns vocab_start .. vocab_start + V/tp of the
(padded) vocabulary; columns >= vocab_size (padding) count as -inf. With the global row max M:

    M   = max over ranks of max_v x_v                                  (all-reduce MAX)
    S   = sum over ranks of sum_v e^{x_v - M}                          (all-reduce SUM, [3, N]:
    U   = sum over ranks of sum_v e^{x_v - M} (x_v - M)                 S, U and the label's
    x_y = sum over ranks of x_label if the label is in the shard else 0 logit in one call)
    logp    = x_y - M - log S
    entropy = -sum_v p_v log p_v = log S - U / S

Backward (no communication: the incoming grads g, h [N] are the same on every rank, because the
loss is computed redundantly on all of them, and each rank returns the grad of its own columns):

    p_v = e^{x_v - M - log S}
    d/dx_v = g ([v == label] - p_v) - h p_v (log p_v + entropy)

M is a constant shift (the results do not depend on it), so the MAX all-reduce has no backward;
the SUM all-reduce's backward is folded into the closed form above. Temperature is applied by
the caller before (logits / T), inside autograd.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor


class VocabParallelMath:
    """The arithmetic, one step per static method; x is the float32 shard [N, Vs]."""

    @staticmethod
    def mask_padding(x: Tensor, vocab_start: int, vocab_size: int) -> Tensor:
        """Columns whose global index is >= vocab_size (vocab padding) set to -inf."""
        end = vocab_start + x.shape[-1]
        if end <= vocab_size:
            return x
        cols = torch.arange(vocab_start, end, device=x.device)  # [Vs]
        return x.masked_fill(cols >= vocab_size, float("-inf"))

    @staticmethod
    def local_max(x: Tensor) -> Tensor:
        return x.amax(dim=-1)  # [N]

    @staticmethod
    def local_sums(x: Tensor, global_max: Tensor, labels: Tensor, vocab_start: int) -> Tensor:
        """[3, N]: sum e^{x-M}, sum e^{x-M} (x-M), and x_label where the label is in this shard."""
        shifted = x - global_max[:, None]  # [N, Vs]
        e = torch.exp(shifted)
        plogp = torch.where(e > 0, e * shifted, torch.zeros((), dtype=x.dtype, device=x.device))
        local = labels - vocab_start  # [N]
        inside = (local >= 0) & (local < x.shape[-1])
        picked = x.gather(1, local.clamp(0, x.shape[-1] - 1)[:, None])[:, 0]  # [N]
        target = torch.where(inside, picked, torch.zeros((), dtype=x.dtype, device=x.device))
        return torch.stack([e.sum(dim=-1), plogp.sum(dim=-1), target])

    @staticmethod
    def finish(global_max: Tensor, sums: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(logp, entropy, lse) [N] each from the reduced sums."""
        log_s = torch.log(sums[0])
        lse = global_max + log_s
        return sums[2] - lse, log_s - sums[1] / sums[0], lse

    @staticmethod
    def grad(x: Tensor, labels: Tensor, vocab_start: int, lse: Tensor, entropy: Tensor,
             grad_logp: Tensor, grad_entropy: Tensor) -> Tensor:
        """d loss / d x [N, Vs] = g (onehot - p) - h p (log p + H)."""
        log_p = x - lse[:, None]  # [N, Vs]; -inf on padding
        p = torch.exp(log_p)
        zero = torch.zeros((), dtype=x.dtype, device=x.device)
        plogp_h = torch.where(p > 0, p * (log_p + entropy[:, None]), zero)
        grad = -grad_logp[:, None] * p - grad_entropy[:, None] * plogp_h
        local = labels - vocab_start
        inside = (local >= 0) & (local < x.shape[-1])
        rows = inside.nonzero()[:, 0]
        grad[rows, local[rows]] += grad_logp[rows]
        return grad


class _VocabParallelLogProbEntropy(torch.autograd.Function):
    """Collectives only; the math is VocabParallelMath."""

    @staticmethod
    def forward(ctx, logits_shard: Tensor, labels: Tensor, vocab_start: int, vocab_size: int,
                group: Optional[dist.ProcessGroup]) -> tuple[Tensor, Tensor]:
        x = VocabParallelMath.mask_padding(logits_shard.float(), vocab_start, vocab_size)
        global_max = VocabParallelMath.local_max(x)
        if group is not None:
            dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
        sums = VocabParallelMath.local_sums(x, global_max, labels, vocab_start)  # [3, N]
        if group is not None:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        logp, entropy, lse = VocabParallelMath.finish(global_max, sums)
        ctx.save_for_backward(logits_shard, labels, lse, entropy)
        ctx.vocab_start, ctx.vocab_size = vocab_start, vocab_size
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: Tensor, grad_entropy: Tensor):
        logits_shard, labels, lse, entropy = ctx.saved_tensors
        x = VocabParallelMath.mask_padding(logits_shard.float(), ctx.vocab_start, ctx.vocab_size)
        grad = VocabParallelMath.grad(x, labels, ctx.vocab_start, lse, entropy,
                                      grad_logp.float(), grad_entropy.float())
        return grad.to(logits_shard.dtype), None, None, None, None


def vocab_parallel_logprob_entropy(logits_shard: Tensor, labels: Tensor, *, vocab_start: int,
                                   vocab_size: int, group: Optional[dist.ProcessGroup]
                                   ) -> tuple[Tensor, Tensor]:
    """(logp [N], entropy [N]) float32 over the whole vocabulary, identical on every rank of group.

    logits_shard [N, V/tp] (float32 or bfloat16, already divided by the temperature), labels [N]
    int64 global indices < vocab_size, vocab_start the global index of column 0, vocab_size the
    true (unpadded) vocabulary, group the tensor-parallel group (None: one shard, no collective).
    Differentiable with respect to logits_shard. Never writes into logits_shard.
    """
    if logits_shard.dim() != 2 or labels.shape != logits_shard.shape[:1]:
        raise ValueError(f"logits_shard must be [N, V/tp] and labels [N]; got "
                         f"{tuple(logits_shard.shape)} and {tuple(labels.shape)}")
    if group is not None and dist.get_world_size(group) == 1:
        group = None
    return _VocabParallelLogProbEntropy.apply(logits_shard, labels, vocab_start, vocab_size, group)
