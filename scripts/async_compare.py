"""Synchronous vs asynchronous training of one config on this machine, runs interleaved.

    python scripts/async_compare.py configs/async_tiny.yaml --steps 16 --seeds 1 2 3 [--out DIR]
        [--modes sync newest uniform recency]

Makes the SFT start once (the config's sft section, into DIR/sft), then for each seed runs
`pfppo train` once per mode: sync (algorithm.async_rl.enable=false) or async with that
async_rl.sampling rule (same prompts, model, lengths), and prints a markdown table: wall-clock per step (perf/step_s, the first step left out: the generator
starts there), per generated token, held-out accuracy after the run, and the staleness
distribution, generator / trainer busy fractions and waits of the asynchronous runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's package, not an installed one


def train(config: str, out: Path, over: list[str]) -> dict:
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "pfppo_mega", "train", config, f"logging.output_dir={out}",
                    "checkpoint.resume=false", *over], cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    recs = [json.loads(line) for line in open(out / "metrics.jsonl")]
    steps = [r for r in recs if "perf/step_s" in r]
    summary = json.loads((out / "summary.json").read_text())
    return {"wall_s": time.monotonic() - t0, "steps": steps, "acc": summary["eval_after"]["eval/accuracy"]}


def mean(xs) -> float:
    xs = list(xs)
    return statistics.fmean(xs) if xs else float("nan")


def row(name: str, runs: list[dict], rows_per_step: int) -> str:
    """Seconds per step, per generated token, held-out accuracy, and the reward's rise (last 8 - first 8 steps)."""
    step_s = [mean(r["perf/step_s"] for r in run["steps"][1:]) for run in runs]
    toks = [mean(r["perf/step_s"] / (r["response/length_mean"] * rows_per_step) for r in run["steps"][1:])
            for run in runs]
    acc = [run["acc"] for run in runs]
    rise = [mean(r["reward/mean"] for r in run["steps"][-8:]) - mean(r["reward/mean"] for r in run["steps"][:8])
            for run in runs]
    return (f"| {name} | {mean(step_s):.3f} ± {statistics.pstdev(step_s):.3f} | {1e3 * mean(toks):.2f} | "
            f"{mean(acc):.3f} ({', '.join(f'{a:.3f}' for a in acc)}) | {mean(rise):+.3f} ± {statistics.pstdev(rise):.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "async_compare")
    ap.add_argument("--set", nargs="*", default=[], help="more overrides for every mode")
    ap.add_argument("--modes", nargs="+", default=["sync", "newest"],
                    help="sync, or an async_rl.sampling rule (newest, uniform, recency)")
    a = ap.parse_args()
    sft = a.out / "sft"
    base = [f"actor_rollout.model_path={sft}", f"training.total_training_steps={a.steps}", *a.set]
    subprocess.run([sys.executable, "-m", "pfppo_mega", "sft", a.config, f"sft.output_dir={sft}", *base],
                   cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    runs: dict[str, list[dict]] = {m: [] for m in a.modes}
    for seed in a.seeds:  # interleaved: the machine's load falls on every mode alike
        for mode in a.modes:
            flags = (["algorithm.async_rl.enable=false"] if mode == "sync" else
                     ["algorithm.async_rl.enable=true", f"algorithm.async_rl.sampling={mode}"])
            runs[mode].append(train(a.config, a.out / f"{mode}_s{seed}", base + [f"training.seed={seed}", *flags]))
    from pfppo_mega.config import load_config

    cfg = load_config(a.config, base)
    rows = cfg.training.rollout_batch_size * cfg.actor_rollout.n_samples_per_prompt
    print(f"{a.config}, {a.steps} steps, seeds {a.seeds}, {rows} rows a step\n")
    print("| mode | s / step (after step 1) | ms / generated token | held-out accuracy after (per seed) | "
          "reward last 8 - first 8 steps |")
    print("|---|---|---|---|---|")
    for mode in a.modes:
        print(row(mode, runs[mode], rows))
    k = cfg.algorithm.async_rl.max_staleness
    for mode in [m for m in a.modes if m != "sync"]:
        steps = [r for run in runs[mode] for r in run["steps"][1:]]
        hist = ", ".join(f"{j}: {mean(r[f'async/staleness_hist/{j}'] for r in steps):.2f}" for j in range(k + 1))
        print(f"\n{mode}, steps 2..{a.steps}: staleness share {{{hist}}}, mean "
              f"{mean(r['async/staleness_mean'] for r in steps):.2f}, max {max(r['async/staleness_max'] for r in steps):.0f}; "
              f"dropped as stale {sum(run['steps'][-1]['async/dropped_stale_total'] for run in runs[mode]):.0f} rows; "
              f"generator busy {mean(r.get('async/generator_busy_frac', 0) for r in steps):.2f}, trainer busy "
              f"{mean(r.get('async/trainer_busy_frac', 0) for r in steps):.2f}; trainer waited "
              f"{mean(r['async/trainer_wait_s'] for r in steps):.3f} s / step, generator idle "
              f"{mean(r['async/generator_idle_s'] for r in steps):.3f} s / step; IS ESS "
              f"{mean(r['async/ess'] for r in steps):.3f}")
    print("\nphase seconds per step (rollout = generating in sync, waiting for the generator in async; sync = the "
          "weight push):")
    for mode in a.modes:
        steps = [r for run in runs[mode] for r in run["steps"][1:]]
        print(f"{mode:8s}" + ", ".join(f"{p} {mean(r[f'time/{p}_s'] for r in steps):.3f}"
                                       for p in ("rollout", "prepare", "update", "sync")))


if __name__ == "__main__":
    main()
