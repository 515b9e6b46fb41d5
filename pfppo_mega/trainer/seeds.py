"""Every random stream of a training run, derived from `training.seed` in one place.

Call sites ask for a stream by name instead of adding their own offsets. The derivations are the
ones the trainer has always used, so seeded runs (tests, the figures in the docs) are unchanged:

    prompts        seed                                        the job's prompt draws and sampling seeds:
                                                               every DP replica holds the same stream,
                                                               draws the global batch from it and keeps
                                                               its slice; a call's rows are seeded by
                                                               their global row (rollout_split), so the
                                                               rows and seeds do not depend on the DP
                                                               size (DP 1 draws as it always did)
    assignment     seed + 7919                                 snapshot assignment of prompt groups
                                                               and the policy-filtration draws
    minibatches    seed * 1_000_003 + step                     mini-batch shuffles of one update
    kl_probe       seed + step                                 sampling of the KL probe
    eval           seed                                        sampling of the held-out evaluation
    clip_cov       seed + 104_729                              the tokens algorithm.policy_loss clip_cov
                                                               cuts (not checkpointed: a resumed run
                                                               draws anew)
"""

from __future__ import annotations

STREAMS = ("prompts", "assignment", "minibatches", "kl_probe", "eval", "clip_cov")


def stream_seed(stream: str, seed: int, *, step: int = 0) -> int:
    """The integer seed of `stream` for this run (see the module docstring)."""
    if stream == "prompts":
        return seed
    if stream == "assignment":
        return seed + 7919
    if stream == "minibatches":
        return seed * 1_000_003 + step
    if stream == "kl_probe":
        return seed + step
    if stream == "eval":
        return seed
    if stream == "clip_cov":
        return seed + 104_729
    raise ValueError(f"random stream {stream!r} is not one of {STREAMS}")
