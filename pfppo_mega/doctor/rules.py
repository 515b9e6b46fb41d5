"""The doctor's rules: one small object per symptom of the PF-PPO article's troubleshooting advice.

A rule names the symptom, the metrics that show it, a detector, the likely cause and the remedies
in the article's order (one change at a time: the first, rerun, then the next). Detectors are pure
functions over the metric series (steps and floats read from metrics.jsonl); every threshold is a
named constant below, documented where it is defined. docs/troubleshooting.md is generated from
this registry (pfppo_mega/doctor/table.py), so the table and the doctor cannot drift.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence


@dataclass(frozen=True)
class Series:
    """One metric over a run: the steps that logged it and its values there (NaN kept)."""

    steps: list[int]
    values: list[float]

    def finite(self) -> "Series":
        keep = [(s, v) for s, v in zip(self.steps, self.values) if math.isfinite(v)]
        return Series([s for s, _ in keep], [v for _, v in keep])

    def __len__(self) -> int:
        return len(self.values)


@dataclass(frozen=True)
class Verdict:
    """What a detector saw: a finding (with evidence lines and the steps it points at), healthy,
    or not checked (with the reason: a metric missing, too few points)."""

    status: str                  # "finding", "healthy" or "not_checked"
    evidence: list[str] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)


def finding(evidence: list[str], steps: Sequence[int]) -> Verdict:
    return Verdict("finding", evidence, sorted(set(steps)))


HEALTHY = Verdict("healthy")


def not_checked(reason: str) -> Verdict:
    return Verdict("not_checked", [reason])


@dataclass(frozen=True)
class Remedy:
    action: str
    key: Optional[str] = None                             # config key to change, if any
    suggest: Optional[Callable[[Any], Any]] = None        # current value -> suggested value
    suggest_text: str = ""                                # the suggestion in words (the table)
    default_from: Optional[str] = None                    # the key a null current value defaults to


@dataclass(frozen=True)
class Rule:
    name: str
    symptom: str
    metrics: tuple[str, ...]
    detect: Callable[[Mapping[str, Series], Optional[Mapping[str, Any]]], Verdict]
    detects: str                 # the detector's rule and thresholds in words (from the constants)
    cause: str
    remedies: tuple[Remedy, ...]

    @property
    def key(self) -> Optional[str]:
        """The config key to change first."""
        return next((r.key for r in self.remedies if r.key), None)


# ----------------------------------------------------------------------------- helpers


def _median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def _mean(xs: Sequence[float]) -> float:
    return math.fsum(xs) / len(xs)


def _quarter(n: int) -> int:
    return max(1, n // 4)


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def config_value(config: Optional[Mapping[str, Any]], key: str) -> Any:
    """The value of dotted `key` in a run's config.yaml (a plain mapping), or None."""
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _at(series: Mapping[str, Series], key: str, step: int) -> Optional[float]:
    s = series.get(key)
    if s is None or step not in s.steps:
        return None
    return s.values[s.steps.index(step)]


# ----------------------------------------------------------------------------- KL spike

KL_METRIC = "kl/ref_mean"
KL_PROBE_METRIC = "kl/probe_k1"  # on-policy KL(current || ref) of fresh samples (logging.kl_probe_size):
                                 # read first when logged. kl/ref_mean is the training batch's, whose rows
                                 # come from older snapshots too with PF-PPO: it jumps when a snapshot does
KL_IS_METRIC = "kl/ref_mean_is"  # the training batch's KL weighted by its importance weights (PF-PPO,
                                 # async_rl): read next. Unweighted, one token an older version wrote that
                                 # the updates since made unlikely can be the whole step's kl/ref_mean
                                 # (docs/async.md, "KL on stale rows")
KL_WINDOW = 10        # baseline: median m of up to the 10 preceding values
KL_MIN_HISTORY = 5    # no verdict on a step with fewer than 5 preceding values
KL_SPIKE_RATIO = 3.0  # a spike: value - m > (3 - 1) x |m| (value > 3 m for a positive m) ...
KL_SPIKE_MIN = 0.01   # ... and > 0.01 nats/token (a KL near 0 tripling is noise) ...
KL_SPIKE_Z = 5.0      # ... and > 5 robust standard deviations of the window (1.4826 x its median
                      # absolute deviation): the k1 estimator is noisy and can be negative, so a
                      # ratio alone would flag noise around a median near or below 0


