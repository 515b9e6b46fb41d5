"""The GPU check of issue 11 (run by scripts/gpu_check.sh on one H200), two parts:

    python -m pfppo_mega.bench.gpu_check kernels [--json PATH]
        GAE at [1024, 8192] fp32: >= 1000x the verl-style Python loop and >= 75% of the measured
        device-to-device copy bandwidth; log-prob + entropy bf16 at [16384, 152064]: >= 5x eager.
    python -m pfppo_mega.bench.gpu_check ppo --model-dir DIR [--steps 10] [--json PATH]
        PPO (PF-PPO on) of a random-init ~1B Llama (configs/gpu_check_1b.yaml), one process, one
        GPU, colocated: the trainer's states offloaded to pinned host memory while the engine
        generates (training.offload_during_rollout=true) and the engine put to sleep after it.
        Prints seconds per step, pool switch time, offload / reload time, the trainer's bytes on
        the GPU during generation and the GPU memory allocated then, peak GPU memory, and the
        planner's training- and rollout-phase predictions for the same config on 1 x 1 H200
        (`pfppo plan`). The first step runs in the device-check mode (trainer/instruments/devicecheck.py). Then
        the device-memory ledger of the colocated order (build, then the last step: offload trainer
        -> wake weights -> refit -> wake KV -> generate -> sleep -> reload -> prepare -> update),
        its prediction per phase next to torch.cuda.max_memory_allocated / memory_allocated.

    python -m pfppo_mega.bench.gpu_check audit --model-dir DIR [--json PATH]
        The trainer built on the GPU (scripts/gpu_check.sh's ~300M config): every parameter, buffer and
        optimizer tensor of actor, reference, critic and engine on the device after one step, and an
        offload round trip of the trainer's states (bit-identical; device bytes before / during /
        after, torch's pinned-host allocator counters and the exactly pinned bytes next to the ledger).
    python -m pfppo_mega.bench.gpu_check matmul [--json PATH]
        The bf16 matmul rate of the device (8192^3), which the ppo part's model FLOP/s is read against.
    python -m pfppo_mega.bench.gpu_check speed [--json PATH] [--matmul-tflops X] [--tiny]
        The update's tokens/s and MFU at a ~1B Llama shape with 4k-token rows (bf16, the default layers:
        TE's or the fused SDPA path), and the fused vs megatron's local layers (pfppo_mega.bench.model_speed).

Exit status: 0 every target met / the run finished; 1 a target missed or the run failed; 2 bad
arguments (also: no CUDA device). Nothing here runs without a GPU but ``speed --tiny``; the CPU
tests check that the entry points exist and parse their arguments, the speed part's FLOP / MFU
arithmetic, and run ``speed --tiny`` (tests/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from pfppo_mega.bench import model_speed

REPO = Path(__file__).resolve().parents[2]
CONFIG_1B = REPO / "configs" / "gpu_check_1b.yaml"
CONFIG_300M = REPO / "configs" / "gpu_check_300m.yaml"  # scripts/gpu_check.sh v2: real vocabulary, every feature
# (name, op, dtype, quantity, threshold): issue 11's GPU targets
TARGETS = (
    ("gae x verl loop", "gae", "float32", "speedup:verl", 1000.0),
    ("gae fraction of HBM copy bandwidth", "gae", "float32", "frac_copy", 0.75),
    ("logprob+entropy bf16 x eager", "logprob_entropy fwd", "bfloat16", "speedup:eager", 5.0),
)
GAE_SHAPE = (1024, 8192)
LOGPROB_ROWS = 16384  # x 152064 (pfppo_mega.bench.kernels.VOCAB)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m pfppo_mega.bench.gpu_check", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="part", required=True)
    k = sub.add_parser("kernels", help="GAE and log-prob+entropy against the GPU targets")
    k.add_argument("--json", type=Path, default=None)
    k.add_argument("--reps", type=int, default=10, help="timed calls of the fused kernels (>= 1)")
    k.add_argument("--report", action="store_true", help="report the targets; exit 0 when one is missed")
    p = sub.add_parser("ppo", help="PPO steps of the random-init ~1B Llama with the memory prediction")
    p.add_argument("--model-dir", type=Path, required=True, help="HF checkpoint of the policy (pfppo sft writes it)")
    p.add_argument("--config", type=Path, default=CONFIG_1B)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out-dir", type=Path, default=Path("build/gpu_check/ppo"))
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--matmul-tflops", type=float, default=None,
                   help="the device's measured bf16 matmul rate (the matmul part), for the update's MFU")
    p.add_argument("--eval-save", action="store_true",
                   help="after the steps: an evaluation and a KL probe at the policy's version, one more step "
                        "(its rollout after them), then a checkpoint")
    p.add_argument("overrides", nargs="*", help="key.path=value, applied after the config")
    a = sub.add_parser("audit", help="every tensor on the device; an offload round trip against the ledger")
    a.add_argument("--model-dir", type=Path, required=True)
    a.add_argument("--config", type=Path, default=CONFIG_1B)
    a.add_argument("--out-dir", type=Path, default=Path("build/gpu_check/audit"))
    a.add_argument("--json", type=Path, default=None)
    a.add_argument("overrides", nargs="*")
    m = sub.add_parser("matmul", help="the device's bf16 matmul rate")
    m.add_argument("--json", type=Path, default=None)
    model_speed.add_arguments(sub.add_parser("speed", help="the update's tokens/s and MFU at 1B / 4k; fused vs "
                                                        "local layers"))
    args = ap.parse_args(argv)
    if getattr(args, "reps", 1) < 1 or getattr(args, "steps", 1) < 1:
        ap.error("--reps and --steps must be >= 1")
    if args.part == "speed":
        try:
            model_speed.check_args(args)
        except ValueError as e:
            ap.error(str(e))
    return args


def _need_cuda() -> None:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device (torch.cuda.is_available() is False): this check needs a GPU")


def run_kernels(args: argparse.Namespace) -> int:
    import torch

    from pfppo_mega.bench import kernels as kb

    _need_cuda()
    copy_gbps, _ = kb.copy_bandwidth("cuda", reps=20)
    print(f"device-to-device copy bandwidth: {copy_gbps:.0f} GB/s (256 MiB, read + write)")
    results = []
    for make in (lambda: kb.gae_case("cuda", *GAE_SHAPE),
                 lambda: kb.logprob_case("cuda", LOGPROB_ROWS, torch.bfloat16, backward=False)):
        case = make()
        if "compile" in case.baselines:
            case.baselines["compile"] = None  # minutes of triton compilation: not part of these targets
        results.append(kb.run_case(case, "cuda", copy_gbps, reps=args.reps, loop_reps=2))
        del case
        torch.cuda.empty_cache()
    print(kb.format_table(results, copy_gbps, "cuda"))
    by_op = {(r.op, r.dtype): r for r in results}
    ok, rows = True, []
    for name, op, dtype, what, threshold in TARGETS:
        value = kb._quantity(by_op[(op, dtype)], what)
        passed = value is not None and value >= threshold
        ok &= passed
        rows.append({"name": name, "value": value, "threshold": threshold, "passed": passed})
        print(f"  {'PASS' if passed else 'FAIL'} {name}: {value if value is None else round(value, 3)} "
              f"(target >= {threshold})")
    if args.json:
        args.json.write_text(json.dumps({"copy_gbps": copy_gbps, "targets": rows,
                                         "results": [r.__dict__ for r in results]}, indent=1, default=str))
    return 0 if ok or args.report else 1


def planned_gib(config: Path, overrides: list[str]) -> tuple[float, float]:
    """The planner's training-phase GPU total (worst stage) and its rollout-phase trainer states
    (0 with training.offload_during_rollout on) for this config on 1 x 1 H200, in GiB."""
    import contextlib
    import io
    import tempfile

    from pfppo_mega.planning.cli import main as plan_main

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan.json"
        with contextlib.redirect_stdout(io.StringIO()):
            plan_main([str(config), *overrides, "--gpu", "h200", "--nodes", "1", "--gpus-per-node", "1",
                       "--json", str(path)])
        plan = json.loads(path.read_text())
    trainer_in_rollout = sum(c["gib"] for c in plan["gpu_rollout_phase"]["components"]
                             if c["name"].startswith("trainer states"))
    return max(b["total_gib"] for b in plan["gpu_train_phase"]), trainer_in_rollout


def ledger_rows(records, holdings) -> list[dict]:
    """One row per phase record: the ledger's predicted device bytes and trainer bytes next to what
    the trainer measured there (TrainerOffload bytes; on CUDA torch.cuda.memory_allocated at the
    transition and max_memory_allocated until the next one). Rows: the build's phases, then the
    last step's (from its last 'offload trainer' before a 'prepare' on)."""
    from pfppo_mega.ledger import BUILD_ORDER

    phases = [r.phase for r in records]
    build = len(BUILD_ORDER)
    last_prepare = max((i for i, p in enumerate(phases) if p == "prepare"), default=len(phases))
    start = max((i for i, p in enumerate(phases[:last_prepare]) if p == "offload trainer" and i >= build),
                default=build)
    rows = []
    for r in records[:build] + records[start:]:
        m = r.measured
        rows.append({"phase": r.phase, "predicted": int(r.device_bytes), "predicted_trainer": int(r.trainer_bytes(holdings)),
                     "trainer": m.get("trainer_bytes"), "allocated": m.get("cuda_allocated"), "peak": m.get("cuda_peak")})
    return rows


