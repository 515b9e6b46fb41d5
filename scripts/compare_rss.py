"""The resident memory of `pfppo compare` itself across a 3-arm tiny compare with the vLLM engine
(ppo, pf_short, grpo; 1 seed, 2 steps each on tests/test_trainer.py's TINY model, warm-started by 10
SFT steps). `compare.py` is this tree's, or with --rev REV the one of that git revision (e.g. the
in-process compare before its runs got processes of their own). Prints one JSON line: RSS at start,
after each run, at the end and the peak (sampled every 0.25 s), in MB.

    PYTHONPATH=. .venv/bin/python scripts/compare_rss.py WORKDIR [--rev REV]
"""

from __future__ import annotations

import argparse
import builtins
import importlib.util
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rss_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def compare_module(rev: str | None, work: Path):
    if rev is None:
        from pfppo_mega.experiments import compare
        return compare
    path = work / f"compare_{rev}.py"
    path.write_text(subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:pfppo_mega/experiments/compare.py"],
                                   check=True, capture_output=True, text=True).stdout)
    spec = importlib.util.spec_from_file_location(f"compare_{rev}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def tiny_config(work: Path) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    from pfppo_mega.config import load_config_dict
    from pfppo_mega.sft import run_sft
    from test_trainer import TINY

    sft = work / "sft"
    if not (sft / "model.safetensors").is_file():
        d = json.loads(json.dumps(TINY))
        d["sft"].update(output_dir=str(sft), steps=10)
        d["actor_rollout"] = {"model_path": str(sft)}
        run_sft(load_config_dict(d), log=lambda *_: None)
    d = json.loads(json.dumps(TINY))
    d["actor_rollout"] = {"model_path": str(sft), "engine": "vllm"}
    d["training"]["total_training_steps"] = 2
    d["data"]["eval_size"] = 16
    d["logging"]["output_dir"] = str(work / "run")
    cfg = work / "tiny.yaml"
    cfg.write_text(json.dumps(d))  # JSON is YAML
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("work")
    ap.add_argument("--rev", default=None)
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    cfg = tiny_config(work)
    mod = compare_module(args.rev, work)
    samples, stop = [], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append(rss_mb())
            time.sleep(0.25)

    threading.Thread(target=sample, daemon=True).start()
    real_print, after_run = builtins.print, []

    def marking_print(*a, **k):  # a run's "[compare]   reward ..." line is printed once it is over
        real_print(*a, **k)
        if a and isinstance(a[0], str) and a[0].startswith("[compare]   "):
            after_run.append(round(rss_mb()))

    start = rss_mb()
    builtins.print = marking_print
    try:
        rc = mod.main([str(cfg), "--seeds", "1", "--arms", "ppo,pf_short,grpo", "--out",
                       str(work / f"cmp_{args.rev or 'tree'}"), "--kl-probe", "8", "--early", "1"])
    finally:
        builtins.print = real_print
        stop.set()
    print(json.dumps({"compare": args.rev or "this tree", "rc": rc, "rss_start_mb": round(start),
                      "rss_after_each_run_mb": after_run, "rss_end_mb": round(rss_mb()),
                      "rss_peak_mb": round(max(samples))}))


if __name__ == "__main__":
    main()
