"""`pfppo bench checkpoint`: what a sharded checkpoint costs each rank, on CPU (gloo).

    pfppo bench checkpoint [--layouts tp2dp2,pp2] [--hidden 512] [--layers 4] [--json PATH]

For each layout, one torchrun launch trains a model of the given shape one PPO step (so the
optimizers hold moments) with parallel.use_distributed_optimizer, then every rank measures:

    step_s            a training step with no save in flight
    blocked_s         how long resume.save holds the training thread (the host copy)
    step_during_s     the next training step, run while the background write goes on
    save_s            save() to committed on every rank (resume.wait), background
    sync_save_s       a synchronous save (write, fsync, read-back hash, commit, barrier)
    load_s            resume.resume on the run: agree on the step, verify, reshard-free install
    part_bytes        this rank's part on disk (from the global manifest)
    save_peak_bytes / load_peak_bytes   peak RSS above the RSS before the operation

The figures are per rank and of this machine (its disk, its 2 cores shared by the ranks);
docs/checkpoints.md models the 70B layout from them and a stated file-system bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

LAYOUTS = {"tp2dp2": (2, 1, 4), "pp2": (1, 2, 2), "dp2": (1, 1, 2)}  # name -> (tp, pp, processes)


class PeakRSS:
    """Peak resident set size above the one at entry, sampled every 2 ms (/proc/self/statm)."""

    def __enter__(self) -> "PeakRSS":
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.base = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self._rss())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._rss())

    @property
    def bytes(self) -> int:
        return self.peak - self.base


def _config(args, work: Path) -> dict:
    h = args.hidden
    return {
        "model": {"num_layers": args.layers, "hidden_size": h, "ffn_hidden_size": 3 * h, "num_attention_heads": 4,
                  "num_query_groups": 2, "vocab_size": 16, "max_position_embeddings": 24, "rope_theta": 10000.0,
                  "norm_epsilon": 1e-5, "tie_word_embeddings": False},
        "data": {"num_digits": 1, "eval_size": 8, "max_prompt_length": 8},
        "training": {"rollout_batch_size": 16, "batch_size": 16, "lr": 1e-4, "critic_lr": 1e-4,
                     "total_training_steps": 100, "seed": 5, "num_threads": 1},
        "algorithm": {"kl_coeff": 0.01, "kl_estimator": "k1", "max_response_length": 4},
        "logging": {"eval_interval": 0, "tensorboard": False, "plots": False, "progress": False,
                    "output_dir": str(work / "runs")},
        "checkpoint": {"save_interval": 0, "resume": False, "export_hf": False, "keep_last": 2},
        "actor_rollout": {"model_path": str(work / "sft")},
        "sft": {"steps": 1, "batch_size": 8, "max_seconds": 0, "output_dir": str(work / "sft")},
    }


def worker(cfg_path: str, out_prefix: str) -> None:
    """One rank of a layout's launch (torchrun)."""
    import torch

    from pfppo_mega.config import load_config_dict
    from pfppo_mega.trainer.checkpoint import resume
    from pfppo_mega.trainer.loop import PPOTrainer

    torch.set_num_threads(1)
    d = json.loads(Path(cfg_path).read_text())
    tr = PPOTrainer(load_config_dict(d), log=lambda *_: None)
    run = tr.run
    root = run.out_dir / "checkpoints"
    tr.train_step()  # moments exist from here on
    t = time.perf_counter()
    tr.train_step()
    step_s = time.perf_counter() - t
    with PeakRSS() as save_peak:
        t0 = time.perf_counter()
        info = resume.save(run, root)
        t1 = time.perf_counter()
        tr.train_step()
        step_during = time.perf_counter() - t1
        resume.wait(root)
        save_s = time.perf_counter() - t0
    t = time.perf_counter()
    resume.save(run, root, background=False)
    resume.wait(root)
    sync_save_s = time.perf_counter() - t
    object.__setattr__(run.cfg.checkpoint, "resume", True)
    with PeakRSS() as load_peak:
        t = time.perf_counter()
        resume.resume(run)
        load_s = time.perf_counter() - t
    step_dir = root / f"step_{run.state.step:06d}"
    manifest = json.loads((step_dir / "manifest.json").read_text())
    p = run.parallel
    out = {"rank": p.rank, "part": resume.my_part(run), "step_s": step_s, "blocked_s": info.blocked_s,
           "step_during_s": step_during, "save_s": save_s, "sync_save_s": sync_save_s, "load_s": load_s,
           "host_copy_bytes": info.bytes, "part_bytes": manifest["parts"][resume.my_part(run)]["bytes"],
           "save_peak_bytes": save_peak.bytes, "load_peak_bytes": load_peak.bytes,
           "params": sum(q.numel() for m in run.models.trained().values() for q in m.parameters())}
    Path(f"{out_prefix}.rank{p.rank}.json").write_text(json.dumps(out))


def _launch(name: str, args, work: Path) -> list[dict]:
    tp, pp, nproc = LAYOUTS[name]
    d = _config(args, work)
    d["parallel"] = {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                     "use_distributed_optimizer": True, "backend": "gloo"}
    d["logging"]["output_dir"] = str(work / name)
    cfg = work / f"{name}.json"
    cfg.write_text(json.dumps(d))
    prefix = work / f"{name}.result"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "pfppo_mega.bench.checkpoint", "--worker", str(cfg), str(prefix)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"pfppo bench checkpoint: {name} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return [json.loads(Path(f"{prefix}.rank{r}.json").read_text()) for r in range(nproc)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pfppo bench checkpoint", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default="tp2dp2,pp2", help=f"comma-separated, of {sorted(LAYOUTS)}")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--work", help="working directory (default: a temp dir, removed)")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--json", help="write the results here (with git sha and machine)")
    args = ap.parse_args(argv)
    names = args.layouts.split(",")
    bad = [n for n in names if n not in LAYOUTS]
    if bad:
        ap.error(f"--layouts: {bad} not among {sorted(LAYOUTS)}")
    from pfppo_mega.bench.kernels import git_sha, machine_info
    from pfppo_mega.config import dump_yaml, load_config_dict

    with tempfile.TemporaryDirectory(prefix="pfppo-bench-ckpt-") as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        if not (work / "sft" / "config.json").exists():  # the warm start, by `pfppo sft`
            (work / "sft.yaml").write_text(dump_yaml(load_config_dict(_config(args, work))))
            subprocess.run([sys.executable, "-m", "pfppo_mega.cli", "sft", str(work / "sft.yaml")], check=True,
                           capture_output=True, timeout=args.timeout)
        results = {"git": git_sha(), "machine": machine_info("cpu"), "hidden": args.hidden, "layers": args.layers,
                   "layouts": {}}
        for name in names:
            ranks = _launch(name, args, work)
            results["layouts"][name] = {"tp_pp_procs": LAYOUTS[name], "ranks": ranks}
            for r in ranks:
                print(f"{name} {r['part']}: part {r['part_bytes'] / 1e6:.1f} MB, blocked {r['blocked_s']:.3f} s, "
                      f"save {r['save_s']:.2f} s (sync {r['sync_save_s']:.2f} s), load {r['load_s']:.2f} s, "
                      f"step {r['step_s']:.2f} s / during save {r['step_during_s']:.2f} s, peak host "
                      f"+{r['save_peak_bytes'] / 1e6:.0f} MB save / +{r['load_peak_bytes'] / 1e6:.0f} MB load")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
    else:
        sys.exit(main())
