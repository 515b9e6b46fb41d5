"""scripts/gpu_check.sh, the prepared GPU check of issue 11, as far as a CPU machine can check it:
the script parses, stays within 8 minutes by its own timeouts, calls only entry points that exist
(files, modules, configs) and those parse their arguments; the targets are the issue's; the PPO
config is a ~1B Llama the planner accepts on one H200. Nothing here measures a GPU."""

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


def test_script_parses_and_its_timeouts_fit_8_minutes():
    out = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    text = SCRIPT.read_text()
    fixed = [int(s) for s in re.findall(r"^\s*(?:PFPPO_\S+ )*(?:MAX_JOBS\S* )?(?:TORCH\S* )?step \w+ (\d+) ",
                                        text, flags=re.M)]
    assert fixed == [200, 90, 60], fixed  # build, tests, kernels; the PPO run gets what is left of 470 s
    assert "left=$((470 - SECONDS))" in text and "480" not in text


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
    for bad in (["ppo"], ["ppo", "--model-dir", "m", "--steps", "0"], ["nope"], []):
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
    from pfppo_mega.trainer.ledger import BUILD_ORDER, STEP_ORDER

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
