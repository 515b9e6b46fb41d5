"""End-to-end: SFT warm start -> PPO on the built-in task, PF-PPO pool, resume, guards, bad input.

All runs share one process (megatron's parallel state is initialised once) and one tiny SFT
checkpoint made by the project's own `pfppo sft` code path.
"""

import json
import math
from pathlib import Path

import pytest
import torch

from pfppo_mega.config import load_config_dict
from pfppo_mega.sft import run_sft
from pfppo_mega.trainer.build import SetupError
from pfppo_mega.trainer.loop import PPOTrainer
from pfppo_mega.trainer.update import TrainingHalted, actor_step

TINY = {
    "model": {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 192, "num_attention_heads": 2,
              "num_query_groups": 1, "vocab_size": 16, "max_position_embeddings": 24,
              "rope_theta": 10000.0, "norm_epsilon": 1e-5, "tie_word_embeddings": False},
    "data": {"task": "addition", "num_digits": 1, "eval_size": 64, "max_prompt_length": 8},
    "training": {"rollout_batch_size": 64, "batch_size": 32, "lr": 3e-4, "critic_lr": 1e-3,
                 "total_training_steps": 4, "seed": 3, "num_threads": 1},
    "algorithm": {"kl_coeff": 0.01, "kl_estimator": "k1", "vf_coef": 0.5, "max_response_length": 5},
    "logging": {"eval_interval": 0, "tensorboard": False, "plots": False, "progress": False},
    "checkpoint": {"export_hf": False},
    # SFT stops on steps (what later tests train from must not depend on machine load); no wall limit.
    "sft": {"steps": 300, "batch_size": 64, "lr": 3e-3, "noise": 0.3, "max_seconds": 0},
}


def _cfg(tmp: Path, sft_dir: Path, **sections):
    d = json.loads(json.dumps(TINY))
    for sec, vals in sections.items():
        d.setdefault(sec, {}).update(vals)
    d.setdefault("actor_rollout", {})["model_path"] = str(sft_dir)
    d["logging"]["output_dir"] = str(tmp)
    return load_config_dict(d)


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft")
    d = json.loads(json.dumps(TINY))
    d["sft"]["output_dir"] = str(out)
    d["actor_rollout"] = {"model_path": str(out)}
    run_sft(load_config_dict(d), log=lambda *_: None)
    return out


def test_sft_writes_a_loadable_hf_checkpoint(sft_dir):
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (sft_dir / name).is_file(), name
    import transformers  # pinned in requirements.lock: a missing install must fail, not skip
    model = transformers.AutoModelForCausalLM.from_pretrained(str(sft_dir))
    assert model.config.num_hidden_layers == 2


def test_ppo_raises_reward(sft_dir, tmp_path):
    """Seeded: mean sampled reward over the last 8 of 40 steps beats the first 8 clearly."""
    cfg = _cfg(tmp_path, sft_dir, training={"total_training_steps": 40},
               logging={"eval_interval": 40, "tensorboard": False, "plots": True, "progress": False})
    res = PPOTrainer(cfg, log=lambda *_: None).fit()
    recs = [json.loads(line) for line in open(res.metrics_path)]
    rewards = [r["reward/mean"] for r in recs if "reward/mean" in r]
    assert len(rewards) == 40
    first, last = sum(rewards[:8]) / 8, sum(rewards[-8:]) / 8
    print(f"reward first8 {first:.3f} last8 {last:.3f}; eval {res.eval_before} -> {res.eval_after}")
    assert last > first + 0.1, (first, last)
    assert res.eval_after["eval/accuracy"] > res.eval_before["eval/accuracy"]
    # Engine log-probs agree with the trainer's recomputation (same weights, fp32).
    assert max(r["rollout/logp_gap_max"] for r in recs if "rollout/logp_gap_max" in r) < 1e-3
    needed = {"kl/ref_mean", "response/length_mean", "response/repetition_rate", "policy/entropy_first10",
              "policy/clipfrac", "policy/approx_kl", "policy/grad_norm", "critic/value_loss",
              "perf/tokens_per_s", "time/rollout_s", "time/update_s", "reward/q90"}
    assert needed <= set(recs[-1]), needed - set(recs[-1])
    assert res.plot_path.is_file() and res.plot_path.stat().st_size > 10_000


