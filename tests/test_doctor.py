"""`pfppo doctor`: every rule on a SYNTHETIC metrics series that shows its symptom and on one that
does not; reading run directories (good, torn, unreadable); exit codes and --json; the remedies'
config keys exist; docs/troubleshooting.md is generated from the rules.

Most series here are synthetic (hand-made curves written as metrics.jsonl); a few are copied from
real runs (REAL_*: the run each comes from is named where it is defined).
"""

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pfppo_mega.config import config_to_dict, load_config_dict
from pfppo_mega.doctor import RULES, RULES_BY_NAME, RunDirError, diagnose, main, read_run, to_json
from pfppo_mega.doctor import table
from pfppo_mega.doctor.rules import config_value

ROOT = Path(__file__).resolve().parents[1]
N = 40


def healthy_records(n: int = N) -> list[dict]:
    """A synthetic plain-PPO run that goes well: reward up, accuracy up, KL creeping, value loss
    settling, length steady."""
    recs = [{"step": 0, "eval/accuracy": 0.3, "eval/accuracy_greedy": 0.5}]
    for s in range(1, n + 1):
        wiggle = 0.01 * math.sin(s)
        recs.append({
            "step": s, "reward/mean": 0.3 + 0.01 * s + wiggle, "reward/std": 0.4,
            "reward/q10": 0.0, "reward/q90": 1.0,
            "kl/ref_mean": 0.002 * s + 0.001 * abs(wiggle),
            "response/length_mean": 5.0 + wiggle, "response/length_max": 8.0,
            "response/finished_frac": 0.98, "response/repetition_rate": 0.02,
            "critic/value_loss": 0.5 / (1 + 0.2 * s) + 0.01 + wiggle / 10, "critic/grad_norm": 0.3,
            "policy/approx_kl": 0.01, "rollout/logp_gap_rows": 32.0,
        })
        if s % 10 == 0:
            recs[-1].update({"eval/accuracy": 0.3 + 0.01 * s, "eval/accuracy_greedy": 0.5 + 0.005 * s})
    return recs


def with_pool(recs: list[dict]) -> list[dict]:
    for r in recs:
        if "reward/mean" in r:
            r.update({"pool/size": 3.0, "pool/snapshots_used": 2.0, "guard/corrupt_snapshots": 0.0})
    return recs


def write_run(tmp: Path, recs: list[dict], config: dict | None = None) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    if config is not None:
        (tmp / "config.yaml").write_text(yaml.safe_dump(config))
    return tmp


def default_config(**changes) -> dict:
    """A resolved config as pfppo train writes it to config.yaml (defaults; `sec__key=value` changes)."""
    d = config_to_dict(load_config_dict({"actor_rollout": {"model_path": "sft"}}))
    for key, value in changes.items():
        node = d
        *parents, leaf = key.split("__")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return d


def verdicts(run_dir: Path) -> dict[str, str]:
    run = read_run(run_dir)
    return {d.rule.name: d.verdict.status for d in diagnose(run)}


# ----------------------------------------------------------------------------- the symptoms (synthetic)


def kl_spike(recs):
    """Synthetic: KL steady ~0.02-0.04, then 0.3 at step 25 (long, repetitive samples that step)."""
    for r in recs:
        if r.get("step") == 25:
            r.update({"kl/ref_mean": 0.3, "response/length_max": 32.0, "response/repetition_rate": 0.6})
    return recs


def reward_scale(recs):
    """Synthetic: rewards in [-100, 100]."""
    for r in recs:
        if "reward/mean" in r:
            r.update({"reward/q10": -95.0, "reward/q90": 98.0, "reward/std": 80.0})
    return recs


def length_growth(recs):
    """Synthetic: mean length 5 -> 20 tokens, responses stop finishing, bigrams repeat."""
    for r in recs:
        if "reward/mean" in r:
            s = r["step"]
            r.update({"response/length_mean": 5.0 + 15.0 * s / N, "response/finished_frac": 1.0 - 0.8 * s / N,
                      "response/repetition_rate": 0.5 * s / N})
    return recs


