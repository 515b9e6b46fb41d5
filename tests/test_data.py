"""Prompt files (JSONL / Parquet, verl's schema, configurable keys), the checkpoint's chat template
(checked against transformers), over-long prompts, seeded epochs and the data position as
checkpoint state, on the project's synthetic GSM8K example and its BPE tokenizer."""

import json
import random

import pytest

from pfppo_mega.config import load_config_dict
from pfppo_mega.data import DataError, FilePrompts, build_prompt_data
from pfppo_mega.data.examples import gsm8k_rows, write_example
from pfppo_mega.data.files import Keys, encode_rows, read_rows
from pfppo_mega.rewards.rules import gsm8k_score
from pfppo_mega.tokenizer import Tokenizer
from pfppo_mega.types import PromptSource, Sample


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    out = tmp_path_factory.mktemp("gsm8k")
    paths = write_example(out, n_train=40, n_test=12, seed=0, vocab_size=400)
    return paths, Tokenizer.from_dir(paths["tokenizer"])


def _cfg(paths, **data):
    d = {"source": "files", "train_files": [str(paths["train.parquet"])], "val_files": [str(paths["test.jsonl"])],
         "max_prompt_length": 128, **data}
    return load_config_dict({"actor_rollout": {"model_path": str(paths["tokenizer"])}, "data": d,
                             "training": {"seed": 5}})


def _build(paths, tok, logs=None, **data):
    return build_prompt_data(_cfg(paths, **data), tok, model_dir=paths["tokenizer"], rng=random.Random(0),
                             log=(logs.append if logs is not None else lambda *_: None))


def test_example_rows_are_gsm8k_format_and_solvable():
    rows = gsm8k_rows(50, seed=1, split="train")
    for r in rows:
        assert r["data_source"] == "openai/gsm8k" and r["prompt"][0]["role"] == "user"
        # the worked solution scores 1 under the GSM8K rule; a wrong number scores 0
        assert gsm8k_score(r["extra_info"]["answer"], r["reward_model"]["ground_truth"]) == 1.0
        assert gsm8k_score("#### -1", r["reward_model"]["ground_truth"]) == 0.0
    assert gsm8k_rows(5, seed=1, split="x") == gsm8k_rows(5, seed=1, split="x")


def test_parquet_and_jsonl_read_the_same_rows(example):
    paths, _ = example
    assert read_rows(paths["train.parquet"], "k") == read_rows(paths["train.jsonl"], "k")


def test_chat_template_matches_transformers(example):
    """The prompt text is what transformers.apply_chat_template renders from the same local files,
    and the ids what its tokenizer encodes."""
    import transformers
    paths, tok = example
    data = _build(paths, tok)
    hf = transformers.AutoTokenizer.from_pretrained(str(paths["tokenizer"]))
    rows = read_rows(paths["test.jsonl"], "k")
    for row, s in zip(rows, data.val):
        text = hf.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        assert s.prompt_text == text
        assert list(s.prompt_ids) == hf(text, add_special_tokens=False)["input_ids"]
        assert s.prompt_ids[0] == tok.bos_id and s.prompt_text.endswith("<|assistant|>")
        assert s.data_source == "openai/gsm8k" and s.ground_truth == row["reward_model"]["ground_truth"]
        assert s.extra_info["question"] == row["extra_info"]["question"]
    # decode is the BPE decoder's (byte-level), not a join of token strings
    ids = tok.encode("Ava has 12 apples.", add_bos=False)
    assert tok.decode(ids + [tok.eos_id] + ids) == "Ava has 12 apples."


def test_string_prompts_and_custom_keys(tmp_path, example):
    paths, tok = example
    f = tmp_path / "custom.jsonl"
    f.write_text(json.dumps({"question": "What is 2+2?", "src": "exact_match", "answer": {"value": "4"},
                             "meta": {"k": 1}}) + "\n")
    data = _build(paths, tok, train_files=[str(f)], val_files=[], prompt_key="question", data_source_key="src",
                  ground_truth_key="answer.value", extra_info_key="meta")
    s = data.val[0]
    assert s.prompt_text.startswith("<s><|user|>What is 2+2?") and s.ground_truth == "4"
    assert s.data_source == "exact_match" and s.extra_info == {"k": 1}
    raw = _build(paths, tok, train_files=[str(f)], val_files=[], prompt_key="question", apply_chat_template=False)
    assert raw.val[0].prompt_text == "What is 2+2?" and raw.val[0].prompt_ids[0] == tok.bos_id


def test_several_files_epochs_seeded_shuffle_and_position(example):
    paths, tok = example
    data = _build(paths, tok, train_files=[str(paths["train.parquet"]), str(paths["test.parquet"])])
    src = data.train
    assert isinstance(src, PromptSource) and len(src.samples) == 52
    first_epoch = [s.row for s in src.next_batch(26) + src.next_batch(26)]
    assert sorted(first_epoch) == sorted(s.row for s in src.samples)  # each row once per epoch
    assert first_epoch != [s.row for s in src.samples]                  # shuffled
    state = src.state_dict()
    nxt = [s.row for s in src.next_batch(30)]                           # wraps into epoch 2
    assert src.state_dict()["epoch"] == 1
    assert nxt != first_epoch[:30]                                      # epoch 2: a new order
    again = _build(paths, tok, train_files=[str(paths["train.parquet"]), str(paths["test.parquet"])]).train
    assert [s.row for s in again.next_batch(52)] == first_epoch       # same seed, same order
    again.load_state_dict(state)
    assert [s.row for s in again.next_batch(30)] == nxt               # resumed where it stopped
    with pytest.raises(DataError, match="saved for 52 training rows.*now give 40"):
        _build(paths, tok).train.load_state_dict(state)


