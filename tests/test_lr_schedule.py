"""Learning-rate warm-up and schedules (training.lr_warmup_steps / lr_warmup_ratio / lr_schedule /
min_lr_ratio; trainer/lr_schedule.py), as verl 0.9.1 computes them, and verl's optim keys onto them."""

import math

import pytest

from pfppo_mega.config import ConfigError, load_config_dict, resolve_config_dict
from pfppo_mega.trainer.loop import PPOTrainer
from pfppo_mega.trainer.lr_schedule import lr_factor, warmup_steps

from test_trainer import _cfg, sft_dir  # noqa: F401  (the module's SFT checkpoint fixture)


def test_constant_with_warmup_written_out():
    # W = 4: updates 0..3 at 0, 1/4, 2/4, 3/4 of lr, then lr (verl's first update trains at 0)
    got = [lr_factor(k, warmup=4, total_steps=10, schedule="constant") for k in range(7)]
    assert got == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert [lr_factor(k, warmup=0, total_steps=10, schedule="constant") for k in range(3)] == [1.0, 1.0, 1.0]


def test_cosine_with_warmup_written_out():
    # W = 2, N = 6, r = 0.1: after the warm-up 0.1 + 0.9 * 0.5 * (1 + cos(pi * (k - 2) / 4))
    W, N, r = 2, 6, 0.1
    want = [0.0, 0.5] + [r + (1 - r) * 0.5 * (1 + math.cos(math.pi * (k - W) / (N - W))) for k in range(2, 7)]
    got = [lr_factor(k, warmup=W, total_steps=N, schedule="cosine", min_lr_ratio=r) for k in range(7)]
    assert got == pytest.approx(want, abs=1e-15)
    assert got[2] == pytest.approx(1.0) and got[4] == pytest.approx(0.55) and got[6] == pytest.approx(0.1)
    with pytest.raises(ValueError, match="schedule='linear': must be one of 'constant', 'cosine'"):
        lr_factor(3, warmup=0, total_steps=6, schedule="linear")


def test_warmup_from_ratio_truncates_as_verl():
    assert warmup_steps(steps=None, ratio=0.05, total_steps=90) == 4   # int(4.5)
    assert warmup_steps(steps=3, ratio=0.5, total_steps=90) == 3       # steps given: the ratio is not read


def test_the_trainer_sets_the_formulas_lr_every_step(sft_dir, tmp_path):  # noqa: F811
    cfg = _cfg(tmp_path, sft_dir, training={"lr_warmup_steps": 2, "lr_schedule": "cosine", "min_lr_ratio": 0.2,
                                            "critic_lr_warmup_ratio": 0.2,  # the critic's own W = int(0.2 * 5) = 1
                                            "total_training_steps": 5, "rollout_batch_size": 16, "batch_size": 16})
    tr = PPOTrainer(cfg, log=lambda *_: None)
    lr, clr = cfg.training.lr, cfg.training.critic_lr
    seen = []
    for k in range(5):
        m = tr.train_step()
        f = [0.0, 0.5, 1.0, 0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi / 3)),          # W = 2, N = 5
             0.2 + 0.8 * 0.5 * (1 + math.cos(2 * math.pi / 3))][k]
        fc = [0.0, 1.0, 0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi / 4)),              # W = 1, N = 5
              0.2 + 0.8 * 0.5 * (1 + math.cos(2 * math.pi / 4)), 0.2 + 0.8 * 0.5 * (1 + math.cos(3 * math.pi / 4))][k]
        groups = tr.run.models.actor_opt.param_groups
        for g in groups:  # megatron's param groups scale the lr by lr_mult (1 here)
            assert g["lr"] == pytest.approx(lr * f * g.get("lr_mult", 1.0), abs=1e-15), (k, g["lr"])
        assert m["optim/actor_lr"] == pytest.approx(lr * f, abs=1e-15)
        assert m["optim/critic_lr"] == pytest.approx(clr * fc, abs=1e-15)
        for g in tr.run.models.critic_opt.param_groups:
            assert g["lr"] == pytest.approx(clr * fc * g.get("lr_mult", 1.0), abs=1e-15), (k, g["lr"])
        seen.append(m["optim/actor_lr"])
    print("actor lr per step:", seen)