def _run(cfg):
    tr = PPOTrainer(cfg, log=lambda *_: None)
    metrics = [tr.train_step() for _ in range(cfg.training.total_training_steps)]
    weights = {k: v.clone() for k, v in tr.run.models.actor.state_dict().items() if isinstance(v, torch.Tensor)}
    return tr, metrics, weights


def test_pool_of_one_is_bit_identical_to_plain_ppo(sft_dir, tmp_path):
    plain = _cfg(tmp_path / "a", sft_dir, training={"total_training_steps": 3}, checkpoint={"resume": False})
    pooled = _cfg(tmp_path / "b", sft_dir, training={"total_training_steps": 3}, checkpoint={"resume": False},
                  algorithm={"use_pf_ppo": True, "pool": {"pool_size": 1, "snapshot_interval": 1}})
    _, m_plain, w_plain = _run(plain)
    tr, m_pool, w_pool = _run(pooled)
    for a, b in zip(m_plain, m_pool):
        for key in ("policy/pg_loss", "critic/value_loss", "reward/mean", "kl/ref_mean", "policy/grad_norm"):
            assert a[key] == b[key], (key, a[key], b[key])
        assert b["is/mean"] == 1.0 and b["is/max"] == 1.0
    assert w_plain.keys() == w_pool.keys()
    for k in w_plain:
        assert torch.equal(w_plain[k], w_pool[k]), k
    assert len(tr.run.strategies.behaviour.pool) == 1 and tr.run.strategies.behaviour.pool.versions == [3]


def test_pool_mixes_behaviour_policies_and_logs_per_snapshot(sft_dir, tmp_path):
    cfg = _cfg(tmp_path, sft_dir, training={"total_training_steps": 7}, checkpoint={"resume": False},
               algorithm={"use_pf_ppo": True, "pool": {"pool_size": 3, "snapshot_interval": 2,
                                                        "sampling": "recency"}})
    tr, metrics, _ = _run(cfg)
    assert tr.run.strategies.behaviour.pool.versions == [2, 4, 6]  # version 0 (SFT) evicted, oldest first
    last = metrics[-1]
    assert last["pool/snapshots_used"] >= 2
    used = [k for k in last if k.startswith("pool/snap") and k.endswith("/count")]
    assert sum(last[k] for k in used) == 64
    assert 0 < last["is/ess"] <= 1 and last["is/max"] <= cfg.algorithm.pool.is_clip
    assert any(last[k] > 0 for k in last if k.endswith("/age"))


def test_step_assignment_generates_each_step_with_one_snapshot(sft_dir, tmp_path):
    cfg = _cfg(tmp_path, sft_dir, training={"total_training_steps": 5}, checkpoint={"resume": False},
               algorithm={"use_pf_ppo": True, "pool": {"pool_size": 3, "snapshot_interval": 1,
                                                        "sampling": "uniform", "assign": "step"}})
    tr, metrics, _ = _run(cfg)
    assert [m["pool/snapshots_used"] for m in metrics] == [1.0] * 5
    per_step = [{k: m[k] for k in m if k.startswith("pool/snap") and k.endswith("/count")} for m in metrics]
    assert all(sorted(c.values()) == [64] for c in per_step), per_step  # every row from one snapshot
    assert tr.run.strategies.behaviour.pool.versions == [3, 4, 5]


