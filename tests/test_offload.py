"""Colocation (pfppo_mega.trainer.colocation.offload): the trainer's states leave the device during rollout and
come back bit-identical; training with the offload equals training without it; the planner's
rollout-phase figure is what the trainer really keeps on the device, with the offload and without."""

import pytest
import torch

from pfppo_mega.planning.memory import Hardware, Knobs, RunShape, make_plan, offload_from_config
from pfppo_mega.trainer.loop import PPOTrainer
from pfppo_mega.trainer.colocation.offload import (TrainerOffload, module_tensors, offload_enabled, optimizer_tensors,
                                        unique_storages)

from test_pinned import fake_cuda  # noqa: F401  (CUDA faked: a recording cudart)
from test_trainer import sft_dir, _cfg  # noqa: F401  (the shared tiny SFT checkpoint)

QUIET = dict(logging={"eval_interval": 0, "tensorboard": False, "plots": False, "progress": False})
BF16 = dict(model={"params_dtype": "bfloat16"})  # the planner's byte counts: bf16 weights, fp32 grads + Adam


def _trainer(tmp_path, sft_dir, **sections):  # noqa: F811
    return PPOTrainer(_cfg(tmp_path, sft_dir, **{**QUIET, **sections}), log=lambda *_: None)


def _everything(tr) -> list[torch.Tensor]:
    return [t for src in (module_tensors(tr.run.models.actor), module_tensors(tr.run.models.critic), module_tensors(tr.run.models.ref),
                          optimizer_tensors(tr.run.models.actor_opt), optimizer_tensors(tr.run.models.critic_opt)) for t in src]


def test_the_default_is_on_for_gpus_only():
    assert offload_enabled(None, torch.device("cuda", 0)) and not offload_enabled(None, torch.device("cpu"))
    assert offload_enabled(True, torch.device("cpu")) and not offload_enabled(False, torch.device("cuda", 0))


def _grads(tr) -> list[torch.Tensor]:
    """DDP's grad-buffer views (main_grad) and every .grad of the trained models and optimizers."""
    return [g for t in _everything(tr) for g in (getattr(t, "main_grad", None), t.grad) if isinstance(g, torch.Tensor)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(torch.uint8) if t.dim() else t.detach()


def test_states_come_back_bit_identical_and_grads_zeroed_without_a_host_copy(sft_dir, tmp_path):  # noqa: F811
    """After a step (Adam states exist, the grad buffers hold the step's gradients), offload frees
    every parameter, grad-buffer and optimizer storage on the device; reload restores every byte
    into the same tensor objects, except the gradients: no host bytes for them, and they come back
    zeroed, the same Python objects at the same size (the update zeroes them before its backward)."""
    tr = _trainer(tmp_path, sft_dir, training={"total_training_steps": 2, "offload_during_rollout": True}, **BF16)
    tr.train_step()
    tensors, grads = _everything(tr), _grads(tr)
    grad_ids = {id(g) for g in grads}
    grad_sizes = [g.untyped_storage().nbytes() for g in grads]
    grad_bytes = sum({g.untyped_storage().data_ptr(): n for g, n in zip(grads, grad_sizes)}.values())
    assert grads and any(bool(g.ne(0).any()) for g in grads)  # last step's gradients are there
    before = [t.detach().clone() for t in tensors]
    held = tr.run.colocation.offload.device_bytes()
    assert held > 0 and any(t.dtype == torch.bfloat16 for t in tensors)
    freed = tr.run.colocation.offload.offload()
    assert freed == held and tr.run.colocation.offload.device_bytes() == 0 and tr.run.colocation.offload.is_offloaded
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors)  # freed, the tensors themselves kept
    assert tr.run.colocation.offload.host_bytes() == held - grad_bytes > 0  # everything but the gradients on the host
    tr.run.colocation.offload.reload()
    assert tr.run.colocation.offload.device_bytes() == held and not tr.run.colocation.offload.is_offloaded
    after = _everything(tr)
    assert [id(t) for t in after] == [id(t) for t in tensors] and [id(g) for g in _grads(tr)] == [id(g) for g in grads]
    assert [g.untyped_storage().nbytes() for g in grads] == grad_sizes
    for t, b in zip(after, before):
        if id(t) in grad_ids:
            assert t.shape == b.shape and not bool(t.ne(0).any()), "a gradient came back non-zero"
        else:
            assert t.dtype == b.dtype and torch.equal(_bits(t), _bits(b))