def spike_indices(values: Sequence[float], *, window: int = KL_WINDOW, min_history: int = KL_MIN_HISTORY,
                  ratio: float = KL_SPIKE_RATIO, min_jump: float = KL_SPIKE_MIN,
                  z: float = KL_SPIKE_Z) -> list[tuple[int, float]]:
    """(index, baseline m) of every value whose rise over the median m of the `window` values before it
    exceeds min_jump, (ratio - 1) x |m| and z robust standard deviations of that window; indices with
    fewer than `min_history` values before them are not judged."""
    out = []
    for i in range(min_history, len(values)):
        before = values[max(0, i - window):i]
        m = _median(before)
        sigma = 1.4826 * _median([abs(v - m) for v in before])
        if values[i] - m > max(min_jump, (ratio - 1) * abs(m), z * sigma):
            out.append((i, m))
    return out


def kl_series(series: Mapping[str, Series]) -> tuple[str, Optional[Series]]:
    """(metric, finite series) the KL rules read: the on-policy probe when it has enough values, else
    the training batch's importance-weighted KL when it has, else the training batch's KL."""
    for key in (KL_PROBE_METRIC, KL_IS_METRIC):
        s = series.get(key)
        if s is not None and len(s.finite()) > KL_MIN_HISTORY:
            return key, s.finite()
    s = series.get(KL_METRIC)
    return KL_METRIC, (s.finite() if s is not None else None)


def detect_kl_spike(series: Mapping[str, Series], config: Optional[Mapping[str, Any]]) -> Verdict:
    metric, s = kl_series(series)
    if s is None:
        return not_checked(f"neither {KL_PROBE_METRIC} nor {KL_METRIC} logged")
    if len(s) <= KL_MIN_HISTORY:
        return not_checked(f"{len(s)} finite {metric} values; a spike needs more than {KL_MIN_HISTORY}")
    spikes = spike_indices(s.values)
    if not spikes:
        return HEALTHY
    lines = []
    for i, base in spikes[:5]:
        step = s.steps[i]
        extra = [f"{k} {_fmt(v)}" for k in ("response/length_max", "response/repetition_rate", "policy/approx_kl")
                 if (v := _at(series, k, step)) is not None]
        lines.append(f"step {step}: {metric} {_fmt(s.values[i])} vs median {_fmt(base)} of the "
                     f"{min(KL_WINDOW, i)} steps before" + ("; that step: " + ", ".join(extra) if extra else ""))
    if len(spikes) > 5:
        lines.append(f"... {len(spikes) - 5} more spike steps")
    if metric == KL_METRIC and config_value(config, "algorithm.use_pf_ppo") is True:
        lines.append(f"caution: with the pool on, {KL_METRIC} is the training batch's KL, whose rows come from "
                     f"older snapshots too; logging.kl_probe_size > 0 logs {KL_PROBE_METRIC} (on-policy), "
                     f"which this rule then reads")
    return finding(lines, [s.steps[i] for i, _ in spikes])


# ----------------------------------------------------------------------------- reward scale

REWARD_SCALE_MAX = 10.0  # median over steps of max(|reward/q10|, |reward/q90|) above 10: not O(1)


def detect_reward_scale(series: Mapping[str, Series], config: Optional[Mapping[str, Any]]) -> Verdict:
    lo, hi = series.get("reward/q10"), series.get("reward/q90")
    if lo is None or hi is None:
        return not_checked("reward/q10 and reward/q90 not logged")
    lo_by_step = dict(zip(lo.finite().steps, lo.finite().values))
    mags = [(st, max(abs(lo_by_step[st]), abs(v))) for st, v in zip(hi.finite().steps, hi.finite().values)
            if st in lo_by_step]
    if not mags:
        return not_checked("no finite reward quantiles")
    typical = _median([m for _, m in mags])
    if typical <= REWARD_SCALE_MAX:
        return HEALTHY
    scaling, clip = config_value(config, "reward.scaling"), config_value(config, "reward.clip_range")
    if scaling not in (None, "none") or clip is not None:
        return HEALTHY  # the trainer already rescales or clips what GAE sees
    worst = max(mags, key=lambda x: x[1])
    how = ("config.yaml absent: reward scaling unknown" if config is None
           else f"reward.scaling {scaling}, reward.clip_range {clip}: GAE sees these raw values")
    return finding([f"median over {len(mags)} steps of max(|reward/q10|, |reward/q90|) is {_fmt(typical)} "
                    f"(> {REWARD_SCALE_MAX:g}); largest {_fmt(worst[1])} at step {worst[0]}", how],
                   [worst[0]])


# ----------------------------------------------------------------------------- length / repetition