def format_ledger_rows(rows: list[dict]) -> str:
    def gib(x) -> str:
        return f"{x / 2**30:>10.2f}" if isinstance(x, (int, float)) else f"{'-':>10}"

    lines = [f"{'phase':<22}{'predicted':>10}{'peak':>10}{'allocated':>10}{'pred.tr':>10}{'trainer':>10}   (GiB; "
             f"ledger prediction vs torch.cuda.max_memory_allocated in the phase, memory_allocated at its start, "
             f"the trainer's states predicted / measured)"]
    for r in rows:
        lines.append(f"{r['phase']:<22}{gib(r['predicted'])}{gib(r['peak'])}{gib(r['allocated'])}"
                     f"{gib(r['predicted_trainer'])}{gib(r['trainer'])}")
    return "\n".join(lines)


def run_ppo(args: argparse.Namespace) -> int:
    import torch

    from pfppo_mega.config import load_config
    from pfppo_mega.trainer.instruments import devicecheck
    from pfppo_mega.trainer.loop import PPOTrainer

    _need_cuda()
    overrides = [f"actor_rollout.model_path={args.model_dir}", f"logging.output_dir={args.out_dir}",
                 f"training.total_training_steps={args.steps}", "training.offload_during_rollout=true",
                 *args.overrides]
    cfg = load_config(args.config, overrides)
    planned, planned_rollout = planned_gib(args.config, overrides)
    t0 = time.perf_counter()
    trainer = PPOTrainer(cfg)
    print(f"trainer built in {time.perf_counter() - t0:.1f}s; device {trainer.run.parallel.device}; offload during "
          f"rollout {trainer.run.colocation.offload.enabled}; engine {type(trainer.run.colocation.engine).__name__}")
    # GPU memory allocated while the engine generates: read inside generate(), when the trainer's
    # states are offloaded and the engine holds its weights and cache (not before the rollout phase)
    in_rollout: list[float] = []
    engine = trainer.run.colocation.engine
    generate, sleep, slept = engine.generate, engine.sleep, []
    engine.generate = lambda *a, **k: (in_rollout.append(torch.cuda.memory_allocated() / 2**30), generate(*a, **k))[1]
    engine.sleep = lambda: (slept.append(trainer.step), sleep())[1]
    torch.cuda.reset_peak_memory_stats()
    peak_seen = [0]  # the ledger resets the allocator's peak at every phase: keep the run's own maximum
    memory = trainer.run.colocation.gen.memory
    if memory is not None:
        enter = memory.enter

        def entering(phase):
            peak_seen[0] = max(peak_seen[0], torch.cuda.max_memory_allocated())
            return enter(phase)

        memory.enter = entering
    steps = []
    for i in range(args.steps):
        t = time.perf_counter()
        if i == 0:  # the device rule, checked on the real device: every loss, boundary and collective
            with devicecheck.session(trainer.run.device) as chk:
                m = trainer.train_step()
            print(f"device check (step 1): {chk.checks} checks at {chk.where}, {chk.collectives} collectives, "
                  f"no violation")
        else:
            m = trainer.train_step()
        torch.cuda.synchronize()
        peak_seen[0] = max(peak_seen[0], torch.cuda.max_memory_allocated())
        steps.append({"step": trainer.step, "step_s": time.perf_counter() - t,
                      "update_s": m.get("time/update_s"), "update_tflops": m.get("perf/update_tflops"),
                      "update_tokens_per_s": m.get("perf/update_tokens_per_s"), "kl_probe": m.get("kl/probe_k1"),
                      "switch_s": m.get("pool/switch_s"), "reward": m.get("reward/mean"),
                      "offload_s": m.get("time/offload_s"), "reload_s": m.get("time/reload_s"),
                      "trainer_bytes_in_rollout": trainer.run.colocation.gen.rollout_trainer_bytes,
                      "allocated_in_rollout_gib": in_rollout[-1] if in_rollout else None,
                      "peak_gib": peak_seen[0] / 2**30})
        s = steps[-1]
        print(f"step {s['step']}: {s['step_s']:.2f}s, pool switch {s['switch_s']}, offload {s['offload_s']}s, "
              f"reload {s['reload_s']}s, trainer bytes on the GPU during rollout {s['trainer_bytes_in_rollout']}, "
              f"allocated then {s['allocated_in_rollout_gib']} GiB, reward {s['reward']}, "
              f"peak {s['peak_gib']:.2f} GiB", flush=True)
    extra = _eval_then_step_then_save(trainer, steps, torch) if args.eval_save else {}
    peak = max(peak_seen[0], torch.cuda.max_memory_allocated()) / 2**30
    steady = sorted(s["step_s"] for s in steps[1:]) or [steps[0]["step_s"]]
    last = [s for s in steps if "trainer_bytes_in_rollout" in s][-1]  # the eval-save step records less
    throughput = update_throughput(trainer, steps, args.matmul_tflops)
    print(f"update: {throughput}")
    print(f"median step (after the first): {steady[len(steady) // 2]:.2f}s; peak GPU memory {peak:.2f} GiB "
          f"(torch allocator) vs planner training phase {planned:.2f} GiB (1 x 1 H200); trainer states on the "
          f"GPU during rollout: measured {last['trainer_bytes_in_rollout'] / 2**30:.2f} GiB, planned "
          f"{planned_rollout:.2f} GiB; engine.sleep() after generating at steps {slept} "
          f"({type(engine).__name__}: "
          f"{'frees its KV cache' if getattr(engine, 'sleep_supported', False) else 'a logged no-op'})")
    if memory is not None:  # the ledger of the colocated order, phase by phase (pfppo_mega/ledger.py)
        memory.enter("sleep")  # closes the last phase's peak (the engine is asleep already)
        ledger = ledger_rows(memory.records[:-1], memory.ledger.h)
        print(format_ledger_rows(ledger))
    else:
        ledger = []
    if args.json:
        args.json.write_text(json.dumps({"steps": steps, "peak_gib": peak, "planned_train_gib": planned,
                                         "ledger": ledger, "update": throughput, **extra,
                                         "planned_rollout_trainer_gib": planned_rollout, "slept_at": slept,
                                         "device_check": {"checks": chk.checks, "collectives": chk.collectives}},
                                        indent=1))
    return 0