def test_training_with_offload_equals_training_without(sft_dir, tmp_path):  # noqa: F811
    """PF-PPO with the current policy as a candidate between snapshots: its live refit happens while
    the states are offloaded (brought back for it, then offloaded again). Metrics and final weights
    are exactly those of the run without offload; the engine slept after every generation."""
    feats = dict(training={"total_training_steps": 3}, **BF16,
                 algorithm={"use_pf_ppo": True, "pool": {"pool_size": 2, "snapshot_interval": 2,
                                                         "include_current": True}})
    runs = {}
    for on in (False, True):
        f = {**feats, "training": {**feats["training"], "offload_during_rollout": on}}
        tr = _trainer(tmp_path / str(on), sft_dir, **f)
        slept = []
        sleep = tr.run.colocation.engine.sleep
        tr.run.colocation.engine.sleep = lambda: (slept.append(tr.step), sleep())[1]
        metrics = [tr.train_step() for _ in range(3)]
        runs[on] = (metrics, [p.detach().clone() for p in _everything(tr)], tr, slept)
    (m_off, w_off, _, _), (m_on, w_on, tr, slept) = runs[False], runs[True]
    keys = ("policy/pg_loss", "critic/value_loss", "policy/grad_norm", "reward/mean", "kl/ref_k1")
    assert [[m[k] for k in keys] for m in m_off] == [[m[k] for k in keys] for m in m_on]
    assert all(torch.equal(a, b) for a, b in zip(w_off, w_on))
    assert tr.run.colocation.offload.enabled and tr.run.colocation.offload.temporary_reloads >= 1  # the current policy was refit while offloaded
    assert "time/offload_s" in m_on[-1] and "time/offload_s" not in m_off[-1]
    assert slept == [0, 1, 2]  # once per rollout phase, after generating
    print(f"offload {m_on[-1]['time/offload_s'] * 1e3:.1f} ms, reload {m_on[-1]['time/reload_s'] * 1e3:.1f} ms "
          f"(CPU: host == device), live refits while offloaded: {tr.run.colocation.offload.temporary_reloads}")


@pytest.mark.parametrize("offload", [False, True])
def test_planner_rollout_figure_is_what_the_trainer_keeps(sft_dir, tmp_path, offload):  # noqa: F811
    """The planner's rollout-phase "trainer states" (offload off) against the bytes of parameter,
    gradient and optimizer storage the trainer really holds on its device while the engine
    generates (second step: Adam's states exist). Equal up to what the planner documents it leaves
    out: Adam's step counters (the reference's RMSNorm weights were fp32 beside its bf16 linears until
    the reference was wrapped as the actor is; now every byte of it is in the plan).
    Offload on: the planner counts none and the trainer holds none; the host holds what the plan's
    host line says (no gradients), up to the same step counters."""
    tr = _trainer(tmp_path, sft_dir, training={"total_training_steps": 2, "offload_during_rollout": offload},
                  **BF16)
    for _ in range(2):
        tr.train_step()
    cfg = tr.run.cfg
    plan = make_plan(RunShape.from_config(cfg, tr.run.models.arch), Hardware.preset("h200", nodes=1, gpus_per_node=1),
                     Knobs(offload_during_rollout=offload_from_config(cfg),
                           distributed_optimizer=cfg.parallel.use_distributed_optimizer))
    planned = sum(c.bytes for c in plan.rollout.components if c.name.startswith("trainer states"))
    measured = tr.run.colocation.gen.rollout_trainer_bytes
    steps = sum(st["step"].untyped_storage().nbytes() for opt in (tr.run.models.actor_opt, tr.run.models.critic_opt)
                for o in getattr(opt, "chained_optimizers", None) or [opt] for st in o.optimizer.state.values())
    if offload:
        assert planned == 0 and measured == 0
        # the host side: what the offload really holds (no gradients) is the plan's host line
        host_planned = {c.name: c.bytes for c in plan.host.components}["trainer states offloaded during rollout"]
        print(f"host bytes of the offload: held {tr.run.colocation.offload.host_bytes()}, planned {host_planned:.0f} "
              f"(+ {steps} Adam step counters)")
        assert tr.run.colocation.offload.host_bytes() == host_planned + steps
        return
    print(f"rollout phase, trainer bytes on the device: measured {measured}, planned {planned:.0f} "
          f"(+ {steps} Adam step counters)")
    # the reference is bf16 throughout (gpt.wrap_frozen): no fp32 norms beyond the plan any more
    assert all(p.dtype == torch.bfloat16 for p in tr.run.models.ref.parameters())
    assert measured == planned + steps