def test_corrupt_snapshot_is_refused_and_counted(sft_dir, tmp_path):
    cfg = _cfg(tmp_path, sft_dir, training={"total_training_steps": 2}, checkpoint={"resume": False},
               algorithm={"use_pf_ppo": True, "pool": {"pool_size": 2, "snapshot_interval": 100}})
    tr = PPOTrainer(cfg, log=lambda *_: None)
    name, t = tr.run.strategies.behaviour.pool.snapshots[0].tensors[0]
    t.reshape(-1).view(torch.uint8)[0] ^= 1  # bit rot in host memory (snapshots may be stored as raw bytes)
    m = tr.train_step()
    assert m["guard/corrupt_snapshots"] == 1 and tr.run.strategies.behaviour.pool.n_corrupt == 1
    assert (m["is/mean"], m["is/max"]) == (1.0, 1.0)  # generated by the current weights instead
    assert tr.run.strategies.behaviour.pool.versions == [0]  # re-seeded with the current policy, so the next step can run
    m = tr.train_step()
    assert m["guard/corrupt_snapshots"] == 1 and math.isfinite(m["policy/pg_loss"])


def test_resume_continues_from_latest_checkpoint(sft_dir, tmp_path):
    cfg = _cfg(tmp_path, sft_dir, training={"total_training_steps": 2}, checkpoint={"save_interval": 1})
    PPOTrainer(cfg, log=lambda *_: None).fit()
    more = _cfg(tmp_path, sft_dir, training={"total_training_steps": 3}, checkpoint={"save_interval": 1})
    msgs = []
    tr = PPOTrainer(more, log=msgs.append)
    assert tr.step == 2 and any("resumed" in m for m in msgs)
    tr.fit()
    assert tr.step == 3


def test_nan_rewards_are_guarded_and_counted(sft_dir, tmp_path, monkeypatch):
    cfg = _cfg(tmp_path, sft_dir, training={"total_training_steps": 1}, checkpoint={"resume": False})
    tr = PPOTrainer(cfg, log=lambda *_: None)
    monkeypatch.setattr(tr.run.reward_fn.task, "reward", lambda p, text, finished: float("nan"))
    m = tr.train_step()
    assert m["guard/bad_rewards"] == 64
    assert math.isfinite(m["policy/pg_loss"]) and math.isfinite(m["critic/value_loss"])


def test_bad_setup_is_refused_before_work(sft_dir, tmp_path):
    with pytest.raises(SetupError, match=r"tensor_model_parallel_size = 2: the builtin engine runs one full copy"):
        PPOTrainer(_cfg(tmp_path, sft_dir, actor_rollout={"engine": "builtin", "tensor_model_parallel_size": 2}))
    with pytest.raises(SetupError, match="no such directory"):
        PPOTrainer(_cfg(tmp_path, tmp_path / "nope"))
    with pytest.raises(SetupError, match="max_position_embeddings"):
        PPOTrainer(_cfg(tmp_path, sft_dir, algorithm={"max_response_length": 20}))
    with pytest.raises(ValueError, match="differ|mismatch|hidden_size"):
        PPOTrainer(_cfg(tmp_path, sft_dir, model={"hidden_size": 128}))
    # A tokenizer larger than the model's vocabulary: checkpoint and tokenizer do not belong together.
    bad = tmp_path / "badtok"
    bad.mkdir()
    for f in sft_dir.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    cfg_json = json.loads((bad / "config.json").read_text())
    cfg_json["vocab_size"] = 8
    (bad / "config.json").write_text(json.dumps(cfg_json))
    with pytest.raises((SetupError, ValueError), match="vocab|tokenizer|shape"):
        PPOTrainer(_cfg(tmp_path, bad, model={"vocab_size": None}))


def test_prompt_longer_than_limit_is_an_error(sft_dir, tmp_path):
    tr = PPOTrainer(_cfg(tmp_path, sft_dir, checkpoint={"resume": False},
                         data={"max_prompt_length": 4}), log=lambda *_: None)
    with pytest.raises(ValueError, match="max_prompt_length"):
        tr.train_step()


def test_stop_file_checkpoints_and_exits_at_step_boundary(sft_dir, tmp_path, monkeypatch):
    """The Slurm USR1 protocol: the trainer checkpoints the finished step and leaves the loop."""
    stop = tmp_path / "stop_requested"
    stop.touch()
    monkeypatch.setenv("PFPPO_STOP_FILE", str(stop))
    cfg = _cfg(tmp_path, sft_dir, training={"total_training_steps": 5}, checkpoint={"save_interval": 0})
    res = PPOTrainer(cfg, log=lambda *_: None).fit()
    assert res.steps == 1
    assert (tmp_path / "checkpoints" / "step_000001" / "manifest.json").is_file()
    stop.unlink()
    tr = PPOTrainer(cfg, log=lambda *_: None)  # requeued job: resumes from step 1
    assert tr.step == 1


