"""The demo-llm task (pfppo_mega/tasks/chat_arith.py): a held-out split no training row touches, rows in
verl's schema that the prompt-file reader takes through a chat template, and its verifier."""

from __future__ import annotations

import json

import pytest

from pfppo_mega.tasks import chat_arith as ca


@pytest.mark.parametrize("kind", sorted(ca.KINDS))
def test_split_is_disjoint_and_covers_every_pair(kind):
    train, held = set(ca.pairs(kind, held=False)), set(ca.pairs(kind, held=True))
    (a0, a1), (b0, b1), _ = ca.KINDS[kind]
    assert not train & held and len(train | held) == (a1 - a0 + 1) * (b1 - b0 + 1)
    assert 0.15 < len(held) / len(train | held) < 0.35


def test_files_rows_and_answers(tmp_path):
    train, val = ca.write_files(tmp_path, kind="add", n_train=300, n_val=100, seed=3)
    rows = [json.loads(line) for line in val.read_text().splitlines()]
    assert len(rows) == 100 and len({(r["extra_info"]["a"], r["extra_info"]["b"]) for r in rows}) == 100
    for r in rows + [json.loads(line) for line in train.read_text().splitlines()]:
        a, b = r["extra_info"]["a"], r["extra_info"]["b"]
        assert r["data_source"] == "chat_arith" and r["reward_model"]["ground_truth"] == str(a + b)
        assert r["prompt"] == [{"role": "user", "content": f"What is {a} + {b}? Answer with just the number."}]
        assert ca.held_out(a, b) is (r in rows)
    assert ca.write_files(tmp_path / "again", kind="add", n_train=300, n_val=100, seed=3)[1].read_text() == val.read_text()


@pytest.mark.parametrize("text, gt, score", [
    ("12", "12", 1.0), ("5 + 7 = 12", "12", 1.0), ("The answer is 12.", "12", 1.0), ("12 or 13", "12", 0.0),
    ("twelve", "12", 0.0), ("", "12", 0.0), ("-3", "-3", 1.0), ("0012", "12", 1.0), ("7 - 9 = -2", "-2", 1.0)])
def test_verifier_reads_the_last_integer(text, gt, score):
    assert ca.compute_score("chat_arith", text, gt, {}) == score


def test_rows_render_through_a_chat_template():
    """SmolLM2's ChatML template (as the GGUF ships it, default system prompt added) renders a row."""
    from pfppo_mega.data.chat import ChatTemplate

    chatml = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
              "{{ '<|im_start|>system\\nYou are a helpful AI assistant.<|im_end|>\\n' }}{% endif %}"
              "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    row = ca.rows("add1", 1, held=True, seed=0)[0]
    text = ChatTemplate(chatml, special_tokens={}, where="test").render(row["prompt"], add_generation_prompt=True)
    q = row["prompt"][0]["content"]
    assert text.endswith(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n")
