"""Where a step's proximal (old) log-probs come from, chosen once per run
(``algorithm.recompute_old_logp``); the loop's prepare phase calls it and never asks which.

    Recompute     the trainer's actor on the rows, in the prepare pass: PPO's three policies
                  (behaviour, proximal, current). Its entropy feeds policy/entropy_first10.
    EngineLogp    the engine's own log-probs: pi_old = pi_behav (verl's rollout-correction bypass
                  mode). The prepare pass runs no actor forward; the update's first epoch observes
                  the actor's log-probs and entropy instead (trainer/update.py, Observed).

The engines report log_softmax(logits / T) of the sampled tokens (the rollout contract,
rollout/base.py), the same quantity the trainer computes, so on the current weights the two differ
by numerics only (rollout/logp_gap_* measures it either way).
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol

import torch

from pfppo_mega.trainer.batch import PackedInputs, RolloutBatch

ActorLogp = Callable[[PackedInputs], tuple[torch.Tensor, torch.Tensor]]  # the actor's (logp, entropy) [B, T]


class Proximal(Protocol):
    observes_in_update: bool

    def old_logp(self, inp: PackedInputs, rb: RolloutBatch, *, actor_logp: ActorLogp,
                 device: torch.device) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(old_logp, entropy or None) [B, T] of the rows, on ``device``."""


class Recompute:
    observes_in_update = False  # the prepare pass has the entropy already

    def old_logp(self, inp: PackedInputs, rb: RolloutBatch, *, actor_logp: ActorLogp,
                 device: torch.device) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(old_logp, entropy) [B, T] of the rows under the actor's current weights."""
        return actor_logp(inp)


class EngineLogp:
    observes_in_update = True  # entropy and the engine/trainer gap come from the update's first epoch

    def old_logp(self, inp: PackedInputs, rb: RolloutBatch, *, actor_logp: ActorLogp,
                 device: torch.device) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(the engine's log-probs, None) [B, T]: no model pass."""
        return rb.behav_logp.to(device), None


def choose_proximal(algorithm) -> Recompute | EngineLogp:
    return Recompute() if algorithm.recompute_old_logp else EngineLogp()
