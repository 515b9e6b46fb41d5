"""Rows for verl's critic section. The critic here is built when the estimator needs it (gae), starts
from the actor's checkpoint and shares the actor's layout, batch sizes, epochs and schedule: verl
keys that may differ between the two must agree (``_same_as``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from pfppo_mega.config.verl.convert import _float
from pfppo_mega.config.verl.keys import LORA_KEYS, A, M_
from pfppo_mega.config.verl.optim import _betas, _critic_optim, _critic_warmup_ratio, _optimizer
from pfppo_mega.config.verl.reasons import CRITIC_LAYOUT, DYNAMIC_BSZ, FORWARD_MICRO, FSDP, MERGE_ADAPTER, MOE, SPEED
from pfppo_mega.config.verl.rule import I, Ignore, M, R, Refuse, Rule, View, _typed, positive_int


def _same_as(key: str, label: str) -> Callable[[Any, View], Any]:
    """A key verl lets differ from another one (critic's from the actor's) and we share: must agree."""
    def convert(value: Any, v: View) -> Any:
        if v.get("algorithm.adv_estimator") != "gae":
            raise Ignore(f"no critic with adv_estimator {v.get('algorithm.adv_estimator')!r}")
        other = v.get(key)
        if value != other and not (isinstance(value, (int, float)) and isinstance(other, (int, float))
                                   and not isinstance(value, bool) and float(value) == float(other)):
            raise Refuse(f"differs from {key} = {other!r}; {label} is one setting here, for actor and "
                         f"critic: set them equal")
        raise Ignore(f"equal to {key} (one {label} here, for actor and critic)")
    return convert


def _critic_enable(value: Any, v: View) -> Any:
    value = _typed(value, Optional[bool])  # true / false / null only: verl reads it as Python truth
    if value is False and v.get("algorithm.adv_estimator") == "gae":
        raise Refuse("adv_estimator gae needs the critic; remove critic.enable (or set it true), or choose an "
                     "estimator without one (algorithm.adv_estimator=grpo, for instance)")
    raise Ignore("the critic is built when the advantage estimator needs it (gae), as verl's null does")


def _critic_path(value: Any, v: View) -> Any:
    if value in (None, v.get(f"{M_}.path")):
        raise Ignore("the critic starts from actor_rollout.model_path (trunk) with a zero-initialised value head")
    raise Refuse(f"a critic from another checkpoint than the actor ({v.get(f'{M_}.path')!r}): here the critic "
                 "always starts from actor_rollout.model_path")


def _same_weight_decay(value: Any, v: View) -> Any:
    return _same_as(f"{A}.optim.weight_decay", "weight decay")(value, v)


def _critic_mini(value: Any, v: View) -> Any:
    return _same_as(f"{A}.ppo_mini_batch_size", "mini-batch size")(value, v)


RULES: tuple[Rule, ...] = (
    # ---------------------------------------------------------------- critic
    M("critic.enable", "(critic)", _critic_enable, why='false with gae refused'),
    M("critic.model.path", "(the actor's checkpoint)", _critic_path, why="must be the actor's checkpoint"),
    I("critic.model.tokenizer_path", "the critic reads the policy's tokens"),
    M("critic.optim.lr", "training.critic_lr", _float),
    M("critic.optim.clip_grad", "training.critic_grad_clip", _float),
    M("critic.grad_clip", "training.critic_grad_clip", _float),
    M("critic.optim.weight_decay", "(training.weight_decay)", _same_weight_decay, why="must equal the actor's (one weight decay here), with a critic"),
    M("critic.cliprange_value", "algorithm.value_clip"),
    M("critic.ppo_mini_batch_size", "(training.batch_size)", _critic_mini, why="must equal the actor's, with a critic"),
    M("critic.ppo_epochs", "(algorithm.ppo_epochs)", lambda x, v: _same_as(f"{A}.ppo_epochs", "ppo_epochs")(x, v), why="must equal the actor's, with a critic"),
    M("critic.loss_agg_mode", "(algorithm.loss_agg_mode)",
      lambda x, v: _same_as(f"{A}.loss_agg_mode", "loss_agg_mode")(x, v), why="must equal the actor's, with a critic"),
    I("critic.ppo_micro_batch_size_per_gpu", "one micro-batch size for actor and critic here "
                                             "(training.micro_batch_size); " + SPEED, check=positive_int),
    I("critic.ppo_micro_batch_size", "one micro-batch size for actor and critic here; " + SPEED, check=positive_int),
    I("critic.forward_micro_batch_size", FORWARD_MICRO, check=positive_int),
    I("critic.forward_micro_batch_size_per_gpu", FORWARD_MICRO, check=positive_int),
    I("critic.use_dynamic_bsz", DYNAMIC_BSZ), I("critic.ppo_max_token_len_per_gpu", DYNAMIC_BSZ, check=positive_int),
    I("critic.forward_max_token_len_per_gpu", DYNAMIC_BSZ, check=positive_int),
    I("critic.shuffle", "see actor_rollout_ref.actor.shuffle"), I("critic.data_loader_seed", "seeded by training.seed"),
    I("critic.rollout_n", "follows actor_rollout_ref.rollout.n"),
    I("critic.strategy", "this trainer is megatron; FSDP settings are ignored"),
    I("critic.ulysses_sequence_parallel_size", FSDP), I("critic.model.fsdp_config.**", FSDP),
    I("critic.megatron.**", CRITIC_LAYOUT),
    I("critic.checkpoint.**", "checkpoints here always hold the models, optimizers and the data position"),
    I("critic.nccl_timeout", "collectives' timeout"),
    R("critic.load_weight", "a critic from random weights", ok=(True,)),
    M("critic.optim.lr_warmup_steps_ratio", "training.critic_lr_warmup_ratio", _critic_warmup_ratio,
      why="the critic's own warm-up fraction (read when critic.optim.lr_warmup_steps is -1, as verl)"),
    *(M(f"critic.optim.{k}", f"(= {A}.optim.{k})", _critic_optim(k), why="one schedule for actor and critic: must equal the actor's")
      for k in ("lr_warmup_steps", "warmup_style", "lr_scheduler_type", "lr_decay_style",
                "min_lr_ratio", "min_lr", "lr_warmup_init", "num_cycles", "lr_decay_steps")),
    R("critic.optim.weight_decay_incr_style", "a weight-decay schedule: constant here", ok=("constant",)),
    M("critic.optim.betas", "(AdamW betas)", _betas, why='(0.9, 0.999) accepted; others refused'), M("critic.optim.optimizer", "(AdamW)", _optimizer, why='adam / AdamW accepted; others refused'),
    I("critic.optim.**", "WSD schedule, optimizer implementation or bookkeeping",
      ("lr_wsd_decay_steps", "lr_wsd_decay_style", "optimizer_impl", "total_training_steps",
       "use_checkpoint_opt_param_scheduler")),
    I("critic.optim.override_optimizer_config.**", SPEED),
    I("critic.optim.override_optimizer_config", SPEED),
    R("critic.model.lora_rank", "LoRA training of the critic: not implemented here (the actor's is, model.lora)", ok=(0, None), fix="remove it to train every weight instead (full fine-tuning: gradients and Adam states for all parameters; `pfppo plan` shows whether that fits)"),
    R("critic.model.lora.rank", "LoRA training of the critic: not implemented here (the actor's is, model.lora)", ok=(0, None), fix="remove it to train every weight instead (full fine-tuning: gradients and Adam states for all parameters; `pfppo plan` shows whether that fits)"),
    R("critic.model.lora.adapter_path", "LoRA adapters: not implemented here", ok=(None,), fix=MERGE_ADAPTER),
    I("critic.model.lora.**", "LoRA only (refused)", LORA_KEYS),
    *(I(f"critic.model.{k}", "LoRA only (refused)") for k in ("lora_alpha", "target_modules")),
    R("critic.model.override_config", "overrides of the checkpoint's config.json", ok=({},)),
    R("critic.model.override_config.model_config", "overrides of the checkpoint's config.json", ok=({},)),
    I("critic.model.override_config.moe_config.**", MOE),
    R("critic.model.override_config.**", "overrides of the checkpoint's config.json"),
    R("critic.model.external_lib", "importing a user's model library", ok=(None,)),
    I("critic.model.trust_remote_code", "no checkpoint code is run here"),
    *(I(f"critic.model.{k}", SPEED) for k in ("enable_gradient_checkpointing", "enable_activation_offload",
                                              "use_remove_padding", "use_shm", "tiled_mlp.enabled",
                                              "tiled_mlp.num_shards")),
)