def value_divergence(recs):
    """Synthetic: value loss settles to ~0.05 then climbs to ~2 over the last quarter."""
    for r in recs:
        if "reward/mean" in r:
            s = r["step"]
            r["critic/value_loss"] = 0.05 if s <= 28 else 0.05 * 1.5 ** (s - 28)
    return recs


def value_nan(recs):
    """Synthetic: a NaN value loss at step 12."""
    for r in recs:
        if r.get("step") == 12:
            r["critic/value_loss"] = float("nan")
    return recs


def pool_disagree(recs):
    """Synthetic: from step 20 one of two ranks holds 2 snapshots, the other 3 (mean 2.5)."""
    for r in with_pool(recs):
        if r.get("step", 0) >= 20 and "pool/size" in r:
            r["pool/size"] = 2.5
    return recs


def pool_corrupt(recs):
    """Synthetic: a snapshot fails its checksum at step 17 (the running count goes 0 -> 1)."""
    for r in with_pool(recs):
        if r.get("step", 0) >= 17 and "pool/size" in r:
            r["guard/corrupt_snapshots"] = 1.0
    return recs


def hacking(recs):
    """Synthetic: reward keeps rising; held-out accuracy peaks at step 10 (0.5) and falls to 0.2."""
    acc = {0: 0.3, 10: 0.5, 20: 0.4, 30: 0.3, 40: 0.2}
    for r in recs:
        if "reward/mean" in r:
            r["reward/mean"] = 0.2 + 0.02 * r["step"]
        if r["step"] in acc:
            r["eval/accuracy"] = acc[r["step"]]
    return recs


def noisy(recs):
    """Synthetic: the trained-on reward flat around 0.45; held-out accuracy 0.3 -> 0.15 (a reward
    with flipped labels: the policy follows the noise)."""
    acc = {0: 0.3, 10: 0.25, 20: 0.2, 30: 0.18, 40: 0.15}
    for r in recs:
        if "reward/mean" in r:
            r["reward/mean"] = 0.45 + 0.01 * math.sin(r["step"])
        if r["step"] in acc:
            r["eval/accuracy"] = acc[r["step"]]
    return recs


def gap_unchecked(recs):
    """Synthetic: the engine/trainer log-prob check covered rows in step 1 only (an asynchronous run)."""
    for r in recs:
        if "reward/mean" in r and r["step"] > 1:
            r["rollout/logp_gap_rows"] = 0.0
    return recs


SYMPTOMS = [
    ("kl_spike", kl_spike), ("reward_scale", reward_scale), ("length_collapse", length_growth),
    ("value_divergence", value_divergence), ("value_divergence", value_nan),
    ("pool_inconsistency", pool_disagree), ("pool_inconsistency", pool_corrupt),
    ("reward_hacking", hacking), ("noisy_reward", noisy), ("engine_gap_unchecked", gap_unchecked),
]


def test_healthy_synthetic_run_has_no_finding(tmp_path):
    v = verdicts(write_run(tmp_path, with_pool(healthy_records()), default_config()))
    assert v == {r.name: "healthy" for r in RULES}, v


@pytest.mark.parametrize("rule,make", SYMPTOMS, ids=[f"{r}-{m.__name__}" for r, m in SYMPTOMS])
def test_rule_finds_its_synthetic_symptom_and_only_it(tmp_path, rule, make):
    v = verdicts(write_run(tmp_path, make(healthy_records()), default_config()))
    assert v[rule] == "finding", v
    others = {k: s for k, s in v.items() if k != rule and s == "finding"}
    assert not others, f"{make.__name__} also tripped {others}"


def test_every_rule_is_exercised_both_ways():
    assert {r for r, _ in SYMPTOMS} == set(RULES_BY_NAME)


def test_kl_spike_evidence_names_step_value_and_samples(tmp_path):
    run = read_run(write_run(tmp_path, kl_spike(healthy_records()), default_config()))
    rep = to_json(run, diagnose(run))
    kl = next(r for r in rep["rules"] if r["rule"] == "kl_spike")
    assert kl["steps"] == [25]
    assert "step 25" in kl["evidence"][0] and "0.3" in kl["evidence"][0]
    assert "response/length_max 32" in kl["evidence"][0]
    # the article's order: inspect samples, clip 0.1, KL coefficient +30%, reward quantile clip p95
    rem = kl["remedies"]
    assert [r["key"] for r in rem] == [None, "algorithm.clip_ratio", "algorithm.kl_coeff", "reward.quantile_clip"]
    assert rem[1]["current"] == 0.2 and rem[1]["suggested"] == 0.1
    assert rem[2]["current"] == 0.05 and rem[2]["suggested"] == pytest.approx(0.065)
    assert rem[3]["suggested"] == 0.95


