"""Built-in task, tokenizer and SFT batch construction."""

import random

import pytest

from pfppo_mega.tasks import AdditionTask, Problem, Tokenizer, char_tokenizer
from pfppo_mega.sft import demo_batch


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
    p = Problem(999, 1)
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
    ids, tgt, mask = demo_batch(task, tok, [Problem(12, 5), Problem(99, 99)], random.Random(0), 0.0)
    # row 0: <s> 1 2 + 5 = 1 7 </s>; targets shift by one; mask covers "1 7 </s>" targets
    assert tok.decode(tgt[0][mask[0].bool()].tolist()) == "17"
    assert tgt[0][mask[0].bool()].tolist()[-1] == tok.eos_id
    assert mask[1].sum() == len("198") + 1
