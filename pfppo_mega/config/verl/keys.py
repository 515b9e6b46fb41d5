"""verl's sections, the prefixes of its actor_rollout_ref keys, and verl's defaults that change the result.

Data only: the rows of the table (``table.RULES``) and the converters read these names.
"""

from __future__ import annotations

from typing import Any


# verl's top-level sections that are not ours: any of them puts a config in verl's layout.
VERL_HEADS = ("actor_rollout_ref", "critic", "trainer", "reward_model", "custom_reward_function",
              "reward_manager", "global_profiler", "ray_kwargs", "transfer_queue", "ray_init")
SHARED_HEADS = ("algorithm", "data")  # sections both trees have; verl's keys there are the table's
# `trainer.total_training_steps` alone is also our native alias (Config.ALIASES): not a verl marker.
_NATIVE_TRAINER_KEYS = ("total_training_steps",)

# the prefixes of verl's actor_rollout_ref keys, as the rows write them
A = "actor_rollout_ref.actor"
R_ = "actor_rollout_ref.rollout"
M_ = "actor_rollout_ref.model"


# verl's defaults (verl/trainer/config/_generated_ppo_megatron_trainer.yaml; the FSDP one agrees on
# each) for the keys the translation reads, applied when a verl config leaves the key out.
# tests/test_verl_layout.py checks each against tests/data/verl_megatron_defaults.json.
VERL_DEFAULTS: dict[str, Any] = {
    "data.train_batch_size": 1024,
    f"{A}.ppo_mini_batch_size": 256,
    f"{R_}.n": 1,
    "data.max_prompt_length": 512,
    "data.max_response_length": 512,
    "data.filter_overlong_prompts": False,
    "data.truncation": "error",
    "algorithm.lam": 1.0,
    "algorithm.gamma": 1.0,
    "algorithm.adv_estimator": "gae",
    "algorithm.use_kl_in_reward": False,
    "algorithm.kl_penalty": "kl",
    "algorithm.kl_ctrl.type": "fixed",
    "algorithm.kl_ctrl.kl_coef": 0.001,
    f"{A}.use_kl_loss": False,
    f"{A}.kl_loss_coef": 0.001,
    f"{A}.kl_loss_type": "low_var_kl",
    f"{A}.ppo_epochs": 1,
    f"{A}.loss_agg_mode": "token-mean",
    f"{A}.optim.lr": 1e-6,
    f"{A}.optim.weight_decay": 0.01,
    "critic.optim.lr": 1e-5,
    "critic.optim.weight_decay": 0.01,
    "critic.cliprange_value": 0.5,
    "critic.optim.lr_warmup_steps_ratio": 0.0,
    f"{A}.megatron.tensor_model_parallel_size": 1,
    "reward_model.enable": False,
    "reward_model.use_reward_loop": True,
}
# Our keys a verl-layout config sets whatever verl key it has (no verl key says them): key ->
# (value, why). One of our keys given explicitly wins.
VERL_FIXED: dict[str, tuple[Any, str]] = {
    "algorithm.vf_coef": (1.0, "verl's critic loss has no coefficient (its own optimizer)"),
}


# verl keys a converter reads whose setting may come as one of our keys in a mixed config.
NATIVE_EQUIVALENTS = {
    f"{R_}.n": "actor_rollout.n_samples_per_prompt",
    f"{A}.megatron.tensor_model_parallel_size": "parallel.tensor_model_parallel_size",
    f"{M_}.path": "actor_rollout.model_path",
}


# the keys verl has under a LoRA subtree (model.lora.*, critic.model.lora.*); any other there is unknown
LORA_KEYS = ("a2a_experimental", "alpha", "dropout", "dropout_position", "dtype", "exclude_modules", "freeze_language_model", "freeze_vision_model", "freeze_vision_projection", "lora_A_init_method", "lora_B_init_method", "merge", "target_modules", "type")
