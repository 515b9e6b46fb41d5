"""megatron-core actor / critic models and Hugging Face checkpoint import / export.

Importing this package imports megatron-core (~3 s); call pfppo_mega.parallel.init_parallel
before building a model.
"""

from pfppo_mega.models.gpt import (
    CriticModel,
    StepStats,
    actor_logits,
    build_actor,
    build_critic,
    build_optimizer,
    check_layout,
    critic_values,
    optimizer_step,
    transformer_config,
    unwrap,
    wrap_ddp,
    zero_grads,
)
from pfppo_mega.models.hf_io import (
    ModelDirError,
    CheckpointReader,
    architecture_from_hf,
    export_hf,
    gather_hf_weights,
    hf_to_megatron,
    load_actor_from_hf,
    load_critic_trunk_from_hf,
    load_hf_state_dict,
    megatron_named_params_to_hf,
    megatron_to_hf,
    model_config_from_hf,
    qkv_bias_from_hf,
    read_hf_config,
)

__all__ = [
    "CriticModel", "StepStats", "actor_logits", "build_actor", "build_critic", "build_optimizer",
    "check_layout", "critic_values", "optimizer_step", "transformer_config", "unwrap", "wrap_ddp",
    "zero_grads",
    "ModelDirError", "CheckpointReader", "architecture_from_hf", "export_hf", "gather_hf_weights", "hf_to_megatron", "load_actor_from_hf",
    "load_critic_trunk_from_hf", "load_hf_state_dict", "megatron_named_params_to_hf", "megatron_to_hf",
    "model_config_from_hf", "qkv_bias_from_hf", "read_hf_config",
]
