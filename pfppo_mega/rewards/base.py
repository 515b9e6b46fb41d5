"""The one guard every reward function goes through, and the in-process implementations.

Each sample's call ends in one outcome (pfppo_mega.types.REWARD_OUTCOMES):
    ok               a finite real number (a dict's "score")         -> that score
    reward_errors    it raised, or returned None / a non-number       -> 0.0
    bad_rewards      NaN or +-inf                                     -> 0.0
    reward_timeouts  it ran past reward.timeout_s (custom functions)  -> 0.0
The first sample of each bad outcome is logged with its row, prompt and response, once per run;
the trainer counts the outcomes per step in guard/<outcome>.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from pfppo_mega.rewards.rules import (CODE_DATA_SOURCES, DATA_SOURCE_PREFIX_SCORERS, DATA_SOURCE_SCORERS, SCORERS,
                                      scorer_name)
from pfppo_mega.rewards.worker import as_score
from pfppo_mega.types import RewardResult, Sample


class RewardSetupError(ValueError):
    """A reward configuration that cannot score the data; refused at start with the row / key."""


class OutcomeLog:
    """Logs the first sample of each bad outcome, once."""

    def __init__(self, log: Callable[[str], None], name: str):
        self.log, self.name = log, name
        self._logged: set[str] = set()

    def once(self, outcome: str, detail: str, sample: Sample, text: str) -> None:
        if outcome in self._logged:
            return
        self._logged.add(outcome)
        self.log(f"[pfppo] {self.name}: {detail} on sample {sample.row or '?'} (data_source "
                 f"{sample.data_source!r}, prompt {sample.prompt_text[-200:]!r}, response {text[:200]!r}) "
                 f"(scored 0 and counted in guard/{outcome}; logged once)")


FLOAT32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max: scores become float32 tensors


def judge(kind: str, payload: Any) -> tuple[float, str, str]:
    """(score, outcome, detail) of one call's result as `worker.as_score` / an exception gave it."""
    if kind == "raised":
        return 0.0, "reward_errors", f"raised {payload}"
    if kind == "type":
        return 0.0, "reward_errors", f"returned {payload} (not a number, nor a dict with a numeric 'score')"
    if kind == "timeout":
        return 0.0, "reward_timeouts", f"ran longer than reward.timeout_s ({payload} s)"
    if kind == "died":
        return 0.0, "reward_errors", f"killed its worker process ({payload})"
    if not math.isfinite(payload):
        return 0.0, "bad_rewards", f"returned {payload}"
    if abs(payload) > FLOAT32_MAX:  # finite here, inf once the trainer holds it (float32)
        return 0.0, "bad_rewards", f"returned {payload!r}, beyond float32's range (+-{FLOAT32_MAX:.4g}) the trainer " \
                                   f"computes rewards in"
    return payload, "ok", ""


def unusable_ground_truth(gt: Any) -> str:
    """'' when a rule-based scorer can compare with ``gt``, else what is wrong with it."""
    if gt is None:
        return "missing (no value at data.ground_truth_key)"
    if isinstance(gt, bool) or not isinstance(gt, (str, int, float)):
        return f"is a {type(gt).__name__} ({str(gt)[:60]!r}), not a string or a number"
    if isinstance(gt, float) and not math.isfinite(gt):
        return f"is {gt} (not a finite number)"
    if isinstance(gt, str) and not gt.strip():
        return "is an empty string"
    return ""


def call_guarded(fn: Callable[..., Any], *args: Any) -> tuple[str, Any]:
    """Run an in-process scorer: ("value", float) / ("type", repr) / ("raised", message)."""
    try:
        return as_score(fn(*args))
    except Exception as e:  # any failure of a scorer is a counted outcome, never a crash
        return "raised", f"{type(e).__name__}: {e}"[:500]