def test_gradual_kl_growth_is_not_a_spike(tmp_path):
    """Synthetic: KL doubling slowly (x1.1 a step) from 0.01: no step is 3x the median before it."""
    recs = healthy_records()
    for r in recs:
        if "kl/ref_mean" in r:
            r["kl/ref_mean"] = 0.01 * 1.1 ** r["step"]
    assert verdicts(write_run(tmp_path, recs))["kl_spike"] == "healthy"


# kl/ref_mean (k1 estimator: noisy, can be negative) of steps 1-30 of a real tiny PF-PPO run: this
# file's TINY-like model (2 layers, hidden 64) after SFT, 1-digit addition, rollout_batch_size 64,
# lr 3e-4, kl_coeff 0.01, max_response_length 5, pool 3 every 2 steps, seed 3.
REAL_K1 = [0.0, -0.0375, -0.0157, -0.0388, 0.0363, 0.1078, 0.1055, 0.0185, 0.0535, -0.0063, 0.0219, 0.0531,
           0.0909, 0.1395, 0.1157, 0.0205, 0.1019, 0.0742, 0.088, 0.1946, 0.1783, 0.1395, 0.056, 0.1472,
           0.2479, 0.2977, 0.2744, 0.2354, 0.4226, 0.2146]


def test_noisy_k1_kl_around_zero_is_not_a_spike(tmp_path):
    """Regression: a ratio to the median alone flagged steps 6-9 of this real run (median <= 0)."""
    recs = healthy_records(len(REAL_K1))
    for r in recs[1:]:
        r["kl/ref_mean"] = REAL_K1[r["step"] - 1]
    assert verdicts(write_run(tmp_path / "real", recs))["kl_spike"] == "healthy"
    recs[26]["kl/ref_mean"] = 1.5  # the same run with a real jump at step 26
    run = read_run(write_run(tmp_path / "jump", recs))
    kl = next(d for d in diagnose(run) if d.rule.name == "kl_spike")
    assert kl.verdict.status == "finding" and kl.verdict.steps == [26]


def test_reward_scale_is_healthy_when_the_trainer_rescales(tmp_path):
    recs = reward_scale(healthy_records())
    assert verdicts(write_run(tmp_path / "a", recs, default_config()))["reward_scale"] == "finding"
    scaled = default_config(reward__scaling="batch_zscore")
    assert verdicts(write_run(tmp_path / "b", recs, scaled))["reward_scale"] == "healthy"


def test_length_remedy_order_and_suggestion(tmp_path):
    run = read_run(write_run(tmp_path, length_growth(healthy_records()),
                             default_config(algorithm__max_response_length=32)))
    rep = to_json(run, diagnose(run))
    ln = next(r for r in rep["rules"] if r["rule"] == "length_collapse")
    assert [r["key"] for r in ln["remedies"]] == ["algorithm.max_response_length", "reward.length_penalty"]
    assert ln["remedies"][0]["suggested"] == 24
    assert any("response/finished_frac" in e for e in ln["evidence"])
    assert any("response/repetition_rate" in e for e in ln["evidence"])


def test_value_remedies_lower_vf_coef_then_clip_critic_gradients(tmp_path):
    rule = RULES_BY_NAME["value_divergence"]
    assert [r.key for r in rule.remedies] == ["algorithm.vf_coef", "training.critic_grad_clip"]
    run = read_run(write_run(tmp_path, value_divergence(healthy_records()), default_config()))
    rem = next(r for r in to_json(run, diagnose(run))["rules"] if r["rule"] == "value_divergence")["remedies"]
    assert (rem[0]["current"], rem[0]["suggested"]) == (0.1, 0.05)
    assert (rem[1]["current"], rem[1]["suggested"]) == (1.0, 0.5)  # resolved from training.grad_clip
    old = default_config(training__grad_clip=0.8)  # a config.yaml from before the key
    del old["training"]["critic_grad_clip"]
    run = read_run(write_run(tmp_path / "old", value_divergence(healthy_records()), old))
    rem = next(r for r in to_json(run, diagnose(run))["rules"] if r["rule"] == "value_divergence")["remedies"]
    assert (rem[1]["current"], rem[1]["suggested"]) == (None, 0.4)


