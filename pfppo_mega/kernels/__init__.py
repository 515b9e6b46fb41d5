"""Fused PPO kernels (pfppo_mega._C) and the backend interface the trainer selects with
`kernels: auto | torch | fused`.

    get_backend("auto")      FusedBackend when pfppo_mega._C is built for the device (on a GPU:
                             and verified there by scripts/gpu_kernels_check.sh), else TorchBackend
    backend.logprob_entropy(logits, labels, *, temperature=1.0, vocab_size=None)
                                                        -> (logp, entropy)
    backend.policy_loss(logp, old_logp, advantages, mask, *, clip_ratio_low, ...)
                                                        -> PolicyLossOutput
    backend.gae(rewards, values, mask, *, gamma, lam, whiten=False) -> (advantages, returns)

Vocab-parallel log-probs: vocab_parallel_logprob_entropy(shard, labels, vocab_start=,
vocab_size=, group=, temperature=, backend=) across a tensor-parallel group (the backend's
partials + two all-reduces); combine_partials for shards in one process. Design notes:
docs/kernels.md.
"""

from pfppo_mega.kernels.backends import (
    KERNEL_MODES,
    FusedBackend,
    KernelBackend,
    TorchBackend,
    available_backends,
    fused_available,
    get_backend,
)
from pfppo_mega.kernels.ops import (
    has_cuda,
    is_built,
    logprob_entropy_partials,
    logprob_entropy_shard_backward,
)
from pfppo_mega.kernels.shard_math import LogProbCombined, LogProbPartials, combine_partials
from pfppo_mega.kernels.vocab_parallel import vocab_parallel_logprob_entropy

__all__ = [
    "KERNEL_MODES",
    "FusedBackend",
    "KernelBackend",
    "LogProbCombined",
    "LogProbPartials",
    "TorchBackend",
    "available_backends",
    "combine_partials",
    "fused_available",
    "get_backend",
    "has_cuda",
    "is_built",
    "logprob_entropy_partials",
    "logprob_entropy_shard_backward",
    "vocab_parallel_logprob_entropy",
]
