"""Rule-based scorers (GSM8K, boxed math, verl's "Answer:" rule, exact match), the per-data_source registry, the shared
reward guard, and a user's function in worker processes (exceptions, hangs, wrong types, dying
workers: scored 0, counted, logged once, never a hang)."""

import time
from pathlib import Path

import pytest
import torch

from pfppo_mega import constants as C
from pfppo_mega.rewards import build_reward_fn
from pfppo_mega.rewards.base import RewardSetupError, RuleReward
from pfppo_mega.rewards.custom import CustomReward
from pfppo_mega.rewards.rules import (SCORERS, exact_match_score, extract_answer, gsm8k_score, last_boxed,
                                      math_dapo_score, math_score, normalize_dapo, normalize_math, scorer_name)
from pfppo_mega.types import RewardFn, Sample


def _s(ds, gt, i=0):
    return Sample(prompt_ids=(1,), data_source=ds, ground_truth=gt, row=f"t.jsonl:{i}")


def test_registry_names_match_the_config_choices():
    assert tuple(SCORERS) == C.REWARD_SCORERS


@pytest.mark.parametrize("text, gt, want", [
    ("3 + 4 = 7\n#### 7", "7", 1.0),
    ("#### 1,234", "1234", 1.0),
    ("#### $12", "12", 1.0),
    ("first #### 5 then #### 6", "6", 1.0),     # the last marker counts
    ("#### 6.0", "6", 1.0),                     # compared as numbers
    ("#### -3", "-3", 1.0),
    ("the answer is 7", "7", 0.0),              # no marker
    ("#### 8", "7", 0.0),
    ("#### 7", "worked solution ...\n#### 7", 1.0),  # a GSM8K solution as ground truth
])
def test_gsm8k(text, gt, want):
    assert gsm8k_score(text, gt) == want


@pytest.mark.parametrize("text, gt, want", [
    (r"so \boxed{42}", "42", 1.0),
    (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
    (r"\boxed{\dfrac12}", r"\frac{1}{2}", 1.0),
    (r"\boxed{2/4}", r"\frac12", 1.0),
    (r"\boxed{ \left( 1 , 2 \right) }", "(1,2)", 1.0),
    (r"\boxed{90^\circ}", "90", 1.0),
    (r"\boxed{\text{5 apples}}", r"\boxed{5apples}", 1.0),
    (r"\boxed{x = 3}", "3", 1.0),
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt{3}}{2}", 1.0),
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt{2}}{2}", 0.0),
    (r"\boxed{3}", "4", 0.0),
    (r"\boxed{3", "3", 0.0),                    # unclosed
    ("42", "42", 0.0),                          # no box
    (r"\boxed{1} then \boxed{2}", "2", 1.0),
])
def test_math(text, gt, want):
    assert math_score(text, gt) == want


def test_math_helpers():
    assert last_boxed(r"a \boxed{\frac{a}{b}} b") == r"\frac{a}{b}"
    assert last_boxed(r"\boxed 5$") == "5"
    assert normalize_math(r"\frac{6}{4}") == normalize_math("1.5") == "3/2"


# verl's "Answer: X" rule (math_dapo / aime*), hand-made cases of each step of its normalisation.
@pytest.mark.parametrize("text, gt, want", [
    ("so the Answer: 42", "42", 1.0),
    ("Answer: 41", "42", -1.0),                                  # wrong: -1, not 0
    (r"\boxed{42}", "42", -1.0),                                 # no "Answer:": nothing extracted
    ("Answer: 5\nwait, Answer: 6", "6", 1.0),                    # the last one counts
    ("answer :   7  ", "7", 1.0),                                # any case, spaces around the colon
    ("Answer: 7\nand more text", "7", 1.0),                      # to the end of its line
    ("Answer: x = 12", "12", 1.0),                               # what follows the last "="
    ("Answer: 1,234", "1234", 1.0),                              # digit groups
    ("Answer: 5 cm", "5", 1.0), ("Answer: 90^\\circ", "90", 1.0),  # units and degrees deleted
    ("Answer: 12 dollars", "12", 1.0),
    ("Answer: a 5", "5", 1.0),                                   # "a " and "an " dropped
    ("Answer: $\\frac12$", "\\frac{1}{2}", 1.0),                 # \fracab braced, $ dropped
    ("Answer: \\sqrt2", "\\sqrt{2}", 1.0),
    ("Answer: \\text{(B)}", "(B)", 1.0),                         # \text{} unwrapped
    ("Answer: \\boxed{3}", "3", 1.0),
    ("Answer: 1/2", "0.5", -1.0),                                # no numeric equivalence
    ("Answer: 3" + "x" * 400, "3", -1.0),                        # only the last 300 characters are read
    ("x" * 400 + "Answer: 3", "3", 1.0),
])
def test_math_dapo(text, gt, want):
    assert math_dapo_score(text, gt) == want