LEN_MIN_POINTS = 8       # the early and late quarters need at least 2 steps each
LENGTH_GROWTH = 1.5      # late-quarter mean length >= 1.5 x the early quarter's ...
LENGTH_MIN_TOKENS = 2.0  # ... and at least 2 tokens longer
FINISHED_MIN = 0.5       # late-quarter finished fraction under 0.5 ...
FINISHED_DROP = 0.2      # ... and at least 0.2 under the early quarter's: responses hit the limit
REPETITION_MAX = 0.3     # late-quarter repetition rate >= 0.3 ...
REPETITION_RISE = 0.1    # ... and at least 0.1 above the early quarter's


def early_late(values: Sequence[float]) -> tuple[float, float]:
    """Means of the first and the last quarter (at least one value each)."""
    q = _quarter(len(values))
    return _mean(values[:q]), _mean(values[-q:])


def detect_length_collapse(series: Mapping[str, Series], config: Optional[Mapping[str, Any]]) -> Verdict:
    length = series.get("response/length_mean")
    if length is None:
        return not_checked("response/length_mean not logged")
    length = length.finite()
    if len(length) < LEN_MIN_POINTS:
        return not_checked(f"{len(length)} steps of response/length_mean; needs {LEN_MIN_POINTS}")
    q = _quarter(len(length))
    late_steps = f"steps {length.steps[-q]}-{length.steps[-1]}"
    early_steps = f"steps {length.steps[0]}-{length.steps[q - 1]}"
    lines = []
    e, l = early_late(length.values)
    if l >= LENGTH_GROWTH * e and l - e >= LENGTH_MIN_TOKENS:
        lines.append(f"response/length_mean {_fmt(e)} ({early_steps}) -> {_fmt(l)} ({late_steps}): "
                     f"{l / e:.2f}x" if e > 0 else f"response/length_mean 0 -> {_fmt(l)}")
    for key, bad in (("response/finished_frac", lambda e, l: l < FINISHED_MIN and l <= e - FINISHED_DROP),
                     ("response/repetition_rate", lambda e, l: l >= REPETITION_MAX and l >= e + REPETITION_RISE)):
        s = series.get(key)
        if s is not None and len(s.finite()) >= LEN_MIN_POINTS:
            e2, l2 = early_late(s.finite().values)
            if bad(e2, l2):
                lines.append(f"{key} {_fmt(e2)} (first quarter) -> {_fmt(l2)} (last quarter)")
    limit = config_value(config, "algorithm.max_response_length")
    if lines and limit is not None:
        lines.append(f"algorithm.max_response_length is {limit}")
    return finding(lines, length.steps[-q:]) if lines else HEALTHY


# ----------------------------------------------------------------------------- value loss

VALUE_METRIC = "critic/value_loss"
VALUE_MIN_POINTS = 8
VALUE_ROLL = 5            # rolling-median window of the baseline
VALUE_GROWTH = 5.0        # last-quarter median > 5 x the lowest rolling median before it ...
VALUE_MIN = 1e-3          # ... and more than 1e-3 above it
VALUE_SPIKE_RATIO = 20.0  # or one step above 20 x the median of the 10 steps before it


def value_divergence(values: Sequence[float]) -> tuple[Optional[tuple[float, float]], list[tuple[int, float]]]:
    """((lowest rolling median before the last quarter, last-quarter median) when it grew by
    VALUE_GROWTH, else None; [(index, baseline)] of single-step spikes)."""
    q = _quarter(len(values))
    head = values[:-q]
    low = min(_median(head[max(0, i - VALUE_ROLL + 1):i + 1]) for i in range(len(head)))
    late = _median(values[-q:])
    growth = (low, late) if late > VALUE_GROWTH * low and late - low > VALUE_MIN else None
    spikes = spike_indices(values, ratio=VALUE_SPIKE_RATIO, min_jump=VALUE_MIN)
    return growth, spikes


def detect_value_divergence(series: Mapping[str, Series], config: Optional[Mapping[str, Any]]) -> Verdict:
    s = series.get(VALUE_METRIC)
    if s is None:
        return not_checked(f"{VALUE_METRIC} not logged")
    bad = [(st, v) for st, v in zip(s.steps, s.values) if not math.isfinite(v)]
    if bad:
        return finding([f"{VALUE_METRIC} is {v} at step {st}" for st, v in bad[:5]], [st for st, _ in bad])
    if len(s) < VALUE_MIN_POINTS:
        return not_checked(f"{len(s)} steps of {VALUE_METRIC}; needs {VALUE_MIN_POINTS}")
    growth, spikes = value_divergence(s.values)
    lines, steps = [], []
    if growth:
        q = _quarter(len(s))
        lines.append(f"{VALUE_METRIC}: median {_fmt(growth[1])} over steps {s.steps[-q]}-{s.steps[-1]} vs "
                     f"{_fmt(growth[0])} at its lowest before ({growth[1] / growth[0]:.1f}x)"
                     if growth[0] > 0 else f"{VALUE_METRIC}: median {_fmt(growth[1])} late, 0 before")
        steps += s.steps[-q:]
    for i, base in spikes[:5]:
        gn = _at(series, "critic/grad_norm", s.steps[i])
        lines.append(f"step {s.steps[i]}: {VALUE_METRIC} {_fmt(s.values[i])} vs median {_fmt(base)} before"
                     + (f"; critic/grad_norm {_fmt(gn)}" if gn is not None else ""))
        steps.append(s.steps[i])
    return finding(lines, steps) if lines else HEALTHY


