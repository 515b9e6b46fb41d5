"""Names and limits shared by the config tree, the math modules and the kernel checks.

Imports nothing (not even torch), so every layer may read it: the config tree takes its CHOICES
from here, the pure-torch math checks its `mode=` / `method=` arguments against the same tuples,
and tests/test_config.py checks that the C++ kernels hard-code the same LOG_RATIO_LIMIT.
"""

# ----------------------------------------------------------------------------- enum tuples

PARAMS_DTYPES = ("float32", "bfloat16", "float16")  # model.params_dtype (float16: with a loss scaler)
LAYER_SPECS = ("auto", "local", "transformer_engine")  # model.layer_spec: TE where installed, else local;
# megatron's torch layers (fused by training.fused_layers); TE's
ROLLOUT_IS_LEVELS = ("token", "sequence")  # algorithm.rollout_correction.rollout_is (ppo/rollout_correction.py)
ROLLOUT_RS_CRITERIA = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
                       "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")  # rollout_rs
RECOMPUTE_MODES = ("none", "selective", "full")  # training.recompute: activation recomputation
PARALLEL_BACKENDS = ("auto", "gloo", "nccl")  # parallel.backend
KERNEL_MODES = ("auto", "torch", "fused")  # kernels
TASKS = ("addition",)  # data.task
ADDITION_FORMATS = ("plain", "padded", "reversed")  # data.addition_format (tasks/addition.py)
DATA_SOURCES = ("task", "files")  # data.source: the built-in task, or JSONL / Parquet prompt files
TOOL_TRUNCATE_SIDES = ("left", "middle", "right")  # actor_rollout.multi_turn.tool_response_truncate_side
TOKENIZATION_CHECK_MODES = ("strict", "ignore_strippable", "disable")  # multi_turn.tokenization_sanity_check_mode
TOOL_CALL_FORMATS = ("hermes",)  # actor_rollout.multi_turn.format
OVERLONG_PROMPTS = ("filter", "error", "left", "right", "middle")  # data.overlong_prompts: drop (counted), refuse
# at start, or cut to max_prompt_length as verl's data.truncation does (left: keep the end; right: keep the start;
# middle: keep both ends)
# LoRA (model.lora, models/lora.py): the megatron linears an adapter may sit on, and the Hugging Face
# projection names (PEFT's target_modules) inside each. A fused linear takes one adapter (one A, one B over
# its whole output), so its parts come all together or not at all.
LORA_LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
LORA_HF_PARTS = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
                 "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}
LORA_ALL = "all-linear"  # PEFT's / verl's name for every linear of the decoder layers (not the LM head)
LORA_INITS = ("kaiming", "xavier")  # model.lora.init_a: PEFT's kaiming_uniform(a=sqrt 5), megatron's xavier
LR_SCHEDULES = ("constant", "cosine")  # training.lr_schedule after the warm-up (verl's lr_scheduler_type)
# Rule-based scorers of the reward registry (pfppo_mega/rewards/rules.py); reward.default_scorer.
REWARD_SCORERS = ("gsm8k", "math", "exact_match", "math_dapo")
ALGORITHMS = ("ppo",)  # algorithm.name