def test_math_dapo_helpers():
    assert extract_answer("no marker") == "[INVALID]"
    assert normalize_dapo("The answer = 1,000 units") == "1000"
    assert normalize_dapo("pizza and a cake") == "pizzandcake"  # verl's literal rewrites, kept as they are
    assert normalize_dapo("is $5$ here and $6$") == "5"


def test_exact_match():
    assert exact_match_score("  yes\n", "yes") == 1.0 and exact_match_score("Yes", "yes") == 0.0


def test_rule_reward_routes_by_data_source_and_refuses_unknown():
    r = RuleReward()
    assert isinstance(r, RewardFn)
    samples = [_s("openai/gsm8k", "7"), _s("lighteval/MATH", "7"), _s("exact_match", "7")]
    res = r(samples, ["#### 7", r"\boxed{7}", "7"], [True] * 3)
    assert res.scores.tolist() == [1.0, 1.0, 1.0] and res.outcomes == ["ok"] * 3
    res = r(samples, [r"\boxed{7}", "#### 7", "#### 7"], [True] * 3)
    assert res.scores.tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(RewardSetupError, match=r"row t.jsonl:0 has data_source 'my/set'.*default_scorer"):
        r.check([_s("my/set", "1")], "data.train_files")
    RuleReward(default_scorer="gsm8k").check([_s("my/set", "1")], "data.train_files")


def test_math_dapo_and_aime_sources_use_the_answer_rule_as_in_verl():
    # verl scores math_dapo and every aime* source with the "Answer:" rule (+1 / -1); `aime` used to be
    # boxed here (verl parity changed it); our `math` keeps the boxed rule.
    r = RuleReward()
    samples = [_s("math_dapo", "7"), _s("aime", "7"), _s("aime2024", "7"), _s("aime_2025", "7"), _s("math", "7")]
    assert r(samples, ["Answer: 7"] * 5, [True] * 5).scores.tolist() == [1.0, 1.0, 1.0, 1.0, 0.0]
    assert r(samples, [r"\boxed{7}"] * 5, [True] * 5).scores.tolist() == [-1.0, -1.0, -1.0, -1.0, 1.0]
    r.check([_s("aime2024", "1")], "data.train_files")
    assert scorer_name("aime_anything", None) == "math_dapo" and scorer_name("ai", None) is None


USER = '''
import os, time
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "raise":
        raise RuntimeError("user bug")
    if solution_str == "hang":
        time.sleep(60)
    if solution_str == "none":
        return None
    if solution_str == "nan":
        return float("nan")
    if solution_str == "die":
        os._exit(3)
    if solution_str == "dict":
        return {"score": 0.5, "acc": True}
    if solution_str == "extra":
        return float(extra_info["bonus"])
    return float(solution_str == str(ground_truth))

def two_args(a, b):
    return 1.0

not_callable = 3
'''


@pytest.fixture(scope="module")
def user_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("user") / "my_reward.py"
    p.write_text(USER)
    return p


def test_custom_function_in_workers_guards_every_failure(user_file):
    logs = []
    r = CustomReward(str(user_file), "compute_score", num_workers=2, timeout_s=1.0, log=logs.append)
    assert len(logs) == 1 and "own session" in logs.pop()  # what each worker's sandbox applied, said once
    try:
        texts = ["42", "raise", "hang", "none", "nan", "die", "dict", "41", "extra"]
        samples = [Sample((1,), "x", "42", {"bonus": 0.25} if t == "extra" else {}, row=f"f:{i}")
                   for i, t in enumerate(texts)]
        t0 = time.monotonic()
        res = r(samples, texts, [True] * len(texts))
        took = time.monotonic() - t0
        assert res.scores.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.0, 0.25]
        assert res.outcomes == ["ok", "reward_errors", "reward_timeouts", "reward_errors", "bad_rewards",
                                "reward_errors", "ok", "ok", "ok"]
        assert (res.errors, res.nonfinite, res.timeouts) == (3, 1, 1)
        assert took < 30, took  # one 1 s timeout + worker restarts, never the 60 s sleep
        # logged once per kind, with the sample's row
        assert len(logs) == 3 and any("f:2" in m and "reward_timeouts" in m for m in logs)
        # the pool is whole again: a second batch scores normally
        again = r(samples[:1] + samples[6:7], ["42", "dict"], [True, True])
        assert again.scores.tolist() == [1.0, 0.5] and len(logs) == 3
    finally:
        r.close()


@pytest.mark.parametrize("name, match", [
    ("two_args", r"signature two_args\(a, b\) cannot be called"),
    ("nope", r"defines no 'nope'"),
    ("not_callable", r"'not_callable' is a int, not a function"),
])
def test_custom_function_refused_at_start(user_file, name, match):
    with pytest.raises(RewardSetupError, match=match):
        CustomReward(str(user_file), name, num_workers=1, timeout_s=1.0)


def test_custom_function_file_problems(tmp_path):
    with pytest.raises(RewardSetupError, match="no such file"):
        CustomReward(str(tmp_path / "missing.py"), "f", num_workers=1, timeout_s=1.0)
    bad = tmp_path / "broken.py"
    bad.write_text("import not_a_module_anywhere\n")
    with pytest.raises(RewardSetupError, match=r"broken.py.*importing the file raised ModuleNotFoundError"):
        CustomReward(str(bad), "f", num_workers=1, timeout_s=1.0)