def update_throughput(trainer, steps: list[dict], matmul_tflops) -> dict:
    """The update phase's tokens/s and model FLOP/s (perf/update_tokens_per_s, perf/update_tflops: the
    trainer's own FLOP count of the passes, forward + backward), median over the steps after the
    first, against the device's measured bf16 matmul rate (the matmul part) when given."""
    from pfppo_mega.models import gpt

    timed = [s for s in steps[1:] if s.get("update_tflops")] or [s for s in steps if s.get("update_tflops")]
    if not timed:
        return {"note": "no perf/update_tflops in the step metrics"}
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    tflops = med([s["update_tflops"] for s in timed])
    out = {"tokens_per_s": med([s["update_tokens_per_s"] for s in timed]), "model_tflops": tflops,
           "update_s": med([s["update_s"] for s in timed]), "steps": len(timed),
           "params_actor": sum(p.numel() for p in gpt.unwrap(trainer.run.models.actor).parameters())}
    if matmul_tflops:
        out["frac_of_measured_matmul"] = tflops / matmul_tflops
    return out


def _eval_then_step_then_save(trainer, steps: list[dict], torch) -> dict:
    """An evaluation and a KL probe at the policy's version, then a step (its rollout comes after
    them at the same version: with vLLM's level-2 sleep this is where stale weights would generate),
    then a checkpoint written and committed (a second process resumes from it)."""
    from pfppo_mega.trainer.checkpoint import resume

    run = trainer.run
    ev = trainer.evaluate()
    probe = trainer.kl_probe() if run.cfg.logging.kl_probe_size else None
    t = time.perf_counter()
    m = trainer.train_step()
    torch.cuda.synchronize()
    steps.append({"step": trainer.step, "step_s": time.perf_counter() - t, "after_eval": True,
                  "reward": m.get("reward/mean"), "logp_gap_max": m.get("rollout/logp_gap_max")})
    root = run.out_dir / "checkpoints"
    t = time.perf_counter()
    resume.save(run, root)
    resume.wait(root)
    saved_s = time.perf_counter() - t
    print(f"eval at step {trainer.step - 1}: {ev}; KL probe {probe}; the step after it: "
          f"logp gap max {m.get('rollout/logp_gap_max')}; checkpoint of step {trainer.step} in {saved_s:.1f}s")
    return {"eval": ev, "kl_probe": probe, "saved_step": trainer.step, "save_s": saved_s}