# Snapshot choice of the PF-PPO pool (algorithm.pool.sampling, pool/sampling.py).
POOL_SAMPLING = ("uniform", "recency", "kl", "reward")
ASYNC_SAMPLING = ("newest", "uniform", "recency")  # algorithm.async_rl.sampling
PARTIAL_ROLLOUT_ENGINES = ("builtin", "vllm")  # actor_rollout.engine values that take weights inside a request
# Behaviour importance weight (algorithm.pool.is_mode, pool/correction.py).
IS_MODES = ("truncate", "mask", "tis")
# Which score feeds a snapshot's mean reward (algorithm.pool.reward_signal).
POOL_REWARD_SIGNALS = ("trained", "honest")
# how often a behaviour snapshot is drawn: per prompt group, or once per rollout step
POOL_ASSIGN = ("group", "step")
# Per-token KL estimators (algorithm.kl_estimator, ppo/kl.py) and verl's names for them.
KL_ESTIMATORS = ("k1", "k2", "k3", "abs")
KL_ESTIMATOR_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}
# Token-loss aggregation (algorithm.loss_agg_mode, ppo/losses.py, the fused policy loss);
# seq-mean-token-sum-norm is Dr.GRPO's (verl 0.9.1): the token sum over the step's rows with a token
# and over a constant (algorithm.loss_scale_factor).
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# the modes the C++/CUDA policy-loss op computes itself; kernels/backends.py maps
# seq-mean-token-sum-norm onto seq-mean-token-sum / constant
KERNEL_LOSS_AGG_MODES = LOSS_AGG_MODES[:3]
# Policy losses a config may choose (algorithm.policy_loss, trainer/policy_loss.py; verl's names);
# "tis" is chosen by algorithm.pool.is_mode, not here. verl's "vanilla" is ppo_clip.
POLICY_LOSSES = ("ppo_clip", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "cispo")
POLICY_LOSS_ALIASES = {"vanilla": "ppo_clip"}
# Sequence-score normalisation (reward.scaling, ppo/rewards.py).
REWARD_SCALING = ("none", "batch_zscore", "running_zscore")
# Gameable wrappers around an honest reward (reward.shaping.kind, rewards/shaping.py).
REWARD_SHAPINGS = ("none", "length_bias", "phrase_exploit", "noisy", "scaled")
# Policy-filtration weights (algorithm.filtration.reweight_method, ppo/filtration.py):
# verl's three under verl's names with verl's definitions, then this project's variants.
VERL_REWEIGHT_METHODS = ("pow", "max_min", "max_random")
REWEIGHT_METHODS = VERL_REWEIGHT_METHODS + ("pow_minmax", "best_random")

# ----------------------------------------------------------------------------- numeric limits

# exp() of a log-ratio beyond this overflows float32 long before it carries information.
# The C++/CUDA policy loss hard-codes the same value (kLogRatioLimit in csrc/policy_loss.h; a test compares them).
LOG_RATIO_LIMIT = 20.0

# Upper bounds of the config's integer keys: far above any real run, far below what overflows
# an int32 index, a seed or a loop that would run for days.
MAX_COUNT = 1 << 20  # batch sizes, samples per prompt, prompts, pool size: 1,048,576
MAX_STEPS = 100_000_000  # steps and step intervals
MAX_LOSS_SCALE = 2.0 ** 64  # model.loss_scale / initial_loss_scale: fp32 holds the scaled gradients
MAX_TOKENS = 1 << 24  # sequence lengths and vocabulary: 16,777,216
MAX_MODEL_DIM = 1 << 20  # layers, widths, heads
MAX_PARALLEL = 4096  # TP / PP degree
MAX_EVAL_PROMPTS = 100_000  # data.eval_size (each is generated and scored every evaluation)
MAX_SEED = (1 << 32) - 1
MAX_THREADS = 1024
MAX_HEAD_CHUNK_TOKENS = 1 << 20  # training.fused_head_chunk_tokens (rows of one [chunk, V] logits block)
MAX_REWARD_WORKERS = 256  # reward.num_workers (processes running a user reward function)
MAX_REWARD_TIMEOUT_S = 3600.0  # reward.timeout_s, per sample
MAX_TOOL_TIMEOUT_S = 86_400.0  # actor_rollout.multi_turn.tool_timeout_s: at most a day
MAX_SANDBOX_CONCURRENT = 4096  # reward.sandbox_fusion.max_concurrent (requests in flight)
MAX_SANDBOX_MEMORY_MB = 1 << 20  # reward.sandbox_fusion.memory_limit_mb (1 TiB)
COLLECTIVE_TIMEOUT_S = 1800.0  # parallel.collective_timeout_s default (torch's own for gloo and NCCL)
REFIT_TIMEOUT_S = 300.0  # actor_rollout.refit_timeout_s default: a rank lost mid-refit ends in an error, not a hang
MAX_REFIT_TIMEOUT_S = 86_400.0  # ... at most a day
MAX_REWARD_WEIGHT = 1e6  # reward.model_weight / reward.rule_weight
MAX_DATA_FILES = 10_000  # data.train_files / data.val_files
MAX_WORST_SAMPLES = 1000  # logging.worst_samples, per kind per step
MAX_SHAPED_REWARD = 1e6  # reward.shaping's bonuses, scores and scale
INT_LIMIT = (1 << 31) - 1  # any other int key (a generic backstop in the config tree)
