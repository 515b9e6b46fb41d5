"""Token log-prob and entropy over a vocabulary split across a tensor-parallel group.

Each rank holds logits_shard [N, V/tp] (columns vocab_start .. vocab_start + V/tp) and the
full labels [N]. The kernel returns per-row partials (pfppo_mega.kernels.ops.LogProbPartials);
two all-reduces combine them, and the backward needs no communication (every rank has the
same grad_logp, grad_entropy and the combined lse, entropy):

    M = max over ranks of m               (all-reduce MAX)
    S, U, target = sum over ranks of      (one all-reduce SUM of [3, N])
        s e^{m-M},  e^{m-M} (u + (m - M) s),  x_label if the label is on this rank else 0
    logp = target - (M + log S),  H = log S - U / S

The arithmetic lives in pfppo_mega.kernels.ops (rescale_partials, finish_partials,
combine_partials for an in-process list of shards); this module only adds the collectives.
"""

import torch
import torch.distributed as dist

from pfppo_mega.kernels import ops


class _VocabParallelLogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_shard, labels, vocab_start, group):
        partials = ops.logprob_entropy_partials(logits_shard, labels, vocab_start)
        global_max = partials.max.clone()  # [N]
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
        sumexp, shifted = ops.rescale_partials(partials, global_max)
        sums = torch.stack([sumexp, shifted, partials.target])  # [3, N]
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        out = ops.finish_partials(global_max, sums[0], sums[1], sums[2])
        ctx.save_for_backward(logits_shard, labels, out.max, out.log_sumexp, out.entropy)
        ctx.vocab_start = vocab_start
        return out.logp, out.entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits_shard, labels, row_max, log_sumexp, entropy = ctx.saved_tensors
        combined = ops.LogProbCombined(None, entropy, row_max, log_sumexp)
        grad = ops.logprob_entropy_shard_backward(
            logits_shard, labels, ctx.vocab_start, combined,
            grad_logp.float().contiguous(), grad_entropy.float().contiguous(),
        )
        return grad, None, None, None


def vocab_parallel_logprob_entropy(
    logits_shard: torch.Tensor,
    labels: torch.Tensor,
    vocab_start: int,
    group: dist.ProcessGroup | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp [N], entropy [N]) of the full vocabulary, float32, identical on every rank of
    `group` (the tensor-parallel group, passed in). logits_shard [N, V/tp] float32/bfloat16,
    labels [N] int64 global indices. Differentiable w.r.t. logits_shard."""
    return _VocabParallelLogProbEntropy.apply(logits_shard, labels, vocab_start, group)
