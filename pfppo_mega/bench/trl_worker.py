"""One TRL arm of `pfppo bench trl`: TRL's GRPOTrainer on a Hugging Face checkpoint directory, timed.

    python -m pfppo_mega.bench.trl_worker --model DIR --data train.jsonl --out result.json [...]

Runs `--rounds` generation rounds of `--prompts` prompts x `--generations` completions of at most
`--max-new-tokens` tokens, each followed by `--opt-steps` optimizer steps (TRL's
steps_per_generation), and writes one JSON record: the clock at the end of every round (the end of
its last optimizer step, a TrainerCallback stamp: consecutive ends differ by the round's wall time,
logging included, as `pfppo bench trl` times our arms), the completion tokens of each round, and the
settings. Rewards: pfppo_mega.tasks.chat_arith.compute_score, the same verifier our arms use.
Needs the optional packages of requirements-llm.lock (trl, accelerate, datasets).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def _rows(path: str, n: int) -> list[dict]:
    out = []
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            out.append({"prompt": row["prompt"], "ground_truth": str(row["reward_model"]["ground_truth"])})
            if len(out) == n:
                break
    return out


def round_ends(stamps: list[float], opt_steps: int) -> list[float]:
    """The clock at each round's end: a round is opt_steps optimizer steps; ``stamps`` holds one
    time per optimizer step's end (a partial last round has no end)."""
    return stamps[opt_steps - 1::opt_steps]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pfppo_mega.bench.trl_worker")
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--opt-steps", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--beta", type=float, default=0.001)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(args.threads)
    t_import = time.perf_counter()
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from pfppo_mega.tasks.chat_arith import compute_score

    import_s = time.perf_counter() - t_import
    completions = args.prompts * args.generations
    if completions % args.opt_steps:
        print(f"trl_worker: prompts x generations = {completions} must divide by --opt-steps {args.opt_steps}",
              file=sys.stderr)
        return 2
    ds = Dataset.from_list(_rows(args.data, args.prompts * args.rounds * 4))
    tok = AutoTokenizer.from_pretrained(args.model)
    tokens: list[int] = []

    def reward(prompts, completions, ground_truth, completion_ids=None, **_):
        if completion_ids is not None:
            tokens.append(sum(len(c) for c in completion_ids))
        return [compute_score("chat_arith", c[0]["content"] if isinstance(c, list) else c, gt)
                for c, gt in zip(completions, ground_truth)]

    stamps: list[float] = []  # time.monotonic() at each optimizer step's end

    class Stamp(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            stamps.append(time.monotonic())

    with tempfile.TemporaryDirectory(prefix="pfppo-trl-") as tmp:
        cfg = GRPOConfig(
            output_dir=tmp, per_device_train_batch_size=completions // args.opt_steps,
            num_generations=args.generations, steps_per_generation=args.opt_steps,
            max_completion_length=args.max_new_tokens, learning_rate=args.lr, beta=args.beta,
            max_steps=args.rounds * args.opt_steps, temperature=args.temperature, top_p=1.0,
            use_cpu=True, bf16=False, report_to="none", save_strategy="no", logging_steps=1, seed=args.seed,
            dataloader_num_workers=0, lr_scheduler_type="constant", warmup_steps=0,
        )
        t0 = time.perf_counter()
        trainer = GRPOTrainer(model=args.model, reward_funcs=reward, args=cfg, train_dataset=ds,
                              processing_class=tok, callbacks=[Stamp()])
        start_s = time.perf_counter() - t0
        trainer.train()
    ends = round_ends(stamps, args.opt_steps)
    rec = {"arm": "trl_grpo", "round_end_s": ends, "tokens": tokens[:len(ends)], "import_s": import_s,
           "start_s": start_s, "settings": vars(args), "trl": __import__("trl").__version__}
    Path(args.out).write_text(json.dumps(rec, indent=2))
    print(json.dumps({k: rec[k] for k in ("round_end_s", "tokens")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
