"""`pfppo compare CONFIG --seeds 3`: PF-PPO pool off vs on, same budget, same seeds; a report.

Each arm x seed is a full `pfppo train` run (same SFT checkpoint, same number of steps, same
data order seed). The report states what the numbers show for each claim, whichever way it goes:
with the pool, KL rises more gently and oscillates less, reward is smoother, early reward may lag,
final accuracy is no worse.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ARMS = ("ppo", "pf_ppo")


@dataclass
class RunStats:
    arm: str
    seed: int
    # KL is kl/probe_k1: KL(current policy || reference) per token on fresh samples of the current
    # policy (logging.kl_probe_size prompts each step), the same estimator in both arms.
    kl_slope_early: float       # nats/token per step, least squares over the first `early` steps
    kl_oscillation: float       # std of the step-to-step change of KL
    kl_spikes: int              # step-to-step KL rises > 3x the run's median |change| (and > 0.01)
    kl_final: float             # mean KL over the last 10% of steps
    reward_smoothness: float    # std of the step-to-step change of mean reward (lower = smoother)
    reward_early: float         # mean reward over the first `early` steps
    steps_to_threshold: int     # first step whose 10-step moving average reward >= threshold (-1: never)
    eval_accuracy: float        # final held-out accuracy, sampled at the rollout temperature
    eval_accuracy_greedy: float
    length_std: float           # std over steps of the mean response length
    wall_s: float


# ----------------------------------------------------------------------------- statistics (pure)


def slope(y: list[float]) -> float:
    """Least-squares slope of y against 0..n-1."""
    n = len(y)
    if n < 2:
        return 0.0
    x = torch.arange(n, dtype=torch.float64)
    t = torch.tensor(y, dtype=torch.float64)
    xc = x - x.mean()
    return float((xc * (t - t.mean())).sum() / (xc * xc).sum())


def diffs(y: list[float]) -> list[float]:
    return [b - a for a, b in zip(y, y[1:])]


def std(y: list[float]) -> float:
    return statistics.pstdev(y) if len(y) > 1 else 0.0


def count_spikes(y: list[float], *, factor: float = 3.0, floor: float = 0.01) -> int:
    d = diffs(y)
    if not d:
        return 0
    typical = statistics.median(abs(v) for v in d)
    return sum(1 for v in d if v > max(factor * typical, floor))


def first_reaching(y: list[float], threshold: float, *, window: int = 10) -> int:
    """1-based step at which the trailing `window`-step mean first reaches threshold; -1 if never."""
    for i in range(window, len(y) + 1):
        if sum(y[i - window:i]) / window >= threshold:
            return i
    return -1


def run_stats(arm: str, seed: int, records: list[dict], *, early: int, threshold: float,
              wall_s: float) -> RunStats:
    steps = [r for r in records if "reward/mean" in r]
    kl = [r["kl/probe_k1"] for r in steps]
    reward = [r["reward/mean"] for r in steps]
    length = [r["response/length_mean"] for r in steps]
    evals = [r for r in records if "eval/accuracy" in r]
    tail = max(1, len(kl) // 10)
    return RunStats(
        arm=arm, seed=seed, kl_slope_early=slope(kl[:early]), kl_oscillation=std(diffs(kl)),
        kl_spikes=count_spikes(kl), kl_final=sum(kl[-tail:]) / tail,
        reward_smoothness=std(diffs(reward)), reward_early=sum(reward[:early]) / max(1, len(reward[:early])),
        steps_to_threshold=first_reaching(reward, threshold),
        eval_accuracy=evals[-1]["eval/accuracy"], eval_accuracy_greedy=evals[-1]["eval/accuracy_greedy"],
        length_std=std(length), wall_s=wall_s)


# ----------------------------------------------------------------------------- report


METRICS = (  # (field, label, better: "lower" | "higher")
    ("kl_slope_early", "KL slope, first steps (nats/token/step)", "lower"),
    ("kl_oscillation", "KL oscillation (std of step change)", "lower"),
    ("kl_spikes", "KL spikes (count)", "lower"),
    ("kl_final", "KL at the end (nats/token)", "lower"),
    ("reward_smoothness", "reward roughness (std of step change)", "lower"),
    ("reward_early", "mean reward, first steps", "higher"),
    ("steps_to_threshold", "steps to reward threshold (-1 never)", "lower"),
    ("eval_accuracy", "final held-out accuracy (sampled)", "higher"),
    ("eval_accuracy_greedy", "final held-out accuracy (greedy)", "higher"),
    ("length_std", "response-length std over steps", "lower"),
    ("wall_s", "wall time (s)", "lower"),
)

CLAIMS = (  # (claim, field, the direction the claim predicts for pf_ppo vs ppo)
    ("KL rises more gently with the pool", "kl_slope_early", "lower"),
    ("KL oscillates less with the pool", "kl_oscillation", "lower"),
    ("fewer KL spikes with the pool", "kl_spikes", "lower"),
    ("reward is smoother with the pool", "reward_smoothness", "lower"),
    ("early reward may lag with the pool", "reward_early", "lower"),
    ("final accuracy is no worse with the pool", "eval_accuracy", "not_lower"),
)


def _mean_sd(vals: list[float]) -> tuple[float, float]:
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else 0.0)


def claim_verdicts(stats: list[RunStats]) -> list[tuple[str, str, str]]:
    """(claim, numbers, verdict) from the per-arm means and the seed-to-seed spread."""
    out = []
    for claim, field, direction in CLAIMS:
        a = [getattr(s, field) for s in stats if s.arm == "ppo"]
        b = [getattr(s, field) for s in stats if s.arm == "pf_ppo"]
        (ma, sa), (mb, sb) = _mean_sd(a), _mean_sd(b)
        noise = math.sqrt((sa**2 + sb**2) / max(1, min(len(a), len(b))))
        diff = mb - ma
        if direction == "not_lower":
            ok = diff >= -noise
            verdict = "holds" if ok else "does not hold"
        else:
            wanted = diff < 0 if direction == "lower" else diff > 0
            if abs(diff) <= noise:
                verdict = "not resolved (difference within seed noise)"
            else:
                verdict = "holds" if wanted else "opposite"
        out.append((claim, f"ppo {ma:.4g} ± {sa:.2g} vs pf_ppo {mb:.4g} ± {sb:.2g}", verdict))
    return out


def write_report(stats: list[RunStats], curves: dict[str, list[list[dict]]], out: Path, *,
                 title: str, settings: str) -> Path:
    lines = [f"# {title}", "", settings, "", "## Every run", "",
             "| arm | seed | " + " | ".join(label for _, label, _ in METRICS) + " |",
             "|---|---|" + "---|" * len(METRICS)]
    for s in stats:
        lines.append(f"| {s.arm} | {s.seed} | " + " | ".join(f"{getattr(s, f):.4g}" for f, _, _ in METRICS) + " |")
    lines += ["", "## Per arm (mean ± std over seeds)", "", "| metric | ppo | pf_ppo | better |", "|---|---|---|---|"]
    for f, label, better in METRICS:
        ma, sa = _mean_sd([getattr(s, f) for s in stats if s.arm == "ppo"])
        mb, sb = _mean_sd([getattr(s, f) for s in stats if s.arm == "pf_ppo"])
        lines.append(f"| {label} | {ma:.4g} ± {sa:.2g} | {mb:.4g} ± {sb:.2g} | {better} |")
    lines += ["", "## The claims", "", "| claim | numbers | verdict |", "|---|---|---|"]
    lines += [f"| {c} | {n} | {v} |" for c, n, v in claim_verdicts(stats)]
    png = _plot(curves, out / "compare.png")
    lines += ["", f"![curves]({png.name})", ""]
    md = out / "report.md"
    md.write_text("\n".join(lines))
    (out / "runs.json").write_text(json.dumps([asdict(s) for s in stats], indent=2))
    return md


def _plot(curves: dict[str, list[list[dict]]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = (("kl/probe_k1", "KL(current || reference), on-policy probe"), ("reward/mean", "reward"),
            ("eval/accuracy", "held-out accuracy (sampled)"), ("response/length_mean", "response length"))
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.5))
    colors = {"ppo": "tab:blue", "pf_ppo": "tab:orange"}
    for ax, (key, label) in zip(axes, keys):
        for arm, runs in curves.items():
            for i, recs in enumerate(runs):
                pts = [(r["step"], r[key]) for r in recs if key in r]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], color=colors[arm], alpha=0.6,
                        label=arm if i == 0 else None)
        ax.set_title(label)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- driver


def main(argv: list[str]) -> int:
    from pfppo_mega.config import load_config, load_config_cli
    from pfppo_mega.trainer.loop import PPOTrainer
    from pfppo_mega.trainer.metrics import read_jsonl

    ap = argparse.ArgumentParser(prog="pfppo compare", description=__doc__)
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*", help="key.path=value, applied to both arms")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--out", default=None, help="default: <logging.output_dir>_compare")
    ap.add_argument("--early", type=int, default=30, help="steps counted as 'first steps'")
    ap.add_argument("--kl-probe", type=int, default=128, help="prompts of the per-step on-policy KL probe")
    ap.add_argument("--threshold", type=float, default=0.75, help="reward threshold for steps-to-threshold")
    args = ap.parse_args(argv)

    base = load_config_cli("pfppo compare", args.config, args.overrides)  # exit 2 if bad
    out = Path(args.out or f"{base.logging.output_dir}_compare")
    out.mkdir(parents=True, exist_ok=True)
    stats, curves = [], {arm: [] for arm in ARMS}
    for seed in range(1, args.seeds + 1):
        for arm in ARMS:
            run_dir = out / arm / f"seed{seed}"
            cfg = load_config(args.config, [*args.overrides, f"training.seed={seed}",
                                            f"algorithm.use_pf_ppo={'true' if arm == 'pf_ppo' else 'false'}",
                                            f"logging.output_dir={run_dir}", "checkpoint.resume=false",
                                            f"logging.kl_probe_size={args.kl_probe}",
                                            "checkpoint.export_hf=false", "logging.progress=false"])
            if (run_dir / "metrics.jsonl").exists():
                (run_dir / "metrics.jsonl").unlink()
            print(f"[compare] {arm} seed {seed} -> {run_dir}", flush=True)
            t0 = time.monotonic()
            res = PPOTrainer(cfg, log=lambda *_: None).fit()
            recs = read_jsonl(res.metrics_path)
            stats.append(run_stats(arm, seed, recs, early=args.early, threshold=args.threshold,
                                   wall_s=time.monotonic() - t0))
            curves[arm].append(recs)
            s = stats[-1]
            print(f"[compare]   kl_slope {s.kl_slope_early:.2e} kl_osc {s.kl_oscillation:.4f} "
                  f"reward_rough {s.reward_smoothness:.4f} eval {s.eval_accuracy:.3f} ({s.wall_s:.0f}s)", flush=True)
    p = base.algorithm.pool
    settings = (f"Config `{args.config}` {' '.join(args.overrides)}; {base.training.total_training_steps} steps, "
                f"seeds 1..{args.seeds}; pf_ppo arm: pool_size {p.pool_size}, snapshot_interval "
                f"{p.snapshot_interval}, sampling {p.sampling}, is_mode {p.is_mode}, is_clip {p.is_clip}. "
                f"'First steps' = {args.early}; reward threshold {args.threshold}.")
    md = write_report(stats, curves, out, title="PF-PPO pool off vs on", settings=settings)
    print(md.read_text())
    print(f"[compare] report: {md}")
    return 0