def result_of(calls: Sequence[tuple[str, Any]], samples: Sequence[Sample], texts: Sequence[str],
              log: OutcomeLog) -> RewardResult:
    scores, outcomes = [], []
    for (kind, payload), sample, text in zip(calls, samples, texts):
        score, outcome, detail = judge(kind, payload)
        if outcome != "ok":
            log.once(outcome, detail, sample, text)
        scores.append(score)
        outcomes.append(outcome)
    return RewardResult(torch.tensor(scores, dtype=torch.float32), outcomes)


class RuleReward:
    """The rule-based registry: each sample is scored by its data_source's scorer
    (`rules.DATA_SOURCE_SCORERS`, else `default_scorer`); with `code` (reward.sandbox_fusion.url), a
    row of a code data_source (`rules.CODE_DATA_SOURCES`) by running its response's code on its test
    cases (rewards/sandbox_fusion.py), the batch's code rows at once."""

    def __init__(self, *, default_scorer: str | None = None, code: Callable[..., list] | None = None,
                 log: Callable[[str], None] = print):
        self.default_scorer, self.code = default_scorer, code
        self.outcomes = OutcomeLog(log, "rule-based reward")

    def _runs_code(self, s: Sample) -> bool:
        return self.code is not None and s.data_source in CODE_DATA_SOURCES

    def check(self, samples: Sequence[Sample], where: str) -> None:
        """Refuse (naming the first row) a data_source that no scorer covers, or a ground truth a
        rule-based scorer cannot use (absent, or not a string / finite number: it would read str(gt)
        and score every correct answer 0); a code row's ground truth must hold its test cases."""
        for s in samples:
            if self._runs_code(s):
                from pfppo_mega.rewards.sandbox_fusion import parse_test_cases
                try:
                    parse_test_cases(s.ground_truth)
                except ValueError as e:
                    raise RewardSetupError(
                        f"{where}: row {s.row} (data_source {s.data_source!r}): the ground truth {e}; a code row's "
                        f"ground truth holds its test cases, {{\"inputs\": [...], \"outputs\": [...]}} (verl's code "
                        f"datasets), read at data.ground_truth_key") from None
                continue
            why = unusable_ground_truth(s.ground_truth)
            if why:
                raise RewardSetupError(
                    f"{where}: row {s.row} (data_source {s.data_source!r}): ground truth {why}; the rule-based "
                    f"scorers compare the answer with a string or a number (data.ground_truth_key names where it "
                    f"is read, default reward_model.ground_truth)")
            if scorer_name(s.data_source, self.default_scorer) is None:
                code = (f"; a code data_source ({', '.join(CODE_DATA_SOURCES)}) is scored by running its tests "
                        f"through reward.sandbox_fusion.url" if s.data_source in CODE_DATA_SOURCES else "")
                raise RewardSetupError(
                    f"{where}: row {s.row} has data_source {s.data_source!r}, which no rule-based scorer "
                    f"covers (known: {sorted(DATA_SOURCE_SCORERS)} and {sorted(p + '*' for p in DATA_SOURCE_PREFIX_SCORERS)}); set reward.default_scorer (one of "
                    f"{sorted(SCORERS)}) or reward.custom_function{code}")

    def __call__(self, samples: Sequence[Sample], texts: Sequence[str], finished: Sequence[bool]) -> RewardResult:
        calls: list[tuple[str, Any]] = []
        for s, text in zip(samples, texts):
            name = scorer_name(s.data_source, self.default_scorer)
            if self._runs_code(s):
                calls.append(("code", None))  # filled below, the batch's code rows in one go
            elif name is None:
                calls.append(("raised", f"no scorer for data_source {s.data_source!r}"))
            else:
                calls.append(call_guarded(SCORERS[name], text, s.ground_truth))
        code_rows = [i for i, c in enumerate(calls) if c[0] == "code"]
        if code_rows:
            for i, res in zip(code_rows, self.code([texts[i] for i in code_rows],
                                                   [samples[i].ground_truth for i in code_rows])):
                calls[i] = res
        return result_of(calls, samples, texts, self.outcomes)

    def close(self) -> None:
        pass
