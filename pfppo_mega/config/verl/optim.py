"""verl's optimizer and learning-rate schedule keys read as ours: one schedule for actor and critic here
(training.lr_warmup_steps / lr_warmup_ratio / lr_schedule / min_lr_ratio), the critic's warm-up ratio
its own; AdamW (0.9, 0.999) only. The actor's and the critic's rows use these converters.
"""

from __future__ import annotations

from typing import Any, Callable

from pfppo_mega.config.verl.keys import A
from pfppo_mega.config.verl.rule import Ignore, Out, Refuse, View, _Unreadable, _same_value, _typed


# verl's learning-rate schedule (verl 0.9.1: FSDP workers read warmup_style / lr_scheduler_type and
# min_lr_ratio, megatron workers lr_decay_style and min_lr; both lr_warmup_steps(_ratio)); ours is
# training.lr_warmup_steps / lr_warmup_ratio / lr_schedule / min_lr_ratio (trainer/lr_schedule.py),
# shared by actor and critic except the critic's warm-up fraction (training.critic_lr_warmup_ratio). verl's values of these keys when a config leaves them out:
OPTIM_DEFAULTS = {"lr_warmup_steps": -1, "lr_warmup_steps_ratio": 0.0, "warmup_style": None,
                  "lr_scheduler_type": "constant", "lr_decay_style": "constant", "min_lr_ratio": 0.0,
                  "min_lr": 0.0, "lr_warmup_init": 0.0, "num_cycles": 0.5, "lr_decay_steps": None}
SCHEDULES = ("constant", "cosine")


def _optim(v: View, section: str, leaf: str) -> Any:
    value = v.get(f"{section}.optim.{leaf}")
    return OPTIM_DEFAULTS[leaf] if value is None else value


def _warmup_steps(value: Any, v: View) -> Any:
    if value is None or _typed(value, int) < 0:
        raise Ignore("verl's -1: the warm-up is lr_warmup_steps_ratio x total_training_steps (see that key)")
    return Out({"training.lr_warmup_steps": _typed(value, int)},
               "the k-th actor update (k = 0, 1, ...) runs at lr x k / lr_warmup_steps until k reaches it, as verl")


def _warmup_ratio(value: Any, v: View) -> Any:
    ratio = _typed(value, float)
    if _typed(_optim(v, A, "lr_warmup_steps"), int) >= 0:
        raise Ignore("actor_rollout_ref.actor.optim.lr_warmup_steps >= 0 decides")
    return Out({"training.lr_warmup_ratio": ratio, "training.lr_warmup_steps": None},
               "warm-up steps = int(ratio x training.total_training_steps), as verl")


def _schedule(value: Any, v: View) -> Any:
    if value is None:
        raise Ignore("null: lr_scheduler_type decides")
    name = _typed(value, str)
    if name not in SCHEDULES:
        raise Refuse(f"learning-rate schedule {name!r}: constant and cosine only here (training.lr_schedule)")
    return Out({"training.lr_schedule": name})


def _min_lr_ratio(value: Any, v: View) -> Any:
    if value is None:
        raise Ignore("null: 0")
    return Out({"training.min_lr_ratio": _typed(value, float)}, "read with training.lr_schedule cosine")


def _min_lr(value: Any, v: View) -> Any:
    floor = _typed(value, float)
    if floor == 0:
        raise Ignore("0: cosine decays to 0, as training.min_lr_ratio's default")
    lr = v.typed(f"{A}.optim.lr", float)
    if not lr > 0:
        raise _Unreadable(f"{A}.optim.lr")  # reported at training.lr (must be > 0)
    return Out({"training.min_lr_ratio": floor / lr}, f"megatron's absolute floor over optim.lr ({lr})")


def _only_default(leaf: str, why: str) -> Callable[[Any, View], Any]:
    """A schedule detail whose verl default is what our schedule does; another value refused."""
    def convert(value: Any, v: View) -> Any:
        if value is None or _same_value(value, OPTIM_DEFAULTS[leaf]) or (
                leaf == "lr_decay_steps" and value == v.get("trainer.total_training_steps")):
            raise Ignore(f"{OPTIM_DEFAULTS[leaf]!r}: as here")
        raise Refuse(why)
    return convert


def _critic_warmup_ratio(value: Any, v: View) -> Any:
    ratio = _typed(value, float)
    if v.get("algorithm.adv_estimator") != "gae":
        raise Ignore(f"no critic with adv_estimator {v.get('algorithm.adv_estimator')!r}")
    if _typed(_optim(v, "critic", "lr_warmup_steps"), int) >= 0:
        raise Ignore("critic.optim.lr_warmup_steps >= 0 decides")
    return Out({"training.critic_lr_warmup_ratio": ratio},
               "the critic's warm-up steps = int(ratio x training.total_training_steps), apart from the actor's, "
               "as verl")


def _critic_optim(leaf: str) -> Callable[[Any, View], Any]:
    """A critic schedule key: one schedule here, so it must agree with the actor's."""
    def convert(value: Any, v: View) -> Any:
        if v.get("algorithm.adv_estimator") != "gae":
            raise Ignore(f"no critic with adv_estimator {v.get('algorithm.adv_estimator')!r}")
        actor = _optim(v, A, leaf)
        if _same_value(value, actor) or (value is None and OPTIM_DEFAULTS[leaf] == actor):
            raise Ignore(f"equal to {A}.optim.{leaf} (one learning-rate schedule here, for actor and critic)")
        raise Refuse(f"differs from {A}.optim.{leaf} = {actor!r}: the learning-rate schedule is one setting "
                     f"here (training.lr_warmup_steps / lr_schedule / min_lr_ratio, for actor and critic; only the "
                     f"critic's warm-up ratio is its own); set them equal")
    return convert


def _betas(value: Any, v: View) -> Any:
    betas = _typed(value, list[float])
    if betas == [0.9, 0.999]:
        raise Ignore("AdamW (0.9, 0.999), as here")
    raise Refuse("AdamW betas are (0.9, 0.999) here")


def _optimizer(value: Any, v: View) -> Any:
    if str(value).lower() in ("adam", "adamw"):
        raise Ignore("AdamW, as here")
    raise Refuse(f"optimizer {value!r}: AdamW only here")
