"""Rows for verl's actor_rollout_ref.model, .actor (batches, loss, optimizer, megatron layout) and .ref,
with the converters only these rows use. verl counts mini-batches in prompts (x rollout.n samples
here); the reference model and the critic share the actor's layout (parallel.*).
"""

from __future__ import annotations

from typing import Any

from pfppo_mega.config.tree import AlgorithmConfig, field_types
from pfppo_mega.config.verl.convert import _choice, _float, _when_ours
from pfppo_mega.config.verl.keys import A, M_, R_
from pfppo_mega.config.verl.lora import RULES as LORA_RULES
from pfppo_mega.config.verl.kl import _kl_coef, _kl_type, _use_kl_loss
from pfppo_mega.config.verl.optim import (_betas, _min_lr, _min_lr_ratio, _only_default, _optimizer, _schedule,
                                          _warmup_ratio, _warmup_steps)
from pfppo_mega.config.verl.reasons import (COPY_TOKENIZER, FORWARD_MICRO, FSDP, MOE, MULTIMODAL,
                                            REF_LAYOUT, SPEED)
from pfppo_mega.config.verl.rule import (Bad, I, Ignore, M, Out, R, Refuse, Rule, View, _native_choices, _typed,
                                         positive_int)


def _mini_batch(value: Any, v: View) -> Out:
    mini = _typed(value, int)
    n = v.typed(f"{R_}.n", int)
    return Out({"training.batch_size": mini * n},
               f"verl counts prompts: {mini} prompts x rollout.n {n} = {mini * n} samples per optimizer step")


def _micro_batch(value: Any, v: View) -> Any:
    if value is None:
        raise Ignore("null: the whole mini-batch is one micro-batch")
    return Out({"training.micro_batch_size": _typed(value, int)},
               "samples per data-parallel rank, as in verl; here micro-batches change memory and speed only "
               "(the loss is normalised over the whole mini-batch; verl's legacy workers average each "
               "micro-batch's token-mean on its own, which re-weights tokens slightly)")


def _loss_param(value: Any, v: View) -> Any:
    """A clip ratio: ours unless verl's loss_mode is one this trainer does not have (refused there)."""
    mode = v.get(f"{A}.policy_loss.loss_mode")
    if mode not in (None, "vanilla") and _policy_loss_key() is None:
        raise Ignore(f"a parameter of verl's {mode!r} policy loss (refused at policy_loss.loss_mode)")
    return _typed(value, float)


def _loss_mode(value: Any, v: View) -> Any:
    name = _typed(value, str)
    key = _policy_loss_key()
    if key is None:
        if name == "vanilla":
            raise Ignore("vanilla: the clipped PPO surrogate, as here")
        raise Refuse(f"mapping waits for a policy-loss selection key in algorithm (verl's {name!r} loss)")
    name = AlgorithmConfig.VALUE_ALIASES.get(key.rpartition(".")[2], {}).get(name, name)  # vanilla -> ppo_clip
    allowed = _native_choices(key)
    if allowed is not None and name not in allowed:
        raise Refuse(f"{name!r} has no counterpart here ({key} is one of {', '.join(map(repr, allowed))})")
    return Out({key: name})


def _policy_loss_key() -> str | None:
    """Our policy-loss selection key, once the tree has one."""
    for name in ("policy_loss", "loss_mode", "policy_loss_mode"):
        if name in field_types(AlgorithmConfig):
            return f"algorithm.{name}"
    return None


def _seq_parallel(value: Any, v: View) -> Any:
    if _typed(value, bool) and v.typed(f"{A}.megatron.tensor_model_parallel_size", int) == 1:
        raise Ignore("verl turns it off at tensor-parallel size 1 (nothing to split)")
    raise Ignore("activation memory only; here it is parallel.sequence_parallel (off by default: it needs "
                 "model.layer_spec transformer_engine)")


def _recompute(value: Any, v: View) -> Any:
    if value is None:
        return "none"
    name = _typed(value, str)
    if name not in ("full", "selective"):
        raise Bad("must be full, selective or null (megatron's recompute_granularity)")
    return name