# ----------------------------------------------------------------------------- pool consistency

# Every data-parallel rank logs its own pool counts and the record holds their mean
# (trainer/metrics.py aggregate_rank_metrics): a fractional count means the ranks disagreed.
POOL_COUNTS = ("pool/size", "pool/snapshots_used")
POOL_CORRUPT = "guard/corrupt_snapshots"  # a running count: any increase is a finding
FRACTION_TOL = 1e-6


def detect_pool_inconsistency(series: Mapping[str, Series], config: Optional[Mapping[str, Any]]) -> Verdict:
    present = [k for k in (*POOL_COUNTS, POOL_CORRUPT) if k in series]
    if not present:
        return not_checked("no pool/* metrics (plain PPO run)")
    lines, steps = [], []
    for key in POOL_COUNTS:
        s = series.get(key)
        if s is None:
            continue
        frac = [(st, v) for st, v in zip(s.steps, s.values)
                if not math.isfinite(v) or abs(v - round(v)) > FRACTION_TOL]
        for st, v in frac[:3]:
            lines.append(f"step {st}: {key} {_fmt(v)} is not a whole number: the data-parallel ranks "
                         f"held different pools (the record is their mean)")
        steps += [st for st, _ in frac]
    c = series.get(POOL_CORRUPT)
    if c is not None:
        prev = 0.0
        for st, v in zip(c.steps, c.values):
            if v > prev:
                lines.append(f"step {st}: {POOL_CORRUPT} {prev:g} -> {v:g} (a snapshot failed its checksum "
                             f"and was evicted)")
                steps.append(st)
            prev = max(prev, v)
    return finding(lines, steps) if lines else HEALTHY


# ----------------------------------------------------------------------------- engine/trainer gap unchecked

# rollout/logp_gap_* compare the engine's log-probs with the trainer's on the rows the current weights
# wrote (trainer/step_metrics.py); rollout/logp_gap_rows counts them, 0 where there were none.
GAP_ROWS = "rollout/logp_gap_rows"
GAP_CHECK_ROWS = "rollout/logp_gap_check_rows"  # the periodic check on an older version's rows (async_rl)
GAP_UNCHECKED_SHARE = 0.9  # a finding when the check covered no row in >= 90% of the steps after the first
GAP_MIN_STEPS = 3          # ... of at least 3 such steps


def detect_engine_gap_unchecked(series: Mapping[str, Series], config: Optional[Mapping[str, Any]]) -> Verdict:
    s = series.get(GAP_ROWS)
    if s is None:
        return not_checked(f"no {GAP_ROWS} (logged since issue 39's fix)")
    older = series.get(GAP_CHECK_ROWS)
    if older is not None and any(v > 0 for v in older.values):
        return HEALTHY  # the periodic check scored rows of older versions (algorithm.async_rl.logp_check_interval)
    first = min(s.steps, default=0)
    later = [(st, v) for st, v in zip(s.steps, s.values) if st > first]
    if len(later) < GAP_MIN_STEPS:
        return not_checked(f"{len(later)} steps after the first (< {GAP_MIN_STEPS})")
    empty = [st for st, v in later if v == 0]
    if len(empty) < GAP_UNCHECKED_SHARE * len(later):
        return HEALTHY
    why = ("every row came from an older version (algorithm.async_rl: generation runs ahead of training)"
           if config_value(config, "algorithm.async_rl.enable") else
           "every row came from an older snapshot (the PF-PPO pool)" if config_value(config, "algorithm.use_pf_ppo")
           else "no row was generated by the current weights")
    shown = ", ".join(str(st) for st in empty[:5]) + (", ..." if len(empty) > 5 else "")
    return finding([f"{GAP_ROWS} 0 in {len(empty)} of the {len(later)} steps after the first (steps {shown}): "
                    f"{why}, so the engine's log-probs were compared with the trainer's on no row there and a "
                    f"numerics mismatch (the engine's dtype, a weight push gone wrong) would go unseen"], empty)