@pytest.mark.parametrize("is_mode", ["tis", "mask"])
def test_other_paths_run_finite(sft_dir, tmp_path, is_mode):
    """TIS / mask correction, include_current, policy filtration, KL as a loss, entropy bonus,
    micro-batching and reward shaping together. Snapshots every 2 steps, so at odd steps the
    current version is not in the pool and include_current must offer the live weights."""
    cfg = _cfg(tmp_path, sft_dir, training={"total_training_steps": 4, "micro_batch_size": 8},
               checkpoint={"resume": False},
               algorithm={"use_pf_ppo": True, "use_kl_loss": True, "kl_estimator": "k3", "entropy_coeff": 0.01,
                          "loss_agg_mode": "seq-mean-token-mean",
                          "pool": {"pool_size": 2, "snapshot_interval": 2, "is_mode": is_mode,
                                   "include_current": True, "sampling": "reward"},
                          "filtration": {"enable": True, "reweight_method": "max_random"}},
               reward={"scaling": "running_zscore", "quantile_clip": 0.95, "clip_range": 3.0,
                       "length_penalty": 0.1})
    tr, metrics, _ = _run(cfg)
    assert tr.run.strategies.policy_loss.name == ("tis" if is_mode == "tis" else "ppo_clip")
    for step, m in enumerate(metrics):
        for key in ("policy/pg_loss", "policy/kl_loss", "critic/value_loss", "policy/grad_norm"):
            assert math.isfinite(m[key]), (key, m[key])
        # the pool holds versions 0, 2, ...: at odd steps the live weights are one more candidate
        held = 1 if step < 2 else 2
        live = step % 2 == 1
        assert ("pool/slot%d/prob" % held in m) == live, (step, sorted(k for k in m if "slot" in k))
        assert sum(m[f"pool/slot{k}/prob"] for k in range(held + live)) == pytest.approx(1.0)
        # only the chosen loss variant's stats are logged: TIS has no clip fraction
        assert ("policy/clipfrac" in m) == (is_mode != "tis")
        assert ("policy/tis_frac_truncated" in m) == (is_mode == "tis")
        if "rollout/logp_gap_max" in m:  # on-policy rows only: engine and trainer hold the same weights
            assert m["rollout/logp_gap_max"] < 1e-3 and m["rollout/logp_gap_mean"] <= m["rollout/logp_gap_max"]
    # rows generated by the live weights (include_current at an odd step) are on-policy rows
    assert any("rollout/logp_gap_max" in m for m in metrics[1::2])
    # k3 is >= 0, and 0 only while the policy equals the reference (the first mini-batch).
    assert all(m["policy/kl_loss"] >= 0 for m in metrics) and metrics[-1]["policy/kl_loss"] > 0
    # running_zscore merged each step's 64 generated rewards exactly once
    assert tr.run.state.running_reward.count == 64 * len(metrics)


def test_running_zscore_moments_update_once_per_batch(sft_dir, tmp_path):
    """Regression: the trainer updated the running moments and scale_rewards updated them again
    (count 128 after one batch of 64, and a wrong std)."""
    cfg = _cfg(tmp_path, sft_dir, training={"total_training_steps": 1}, checkpoint={"resume": False},
               reward={"scaling": "running_zscore"})
    tr = PPOTrainer(cfg, log=lambda *_: None)
    seen = []
    score = tr.score
    tr.score = lambda rb: seen.append(score(rb)) or seen[-1]
    tr.train_step()
    raw = seen[0].raw_scores.double()
    assert tr.run.state.running_reward.count == 64
    assert tr.run.state.running_reward.mean == pytest.approx(raw.mean().item(), abs=1e-12)
    assert tr.run.state.running_reward.std == pytest.approx(raw.std().item(), abs=1e-9)