def test_hacking_needs_the_honest_metric_to_fall(tmp_path):
    """Synthetic: the same rising reward with accuracy rising too is healthy."""
    recs = hacking(healthy_records())
    for r in recs:
        if "eval/accuracy" in r:
            r["eval/accuracy"] = 0.3 + 0.01 * r["step"]
    assert verdicts(write_run(tmp_path, recs))["reward_hacking"] == "healthy"


def test_noisy_reward_is_not_hacking_a_scale_problem_or_a_falling_reward(tmp_path):
    """Synthetic: the same falling accuracy is reward_hacking's when the reward rises, neither rule's
    when the reward falls with it (the reward still tracks the task), and not noisy_reward's when
    samples are marked hacked or the reward's scale is the problem."""
    def run(name, change, config=None):
        recs = noisy(healthy_records())
        for r in recs:
            if "reward/mean" in r:
                change(r)
        return verdicts(write_run(tmp_path / name, recs, config))

    assert run("flat", lambda r: None)["noisy_reward"] == "finding"
    rising = run("rising", lambda r: r.update({"reward/mean": 0.2 + 0.02 * r["step"]}))
    assert rising["noisy_reward"] == "healthy" and rising["reward_hacking"] == "finding"
    falling = run("falling", lambda r: r.update({"reward/mean": 0.8 - 0.01 * r["step"]}))
    assert falling["noisy_reward"] == falling["reward_hacking"] == "healthy"
    assert run("hacked", lambda r: r.update({"reward/hacked_frac": 0.4}))["noisy_reward"] == "healthy"
    scaled = run("scaled", lambda r: r.update({"reward/mean": 100 * (2 * r["reward/mean"] - 1), "reward/std": 99.0,
                                               "reward/q10": -100.0, "reward/q90": 100.0}), default_config())
    assert scaled["noisy_reward"] == "healthy" and scaled["reward_scale"] == "finding"
    one_eval = noisy(healthy_records())
    for r in one_eval:
        if r["step"] not in (0, 40):
            r.pop("eval/accuracy", None)
    v = verdicts(write_run(tmp_path / "two_evals", one_eval))
    assert v["noisy_reward"] == "not_checked"


def test_noisy_reward_remedies_in_order(tmp_path):
    run = read_run(write_run(tmp_path, noisy(healthy_records()), default_config(training__lr=1e-4)))
    rep = next(r for r in to_json(run, diagnose(run))["rules"] if r["rule"] == "noisy_reward")
    assert [r["key"] for r in rep["remedies"]] == ["reward.custom_function.path", "training.lr", "algorithm.kl_coeff",
                                                   "reward.quantile_clip", "training.rollout_batch_size"]
    assert rep["remedies"][1]["suggested"] == pytest.approx(5e-5)
    assert rep["remedies"][4]["current"] * 2 == rep["remedies"][4]["suggested"]
    assert "eval/accuracy 0.3 at step 0 -> 0.15 at step 40" in rep["evidence"][0]
    assert rep["evidence"][1].startswith("reward/mean flat")


# reward/mean and the held-out honest accuracy (eval/honest_accuracy, 128 prompts, sampled) of a
# real run: runs/compare_all/noisy/ppo/seed2 (configs/experiments/noisy.yaml: 40% of the 0/1 labels
# flipped, plain PPO, 60 steps); its reward/std stayed at ~0.498. The trained-on reward on the
# held-out prompts (eval/accuracy) went 0.398 -> 0.453 meanwhile.
REAL_NOISY_REWARD = [
    0.5469, 0.5, 0.5156, 0.2969, 0.4844, 0.4219, 0.5625, 0.375, 0.4688, 0.4688, 0.3281, 0.3906, 0.3594, 0.6094,
    0.4062, 0.4219, 0.4531, 0.4375, 0.3281, 0.5, 0.4219, 0.625, 0.4062, 0.3906, 0.5, 0.4062, 0.4062, 0.3125,
    0.4375, 0.5, 0.4844, 0.375, 0.4531, 0.5312, 0.4219, 0.4375, 0.5156, 0.2031, 0.3125, 0.4375, 0.4688, 0.4062,
    0.2812, 0.4062, 0.4531, 0.3281, 0.4219, 0.4062, 0.4844, 0.4062, 0.375, 0.3906, 0.3281, 0.4844, 0.5156,
    0.3438, 0.4688, 0.2969, 0.4219, 0.4375]
