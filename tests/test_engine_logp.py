"""algorithm.recompute_old_logp: false (verl's rollout-correction bypass mode): the engine's log-probs
are the proximal policy, the prepare pass runs no actor forward, and a step trains to the same
weights and reports the same metrics as the recomputing step, within the engine/trainer numerics."""

import json

import pytest
import torch

from pfppo_mega.config import ConfigError, load_config_dict
from pfppo_mega.models import passes as model_passes
from pfppo_mega.trainer.loop import PPOTrainer
from pfppo_mega.trainer.checkpoint.resume import tensor_state

from test_trainer import _cfg, sft_dir  # noqa: F401  (the module's SFT checkpoint fixture)


def _trainer(tmp_path, sft_dir, recompute: bool, **sections):  # noqa: F811
    sections = {k: dict(v) for k, v in sections.items()}
    sections.setdefault("algorithm", {})["recompute_old_logp"] = recompute
    sections.setdefault("checkpoint", {})["resume"] = False
    return PPOTrainer(_cfg(tmp_path / ("recompute" if recompute else "engine"), sft_dir, **sections),
                      log=lambda *_: None)


def _counting_forwards(monkeypatch) -> list:
    """Every forward_logp_entropy call's model, in order."""
    calls: list = []
    real = model_passes.forward_logp_entropy

    def counted(model, *args, **kwargs):
        calls.append(model)
        return real(model, *args, **kwargs)
    monkeypatch.setattr(model_passes, "forward_logp_entropy", counted)
    return calls