def test_metrics_and_pool_stats_describe_the_generated_batch(sft_dir, tmp_path):
    """Policy filtration resamples the rows the update trains on; reward/*, response/* and the
    pool's per-snapshot rewards (which `sampling: reward` reads) describe every generated row."""
    cfg = _cfg(tmp_path, sft_dir, training={"total_training_steps": 1}, checkpoint={"resume": False},
               algorithm={"use_pf_ppo": True, "pool": {"pool_size": 2, "snapshot_interval": 1, "sampling": "reward"},
                          "filtration": {"enable": True, "reweight_method": "max_min"}})
    tr = PPOTrainer(cfg, log=lambda *_: None)
    seen, trained = [], []
    score, advantages = tr.score, tr.advantages
    tr.score = lambda rb: seen.append(score(rb)) or seen[-1]
    tr.advantages = lambda sb, prep: trained.append(sb) or advantages(sb, prep)
    m = tr.train_step()
    raw = seen[0].raw_scores.double()
    assert 0 < raw.mean() < 1, "the check needs a batch with both rewards"
    # max_min resamples from the best and worst rows: the trained batch is not the generated one (its
    # reward mean may still coincide with binary rewards: 39/64 both ways at one seed)
    assert not torch.equal(trained[0].raw_scores.double(), raw)
    assert m["reward/mean"] == pytest.approx(raw.mean().item(), abs=1e-6)
    lengths = seen[0].rollout.response_mask.sum(1)
    assert m["response/length_mean"] == pytest.approx(lengths.mean().item(), abs=1e-6)
    assert m["response/length_max"] == lengths.max().item()
    st = next(s for s in tr.run.strategies.behaviour.pool.snapshots if s.version == 0).stats  # every row came from version 0
    assert st.n_samples == 64 and st.reward_sum == pytest.approx(raw.sum().item())
    assert m["pool/snap0/count"] == 64 and m["pool/snap0/reward_mean"] == pytest.approx(raw.mean().item())


def _bad_reward_factory():
    """A reward function that raises, returns None, NaN or inf for some samples, 1.0 otherwise."""
    calls = {"n": 0}

    def reward(p, text, finished):
        calls["n"] += 1
        k = calls["n"] % 8
        if k == 1:
            raise ZeroDivisionError("boom")
        if k == 2:
            return None
        if k == 3:
            return float("nan")
        if k == 4:
            return float("inf")
        return 1.0
    return reward


def test_bad_rewards_are_guarded_under_filtration_and_reward_sampling(sft_dir, tmp_path, monkeypatch):
    """NaN / inf / raising / None rewards with policy filtration and reward-weighted snapshot
    sampling on: scored 0, counted (guard/bad_rewards, guard/reward_errors), logged once, the run
    goes on; evaluation is guarded the same way (eval/accuracy stays finite)."""
    cfg = _cfg(tmp_path, sft_dir, training={"total_training_steps": 2}, checkpoint={"resume": False},
               algorithm={"use_pf_ppo": True, "pool": {"pool_size": 2, "snapshot_interval": 1, "sampling": "reward"},
                          "filtration": {"enable": True, "reweight_method": "pow"}},
               reward={"scaling": "running_zscore"})
    logs = []
    tr = PPOTrainer(cfg, log=logs.append)
    monkeypatch.setattr(tr.run.reward_fn.task, "reward", _bad_reward_factory())
    metrics = [tr.train_step() for _ in range(2)]
    # per 64 rows: 8 groups of 8 calls -> 8 raised + 8 None, 8 NaN + 8 inf
    assert metrics[0]["guard/reward_errors"] == 16 and metrics[0]["guard/bad_rewards"] == 16
    assert metrics[1]["guard/reward_errors"] == 32 and metrics[1]["guard/bad_rewards"] == 32
    for m in metrics:
        assert math.isfinite(m["policy/pg_loss"]) and math.isfinite(m["reward/mean"])
    assert sum("raised ZeroDivisionError" in x for x in logs) == 1  # logged once, with the sample
    assert sum("returned None" in x for x in logs) <= 1
    ev = tr.evaluate()
    assert all(math.isfinite(v) for v in ev.values()), ev
    assert tr.run.state.guards["reward_errors"] > 32  # evaluation's bad rewards are counted too