def _dtype(value: Any, v: View) -> Any:
    name = _typed(value, str)
    names = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32",
             "float16": "float16", "fp16": "float16"}
    if name not in names:
        raise Bad("must be bfloat16, float16 or float32 (model.params_dtype)")
    return names[name]


def _max_pos(value: Any, v: View) -> Any:
    return Out({"model.max_position_embeddings": _typed(value, int)},
               "a set model field must match the checkpoint's config.json (checked at start)")


RULES: tuple[Rule, ...] = (
    # ---------------------------------------------------------------- model
    M(f"{M_}.path", "actor_rollout.model_path"),
    R(f"{M_}.hf_config_path", "a config.json apart from the checkpoint's", ok=(None,),
      fix="copy that config.json into the checkpoint directory (model.path)"),
    R(f"{M_}.tokenizer_path", "a tokenizer apart from the checkpoint's (here read from model_path)", ok=(None,),
      fix=COPY_TOKENIZER),
    R(f"{M_}.custom_chat_template", "a chat template apart from the checkpoint's tokenizer_config.json",
      ok=(None,), fix="save the template as chat_template.jinja in the checkpoint directory (model.path)"),
    R(f"{M_}.external_lib", "importing a user's model library", ok=(None,)),
    I(f"{M_}.trust_remote_code", "no checkpoint code is run here (the families are built in)"),
    I(f"{M_}.use_shm", SPEED),
    I(f"{M_}.enable_gradient_checkpointing",
      "activation checkpointing of FSDP models; megatron's is override_transformer_config.recompute_granularity "
      "(training.recompute); " + SPEED),
    I(f"{M_}.enable_activation_offload", SPEED),
    I(f"{M_}.use_remove_padding", SPEED),
    I(f"{M_}.use_liger", SPEED), I(f"{M_}.use_fused_kernels", SPEED), I(f"{M_}.fused_kernel_options.**", SPEED, ("impl_backend",)),
    I(f"{M_}.tiled_mlp.**", SPEED, ("enabled", "num_shards")),
    I(f"{M_}.torch_dtype", FSDP),
    *LORA_RULES,  # config/verl/lora.py: model.lora
    R(f"{M_}.mtp.enable", "multi-token prediction: not implemented here", ok=(False,)),
    I(f"{M_}.mtp.**", "multi-token prediction only (mtp.enable=True is refused)",
      ("detach_encoder", "enable_rollout", "enable_train", "method", "mtp_loss_scaling_factor", "num_speculative_tokens",
       "speculative_algorithm", "speculative_eagle_topk", "speculative_num_draft_tokens", "speculative_num_steps")),
    M(f"{M_}.override_config.max_position_embeddings", "model.max_position_embeddings", _max_pos, why="must match the checkpoint's config.json (checked at start)"),
    M(f"{M_}.override_config.model_config.max_position_embeddings", "model.max_position_embeddings", _max_pos, why="must match the checkpoint's config.json (checked at start)"),
    I(f"{M_}.override_config.moe_config.**", MOE),
    R(f"{M_}.override_config.model_config", "overrides of the checkpoint's config.json", ok=({},)),
    R(f"{M_}.override_config", "overrides of the checkpoint's config.json", ok=({},)),
    R(f"{M_}.override_config.**", "overrides of the checkpoint's config.json change the model; here the model "
                                  "is the checkpoint's (model.* fields must match it)"),
    I("actor_rollout_ref.hybrid_engine", "actor and rollout share the GPUs here, as in verl's hybrid engine"),
    I("actor_rollout_ref.nccl_timeout", "collectives' timeout; refits use actor_rollout.refit_timeout_s"),
    # ---------------------------------------------------------------- actor: batches and epochs
    M(f"{A}.ppo_mini_batch_size", "training.batch_size", _mini_batch, why='verl counts prompts: x rollout.n samples'),
    M(f"{A}.ppo_micro_batch_size_per_gpu", "training.micro_batch_size", _micro_batch, why='samples per data-parallel rank in both; memory and speed only here (the loss is normalised over the whole mini-batch)'),
    I(f"{A}.ppo_micro_batch_size", "verl's deprecated global micro-batch, divided by the data-parallel size at "
                                   "launch; set training.micro_batch_size (per rank); " + SPEED),
    M(f"{A}.use_dynamic_bsz", "training.use_dynamic_bsz",
      why="token-budget micro-batches for the actor, the critic and the forward passes alike here"),
    M(f"{A}.ppo_max_token_len_per_gpu", "training.max_tokens_per_micro_batch",
      why="tokens per micro-batch per data-parallel rank in both (read only with use_dynamic_bsz)"),
    M(f"{A}.ppo_epochs", "algorithm.ppo_epochs"),
    I(f"{A}.shuffle", "here each epoch shuffles the rollout batch into mini-batches (verl's default keeps "
                      "rollout order); with one mini-batch per rollout the same"),
    I(f"{A}.data_loader_seed", "every random draw here is seeded by training.seed"),
    I(f"{A}.rollout_n", "follows actor_rollout_ref.rollout.n"),
    # ---------------------------------------------------------------- actor: loss
    M(f"{A}.clip_ratio", "algorithm.clip_ratio", _loss_param),
    M(f"{A}.clip_ratio_low", "algorithm.clip_ratio_low", _loss_param),
    M(f"{A}.clip_ratio_high", "algorithm.clip_ratio_high", _loss_param),
    M(f"{A}.clip_ratio_c", "algorithm.dual_clip_c", _loss_param),
    M(f"{A}.entropy_coeff", "algorithm.entropy_coeff"),
    M(f"{A}.loss_agg_mode", "algorithm.loss_agg_mode", _choice("algorithm.loss_agg_mode"), why="verl's names are ours; others refused"),
    M(f"{A}.loss_scale_factor", "algorithm.loss_scale_factor", _when_ours("algorithm.loss_scale_factor", (None,)), why='refused until our tree has the key'),
    M(f"{A}.policy_loss.loss_mode", "algorithm.policy_loss", _loss_mode, why="vanilla = ppo_clip; verl's names are ours; others refused"),
    # parameters of verl's other policy losses; at verl's default values they ask for nothing
    *(M(f"{A}.policy_loss.{k}", f"algorithm.{k}", _when_ours(f"algorithm.{k}", (d,)))
      for k, d in (("clip_cov_ratio", 0.0002), ("clip_cov_lb", 1.0), ("clip_cov_ub", 5.0), ("kl_cov_ratio", 0.0002),
                   ("ppo_kl_coef", 0.1))),
    M(f"{A}.tau_pos", "algorithm.tau_pos", _when_ours("algorithm.tau_pos", (1.0,))),
    M(f"{A}.tau_neg", "algorithm.tau_neg", _when_ours("algorithm.tau_neg", (1.05,))),
    M(f"{A}.use_kl_loss", "algorithm.use_kl_loss, algorithm.kl_coeff", _use_kl_loss, why='with use_kl_in_reward: loss term, reward penalty, or no KL (kl_coeff 0); both on refused'),
    M(f"{A}.kl_loss_coef", "algorithm.kl_coeff", _kl_coef("loss"), why='only with use_kl_loss alone'),
    M(f"{A}.kl_loss_type", "algorithm.kl_estimator", _kl_type("loss"), why='only with use_kl_loss alone: kl/k1, abs, mse/k2, low_var_kl/k3; full and the + forms refused'),
    I(f"{A}.calculate_entropy", "entropy is always logged here (policy/entropy)"),
    I(f"{A}.calculate_sum_pi_squared", "sum_v pi(v)^2 is computed here when the estimator reads it "
      "(optimal_token_baseline), else only logged by verl"),
    I(f"{A}.entropy_checkpointing", SPEED), I(f"{A}.entropy_from_logits_with_chunking", SPEED),
    I(f"{A}.sum_pi_squared_checkpointing", SPEED),
    I(f"{A}.use_torch_compile", SPEED), I(f"{A}.use_fused_kernels", SPEED), I(f"{A}.use_prefix_grouper", SPEED),
    I(f"{A}.use_remove_padding", SPEED),
    I(f"{A}.freeze_vision_tower", MULTIMODAL),
    I(f"{A}.strategy", "this trainer is megatron; FSDP settings are ignored"),
    I(f"{A}.ulysses_sequence_parallel_size", FSDP),
    I(f"{A}.fsdp_config.**", FSDP),
    I(f"{A}.checkpoint.**", "checkpoints here always hold the models, optimizers and the data position"),
    R(f"{A}.router_replay.mode", MOE, ok=("disabled",)),
    I(f"{A}.router_replay.**", MOE, ("record_file", "replay_file")),
    R(f"{A}.load_weight", "training from random weights", ok=(True,)),
    # ---------------------------------------------------------------- actor: optimizer
    M(f"{A}.optim.lr", "training.lr", _float),
    M(f"{A}.optim.weight_decay", "training.weight_decay", _float),
    M(f"{A}.optim.clip_grad", "training.grad_clip", _float),
    M(f"{A}.grad_clip", "training.grad_clip", _float),
    M(f"{A}.optim.betas", "(AdamW betas)", _betas, why='(0.9, 0.999) accepted; others refused'),
    M(f"{A}.optim.optimizer", "(AdamW)", _optimizer, why='adam / AdamW accepted; others refused'),
    I(f"{A}.optim.optimizer_impl", "AdamW here (megatron's)"),
    M(f"{A}.optim.lr_warmup_steps", "training.lr_warmup_steps", _warmup_steps, why="-1: the ratio decides"),
    M(f"{A}.optim.lr_warmup_steps_ratio", "training.lr_warmup_ratio", _warmup_ratio,
      why="read when lr_warmup_steps < 0, as verl"),
    M(f"{A}.optim.warmup_style", "training.lr_schedule", _schedule, why="verl's older name of lr_scheduler_type"),
    M(f"{A}.optim.lr_scheduler_type", "training.lr_schedule", _schedule, why="constant or cosine (FSDP workers)"),
    M(f"{A}.optim.lr_decay_style", "training.lr_schedule", _schedule,
      why="constant or cosine (megatron workers); linear, inverse-square-root and WSD refused"),
    M(f"{A}.optim.min_lr_ratio", "training.min_lr_ratio", _min_lr_ratio, why="cosine's floor over lr"),
    M(f"{A}.optim.min_lr", "training.min_lr_ratio", _min_lr, why="megatron's absolute floor, over optim.lr"),
    M(f"{A}.optim.num_cycles", "(cosine: half a cycle)",
      _only_default("num_cycles", "a cosine of other than half a cycle: training.lr_schedule cosine decays once")),
    M(f"{A}.optim.lr_decay_steps", "(cosine ends at total_training_steps)",
      _only_default("lr_decay_steps", "a decay ending before total_training_steps: cosine ends there here")),
    M(f"{A}.optim.lr_warmup_init", "(warm-up from 0)",
      _only_default("lr_warmup_init", "a warm-up from a non-zero lr: it starts at 0 here, as verl's default")),
    R(f"{A}.optim.weight_decay_incr_style", "a weight-decay schedule: constant here", ok=("constant",)),
    I(f"{A}.optim.lr_wsd_decay_style", "WSD schedule only (refused at lr_decay_style)"),
    I(f"{A}.optim.lr_wsd_decay_steps", "WSD schedule only (refused at lr_decay_style)"),
    I(f"{A}.optim.total_training_steps", "verl fills it in from trainer.total_training_steps"),
    I(f"{A}.optim.use_checkpoint_opt_param_scheduler", "here the lr is a function of the step, which a resume restores"),
    I(f"{A}.optim.override_optimizer_config.**", "megatron optimizer offload / precision options; " + SPEED),
    I(f"{A}.optim.override_optimizer_config", "megatron optimizer offload / precision options; " + SPEED),
    # ---------------------------------------------------------------- actor: megatron layout
    M(f"{A}.megatron.tensor_model_parallel_size", "parallel.tensor_model_parallel_size"),
    M(f"{A}.megatron.pipeline_model_parallel_size", "parallel.pipeline_model_parallel_size"),
    M(f"{A}.megatron.virtual_pipeline_model_parallel_size", "parallel.virtual_pipeline_size"),
    M(f"{A}.megatron.sequence_parallel", "(parallel.sequence_parallel)", _seq_parallel, why='ignored: activation memory only (ours needs model.layer_spec transformer_engine)'),
    M(f"{A}.megatron.use_distributed_optimizer", "parallel.use_distributed_optimizer"),
    M(f"{A}.megatron.dtype", "model.params_dtype", _dtype, why="bfloat16 / float16 (megatron's loss scaler) / float32"),
    M(f"{A}.megatron.override_transformer_config.recompute_granularity", "training.recompute", _recompute, why='full, selective; null = none'),
    I(f"{A}.megatron.context_parallel_size", "context parallelism: not here (a layout; " + SPEED + ")"),
    I(f"{A}.megatron.expert_model_parallel_size", MOE), I(f"{A}.megatron.expert_tensor_parallel_size", MOE),
    I(f"{A}.megatron.param_offload", SPEED), I(f"{A}.megatron.grad_offload", SPEED),
    I(f"{A}.megatron.optimizer_offload", SPEED),
    I(f"{A}.megatron.use_dist_checkpointing", "checkpoint format (here megatron's own, verified)"),
    I(f"{A}.megatron.dist_checkpointing_path", "checkpoint format (here megatron's own, verified)"),
    I(f"{A}.megatron.dist_checkpointing_prefix", "checkpoint format (here megatron's own, verified)"),
    I(f"{A}.megatron.seed", "megatron's initialisation seed (the weights come from the checkpoint); "
                            "training.seed seeds the rest"),
    I(f"{A}.megatron.use_mbridge", "checkpoint conversion (here pfppo_mega's HF import/export)"),
    I(f"{A}.megatron.vanilla_mbridge", "checkpoint conversion (here pfppo_mega's HF import/export)"),
    I(f"{A}.megatron.use_remove_padding", SPEED), I(f"{A}.megatron.forward_only", "set by verl itself"),
    I(f"{A}.megatron.override_ddp_config", SPEED), I(f"{A}.megatron.override_ddp_config.**", SPEED),
    R(f"{A}.megatron.override_mcore_model_config", "overrides of megatron's model config", ok=({},)),
    I(f"{A}.megatron.override_transformer_config.recompute_method", "megatron's recompute detail; " + SPEED),
    I(f"{A}.megatron.override_transformer_config.recompute_num_layers", "megatron's recompute detail; " + SPEED),
    I(f"{A}.megatron.override_transformer_config.recompute_modules", "megatron's recompute detail; " + SPEED),
    I(f"{A}.megatron.override_transformer_config.attention_backend", "attention kernel (model.layer_spec); " + SPEED),
    R(f"{A}.megatron.override_transformer_config.fp8", "fp8 training", ok=(None, False)),
    I(f"{A}.megatron.override_transformer_config.fp8_recipe", "fp8 only (refused)"),
    *(I(f"{A}.megatron.override_transformer_config.{k}", "a megatron kernel fusion; " + SPEED)
      for k in ("apply_rope_fusion", "bias_activation_fusion", "bias_dropout_fusion", "gradient_accumulation_fusion",
                "masked_softmax_fusion", "persist_layer_norm", "deallocate_pipeline_outputs")),
    *(I(f"{A}.megatron.override_transformer_config.{k}", "pipeline stage sizes (a layout; here layers are split "
                                                         "evenly); " + SPEED)
      for k in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
                "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")),
    I(f"{A}.megatron.override_transformer_config.moe_*", MOE),
    R(f"{A}.megatron.override_transformer_config.*", "an override of megatron's TransformerConfig: not applied "
                                                     "here (the model follows the checkpoint)"),
    # ---------------------------------------------------------------- reference
    I("actor_rollout_ref.ref.megatron.**", REF_LAYOUT),
    I("actor_rollout_ref.ref.fsdp_config.**", FSDP),
    I("actor_rollout_ref.ref.log_prob_micro_batch_size", FORWARD_MICRO, check=positive_int),
    I("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", FORWARD_MICRO, check=positive_int),
    I("actor_rollout_ref.ref.log_prob_use_dynamic_bsz", FORWARD_MICRO),
    I("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", FORWARD_MICRO, check=positive_int),
    I("actor_rollout_ref.ref.*", REF_LAYOUT + "; " + SPEED),
    I("actor_rollout_ref.ref.**", REF_LAYOUT),
)
