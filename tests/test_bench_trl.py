"""pfppo bench trl's arithmetic and refusals (the benchmark itself needs the optional TRL packages and
the imported model; its figures are in docs/experiments/llm/)."""

from __future__ import annotations

import pytest

from pfppo_mega.bench import trl


def test_ratios_are_against_trl():
    s = trl.summarize({"trl_grpo": {"step_s": [30.0, 34.0, 32.0], "tokens": [300, 340, 320]},
                       "ours_grpo": {"step_s": [10.0, 12.0, 11.0], "tokens": [330, 360, 330]}})
    # headline: tokens over wall seconds; TRL 960 / 96 = 10 tok/s, ours 1020 / 33
    assert s["trl_grpo"]["tokens_per_s"] == 10.0 and s["ours_grpo"]["tokens_per_s"] == 1020 / 33
    assert s["ours_grpo"]["tokens_per_s_ratio_to_trl"] == pytest.approx((1020 / 33.0) / 10.0)
    assert s["trl_grpo"]["steps_per_s_ratio_to_trl"] == 1.0 and s["ours_grpo"]["median_step_s"] == 11.0
    assert s["ours_grpo"]["steps_per_s_ratio_to_trl"] == pytest.approx(32.0 / 11.0)
    # the generated tokens differ: shown (340 vs 320 per step)
    assert (s["ours_grpo"]["tokens_per_step"], s["trl_grpo"]["tokens_per_step"]) == (340.0, 320.0)
    assert s["ours_grpo"]["tokens_per_step_ratio_to_trl"] == pytest.approx(340 / 320)


def test_both_arms_are_timed_between_step_ends():
    """The same rule for both arms: step k's wall time = end[k] - end[k-1], the warm-up steps (and
    with them the start-up before the first end) not counted."""
    ends = [100.0, 117.5, 135.0, 160.0]
    assert trl.between_step_ends(ends, 1) == [17.5, 17.5, 25.0]
    assert trl.between_step_ends(ends, 2) == [17.5, 25.0]
    # ours: perf/step_end_s of the records (the step-0 eval record has none); perf/step_s (the step's own
    # work, without logging) is not the timing; the tokens are the step's
    recs = [{"step": 0, "eval/accuracy": 0.5}] + [
        {"step": i + 1, "perf/step_end_s": e, "perf/step_s": 10.0, "perf/tokens_per_s": 30.0 + i, "time/update_s": i}
        for i, e in enumerate(ends)]
    got = trl.our_steps(recs, 1)
    assert got["step_s"] == [17.5, 17.5, 25.0]
    assert got["tokens"] == [310.0, 320.0, 330.0] and got["phases"] == {"time/update_s": 2}


def test_trl_rounds_end_at_their_last_optimizer_step():
    from pfppo_mega.bench.trl_worker import round_ends

    stamps = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]  # 2 optimizer steps a round; the 7th starts a 4th round
    assert round_ends(stamps, 2) == [2.0, 4.0, 6.0]
    assert round_ends(stamps, 1) == stamps
    assert trl.between_step_ends(round_ends(stamps, 2), 1) == [2.0, 2.0]


def test_every_arm_runs_on_the_same_pinned_cpus():
    import os

    cores, env = trl.pinned(1)
    assert cores == sorted(os.sched_getaffinity(0))[:1]
    assert env == {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": str(cores[0])}
    n = len(os.sched_getaffinity(0))
    assert trl.pinned(n)[1]["VLLM_CPU_OMP_THREADS_BIND"] == ",".join(map(str, sorted(os.sched_getaffinity(0))))
    with pytest.raises(ValueError, match=f"--threads {n + 1} > the {n} CPUs"):
        trl.pinned(n + 1)


def test_warmup_0_and_too_many_threads_are_refused(capsys):
    import os

    assert trl.main(["--warmup", "0"]) == 2
    assert "--warmup 0: must be >= 1" in capsys.readouterr().err
    assert trl.main(["--threads", str(len(os.sched_getaffinity(0)) + 1)]) == 2
    assert "CPUs this process may use" in capsys.readouterr().err


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
         "time/rollout_weights_s": 0.5 * i, "time/rollout_engine_s": 0.4 * i, "perf/padding_frac": 0.05,
         "perf/step_end_s": 1000.0 + 20 * i} for i in (1, 2, 3)]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    lines = breakdown(tmp_path / "m.jsonl")
    assert lines[0] == "3 steps, median step 20.0 s:"
    assert any("rollout" in line and "2.00 s (10%)" in line for line in lines)
    assert any("update" in line and "10.00 s (50%)" in line for line in lines)
    assert any("rollout_weights" in line and "1.00 s (5%) of rollout: refits" in line for line in lines)
    assert any("rollout_engine" in line and "0.80 s (4%) of rollout: the engine's" in line for line in lines)
    assert any(line.strip().startswith("perf/padding_frac") and "0.05" in line for line in lines)
    assert not any("perf/step_end_s" in line for line in lines)  # a clock, not a figure
