"""Issue 24.7 / 24.8 leftovers: a deeply nested JSONL row and a lone surrogate ended in
RecursionError / TypeError tracebacks; a template's SyntaxError, "range() arg 3 must not be zero"
and "substring not found" came without the template's file. Each is now a named error. A template
that ends every prompt in EOS trained on without a word: it is now said at start (a warning: it
still renders the conversation)."""

from __future__ import annotations

import json
import random
import re
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


# Issue 40: a row with a key twice (two reward_model objects) kept the last silently (every correct
# answer then scored 0); a template nested deeper than Python's compiler allows ended in a SyntaxError
# (IndentationError) or RecursionError traceback from Jinja's compiler.

GOOD = json.dumps(_row())
TWICE_TOP = ('{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "What is 2+2?"}], '
             '"reward_model": {"ground_truth": "4"}, "extra_info": {}, "reward_model": {"ground_truth": "5"}}')
TWICE_NESTED = ('{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "What is 2+2?"}], '
                '"reward_model": {"ground_truth": "4", "ground_truth": "5"}, "extra_info": {}}')


@pytest.mark.parametrize("name,text,said", [
    ("top.jsonl", f"{GOOD}\n\n{TWICE_TOP}\n", r"top.jsonl' line 3 \(row 1\): key 'reward_model' appears twice"),
    ("nested.jsonl", f"{TWICE_NESTED}\n", r"nested.jsonl' line 1 \(row 0\): key 'reward_model.ground_truth' appears twice"),
    ("array.json", f"[{GOOD}, {GOOD}, {TWICE_NESTED}]", r"array.json' row 2: key 'reward_model.ground_truth' appears twice"),
    ("lines.json", f"{GOOD}\n{TWICE_TOP}\n", r"lines.json' line 2 \(row 1\): key 'reward_model' appears twice"),
], ids=["jsonl_top", "jsonl_nested", "json_array", "json_lines"])
def test_a_key_twice_in_a_row_is_refused_by_row_and_key(tok_dir, tmp_path, name, text, said):  # noqa: F811
    f = tmp_path / name
    f.write_text(text)
    with pytest.raises(DataError, match=rf"{said} in one object \(JSON would silently keep the last one\)"):
        _load(tok_dir, [str(f)])


@pytest.mark.parametrize("source", [
    "{% if true %}" * 120 + "{% for m in messages %}{{ m['content'] }}{% endfor %}" + "{% endif %}" * 120,
    "{% if true %}" * 2000 + "{% for m in messages %}{{ m['content'] }}{% endfor %}" + "{% endif %}" * 2000,
    "{{ " + "(" * 2000 + "1" + ")" * 2000 + " }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
], ids=["if_120", "if_2000", "parens_2000"])
def test_a_template_nested_too_deep_is_refused_by_file(source):
    with pytest.raises(ChatTemplateError, match=r"^/ckpt/chat_template.jinja: chat_template does not compile: its "
                                                r"blocks or expressions are nested deeper than .* flatten it"):
        ChatTemplate(source, special_tokens={"bos_token": "<s>"}, where="/ckpt/chat_template.jinja")


# Issue 40 (vague refusals): a template's own refusal (`raise_exception`, as Mistral's and Gemma's
# templates refuse a system message) or its arithmetic failing came with the file but not the
# template line that raised it.

LINES = ["{% for m in messages %}",
         "{% if m['role'] == 'system' %}",
         "{{ RAISE }}",
         "{% endif %}",
         "{{ m['content'] }}",
         "{% endfor %}"]


@pytest.mark.parametrize("raise_,said", [
    ("raise_exception('System role not supported')", "System role not supported"),
    ("(1 // 0)", "ZeroDivisionError: integer division or modulo by zero"),
], ids=["raise_exception", "zero_division"])
@pytest.mark.parametrize("newline", ["\n", "\r\n"], ids=["lf", "crlf"])
def test_a_template_refusal_names_the_template_line(raise_, said, newline):
    source = newline.join(LINES).replace("RAISE", raise_)
    t = ChatTemplate(source, special_tokens={"bos_token": "<s>"}, where="/ckpt/chat_template.jinja")
    t.render([{"role": "user", "content": "hi"}])  # a user message passes
    line = re.escape("{{ " + raise_ + " }}")
    with pytest.raises(ChatTemplateError, match=rf"^/ckpt/chat_template.jinja: chat_template refused the prompt: "
                                                rf"{said} \(raised at line 3 of the template: [\"']{line}[\"']\)$"):
        t.render([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
