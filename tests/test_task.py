"""Built-in task, tokenizer and SFT batch construction."""

import random

import pytest

from pfppo_mega.sft import demo_batch
from pfppo_mega.tasks import AdditionProblem, AdditionTask
from pfppo_mega.tokenizer import Tokenizer, char_tokenizer


def test_tokenizer_round_trip_and_hf_compat(tmp_path):
    tok = char_tokenizer()
    ids = tok.encode("907+18=")
    assert ids[0] == tok.bos_id and len(ids) == 8
    assert tok.decode(ids[1:] + [tok.eos_id] + ids[1:]) == "907+18="  # stops at EOS
    tok.save(tmp_path)
    again = Tokenizer.from_dir(tmp_path)
    assert again.encode("907+18=") == ids and again.eos_id == tok.eos_id
    import transformers  # pinned in requirements.lock: a missing install must fail, not skip
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert hf("907+18=", add_special_tokens=False).input_ids == ids[1:]


def test_tokenizer_missing_specials(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_split_is_disjoint_and_reward_is_exact():
    task = AdditionTask(3)
    rng = random.Random(0)
    train = set(task.train_prompts(2000, rng))
    held = set(task.eval_prompts(300))
    assert not train & held
    assert not any(task.is_held_out(p) for p in train)
    assert all(task.is_held_out(p) for p in held)
    p = AdditionProblem(999, 1)
    assert task.reward(p, "1000", True) == 1.0
    assert task.reward(p, "1000", False) == 0.0  # no EOS
    assert task.reward(p, "100", True) == 0.0


def test_noisy_demonstrations_rate():
    task = AdditionTask(3)
    rng = random.Random(1)
    probs = task.train_prompts(4000, rng)
    wrong = sum(task.demonstration(p, rng, noise=0.3) != p.answer for p in probs) / len(probs)
    assert abs(wrong - 0.3) < 0.03
    assert all(task.demonstration(p, rng, noise=0.0) == p.answer for p in probs[:200])


def test_sft_batch_masks_only_answer_tokens():
    tok, task = char_tokenizer(), AdditionTask(2)
    ids, tgt, mask = demo_batch(task, tok, [AdditionProblem(12, 5), AdditionProblem(99, 99)], random.Random(0), 0.0)
    # row 0: <s> 1 2 + 5 = 1 7 </s>; targets shift by one; mask covers "1 7 </s>" targets
    assert tok.decode(tgt[0][mask[0].bool()].tolist()) == "17"
    assert tgt[0][mask[0].bool()].tolist()[-1] == tok.eos_id
    assert mask[1].sum() == len("198") + 1


def test_written_forms_and_reward():
    plain, rev = AdditionTask(3), AdditionTask(3, format="reversed")
    p = AdditionProblem(123, 45)
    assert (plain.prompt_text(p), plain.answer_text(p)) == ("123+45=", "168") == (p.prompt, p.answer)
    assert (rev.prompt_text(p), rev.answer_text(p)) == REVERSED_123_45
    pad = AdditionTask(3, format="padded")
    assert (pad.prompt_text(p), pad.answer_text(p)) == PADDED_123_45 and pad.read("0168") == 168
    assert pad.reward(p, "0168", True) == 1.0 and pad.reward(p, "168", True) == 0.0
    assert rev.reward(p, rev.answer_text(p), True) == 1.0
    assert rev.reward(p, "168", True) == 0.0 and rev.reward(p, rev.answer_text(p), False) == 0.0
    assert rev.read(rev.answer_text(AdditionProblem(999, 1))) == 1000 and rev.read("12a") is None
    # every prompt and answer of the reversed form has one length: digits sit at fixed positions
    probs = rev.train_prompts(300, random.Random(0))
    assert {len(rev.prompt_text(q)) for q in probs} == {8} and {len(rev.answer_text(q)) for q in probs} == {4}
    with pytest.raises(ValueError, match="format = 'lsd'.*'plain', 'padded', 'reversed'"):
        AdditionTask(3, format="lsd")


def test_samples_carry_the_task_form():
    from pfppo_mega.tasks.addition import AdditionPrompts
    tok, rev = char_tokenizer(), AdditionTask(3, format="reversed")
    src = AdditionPrompts(rev, tok, random.Random(0))
    for s in src.next_batch(20) + src.eval_samples(20):
        p = AdditionProblem(s.extra_info["a"], s.extra_info["b"])
        assert tok.decode(list(s.prompt_ids)) == rev.prompt_text(p) and s.ground_truth == rev.answer_text(p)


@pytest.mark.parametrize("fmt", ["plain", "padded", "reversed"])
def test_carry_drop_errs_exactly_where_and_as_often_as_configured(fmt):
    """The systematic demonstrator: wrong only on problems that carry into carry_digit, there at
    rate carry_drop, and then it writes exactly a + b - 10**carry_digit."""
    task = AdditionTask(3, format=fmt)
    rng = random.Random(7)
    probs = task.train_prompts(20000, rng)
    carry = [p for p in probs if task.carries_into(p, 2)]
    other = [p for p in probs if not task.carries_into(p, 2)]
    assert 0.35 < len(carry) / len(probs) < 0.55  # (a mod 100) + (b mod 100) >= 100
    assert all(task.demonstration(p, rng, noise=0.0, carry_drop=0.7, carry_digit=2) == task.answer_text(p)
               for p in other)
    demos = [task.demonstration(p, rng, noise=0.0, carry_drop=0.7, carry_digit=2) for p in carry]
    wrong = [(p, d) for p, d in zip(carry, demos) if d != task.answer_text(p)]
    assert abs(len(wrong) / len(carry) - 0.7) < 0.02
    assert all(task.read(d) == p.a + p.b - 100 for p, d in wrong)
    # carry_digit 1: the tens; carry_drop 1: always; 0: never (and the rng stream is the old one)
    p = AdditionProblem(15, 17)
    assert task.read(task.demonstration(p, rng, noise=0.0, carry_drop=1.0, carry_digit=1)) == 22
    a, b = random.Random(3), random.Random(3)
    assert [task.demonstration(q, a, noise=0.3) for q in probs[:300]] == \
           [task.demonstration(q, b, noise=0.3, carry_drop=0.0) for q in probs[:300]]
    assert not task.carries_into(AdditionProblem(999, 999), 0)


def test_sft_batch_uses_the_task_form():
    tok, rev = char_tokenizer(), AdditionTask(2, format="reversed")
    ids, tgt, mask = demo_batch(rev, tok, [AdditionProblem(12, 5)], random.Random(0), 0.0)
    assert tok.decode(ids[0].tolist()) == "21+50=" + "710"  # 12 + 05 = 017, written backwards
    assert tok.decode(tgt[0][mask[0].bool()].tolist()) == "710"


REVERSED_123_45 = ("321+540=", "8610")
PADDED_123_45 = ("123+045=", "0168")