def test_build_reward_fn_picks_the_configured_implementation(user_file):
    from pfppo_mega.config import load_config_dict
    base = {"actor_rollout": {"model_path": "/x"}}
    assert type(build_reward_fn(load_config_dict(base))).__name__ == "AdditionReward"
    files = {**base, "data": {"source": "files", "train_files": ["a.jsonl"]}}
    r = build_reward_fn(load_config_dict({**files, "reward": {"default_scorer": "math"}}))
    assert isinstance(r, RuleReward) and r.default_scorer == "math"
    r = build_reward_fn(load_config_dict({**files, "reward": {"custom_function": {"path": str(user_file)},
                                                               "num_workers": 1}}))
    try:
        assert isinstance(r, CustomReward)
        assert r([_s("any", "3")], ["3"], [True]).scores.tolist() == [1.0]
    finally:
        r.close()


def test_addition_reward_goes_through_the_same_guard():
    from pfppo_mega.rewards.task import AdditionReward
    from pfppo_mega.tasks.addition import AdditionProblem, AdditionTask, to_sample
    from pfppo_mega.tokenizer import char_tokenizer
    task = AdditionTask(2)
    logs = []
    r = AdditionReward(task, log=logs.append)
    s = [to_sample(AdditionProblem(12, 30), char_tokenizer())] * 3
    assert r(s, ["42", "42", "41"], [True, False, True]).scores.tolist() == [1.0, 0.0, 0.0]
    task.reward = lambda p, text, finished: torch.tensor(float("nan"))
    res = r(s, ["42"] * 3, [True] * 3)
    assert res.nonfinite == 3 and torch.isfinite(res.scores).all() and len(logs) == 1


class _ConstantScorer:
    """A RewardFn standing in for a reward model's part: a fixed score per row, no honest metric."""

    def __init__(self, scores):
        self.scores = scores

    def __call__(self, samples, texts, finished):
        from pfppo_mega.types import RewardResult
        return RewardResult(torch.tensor(self.scores, dtype=torch.float32), ["ok"] * len(samples))

    def check(self, samples, where):
        pass

    def close(self):
        pass


@pytest.mark.parametrize("kind,texts,honest,hacked", [
    # phrase "11" pays 5 whatever the answer: row 1 ("11", wrong) is hacked
    ("phrase_exploit", ["42", "11", "41"], [1.0, 0.0, 0.0], [False, True, False]),
    # 0.5 per character: row 2 ("4100", wrong and longer than "42") is hacked
    ("length_bias", ["42", "4", "4100"], [1.0, 0.0, 0.0], [False, False, True]),
])
def test_weighted_reward_carries_the_shaped_scorers_honest_and_hacked(kind, texts, honest, hacked):
    """rule_weight * shaped rule score + model_weight * model score: the sum is trained on, and the
    rule scorer's honest score and hacked marks come through unweighted (they were dropped before,
    so reward/honest and eval/honest_accuracy vanished when a reward model joined reward.shaping)."""
    from pfppo_mega.rewards.model import WeightedReward
    from pfppo_mega.rewards.shaping import ShapedReward
    from pfppo_mega.rewards.task import AdditionReward
    from pfppo_mega.tasks.addition import AdditionProblem, AdditionTask, to_sample
    from pfppo_mega.tokenizer import char_tokenizer

    rows = [to_sample(AdditionProblem(12, 30), char_tokenizer())] * 3
    rule = ShapedReward(AdditionReward(AdditionTask(2)), kind=kind, length_bonus=0.5, phrase="11",
                        phrase_score=5.0, flip_rate=0.0, scale=1.0, seed=1)
    alone = rule(rows, texts, [True] * 3)
    assert alone.honest.tolist() == honest and alone.hacked.tolist() == hacked
    fn = WeightedReward([(0.5, rule), (2.0, _ConstantScorer([0.25, -1.0, 3.0]))])
    assert isinstance(fn, RewardFn)
    res = fn(rows, texts, [True] * 3)
    want = [0.5 * a + 2.0 * b for a, b in zip(alone.scores.tolist(), [0.25, -1.0, 3.0])]
    assert res.scores.tolist() == pytest.approx(want)
    assert res.honest is not None and res.honest.tolist() == honest
    assert res.hacked is not None and res.hacked.tolist() == hacked
    # the order of the parts does not matter, and no shaped part means no honest metric apart
    swapped = WeightedReward([(2.0, _ConstantScorer([0.25, -1.0, 3.0])), (0.5, rule)])(rows, texts, [True] * 3)
    assert swapped.honest.tolist() == honest and swapped.hacked.tolist() == hacked
    plain = WeightedReward([(1.0, _ConstantScorer([1.0, 2.0, 3.0]))])(rows, texts, [True] * 3)
    assert plain.honest is None and plain.hacked is None