# The honest metric first when the run logs it apart (reward.shaping): eval/accuracy is then the
# trained-on reward's mean on the held-out prompts and rises with the hack.
HACK_METRICS = ("eval/honest_accuracy", "eval/honest_accuracy_greedy", "eval/accuracy", "eval/accuracy_greedy")
ACC_DROP = 0.05         # the last held-out accuracy at least 0.05 under its best ...
HACK_WINDOW = 5         # ... while the mean reward of the last 5 steps ...
REWARD_RISE_STD = 0.25  # ... exceeds that of the 5 steps up to the best evaluation by 0.25 x the
REWARD_RISE_ABS = 0.05  # median reward/std (0.05 when reward/std is not logged)


def hacking_check(reward: Series, acc: Series, reward_std: Optional[float]) -> Optional[tuple[int, float, float, float]]:
    """(best eval step, its accuracy, reward rise, threshold) when the trained-on reward rose after
    the best held-out accuracy while the accuracy fell by ACC_DROP; else None."""
    best = max(range(len(acc)), key=lambda i: acc.values[i])  # earliest best
    best_step, best_acc = acc.steps[best], acc.values[best]
    if acc.values[-1] > best_acc - ACC_DROP or acc.steps[-1] <= best_step:
        return None
    before = [v for st, v in zip(reward.steps, reward.values) if st <= best_step][-HACK_WINDOW:]
    if not before:
        before = reward.values[:HACK_WINDOW]
    after = reward.values[-HACK_WINDOW:]
    rise = _mean(after) - _mean(before)
    threshold = REWARD_RISE_STD * reward_std if reward_std else REWARD_RISE_ABS
    return (best_step, best_acc, rise, threshold) if rise > threshold else None


def detect_reward_hacking(series: Mapping[str, Series], config: Optional[Mapping[str, Any]]) -> Verdict:
    reward = series.get("reward/mean")
    if reward is None or len(reward.finite()) < 2 * HACK_WINDOW:
        return not_checked(f"reward/mean needs {2 * HACK_WINDOW} steps")
    reward = reward.finite()
    std = series.get("reward/std")
    reward_std = _median(std.finite().values) if std is not None and len(std.finite()) else None
    evals = [(k, series[k].finite()) for k in HACK_METRICS if k in series and len(series[k].finite()) >= 2]
    if any(k.startswith("eval/honest") for k, _ in evals):
        evals = [(k, s) for k, s in evals if k.startswith("eval/honest")]
    if not evals:
        return not_checked("fewer than 2 held-out evaluations (logging.eval_interval)")
    # the sampled metric decides (the reward is earned by sampled responses); a greedy fall alone is
    # the policy sharpening onto other answers, not hacking, and is quoted only beside a sampled fall
    deciding = {k for k, _ in evals if not k.endswith("_greedy")} or {k for k, _ in evals}
    lines, steps = [], []
    for key, acc in sorted(evals, key=lambda e: e[0] not in deciding):  # deciding metrics first
        hit = hacking_check(reward, acc, reward_std)
        if hit and (lines or key in deciding):
            best_step, best_acc, rise, threshold = hit
            lines.append(f"{key} {_fmt(best_acc)} at step {best_step} -> {_fmt(acc.values[-1])} at step "
                         f"{acc.steps[-1]}, while reward/mean rose by {_fmt(rise)} (> {_fmt(threshold)})")
            steps += [best_step, acc.steps[-1]]
    return finding(lines, steps) if lines else HEALTHY


# ----------------------------------------------------------------------------- noisy reward

# The honest metric falls while the trained-on reward stays flat: the reward does not follow what
# the task asks for (flipped labels, a noisy verifier or reward model). The reward is neither rising
# (reward_hacking's symptom) nor falling with the honest metric (then the reward still tracks it),
# no sample is marked hacked and the scale is O(1) (reward_scale's symptom). The sampled held-out
# metric of ~100 prompts moves by a few points from one evaluation to the next, so the fall is
# judged on a least-squares line through all evaluations AND on the last against the first.
NOISY_EVALS = ("eval/honest_accuracy", "eval/accuracy")  # the sampled held-out metric, honest first
NOISY_MIN_EVALS = 3       # evaluations needed (step 0 counts)
NOISY_ACC_DROP = 0.05     # the line through the evaluations falls by >= 0.05 over the run, and the
                          # last evaluation is >= 0.05 under the first
NOISY_FLAT = 0.25         # |trained-on reward change| along its least-squares line over the run
                          # <= 0.25 x the median reward/std (0.05 when reward/std is not logged)
