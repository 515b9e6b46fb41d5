"""Value-loss spike guard (training.value_loss_spike_factor): the critic's update of a step is
skipped when its value loss *before* the update is far above the recent ones.

Before a step's first critic update the critic still holds the weights that computed the batch's
values, so that loss needs no extra forward pass:

    L_pre = token-mean over the batch of 0.5 * (V_old - R)^2

A spike: at least VALUE_GUARD_MIN_HISTORY earlier steps recorded and L_pre > factor x the median of
the last VALUE_GUARD_WINDOW of them. A spiking step skips every critic mini-batch update of that
step (the actor still updates with the advantages already computed), is counted in
guard/value_loss_spikes, and its L_pre is still recorded in the history (a lasting level shift
stops being a spike after a few steps instead of freezing the critic forever). The history is not
checkpointed: after a resume the guard waits for VALUE_GUARD_MIN_HISTORY steps again.
"""

from __future__ import annotations

import statistics
from collections import deque

import torch

VALUE_GUARD_WINDOW = 10
VALUE_GUARD_MIN_HISTORY = 5


def pre_update_value_loss(old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                          *, reduce_sum=None) -> float:
    """Token-mean of 0.5 (V_old - R)^2 over the (global, with reduce_sum) batch.  [B, T] inputs."""
    m = mask.double()
    num_den = torch.stack([(0.5 * (old_values.double() - returns.double()).square() * m).sum(), m.sum()])
    if reduce_sum is not None:
        num_den = reduce_sum(num_den)
    return float(num_den[0] / num_den[1].clamp(min=1.0))


class ValueLossGuard:
    def __init__(self, factor: float, *, window: int = VALUE_GUARD_WINDOW,
                 min_history: int = VALUE_GUARD_MIN_HISTORY):
        self.factor, self.min_history = factor, min_history
        self.history: deque[float] = deque(maxlen=window)

    def is_spike(self, loss: float) -> bool:
        """Judge this step's pre-update loss against the history, then record it. Off (factor 0):
        never. A non-finite loss is a spike once the history allows a verdict."""
        spike = False
        if self.factor > 0 and len(self.history) >= self.min_history:
            base = statistics.median(self.history)
            spike = not (loss == loss and abs(loss) != float("inf")) or loss > self.factor * base
        if loss == loss and abs(loss) != float("inf"):
            self.history.append(loss)
        return spike
