"""Bad prompt files and reward settings are refused at start with a message naming the file, the
row or the key: never a traceback from deep inside a library, never a silently empty dataset.

Table-driven over the public builders (build_prompt_data, build_reward_fn, RewardFn.check), the
same calls the trainer makes before any model is built.
"""

from __future__ import annotations

import json
import random

import pytest

from pfppo_mega.config import ConfigError, load_config_dict
from pfppo_mega.data import DataError, build_prompt_data
from pfppo_mega.data.examples import train_bpe_tokenizer
from pfppo_mega.rewards import build_reward_fn
from pfppo_mega.rewards.base import RewardSetupError


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    train_bpe_tokenizer(["What is 2 + 2? The answer is 4."] * 4, vocab_size=300).save(d)
    return d


def _row(**kw):
    r = {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "What is 2+2?"}],
         "reward_model": {"ground_truth": "4"}, "extra_info": {}}
    r.update(kw)
    return r


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _load(tok_dir, train, **data):
    from pfppo_mega.tokenizer import Tokenizer
    cfg = load_config_dict({"actor_rollout": {"model_path": str(tok_dir)},
                            "data": {"source": "files", "train_files": train, "max_prompt_length": 64, **data}})
    tok = Tokenizer.from_dir(tok_dir)
    data = build_prompt_data(cfg, tok, model_dir=tok_dir, rng=random.Random(0), log=lambda *_: None)
    reward = build_reward_fn(cfg, log=lambda *_: None)
    try:
        reward.check(data.train_rows + data.val, "data")
    finally:
        reward.close()
    return data


CASES = {
    # name: (files builder(tmp) -> train_files, expected message regex)
    "missing file": (lambda t: [str(t / "nope.parquet")], r"data.train_files '.*nope.parquet': no such file"),
    "unknown extension": (lambda t: [_jsonl(t / "x.csv", [_row()])], r"unknown format '.csv'"),
    "damaged parquet": (lambda t: [str((t / "bad.parquet").write_bytes(b"PAR1 not really") and t / "bad.parquet")],
                        r"bad.parquet': not a readable Parquet file"),
    "binary jsonl": (lambda t: [str((t / "bin.jsonl").write_bytes(b"\xff\xfe\x00") and t / "bin.jsonl")],
                     r"bin.jsonl': cannot be read as UTF-8"),
    "broken json line": (lambda t: [str((t / "b.jsonl").write_text(json.dumps(_row()) + "\n{oops\n") and t / "b.jsonl")],
                         r"b.jsonl' line 2: not valid JSON"),
    "row without prompt": (lambda t: [_jsonl(t / "np.jsonl", [_row(), {"data_source": "openai/gsm8k"}])],
                           r"np.jsonl' row 1: no 'prompt' key \(data.prompt_key"),
    "prompt of wrong shape": (lambda t: [_jsonl(t / "ws.jsonl", [_row(prompt=[{"role": "user"}])])],
                              r"ws.jsonl' row 0: 'prompt' must be a string or a non-empty list"),
    "row not an object": (lambda t: [_jsonl(t / "no.jsonl", [[1, 2]])], r"no.jsonl' row 0: a row must be a JSON object / Parquet record, got list"),
    "empty file": (lambda t: [str((t / "e.jsonl").write_text("") is not None and t / "e.jsonl")],
                   r"no usable prompt: the file\(s\) hold no rows$"),
    # issue 40's sweep: every row dropped as too long was told as "every file empty, or every prompt
    # longer" -- which of the two, and what to do, is now said
    "every prompt too long": (lambda t: [_jsonl(t / "long.jsonl", [_row(prompt="2+2? " * 80)] * 3)],
                              r"long.jsonl'\]: no usable prompt: all 3 row\(s\) are longer than "
                              r"data.max_prompt_length = 64 tokens and data.overlong_prompts = filter dropped them; "
                              r"raise data.max_prompt_length, or cut them"),
    "unknown data_source": (lambda t: [_jsonl(t / "ds.jsonl", [_row(), _row(data_source="my/private_set")])],
                            r"row .*ds.jsonl:1 has data_source 'my/private_set'.*reward.default_scorer"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_data_refused_at_start_naming_it(tok_dir, tmp_path, name):
    files, match = CASES[name]
    with pytest.raises((DataError, RewardSetupError), match=match):
        _load(tok_dir, files(tmp_path))


def test_good_file_loads(tok_dir, tmp_path):
    data = _load(tok_dir, [_jsonl(tmp_path / "ok.jsonl", [_row(), _row()])])
    assert len(data.train.samples) == 2


def test_chat_prompt_without_template_refused(tmp_path):
    from pfppo_mega.tokenizer import Tokenizer, char_tokenizer
    d = tmp_path / "tok"
    d.mkdir()
    char_tokenizer("abcdefghijklmnopqrstuvwxyz?+24 ").save(d)
    with pytest.raises(DataError, match=r"row 0: 'prompt' is a list of chat messages but .* has no chat template \(chat_template.jinja, or chat_template in tokenizer_config.json"):
        _load(d, [_jsonl(tmp_path / "c.jsonl", [_row()])])
    assert Tokenizer.from_dir(d).chat_template is None


def test_config_refuses_inconsistent_data_keys():
    base = {"actor_rollout": {"model_path": "/x"}}
    with pytest.raises(ConfigError, match=r"data.train_files = \[\]: must list at least one file"):
        load_config_dict({**base, "data": {"source": "files"}})
    with pytest.raises(ConfigError, match=r"data.source = 'task': must be files when"):
        load_config_dict({**base, "data": {"train_files": ["a.parquet"]}})
    with pytest.raises(ConfigError, match=r"reward.default_scorer = 'gsm'.*'gsm8k', 'math', 'exact_match'"):
        load_config_dict({**base, "reward": {"default_scorer": "gsm"}})
    with pytest.raises(ConfigError, match=r"reward.custom_function.name = 'my-fn': must be a Python identifier"):
        load_config_dict({**base, "reward": {"custom_function": {"path": "f.py", "name": "my-fn"}}})
    with pytest.raises(ConfigError, match=r"data.train_files = .*item 1: expected str, got int"):
        load_config_dict({**base, "data": {"source": "files", "train_files": ["a.parquet", 3]}})


@pytest.mark.parametrize("body, name, match", [
    ("def f(x):\n    return 1\n", "f", r"signature f\(x\) cannot be called as f\(data_source=..."),
    ("raise SystemExit(2)\n", "f", r"importing the file raised SystemExit"),
    ("x = 1\n", "compute_score", r"defines no 'compute_score'"),
    ("def compute_score(:\n", "compute_score", r"importing the file raised SyntaxError"),
])
def test_custom_function_refused_at_start(tmp_path, body, name, match):
    p = tmp_path / "user_reward.py"
    p.write_text(body)
    cfg = load_config_dict({"actor_rollout": {"model_path": "/x"},
                            "reward": {"custom_function": {"path": str(p), "name": name}, "num_workers": 1}})
    with pytest.raises(RewardSetupError, match=rf"reward.custom_function: '{name}' in .*user_reward.py.*{match}"):
        build_reward_fn(cfg)
