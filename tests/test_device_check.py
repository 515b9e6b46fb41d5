"""Device-check mode (pfppo_mega.trainer.instruments.devicecheck): the trainer's phases pass it on CPU, and
each of its checks fires when a tensor is where the device rule says it must not be.

The 2-rank layouts (TP2, PP2, DP2, distributed optimizer) run under PFPPO_DEVICE_CHECK=1 in the
shared multirank launch (tests/test_trainer_parallel.py)."""

import pytest
import torch
import torch.distributed as dist

from pfppo_mega.trainer.instruments import devicecheck
from pfppo_mega.trainer import loop as trainer_loop
from pfppo_mega.trainer import phases as trainer_phases
from pfppo_mega.trainer.instruments.devicecheck import DeviceViolation

from test_trainer import sft_dir, _cfg  # noqa: F401  (the shared tiny SFT checkpoint)

FEATURES = dict(reward={"scaling": "running_zscore", "quantile_clip": 0.9},
                algorithm={"use_pf_ppo": True, "use_kl_loss": True, "entropy_coeff": 0.01,
                           "filtration": {"enable": True}},
                training={"micro_batch_size": 16, "total_training_steps": 3},
                logging={"eval_interval": 0, "tensorboard": False, "plots": False, "progress": False,
                         "kl_probe_size": 8})


@pytest.fixture
def trainer(sft_dir, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv(devicecheck.ENV, "1")
    return trainer_loop.PPOTrainer(_cfg(tmp_path, sft_dir, **FEATURES), log=lambda *_: None)


def test_trainer_steps_pass_the_device_check(trainer):
    """PF-PPO, running z-scores, quantile clip, filtration, KL loss, micro-batches, KL probe: every
    loss call, phase boundary and collective of 2 steps passes (on CPU the model's device is cpu)."""
    assert trainer.device_check and trainer.run.device == torch.device("cpu")
    with devicecheck.session(trainer.run.device) as s:  # the trainer's own session nests into this one
        for _ in range(2):
            m = trainer.train_step()
            assert all(v == v for v in m.values())
    assert {"prepare: model inputs and results", "advantages: experience batch", "policy loss",
            "value loss"} <= set(s.where)
    assert s.checks >= 2 * 4
    print(f"device check: {s.checks} checks at {s.where}, {s.collectives} collectives")


def test_the_experience_left_on_the_host_is_caught(trainer, monkeypatch):
    """The bug issue 11 names: the experience packed on the host (no device) while the models are on
    the device. The check mode catches it at the first op that mixes the two."""
    pack = trainer_phases.pack
    monkeypatch.setattr(trainer_phases, "pack", lambda *a, device=None, **k: pack(*a, **k))
    with pytest.raises(DeviceViolation, match=r"prepare: model inputs and results: inputs .* made on the host"):
        trainer.train_step()


def test_every_trainer_check_fires_for_another_expected_device(trainer):
    """With the expected device set to meta, the trainer's first checked call (a collective or an
    expect() site) refuses its CPU tensors."""
    with pytest.raises(DeviceViolation, match="meta"):
        with devicecheck.session(trainer.run.device, expect=torch.device("meta")):
            trainer.train_step()


def test_expect_names_the_tensor_and_the_rule():
    cpu = torch.device("cpu")
    ok = torch.zeros(3, device=cpu)
    with devicecheck.session(cpu, expect=torch.device("meta")):
        with pytest.raises(DeviceViolation, match=r"value loss: returns \(3,\).* is on cpu, expected .*meta"):
            devicecheck.expect("value loss", cpu, returns=ok)
    with devicecheck.session(cpu) as s:
        devicecheck.expect("policy loss", cpu, logp=torch.zeros(2, device=cpu))  # explicit device: fine
        host = torch.zeros(2)  # no device: on a GPU machine this is a CPU tensor
        with pytest.raises(DeviceViolation, match="policy loss: old_logp .* made on the host"):
            devicecheck.expect("policy loss", cpu, old_logp=host)
        with pytest.raises(DeviceViolation, match="mul.* mixes a host tensor"):
            _ = host * torch.ones(2, device=cpu)
        _ = host.to(cpu) * torch.ones(2, device=cpu)  # moved explicitly: fine
        _ = torch.ones(2, device=cpu) * torch.tensor(2.0)  # a 0-dim host scalar: torch allows it
        with pytest.raises(DeviceViolation, match="stack"):  # ... but not in stack / cat
            torch.stack([torch.ones((), device=cpu), torch.tensor(1.0)])
        # tags follow the data: an op of host tensors is host, indexing keeps the indexed side
        assert devicecheck.is_host((host + 1)[torch.tensor([0])])
        assert not devicecheck.is_host(torch.ones(2, device=cpu)[torch.tensor([0])])
    assert s.checks == 2 and devicecheck.active() is None
    assert not devicecheck.is_host(torch.zeros(2))  # outside a session nothing is tagged


def test_collectives_refuse_host_tensors_and_other_devices():
    """Every torch.distributed collective is checked while a session is on (a one-process gloo
    world: the call itself is real)."""
    from pfppo_mega import parallel

    parallel.init_parallel(tp=1, pp=1, backend="gloo", seed=1)
    cpu = torch.device("cpu")
    plain = dist.all_reduce
    with devicecheck.session(cpu) as s:
        assert dist.all_reduce is not plain
        t = torch.ones(2, device=cpu)
        dist.all_reduce(t)
        with pytest.raises(DeviceViolation, match="all_reduce .* made on the host goes to a collective"):
            dist.all_reduce(torch.ones(2))
        assert parallel.world_min(3, dist.group.WORLD) == 3
    assert s.collectives >= 2
    with devicecheck.session(cpu, expect=torch.device("meta")):
        with pytest.raises(DeviceViolation, match="broadcast .* group's device is meta"):
            dist.broadcast(torch.ones(2, device=cpu), src=0)
    assert dist.all_reduce is plain  # restored after the session


def test_the_env_switch_is_validated(monkeypatch):
    monkeypatch.setenv(devicecheck.ENV, "yes")
    with pytest.raises(ValueError, match=r"PFPPO_DEVICE_CHECK='yes' must be 0 or 1"):
        devicecheck.requested()
    monkeypatch.setenv(devicecheck.ENV, "0")
    assert not devicecheck.requested()
