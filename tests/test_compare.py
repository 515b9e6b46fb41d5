"""`pfppo compare`: run statistics from metric records, the per-claim verdicts of each pool arm vs
PPO, the cross-setting summary, and the arm registry (pure: no training here)."""

import json
import math

import pytest

from pfppo_mega.config import load_config
from pfppo_mega.experiments import compare as C


def _records(steps=20, *, reward=lambda s: 0.5, honest=None, length=lambda s: 3.0, kl=lambda s: 0.01 * s,
             hacked=None, evals=((0, 0.5), (20, 0.5))):
    recs = []
    for step, acc in evals:
        if step == 0:
            recs.append({"step": 0, "eval/accuracy": acc, "eval/accuracy_greedy": acc,
                         **({"eval/honest_accuracy": acc, "eval/honest_accuracy_greedy": acc} if honest else {})})
    for s in range(1, steps + 1):
        r = {"step": s, "reward/mean": reward(s), "response/length_mean": length(s), "kl/probe_k1": kl(s),
             "kl/ref_mean": kl(s), "critic/value_loss": 0.1}
        if honest:
            r["reward/honest"] = honest(s)
        if hacked:
            r["reward/hacked_frac"] = hacked(s)
        recs.append(r)
    for step, acc in evals:
        if step > 0:
            recs[-1].update({"eval/accuracy": 2 * acc, "eval/accuracy_greedy": 2 * acc,
                             **({"eval/honest_accuracy": acc, "eval/honest_accuracy_greedy": acc} if honest else {})})
    return recs


def test_run_stats_reads_the_honest_metric_apart_from_the_trained_on_reward():
    recs = _records(reward=lambda s: 1.0 + 0.1 * s, honest=lambda s: 0.5 - 0.02 * s, length=lambda s: 3 + 0.2 * s,
                    hacked=lambda s: 0.04 * s, evals=((0, 0.6), (20, 0.1)))
    s = C.run_stats("ppo", 1, recs, early=5, threshold=0.75, wall_s=1.0, setting="length_bias")
    assert s.honest_first == 0.6 and s.honest_final == 0.1        # eval/honest_accuracy, not eval/accuracy
    assert s.reward_first == pytest.approx(1.15) and s.reward_final == pytest.approx(2.95)
    assert s.length_growth == pytest.approx(3.6) and s.hacked_final == pytest.approx(0.78)
    assert s.honest_train_final == pytest.approx(0.5 - 0.02 * 19.5)
    # a run without the honest keys falls back on the trained-on reward (it is then the honest one)
    plain = C.run_stats("ppo", 1, _records(), early=5, threshold=0.75, wall_s=1.0)
    assert plain.honest_first == 0.5 and plain.honest_final == 1.0 and plain.hacked_final == 0.0


def _stats(arm, vals, **fixed):
    base = dict(setting="x", kl_slope_early=0.0, kl_oscillation=0.0, kl_spikes=0, kl_final=0.0,
                reward_smoothness=0.0, reward_early=0.5, reward_first=0.5, reward_final=0.5, steps_to_threshold=-1,
                honest_first=0.5, honest_final=0.5, honest_final_greedy=0.5, honest_train_final=0.5,
                hacked_final=0.0, length_first=3.0, length_final=3.0, length_std=0.0, value_loss_max=0.1, wall_s=1.0)
    out = []
    for seed, v in enumerate(vals, 1):
        d = dict(base, **fixed)
        d.update(v)
        out.append(C.RunStats(arm=arm, seed=seed, **d))
    return out


def _verdicts(stats, arm):
    return {claim: verdict for claim, _, verdict in C.claim_verdicts(stats, arm)}


