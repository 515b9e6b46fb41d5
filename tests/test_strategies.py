"""The trainer's strategies are chosen once, at build time, from registries: a new advantage
estimator (one that needs no critic) and a new rollout engine are registered from this file alone
and a run trains, checkpoints and resumes with them; no other file knows them."""

import json

import pytest
import torch

from pfppo_mega.config import ConfigError
from pfppo_mega.families import DecoderShape
from pfppo_mega.registry import ADV_ESTIMATORS, ROLLOUT_ENGINES, Registry
from pfppo_mega.rollout.base import EngineSpec
from pfppo_mega.rollout.builtin import BuiltinEngine
from pfppo_mega.trainer.checkpoint import store as ckpt
from pfppo_mega.trainer.checkpoint import resume
from pfppo_mega.trainer.estimators import AdvantageEstimator
from pfppo_mega.trainer.loop import PPOTrainer

from test_trainer import _cfg, sft_dir  # noqa: F401  (the module's SFT checkpoint fixture)

CALLS = {"estimator": 0, "generate": 0, "built": 0}


def _mean_baseline(x, ctx):
    """REINFORCE with the batch-mean baseline: one advantage per sequence, no critic."""
    CALLS["estimator"] += 1
    assert x.values is None  # needs_critic=False: no value pass ran
    score = x.token_rewards.sum(1)                                       # [B]
    adv = (score - score.mean())[:, None] * x.mask                       # [B, T]
    return adv, score[:, None] * x.mask


class CountingEngine(BuiltinEngine):
    def generate(self, prompts, params):
        CALLS["generate"] += 1
        return super().generate(prompts, params)


def _build(cfg, model_dir, hf_cfg, *, pad_token_id, bucket_bytes, max_model_len, device, log):
    CALLS["built"] += 1
    return CountingEngine(DecoderShape.from_hf_config(hf_cfg), pad_token_id=pad_token_id, bucket_bytes=bucket_bytes,
                          device=device, log=log)


def _from_hf_model(hf_model, *, pad_token_id, version=1, **kw):
    engine = CountingEngine(DecoderShape.from_hf_config(hf_model.config.to_dict()), pad_token_id=pad_token_id, **kw)
    engine.load_weights(hf_model.state_dict().items(), version=version)
    return engine


@pytest.fixture
def registered():
    ADV_ESTIMATORS.register("mean_baseline", AdvantageEstimator("mean_baseline", needs_critic=False,
                                                                compute=_mean_baseline))
    ROLLOUT_ENGINES.register("counting", EngineSpec(check=lambda cfg, *, world_size: None, build=_build,
                                                    from_hf_model=_from_hf_model))
    CALLS.update(estimator=0, generate=0, built=0)
    yield
    ADV_ESTIMATORS.unregister("mean_baseline")
    ROLLOUT_ENGINES.unregister("counting")


