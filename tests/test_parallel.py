"""Tensor, pipeline and data parallelism on gloo: parallel equals serial.

Two torchrun launches (2 and 4 processes) run every multi-rank check of tests/multirank/checks.py
in one go each (logits vs transformers, vocab-parallel log-prob / entropy and its gradients vs
fp64, exact HF round trip and sharded export, one PPO update). This file asserts on the result
lines they print, and compares their PPO updates with the serial one computed here in-process
at tp = pp = dp = 1 with a single micro-batch (the trainer's computation).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]
MULTIRANK = REPO / "tests" / "multirank"
sys.path.insert(0, str(MULTIRANK))

import common  # noqa: E402
import feature_checks  # noqa: E402
import refit_checks  # noqa: E402
import reward_model_checks  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from pfppo_mega import parallel  # noqa: E402
from pfppo_mega.kernels import available_backends  # noqa: E402
from pfppo_mega.compat import megatron_cpu  # noqa: E402

LAUNCH_TIMEOUT_S = 300
# Tolerances of parallel vs serial after one update (fp32; reductions run in another order).
LOSS_RTOL = 1e-6        # |dL| <= LOSS_RTOL * max(1, |L|)
GRAD_NORM_RTOL = 1e-5   # |d grad_norm| <= GRAD_NORM_RTOL * max(1, grad_norm)
# Adam's first step moves a weight by lr * g / (|g| + eps): for |g| near eps it amplifies fp32
# round-off of g, so weights agree to a fraction of the step size lr, not to fp32 epsilon.
WEIGHT_ATOL = common.LR / 50
_RESULT = re.compile(r"^RESULT (\S+) (\S+) (PASS|FAIL) max_diff=(\S+) tol=(\S+)(.*)$")


BACKENDS = [b.name for b in available_backends()]  # the kernels backends the rank processes run


def _expected_checks() -> list[tuple[int, str, str]]:
    out = [(2, "any", "bad_layout_rejected")]
    for world, layouts in common.LAYOUTS.items():
        for layout, tp, _, _ in layouts:
            for kind in common.CHECKPOINTS:
                for check in ("logits_vs_transformers", "gather_hf_weights_exact", "export_sharded_exact",
                              "ppo_update_ran", "replicas_identical"):
                    out.append((world, layout, f"{check}[{kind}]"))
            for kind in common.FAMILIES:
                for check in ("logits_vs_transformers", "gather_hf_weights_exact", "export_sharded_exact"):
                    out.append((world, layout, f"{check}[{kind}]"))
            for backend in BACKENDS:
                out.append((world, layout, f"logp_entropy_vs_fp64[llama,{backend}]"))
                out.append((world, layout, f"logp_entropy_vs_fp64[llama,{backend},fused_head]"))
                if tp > 1:
                    out.append((world, layout, f"vocab_parallel_fwd_bwd[{backend}]"))
                    out.append((world, layout, f"fused_head_fwd_bwd[{backend}]"))  # checks.check_fused_head_grads
            out += [(world, layout, check) for check in refit_checks.CHECKS]  # tests/multirank/refit_checks.py
            if world == 2:
                out.append((world, layout, "token_budget_logp_vs_fp64[llama]"))  # checks.check_token_budget
                out += [(world, layout, check) for check in feature_checks.CHECKS]  # tests/multirank/feature_checks.py
                out += [(world, layout, check) for check in reward_model_checks.CHECKS]  # reward models per family
    return out


EXPECTED = _expected_checks()
PARITY = [(layout, kind) for layouts in common.LAYOUTS.values() for layout, *_ in layouts
          for kind in common.CHECKPOINTS]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("parallel")
    common.make_checkpoints(root)
    reward_model_checks.make_checkpoints(root)
    return root


def _start(world: int, data: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), str(MULTIRANK)]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           str(MULTIRANK / "checks.py"), str(data)]
    # Own process group, so a timeout or a failure elsewhere can stop torchrun and its ranks together.
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


def _finish(world: int, proc: subprocess.Popen, t0: float) -> dict[tuple[str, str], tuple[bool, str]]:
    try:
        stdout, stderr = proc.communicate(timeout=max(1.0, LAUNCH_TIMEOUT_S - (time.perf_counter() - t0)))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"torchrun with {world} processes ran past {LAUNCH_TIMEOUT_S} s:\n"
                    f"{stdout[-3000:]}\n{stderr[-3000:]}")
    if proc.returncode != 0:
        pytest.fail(f"torchrun with {world} processes exited with {proc.returncode}:\n"
                    f"{stdout[-3000:]}\n{stderr[-6000:]}")
    results = {}
    for line in stdout.splitlines():
        m = _RESULT.match(line)
        if m:
            results[(m.group(1), m.group(2))] = (m.group(3) == "PASS", line)
        if line.startswith(("RESULT", "TIME")):
            print(f"[world {world}] {line}")
    print(f"[world {world}] launch + all checks: {time.perf_counter() - t0:.1f} s (launches run concurrently)")
    return results


@pytest.fixture(scope="module")
def launches(data) -> dict[int, dict]:
    """Both launches at once (they overlap their start-up and waits on 2 cores)."""
    t0 = time.perf_counter()
    procs = {world: _start(world, data) for world in common.LAYOUTS}
    try:
        return {world: _finish(world, proc, t0) for world, proc in procs.items()}
    finally:
        for proc in procs.values():
            _stop(proc)


@pytest.fixture(scope="module")
def serial(data) -> dict[str, dict[int, common.UpdateResult]]:
    """The TP1 update of each checkpoint with one micro-batch (the reference) and with B
    micro-batches of one row (micro-batching alone)."""
    parallel.init_parallel(tp=1, pp=1, seed=1234)
    try:
        batch = common.ppo_batch()
        return {kind: {mbs: common.ppo_update(data / kind, batch, micro_batch_size=mbs, dp_rank=0, dp=1)
                       for mbs in (common.BATCH, 1)}
                for kind in common.CHECKPOINTS}
    finally:
        parallel.destroy_parallel()
        megatron_cpu.disable()


@pytest.mark.parametrize("world,layout,check", EXPECTED, ids=[f"{lay}-{chk}" for _, lay, chk in EXPECTED])
def test_multirank_check(launches, world, layout, check):
    results = launches[world]
    assert (layout, check) in results, f"no result line for {layout} {check} (world {world})"
    ok, line = results[(layout, check)]
    assert ok, line


def _compare(ref: common.UpdateResult, got_scalars: dict, got_weights: dict[str, torch.Tensor], label: str) -> None:
    rs = ref.scalars()
    problems = []
    for key in ("actor_loss", "critic_loss"):
        diff = abs(got_scalars[key] - rs[key])
        print(f"[{label}] {key}: serial {rs[key]:.7f} parallel {got_scalars[key]:.7f} |diff| {diff:.2e} "
              f"(tol {LOSS_RTOL * max(1.0, abs(rs[key])):.1e})")
        if diff > LOSS_RTOL * max(1.0, abs(rs[key])):
            problems.append(f"{key} differs by {diff:.2e}")
    for key in ("actor_grad_norm", "critic_grad_norm"):
        diff = abs(got_scalars[key] - rs[key])
        if diff > GRAD_NORM_RTOL * max(1.0, rs[key]):
            problems.append(f"{key}: serial {rs[key]} parallel {got_scalars[key]}")
    assert sorted(got_weights) == sorted(ref.weights), "different tensor names after the update"
    for role in ("actor", "critic"):
        names = [n for n in ref.weights if n.startswith(role + "/")]
        diffs = {n: (got_weights[n] - ref.weights[n]).abs().max().item() for n in names}
        worst = max(diffs, key=diffs.get)
        mean = sum((got_weights[n] - ref.weights[n]).abs().sum().item() for n in names) / sum(
            ref.weights[n].numel() for n in names)
        print(f"[{label}] {role} weights after one update: max |diff| {diffs[worst]:.2e} ({worst}), "
              f"mean |diff| {mean:.1e} (tol {WEIGHT_ATOL:.0e} = lr / 50)")
        if diffs[worst] > WEIGHT_ATOL:
            problems.append(f"{role} weight {worst} differs by {diffs[worst]:.2e}")
    assert not problems, "; ".join(problems)


@pytest.mark.parametrize("layout,kind", PARITY, ids=[f"{lay}-{k}" for lay, k in PARITY])
def test_parallel_update_equals_serial(launches, serial, data, layout, kind):
    stem = data / "results" / f"{layout}_{kind}"
    scalars = json.loads(Path(str(stem) + ".json").read_text())
    weights = load_file(str(stem) + ".safetensors")
    _compare(serial[kind][common.BATCH], scalars, weights, f"{layout} {kind}")


@pytest.mark.parametrize("layout", [layout for layout, *_ in common.LAYOUTS[2]])
def test_token_budget_update_at_a_layout_equals_serial_padded(launches, serial, data, layout):
    """Token-budget micro-batches + response-only head at tp2 / pp2 / dp2 vs the serial padded update."""
    stem = data / "results" / f"{layout}_llama_budget"
    scalars = json.loads(Path(str(stem) + ".json").read_text())
    _compare(serial["llama"][common.BATCH], scalars, load_file(str(stem) + ".safetensors"), f"{layout} budget llama")


@pytest.mark.parametrize("kind", common.CHECKPOINTS)
def test_micro_batching_alone_equals_one_micro_batch(serial, kind):
    one_row = serial[kind][1]
    _compare(serial[kind][common.BATCH], one_row.scalars(), one_row.weights, f"tp1 mbs=1 {kind}")


def test_update_moves_weights(serial, data):
    """The parity above would be empty if the update did nothing."""
    from pfppo_mega.models import hf_io

    ref = serial["llama"][common.BATCH]
    before = hf_io.load_hf_state_dict(data / "llama")
    moved = max((ref.weights[f"actor/{n}"] - t).abs().max().item() for n, t in before.items())
    assert moved > common.LR / 2


def test_sharded_export_from_tp2pp2_loads_in_transformers(launches, data):
    from transformers import AutoModelForCausalLM

    export = data / "exports" / "tp2pp2_qwen2"
    assert len(list(export.glob("model-*-of-*.safetensors"))) > 1
    reread = AutoModelForCausalLM.from_pretrained(export).eval()
    original = common.hf_model("qwen2")
    assert type(reread).__name__ == "Qwen2ForCausalLM"
    ids = common.ppo_batch().inputs.input_ids
    with torch.no_grad():
        assert torch.equal(reread(ids).logits, original(ids).logits)
