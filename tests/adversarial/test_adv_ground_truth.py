"""A ground truth the rule-based scorers cannot use (missing, a wrong data.ground_truth_key, a list,
dict, bool or NaN) is refused at start naming the file and row (issue 24.3): the gsm8k / math
scorers read str(gt), so every correct answer used to score 0 and training ran on."""

import random

import pytest

from pfppo_mega.config import load_config_dict
from pfppo_mega.data import build_prompt_data
from pfppo_mega.data.examples import write_example
from pfppo_mega.data.files import read_rows
from pfppo_mega.rewards import build_reward_fn
from pfppo_mega.rewards.base import RewardSetupError, RuleReward
from pfppo_mega.tokenizer import Tokenizer
from pfppo_mega.types import Sample


@pytest.mark.parametrize("gt,why", [
    (None, r"ground truth missing \(no value at data.ground_truth_key\)"),
    (["72"], r"ground truth is a list \(\"\['72'\]\"\), not a string or a number"),
    ({"answer": "72"}, r"ground truth is a dict"),
    (True, r"ground truth is a bool"),
    (float("nan"), r"ground truth is nan \(not a finite number\)"),
    ("  ", r"ground truth is an empty string"),
])
def test_an_unusable_ground_truth_is_refused_by_row(gt, why):
    rows = [Sample((1,), "openai/gsm8k", "72", row="train.jsonl:0"),
            Sample((1,), "openai/gsm8k", gt, row="train.jsonl:1")]
    with pytest.raises(RewardSetupError, match=rf"data: row train.jsonl:1 \(data_source 'openai/gsm8k'\): {why}"):
        RuleReward().check(rows, "data")


@pytest.mark.parametrize("gt", ["72", 72, 7.5, "\\frac{1}{2}"])
def test_strings_and_finite_numbers_pass(gt):
    RuleReward().check([Sample((1,), "openai/gsm8k", gt, row="f:0")], "data")


def test_a_wrong_ground_truth_key_is_refused_at_start(tmp_path):
    """Through the real loader: data.ground_truth_key pointing at nothing."""
    paths = write_example(tmp_path, n_train=8, n_test=4, seed=0, vocab_size=512)
    rows = read_rows(paths["train.jsonl"], "k")
    assert rows[0]["reward_model"]["ground_truth"]  # the rows are fine: only the key is wrong
    cfg = load_config_dict({"actor_rollout": {"model_path": str(paths["tokenizer"])},
                            "data": {"source": "files", "train_files": str(paths["train.jsonl"]),
                                     "ground_truth_key": "reward_model.answer", "max_prompt_length": 256}})
    tok = Tokenizer.from_dir(paths["tokenizer"])
    data = build_prompt_data(cfg, tok, model_dir=paths["tokenizer"], rng=random.Random(0), log=lambda *_: None)
    with pytest.raises(RewardSetupError, match=r"train.jsonl:\d+ \(data_source .*\): ground truth missing"):
        build_reward_fn(cfg, log=lambda *_: None).check(data.train_rows + data.val, "data")