def _weights(module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("pf_ppo", [False, True])
def test_a_registered_estimator_and_engine_train_without_a_critic(sft_dir, tmp_path, registered, pf_ppo):  # noqa: F811
    sections = dict(algorithm={"adv_estimator": "mean_baseline", "use_pf_ppo": pf_ppo,
                               "pool": {"pool_size": 2, "snapshot_interval": 1}},
                    actor_rollout={"engine": "counting", "refit_timeout_s": 12.5},
                    training={"total_training_steps": 3}, checkpoint={"save_interval": 1})
    tr = PPOTrainer(_cfg(tmp_path, sft_dir, **sections), log=lambda *_: None)
    run = tr.run
    assert run.models.critic is None and run.models.critic_opt is None and CALLS["built"] == 1
    assert isinstance(run.colocation.engine, CountingEngine)
    assert run.colocation.sync.groups.timeout_s == 12.5  # actor_rollout.refit_timeout_s reaches every refit collective
    before = _weights(run.models.actor)
    res = tr.fit()
    steps = [json.loads(line) for line in open(res.metrics_path)]
    steps = [r for r in steps if "reward/mean" in r]
    assert len(steps) == 3 and CALLS["estimator"] == 3
    assert CALLS["generate"] >= 3 + 2 * 2  # every step's rollout + sampled and greedy evaluation, twice
    assert not [k for r in steps for k in r if k.startswith("critic/value")], "a critic-free run logged a critic"
    assert all(math_ok(r["policy/grad_norm"]) for r in steps)
    after = _weights(run.models.actor)
    assert any(not torch.equal(after[k], before[k]) for k in before), "the actor did not train"
    if pf_ppo:
        assert "is/mean" in steps[-1] and run.strategies.behaviour.pool.versions[-1] == 3
    # the checkpoint holds no critic, and a resume with it continues where it stopped
    found = resume.load_part(tmp_path / "checkpoints")
    assert found.step == 3 and "critic" not in found.tensors and found.state["critic_opt"] is None
    more = dict(sections, training={"total_training_steps": 4})
    again = PPOTrainer(_cfg(tmp_path, sft_dir, **more), log=lambda *_: None)
    assert again.step == 3 and again.run.models.critic is None
    assert all(torch.equal(_weights(again.run.models.actor)[k], after[k]) for k in after)
    again.fit()
    assert again.step == 4
    # GAE needs a critic this checkpoint does not have: refused by name, not trained from a fresh critic
    gae = dict(more, algorithm={**sections["algorithm"], "adv_estimator": "gae"})
    with pytest.raises(ckpt.CheckpointError, match=r"tensor files \['actor'.*must be \['actor', 'critic'"):
        PPOTrainer(_cfg(tmp_path, sft_dir, **gae), log=lambda *_: None)


def math_ok(x: float) -> bool:
    return x == x and abs(x) < float("inf")


def test_an_unregistered_name_is_refused_with_the_registered_ones(sft_dir, tmp_path):  # noqa: F811
    with pytest.raises(ConfigError, match=r"algorithm.adv_estimator = 'mean_baseline': must be one of 'gae'"):
        _cfg(tmp_path, sft_dir, algorithm={"adv_estimator": "mean_baseline"})
    with pytest.raises(ConfigError, match=r"actor_rollout.engine = 'counting': must be one of 'builtin', 'vllm'"):
        _cfg(tmp_path, sft_dir, actor_rollout={"engine": "counting"})


def test_registry_refuses_a_second_registration_and_keeps_its_own_entries():
    reg = Registry("some.key", {"gae": "pfppo_mega.trainer.estimators:GAE"})
    assert list(reg) == ["gae"] and "gae" in reg and reg.get("gae").needs_critic
    with pytest.raises(ValueError, match=r"some.key: 'gae' is already registered"):
        reg.register("gae", object())
    with pytest.raises(ValueError, match="one of the project's own entries"):
        reg.unregister("gae")
    with pytest.raises(ValueError, match=r"some.key = 'nope': must be one of 'gae'"):
        reg.get("nope")
    reg.register("mine", 1)
    assert list(reg) == ["gae", "mine"] and reg.get("mine") == 1


def test_the_planner_counts_no_critic_for_an_estimator_that_needs_none(registered):
    from pathlib import Path

    from pfppo_mega.config import load_config
    from pfppo_mega.planning.memory import Hardware, Knobs, RunShape, make_plan

    path = Path(__file__).resolve().parents[1] / "configs" / "70b_pfppo.yaml"
    hw = Hardware.preset("h200", nodes=8, gpus_per_node=8)
    plans = {name: make_plan(RunShape.from_config(load_config(path, [f"algorithm.adv_estimator={name}"])), hw, Knobs())
             for name in ("gae", "mean_baseline")}
    gae, free = plans["gae"], plans["mean_baseline"]
    assert gae.critic_params_total > 0 and free.critic_params_total == 0
    for g, f in zip(gae.stages, free.stages):
        names = [c.name for c in f.train.components]
        assert f.critic_params == 0 and not [n for n in names if n.startswith("critic")], names
        critic_bytes = sum(c.bytes for c in g.train.components if c.name.startswith("critic"))
        assert critic_bytes > 0
        assert sum(c.bytes for c in g.train.components) - sum(c.bytes for c in f.train.components) >= critic_bytes
