"""scripts/async_step_model.py --measured (pfppo_mega/bench/step_scale.py): our phase efficiencies
applied to a layout's work at a GPU's rates."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pfppo_mega.bench import step_scale

REPO = Path(__file__).resolve().parents[1]


def _metrics(path: Path, **over) -> Path:
    rec = {"time/rollout_engine_s": 2.0, "time/prepare_s": 1.0, "time/update_s": 3.0, "time/sync_s": 0.0,
           "perf/generate_floor_frac": 0.5, "perf/prepare_matmul_frac": 0.25, "perf/update_matmul_frac": 0.4,
           "work/rows": 32, "response/length_mean": 10.0}
    rec.update(over)
    lines = [{"step": 1, **rec, "perf/matmul_gflops": 400.0, "perf/memcpy_gbps": 13.0}]
    lines += [{"step": k, **rec} for k in (2, 3, 4)]  # the rates are logged at the probes only
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return path


def test_each_phase_is_its_work_at_the_gpu_rate_over_our_efficiency(tmp_path):
    layout = str(REPO / "configs" / "70b_pfppo_h100.yaml")
    m = step_scale.measured(str(_metrics(tmp_path / "a.jsonl")), skip=1)
    assert (m.steps, m.matmul, m.prepare_frac) == (3, 400.0, 0.25)
    s = step_scale.scaled(m, layout, gpus=64)
    rate = 64 * step_scale.H100["matmul"]
    assert s.prepare_s == pytest.approx(s.prepare_tflop * 1e12 / (rate * 0.25))
    assert s.update_s == pytest.approx(s.update_tflop * 1e12 / (rate * 0.4))
    assert s.gen_s == pytest.approx(s.gen_floor_s / 0.5) and s.gen_floor_s > 0
    assert 130 < s.weight_gb < 150  # Llama-3-70B in bf16 (the ledger's parameter count)
    # twice as efficient on this machine: half the time at scale; more GPUs: less time
    m2 = step_scale.measured(str(_metrics(tmp_path / "b.jsonl", **{"perf/prepare_matmul_frac": 0.5,
                                                                    "perf/generate_floor_frac": 1.0})))
    s2 = step_scale.scaled(m2, layout, gpus=64)
    assert s2.prepare_s == pytest.approx(s.prepare_s / 2) and s2.gen_s == pytest.approx(s.gen_s / 2)
    assert step_scale.scaled(m, layout, gpus=128).update_s == pytest.approx(s.update_s / 2)


def test_a_metrics_file_without_the_phases_is_refused_by_name(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"step": 2, "time/prepare_s": 1.0}) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl: .*perf/matmul_gflops"):
        step_scale.measured(str(bad))


def test_the_script_prints_the_scaled_phases_and_the_split_table(tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "async_step_model.py"), "--measured",
                          str(_metrics(tmp_path / "a.jsonl"))], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "| log-probs (prepare) |" in out.stdout and "on our scaled phases" in out.stdout