def test_all_updates_skipped_halts_the_run(sft_dir, tmp_path):
    """A critic with NaN weights makes every loss non-finite: the run stops with a reason after
    training.max_consecutive_skipped_updates skipped updates instead of "finishing" with exit 0."""
    cfg = _cfg(tmp_path, sft_dir, training={"total_training_steps": 20, "max_consecutive_skipped_updates": 3},
               checkpoint={"resume": False})
    tr = PPOTrainer(cfg, log=lambda *_: None)
    with torch.no_grad():
        for p in tr.run.models.critic.parameters():
            p.fill_(float("nan"))
    with pytest.raises(TrainingHalted, match=r"3 consecutive (critic|actor) updates .*"
                                             r"training.max_consecutive_skipped_updates \(3\)"):
        tr.fit()
    assert tr.step < 3 and tr.run.state.guards["skipped_updates"] >= 3


def test_pfppo_train_exits_nonzero_when_updates_keep_failing(sft_dir, tmp_path, monkeypatch):
    """`pfppo train` end to end: a reward of 1e38 (finite, so not a guarded bad reward) overflows the
    squared value error to inf, every critic update is skipped, and the command exits 3 with the
    reason instead of reporting success."""
    from pfppo_mega import cli
    from pfppo_mega.tasks.addition import AdditionTask

    monkeypatch.setattr(AdditionTask, "reward", staticmethod(lambda p, text, finished: 1e38))
    d = json.loads(json.dumps(TINY))
    d["actor_rollout"] = {"model_path": str(sft_dir)}
    d["logging"]["output_dir"] = str(tmp_path / "run")
    d["training"].update(total_training_steps=20, max_consecutive_skipped_updates=2)
    d["checkpoint"]["resume"] = False
    path = tmp_path / "cfg.yaml"
    path.write_text(json.dumps(d))
    assert cli.main(["train", str(path)]) == 3
    assert not (tmp_path / "run" / "summary.json").exists()  # no success summary


def test_update_stats_are_token_weighted_over_micro_batches(sft_dir, tmp_path):
    """Micro-batches of unequal token counts: the logged stats are the whole mini-batch's (token-
    weighted), not an unweighted mean of the micro-batches' (which depends on micro_batch_size)."""
    from pfppo_mega.trainer.checkpoint.resume import load_tensor_state, tensor_state

    cfg = _cfg(tmp_path, sft_dir, training={"total_training_steps": 1}, checkpoint={"resume": False})
    tr = PPOTrainer(cfg, log=lambda *_: None)
    rb, _ = tr.rollout(tr.run.prompts.next_batch(32))
    sb = tr.score(rb)
    eb = tr.advantages(sb, tr.prepare(sb))
    lengths = eb.inputs.response_mask.sum(1)
    assert len(set(lengths[:8].tolist() + lengths[8:16].tolist())) > 1 or lengths[:8].sum() != lengths[8:16].sum()
    start = {k: v.clone() for k, v in tensor_state(tr.run.models.actor).items()}
    r = tr.run
    parts = dict(cfg=r.cfg, models=r.models, strategies=r.strategies, state=r.state, device=r.device, log=r.log)
    whole = actor_step(eb, **parts)
    load_tensor_state(tr.run.models.actor, start)  # same weights: the stats are taken before the optimizer step
    tr.run.cfg.training.micro_batch_size = 5  # 7 micro-batches, the last one of 2 rows
    micro = actor_step(eb, **parts)
    for key in ("policy/entropy", "policy/pg_loss", "policy/approx_kl"):
        assert micro[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-7), (key, micro[key], whole[key])