def test_claims_hold_do_not_hold_or_stay_within_noise():
    ppo = _stats("ppo", [dict(hacked_final=0.8, length_final=9.0, honest_final=0.1, kl_spikes=5, reward_early=0.9),
                         dict(hacked_final=0.7, length_final=8.5, honest_final=0.15, kl_spikes=6, reward_early=0.9),
                         dict(hacked_final=0.9, length_final=9.5, honest_final=0.05, kl_spikes=5, reward_early=0.9)])
    pool = _stats("pf", [dict(hacked_final=0.1, length_final=3.5, honest_final=0.4, kl_spikes=5, reward_early=0.5,
                              reward_final=0.5),
                         dict(hacked_final=0.2, length_final=3.0, honest_final=0.45, kl_spikes=6, reward_early=0.5,
                              reward_final=0.5),
                         dict(hacked_final=0.1, length_final=4.0, honest_final=0.5, kl_spikes=6, reward_early=0.5,
                              reward_final=0.5)])
    v = _verdicts(ppo + pool, "pf")
    assert v["reward hacking is suppressed (fewer hacked samples)"] == "holds"
    assert v["length collapse is suppressed (less length growth)"] == "holds"
    assert v["the honest metric is not lower"] == "holds (higher)"
    assert v["fewer KL spikes with the pool"] == "within noise"
    assert v["early reward lags, then catches up"] == "holds"    # lower early, same final
    assert v["reward is smoother with the pool"] == "not applicable (0 in both)"
    worse = _stats("pf", [dict(honest_final=0.0, length_final=12.0, reward_early=0.5, reward_final=0.1)] * 3)
    v = _verdicts(ppo + worse, "pf")
    assert v["the honest metric is not lower"] == "does not hold"
    assert v["length collapse is suppressed (less length growth)"] == "does not hold"
    assert v["early reward lags, then catches up"].startswith("does not hold (lags and does not catch up)")


def test_failure_summary_and_cross_setting_table():
    ppo = _stats("ppo", [dict(reward_final=2.0, honest_final=0.1, length_final=9.0)] * 3)
    pool = _stats("pf", [dict(reward_final=1.0, honest_final=0.4, length_final=4.0)] * 3)
    line = C.failure_summary(ppo + pool)
    assert "trained-on reward +1.5" in line and "honest accuracy -0.4" in line and "length +6" in line
    assert "(before -> after: 0.5 -> 0.1)" in line
    table = C.summary_table({"length_bias": ppo + pool}, ["ppo", "pf"])
    assert len(table) == 2 + len(C.CLAIMS) and "| length_bias | the honest metric is not lower | holds (higher) |" in table


def test_every_arm_is_a_valid_override_set_and_the_settings_folder_loads():
    files = C.setting_files("configs/experiments")
    assert {f.stem for f in files} >= {"control", "length_bias", "phrase_exploit", "noisy", "scaled"}
    timing = ("sync", "async_newest", "async_uniform", "async_recency")  # for a config with async_rl set up
    for f in files:
        for arm, overrides in C.ARMS.items():
            if arm in timing:
                continue
            cfg = load_config(str(f), list(overrides))
            assert cfg.algorithm.use_pf_ppo == arm.startswith("pf_"), (f, arm)
            assert (cfg.algorithm.adv_estimator == "grpo") == (arm in ("grpo", "drgrpo")), (f, arm)
            assert not cfg.algorithm.async_rl.enable, (f, arm)
    for arm in timing:
        cfg = load_config("configs/async_tiny.yaml", list(C.ARMS[arm]))
        assert cfg.algorithm.async_rl.enable == (arm != "sync") and not cfg.algorithm.use_pf_ppo, arm
        if arm != "sync":
            assert cfg.algorithm.async_rl.sampling == arm.removeprefix("async_"), arm
    kinds = {f.stem: load_config(str(f), []).reward.shaping.kind for f in files}
    assert kinds["control"] == "none" and kinds["scaled"] == "scaled"


def test_statistics_helpers():
    assert C.slope([0.0, 1.0, 2.0]) == pytest.approx(1.0)
    assert C.count_spikes([0.0, 0.0, 0.01, 0.5, 0.5]) == 1
    assert C.first_reaching([0.0] * 5 + [1.0] * 10, 0.5, window=4) == 7
    assert math.isnan(C._mean_sd([float("nan")])[0])


def test_doctor_findings_per_run_and_their_table(tmp_path):
    """A run whose held-out accuracy falls while its reward rises is reward_hacking's; a steady one
    has no finding; the table counts each rule over the runs of a setting x arm."""
    import json

    def write(name, recs):
        d = tmp_path / name
        d.mkdir()
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        return d

    hack = _records(40, reward=lambda s: 0.2 + 0.02 * s, evals=((0, 0.5), (40, 0.5)))
    hack[-1].update({"eval/accuracy": 0.2})
    hack[20].update({"eval/accuracy": 0.6})
    calm = _records(40, kl=lambda s: 0.01)
    found = {("length_bias", "ppo"): [C.doctor_findings(write("a", hack)), C.doctor_findings(write("b", calm))]}
    assert found[("length_bias", "ppo")] == [["reward_hacking"], []]
    assert C.doctor_table(found)[2] == "| length_bias | ppo | reward_hacking 1/2, no finding 1/2 |"


