"""Small-number arithmetic asked in words, for a real chat model (the `make demo-llm` task).

    python -m pfppo_mega.tasks.chat_arith OUT_DIR [--kind add] [--train 2000] [--val 256]

writes OUT_DIR/train.jsonl and OUT_DIR/val.jsonl in verl's schema (data.source = files): each row's
prompt is one user message, e.g. "What is 7 + 25? Answer with just the number.", which the trainer
renders through the checkpoint's chat template; reward_model.ground_truth is the answer as a
string; data_source is "chat_arith". The verifier is `compute_score` in this file, used as
reward.custom_function (path: pfppo_mega/tasks/chat_arith.py): 1.0 when the LAST integer the
response writes equals the answer, else 0.0 (a 135M chat model answers "7 + 25 = 32" as often as
"32"; reading the last number scores both, and listing candidates ends on one of them only).

Kinds (KINDS): ``add`` (a + b, a in 1..99, b in 1..9), ``add1`` (both in 1..12; SmolLM2-135M-Instruct starts at ~0.6 greedy, ~0.1
sampled at temperature 1 on 1..9), ``sub`` (a - b,
a in 10..30, b in 1..9). The operand pairs are split into training and held-out sets by a fixed
hash, so no held-out question is ever trained on; the rows are drawn with a seed.
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

DATA_SOURCE = "chat_arith"
SUFFIX = " Answer with just the number."
KINDS = {  # kind -> (a range, b range, operator)
    "add": ((1, 99), (1, 9), "+"),
    "add1": ((1, 12), (1, 12), "+"),
    "sub": ((10, 30), (1, 9), "-"),
}
_INT = re.compile(r"-?\d+")


def answer(a: int, b: int, op: str) -> int:
    return a + b if op == "+" else a - b


def question(a: int, b: int, op: str) -> str:
    return f"What is {a} {op} {b}?{SUFFIX}"


def held_out(a: int, b: int, every: int = 4) -> bool:
    """A fixed multiplicative hash of the pair (independent of any seed): ~1 pair in `every`."""
    return ((a * 2654435761 + b * 40503) >> 5) % every == 0


def pairs(kind: str, *, held: bool) -> list[tuple[int, int]]:
    if kind not in KINDS:
        raise ValueError(f"chat_arith kind = {kind!r}: must be one of {', '.join(map(repr, KINDS))}")
    (a0, a1), (b0, b1), _ = KINDS[kind]
    return [(a, b) for a in range(a0, a1 + 1) for b in range(b0, b1 + 1) if held_out(a, b) == held]


def rows(kind: str, n: int, *, held: bool, seed: int) -> list[dict]:
    """n rows drawn (with replacement beyond the pool's size) from the split's pairs; the held-out
    rows are distinct pairs as long as the split has n of them."""
    op = KINDS[kind][2]
    pool = pairs(kind, held=held)
    rng = random.Random(seed)
    picked = rng.sample(pool, n) if n <= len(pool) else [rng.choice(pool) for _ in range(n)]
    return [{"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": question(a, b, op)}],
             "reward_model": {"ground_truth": str(answer(a, b, op))},
             "extra_info": {"a": a, "b": b, "op": op, "kind": kind}} for a, b in picked]


def write_files(out_dir: str | Path, *, kind: str = "add", n_train: int = 2000, n_val: int = 256,
                seed: int = 0) -> tuple[Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, n, held in (("train.jsonl", n_train, False), ("val.jsonl", n_val, True)):
        p = out / name
        tmp = p.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows(kind, n, held=held, seed=seed + held)))
        tmp.replace(p)
        paths.append(p)
    return paths[0], paths[1]


def last_integer(text: str) -> str | None:
    found = _INT.findall(text)
    return found[-1] if found else None


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """verl's custom reward signature: 1.0 when the response's last integer equals ground_truth."""
    got = last_integer(str(solution_str))
    return float(got is not None and int(got) == int(str(ground_truth)))


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m pfppo_mega.tasks.chat_arith", description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--kind", default="add", choices=sorted(KINDS))
    ap.add_argument("--train", type=int, default=2000)
    ap.add_argument("--val", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    train, val = write_files(args.out_dir, kind=args.kind, n_train=args.train, n_val=args.val, seed=args.seed)
    print(f"[pfppo] chat_arith {args.kind}: {args.train} training rows -> {train}, {args.val} held-out -> {val}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
