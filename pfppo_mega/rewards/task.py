"""The built-in task's verifier as a RewardFn (data.source = task): `AdditionTask.reward` on each
sample, through the guard every reward function goes through (rewards/base.py)."""

from __future__ import annotations

from pfppo_mega.rewards.base import OutcomeLog, call_guarded, result_of
from pfppo_mega.tasks.addition import DATA_SOURCE, AdditionProblem, AdditionTask
from pfppo_mega.types import RewardResult


class AdditionReward:
    """Exact sum in the task's form + EOS -> 1, else 0; a raising or non-finite call is counted."""

    def __init__(self, task: AdditionTask, *, log=print):
        self.task = task
        self.outcomes = OutcomeLog(log, f"{DATA_SOURCE} reward")

    def __call__(self, samples, texts, finished) -> RewardResult:
        calls = [call_guarded(self.task.reward, AdditionProblem(s.extra_info["a"], s.extra_info["b"]), text, bool(f))
                 for s, text, f in zip(samples, texts, finished)]
        return result_of(calls, samples, texts, self.outcomes)

    def check(self, samples, where: str) -> None:  # the task's own samples only (data.source = task)
        pass

    def close(self) -> None:
        pass
