"""Issue 24.7 / 24.8 leftovers: a deeply nested JSONL row and a lone surrogate ended in
RecursionError / TypeError tracebacks; a template's SyntaxError, "range() arg 3 must not be zero"
and "substring not found" came without the template's file. Each is now a named error."""

from __future__ import annotations

import json

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
