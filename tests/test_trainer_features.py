"""The training features of the config reach the trainer's models and optimizers (issue 11):
the distributed optimizer and bf16 parameters with fp32 main weights run on CPU, checkpoint and
resume bit-identically; what the CPU cannot run is refused at start by key."""

import copy
import math

import pytest
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from pfppo_mega.models.gpt import FeatureError
from pfppo_mega.trainer.checkpoint import store as ckpt
from pfppo_mega.trainer.checkpoint import resume
from pfppo_mega.trainer.loop import PPOTrainer
from test_trainer_resume import _LOG, quiet, records_and_weights, resume_comparison, sft_small  # noqa: F401
from test_trainer import _cfg


def _run(sft, out, steps, **sections):
    tr = PPOTrainer(_cfg(out, sft, training={"total_training_steps": steps}, logging=_LOG,
                         checkpoint={"save_interval": 0}, **sections), log=quiet)
    return tr, tr.fit()


def test_distributed_optimizer_and_bf16_run_and_resume_bit_identically(sft_small, tmp_path):
    feats = dict(parallel={"use_distributed_optimizer": True}, model={"params_dtype": "bfloat16"})
    tr, res = _run(sft_small, tmp_path / "a", 4, **feats)
    assert isinstance(tr.run.models.actor_opt.chained_optimizers[0] if hasattr(tr.run.models.actor_opt, "chained_optimizers")
                      else tr.run.models.actor_opt, DistributedOptimizer)
    assert tr.run.models.actor.config.bf16 and next(tr.run.models.actor.parameters()).dtype.is_floating_point
    straight = records_and_weights(tr, res)
    _run(sft_small, tmp_path / "b", 2, **feats)
    tr, res = _run(sft_small, tmp_path / "b", 4, **feats)
    differ, n, max_diff = resume_comparison(straight, records_and_weights(tr, res))
    assert not differ, differ[:10]
    assert max_diff == 0.0
    # the checkpoint's optimizer state is checked against the run: each rank's share is saved by
    # parameter name and element range, and its param groups must be the run's
    sd = resume.load_part(tmp_path / "b" / "checkpoints").state["actor_opt"]
    ckpt.check_optimizer_state(tr.run.models.actor_opt, sd, "actor_opt")
    part = sd["distributed_optimizer"][0]
    assert part["slices"] and all(0 <= s < e for _, _, s, e in part["slices"])
    bad = copy.deepcopy(sd)
    bad["distributed_optimizer"][0]["slices"][0][3] = 10**12
    with pytest.raises(ckpt.CheckpointError, match=r"slices must be a list of \[name, shape, start, end\]"):
        ckpt.check_optimizer_state(tr.run.models.actor_opt, bad, "actor_opt")
    bad = copy.deepcopy(sd)
    bad["distributed_optimizer"][0]["state_dict"]["optimizer"]["param_groups"].pop()
    with pytest.raises(ckpt.CheckpointError, match="param groups, the run's optimizer has"):
        ckpt.check_optimizer_state(tr.run.models.actor_opt, bad, "actor_opt")
    with pytest.raises(ckpt.CheckpointError, match="use_distributed_optimizer=true but the checkpoint holds a plain"):
        ckpt.check_optimizer_state(tr.run.models.actor_opt, {"state": {}, "param_groups": []}, "actor_opt")


def test_distributed_optimizer_checkpoint_before_any_step_resumes(sft_small, tmp_path):
    """megatron's DistributedOptimizer.state_dict() asserts before the first step: a checkpoint at
    step 0 stores no moments and the resumed run refreshes its fp32 main params from the weights."""
    feats = dict(parallel={"use_distributed_optimizer": True}, model={"params_dtype": "bfloat16"})
    tr = PPOTrainer(_cfg(tmp_path, sft_small, logging=_LOG, **feats), log=quiet)
    resume.save(tr.run, tmp_path / "checkpoints")
    resume.wait(tmp_path / "checkpoints")
    state = resume.load_part(tmp_path / "checkpoints", step=0).state
    assert state["actor_opt"] == {"distributed_optimizer": [{"state_dict": None, "slices": None}]}
    msgs: list[str] = []
    again = PPOTrainer(_cfg(tmp_path, sft_small, logging=_LOG, **feats), log=msgs.append)
    assert any("resumed" in m for m in msgs), msgs
    assert again.step == 0 and math.isfinite(again.train_step()["policy/pg_loss"])


@pytest.mark.parametrize("section,key,value", [
    ("training", "recompute", "full"),
    ("model", "layer_spec", "transformer_engine"),
])
def test_features_the_cpu_cannot_run_are_refused_by_key(sft_small, tmp_path, section, key, value):
    with pytest.raises(FeatureError, match=f"{section}.{key}"):
        PPOTrainer(_cfg(tmp_path, sft_small, **{section: {key: value}}, logging=_LOG), log=quiet)