REAL_NOISY_HONEST = {0: 0.2422, 10: 0.1797, 20: 0.1406, 30: 0.1484, 40: 0.125, 50: 0.1172, 60: 0.1016}
REAL_NOISY_ACC = {0: 0.3984, 10: 0.4141, 20: 0.3828, 30: 0.4375, 40: 0.3984, 50: 0.4062, 60: 0.4531}


# The same of the honest control: runs/compare_all/control/ppo/seed1 (configs/experiments/control.yaml:
# the exact reward, plain PPO, 60 steps; eval/accuracy is then the honest metric; reward/std ~0.460).
REAL_CONTROL_REWARD = [
    0.1875, 0.125, 0.2656, 0.1719, 0.2656, 0.25, 0.2344, 0.1719, 0.2344, 0.2812, 0.2969, 0.2812, 0.3125, 0.2656,
    0.3125, 0.2188, 0.2812, 0.2656, 0.2812, 0.25, 0.25, 0.2969, 0.3125, 0.3281, 0.2031, 0.3125, 0.2969, 0.4062,
    0.3594, 0.2969, 0.3438, 0.3281, 0.4062, 0.2812, 0.3438, 0.3594, 0.2344, 0.3281, 0.3281, 0.2969, 0.4219,
    0.2656, 0.2344, 0.375, 0.2969, 0.3438, 0.2969, 0.2812, 0.4062, 0.4375, 0.3906, 0.3906, 0.375, 0.3281, 0.3906,
    0.3281, 0.3438, 0.2969, 0.3281, 0.2812]
REAL_CONTROL_ACC = {0: 0.2578, 10: 0.2734, 20: 0.3281, 30: 0.3359, 40: 0.3906, 50: 0.3594, 60: 0.3672}


def real_series(rewards: list[float], honest: dict[int, float] | None, acc: dict[int, float],
                std: float) -> list[dict]:
    recs = healthy_records(len(rewards))
    for r in recs:
        if "reward/mean" in r:
            r.update({"reward/mean": rewards[r["step"] - 1], "reward/std": std})
        if r["step"] in acc:
            r.update({"eval/accuracy": acc[r["step"]], **({"eval/honest_accuracy": honest[r["step"]]} if honest else {})})
    return recs


def test_noisy_reward_on_a_real_noisy_run_and_not_on_the_real_control(tmp_path):
    v = verdicts(write_run(tmp_path / "noisy", real_series(REAL_NOISY_REWARD, REAL_NOISY_HONEST, REAL_NOISY_ACC,
                                                           0.498)))
    assert v["noisy_reward"] == "finding", v
    assert [k for k, s in v.items() if s == "finding"] == ["noisy_reward"], v
    # without the honest metric apart, the noisy run's trained-on accuracy rose: nothing to see
    blind = verdicts(write_run(tmp_path / "blind", real_series(REAL_NOISY_REWARD, None, REAL_NOISY_ACC, 0.498)))
    assert blind["noisy_reward"] == "healthy", blind
    ctl = verdicts(write_run(tmp_path / "control", real_series(REAL_CONTROL_REWARD, None, REAL_CONTROL_ACC, 0.460)))
    assert ctl["noisy_reward"] == "healthy", ctl
    assert not [k for k, s in ctl.items() if s == "finding"], ctl


