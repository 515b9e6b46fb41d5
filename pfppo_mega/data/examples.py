"""A small GSM8K-format example written by the project: synthetic word problems (no downloads),
a byte-level BPE tokenizer trained on them with a chat template, in verl's file schema.

    python -m pfppo_mega.data.examples OUT_DIR [--train 256] [--test 64] [--seed 0]

writes OUT_DIR/train.parquet, test.parquet (and .jsonl twins) and OUT_DIR/tokenizer/
(tokenizer.json + tokenizer_config.json with `chat_template`). examples/gsm8k_synth/ holds the
output of the default command; tests/test_data_e2e.py trains a few PPO steps on it.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from pfppo_mega.tokenizer import BOS, EOS, PAD, UNK, Tokenizer

DATA_SOURCE = "openai/gsm8k"  # scored by the gsm8k rule (rewards/rules.py)
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
ROLES = ("<|system|>", "<|user|>", "<|assistant|>")
# One turn per message; the prompt ends with the assistant marker, the reply with EOS.
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")

_NAMES = ("Ava", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jon", "Kemal", "Lena")
_ITEMS = ("apples", "pencils", "stickers", "marbles", "cookies", "books", "shells", "cards")


def word_problem(rng: random.Random) -> tuple[str, str, int]:
    """(question, worked solution ending in '#### n', n): one of four two-step templates."""
    name, other = rng.sample(_NAMES, 2)
    item = rng.choice(_ITEMS)
    a, b, c = rng.randint(2, 40), rng.randint(2, 30), rng.randint(2, 9)
    kind = rng.randrange(4)
    if kind == 0:
        q = f"{name} has {a} {item}. {name} buys {b} more and then gives {min(c, a + b)} to {other}. " \
            f"How many {item} does {name} have now?"
        c = min(c, a + b)
        n = a + b - c
        sol = f"{name} has {a} + {b} = {a + b} {item}. After giving {c} away: {a + b} - {c} = {n}."
    elif kind == 1:
        q = f"{name} packs {c} boxes with {a} {item} in each box. How many {item} are packed in total?"
        n = a * c
        sol = f"{c} boxes of {a} make {c} * {a} = {n}."
    elif kind == 2:
        total = a * c
        q = f"{name} shares {total} {item} equally among {c} friends. How many {item} does each friend get?"
        n = a
        sol = f"Each friend gets {total} / {c} = {n}."
    else:
        q = f"{name} has {a} {item} and {other} has {b} {item}. {other} finds {c} more. " \
            f"How many {item} do they have together?"
        n = a + b + c
        sol = f"{other} has {b} + {c} = {b + c}. Together: {a} + {b + c} = {n}."
    return q, f"{sol}\n#### {n}", n


def gsm8k_rows(n: int, *, seed: int, split: str) -> list[dict]:
    """Rows in verl's GSM8K schema (as verl's examples/data_preprocess/gsm8k.py writes them)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        q, sol, ans = word_problem(rng)
        rows.append({"data_source": DATA_SOURCE,
                     "prompt": [{"role": "user", "content": f"{q} {INSTRUCTION}"}],
                     "ability": "math",
                     "reward_model": {"style": "rule", "ground_truth": str(ans)},
                     "extra_info": {"split": split, "index": i, "answer": sol, "question": q}})
    return rows


def train_bpe_tokenizer(texts: list[str], *, vocab_size: int = 512) -> Tokenizer:
    """Byte-level BPE trained on `texts`, the four specials first, the chat role markers added as
    special tokens, and CHAT_TEMPLATE in its tokenizer_config.json."""
    hf = HFTokenizer(models.BPE(unk_token=None))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    specials = [PAD, BOS, EOS, UNK, *ROLES]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(texts, trainer=trainer)
    config = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK,
              "additional_special_tokens": list(ROLES), "chat_template": CHAT_TEMPLATE,
              "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20}
    ids = {t: hf.token_to_id(t) for t in (PAD, BOS, EOS)}
    return Tokenizer(hf, pad_id=ids[PAD], bos_id=ids[BOS], eos_id=ids[EOS], config=config)


def write_rows(rows: list[dict], path: Path) -> None:
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_example(out: str | Path, *, n_train: int = 256, n_test: int = 64, seed: int = 0,
                  vocab_size: int = 512) -> dict[str, Path]:
    out = Path(out)
    (out / "tokenizer").mkdir(parents=True, exist_ok=True)
    train = gsm8k_rows(n_train, seed=seed, split="train")
    test = gsm8k_rows(n_test, seed=seed + 1, split="test")
    paths = {}
    for name, rows in (("train", train), ("test", test)):
        for ext in (".parquet", ".jsonl"):
            paths[name + ext] = out / f"{name}{ext}"
            write_rows(rows, paths[name + ext])
    texts = [r["prompt"][0]["content"] + "\n" + r["extra_info"]["answer"] for r in train]
    train_bpe_tokenizer(texts, vocab_size=vocab_size).save(out / "tokenizer")
    paths["tokenizer"] = out / "tokenizer"
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pfppo_mega.data.examples", description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--train", type=int, default=256)
    ap.add_argument("--test", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=512)
    a = ap.parse_args(argv)
    for name, p in write_example(a.out, n_train=a.train, n_test=a.test, seed=a.seed, vocab_size=a.vocab_size).items():
        print(f"{name}: {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