def test_native_keys_are_checked():
    base = {"actor_rollout": {"model_path": "/m"}}
    with pytest.raises(ConfigError, match=r"training.lr_schedule = 'linear'.*'constant', 'cosine'"):
        load_config_dict({**base, "training": {"lr_schedule": "linear"}})
    with pytest.raises(ConfigError, match=r"training.lr_warmup_ratio = 1.0: must be >= 0 and < 1"):
        load_config_dict({**base, "training": {"lr_warmup_ratio": 1.0}})
    with pytest.raises(ConfigError, match=r"training.min_lr_ratio = 1.5: must be >= 0 and <= 1"):
        load_config_dict({**base, "training": {"min_lr_ratio": 1.5}})


A = "actor_rollout_ref.actor.optim"


def _verl(*overrides):
    return resolve_config_dict({}, ["actor_rollout_ref.model.path=/m", "trainer.total_training_steps=100",
                                    *overrides])


@pytest.mark.parametrize("overrides, want", [
    ([f"{A}.lr_warmup_steps=10"], (10, 0.0, "constant", 0.0)),
    ([f"{A}.lr_warmup_steps_ratio=0.05"], (None, 0.05, "constant", 0.0)),
    ([f"{A}.lr_warmup_steps=3", f"{A}.lr_warmup_steps_ratio=0.05"], (3, 0.0, "constant", 0.0)),  # steps win
    ([f"{A}.lr_warmup_steps=-1", f"{A}.lr_warmup_steps_ratio=0.1", f"{A}.lr_scheduler_type=cosine",
      f"{A}.min_lr_ratio=0.1"], (None, 0.1, "cosine", 0.1)),
    ([f"{A}.warmup_style=cosine"], (None, 0.0, "cosine", 0.0)),
    ([f"{A}.lr=2e-6", f"{A}.lr_decay_style=cosine", f"{A}.min_lr=2e-7"], (None, 0.0, "cosine", pytest.approx(0.1))),
])
def test_verl_schedule_keys_map(overrides, want):
    t = _verl(*overrides).config.training
    assert (t.lr_warmup_steps, t.lr_warmup_ratio, t.lr_schedule, t.min_lr_ratio) == want


@pytest.mark.parametrize("overrides, key, why", [
    ([f"{A}.lr_scheduler_type=wsd"], f"{A}.lr_scheduler_type", "constant and cosine only"),
    ([f"{A}.lr_decay_style=linear"], f"{A}.lr_decay_style", "constant and cosine only"),
    ([f"{A}.lr_warmup_init=1e-7"], f"{A}.lr_warmup_init", "non-zero lr"),
    ([f"{A}.num_cycles=1.0"], f"{A}.num_cycles", "half a cycle"),
    ([f"{A}.lr_warmup_steps=10", "critic.optim.lr_warmup_steps=5"],
     "critic.optim.lr_warmup_steps", "differs from actor_rollout_ref.actor.optim.lr_warmup_steps = 10"),
    ([f"{A}.lr_scheduler_type=cosine", "critic.optim.lr_scheduler_type=constant"],
     "critic.optim.lr_scheduler_type", "the learning-rate schedule is one setting here"),
])
def test_what_our_schedule_cannot_do_is_refused_by_name(overrides, key, why):
    with pytest.raises(ConfigError) as e:
        _verl(*overrides)
    p = next(p for p in e.value.problems if p.key == key)
    assert "refused (verl layout)" in p.rule and why in p.rule, p


@pytest.mark.parametrize("overrides, want", [
    # verl's critic has its own warm-up ratio (examples/ppo_trainer/run_qwen2-7b_rm*.sh: actor 0.1, critic 0.05)
    ([f"{A}.lr_warmup_steps_ratio=0.1", "critic.optim.lr_warmup_steps_ratio=0.05"], (None, 0.1, 0.05)),
    # actor steps, critic left at verl's default (-1, ratio 0): verl's critic does not warm up
    ([f"{A}.lr_warmup_steps=10"], (10, 0.0, 0.0)),
    ([f"{A}.lr_warmup_steps=10", "critic.optim.lr_warmup_steps=10"], (10, 0.0, None)),
])
def test_the_critic_warmup_is_verls(overrides, want):
    t = _verl(*overrides).config.training
    assert (t.lr_warmup_steps, t.lr_warmup_ratio, t.critic_lr_warmup_ratio) == want
    assert _verl(*overrides, "algorithm.adv_estimator=grpo").config.training.critic_lr_warmup_ratio is None