def test_short_or_plain_ppo_runs_are_not_checked_not_healthy(tmp_path, capsys):
    v = verdicts(write_run(tmp_path, healthy_records(3)))
    assert v["kl_spike"] == v["length_collapse"] == v["value_divergence"] == "not_checked"
    assert v["pool_inconsistency"] == "not_checked"  # no pool/* metrics: plain PPO
    assert main([str(tmp_path)]) == 0
    assert "3 training steps, no finding (7 of 8 rules not checked)" in capsys.readouterr().out


def test_remedy_keys_exist_and_suggestions_are_valid_values():
    """A remedy naming a key the config does not have, or suggesting a value it refuses, would send
    a user to an error: apply every suggestion to the default config through the loader."""
    d = default_config()
    for rule in RULES:
        for rem in rule.remedies:
            if rem.key is None:
                continue
            parent, leaf = rem.key.rsplit(".", 1)
            assert leaf in config_value(d, parent), (rule.name, rem.key)
            if rem.suggest is not None:
                value = rem.suggest(config_value(d, rem.key))
                cfg = load_config_dict({"actor_rollout": {"model_path": "sft"}},
                                       [f"{rem.key}={json.dumps(value)}"])
                assert config_value(config_to_dict(cfg), rem.key) == value, (rule.name, rem.key)


# ----------------------------------------------------------------------------- reading run directories


def test_unreadable_run_dirs_exit_2_with_named_error(tmp_path, capsys):
    assert main([str(tmp_path / "nope")]) == 2
    assert "no such directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == 2
    assert "metrics.jsonl: missing" in capsys.readouterr().err
    bad = write_run(tmp_path / "bad", healthy_records(4))
    text = (bad / "metrics.jsonl").read_text().splitlines()
    text.insert(2, "{not json")
    (bad / "metrics.jsonl").write_text("\n".join(text) + "\n")
    assert main([str(bad)]) == 2
    assert "metrics.jsonl line 3: not a JSON record" in capsys.readouterr().err
    only_eval = write_run(tmp_path / "eval_only", healthy_records(0))
    assert main([str(only_eval)]) == 2
    assert "no training step recorded" in capsys.readouterr().err
    strval = write_run(tmp_path / "str", [{"step": 1, "reward/mean": "high"}])
    with pytest.raises(RunDirError, match=r"step 1: reward/mean = 'high' is not a number"):
        read_run(strval)


def test_torn_last_line_is_skipped_with_a_note(tmp_path):
    d = write_run(tmp_path, healthy_records(12))
    with open(d / "metrics.jsonl", "a") as f:
        f.write('{"step": 13, "reward/me')
    run = read_run(d)
    assert run.steps == 12 and any("torn last record" in n for n in run.notes)
    assert any("config.yaml absent" in n for n in run.notes)


def test_exit_codes_text_and_json(tmp_path, capsys):
    good = write_run(tmp_path / "good", with_pool(healthy_records()), default_config())
    assert main([str(good)]) == 0
    assert "healthy" in capsys.readouterr().out
    sick = write_run(tmp_path / "sick", kl_spike(healthy_records()), default_config())
    assert main([str(sick)]) == 1
    out = capsys.readouterr().out
    assert "[1] kl_spike" in out and "step 25" in out and "algorithm.clip_ratio: 0.2 -> 0.1" in out
    assert out.index("algorithm.clip_ratio") < out.index("algorithm.kl_coeff") < out.index("reward.quantile_clip")
    assert "[reward.quantile_clip: null -> 0.95]" in out
    no_config = write_run(tmp_path / "no_config", kl_spike(healthy_records()))
    assert main([str(no_config)]) == 1
    assert "[algorithm.clip_ratio: ? -> 0.1]" in capsys.readouterr().out
    assert main([str(sick), "--json"]) == 1
    rep = json.loads(capsys.readouterr().out)
    assert rep["healthy"] is False
    assert [r["rule"] for r in rep["rules"] if r["status"] == "finding"] == ["kl_spike"]


