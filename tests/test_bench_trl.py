"""pfppo bench trl's arithmetic and refusals (the benchmark itself needs the optional TRL packages and
the imported model; its figures are in docs/experiments/llm/)."""

from __future__ import annotations

import pytest

from pfppo_mega.bench import trl


def test_ratios_are_against_trl():
    s = trl.summarize({"trl_grpo": {"step_s": [30.0, 34.0, 32.0], "tokens": [300, 340, 320]},
                       "ours_grpo": {"step_s": [10.0, 12.0, 11.0], "tokens": [330, 360, 330]}})
    assert s["trl_grpo"]["steps_per_s_ratio_to_trl"] == pytest.approx(1.0)
    assert s["ours_grpo"]["median_step_s"] == 11.0
    assert s["ours_grpo"]["steps_per_s_ratio_to_trl"] == pytest.approx(32.0 / 11.0)
    assert s["ours_grpo"]["tokens_per_s_ratio_to_trl"] == pytest.approx((1020 / 33.0) / (960 / 96.0))


def test_unknown_arm_and_missing_model_are_refused(tmp_path, capsys):
    assert trl.main(["--arms", "trl_grpo,verl"]) == 2
    assert "allowed trl_grpo, ours_grpo, ours_grpo_bypass, ours_ppo" in capsys.readouterr().err
    assert trl.main(["--model", str(tmp_path / "none"), "--data", str(tmp_path / "none.jsonl")]) == 2
    assert "make demo-llm" in capsys.readouterr().err


def test_demo_llm_breakdown_reads_the_medians(tmp_path):
    import json

    from pfppo_mega.experiments.llm_demo import breakdown

    recs = [{"step": 0, "eval/accuracy": 0.1}] + [
        {"step": i, "perf/step_s": 10.0 * i, "time/rollout_s": 1.0 * i, "time/update_s": 5.0 * i,
         "time/rollout_weights_s": 0.5 * i, "time/rollout_engine_s": 0.4 * i, "perf/padding_frac": 0.05} for i in (1, 2, 3)]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    lines = breakdown(tmp_path / "m.jsonl")
    assert lines[0] == "3 steps, median step 20.0 s:"
    assert any("rollout" in line and "2.00 s (10%)" in line for line in lines)
    assert any("update" in line and "10.00 s (50%)" in line for line in lines)
    assert any("rollout_weights" in line and "1.00 s (5%) of rollout: refits" in line for line in lines)
    assert any("rollout_engine" in line and "0.80 s (4%) of rollout: the engine's" in line for line in lines)
    assert any(line.strip().startswith("perf/padding_frac") and "0.05" in line for line in lines)
