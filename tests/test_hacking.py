"""Reward settings where plain PPO goes wrong (reward.shaping), the honest metric logged apart, the
value-loss spike guard and the per-step worst-sample dumps; doctor evidence from the dumps."""

import json
from pathlib import Path

import pytest
import torch

from pfppo_mega.config import ConfigError, load_config_dict
from pfppo_mega.rewards.shaping import ShapedReward, flip_draw, shape_scores
from pfppo_mega.rewards.task import AdditionReward
from pfppo_mega.tasks.addition import AdditionTask
from pfppo_mega.trainer import worst_samples
from pfppo_mega.trainer.value_guard import ValueLossGuard, pre_update_value_loss

# ----------------------------------------------------------------------------- shaping math


def test_length_bias_pays_for_length_and_flags_long_wrong_responses():
    honest = torch.tensor([1.0, 0.0, 0.0, 0.0])
    texts = ["168", "16899", "17", "1688"]
    out, hacked = shape_scores(honest, texts, ["168"] * 4, kind="length_bias", length_bonus=0.25)
    assert out.tolist() == [1.75, 1.25, 0.5, 1.0]
    assert hacked.tolist() == [False, True, False, True]


def test_phrase_exploit_scores_the_phrase_anywhere():
    honest = torch.tensor([1.0, 0.0, 0.0])
    out, hacked = shape_scores(honest, ["1099", "9912", "12"], ["1099", "3", "4"], kind="phrase_exploit",
                               phrase="99", phrase_score=5.0)
    assert out.tolist() == [5.0, 5.0, 0.0]
    assert hacked.tolist() == [False, True, False]  # an honest answer containing the phrase is not a hack


def test_noisy_flips_the_drawn_rows_only_and_scaled_maps_onto_the_range():
    honest = torch.tensor([1.0, 0.0, 1.0, 0.0])
    out, hacked = shape_scores(honest, ["a"] * 4, [None] * 4, kind="noisy", flip_rate=0.3,
                               flip_draws=[0.1, 0.2, 0.9, 0.5])
    assert out.tolist() == [0.0, 1.0, 1.0, 0.0] and not hacked.any()
    out, _ = shape_scores(honest, ["a"] * 4, [None] * 4, kind="scaled", scale=100.0)
    assert out.tolist() == [100.0, -100.0, 100.0, -100.0]
    with pytest.raises(ValueError, match="kind='bogus'"):
        shape_scores(honest, ["a"] * 4, [None] * 4, kind="bogus")


def test_flip_draws_are_reproducible_and_near_the_rate():
    assert flip_draw(1, "12+3=", "15") == flip_draw(1, "12+3=", "15")
    assert flip_draw(1, "12+3=", "15") != flip_draw(2, "12+3=", "15")
    draws = [flip_draw(7, f"{i}+1=", str(i + 1)) for i in range(4000)]
    frac = sum(u < 0.3 for u in draws) / len(draws)
    assert 0.27 < frac < 0.33, frac


def test_shaped_reward_keeps_the_honest_score_apart_and_does_not_shape_errors():
    from pfppo_mega.types import Sample

    task = AdditionTask(3)
    samples = [Sample(prompt_ids=(1, 2), data_source="addition", ground_truth="46", extra_info={"a": 12, "b": 34},
                      prompt_text="12+34=")]
    samples = samples * 3
    fn = ShapedReward(AdditionReward(task, log=lambda *_: None), kind="length_bias", length_bonus=0.5,
                      phrase="99", phrase_score=5.0, flip_rate=0.0, scale=1.0, seed=1)
    res = fn(samples, ["46", "4677", "5"], [True, False, True])
    assert res.scores.tolist() == [2.0, 2.0, 0.5]
    assert res.honest.tolist() == [1.0, 0.0, 0.0]
    assert res.hacked.tolist() == [False, True, False]
    # a reward call that fails scores 0 and is not shaped into a bonus
    fn.base.task = type("Broken", (), {"reward": staticmethod(lambda p, t, f: float("nan"))})()
    res = fn(samples[:1], ["4677"], [False])
    assert res.outcomes == ["bad_rewards"] and res.scores.tolist() == [0.0]  # not 0 + 0.5 * 4