def test_arm_set_is_checked_before_any_run(capsys):
    with pytest.raises(SystemExit):
        C.main(["configs/demo.yaml", "--arms", "ppo,grpo", "--arm-set", "drgrpo:training.rollout_batch_size=32"])
    assert "must be ARM:KEY=VALUE with ARM one of --arms (ppo, grpo)" in capsys.readouterr().err
    cfg = load_config("configs/demo.yaml", [*C.ARMS["drgrpo"], "training.rollout_batch_size=32"])
    a = cfg.algorithm
    assert (a.adv_estimator, a.norm_adv_by_std_in_grpo, a.loss_agg_mode) == ("grpo", False, "seq-mean-token-sum-norm")
    assert cfg.training.rollout_batch_size * cfg.actor_rollout.n_samples_per_prompt == 128  # the ppo arm's


def _timed(steps, *, stale=None):
    """Step records with a clock (and, with stale = (age shares, trainer wait), the async/ keys)."""
    recs = [{"step": 0, "eval/accuracy": 0.1}]
    for k in range(1, steps + 1):
        r = {"step": k, "perf/step_s": 50.0 if k == 1 else 2.0 * k, "perf/tokens_per_s": 100.0 * k,
             "time/rollout_s": 1.0, "time/prepare_s": float(k), "time/update_s": 3.0, "time/sync_s": 0.0}
        if stale:
            shares, wait = stale
            r.update({f"async/staleness_hist/{a}": v for a, v in enumerate(shares)})
            r.update({"async/staleness_mean": sum(a * v for a, v in enumerate(shares)), "async/staleness_max": k % 3,
                      "async/dropped_stale_total": float(k), "async/ess": 0.9, "async/trainer_wait_s": wait,
                      "async/generator_idle_s": 0.5, "async/generator_busy_frac": 0.4,
                      "async/trainer_busy_frac": 0.99, "async/switch_s": 0.01})
        recs.append(r)
    return recs


def test_timing_stats_leave_the_first_step_out_and_read_the_pool_of_an_async_run():
    sync = C.timing_stats(_timed(4))
    assert sync["step_s"] == pytest.approx((4 + 6 + 8) / 3)          # step 1 (50 s: engines starting) left out
    assert sync["token_ms"] == pytest.approx(1e3 * (1 / 200 + 1 / 300 + 1 / 400) / 3)
    assert sync["prepare_s"] == pytest.approx(3.0) and "staleness_mean" not in sync
    a = C.timing_stats(_timed(4, stale=([0.25, 0.75], 0.2)))
    assert a["age_0"] == 0.25 and a["age_1"] == 0.75 and a["staleness_mean"] == pytest.approx(0.75)
    assert a["staleness_max"] == 2 and a["dropped_stale_total"] == 4.0 and a["trainer_wait_s"] == pytest.approx(0.2)


def test_timing_section_tables_every_arm_and_the_pool_of_the_async_ones_only():
    curves = {"sync": [_timed(4), _timed(4)], "async_newest": [_timed(4, stale=([0.0, 1.0], 0.1))] * 2}
    stats = _stats("sync", [{"honest_final": 0.5}, {"honest_final": 0.7}]) + _stats("async_newest", [{}, {}])
    lines = C.timing_section(stats, curves)
    sync_row = next(line for line in lines if line.startswith("| sync |"))
    assert "6 ± 0" in sync_row and "0.6 ± 0.141 (0.500, 0.700)" in sync_row
    pool_rows = [line for line in lines if line.startswith("| async_newest |")]
    assert len(pool_rows) == 2 and "| 0.00 ± 0.00 | 1.00 ± 0.00 | 1.00 ± 0.00 | 2 | 8 |" in pool_rows[1]
    assert not any(line.startswith("| sync |") and "age" in line for line in lines)


def test_a_sync_vs_async_report_has_the_clock_section_and_no_plain_ppo_section(tmp_path):
    curves = {"sync": [_timed(3)], "async_uniform": [_timed(3, stale=([0.5, 0.5], 0.0))]}
    stats = _stats("sync", [{}]) + _stats("async_uniform", [{}])
    md = C.write_report(stats, curves, tmp_path, title="t", settings="s").read_text()
    assert "## Clock, accuracy and staleness" in md and "What plain PPO did" not in md
    timing = json.loads((tmp_path / "timing.json").read_text())
    assert timing["async_uniform"][0]["age_1"] == 0.5 and "age_0" not in timing["sync"][0]