def test_data_parallel_ranks_take_disjoint_slices(example):
    paths, tok = example
    samples = _build(paths, tok).train.samples
    ranks = [FilePrompts(samples, seed=3, shuffle=True, dp_rank=r, dp_size=2) for r in range(2)]
    a, b = ([s.row for s in src.next_batch(10)] for src in ranks)
    assert not set(a) & set(b) and len(a) == len(b) == 10
    assert ranks[0].state_dict() == ranks[1].state_dict()


def test_overlong_prompts_filtered_and_reported_or_refused(example):
    paths, tok = example
    rows = read_rows(paths["train.jsonl"], "k")
    lengths = [len(s.prompt_ids) for s in _build(paths, tok).train.samples]
    limit = sorted(lengths)[len(lengths) // 2]
    logs = []
    data = _build(paths, tok, logs, max_prompt_length=limit)
    dropped = sum(n > limit for n in lengths)
    assert 0 < dropped < len(rows) and len(data.train.samples) == len(rows) - dropped
    assert any(f"dropped {dropped} prompt(s) longer than data.max_prompt_length ({limit}" in m for m in logs)
    with pytest.raises(DataError, match=r"train.parquet' row \d+: the prompt has \d+ tokens > data.max_prompt_length"):
        _build(paths, tok, max_prompt_length=limit, overlong_prompts="error")
    with pytest.raises(DataError, match="no usable prompt"):
        _build(paths, tok, max_prompt_length=3)


def test_builtin_task_is_a_registered_prompt_source(example):
    from pfppo_mega.tokenizer import char_tokenizer
    cfg = load_config_dict({"actor_rollout": {"model_path": "/x"}, "data": {"num_digits": 2, "eval_size": 5}})
    rng = random.Random(1)
    data = build_prompt_data(cfg, char_tokenizer(), model_dir="/x", rng=rng)
    batch = data.train.next_batch(4)
    assert all(isinstance(s, Sample) and s.data_source == "addition" for s in batch) and len(data.val) == 5
    state, rng_state = data.train.state_dict(), rng.getstate()  # the position is the given rng's
    more = [s.prompt_text for s in data.train.next_batch(3)]
    rng.setstate(rng_state)
    data.train.load_state_dict(state)
    assert [s.prompt_text for s in data.train.next_batch(3)] == more
    with pytest.raises(ValueError, match="must be {}"):
        data.train.load_state_dict({"epoch": 1})


def test_encode_rows_names_row_and_key(example):
    _, tok = example
    with pytest.raises(DataError, match=r"data.train_files 'f.jsonl' row 1: no 'prompt' key"):
        encode_rows([{"prompt": "a"}, {"question": "b"}], key="data.train_files", file="f.jsonl", keys=Keys(),
                    tokenizer=tok, template=None, max_prompt_length=50, overlong="filter")


def test_committed_example_is_what_the_generator_writes(tmp_path):
    from pathlib import Path
    committed = Path(__file__).resolve().parents[1] / "examples" / "gsm8k_synth"
    fresh = write_example(tmp_path, n_train=256, n_test=64, seed=0, vocab_size=512)
    for name in ("train.parquet", "test.parquet", "train.jsonl", "test.jsonl"):
        assert read_rows(committed / name, "k") == read_rows(fresh[name], "k"), name
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (committed / "tokenizer" / name).read_text() == (fresh["tokenizer"] / name).read_text(), name


QWEN_LIKE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if message.role == 'system' and loop.first %}{%- continue %}{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def test_hf_style_special_tokens_and_another_template_match_transformers(tmp_path, example):
    """A Qwen2-style tokenizer_config.json: no BOS, eos as {"content": ...}, pad unset (-> eos), a
    template with loop controls and a default system prompt; rendered as transformers renders it."""
    import transformers
    from pfppo_mega.data import chat_template_of
    from pfppo_mega.tokenizer import TokenizerError
    paths, tok = example
    d = tmp_path / "qwenish"
    d.mkdir()
    (d / "tokenizer.json").write_text((paths["tokenizer"] / "tokenizer.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": None, "eos_token": {"__type": "AddedToken", "content": "</s>", "lstrip": False,
                                           "rstrip": False, "normalized": False, "single_word": False,
                                           "special": True}, "chat_template": QWEN_LIKE,
         "tokenizer_class": "PreTrainedTokenizerFast"}))
    qt = Tokenizer.from_dir(d)
    assert qt.bos_id is None and qt.pad_id == qt.eos_id == tok.eos_id
    assert qt.encode("Ava has", add_bos=True) == tok.encode("Ava has", add_bos=False)
    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    template = chat_template_of(qt, d)
    for msgs in ([{"role": "user", "content": "What is 2+2?"}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "2+2?"}]):
        assert template.render(msgs) == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    with pytest.raises(TokenizerError, match=r"tokenizer_config.json names special tokens missing from "
                                             r"tokenizer.json \(eos_token='<\|im_end\|>'\)"):
        Tokenizer.from_dir(d)
