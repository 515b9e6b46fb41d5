"""The one place a reward function's output is checked: a bad sample never ends or poisons a run.

For each sample the function is called once; the outcome is one of
    ok          a finite real number                       -> that score
    error       it raised, or returned None / a non-number  -> 0.0, counted in `errors`
    non-finite  NaN or +-inf                                -> 0.0, counted in `nonfinite`
The first error and the first non-finite value of a guard's life are logged with the sample, once
each (the counts go to the guard/* metrics every step). Training and evaluation share it; a
reward function run in a worker process with a timeout can reuse `RewardGuard.score_one`.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch


@dataclass
class GuardedScores:
    scores: torch.Tensor  # [B] float32, finite
    errors: int           # raised / None / not a number
    nonfinite: int        # NaN / inf


class RewardGuard:
    def __init__(self, fn: Callable[..., Any], *, log: Callable[[str], None], name: str = "reward"):
        self.fn = fn
        self.log = log
        self.name = name
        self._logged: set[str] = set()

    def _once(self, kind: str, msg: str) -> None:
        if kind not in self._logged:
            self._logged.add(kind)
            self.log(f"[pfppo] {msg} (scored 0 and counted in guard/{kind}; logged once)")

    def score_one(self, args: Sequence[Any]) -> tuple[float, str]:
        """(score, outcome) with outcome 'ok', 'reward_errors' or 'bad_rewards'."""
        try:
            value = self.fn(*args)
        except Exception as e:  # any failure of user/task code is a guarded outcome, not a crash
            self._once("reward_errors", f"{self.name} function raised {type(e).__name__}: {e} on sample {args!r}")
            return 0.0, "reward_errors"
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if not isinstance(value, numbers.Real):  # None, str, list ... (bool counts as 0 / 1)
            self._once("reward_errors", f"{self.name} function returned {value!r} (not a number) on sample "
                                        f"{args!r}")
            return 0.0, "reward_errors"
        value = float(value)
        if not math.isfinite(value):
            self._once("bad_rewards", f"{self.name} function returned {value} on sample {args!r}")
            return 0.0, "bad_rewards"
        return value, "ok"

    def __call__(self, samples: Sequence[Sequence[Any]]) -> GuardedScores:
        scores, errors, nonfinite = [], 0, 0
        for args in samples:
            v, outcome = self.score_one(args)
            scores.append(v)
            errors += outcome == "reward_errors"
            nonfinite += outcome == "bad_rewards"
        return GuardedScores(torch.tensor(scores, dtype=torch.float32), errors, nonfinite)