NOISY_HACKED_MAX = 0.05   # mean reward/hacked_frac over the last quarter above 0.05: hacking, not noise


def _line_change(steps: Sequence[float], values: Sequence[float]) -> float:
    """Change from the first to the last step along the least-squares line through the points."""
    if len(values) < 2:
        return 0.0
    mx, my = _mean(steps), _mean(values)
    sxx = math.fsum((x - mx) ** 2 for x in steps)
    if sxx == 0:
        return 0.0
    return math.fsum((x - mx) * (y - my) for x, y in zip(steps, values)) / sxx * (steps[-1] - steps[0])


def _scale_mismatch(series: Mapping[str, Series], config: Optional[Mapping[str, Any]]) -> bool:
    return detect_reward_scale(series, config).status == "finding"


def detect_noisy_reward(series: Mapping[str, Series], config: Optional[Mapping[str, Any]]) -> Verdict:
    reward = series.get("reward/mean")
    if reward is None or len(reward.finite()) < LEN_MIN_POINTS:
        return not_checked(f"reward/mean needs {LEN_MIN_POINTS} steps")
    reward = reward.finite()
    key = next((k for k in NOISY_EVALS if k in series and len(series[k].finite()) >= NOISY_MIN_EVALS), None)
    if key is None:
        return not_checked(f"fewer than {NOISY_MIN_EVALS} held-out evaluations (logging.eval_interval)")
    acc = series[key].finite()
    fall = -_line_change(acc.steps, acc.values)
    if fall < NOISY_ACC_DROP or acc.values[0] - acc.values[-1] < NOISY_ACC_DROP:
        return HEALTHY
    std = series.get("reward/std")
    reward_std = _median(std.finite().values) if std is not None and len(std.finite()) else None
    flat = NOISY_FLAT * reward_std if reward_std else REWARD_RISE_ABS
    change = _line_change(reward.steps, reward.values)
    if abs(change) > flat:
        return HEALTHY  # rising: reward_hacking's symptom; falling with the honest metric: it tracks it
    hacked = series.get("reward/hacked_frac")
    if hacked is not None and len(hacked.finite()) and early_late(hacked.finite().values)[1] > NOISY_HACKED_MAX:
        return HEALTHY
    if _scale_mismatch(series, config):
        return HEALTHY
    lines = [f"{key} {_fmt(acc.values[0])} at step {acc.steps[0]} -> {_fmt(acc.values[-1])} at step "
             f"{acc.steps[-1]} (least-squares line: -{_fmt(fall)} over the run, >= {NOISY_ACC_DROP:g})",
             f"reward/mean flat: {_fmt(change)} along its line over steps {reward.steps[0]}-{reward.steps[-1]} "
             f"(|change| <= {_fmt(flat)}" + (f" = {NOISY_FLAT:g} x median reward/std {_fmt(reward_std)})"
                                           if reward_std else ")")]
    honest = series.get("reward/honest")
    if honest is not None and len(honest.finite()) >= LEN_MIN_POINTS:
        e, l = early_late(honest.finite().values)
        lines.append(f"reward/honest (training samples) {_fmt(e)} (first quarter) -> {_fmt(l)} (last quarter)")
    if hacked is not None and len(hacked.finite()):
        lines.append(f"reward/hacked_frac {_fmt(early_late(hacked.finite().values)[1])} in the last quarter: "
                     f"no exploit paid")
    worst = max(range(len(reward)), key=lambda i: reward.values[i])
    return finding(lines, [acc.steps[-1], reward.steps[worst]])


# ----------------------------------------------------------------------------- the registry


def _times(f: float) -> Callable[[Any], Any]:
    # 6 significant digits (not decimals: a learning rate of 1e-6 halved must not round to 0)
    return lambda v: float(f"{v * f:.6g}") if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _fixed(value: Any) -> Callable[[Any], Any]:
    return lambda _v: value


def _doubled(v: Any) -> Any:
    return 2 * v if isinstance(v, int) and not isinstance(v, bool) else None


def _shorter(v: Any) -> Any:
    return max(1, int(v * 0.75)) if isinstance(v, int) and not isinstance(v, bool) else None


