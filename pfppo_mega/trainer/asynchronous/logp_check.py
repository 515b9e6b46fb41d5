"""The engine-vs-trainer log-prob check on rows an older version wrote (algorithm.async_rl.
logp_check_interval): rollout/logp_gap_* compares the engine's log-probs with the trainer's only on
rows of the current weights, and here every row after the first step is an older version's.

Every `interval` steps the actor's parameters, as published to the generator as version v, are
copied to the host. When rows of version v reach the trainer (they must within max_staleness steps),
up to `rows` of them are scored with those parameters put back into the actor for one forward pass,
then the current ones are restored bit for bit; the gap to the engine's log-probs is logged as
rollout/logp_gap_check_{rows,max,mean,age}. One copy is kept at a time; a version whose rows never
came (all dropped as stale) is given up after max_staleness steps and counted as
rollout/logp_gap_check_missed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pfppo_mega import ppo
from pfppo_mega.models.passes import forward_logp_entropy
from pfppo_mega.types import PackedInputs


@dataclass
class _Kept:
    version: int
    params: list[torch.Tensor]   # host copies, in actor.parameters() order


def _rows_of(inp: PackedInputs, idx: torch.Tensor) -> PackedInputs:
    return PackedInputs(*(getattr(inp, f)[idx] for f in ("input_ids", "attention_mask", "resp_pos", "labels",
                                                        "response_mask")))


class VersionLogpCheck:
    def __init__(self, actor: torch.nn.Module, *, interval: int, rows: int, max_age: int, temperature: float,
                 kernels=None) -> None:
        self.actor, self.interval, self.rows, self.max_age = actor, interval, rows, max_age
        self.temperature, self.kernels = temperature, kernels
        self.kept: Optional[_Kept] = None
        self.missed = 0

    @property
    def host_bytes(self) -> int:
        return 0 if self.kept is None else sum(t.numel() * t.element_size() for t in self.kept.params)

    def keep(self, step: int) -> None:
        """After the update of step `step` (the actor holds version `step`, published next)."""
        if self.interval and step % self.interval == 0 and self.kept is None:
            self.kept = _Kept(step, [p.detach().to("cpu", copy=True) for p in self.actor.parameters()])

    def measure(self, inp: PackedInputs, behav_logp: torch.Tensor, versions: torch.Tensor,
                step: int) -> dict[str, float]:
        """The check on this batch's rows of the kept version, if any. inp, behav_logp: [B, ...] of the
        trained rows; versions [B]; `step` the version the batch was trained at (its on-policy rows')."""
        if self.kept is None:
            return {}
        v = self.kept.version
        has_tokens = inp.response_mask.sum(1) > 0                                     # [B]
        idx = torch.nonzero((versions.to(has_tokens.device) == v) & has_tokens).flatten()[: self.rows]
        if idx.numel() == 0:
            if step - v >= self.max_age:  # later batches are past the staleness bound for v: given up
                self.kept, self.missed = None, self.missed + 1
            return {"rollout/logp_gap_check_missed": float(self.missed)}
        sub = _rows_of(inp, idx)
        trainer = self._logp_under(self.kept.params, sub)                             # [b, T]
        self.kept = None
        m = sub.response_mask
        gap = (behav_logp[idx] - trainer).abs()
        return {"rollout/logp_gap_check_rows": float(idx.numel()),
                "rollout/logp_gap_check_max": float(torch.where(m.bool(), gap, 0.0).max()),
                "rollout/logp_gap_check_mean": ppo.masked_mean(gap, m).item(),
                "rollout/logp_gap_check_age": float(step - v),
                "rollout/logp_gap_check_missed": float(self.missed)}

    def _logp_under(self, params: list[torch.Tensor], sub: PackedInputs) -> torch.Tensor:
        """Log-probs [b, T] of `sub` with `params` in the actor, the current parameters restored after."""
        current = list(self.actor.parameters())
        saved = [p.detach().clone() for p in current]
        try:
            with torch.no_grad():
                for p, old in zip(current, params):
                    p.copy_(old.to(p.device))
            logp, _ = forward_logp_entropy(self.actor, sub, temperature=self.temperature,
                                           micro_batch_size=sub.labels.shape[0], kernels=self.kernels)
        finally:
            with torch.no_grad():
                for p, now in zip(current, saved):
                    p.copy_(now)
        return logp * sub.response_mask
