"""fp16 training (model.params_dtype float16, issue 36; verl's `megatron.dtype=float16`): megatron's
Float16Module and mixed-precision optimizer with its dynamic loss scaler. A tiny run trains; an
inf gradient skips the step, is counted, and halves the scale; a resume restores the scaler."""

import math

import torch

from pfppo_mega.models import gpt
from pfppo_mega.trainer.checkpoint import resume
from pfppo_mega.trainer.loop import PPOTrainer
from test_trainer import _cfg
from test_trainer_resume import _LOG, quiet, sft_small  # noqa: F401

FP16 = {"params_dtype": "float16", "initial_loss_scale": 1024.0, "loss_scale_window": 3}


def _scaler(opt):
    subs = getattr(opt, "chained_optimizers", None) or [opt]
    return next(o.grad_scaler for o in subs if getattr(o, "grad_scaler", None) is not None)


def _trainer(sft, out, steps, **model):
    return PPOTrainer(_cfg(out, sft, model={**FP16, **model}, training={"total_training_steps": steps},
                           logging=_LOG, checkpoint={"save_interval": 0}), log=quiet)


def test_fp16_matmul_runs_on_this_torch():
    a = torch.randn(64, 32, dtype=torch.float16)
    b = torch.randn(32, 16, dtype=torch.float16)
    assert (a @ b).dtype == torch.float16
    torch.testing.assert_close((a @ b).float(), a.float() @ b.float(), atol=2e-2, rtol=1e-2)


def test_tiny_fp16_run_trains_in_fp16_with_a_scaler(sft_small, tmp_path):
    tr = _trainer(sft_small, tmp_path, 3)
    actor = gpt.unwrap(tr.run.models.actor)
    assert actor.config.fp16 and not actor.config.bf16
    assert next(actor.decoder.parameters()).dtype == torch.float16
    assert tr.run.models.actor.config.grad_scale_func is not None  # megatron's schedule scales the loss
    before = {k: v.float().clone() for k, v in actor.state_dict().items() if isinstance(v, torch.Tensor)}
    rec = [tr.train_step() for _ in range(3)]
    assert all(math.isfinite(r["policy/pg_loss"]) for r in rec)
    assert all("policy/loss_scale" in r for r in rec)
    after = actor.state_dict()
    moved = [k for k, v in before.items() if not torch.equal(v, after[k].float())]
    assert len(moved) > len(before) // 2, moved  # the weights trained
    assert rec[-1]["guard/skipped_updates"] == rec[-1]["guard/loss_scale_overflows"]  # nothing else skipped


def test_an_inf_gradient_skips_the_step_and_halves_the_scale(sft_small, tmp_path):
    tr = _trainer(sft_small, tmp_path, 4, loss_scale_hysteresis=1)
    tr.train_step()  # a clean step first (the scaler's window restarts)
    actor = gpt.unwrap(tr.run.models.actor)
    scale = _scaler(tr.run.models.actor_opt).scale.item()
    weights = {k: v.clone() for k, v in actor.state_dict().items() if isinstance(v, torch.Tensor)}
    skipped = tr.run.state.guards["loss_scale_overflows"]
    # an inf in one gradient of the actor's next backward
    w = actor.decoder.layers[0].mlp.linear_fc1.weight
    hook = w.register_hook(lambda g: g.index_put((torch.tensor([0]), torch.tensor([0])),
                                                 torch.tensor(float("inf"), dtype=g.dtype)))
    try:
        rec = tr.train_step()
    finally:
        hook.remove()
    assert tr.run.state.guards["loss_scale_overflows"] > skipped
    assert rec["guard/loss_scale_overflows"] == tr.run.state.guards["loss_scale_overflows"]
    assert _scaler(tr.run.models.actor_opt).scale.item() == scale / 2 ** (tr.run.state.guards["loss_scale_overflows"] - skipped)
    # the skipped actor step changed no weight (every actor update of this step saw the inf)
    after = actor.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in weights.items())
    assert math.isnan(rec["policy/grad_norm"])


def test_resume_restores_the_scaler(sft_small, tmp_path):
    tr = _trainer(sft_small, tmp_path, 2, initial_loss_scale=2.0 ** 20)
    for _ in range(2):
        tr.train_step()
    sc = _scaler(tr.run.models.actor_opt)
    sc._scale.fill_(96.0)
    sc._growth_tracker = 2
    resume.save(tr.run, tmp_path / "checkpoints")
    resume.wait(tmp_path / "checkpoints")
    again = _trainer(sft_small, tmp_path, 4, initial_loss_scale=2.0 ** 20)
    got = _scaler(again.run.models.actor_opt)
    assert again.step == 2 and got.scale.item() == 96.0 and got._growth_tracker == 2


def test_megatrons_first_scale_overflows_are_counted_and_the_run_goes_on(sft_small, tmp_path):
    """From megatron's initial 2^32 the scaled fp16 gradients overflow: those steps are skipped and
    counted, the scale falls, and (above min_loss_scale) they do not halt the run."""
    tr = PPOTrainer(_cfg(tmp_path, sft_small, model={"params_dtype": "float16"},
                         training={"total_training_steps": 3, "max_consecutive_skipped_updates": 2},
                         logging=_LOG, checkpoint={"save_interval": 0}), log=quiet)
    rec = [tr.train_step() for _ in range(3)]
    assert rec[-1]["guard/loss_scale_overflows"] >= 3 and rec[-1]["policy/loss_scale"] < 2.0 ** 32
    assert rec[-1]["guard/skipped_updates"] >= rec[-1]["guard/loss_scale_overflows"]


def test_the_ledger_counts_fp16_as_bf16_bytes():
    from pfppo_mega import ledger

    n = 1000
    fp16 = {h.name.replace("fp16", "x"): h.bytes for h in ledger._train_state("actor", n, 1, False, "float16")}
    bf16 = {h.name.replace("bf16", "x"): h.bytes for h in ledger._train_state("actor", n, 1, False, "bfloat16")}
    assert fp16 == bf16 and fp16["actor weights (x)"] == 2 * n  # fp16 weights; fp32 grads, main weights, Adam
    assert sum(fp16.values()) == (2 + 4 + 12) * n


def test_the_distributed_optimizers_scaler_resumes_too(sft_small, tmp_path):
    def trainer(steps):
        return PPOTrainer(_cfg(tmp_path, sft_small, model=FP16, parallel={"use_distributed_optimizer": True},
                               training={"total_training_steps": steps}, logging=_LOG,
                               checkpoint={"save_interval": 0}), log=quiet)

    tr = trainer(2)
    tr.train_step()
    _scaler(tr.run.models.actor_opt)._scale.fill_(96.0)
    resume.save(tr.run, tmp_path / "checkpoints")
    resume.wait(tmp_path / "checkpoints")
    again = trainer(4)
    assert again.step == 1 and _scaler(again.run.models.actor_opt).scale.item() == 96.0
    assert math.isfinite(again.train_step()["policy/pg_loss"])
