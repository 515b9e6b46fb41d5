"""Metric sinks: JSONL (always), TensorBoard, a progress line, and PNG plots at the end."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch

from pfppo_mega.trainer.checkpoint.store import atomic_write_bytes

# Curves plotted at the end of a run: (metric key, panel title).
PLOTTED = (
    ("reward/mean", "reward (mean)"),
    ("eval/accuracy", "held-out accuracy (sampled)"),
    ("eval/accuracy_greedy", "held-out accuracy (greedy)"),
    ("kl/ref_mean", "KL to reference (nats/token)"),
    ("policy/entropy_first10", "entropy of first 10 tokens"),
    ("response/length_mean", "response length"),
    ("policy/clipfrac", "clip fraction"),
    ("critic/value_loss", "value loss"),
    ("policy/approx_kl", "approx KL (old vs new)"),
)


class MetricsLogger:
    def __init__(self, out_dir: Path, *, tensorboard: bool, progress: bool, total_steps: int,
                 enabled: bool = True, start_step: int = 0):
        """enabled=False (every rank but global rank 0): accept records, write nothing.

        start_step: the step the run starts (or resumes) at. Records of later steps already in
        metrics.jsonl (written after the checkpoint the run resumed from, or by an earlier run in
        this directory) are dropped first, so that no step appears twice; a fresh run (0) starts
        an empty file. TensorBoard events after start_step are purged likewise."""
        self.enabled = enabled
        self.out_dir = out_dir
        self.jsonl_path = out_dir / "metrics.jsonl"
        self.progress = progress
        self.total_steps = total_steps
        self.t0 = time.monotonic()
        self.first_step: int | None = None
        if enabled:
            truncate_jsonl(self.jsonl_path, keep_through_step=start_step if start_step > 0 else -1)
        self._jsonl = open(self.jsonl_path, "a", buffering=1) if enabled else None
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(out_dir / "tensorboard"), purge_step=start_step + 1 if start_step else None)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in metrics.items()}
        self._jsonl.write(json.dumps({"step": step, **clean}) + "\n")
        if self._tb is not None:
            for k, v in clean.items():
                if math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
        if self.progress:
            self._print_progress(step, clean)

    def _print_progress(self, step: int, m: dict[str, float]) -> None:
        if self.first_step is None:
            self.first_step, self.t0 = step, time.monotonic()
            eta = "?"
        else:
            rate = (step - self.first_step) / max(time.monotonic() - self.t0, 1e-9)
            eta = f"{(self.total_steps - step) / rate:.0f}s" if rate > 0 else "?"
        if "reward/mean" not in m:  # an evaluation-only record (step 0)
            print(f"step {step:>4}/{self.total_steps}  " + "  ".join(
                f"{k.split('/')[-1]} {v:.3f}" for k, v in m.items()), flush=True)
            return
        parts = [f"step {step:>4}/{self.total_steps}",
                 f"reward {m.get('reward/mean', float('nan')):.3f}",
                 f"kl {m.get('kl/ref_mean', float('nan')):.4f}",
                 f"ent10 {m.get('policy/entropy_first10', float('nan')):.3f}",
                 f"len {m.get('response/length_mean', float('nan')):.1f}"]
        if "eval/accuracy" in m:
            parts.append(f"eval_acc {m['eval/accuracy']:.3f} (greedy {m['eval/accuracy_greedy']:.3f})")
        parts.append(f"{m.get('perf/step_s', float('nan')):.2f}s/step  ETA {eta}")
        print("  ".join(parts), file=sys.stdout, flush=True)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


def truncate_jsonl(path: Path, *, keep_through_step: int) -> int:
    """Rewrite the JSONL file at `path` atomically, keeping the records whose "step" is
    <= keep_through_step (a torn last line from a killed writer is dropped too). Returns the
    number of records dropped; a missing file is left missing."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    with open(path, "rb") as f:
        for raw in f:
            try:
                rec = json.loads(raw)
                keep = isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= keep_through_step
            except ValueError:
                keep = False
            if keep:
                kept.append(raw if raw.endswith(b"\n") else raw + b"\n")
            elif raw.strip():
                dropped += 1
    if dropped:
        atomic_write_bytes(path, b"".join(kept))
    return dropped


def read_jsonl(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_curves(records: list[dict], out_png: Path, *, title: str = "") -> Path:
    """One panel per PLOTTED metric present in the records; returns the PNG path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    present = [(k, t) for k, t in PLOTTED if any(k in r for r in records)]
    cols = 4
    rows = max(1, math.ceil(len(present) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
    for ax, (key, label) in zip(axes.flat, present):
        pts = [(r["step"], r[key]) for r in records if key in r]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="." if len(pts) < 30 else None)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(present):]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_png, dpi=90)
    plt.close(fig)
    return out_png


# ----------------------------------------------------------------------------- text statistics


def repetition_rate(tokens: list[int], n: int = 2) -> float:
    """Fraction of the response's n-grams that already occurred earlier in it."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    if not grams:
        return 0.0
    return 1.0 - len(set(grams)) / len(grams)


def quantiles(x: torch.Tensor, qs=(0.1, 0.5, 0.9)) -> dict[str, float]:
    x = x.float()
    return {f"q{int(q * 100)}": torch.quantile(x, q).item() for q in qs}


# ----------------------------------------------------------------------------- data-parallel aggregation


# rollout/multiturn.py's TurnStats.metrics counts (each rank's rows): the job's count is their sum
MULTI_TURN_COUNTS = ("rollout/tool_call_errors", "rollout/tokenization_mismatches", "rollout/tool_calls_dropped",
                     "rollout/cut_before_answer", "rollout/interaction_turns")


def _rule(key: str) -> str:
    """How one metric combines over data-parallel ranks (each rank saw its own part of the batch).

    max:  maxima and the slowest rank's times        (*_max, */max, time/*, perf/step_s, perf/step_end_s)
    sum:  rates and counts of the rank's own rows     (perf/tokens_per_s, */count, rollout/logp_gap_*rows,
          the multi-turn counts: MULTI_TURN_COUNTS, tool/<name>/calls, /errors and /timeouts)
    same: counters that are already global            (guard/*: every rank holds the total; max)
    mean: everything else (means over equal-sized per-rank shares)
    """
    if key in ("perf/step_s", "perf/step_end_s") or key.startswith("time/") or key.endswith(("_max", "/max")):
        return "max"
    if key in ("perf/tokens_per_s", "rollout/logp_gap_rows", "rollout/logp_gap_check_rows") or key.endswith("/count"):
        return "sum"
    if key in MULTI_TURN_COUNTS or (key.startswith("tool/") and key.endswith(("/calls", "/errors", "/timeouts"))):
        return "sum"
    if key.startswith("guard/"):
        return "same"
    return "mean"


def aggregate_rank_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """One record from every data-parallel rank's record (keys may differ: a rank that has no value
    for a key, e.g. no on-policy rows, does not take part in it). Keys sorted."""
    keys = sorted(set().union(*per_rank))
    out = {}
    for k in keys:
        vals = [m[k] for m in per_rank if k in m]
        rule = _rule(k)
        if rule == "max":
            out[k] = max(vals)
        elif rule == "sum":
            out[k] = math.fsum(vals)
        elif rule == "same":  # equal on every rank; max, so a rank behind never hides a count
            out[k] = max(vals)
        else:
            out[k] = math.fsum(vals) / len(vals)
    return out
