"""Issue 24.7 / 24.8 leftovers: a deeply nested JSONL row and a lone surrogate ended in
RecursionError / TypeError tracebacks; a template's SyntaxError, "range() arg 3 must not be zero"
and "substring not found" came without the template's file. Each is now a named error. A template
that ends every prompt in EOS trained on without a word: it is now said at start (a warning: it
still renders the conversation)."""

from __future__ import annotations

import json
import random
import shutil

import pytest

from test_adv_data_inputs import _load, _row, tok_dir  # noqa: F401  (its tokenizer fixture)

from pfppo_mega.data import DataError
from pfppo_mega.data.chat import ChatTemplate, ChatTemplateError

DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("layout", ["jsonl", "json_array"])
def test_a_row_nested_too_deep_is_refused_by_file(tok_dir, tmp_path, layout):  # noqa: F811
    f = tmp_path / ("deep.jsonl" if layout == "jsonl" else "deep.json")
    good = json.dumps(_row())
    f.write_text(f"{good}\n{{\"prompt\": {DEEP}}}\n" if layout == "jsonl" else f"[{good}, {DEEP}]")
    where = r"deep.jsonl' line 2" if layout == "jsonl" else r"deep.json'"
    with pytest.raises(DataError, match=rf"{where}: nested deeper than Python's JSON reader allows"):
        _load(tok_dir, [str(f)])


def test_a_lone_surrogate_is_refused_by_row(tok_dir, tmp_path):  # noqa: F811
    f = tmp_path / "sur.jsonl"
    f.write_text(json.dumps(_row()) + "\n" + json.dumps(_row(prompt="What is \ud800 2+2?")) + "\n")
    with pytest.raises(DataError, match=r"sur.jsonl' row 1: the prompt is not valid Unicode \(surrogates not allowed"):
        _load(tok_dir, [str(f)])


@pytest.mark.parametrize("source,said", [
    ("{% for %}", "does not compile"),
    ("{{ range(1, 5, 0) | list }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
     r"refused the prompt: ValueError: range\(\) arg 3 must not be zero"),
    ("{{ 'abc'.index('z') }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
     "refused the prompt: ValueError: substring not found"),
])
def test_a_template_error_names_the_templates_file(source, said):
    with pytest.raises(ChatTemplateError, match=rf"^/ckpt/chat_template.jinja: chat_template {said}"):
        ChatTemplate(source, special_tokens={"bos_token": "<s>"}, where="/ckpt/chat_template.jinja")


def test_a_template_that_ends_every_prompt_in_eos_is_said_at_start(tok_dir, tmp_path):  # noqa: F811
    from pfppo_mega.config import load_config_dict
    from pfppo_mega.data import build_prompt_data
    from pfppo_mega.tokenizer import Tokenizer

    d = tmp_path / "tok"
    shutil.copytree(tok_dir, d)
    (d / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}{{ eos_token }}")
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps(_row()) + "\n")
    cfg = load_config_dict({"actor_rollout": {"model_path": str(d)},
                            "data": {"source": "files", "train_files": [str(f)], "max_prompt_length": 64}})
    lines: list[str] = []
    build_prompt_data(cfg, Tokenizer.from_dir(d), model_dir=d, rng=random.Random(0), log=lines.append)
    said = [x for x in lines if "ends every prompt with the EOS token" in x]
    assert len(said) == 1 and said[0].startswith("[pfppo] warning: ") and "chat_template.jinja" in said[0], lines
    # a template that ends in the assistant's header says nothing
    (d / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}<|assistant|>")
    lines.clear()
    build_prompt_data(cfg, Tokenizer.from_dir(d), model_dir=d, rng=random.Random(0), log=lines.append)
    assert not any("EOS token" in x for x in lines), lines
