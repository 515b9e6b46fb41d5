"""Bad rewards through the real trainer: a reward function that returns NaN, +-inf, None, a string,
a tensor, or raises, under plain PPO, policy filtration (each verl method), reward-weighted
snapshot sampling and both reward z-scores, and in evaluation. Each must be guarded and counted
(scored 0; guard/bad_rewards for NaN / inf, guard/reward_errors for raised / None / not a number),
never a traceback and never a silent NaN.

Table-driven. ``outcome(case, sft_dir, out_dir)`` runs one case in this process under a wall-clock
alarm and classifies what happens:

    guarded    the step (or evaluation) finishes, every metric checked is finite and the guard
               counters grew by exactly the number of bad rewards
    silent     it finishes, but a metric is NaN / inf or the bad rewards were not counted
    traceback  an exception escaped
    hang       still running when the alarm fires

`python tests/adversarial/test_adv_rewards_trainer.py` prints the count per class (run it with
PYTHONPATH pointing at an older tree for the "before" column of issue 8). Only public trainer
APIs are used (PPOTrainer, train_step, evaluate, the task's reward function).
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from pfppo_mega.config import load_config_dict
from pfppo_mega.sft import run_sft
from pfppo_mega.trainer.loop import PPOTrainer

TIMEOUT_S = 120
ROWS = 16  # rollout rows per step; every other row gets the bad reward

TINY = {
    "model": {"num_layers": 1, "hidden_size": 32, "ffn_hidden_size": 64, "num_attention_heads": 2,
              "num_query_groups": 1, "vocab_size": 16, "max_position_embeddings": 24,
              "rope_theta": 10000.0, "norm_epsilon": 1e-5, "tie_word_embeddings": False},
    "data": {"num_digits": 1, "eval_size": 8, "max_prompt_length": 8},
    "training": {"rollout_batch_size": ROWS, "batch_size": ROWS, "lr": 3e-4, "total_training_steps": 1,
                 "seed": 4, "num_threads": 1},
    "algorithm": {"max_response_length": 4},
    "logging": {"eval_interval": 0, "tensorboard": False, "plots": False, "progress": False},
    "checkpoint": {"export_hf": False, "resume": False},
    "sft": {"steps": 10, "batch_size": 16, "max_seconds": 0},
}

# What the reward function returns for the bad rows: (name, value or exception, counter it goes to)
BAD = (
    ("nan", float("nan"), "bad_rewards"),
    ("inf", float("inf"), "bad_rewards"),
    ("-inf", float("-inf"), "bad_rewards"),
    ("tensor_nan", "tensor_nan", "bad_rewards"),
    ("none", None, "reward_errors"),
    ("string", "1.0", "reward_errors"),
    ("list", [1.0], "reward_errors"),
    ("raises", ZeroDivisionError("reward crashed"), "reward_errors"),
)

# Trainer settings under which the bad rewards arrive (sections merged into TINY).
SETTINGS = {
    "ppo": {},
    "filtration_pow": {"algorithm": {"filtration": {"enable": True, "reweight_method": "pow"}}},
    "filtration_max_min": {"algorithm": {"filtration": {"enable": True, "reweight_method": "max_min"}},
                           "reward": {"scaling": "batch_zscore"}},
    "pool_reward_sampling": {"algorithm": {"use_pf_ppo": True, "pool": {"pool_size": 2, "snapshot_interval": 1,
                                                                       "sampling": "reward"}}},
    "pool_and_filtration_running": {
        "algorithm": {"use_pf_ppo": True, "pool": {"pool_size": 2, "snapshot_interval": 1, "sampling": "reward"},
                      "filtration": {"enable": True, "reweight_method": "max_random"}},
        "reward": {"scaling": "running_zscore"}},
}


@dataclass(frozen=True)
class Case:
    setting: str
    bad: str
    phase: str  # "train": two steps; "eval": evaluate()

    @property
    def id(self) -> str:
        return f"{self.phase}-{self.setting}-{self.bad}"


CASES = ([Case(s, b[0], "train") for s in SETTINGS for b in BAD]
         + [Case("ppo", b[0], "eval") for b in BAD])


def _merge(base: dict, extra: dict) -> dict:
    out = json.loads(json.dumps(base))
    for sec, vals in extra.items():
        node = out.setdefault(sec, {})
        for k, v in vals.items():
            if isinstance(v, dict):
                node.setdefault(k, {}).update(v)
            else:
                node[k] = v
    return out


def _reward_fn(bad: str):
    """Every other call returns the bad value (or raises); the others score the real answer."""
    value = next(v for name, v, _ in BAD if name == bad)
    state = {"n": 0, "bad": 0}

    def reward(p, text, finished):
        state["n"] += 1
        if state["n"] % 2:
            return 1.0 if finished and text == p.answer else 0.0
        state["bad"] += 1
        if isinstance(value, BaseException):
            raise value
        if value == "tensor_nan":
            return torch.tensor(float("nan"))
        return value
    return reward, state


@dataclass
class Result:
    outcome: str
    detail: str = ""
    metrics: dict = field(default_factory=dict)


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def outcome(case: Case, sft_dir: Path, out_dir: Path) -> Result:
    d = _merge(TINY, SETTINGS[case.setting])
    d["actor_rollout"] = {"model_path": str(sft_dir)}
    d["logging"]["output_dir"] = str(out_dir)
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(TIMEOUT_S)
    try:
        tr = PPOTrainer(load_config_dict(d), log=lambda *_: None)
        fn, state = _reward_fn(case.bad)
        tr.run.reward_fn.task.reward = fn
        counter = next(c for name, _, c in BAD if name == case.bad)
        if case.phase == "train":
            metrics = {}
            for _ in range(2):
                metrics = tr.train_step()
            checked = {k: metrics[k] for k in ("reward/mean", "policy/pg_loss", "critic/value_loss",
                                               "policy/grad_norm") if k in metrics}
        else:
            checked = tr.evaluate()
            metrics = dict(checked)
        counted = tr.run.state.guards.get(counter, 0)
        if not all(math.isfinite(v) for v in checked.values()):
            return Result("silent", f"non-finite metrics {checked}", metrics)
        if counted != state["bad"]:
            return Result("silent", f"{state['bad']} bad rewards, guard/{counter} = {counted}", metrics)
        if case.phase == "train" and metrics.get(f"guard/{counter}") != float(state["bad"]):
            return Result("silent", f"metric guard/{counter} = {metrics.get(f'guard/{counter}')}", metrics)
        return Result("guarded", f"{state['bad']} counted in guard/{counter}", metrics)
    except _Timeout:
        return Result("hang", f"> {TIMEOUT_S}s")
    except Exception as e:  # noqa: BLE001 - classifying is the point
        return Result("traceback", f"{type(e).__name__}: {e}")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def make_sft(out: Path) -> Path:
    d = json.loads(json.dumps(TINY))
    d["sft"]["output_dir"] = str(out)
    d["actor_rollout"] = {"model_path": str(out)}
    run_sft(load_config_dict(d), log=lambda *_: None)
    return out


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory):
    return make_sft(tmp_path_factory.mktemp("adv_rewards_sft"))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_reward_is_guarded_and_counted(case, sft_dir, tmp_path):
    res = outcome(case, sft_dir, tmp_path)
    assert res.outcome == "guarded", (case.id, res.outcome, res.detail)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.parse_args(argv)
    torch.set_num_threads(1)
    counts: dict[str, dict[str, int]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        sft = make_sft(Path(tmp) / "sft")
        for i, case in enumerate(CASES):
            res = outcome(case, sft, Path(tmp) / f"run{i}")
            group = f"{case.phase}:{case.setting}"
            counts.setdefault(group, {}).setdefault(res.outcome, 0)
            counts[group][res.outcome] += 1
            print(f"{case.id:50s} {res.outcome:9s} {res.detail[:110]}", flush=True)
    total: dict[str, int] = {}
    for group, c in counts.items():
        print(f"{group:40s} " + ", ".join(f"{k} {v}" for k, v in sorted(c.items())))
        for k, v in c.items():
            total[k] = total.get(k, 0) + v
    print(f"{'TOTAL (' + str(len(CASES)) + ' cases)':40s} " + ", ".join(f"{k} {v}" for k, v in sorted(total.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())


@pytest.mark.parametrize("bad", ["list", "raises", "none"])
def test_a_reward_that_fails_on_every_row_halts_by_name(bad, sft_dir, tmp_path):
    """Issue 40's sweep: a reward function that fails on every row (returns a list or a tuple instead of
    a number, raises) scored every row 0 with one log line per kind, and the run trained on zeros to
    the end, exit 0. Now the step halts (pfppo train exits non-zero with the message)."""
    from pfppo_mega.trainer.update import TrainingHalted

    d = json.loads(json.dumps(TINY))
    d["actor_rollout"] = {"model_path": str(sft_dir)}
    d["logging"]["output_dir"] = str(tmp_path)
    tr = PPOTrainer(load_config_dict(d), log=lambda *_: None)
    value = next(v for name, v, _ in BAD if name == bad)

    def always_bad(p, text, finished):
        if isinstance(value, BaseException):
            raise value
        return value
    tr.run.reward_fn.task.reward = always_bad
    with pytest.raises(TrainingHalted, match=rf"reward: every one of the {ROWS} reward calls of step 0 failed "
                                             rf"\(raised, returned no number, or killed its worker.*\): no row "
                                             rf"carries a reward"):
        tr.train_step()
    assert tr.run.state.step == 0  # nothing was updated