def test_offload_object_alone_round_trips_shared_storages():
    """Two views of one storage (a parameter and its bucket) move once and both come back."""
    flat = torch.arange(12, dtype=torch.float32)
    a, b = flat[:6].view(2, 3), flat[6:]
    off = TrainerOffload(lambda: [a, b, flat], device=torch.device("cpu"), enabled=True, late=lambda: [a])
    assert len(unique_storages([a, b, flat], torch.device("cpu"))) == 1
    with off.offloaded():
        assert off.device_bytes() == 0 and flat.untyped_storage().nbytes() == 0
        with off.on_device():
            assert float(a.sum()) == 15.0
        assert off.device_bytes() == 0
    assert torch.equal(flat, torch.arange(12, dtype=torch.float32)) and float(b[0]) == 6.0


def test_host_buffers_are_pinned_exactly_and_grads_take_none(fake_cuda):  # noqa: F811
    """With pinning on (CUDA faked: test_pinned.FakeCudart), every host buffer is one exact-size
    registration (pfppo_mega.pinned; torch.empty(pin_memory=True) would round up to a power of two,
    and cannot run here); the gradients (main_grad into a grad buffer, .grad) get none and come back
    zeroed in the same objects; the rest round-trips bit-identical, through a refit's on_device too."""
    lin = torch.nn.Linear(4, 3)                                  # weight [3, 4] (the late storage), bias [3]
    grad_buffer = torch.randn(15)                                # megatron DDP's flat fp32 grad buffer
    lin.weight.main_grad, lin.bias.main_grad = grad_buffer[:12].view(3, 4), grad_buffer[12:]
    lin.weight.grad, lin.bias.grad = torch.randn(3, 4), torch.randn(3)
    adam = torch.randn(3, 4)                                     # an optimizer state, the weight's size
    tensors = lambda: [*module_tensors(lin), adam]  # noqa: E731
    grads = [lin.weight.main_grad, lin.bias.main_grad, lin.weight.grad, lin.bias.grad]
    before = [t.detach().clone() for t in (lin.weight, lin.bias, adam)]
    off = TrainerOffload(tensors, device=torch.device("cpu"), enabled=True, late=lambda: [lin.weight], pin=True)
    with off.offloaded():
        assert sorted(fake_cuda.live) == [12, 48, 48]            # bias, weight, adam: exactly, no grads
        assert off.host_bytes() == 12 + 48 + 48 and off.device_bytes() == 0
        assert all(g.untyped_storage().nbytes() == 0 for g in grads)
        with off.on_device():                                    # a refit reads the weight
            assert torch.equal(lin.weight.detach(), before[0])
        assert sorted(fake_cuda.live) == [12, 48, 48]            # the buffers are reused, not re-pinned
    assert [lin.weight.main_grad, lin.bias.main_grad, lin.weight.grad, lin.bias.grad] == grads  # same objects
    assert all(g.untyped_storage().nbytes() > 0 and not bool(g.ne(0).any()) for g in grads)
    assert grad_buffer.shape == (15,) and grad_buffer.untyped_storage().nbytes() == 60
    assert all(torch.equal(t.detach(), b) for t, b in zip((lin.weight, lin.bias, adam), before))