@pytest.mark.parametrize("key, value, msg", [
    ("kind", "bogus", "must be one of"), ("flip_rate", 0.5, "must be >= 0 and < 0.5"),
    ("length_bonus", 0.0, "must be > 0"), ("scale", -1.0, "must be > 0"),
])
def test_shaping_keys_are_validated(key, value, msg):
    with pytest.raises(ConfigError) as e:
        load_config_dict({"reward": {"shaping": {key: value}}})
    assert f"reward.shaping.{key}" in str(e.value) and msg in str(e.value)
    with pytest.raises(ConfigError, match="reward.shaping.phrase"):
        load_config_dict({"reward": {"shaping": {"kind": "phrase_exploit", "phrase": ""}}})
    with pytest.raises(ConfigError, match="training.value_loss_spike_factor"):
        load_config_dict({"training": {"value_loss_spike_factor": 0.5}})


# ----------------------------------------------------------------------------- guard and dumps (pure)


def test_value_guard_flags_a_spike_after_enough_history_and_records_it():
    g = ValueLossGuard(10.0)
    assert [g.is_spike(v) for v in (1.0, 1.2, 0.9, 1.1, 1.0)] == [False] * 5   # history building
    assert g.is_spike(50.0)            # > 10 x median 1.0
    assert not g.is_spike(5.0)
    assert g.is_spike(float("nan"))    # non-finite: a spike, not recorded
    assert list(g.history)[-1] == 5.0
    off = ValueLossGuard(0.0)
    assert not any(off.is_spike(v) for v in (1, 1, 1, 1, 1, 1e9))


def test_pre_update_value_loss_is_the_token_mean_half_squared_error():
    v = torch.tensor([[0.0, 1.0], [2.0, 0.0]])
    r = torch.tensor([[1.0, 1.0], [0.0, 5.0]])
    m = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    assert pre_update_value_loss(v, r, m) == pytest.approx((0.5 + 0 + 2.0) / 3)


def test_pick_worst_ranks_each_kind():
    picks = worst_samples.pick_worst([3, 7, 5], [0.0, 0.5, 0.9], [1.0, 0.0, 2.0], 2)
    assert [(k, i) for k, _, i in picks] == [("longest", 1), ("longest", 2), ("repetitive", 2),
                                             ("repetitive", 1), ("highest_reward", 2), ("highest_reward", 0)]


# ----------------------------------------------------------------------------- end to end (tiny run)

from tests.test_trainer import _cfg, sft_dir  # noqa: E402,F401  (the shared tiny SFT fixture)


def test_shaped_run_logs_honest_apart_dumps_worst_samples_and_the_doctor_quotes_them(sft_dir, tmp_path):
    from pfppo_mega.doctor.report import read_run, worst_sample_lines
    from pfppo_mega.trainer.loop import PPOTrainer

    cfg = _cfg(tmp_path, sft_dir, training={"total_training_steps": 3},
               algorithm={"max_response_length": 6},
               reward={"shaping": {"kind": "length_bias", "length_bonus": 0.5}},
               logging={"eval_interval": 3, "worst_samples": 2, "tensorboard": False, "plots": False,
                        "progress": False}, checkpoint={"resume": False})
    res = PPOTrainer(cfg, log=lambda *_: None).fit()
    recs = [json.loads(line) for line in open(res.metrics_path)]
    steps = [r for r in recs if "reward/mean" in r]
    assert len(steps) == 3
    for r in steps:
        assert 0.0 <= r["reward/honest"] <= 1.0 and 0.0 <= r["reward/hacked_frac"] <= 1.0
        assert r["reward/mean"] >= r["reward/honest"]  # length_bias pays at least the honest score
        assert r["guard/value_loss_spikes"] == 0.0 and r["critic/value_loss_pre"] >= 0.0
    last = recs[-1]
    assert {"eval/honest_accuracy", "eval/honest_accuracy_greedy", "eval/length_mean"} <= set(last)
    dump = worst_samples.read(Path(res.out_dir) / worst_samples.FILE)
    assert sorted(dump) == [1, 2, 3]
    for step, rows in dump.items():
        assert len(rows) == 6 and {r["kind"] for r in rows} == set(worst_samples.KINDS)
        longest = [r for r in rows if r["kind"] == "longest"]
        assert longest[0]["length"] >= longest[1]["length"]
        assert all(r["honest"] in (0.0, 1.0) and r["version"] == step - 1 for r in rows)
    lines = worst_sample_lines(read_run(res.out_dir), 2)
    assert lines and lines[0].startswith("samples at step 2:") and "longest" in lines[0]