def test_cli_subcommand(tmp_path):
    sick = write_run(tmp_path, value_nan(healthy_records()))
    out = subprocess.run([sys.executable, "-m", "pfppo_mega", "doctor", str(sick)], capture_output=True,
                         text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 1, out.stderr
    assert "value_divergence" in out.stdout and "nan at step 12" in out.stdout


# ----------------------------------------------------------------------------- docs/troubleshooting.md


def test_troubleshooting_doc_is_generated_from_the_rules():
    out = subprocess.run([sys.executable, "-m", "pfppo_mega.doctor.table", "--check"], capture_output=True,
                         text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr


def test_troubleshooting_table_lists_every_rule_and_key(tmp_path):
    text = table.generate_table()
    for rule in RULES:
        assert f"`{rule.name}`" in text and rule.symptom in text
        for rem in rule.remedies:
            if rem.key:
                assert f"`{rem.key}`" in text
    stale = tmp_path / "t.md"
    stale.write_text(text.replace(RULES[0].symptom, "edited by hand"))
    assert table.main(["--check", str(stale)]) == 1
    assert table.main(["--write", str(stale)]) == 0 and stale.read_text() == text
    assert dataclasses.is_dataclass(RULES[0])


# Steps 1-30 of a real PF-PPO control run (exact reward, pool 3 every 2 steps, recency; 
# `pfppo compare configs/experiments --only control --arms pf_default`, seed 1): the training batch's
# KL (rows of older snapshots too) jumps at steps 11 and 25, the on-policy probe does not.
REAL_POOL_REF = [0.0, -0.1279, 0.0557, 0.0317, 0.0449, 0.0332, 0.0249, 0.0342, 0.0234, 0.0526, 0.1424, 0.0338,
                 0.0689, 0.0622, 0.0796, 0.0776, 0.0898, 0.1014, 0.0932, 0.1023, 0.0621, 0.0128, 0.0705, -0.0003,
                 0.2388, 0.1219, 0.171, 0.0859, 0.0889, 0.0784]
REAL_POOL_PROBE = [0.078, 0.0453, 0.0609, 0.0104, 0.0621, 0.0264, 0.0424, 0.0626, 0.0253, 0.0792, 0.0878, 0.0984,
                   0.1226, 0.1764, 0.1198, 0.0849, 0.1005, 0.1456, 0.1025, 0.1124, 0.1256, 0.1327, 0.2153, 0.1312,
                   0.1771, 0.1896, 0.1608, 0.0799, 0.0951, 0.0669]


def _pool_kl_run(tmp: Path, *, probe: bool, pf_ppo: bool = True) -> Path:
    recs = with_pool(healthy_records(len(REAL_POOL_REF)))
    for r in recs[1:]:
        r["kl/ref_mean"] = REAL_POOL_REF[r["step"] - 1]
        if probe:
            r["kl/probe_k1"] = REAL_POOL_PROBE[r["step"] - 1]
    return write_run(tmp, recs, default_config(algorithm__use_pf_ppo=pf_ppo))


def test_kl_spike_reads_the_on_policy_probe_when_logged(tmp_path):
    """Regression (a false alarm on real pool runs): with kl/probe_k1 logged the rule reads it, so the
    pool's batch-KL jumps are not called spikes; a real jump of the probe still is, by that name."""
    assert verdicts(_pool_kl_run(tmp_path / "probe", probe=True))["kl_spike"] == "healthy"
    run = _pool_kl_run(tmp_path / "jump", probe=True)
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    recs[20]["kl/probe_k1"] = 1.2
    write_run(run, recs)
    kl = next(d for d in diagnose(read_run(run)) if d.rule.name == "kl_spike")
    assert kl.verdict.status == "finding" and kl.verdict.steps == [20]
    assert kl.verdict.evidence[0].startswith("step 20: kl/probe_k1 1.2 vs median")


def test_kl_spike_without_the_probe_warns_that_pool_batches_mix_snapshots(tmp_path):
    """Without the probe the batch KL decides (the jumps are found), and on a PF-PPO run the evidence
    says why that metric is suspect and which key logs the on-policy one; a PPO run gets no caution."""
    kl = next(d for d in diagnose(read_run(_pool_kl_run(tmp_path / "pf", probe=False))) if d.rule.name == "kl_spike")
    assert kl.verdict.status == "finding" and 25 in kl.verdict.steps
    assert "with the pool on" in kl.verdict.evidence[-1] and "logging.kl_probe_size" in kl.verdict.evidence[-1]
    ppo_run = _pool_kl_run(tmp_path / "ppo", probe=False, pf_ppo=False)
    kl = next(d for d in diagnose(read_run(ppo_run)) if d.rule.name == "kl_spike")
    assert not any("with the pool on" in line for line in kl.verdict.evidence)


def test_kl_spike_reads_the_weighted_batch_kl_before_the_raw_one(tmp_path):
    """Regression (issue 39: kl/ref_mean 27 at one step of an async run, one stale token): with
    kl/ref_mean_is logged and steady the rule reads it, so the raw batch KL's jumps are not called
    spikes; a jump of the weighted one still is, by that name."""
    run = _pool_kl_run(tmp_path / "is", probe=False)
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for r in recs:
        if "kl/ref_mean" in r:
            r["kl/ref_mean_is"] = 0.02 + 0.001 * (r["step"] % 3)
    write_run(run, recs)
    kl = next(d for d in diagnose(read_run(run)) if d.rule.name == "kl_spike")
    assert kl.verdict.status == "healthy", kl.verdict.evidence
    jump = next(i for i, r in enumerate(recs) if r.get("step") == 20)
    recs[jump]["kl/ref_mean_is"] = 1.5
    write_run(run, recs)
    kl = next(d for d in diagnose(read_run(run)) if d.rule.name == "kl_spike")
    assert kl.verdict.status == "finding" and kl.verdict.steps == [20]
    assert kl.verdict.evidence[0].startswith("step 20: kl/ref_mean_is 1.5 vs median")


# A real plain-PPO control run (exact reward; seed 1 of the same compare): sampled held-out accuracy
# 0.328 -> 0.344 while greedy fell 0.617 -> 0.484 and the reward rose. Not hacking: the reward is earned
# by sampled responses, whose accuracy did not fall.
REAL_EVAL = {0: (0.3281, 0.6172), 10: (0.2969, 0.5312), 20: (0.3281, 0.5), 30: (0.2969, 0.5234),
             40: (0.3438, 0.4766), 50: (0.3906, 0.5156), 60: (0.3438, 0.4844)}
REAL_REWARD = [0.234, 0.203, 0.281, 0.281, 0.281, 0.281, 0.297, 0.266, 0.328, 0.391, 0.312, 0.281, 0.344, 0.375,
               0.328, 0.375, 0.406, 0.406, 0.281, 0.281, 0.375, 0.406, 0.484, 0.375, 0.328, 0.406, 0.328, 0.516,
               0.422, 0.406, 0.359, 0.375, 0.359, 0.359, 0.312, 0.391, 0.297, 0.344, 0.344, 0.328, 0.5, 0.359,
               0.391, 0.406, 0.281, 0.406, 0.359, 0.453, 0.422, 0.406, 0.484, 0.469, 0.469, 0.312, 0.328, 0.406,
               0.359, 0.375, 0.406, 0.359]


def _eval_run(tmp: Path, evals: dict) -> Path:
    recs = healthy_records(len(REAL_REWARD))
    for r in recs:
        r.pop("eval/accuracy", None), r.pop("eval/accuracy_greedy", None)
        if r["step"] >= 1:
            r["reward/mean"], r["reward/std"] = REAL_REWARD[r["step"] - 1], 0.45
        if r["step"] in evals:
            r["eval/accuracy"], r["eval/accuracy_greedy"] = evals[r["step"]]
    return write_run(tmp, recs, default_config())


def test_reward_hacking_is_decided_by_the_sampled_metric(tmp_path):
    """Regression (a false alarm on a real control run): a greedy fall alone is not hacking; when
    the sampled accuracy falls too, both are quoted."""
    assert verdicts(_eval_run(tmp_path / "real", REAL_EVAL))["reward_hacking"] == "healthy"
    falling = {st: (max(0.0, s - 0.004 * st), g) for st, (s, g) in REAL_EVAL.items()}  # sampled 0.33 -> 0.10
    hack = next(d for d in diagnose(read_run(_eval_run(tmp_path / "fall", falling))) if d.rule.name == "reward_hacking")
    assert hack.verdict.status == "finding"
    assert hack.verdict.evidence[0].startswith("eval/accuracy 0.3281 at step 0 ->")
    assert any(line.startswith("eval/accuracy_greedy") for line in hack.verdict.evidence[1:])