def run_audit(args: argparse.Namespace) -> int:
    """Every tensor of the trainer on the GPU, and an offload round trip against the ledger."""
    import torch

    from pfppo_mega.config import load_config
    from pfppo_mega.models import gpt
    from pfppo_mega.trainer.loop import PPOTrainer
    from pfppo_mega.trainer.colocation.offload import module_tensors, optimizer_tensors

    _need_cuda()
    cfg = load_config(args.config, [f"actor_rollout.model_path={args.model_dir}", f"logging.output_dir={args.out_dir}",
                                    "training.total_training_steps=1", "training.offload_during_rollout=true",
                                    *args.overrides])
    trainer = PPOTrainer(cfg)
    run = trainer.run
    trainer.train_step()  # optimizer states exist after a step
    torch.cuda.synchronize()
    named = {}
    for what, module in (("actor", run.models.actor), ("ref", run.models.ref), ("critic", run.models.critic),
                         ("engine", getattr(run.colocation.engine, "model", None))):
        if module is not None:
            named.update({f"{what}.{n}": t for n, t in [*module.named_parameters(), *module.named_buffers()]})
    for what, opt in run.models.optimizers().items():
        named.update({f"{what}[{i}]": t for i, t in enumerate(optimizer_tensors(opt))})
    off = sorted(f"{n} {t.device}" for n, t in named.items() if t.device.type != "cuda")
    print(f"audit: {len(named)} tensors, {len(off)} not on the GPU{': ' + ', '.join(off[:10]) if off else ''}")
    # offload round trip: bit-identical, device bytes freed, host bytes as pinned
    models = run.models
    trained = [t for m in (models.actor, models.critic, models.ref) if m is not None for t in module_tensors(m)]
    trained += [t for o in run.models.optimizers().values() for t in optimizer_tensors(o)]
    before = [t.detach().clone() for t in trained]
    alloc0 = torch.cuda.memory_allocated()
    host0 = dict(torch.cuda.host_memory_stats())
    try:
        from pfppo_mega import pinned
        exact0 = pinned.pinned_bytes()
    except ImportError:
        pinned, exact0 = None, None
    predicted = run.colocation.offload.device_bytes()
    with run.colocation.offload.offloaded():
        torch.cuda.synchronize()
        alloc_off = torch.cuda.memory_allocated()
        host1 = dict(torch.cuda.host_memory_stats())
        exact1 = pinned.pinned_bytes() if pinned else None
        host_buffers = run.colocation.offload.host_bytes() if hasattr(run.colocation.offload, "host_bytes") else None
    torch.cuda.synchronize()
    alloc_back = torch.cuda.memory_allocated()
    # gradient buffers come back zeroed (nothing reads them before zero_grads): compare the rest
    grads = {id(g) for m in (run.models.actor, run.models.critic) if m is not None for p in m.parameters()
             for g in (getattr(p, "main_grad", None), p.grad) if g is not None}
    same = all(torch.equal(a, b) for a, b, t in zip(before, [t.detach() for t in trained], trained) if id(t) not in grads)
    host_key = "allocated_bytes.current"
    res = {"tensors": len(named), "off_device": off, "offload_bit_identical": same,
           "trainer_device_bytes": predicted, "allocated_before": alloc0, "allocated_offloaded": alloc_off,
           "allocated_after": alloc_back, "freed_bytes": alloc0 - alloc_off,
           "torch_pinned_held_during": host1.get(host_key, 0) - host0.get(host_key, 0),
           "exact_pinned_during": None if exact1 is None else exact1 - exact0,
           "offload_host_buffers": host_buffers,  # the trainer's host copies (gradients are not copied)
           "params": sum(p.numel() for p in gpt.unwrap(run.models.actor).parameters())}
    print(f"offload round trip: bit-identical {same}; device bytes {alloc0 / 2**30:.3f} -> {alloc_off / 2**30:.3f} -> "
          f"{alloc_back / 2**30:.3f} GiB (trainer states {predicted / 2**30:.3f} GiB); pinned host held during it: "
          f"torch allocator {res['torch_pinned_held_during'] / 2**30:.3f} GiB, exactly pinned "
          f"{res['exact_pinned_during'] if exact1 is None else round(res['exact_pinned_during'] / 2**30, 3)} GiB, "
          f"the offload's host buffers {(host_buffers or 0) / 2**30:.3f} GiB")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    return 0 if not off and same else 1


def run_matmul(args: argparse.Namespace) -> int:
    import torch

    _need_cuda()
    n = 8192
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    t = sorted(times)[len(times) // 2]
    tflops = 2 * n ** 3 / t / 1e12
    print(f"bf16 matmul {n}^3: {t * 1e3:.2f} ms median, {tflops:.0f} TFLOP/s")
    if args.json:
        args.json.write_text(json.dumps({"n": n, "median_s": t, "tflops": tflops}))
    return 0


def run_speed(args: argparse.Namespace) -> int:
    """bench.model_speed: the update's tokens/s and MFU, the layer paths side by side (GPU; --tiny anywhere)."""
    if not args.tiny:
        _need_cuda()
    return model_speed.main(args)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    parts = {"kernels": run_kernels, "ppo": run_ppo, "audit": run_audit, "matmul": run_matmul, "speed": run_speed}
    try:
        return parts[args.part](args)
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
