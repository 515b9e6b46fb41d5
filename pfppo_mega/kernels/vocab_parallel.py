"""Token log-prob and entropy over a vocabulary split across a tensor-parallel group.

Each rank holds logits_shard [N, Vp/tp] (global columns vocab_start .. vocab_start + Vp/tp of
the padded vocabulary; columns >= vocab_size are megatron's padding) and the full labels [N].
The backend (torch or fused kernels) reduces its shard of y = x / T to four per-row partials
(pfppo_mega.kernels.shard_math); two all-reduces combine them, and the backward needs no
communication (every rank has the same grad_logp, grad_entropy and the combined lse, entropy):

    M = max over ranks of m               (all-reduce MAX; a constant shift, no backward)
    S, U, target = sum over ranks of      (one all-reduce SUM of [3, N]; its backward is folded
        s e^{m-M},  e^{m-M} (u + (m - M) s),   into the closed-form shard gradient)
        y_label if the label is on this rank else 0
    logp = target - (M + log S),  H = log S - U / S

This module holds only the collectives (a thin autograd Function, each collective paired with
its backward); the arithmetic is the backend's (shard_math for torch, pfppo_mega._C for fused).
Without a group (tp = 1) and with the whole vocabulary on one rank it is the backend's
full-vocabulary logprob_entropy.
"""

from typing import Optional

import torch
import torch.distributed as dist

from pfppo_mega.kernels.backends import KernelBackend, TorchBackend
from pfppo_mega.kernels.shard_math import LogProbCombined, LogProbPartials, finish_partials, rescale_partials


def combine_over_group(partials: LogProbPartials, group: Optional[dist.ProcessGroup]) -> LogProbCombined:
    """This rank's partials [N] combined with the other vocab shards' of ``group`` (None: this shard is
    the whole vocabulary): one all-reduce MAX of [N], one all-reduce SUM of [3, N]. Not differentiable
    (the callers' backward uses the closed-form shard gradient)."""
    global_max = partials.max.clone()  # [N]
    if group is not None:
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=group)
    sumexp, shifted = rescale_partials(partials, global_max)
    sums = torch.stack([sumexp, shifted, partials.target])  # [3, N]
    if group is not None:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
    return finish_partials(global_max, sums[0], sums[1], sums[2])


class _VocabParallelLogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_shard, labels, backend, vocab_start, vocab_size, temperature, group):
        shard = dict(vocab_start=vocab_start, vocab_size=vocab_size, temperature=temperature)
        out = combine_over_group(backend.logprob_entropy_partials(logits_shard, labels, **shard), group)
        ctx.save_for_backward(logits_shard, labels, out.max, out.log_sumexp, out.entropy)
        ctx.backend, ctx.shard = backend, shard
        return out.logp, out.entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits_shard, labels, row_max, log_sumexp, entropy = ctx.saved_tensors
        grad = ctx.backend.logprob_entropy_shard_backward(
            logits_shard, labels, combined=LogProbCombined(None, entropy, row_max, log_sumexp),
            grad_logp=grad_logp, grad_entropy=grad_entropy, **ctx.shard,
        )
        return grad, None, None, None, None, None, None


def vocab_parallel_logprob_entropy(
    logits_shard: torch.Tensor,
    labels: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    group: Optional[dist.ProcessGroup],
    temperature: float = 1.0,
    backend: Optional[KernelBackend] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp [N], entropy [N]) float32 of softmax(full logits[:, :vocab_size] / temperature),
    identical on every rank of `group` (the tensor-parallel group, passed in; None: one shard).

    logits_shard [N, Vp/tp] float32/bfloat16 (never written), labels [N] int64 global indices
    < vocab_size, vocab_start the global index of column 0, vocab_size the true (unpadded)
    vocabulary, backend the kernels to use (default: pure torch). Differentiable with respect
    to logits_shard; padding columns get a zero gradient.
    """
    fn = "vocab_parallel_logprob_entropy"
    if logits_shard.dim() != 2 or logits_shard.shape[1] < 1:
        raise ValueError(f"{fn}: logits_shard must have shape [N, V/tp] with V/tp >= 1; "
                         f"got {tuple(logits_shard.shape)}")
    if labels.shape != logits_shard.shape[:1]:
        raise ValueError(f"{fn}: labels must have shape [N] = [{logits_shard.shape[0]}] (one per row of "
                         f"logits_shard); got {list(labels.shape)}")
    if vocab_start < 0 or vocab_size < 1:
        raise ValueError(f"{fn}: vocab_start={vocab_start} must be >= 0 and vocab_size={vocab_size} >= 1")
    if not 0.0 < temperature < float("inf"):
        raise ValueError(f"{fn}: temperature={temperature} must be a finite number > 0")
    backend = backend if backend is not None else TorchBackend()
    if group is not None and dist.get_world_size(group) == 1:
        group = None
    if group is None and vocab_start == 0 and vocab_size <= logits_shard.shape[1]:
        # The whole vocabulary is here: the backend's one-pass full op.
        return backend.logprob_entropy(logits_shard, labels, temperature=temperature,
                                       vocab_size=vocab_size)
    return _VocabParallelLogProbEntropy.apply(logits_shard, labels, backend, vocab_start, vocab_size,
                                              temperature, group)
