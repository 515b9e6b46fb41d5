"""`pfppo bench pool-step`: what the PF-PPO pool adds to a training step, per engine.

Trains the same config (default configs/demo.yaml) once per arm and compares the median step
time of each pool arm with plain PPO's:

    ppo        algorithm.use_pf_ppo=false (the engine takes the live weights every step)
    pf_group   the pool, one snapshot drawn per prompt group (algorithm.pool.assign=group)
    pf_step    the pool, one snapshot drawn per step (algorithm.pool.assign=step)

Each arm is a separate `pfppo train` process (its own engine), run one after the other and
repeated for --rounds rounds in the same order, so a change of machine load during the
benchmark reaches every arm alike; the first --warmup steps of every run are not counted
(engine start, first compile, first snapshots). Result: per arm the median of its counted
steps over all rounds, the ratio to ppo, and the pool's own per-step parts (switch time,
snapshots used). The warm start is the demo's SFT made once in --work (or --model-path).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ARMS: dict[str, tuple[str, ...]] = {
    "ppo": ("algorithm.use_pf_ppo=false",),
    "pf_group": ("algorithm.use_pf_ppo=true", "algorithm.pool.assign=group"),
    "pf_step": ("algorithm.use_pf_ppo=true", "algorithm.pool.assign=step"),
}


@dataclass
class ArmResult:
    arm: str
    overrides: list[str]
    step_s: list[float]          # every counted step, all rounds
    median_s: float
    ratio_to_ppo: float | None   # median / ppo's median
    rollout_s: float             # median time/rollout_s of the counted steps
    switch_s: float | None       # median pool/switch_s (pool arms)
    snapshots_used: float | None  # mean pool/snapshots_used (pool arms)


def _pfppo(*args: str) -> list[str]:
    return [sys.executable, "-m", "pfppo_mega.cli", *args]


def _run(cmd: list[str], log: Path) -> None:
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
    if rc != 0:
        tail = log.read_text().splitlines()[-15:]
        raise RuntimeError(f"pfppo bench pool-step: {' '.join(cmd)} exited {rc}; last lines of {log}:\n" + "\n".join(tail))


def _warm_start(config: str, work: Path, sft_steps: int, overrides: list[str]) -> Path:
    out = work / "sft"
    info = out / "sft_info.json"
    made = json.loads(info.read_text()).get("steps") if info.is_file() and (out / "config.json").is_file() else None
    if made != sft_steps:  # none yet, or one of another length: made again
        _run(_pfppo("sft", config, f"sft.output_dir={out}", f"sft.steps={sft_steps}", "sft.min_accuracy=0",
                    *overrides), work / "sft.log")
    return out


def _steps(run_dir: Path, warmup: int) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "perf/step_s" in r and r.get("perf/step_s") is not None]
    return rows[warmup:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pfppo bench pool-step", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/demo.yaml")
    ap.add_argument("--engine", default="vllm", help="actor_rollout.engine of every arm (builtin or vllm)")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma list of {list(ARMS)} (ppo is the baseline)")
    ap.add_argument("--steps", type=int, default=16, help="training steps per run")
    ap.add_argument("--warmup", type=int, default=4, help="steps of each run not counted")
    ap.add_argument("--rounds", type=int, default=3, help="times every arm is run, in the same order")
    ap.add_argument("--sft-steps", type=int, default=800,
                    help="steps of the warm start made in --work (800, the demo's: a policy that answers, so "
                         "rewards, updates and snapshots differ as in the demo; a few dozen measure an "
                         "untrained policy, whose snapshots barely differ)")
    ap.add_argument("--model-path", help="an existing warm start instead")
    ap.add_argument("--work", default="runs/bench_pool_step")
    ap.add_argument("--json", help="write the results here (with git sha and machine)")
    ap.add_argument("overrides", nargs="*", help="key.path=value for every arm")
    args = ap.parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    bad = [a for a in arms if a not in ARMS]
    if bad or "ppo" not in arms:
        ap.error(f"--arms {args.arms!r}: need ppo and only names from {list(ARMS)}")
    if args.warmup < 0 or args.steps <= args.warmup or args.rounds < 1:
        ap.error(f"--steps {args.steps} must exceed --warmup {args.warmup} (>= 0); --rounds {args.rounds} >= 1")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    common = [f"actor_rollout.engine={args.engine}", f"training.total_training_steps={args.steps}",
              "checkpoint.resume=false", "checkpoint.save_interval=0", "logging.eval_interval=0", *args.overrides]
    model = Path(args.model_path) if args.model_path else _warm_start(args.config, work, args.sft_steps, args.overrides)
    rows: dict[str, list[dict]] = {a: [] for a in arms}
    t0 = time.time()
    for r in range(args.rounds):
        for arm in arms:
            out = work / f"{arm}_r{r}"
            _run(_pfppo("train", args.config, f"actor_rollout.model_path={model}", f"logging.output_dir={out}",
                        *common, *ARMS[arm]), work / f"{arm}_r{r}.log")
            rows[arm] += _steps(out, args.warmup)
            print(f"[bench pool-step] round {r + 1}/{args.rounds} {arm}: median "
                  f"{statistics.median(s['perf/step_s'] for s in _steps(out, args.warmup)):.3f} s/step", flush=True)
    base = statistics.median(s["perf/step_s"] for s in rows["ppo"])
    results = []
    for arm in arms:
        st = rows[arm]
        med = statistics.median(s["perf/step_s"] for s in st)
        sw = [s["pool/switch_s"] for s in st if "pool/switch_s" in s]
        used = [s["pool/snapshots_used"] for s in st if "pool/snapshots_used" in s]
        results.append(ArmResult(arm=arm, overrides=[*common, *ARMS[arm]], step_s=[s["perf/step_s"] for s in st],
                                 median_s=med, ratio_to_ppo=med / base,
                                 rollout_s=statistics.median(s.get("time/rollout_s", float("nan")) for s in st),
                                 switch_s=statistics.median(sw) if sw else None,
                                 snapshots_used=statistics.fmean(used) if used else None))
    print(f"{'arm':<10}{'s/step':>9}{'vs ppo':>9}{'rollout s':>11}{'switch s':>10}{'snaps/step':>11}  "
          f"({args.engine}, {args.config}, {args.rounds} rounds x {args.steps - args.warmup} counted steps)")
    for x in results:
        print(f"{x.arm:<10}{x.median_s:9.3f}{100 * (x.ratio_to_ppo - 1):+8.1f}%{x.rollout_s:11.3f}"
              f"{'-' if x.switch_s is None else f'{x.switch_s:.3f}':>10}"
              f"{'-' if x.snapshots_used is None else f'{x.snapshots_used:.2f}':>11}")
    load = os.getloadavg()
    print(f"load average at the end: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; wall {time.time() - t0:.0f} s")
    if args.json:
        from pfppo_mega.bench.kernels import git_sha, machine_info

        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"git": git_sha(), "machine": machine_info("cpu"), "engine": args.engine,
                                               "config": args.config, "load_average": load,
                                               "arms": [asdict(x) for x in results]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