CASES = {
    "gae": {},  # the critic's pass stays; one mini-batch (64 rows), so every row is seen before the optimizer step
    # KL as a loss, as verl runs GRPO (in the reward, a group of equal scores divides the penalty by ~0)
    "grpo": {"algorithm": {"adv_estimator": "grpo", "use_kl_loss": True}, "actor_rollout": {"n_samples_per_prompt": 4},
             "training": {"rollout_batch_size": 16}},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_engine_logp_step_equals_the_recomputing_step(sft_dir, tmp_path, monkeypatch, case):  # noqa: F811
    sections = json.loads(json.dumps(CASES[case]))
    sections.setdefault("training", {})["batch_size"] = 64
    runs = {}
    for recompute in (True, False):
        tr = _trainer(tmp_path, sft_dir, recompute, **sections)
        calls = _counting_forwards(monkeypatch)
        w0 = {k: v.clone() for k, v in tensor_state(tr.run.models.actor).items()}
        m = tr.train_step()
        actor_passes = sum(c is tr.run.models.actor for c in calls)
        runs[recompute] = (m, {k: v.clone() for k, v in tensor_state(tr.run.models.actor).items()}, actor_passes, tr)
    (m_re, w_re, n_re, _), (m_en, w_en, n_en, tr) = runs[True], runs[False]
    # the prepare pass's actor forward is gone (the reference's stays); the update has its own
    assert n_re == 1 and n_en == 0, (n_re, n_en)
    # the rollouts are the same (same seed, same weights): the old log-probs differ by numerics only
    assert m_re["reward/mean"] == m_en["reward/mean"] and m_re["response/length_mean"] == m_en["response/length_mean"]
    for key in ("policy/entropy_first10", "policy/pg_loss", "policy/approx_kl", "policy/clipfrac", "kl/ref_k1",
                "policy/grad_norm"):
        assert m_en[key] == pytest.approx(m_re[key], rel=1e-4, abs=1e-5), (key, m_re[key], m_en[key])
    # the engine/trainer gap is still measured (from the update's first forward), and small
    assert 0 < m_en["rollout/logp_gap_max"] < 1e-3 and m_en["rollout/logp_gap_max"] == pytest.approx(
        m_re["rollout/logp_gap_max"], rel=0.5, abs=1e-6)
    # Adam's first step is ~lr * sign(grad), so an element whose gradient is ~0 may flip: compare the
    # whole update's size instead of single elements
    gap = sum(float((w_re[k].double() - w_en[k].double()).square().sum()) for k in w_re) ** 0.5
    step = sum(float((w_re[k].double() - w0[k].double()).square().sum()) for k in w_re) ** 0.5
    assert gap < 1e-2 * step, (gap, step)
    print(f"{case}: |weights(engine) - weights(recompute)| = {gap:.2e} after an update of {step:.2e}; "
          f"logp gap {m_en['rollout/logp_gap_max']:.2e}")


def test_old_logp_is_the_engines_and_every_row_is_observed(sft_dir, tmp_path):  # noqa: F811
    tr = _trainer(tmp_path, sft_dir, False, training={"batch_size": 32})  # 2 mini-batches
    rb, _ = tr.rollout(tr.run.prompts.next_batch(64))
    sb = tr.score(rb)
    prep = tr.prepare(sb)
    m = prep.inputs.response_mask
    assert prep.entropy is None
    assert torch.equal(prep.old_logp, rb.behav_logp * m)
    eb = tr.advantages(sb, prep)
    assert torch.equal(eb.old_logp, eb.behav_logp)
    stats, seen = tr.update(eb, observe=True)
    assert seen is not None and int(seen.fresh.sum()) == 32  # the first of two mini-batches
    assert bool(((seen.entropy > 0) | (m == 0)).all()) and bool((seen.logp[m.bool()] < 0).all())
    # the fresh rows' log-probs are the generating weights': the engine's within numerics
    fresh = m.bool() & seen.fresh[:, None]
    assert float((seen.logp - eb.behav_logp)[fresh].abs().max()) < 1e-3
    # the other rows were seen after one optimizer step: they moved more than numerics
    stale = m.bool() & ~seen.fresh[:, None]
    assert float((seen.logp - eb.behav_logp)[stale].abs().max()) > 1e-3


def test_without_actor_training_there_is_no_entropy_record(sft_dir, tmp_path):  # noqa: F811
    tr = _trainer(tmp_path, sft_dir, False, training={"critic_warmup_steps": 1})
    m = tr.train_step()
    assert "policy/entropy_first10" not in m and "rollout/logp_gap_max" not in m
    m = tr.train_step()  # the actor trains from step 2
    assert m["policy/entropy_first10"] > 0 and m["rollout/logp_gap_max"] < 1e-3


def test_refused_with_the_pool_by_name():
    with pytest.raises(ConfigError) as e:
        load_config_dict({"algorithm": {"use_pf_ppo": True, "recompute_old_logp": False},
                          "actor_rollout": {"model_path": "x"}})
    assert "algorithm.recompute_old_logp = False" in str(e.value) and "use_pf_ppo" in str(e.value)


VERL = {"actor_rollout_ref": {"model": {"path": "x"}, "actor": {"ppo_epochs": 1}},
        "algorithm": {"rollout_correction": {"bypass_mode": True}}}


def test_verl_bypass_mode_maps_and_its_other_forms_are_refused():
    assert load_config_dict(json.loads(json.dumps(VERL))).algorithm.recompute_old_logp is False
    off = json.loads(json.dumps(VERL))
    off["algorithm"]["rollout_correction"]["bypass_mode"] = False
    assert load_config_dict(off).algorithm.recompute_old_logp is True
    # verl's bypass-mode correction maps (tests/test_rollout_correction.py); its decoupled mode is refused
    with pytest.raises(ConfigError) as e:
        load_config_dict({**off, "algorithm": {"rollout_correction": {"bypass_mode": False, "rollout_is": "token"}}})
    assert "decoupled mode" in str(e.value) and "bypass_mode=true" in str(e.value)
    for key, value, says in (
            ("actor_rollout_ref.actor.policy_loss.loss_mode", "gspo", "vanilla PPO-clip"),
            ("algorithm.rollout_correction.loss_type", "reinforce-ish", "must be ppo_clip or reinforce"),
            ("algorithm.rollout_correction.rollout_is", "tokens", "must be null or one of token, sequence")):
        d = json.loads(json.dumps(VERL))
        *head, leaf = key.split(".")
        node = d
        for part in head:
            node = node.setdefault(part, {})
        node[leaf] = value
        with pytest.raises(ConfigError) as e:
            load_config_dict(d)
        assert says in str(e.value), (key, str(e.value))
