"""scripts/gpu_check.sh (v2), the prepared GPU check, as far as a CPU machine can check it: the
script parses, its steps run in the issue's order, each with its own timeout (the sum within 8
minutes), a failing step does not stop the next; it calls only entry points that exist (files,
modules, configs) and those parse their arguments; the targets are issue 11's; the configs are ones
the planner accepts on one H200. Nothing here measures a GPU."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pfppo_mega.bench import gpu_check

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.sh"


STEPS = ["build", "kernel_tests", "sft", "audit", "matmul", "speed", "ppo", "resume", "grpo", "contracts", "kernels"]


def _steps(text: str) -> list[tuple[str, int]]:
    return [(name, int(t)) for name, t in re.findall(r"^\s*(?:[A-Z_]+=\S+ )*step (\w+) (\d+) ", text, flags=re.M)]


def test_script_parses_and_its_steps_fit_8_minutes():
    """v2: every step its own process with its own timeout, in the issue's order, the sum of the limits
    within 8 minutes with the start and the summary; no -x, no step chained to another with &&."""
    out = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    text = SCRIPT.read_text()
    steps = _steps(text)
    assert [n for n, _ in steps] == STEPS, steps
    # each step's limit is clipped to what is left of the 470 s budget (the runner test below checks it)
    assert "BUDGET_S=${GPU_CHECK_BUDGET_S:-470}" in text and '[ "$limit" -le "$left" ] || limit=$left' in text
    assert all(t <= 150 for _, t in steps), steps
    assert " -x " not in text and not re.search(r"^\s*step .*\\?\n?\s*&& step", text, flags=re.M)
    assert "steps.jsonl" in text and "summary.txt" in text


def test_the_prepare_step_brings_megatron_core_alone():
    text = SCRIPT.read_text()
    prepare = text[text.index("--prepare\" ]"):text.index("exit 0")]
    assert "megatron-core" in prepare and "numpy" not in prepare and "PyYAML" not in prepare


@pytest.mark.skipif(not __import__("shutil").which("timeout"), reason="coreutils timeout missing")
def test_a_failing_step_does_not_stop_the_others(tmp_path):
    """The step runner alone (the script's own function, sourced): a failing and a timed-out step are
    recorded and the next step still runs; steps.jsonl holds one JSON record a step."""
    text = SCRIPT.read_text()
    body = text[text.index("failed=0"):text.index("nvidia-smi")]
    script = (f"set -uo pipefail\nOUT={tmp_path}/out WORK={tmp_path}/w BUDGET_S=100\nmkdir -p $OUT $WORK\n"
              f": > $OUT/summary.txt; : > $OUT/steps.jsonl; : > $OUT/log.txt\n{body}\n"
              "step a 5 false\nstep b 1 sleep 3\nstep c 5 true\nBUDGET_S=0\nstep d 5 true\nexit $failed\n")
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, out.stdout + out.stderr
    records = [json.loads(line) for line in (tmp_path / "out" / "steps.jsonl").read_text().splitlines()]
    assert [(r["step"], r["status"]) for r in records] == [("a", "failed"), ("b", "timed out"), ("c", "passed"),
                                                           ("d", "not run")]  # past the budget


def test_script_calls_only_what_exists():
    text = SCRIPT.read_text()
    for path in re.findall(r"(tests/test_\w+\.py|configs/\w+\.yaml|scripts/\w+\.sh|build_ext\.py)", text):
        assert (REPO / path).is_file(), path
    for module in set(re.findall(r"-m (pfppo_mega[\w.]*)", text)):
        out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True,
                             cwd=REPO, timeout=120)
        assert out.returncode == 0, (module, out.stderr[-2000:])


def test_entry_point_parses_its_arguments():
    a = gpu_check.parse_args(["kernels", "--json", "k.json"])
    assert a.part == "kernels" and a.json == Path("k.json") and a.reps == 10
    a = gpu_check.parse_args(["ppo", "--model-dir", "m", "--steps", "10", "training.seed=3"])
    assert (a.part, a.model_dir, a.steps, a.overrides) == ("ppo", Path("m"), 10, ["training.seed=3"])
    a = gpu_check.parse_args(["audit", "--model-dir", "m", "--config", str(gpu_check.CONFIG_300M)])
    assert (a.part, a.model_dir, a.config) == ("audit", Path("m"), gpu_check.CONFIG_300M)
    a = gpu_check.parse_args(["ppo", "--model-dir", "m", "--eval-save", "--matmul-tflops", "750"])
    assert a.eval_save and a.matmul_tflops == 750.0
    assert gpu_check.parse_args(["kernels", "--report"]).report
    for bad in (["ppo"], ["ppo", "--model-dir", "m", "--steps", "0"], ["audit"], ["nope"], []):
        with pytest.raises(SystemExit) as e:
            gpu_check.parse_args(bad)
        assert e.value.code == 2, bad


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal without a GPU")
def test_without_a_gpu_it_says_so_and_exits_2(capsys):
    assert gpu_check.main(["kernels"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_targets_are_the_issues():
    assert gpu_check.TARGETS == (
        ("gae x verl loop", "gae", "float32", "speedup:verl", 1000.0),
        ("gae fraction of HBM copy bandwidth", "gae", "float32", "frac_copy", 0.75),
        ("logprob+entropy bf16 x eager", "logprob_entropy fwd", "bfloat16", "speedup:eager", 5.0))
    assert gpu_check.GAE_SHAPE == (1024, 8192) and gpu_check.LOGPROB_ROWS == 16384
    from pfppo_mega.bench.kernels import VOCAB

    assert VOCAB == 152064


def test_ppo_config_is_a_1b_llama_the_planner_fits_on_one_h200(tmp_path):
    report = tmp_path / "plan.json"
    out = subprocess.run([sys.executable, "-m", "pfppo_mega.planning", str(gpu_check.CONFIG_1B), "--gpu", "h200",
                          "--nodes", "1", "--gpus-per-node", "1", "--json", str(report)],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    plan = json.loads(report.read_text())
    assert 0.9e9 <= plan["params"]["actor_total"] <= 1.1e9, plan["params"]
    assert plan["knobs"]["recompute"] == "none" and plan["run"]  # features from the config
    train, in_rollout = gpu_check.planned_gib(gpu_check.CONFIG_1B, ["training.offload_during_rollout=true"])
    assert 0 < train < 140 and in_rollout == 0  # offloaded: no trainer state on the GPU while generating
    _, kept = gpu_check.planned_gib(gpu_check.CONFIG_1B, ["training.offload_during_rollout=false"])
    assert kept > 1  # GiB: bf16 weights + fp32 grads + Adam of actor and critic, reference weights


def test_ledger_rows_put_the_prediction_next_to_what_was_measured():
    """The per-phase table the PPO part prints (its CPU-side logic): the build's phases, then the last
    step's from its last 'offload trainer' before 'prepare', each with the ledger's predicted bytes and
    the measured ones (here: made-up measurements on the plan's own records of the 1B config)."""
    import dataclasses

    from pfppo_mega.config import load_config
    from pfppo_mega.planning.memory import Hardware, Knobs, RunShape, make_plan
    from pfppo_mega.ledger import BUILD_ORDER, STEP_ORDER

    cfg = load_config(gpu_check.CONFIG_1B, ["training.offload_during_rollout=true"])
    plan = make_plan(RunShape.from_config(cfg), Hardware.preset("h200", nodes=1, gpus_per_node=1), Knobs.from_config(cfg))
    one = plan.ledger[0]
    steps = one[len(BUILD_ORDER):]
    records = one + steps  # the build, then two steps
    records = [dataclasses.replace(r, measured={"trainer_bytes": 7 * i, "cuda_allocated": 11 * i, "cuda_peak": 13 * i})
               for i, r in enumerate(records)]
    rows = gpu_check.ledger_rows(records, plan.holdings[0])
    assert [r["phase"] for r in rows] == list(BUILD_ORDER + STEP_ORDER)
    last = len(records) - len(STEP_ORDER)
    assert rows[len(BUILD_ORDER)]["peak"] == 13 * last and rows[-1]["allocated"] == 11 * (len(records) - 1)
    assert [r["predicted"] for r in rows] == [int(r.device_bytes) for r in one]
    update = rows[-1]
    assert update["predicted_trainer"] > 0 and update["predicted"] > update["predicted_trainer"]
    generate = next(r for r in rows if r["phase"] == "generate")
    assert generate["predicted_trainer"] == 0  # offloaded while the engine generates
    text = gpu_check.format_ledger_rows(rows)
    assert text.count("\n") == len(rows) and "wake kv cache" in text and "max_memory_allocated" in text


def test_the_300m_config_has_a_real_vocabulary_and_every_gpu_feature(tmp_path):
    from pfppo_mega.config import load_config

    cfg = load_config(gpu_check.CONFIG_300M, [])
    assert cfg.model.vocab_size >= 32768 and cfg.algorithm.use_pf_ppo and cfg.kernels == "fused"
    assert cfg.parallel.use_distributed_optimizer and cfg.training.recompute == "selective"
    assert cfg.training.offload_during_rollout and cfg.logging.kl_probe_size > 0
    report = tmp_path / "plan.json"
    out = subprocess.run([sys.executable, "-m", "pfppo_mega.planning", str(gpu_check.CONFIG_300M), "--gpu", "h200",
                          "--nodes", "1", "--gpus-per-node", "1", "--json", str(report)],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert 0.25e9 <= json.loads(report.read_text())["params"]["actor_total"] <= 0.35e9


def test_phase_timers_synchronize_the_gpu(monkeypatch):
    """Issue 35 (10): the phase timers read a host clock around asynchronous GPU work; on CUDA they now
    synchronize at both ends of a phase (on the CPU nothing is queued: no call)."""
    import torch

    from pfppo_mega.trainer.loop import PhaseTimer

    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    cuda = PhaseTimer(torch.device("cuda", 0))
    with cuda("update"):
        pass
    assert calls == [torch.device("cuda", 0)] * 2 and "update" in cuda.seconds
    with PhaseTimer(torch.device("cpu"))("update"):
        pass
    assert len(calls) == 2


# ----------------------------------------------------------------------------- the speed step (bench.model_speed)


def test_speed_flops_are_6n_plus_attention():
    """Llama-3.2-1B's shape at 4k: 6 x (decoder matmul weights + the head at the response tokens) plus
    12 x heads x head_dim x layers per causal pair, per token (recounted here from the dimensions)."""
    from pfppo_mega.bench import model_speed as ms
    from pfppo_mega.config.tree import ModelConfig
    from pfppo_mega.families import DecoderShape

    shape = DecoderShape.from_model_config(ModelConfig(**ms.LLAMA_1B))
    L, h, f, a, g, d, V, s, r = 16, 2048, 8192, 32, 8, 64, 128256, 4096, 4096 - ms.PROMPT
    layer = h * a * d + 2 * h * g * d + a * d * h + 3 * h * f
    want = 6 * L * layer + 6 * h * V * r / s + 12 * a * d * L * (s * (s + 1) / 2) / s
    assert ms.train_flops_per_token(shape, seq=s, head_tokens=r) == pytest.approx(want, rel=1e-12)
    assert 6 * (L * layer + h * V) / 1e9 == pytest.approx(7.4, abs=0.05)  # ~1.24 B parameters in matmuls
    with pytest.raises(ValueError, match=r"head_tokens\(5\) within \[0, seq\]"):
        ms.train_flops_per_token(shape, seq=4, head_tokens=5)


def test_speed_mfu_and_peaks():
    from pfppo_mega.bench import model_speed as ms

    assert ms.peak_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert ms.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert ms.peak_tflops("NVIDIA H200") == 989.4
    assert ms.peak_tflops("cpu") is None
    # 20,000 tokens/s x 10 GFLOP a token = 200 TFLOP/s of 1000
    assert ms.mfu(20_000.0, 1e10, 1000.0) == pytest.approx(0.2)
    assert ms.mfu(20_000.0, 1e10, None) is None
    with pytest.raises(ValueError, match=r"tokens_per_s\(-1.0\)"):
        ms.mfu(-1.0, 1.0, 1.0)


def test_speed_arguments(capsys):
    a = gpu_check.parse_args(["speed", "--json", "s.json", "--matmul-tflops", "700"])
    assert (a.part, a.json, a.matmul_tflops, a.rows, a.seq, a.steps, a.compare_layers, a.tiny) == \
        ("speed", Path("s.json"), 700.0, 4, 4096, 3, 4, False)
    for bad, msg in ((["speed", "--rows", "0"], "--rows (0) must be >= 1"),
                     (["speed", "--seq", "64"], "--seq (64) must exceed the 64-token prompt")):
        with pytest.raises(SystemExit) as e:
            gpu_check.parse_args(bad)
        assert e.value.code == 2 and msg in capsys.readouterr().err


def test_speed_tiny_runs_on_the_cpu(tmp_path):
    """The speed step's code end to end on a two-layer fp32 shape: the update's rates and both layer paths
    (the fused one and megatron's), in the JSON the GPU check sends back."""
    from pfppo_mega.bench import model_speed as ms

    report = tmp_path / "speed.json"
    out = subprocess.run([sys.executable, "-m", "pfppo_mega.bench.gpu_check", "speed", "--tiny", "--rows", "2",
                          "--steps", "1", "--compare-layers", "1", "--json", str(report)],
                         capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    r = json.loads(report.read_text())
    assert r["layer_path"] == "fused" and r["tokens_per_step"] == 2 * r["seq"] and r["git"]
    u = r["update"]
    assert u["tokens_per_s"] == pytest.approx(r["tokens_per_step"] / u["median_s"])
    assert u["model_tflops"] == pytest.approx(u["tokens_per_s"] * r["flops_per_token"] / 1e12)
    assert u["mfu"] is None and r["device"] == "cpu"
    assert {r["layers"][k]["layer_path"] for k in ("fused", "local")} == {"fused", "local"}
    assert r["layers"]["local_over_fused"] > 0 and r["layers"]["num_layers"] == 1
    assert set(r["head_keys"]) == set(ms.head_keys())
    assert "tokens/s" in out.stdout and "local / fused step time" in out.stdout


def test_the_check_sends_back_at_most_8_files():
    text = SCRIPT.read_text()
    assert len(set(re.findall(r"\$OUT/([\w.]+)", text))) <= 8


def test_sdpa_backend_probe_names_each_backend():
    """The speed step's probe, on the CPU: torch's CPU flash kernel takes the layers' causal GQA call;
    the CUDA-only backends are refused with torch's message, not skipped."""
    import torch

    from pfppo_mega.bench import model_speed as ms
    from pfppo_mega.config.tree import ModelConfig
    from pfppo_mega.families import DecoderShape

    shape = DecoderShape.from_model_config(ModelConfig(**ms.TINY))
    got = ms.sdpa_backends(shape, 16, torch.device("cpu"))
    assert set(got) == {"flash_attention", "cudnn_attention", "efficient_attention"}
    assert got["flash_attention"] == "ok" and got["cudnn_attention"] != "ok"
