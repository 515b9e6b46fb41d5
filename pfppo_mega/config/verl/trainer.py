"""Rows for verl's trainer section: run length, checkpoints, evaluation and resume mapped; logging,
Ray placement and housekeeping ignored.
"""

from __future__ import annotations

from typing import Any, Optional

from pfppo_mega.config.verl.reasons import LOGS, RAY, SPEED
from pfppo_mega import constants as C
from pfppo_mega.config.verl.rule import Bad, I, Ignore, M, Out, R, Refuse, Rule, View, _typed


def _save_freq(value: Any, v: View) -> Any:
    n = _typed(value, int)
    if n <= 0:
        return Out({"checkpoint.save_interval": 0}, "verl saves none; here only the final checkpoint")
    return n


def _test_freq(value: Any, v: View) -> Any:
    n = _typed(value, int)
    return Out({"logging.eval_interval": max(n, 0)}, "only at start and end" if n <= 0 else "")


def _resume(value: Any, v: View) -> Any:
    mode = _typed(value, str)
    if mode == "auto":
        return Out({"checkpoint.resume": True})
    if mode == "disable":
        return Out({"checkpoint.resume": False})
    raise Refuse(f"resume_mode {mode!r}: here a run resumes from the latest checkpoint in logging.output_dir "
                 "(auto) or not at all (disable)")


def _resume_from_path(value: Any, v: View) -> Any:
    """verl's _load_checkpoint reads resume_from_path only with resume_mode resume_path (auto: the latest
    checkpoint under default_local_dir; disable: none)."""
    _typed(value, Optional[str])  # a path (or null) even where unused
    mode = v.get("trainer.resume_mode")
    if mode != "resume_path":
        raise Ignore(f"read only with trainer.resume_mode=resume_path (verl too ignores it with {mode!r})")
    raise Refuse("resuming from another directory: here a run resumes from the latest checkpoint in "
                 "logging.output_dir; copy or link that checkpoint there and set trainer.resume_mode=auto")


def _keep(value: Any, v: View) -> Any:
    if value is None:
        raise Ignore("null (keep all): checkpoint.keep_last keeps its default")
    return _typed(value, int)


def _total_steps(value: Any, v: View) -> Any:
    if value is None:
        raise Ignore("null: see trainer.total_epochs")
    return _typed(value, int)


def _total_epochs(value: Any, v: View) -> Any:
    n = _typed(value, int)
    if not 1 <= n <= C.MAX_STEPS:
        raise Bad(f"must be >= 1 and <= {C.MAX_STEPS} (passes over the data); our run length is "
                  "training.total_training_steps: set trainer.total_training_steps to the steps verl would run")
    raise Ignore("this trainer stops after training.total_training_steps (one rollout batch each); verl stops at "
                 "whichever comes first, total_epochs passes over the data or trainer.total_training_steps. "
                 "Set trainer.total_training_steps to the steps verl would run")


RULES: tuple[Rule, ...] = (
    # ---------------------------------------------------------------- trainer
    M("trainer.total_training_steps", "training.total_training_steps", _total_steps, why='null: see total_epochs'),
    M("trainer.total_epochs", "(run length)", _total_epochs, why='ignored: our run length is training.total_training_steps (set trainer.total_training_steps)'),
    M("trainer.critic_warmup", "training.critic_warmup_steps"),
    M("trainer.save_freq", "checkpoint.save_interval", _save_freq, why='-1: only the final checkpoint'),
    M("trainer.test_freq", "logging.eval_interval", _test_freq, why='-1: only at start and end'),
    M("trainer.resume_mode", "checkpoint.resume", _resume, why='auto: resume; disable: not; resume_path refused'),
    M("trainer.resume_from_path", "checkpoint.resume", _resume_from_path,
      why="read only with resume_mode resume_path (refused), as verl"),
    M("trainer.default_local_dir", "logging.output_dir", why="checkpoints go under it here"),
    M("trainer.max_actor_ckpt_to_keep", "checkpoint.keep_last", _keep, why='null: our default'),
    I("trainer.max_critic_ckpt_to_keep", "one checkpoint holds actor and critic here (checkpoint.keep_last)"),
    I("trainer.val_before_train", "here the held-out set is always scored at start and end"),
    I("trainer.val_only", "here `pfppo train` always trains"),
    I("trainer.log_val_generations", LOGS), I("trainer.rollout_data_dir", LOGS),
    I("trainer.validation_data_dir", LOGS),
    I("trainer.logger", LOGS), I("trainer.project_name", LOGS), I("trainer.experiment_name", LOGS),
    I("trainer.tensorboard_dir", LOGS), I("trainer.rl_logging_board_dir", LOGS),
    I("trainer.nnodes", RAY), I("trainer.n_gpus_per_node", RAY),
    I("trainer.ray_wait_register_center_timeout", RAY),
    R("trainer.device", "only CUDA GPUs (or the CPU for tests) here", ok=("cuda",),
      fix="set it to cuda (or remove it) and run on NVIDIA GPUs"),
    I("trainer.balance_batch", "reorders rows over data-parallel ranks by length; " + SPEED),
    I("trainer.esi_redundant_time", "checkpointing before a preemption deadline"),
    I("trainer.del_local_ckpt_after_load", "checkpoint housekeeping"),
    I("trainer.default_hdfs_dir", "checkpoint copies to HDFS"),
    I("trainer.use_legacy_worker_impl", "verl's choice of worker implementation"),
)