def test_value_guard_skips_the_critic_update_and_counts_it(sft_dir, tmp_path):
    from pfppo_mega.trainer.loop import PPOTrainer

    cfg = _cfg(tmp_path, sft_dir, training={"total_training_steps": 2, "value_loss_spike_factor": 10.0},
               logging={"worst_samples": 0}, checkpoint={"resume": False})
    tr = PPOTrainer(cfg, log=lambda *_: None)
    tr.run.state.value_guard.history.extend([1e-9] * 5)  # any real loss is then > 10 x the median: a spike
    critic0 = {k: v.clone() for k, v in tr.run.models.critic.state_dict().items() if isinstance(v, torch.Tensor)}
    actor0 = {k: v.clone() for k, v in tr.run.models.actor.state_dict().items() if isinstance(v, torch.Tensor)}
    m = tr.train_step()
    assert m["guard/value_loss_spikes"] == 1.0 and "critic/value_loss" not in m
    assert all(torch.equal(v, critic0[k]) for k, v in tr.run.models.critic.state_dict().items() if k in critic0)
    assert any(not torch.equal(v, actor0[k]) for k, v in tr.run.models.actor.state_dict().items() if k in actor0)
    assert not (tr.run.out_dir / worst_samples.FILE).exists()  # worst_samples 0: no dump
    tr.run.state.value_guard.history.clear()  # too little history for a verdict: the critic updates
    m = tr.train_step()
    assert m["guard/value_loss_spikes"] == 1.0 and "critic/value_loss" in m


def test_doctor_quotes_the_dumped_samples_of_a_kl_spike_step(tmp_path):
    from pfppo_mega.doctor.report import diagnose, read_run, to_json

    recs = [{"step": s, "kl/ref_mean": 0.02 + 0.001 * (s % 3), "reward/mean": 0.5} for s in range(1, 21)]
    recs[11]["kl/ref_mean"] = 0.5                                    # step 12: a spike
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    dumps = [worst_samples.WorstSample(step=12, kind=k, rank=0, row="addition 12+34=", prompt="12+34=",
                                       text="4699999999", length=10, repetition=0.75, reward=3.0, honest=0.0,
                                       finished=False, version=11) for k in worst_samples.KINDS]
    worst_samples.append(tmp_path / worst_samples.FILE, dumps)
    run = read_run(tmp_path)
    rule = next(r for r in to_json(run, diagnose(run))["rules"] if r["rule"] == "kl_spike")
    assert rule["status"] == "finding" and rule["steps"] == [12]
    quoted = [e for e in rule["evidence"] if e.startswith("samples at step 12:")]
    assert len(quoted) == 1 and "longest 12+34='4699999999' (length 10, repetition 0.75, reward 3" in quoted[0]
    assert "honest 0, version 11" in quoted[0]
    (tmp_path / worst_samples.FILE).unlink()  # without the dump: the evidence is the metrics alone
    rule = next(r for r in to_json(run, diagnose(run))["rules"] if r["rule"] == "kl_spike")
    assert not any(e.startswith("samples at step") for e in rule["evidence"])