RULES: tuple[Rule, ...] = (
    Rule(
        name="kl_spike",
        symptom="KL to the reference jumps within a step or two; the policy then gets worse and recovers slowly",
        metrics=(KL_PROBE_METRIC, KL_IS_METRIC, KL_METRIC, "response/length_max", "response/repetition_rate", "policy/approx_kl"),
        detect=detect_kl_spike,
        detects=f"`{KL_PROBE_METRIC}` (when logged; else `{KL_IS_METRIC}` when logged; else `{KL_METRIC}`) rises over the median m of the "
                f"{KL_WINDOW} steps before it by more than "
                f"{KL_SPIKE_MIN:g}, {KL_SPIKE_RATIO - 1:g} x |m| and {KL_SPIKE_Z:g} robust standard deviations "
                f"of those steps (judged from the {KL_MIN_HISTORY + 1}th value)",
        cause="a few extreme samples (very long or repetitive responses with large advantages) move "
              "the policy too far in one update",
        remedies=(
            Remedy("look at that step's longest and most repetitive samples and at the advantage magnitude "
                   "(a few samples usually drive the spike); fix the data or the reward if they are broken"),
            Remedy("tighten the PPO clip", "algorithm.clip_ratio", _fixed(0.1), "0.1"),
            Remedy("raise the KL coefficient by 30%", "algorithm.kl_coeff", _times(1.3), "x 1.3"),
            Remedy("clip rewards to their batch quantiles", "reward.quantile_clip", _fixed(0.95), "0.95"),
        ),
    ),
    Rule(
        name="reward_scale",
        symptom="rewards far from O(1) (e.g. in [-100, 100]) enter GAE unscaled",
        metrics=("reward/q10", "reward/q90"),
        detect=detect_reward_scale,
        detects=f"median over steps of max(|q10|, |q90|) > {REWARD_SCALE_MAX:g} with `reward.scaling: none` "
                f"and no `reward.clip_range`",
        cause="the reward's range is far larger than the value head's and the advantages': value "
              "loss and policy steps are dominated by the scale, not the signal",
        remedies=(
            Remedy("z-score the rewards over the batch", "reward.scaling", _fixed("batch_zscore"), "batch_zscore"),
            Remedy("or clip the scores to [-c, c]", "reward.clip_range", _fixed(5.0), "5.0"),
        ),
    ),
    Rule(
        name="length_collapse",
        symptom="responses grow longer, run into the length limit or repeat themselves",
        metrics=("response/length_mean", "response/finished_frac", "response/repetition_rate"),
        detect=detect_length_collapse,
        detects=f"last vs first quarter of the run (>= {LEN_MIN_POINTS} steps): length x {LENGTH_GROWTH:g} and "
                f"+{LENGTH_MIN_TOKENS:g} tokens, or finished fraction < {FINISHED_MIN:g} and down "
                f"{FINISHED_DROP:g}, or repetition rate >= {REPETITION_MAX:g} and up {REPETITION_RISE:g}",
        cause="the reward pays for length or does not punish padding / repetition: the policy learns "
              "longer but emptier answers",
        remedies=(
            Remedy("tighten the response length limit first", "algorithm.max_response_length", _shorter, "x 0.75"),
            Remedy("then add a length penalty", "reward.length_penalty", _fixed(0.1), "0.1"),
        ),
    ),
    Rule(
        name="value_divergence",
        symptom="the critic's value loss grows or spikes instead of settling",
        metrics=(VALUE_METRIC, "critic/grad_norm"),
        detect=detect_value_divergence,
        detects=f"a non-finite value loss; or the last quarter's median > {VALUE_GROWTH:g} x the lowest "
                f"{VALUE_ROLL}-step rolling median before it; or one step > {VALUE_SPIKE_RATIO:g} x the "
                f"median of the {KL_WINDOW} before it (and {KL_SPIKE_Z:g} robust standard deviations above it)",
        cause="the value loss dominates the update (large returns, too high a weight) or the critic "
              "takes oversized gradient steps",
        remedies=(
            Remedy("lower the value-loss weight", "algorithm.vf_coef", _times(0.5), "x 0.5"),
            Remedy("clip the critic's gradients separately, harder than the actor's", "training.critic_grad_clip",
                   _times(0.5), "x 0.5", default_from="training.grad_clip"),
        ),
    ),
    Rule(
        name="pool_inconsistency",
        symptom="the data-parallel ranks' pools disagree or a snapshot fails its checksum",
        metrics=(*POOL_COUNTS, POOL_CORRUPT),
        detect=detect_pool_inconsistency,
        detects="a fractional `pool/size` or `pool/snapshots_used` (the record is the ranks' mean: "
                "they disagreed), or any increase of `guard/corrupt_snapshots`",
        cause="ranks resumed from different checkpoints or sampled with different seeds, or a "
              "snapshot in host memory was corrupted; the off-policy correction is then wrong",
        remedies=(
            Remedy("read the run's log at the first step listed: the version assignment (pool/assignment.py) "
                   "names the rank and both versions when ranks generate with different weights"),
            Remedy("resume every rank from the last good checkpoint, which restores one pool on all of them",
                   "checkpoint.resume", _fixed(True), "true"),
            Remedy("rule the pool out: rerun the same steps with plain PPO", "algorithm.use_pf_ppo",
                   _fixed(False), "false"),
        ),
    ),
    Rule(
        name="engine_gap_unchecked",
        symptom="the engine-vs-trainer log-prob check (rollout/logp_gap_*) is missing from most steps",
        metrics=(GAP_ROWS, GAP_CHECK_ROWS, "rollout/logp_gap_max"),
        detect=detect_engine_gap_unchecked,
        detects=f"`{GAP_ROWS}` is 0 in >= {GAP_UNCHECKED_SHARE:.0%} of the steps after the first (at least "
                f"{GAP_MIN_STEPS} of them) and `{GAP_CHECK_ROWS}` never above 0",
        cause="the gap is measured only on rows the current weights wrote; in the asynchronous mode (and with "
              "a PF-PPO pool drawn per step) the rows come from older versions, so the check sees nothing",
        remedies=(
            Remedy("asynchronous runs: check older versions' rows every few steps (their weights kept on the "
                   "host until their rows arrive; rollout/logp_gap_check_*)", "algorithm.async_rl.logp_check_interval",
                   _fixed(10), "10"),
            Remedy("or measure the gap on a few synchronous steps of the same config: rollout/logp_gap_max "
                   "should stay at round-off (about 1e-5 in fp32)", "algorithm.async_rl.enable",
                   _fixed(False), "false"),
            Remedy("or let some prompt groups take the current weights (PF-PPO): draw versions per group",
                   "algorithm.pool.assign", _fixed("group"), "group"),
        ),
    ),
    Rule(
        name="reward_hacking",
        symptom="the trained-on reward keeps rising while the held-out (honest) accuracy falls",
        metrics=("reward/mean", "reward/std", *HACK_METRICS),
        detect=detect_reward_hacking,
        detects=f"the last held-out accuracy (sampled; greedy only when no sampled one is logged) >= "
                f"{ACC_DROP:g} under its best, while mean reward of the last "
                f"{HACK_WINDOW} steps exceeds that of the {HACK_WINDOW} steps up to the best evaluation by "
                f"> {REWARD_RISE_STD:g} x median `reward/std`",
        cause="the policy found a way to score without solving the task (extra tokens, a fixed "
              "phrase the reward over-pays)",
        remedies=(
            Remedy("read the highest-reward samples for the exploit and fix the reward function",
                   "reward.custom_function.path"),
            Remedy("raise the KL coefficient by 30%", "algorithm.kl_coeff", _times(1.3), "x 1.3"),
            Remedy("if responses grew as well, add a length penalty", "reward.length_penalty",
                   _fixed(0.1), "0.1"),
        ),
    ),
    Rule(
        name="noisy_reward",
        symptom="the held-out (honest) accuracy falls while the trained-on reward stays flat",
        metrics=("reward/mean", "reward/std", *NOISY_EVALS, "reward/honest", "reward/hacked_frac"),
        detect=detect_noisy_reward,
        detects=f"the least-squares line through `{NOISY_EVALS[0]}` (else `{NOISY_EVALS[1]}`; >= "
                f"{NOISY_MIN_EVALS} evaluations) falls by >= {NOISY_ACC_DROP:g} and the last evaluation is "
                f">= {NOISY_ACC_DROP:g} under the first, while `reward/mean` changes by <= {NOISY_FLAT:g} x "
                f"median `reward/std` along its line, no more than {NOISY_HACKED_MAX:g} of the last quarter's "
                f"samples are marked hacked and the `reward_scale` rule does not fire",
        cause="the reward does not follow the task (labels flipped or a noisy verifier / reward model): "
              "the policy follows the noise, and the updates move it away from what was right",
        remedies=(
            Remedy("check the reward labels / the verifier on the run's highest-reward samples "
                   "(samples_worst.jsonl: a wrong answer scored high, a right one low) and fix them first",
                   "reward.custom_function.path"),
            Remedy("take smaller steps: lower the learning rate", "training.lr", _times(0.5), "x 0.5"),
            Remedy("raise the KL coefficient by 30%", "algorithm.kl_coeff", _times(1.3), "x 1.3"),
            Remedy("clip rewards to their batch quantiles (outlier scores of a reward model)",
                   "reward.quantile_clip", _fixed(0.95), "0.95"),
            Remedy("average the noise over more samples: a larger rollout batch", "training.rollout_batch_size",
                   _doubled, "x 2"),
        ),
    ),
)

RULES_BY_NAME = {r.name: r for r in RULES}