def test_dp_metric_aggregation_rules():
    """Maxima by max, throughput and counts by sum, global counters as they are (never averaged),
    means by mean."""
    from pfppo_mega.trainer.metrics import aggregate_rank_metrics

    ranks = [{"response/length_max": 5.0, "is/max": 1.5, "rollout/logp_gap_max": 1e-4, "reward/mean": 0.2,
              "perf/tokens_per_s": 100.0, "time/rollout_s": 1.0, "guard/skipped_updates": 2.0,
              "pool/snap0/count": 16.0},
             {"response/length_max": 9.0, "is/max": 1.1, "reward/mean": 0.6, "perf/tokens_per_s": 50.0,
              "time/rollout_s": 3.0, "guard/skipped_updates": 2.0, "pool/snap0/count": 16.0}]
    out = aggregate_rank_metrics(ranks)
    assert out["response/length_max"] == 9.0 and out["is/max"] == 1.5 and out["time/rollout_s"] == 3.0
    assert out["rollout/logp_gap_max"] == 1e-4  # only rank 0 had on-policy rows
    assert out["reward/mean"] == pytest.approx(0.4) and out["perf/tokens_per_s"] == 150.0
    assert out["guard/skipped_updates"] == 2.0 and out["pool/snap0/count"] == 32.0
    ranks[1]["guard/skipped_updates"] = 3.0  # a rank that has counted more: its count, not a mean
    assert aggregate_rank_metrics(ranks)["guard/skipped_updates"] == 3.0


def test_random_streams_are_named_and_unchanged():
    """Seeds come from one helper; its derivations are the ones seeded runs (and the documented
    figures) were produced with, so a refactor that changes a stream fails here first."""
    from pfppo_mega.trainer.seeds import stream_seed

    assert stream_seed("prompts", 3) == 3  # one stream for the job, whatever the DP size
    assert stream_seed("assignment", 3) == 3 + 7919
    assert stream_seed("minibatches", 3, step=4) == 3 * 1_000_003 + 4
    assert stream_seed("kl_probe", 3, step=4) == 7 and stream_seed("eval", 3) == 3
    with pytest.raises(ValueError, match="'data'.*'prompts', 'assignment'"):
        stream_seed("data", 3)


def test_sft_stops_on_steps_and_max_seconds_is_only_a_safety_limit(tmp_path):
    """SFT never cuts itself short on wall time (what later stages train from would depend on the
    machine's load): running out of sft.max_seconds is an error naming the key, nothing written."""
    from pfppo_mega.sft import SFTTimeout

    d = json.loads(json.dumps(TINY))
    d["sft"].update(output_dir=str(tmp_path / "sft"), steps=3, max_seconds=1e-6)
    d["actor_rollout"] = {"model_path": str(tmp_path / "sft")}
    with pytest.raises(SFTTimeout, match=r"sft.max_seconds = 1e-06 exceeded at step 1 of sft.steps = 3"):
        run_sft(load_config_dict(d), log=lambda *_: None)
    assert not (tmp_path / "sft" / "model.safetensors").exists()
    d["sft"]["max_seconds"] = 0  # no limit: exactly sft.steps steps
    out = run_sft(load_config_dict(d), log=lambda *_: None)
    assert json.loads((out / "sft_info.json").read_text())["steps"] == 3


def test_a_finished_pf_ppo_trainer_frees_its_engine_without_the_garbage_collector(sft_dir, tmp_path):
    """No reference cycle holds a finished run's engine: an in-process vLLM engine tears its process
    groups down when freed, so one freed by a later garbage collection would do it in the middle of
    the next run's build (pfppo compare's four trainers in one process failed this way)."""
    import gc
    import weakref

    cfg = _cfg(tmp_path, sft_dir, training={"total_training_steps": 1},
               algorithm={"use_pf_ppo": True, "pool": {"pool_size": 2, "snapshot_interval": 1}})
    gc.disable()
    try:
        with PPOTrainer(cfg, log=lambda *_: None) as t:
            t.fit()
            engine, run = weakref.ref(t.run.colocation.engine), weakref.ref(t.run)
        del t
        assert run() is None and engine() is None, "the finished run's engine is held by a reference cycle"
    finally:
        gc.enable()
