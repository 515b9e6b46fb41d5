"""Fused PPO kernels (pfppo_mega._C) and the backend interface the trainer selects with
`kernels: auto | torch | fused`.

    get_backend("auto")      FusedBackend when pfppo_mega._C is built, else TorchBackend
    backend.logprob_entropy(logits, labels)             -> (logp, entropy)
    backend.policy_loss(logp, old_logp, advantages, mask, *, clip_ratio_low, ...)
                                                        -> PolicyLossOutput
    backend.gae(rewards, values, mask, *, gamma, lam, whiten=False) -> (advantages, returns)

Vocab-parallel log-probs: logprob_entropy_partials + combine_partials (in-process) or
vocab_parallel_logprob_entropy (across a process group). Design notes: docs/kernels.md.
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
    LogProbCombined,
    LogProbPartials,
    combine_partials,
    has_cuda,
    is_built,
    logprob_entropy_partials,
    logprob_entropy_shard_backward,
)
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
