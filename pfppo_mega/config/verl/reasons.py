"""Reasons and fixes that many rows of the table share, so that one wording says one thing
(docs/verl.md prints them; a refusal adds the fix, see ``rule.refusal``).
"""

from __future__ import annotations




# Reasons and fixes shared by many rules.
MERGE_ADAPTER = ("merge the adapter into its base model (PEFT's merge_and_unload, then save_pretrained) and set "
                 "model.path to the merged checkpoint")
COPY_TOKENIZER = "copy that tokenizer's files (tokenizer.json, tokenizer_config.json) into the checkpoint directory"
SINGLE_TURN = "remove it for single-turn generation (one response per prompt, no tool calls)"
NO_CORRECTION = ("remove the rollout_correction keys to train with the clipped loss on the trainer's recomputed "
                 "old log-probs (algorithm.recompute_old_logp), without a rollout-to-trainer correction")
FSDP = "FSDP-only (this trainer is megatron: its layout is parallel.*)"
RAY = "Ray placement (here the launcher, torchrun or slurm, sets the world size)"
SPEED = "speed or memory only; the result is unchanged"
PROFILE = "profiler settings"
HYDRA = "hydra bookkeeping (the class verl instantiates)"
LOGS = "logging / run names (here metrics.jsonl, TensorBoard and plots go to logging.output_dir)"
MOE = "MoE settings (this trainer builds dense decoders; a MoE checkpoint is refused at start)"
MULTIMODAL = "image / video inputs (text-only here)"
FORWARD_MICRO = ("forward-only micro-batch (log-probs); here forward passes use training.micro_batch_size; "
                 + SPEED)
REF_LAYOUT = "the reference model uses the actor's layout here (parallel.*)"
CRITIC_LAYOUT = "the critic uses the actor's layout here (parallel.*)"
DYNAMIC_BSZ = ("token-budget micro-batching follows actor_rollout_ref.actor.use_dynamic_bsz / "
               "ppo_max_token_len_per_gpu here (training.use_dynamic_bsz, one budget for every pass); micro-batches "
               "change memory and speed only (every loss is normalised over the whole mini-batch). In verl's default "
               "(legacy) workers each micro-batch's token-mean is averaged on its own, so there it also re-weights "
               "tokens slightly")
