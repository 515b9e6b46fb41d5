"""Generates docs/verl.md from the translation table of ``pfppo_mega.config.verl``, so the doc
cannot drift from the code.

    python -m pfppo_mega.config.verl_doc --write docs/verl.md
    python -m pfppo_mega.config.verl_doc --check docs/verl.md   # exit 1 if stale
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, Sequence

from pfppo_mega.config.reference import write_or_check
from pfppo_mega.config.verl import RULES, VERL_DEFAULTS, VERL_FIXED, VERL_HEADS, Rule, _float, refusal

DEFAULT_PATH = Path(__file__).resolve().parents[2] / "docs" / "verl.md"
COMMAND = "python -m pfppo_mega.config.verl_doc --write docs/verl.md"


def generate_doc() -> str:
    rows = [_row(r) for r in RULES]
    return "\n".join(_intro() + rows + ["", MAPPING, "", LOSSES]) + "\n"


def _intro() -> list[str]:
    """The doc's lines before the table's rows: what the table is, verl's defaults, the table's head."""
    return [
        "# verl's config layout",
        "",
        f"<!-- Generated from pfppo_mega/config/verl/ by `{COMMAND}`.",
        "     Do not edit by hand: tests/test_verl_layout.py fails when this file is out of date. -->",
        "",
        "A config or a launch script's `key=value` overrides written in verl's tree (any of "
        + ", ".join(f"`{h}`" for h in VERL_HEADS) + ") are read through this table: each verl key is",
        "**mapped** onto ours (value converted), **ignored** with the reason printed, or **refused** by name",
        "where accepting it would change the result (a refusal's *ok* values ask for nothing and are",
        "accepted). Keys of `algorithm` and `data` are verl's when listed here, else ours. `pfppo validate`",
        "prints what each key became. The first row that matches a key applies (exact keys first); `*`",
        "is one key segment (or part of one), `**` any tail, `{a, b}` the keys of a subtree verl has (any",
        "other key there is unknown).",
        "",
        "## verl's defaults applied",
        "",
        "Keys a verl config leaves out take verl's default (its `ppo_megatron_trainer.yaml`), as in verl;",
        "one of our keys given explicitly wins.",
        "",
        "| verl key | default |",
        "|---|---|",
        *(f"| `{k}` | `{v!r}` |" for k, v in VERL_DEFAULTS.items()),
        *(f"| (our `{k}`) | `{v!r}`: {why} |" for k, (v, why) in VERL_FIXED.items()),
        "",
        "## The table",
        "",
        "| verl key | becomes | why / notes |",
        "|---|---|---|",
    ]


def _row(r: Rule) -> str:
    """One row of the table: the key pattern, what it becomes, why."""
    if r.action == "map":
        converted = r.convert is not None and r.convert is not _float
        becomes = f"`{r.target}`" + (" (converted)" if converted else "")
        why = r.why or (_first_line(r.convert) if r.convert else "")
    elif r.action == "ignore":
        checked = f" (checked: {_first_line(r.convert).rstrip('.')})" if r.convert else ""
        becomes, why = "ignored" + checked, r.why
    else:
        ok = ", ".join(f"`{o!r}`" for o in r.ok)
        becomes, why = "refused" + (f" unless {ok}" if ok else ""), refusal(r)
    return f"| `{shown(r)}` | {becomes} | {why.replace('|', '/')} |"


# What verl's DAPO recipe, warm-up, truncation and serving keys become (by hand: the code is
# pfppo_mega/trainer/collect.py, trainer/lr_schedule.py and data/files.py; tests named below).
MAPPING = """## Config mapping: DAPO, learning-rate schedule, truncation, serving keys, fp16, rollout correction (issue 36)

Counted over verl's 157 `main_ppo` example and recipe scripts (tests/data, verl b178a3c): 79 loaded
unchanged before these mappings, 112 after them, 114 with `remax`, 115 with `trainer.resume_from_path`
ignored unless `resume_mode` is `resume_path` (verl reads it only then), then 117 with fp16 training,
119 with verl's rollout correction, 121 with `over_sample_rate` read as verl 0.9.1 reads it (not at
all), 122 with chat-template arguments, 123 with `optimal_token_baseline` and 136 with LoRA (the 13
scripts refused only for `lora_rank`, `lora.rank` or `lora_adapter_path`). Read with the multi-turn
config files that 16 scripts name (below), 124 loaded; with code rewards through a SandboxFusion service
(`reward.sandbox_fusion`, below) 125; with multi-turn rollouts (the 15 scripts refused only for
`multi_turn.enable`) 140; with a user's sampler (`data.sampler_path`, below: the two multi-turn curriculum
scripts) **142 of 157 (90.4%)** load unchanged
(`PYTHONPATH=. .venv/bin/python tests/test_verl_layout.py` prints the count). tests/test_verl_layout.py
writes out every refused script with its keys, each refusal's reason and the fix it names. Issue 36's
target, 90% (142 scripts), is reached: the 15 scripts left need features this trainer does not
have, and refusing is the honest answer for each:

| scripts | what they need | the fix the refusal names |
|---|---|---|
| 8 | agent loops, a user's dataset class, a reward manager, the gpt-oss tool-call format (retool 4, langgraph 2, collabllm, minicpmo) | write the rows in verl's columns; write the scoring as `custom_reward_function`; `multi_turn.format: hermes` |
| 2 | MoE router replay | `disabled` (a MoE checkpoint is refused at start) |
| 2 | FAPO's generative reward model (a reward function that queries the model) | drop the function, or mix model and rule scores in our keys |
| 1 each | fp8 training, multi-token prediction, an NPU | remove the fp8 override; remove it; `cuda` |

The count reads each script's overrides after the keys of the config file it names with
`--config-name` where that is not one of verl's two trainer configs: the 16 scripts that name a
multi-turn config (examples/sglang_multiturn/config/*_multiturn_*.yaml, recipe/deepeyes) get its
`rollout.multi_turn.enable: true` (`CONFIG_FILE_KEYS` in tests/test_verl_layout.py). Before this was
read, 12 of them counted as loading (136 of 157); with their config files they were refused until
multi-turn rollouts were built; now all 16 load. "Load" is the config: the two curriculum scripts
name their sampler as `pkg://tests.utils.dataset...`, a module of verl's own test tree, so at start they
stop with SamplerLoadError naming it unless that module is importable; the geo3k and deepeyes scripts
train a vision-language model on image datasets, which this trainer does not read (text only), and
deepeyes' image-zoom tool is refused when its tool file is read at start.

- **multi-turn / tool-calling rollouts** (`rollout.multi_turn.*` -> `actor_rollout.multi_turn.*`;
  pfppo_mega/rollout/multiturn.py, verl 0.9.1's tool agent loop): the policy's turns (mask 1, the
  engine's log-probs) and the tool answers or simulated user's replies between them (mask 0,
  log-prob 0) form one response; `response_length` counts every response token; a tool answer that
  would leave no room for one more policy token ends the row, as verl does; a turn's first
  `max_parallel_calls` calls run, the rest are counted (`rollout/tool_calls_dropped`); tool answers
  are cut by characters with verl's marks; `max_assistant_turns` / `max_user_turns` 0 or null mean no
  limit. GAE skips the mask-0 tokens as verl 0.9.1's `compute_gae_advantage_return` does; REINFORCE++'s discounted
  return skips them too (verl 0.9.1 resets it at every mask-0 token, so there the turns before a tool
  answer get no outcome reward). Differences:
  tool and user turns are rendered with the checkpoint's template against a fixed two-message
  conversation (verl renders the new messages alone and strips the system prompt), plus the
  template's text after the assistant's EOS (Qwen's newline, which verl leaves out); every row's tools
  get `create` with its `create_kwargs` once at the row's start and `release` at its end (verl creates
  and releases an instance per call), so a tool's state lasts the row: the gsm8k / geo3k tools' step
  reward compares a call's score with the row's previous call's (a repeated right answer costs -0.05),
  where verl's fresh instance starts from 0 at every call (a right answer 0.0, a wrong one -0.05); the
  outcome reward sits on the row's last token, always a policy token here (verl's reward manager puts it
  on the last response token, which is the terminating user reply when an interaction ends a row, a
  mask-0 token its GAE then skips); an interaction's final (terminating) reply is not appended;
  `format` other than hermes and `use_inference_chat_template: true` are refused; `num_repeat_rollouts`
  is ignored (verl 0.9.1 reads it nowhere); `data.tool_config_path` must name the rollout's file or be
  unset. Evaluation runs the held-out rows as conversations with the same tools. Refused with it at load:
  `algorithm.async_rl.enable`, `adv_estimator: remax`, the built-in task (prompt files with a chat
  template are needed).

- **Code rewards** (`examples/ppo_trainer/run_deepseek7b_llm_sandbox_fusion.sh`):
  `reward_model.sandbox_fusion.{url,max_concurrent,memory_limit_mb}` -> `reward.sandbox_fusion.*`. As in
  verl's default scorer, a row of data_source codecontests, apps, codeforces or taco is scored by running
  the response's code (its last ```` ```python ```` block, else its first fenced block) on the row's test
  cases (the ground truth `{inputs, outputs}`, also `fn_name` and `assert_case`) through the service's
  run_code API, score = the passed fraction of the first 10 cases (verl's `continuous=True`); 10 s per
  case (`reward.sandbox_fusion.case_timeout_s`). Differences: a service failure (unreachable, HTTP error,
  its SandboxError, no answer in time) is counted in `guard/reward_errors` and logged, where verl scores
  the case as failed; HTTP 502 and 503 are retried besides 504; only the 10 scored cases are run (verl
  runs all and reads 10: the score is the same); a row whose ground truth holds no test cases is refused
  at start. Ignored with `custom_reward_function.path`, as verl ignores it. Without a url, verl runs the
  code locally (prime_code); here a code row is then refused at start (set the url, `reward.default_scorer`
  or a custom function). rewards/sandbox_fusion.py; docs/multiturn_tools.md.
- **fp16 training** (`recipe/dapo/*_fp16.sh`): `actor.megatron.dtype=float16` ->
  `model.params_dtype: float16`: megatron's Float16Module and its mixed-precision optimizer (fp32 main
  weights, gradients and Adam states) with the dynamic loss scaler (`model.loss_scale` null,
  `initial_loss_scale` 2^32, `min_loss_scale` 1, `loss_scale_window` 1000, `loss_scale_hysteresis` 2:
  megatron-core's defaults, which verl's megatron optimizer keeps). The loss is multiplied by the scale
  before the backward; a step whose gradients hold an inf or NaN is skipped (no weight or moment
  changes), counted in `guard/loss_scale_overflows` and `guard/skipped_updates`, and lowers the scale
  (`policy/loss_scale`, `critic/loss_scale`); such skips do not count towards
  `training.max_consecutive_skipped_updates` until the scale is at its minimum. The scaler's state is in
  the checkpoint. `rollout.dtype=float16` -> `actor_rollout.dtype: float16` (vLLM's `dtype`, the
  built-in engine's weights). The fused LM head hands its fp16 logits to the float32 kernels, as
  Float16Module does for megatron's head. The memory ledger counts fp16 as bf16 (2-byte weights,
  fp32 grads, main weights and moments). tests/test_fp16.py (a run trains; an injected inf gradient
  skips the step and halves the scale; resume restores the scaler). fp8 stays refused.
- **Rollout correction** (`examples/rollout_correction/*`, verl 0.9.1's bypass mode):
  `algorithm.rollout_correction.*` keeps verl's names (`rollout_is` token / sequence,
  `rollout_is_threshold` a number (TIS) or `'lower_upper'` (IcePop) -> `rollout_is_threshold` /
  `rollout_is_threshold_lower`, `rollout_is_batch_normalize`, `rollout_rs` comma-separated ->
  a list, `rollout_rs_threshold` -> `rollout_rs_upper` / `rollout_rs_lower` per criterion, a k1
  criterion's single `u` meaning `[1/u, u]`, `loss_type` ppo_clip / reinforce); `bypass_mode=true` ->
  `algorithm.recompute_old_logp: false`. In the loss, with delta = log pi_theta - log pi_rollout: the
  rejection criteria (token / seq_sum / seq_mean / seq_max of k1 = -delta, k2 = delta^2/2, k3 = e^delta
  - 1 - delta) drop tokens or rows from the aggregate (its denominator stays the step's token / row
  count, as verl's global batch counts); `ppo_clip` trains the clipped surrogate on pi_theta /
  pi_rollout without IS weights (verl: the ratio is the correction), `reinforce` -w A log pi_theta
  with the truncated weights (pfppo_mega/ppo/rollout_correction.py; tests/test_rollout_correction.py
  checks every criterion and weight against its formula). Difference: `rollout_is_batch_normalize`
  divides by the mean over this rank's micro-batch; verl all-reduces that mean over the data-parallel
  ranks in its loss (equal at DP = 1). verl's decoupled mode (`bypass_mode=false` with rollout_is /
  rollout_rs / reinforce: weights from recomputed old log-probs) is refused with that fix.
- **`rollout.over_sample_rate`**: verl 0.9.1 declares it (abort the last fraction of a batch's
  requests) in its RolloutConfig and no code of the release reads it, so it is ignored here too, with
  that reason; a value outside [0, 1) is still named.
- **Chat-template arguments**: `data.apply_chat_template_kwargs.NAME=value` ->
  `data.chat_template_kwargs: ['NAME=<JSON value>']`, passed to the checkpoint's template as
  transformers' `apply_chat_template(**kwargs)` passes them (`reasoning_effort`, `enable_thinking`;
  tests/test_chat_template_kwargs.py renders against transformers).
- **`optimal_token_baseline`** (verl 0.9.1's OTB): A_t = G_t - B_t with, per prompt group and
  position, B_t = sum_i G_t W_t / (sum_i W_t + 1e-8), W_t the running sum of 1 - 2 pi_t + sum_v
  pi(v)^2 (old log-probs); a group of one has no baseline; a group's strictly longest row has B = 0
  past the second-longest length. The prepare pass computes sum_v pi(v)^2 with one more actor forward
  through megatron's head (verl's `calculate_sum_pi_squared`, needed there, is implied here); no
  rollout IS weights in W (verl applies them only in its decoupled correction mode, refused here).
  tests/test_optimal_token_baseline.py.

- **LoRA** (`model.lora`, pfppo_mega/models/lora.py): verl's FSDP keys (`model.lora_rank`, `lora_alpha`,
  `target_modules`, `exclude_modules`, `lora_adapter_path`) and its megatron ones (`model.lora.rank`,
  `alpha`, `target_modules`, `exclude_modules`, `adapter_path`, `lora_A_init_method`, `dropout`) map onto
  it; a rank > 0 takes the alpha of its own spelling when the script leaves it out (16 for `lora_alpha`,
  32 for `lora.alpha`, and `lora.lora_A_init_method`'s xavier), and the other settings of a spelling whose
  rank is 0 are ignored (verl's composed config holds both spellings' defaults). As verl: base weights
  frozen, B = 0 at step 0, scale alpha / rank, the reference policy is the base with the adapters off (no
  second copy), the engines get merged weights. Differences: a fused megatron linear (q/k/v, gate/up)
  takes one adapter, so a subset of its projections (`[q_proj, v_proj]`) is refused by name, and a PEFT
  adapter whose q/k/v parts have different `lora_A` is refused at load (merge it into the base instead);
  adapter dropout only 0; `lora.type` dora / canonical_lora, non-zero B init and an adapter dtype of its
  own are refused; the critic takes no LoRA (`critic.model.lora_rank` stays refused).
- **Dynamic sampling** (`data.gen_batch_size` > `data.train_batch_size`, with
  `algorithm.filter_groups.enable`): `algorithm.filter_groups.gen_batch_size`. Each round generates
  that many prompts; groups whose rewards all agree are dropped; the first `train_batch_size` kept
  groups are trained on, as verl's DAPO trainer. Differences: still short after
  `max_num_gen_batches` rounds, verl stops the run, here the batch is filled with agreeing groups
  (`dapo/filled_groups`). `gen_batch_size` > `train_batch_size` without `filter_groups.enable`
  (verl's DAPO trainer then trains on all of them) and `gen_batch_size` < `train_batch_size` are
  refused with the fix. tests/test_verl_dapo.py runs a DAPO-shaped verl config on the CPU.
- **Overlong buffer**: `reward_model.overlong_buffer.{enable,len,penalty_factor}` (recipe/dapo's
  `dapo_trainer.yaml`) and `reward_model.reward_kwargs.overlong_buffer_cfg.*` (the examples) both
  become `reward.overlong_buffer.*`; both spellings with different values are an error.
- **Learning rate** (verl 0.9.1, `verl/utils/torch_functional.py`): `optim.lr_warmup_steps` ->
  `training.lr_warmup_steps`; `-1` with `lr_warmup_steps_ratio` -> `training.lr_warmup_ratio`
  (W = int(ratio x total_training_steps)); `lr_scheduler_type` / `warmup_style` (FSDP) and
  `lr_decay_style` (megatron) constant or cosine -> `training.lr_schedule`; `min_lr_ratio` (or
  megatron's `min_lr` / `optim.lr`) -> `training.min_lr_ratio`. The k-th update of an optimizer
  runs at lr x k / W during the warm-up (the first at 0, as verl), then lr (constant) or
  `r + (1 - r) x 0.5 x (1 + cos(pi (k - W) / (N - W)))` x lr (cosine). The critic has its own
  warm-up fraction (`critic.optim.lr_warmup_steps_ratio` -> `training.critic_lr_warmup_ratio`;
  verl's default 0 when only the actor's steps are set); the rest of the schedule is shared, and a
  `critic.optim` key that differs from the actor's (steps, schedule, floor) is refused. The actor
  counts its updates from the first one after `critic_warmup_steps`, as verl steps its scheduler
  only when it updates. Linear, inverse-square-root and WSD decay, `lr_warmup_init` != 0,
  `num_cycles` != 0.5 and an `lr_decay_steps` other than the run's steps are refused.
  tests/test_lr_schedule.py checks the lr of every step against the formula.
- **Truncation**: `data.truncation` error / left / right / middle -> `data.overlong_prompts` of the
  same name: after the chat template, left keeps the last `max_prompt_length` tokens, right the
  first, middle the first `max_prompt_length // 2` and the rest from the end (verl's
  `postprocess_data`); `data.filter_overlong_prompts=True` drops them first, as verl.
  tests/test_truncation.py.
- **Serving keys**: `rollout.dtype` -> `actor_rollout.dtype`,
  `rollout.enforce_eager` -> `actor_rollout.enforce_eager`, `rollout.max_num_seqs` ->
  `actor_rollout.max_num_seqs`.
- **Reward model**: `reward_model.enable` maps to `reward.model_path` with `reward.rule_weight = 0`
  (the model's score alone) on verl's legacy path and in its reward loop without a
  `custom_reward_function` (verl's RewardLoopWorker scores with the discriminative model alone
  there). With a `custom_reward_function` the user's function computes the reward and may query the
  model through verl's reward router (FAPO's generative RM): refused, naming the fixes (drop the
  function, or mix the scores in `reward.model_path` / `model_weight` / `rule_weight`).
- **A user's sampler**: `data.sampler.class_path` + `class_name` -> `data.sampler_path` +
  `data.sampler_class` (a module, `pkg://a.b.c`, or a `.py` file), built as verl builds it,
  `cls(data_source=rows, data_config=...)`; `data_source[i]` is a dict (prompt_ids, prompt_text,
  data_source, ground_truth, extra_info, row), `data_config` our data section plus `seed`. Its
  indices decide the rows of each step (on every data-parallel rank the same: its global random
  draws come from private streams seeded by `training.seed`). A curriculum's `update(batch)` gets,
  after each step, a dict, not verl's DataProto: `index` [B] (the rows' indices in data_source),
  `score` [B] (the verifier's), `reward` [B] (trained on), `data_source`, `row`, `step`; B is every
  response of the step on every rank, before policy filtration. Resume is exact: its
  `state_dict()` is checkpointed, a sampler without one is replayed from its seed, and a
  curriculum without one is refused at resume (`SamplerResumeError`, warned at start). A bad path,
  a class that is not a torch Sampler, an index out of range, a pass that yields nothing: named
  errors (tests/adversarial/test_adv_sampler.py, tests/test_sampler.py)."""


# The loss math against verl's release (written by hand: the formulas live in pfppo_mega/ppo and
# pfppo_mega/trainer/policy_loss.py; tests/test_verl091_losses.py checks them against verl 0.9.1's).
LOSSES = """## Losses: verl 0.9.1, and every difference

The aggregation (`algorithm.loss_agg_mode`, `pfppo_mega.ppo.agg_loss`) follows verl 0.9.1's
`agg_loss` (`verl/trainer/ppo/core_algos.py`), over the optimizer step's mini-batch (all its
micro-batches on all data-parallel ranks):

- `token-mean`: the token sum over the step's tokens.
- `seq-mean-token-sum`, `seq-mean-token-mean`: the mean over the step's rows with a token.
- `seq-mean-token-sum-norm` (Dr.GRPO): verl 0.9.1 computes, per rank,
  `sum_rows(sum_t loss*mask) / global_batch_size * dp_size / loss_scale_factor`, and DDP averages the
  ranks: the step minimises `sum over the step's rows of sum_t loss*mask / (global_batch_size *
  loss_scale_factor)`. Here `global_batch_size` = the step's rows with a token (over all ranks), and
  `loss_scale_factor` = `algorithm.loss_scale_factor`, else `algorithm.max_response_length` (verl's
  default is T, the padded response length; the trainer passes the constant). Before verl 0.9.1
  (and here before issue 36) there was no `1 / global_batch_size`: the loss and the gradient norm were
  the step's rows times verl 0.9.1's, and `training.grad_clip` bound where verl's would not.

Each micro-batch returns its share of the step's aggregate (`models/passes.py`, `share_scale`: its
tokens or rows over the step's), so the micro-batch size, token-budget micro-batching and the DP
degree change only the order of floating-point sums (`tests/test_verl091_losses.py`). The KL loss,
the entropy bonus and the critic's value loss use the same mode and rule.

Policy losses (`algorithm.policy_loss`, verl's names), each read against verl 0.9.1's
`core_algos.py` (the PyPI wheel, `verl/trainer/ppo/core_algos.py`; facts only, no code taken):

| loss | follows | aggregation | token log-ratio |
|---|---|---|---|
| `ppo_clip` (verl's `vanilla`) | 0.9.1: clipped surrogate, dual clip `clip_ratio_c` (3) for A < 0 | `loss_agg_mode` | clamped +-20, as verl |
| `gspo` | 0.9.1: sequence ratio `exp(mean_t log r)`, `log s <= 10` | `loss_agg_mode` (verl's default `token-mean`) | not clamped, as verl |
| `cispo` | 0.9.1: `-sg[clip(r, 1 - eps_low, 1 + eps_high)] A logp` | `loss_agg_mode` | clamped +-20, as verl |
| `sapo` | 0.9.1: `-sigmoid(tau (r - 1)) 4 / tau A`, `tau_pos` (1.0) where A > 0 else `tau_neg` (1.05) | `seq-mean-token-mean` always, as verl | clamped +-20, as verl |
| `gpg` | 0.9.1: `-logp A` | `loss_agg_mode` | (no ratio) |
| `clip_cov` | 0.9.1: clipped surrogate; `max(1, int(clip_cov_ratio x tokens))` random tokens with covariance in (`clip_cov_lb`, `clip_cov_ub`), not clipped, cut | `loss_agg_mode` | clamped +-20 (verl: none) |
| `kl_cov` | 0.9.1: `-A r`, plus `ppo_kl_coef |log r|` on the `max(1, int(kl_cov_ratio x tokens))` tokens of largest covariance | `loss_agg_mode` | clamped +-20 (verl: none) |
| `geo_mean` | 0.9.1: row ratio `exp(mean_t sgn(A) min(sgn(A) log r, sgn(A) clip(log r, -eps_low, eps_high)))`, `-mean_t(A) R`, IS weights by their geometric mean | mean over the step's rows with a token (verl: `torch.mean` over the micro-batch's rows) | clamped +-20 (verl: none) |

CISPO accepts verl's canonical `clip_ratio_low = 10` (any value > 0: the lower bound `1 - eps_low`
binds only below it; every other loss keeps `0 < clip_ratio_low < 1`). verl 0.9.1's other losses
(`dppo_tv`, `dppo_kl`, `dro`), its `token-sum` aggregation and its estimators without a counterpart
here (`tir_optimal_token_baseline`, `gdpo`) are refused by name with the
list of ours; `rloo_vectorized` and `grpo_vectorized` are verl's vectorised `rloo` / `grpo` (the same
values). `tests/test_pg_variants.py` and `tests/test_verl091_losses.py` check each formula against a
reference written in the test; `tests/test_grpo_e2e.py` checks every loss the update computes in a
3-step run against a token-by-token reference.

Remaining differences from verl 0.9.1, each with its reason:

- `global_batch_size` counts the step's rows with a token (verl's `agg_loss` default); verl's trainer
  passes `ppo_mini_batch_size * n`, which also counts rows with no token. Every generated response
  has a token, so the two differ only when PF-PPO's `pool.is_mode: mask` drops every token of a row
  (that row then leaves the denominator here). The same holds for the `seq-mean-*` modes.
- `clip_cov`, `kl_cov` and `geo_mean` clamp the token log-ratio to +-20 (`LOG_RATIO_LIMIT`) before
  `exp`, as verl's `vanilla`, `cispo` and `sapo` do and these three do not: `exp` of a log-ratio
  above about 88 overflows float32 (a behaviour-sampled token far less likely under the current
  policy, PF-PPO's mixed snapshots), and an inf ratio turns the loss and every gradient into NaN. The
  gradient is 0 beyond the clamp; the results differ only where a ratio exceeds e^20 (or falls below
  e^-20), where verl's would be inf or NaN, or near 0.
- `geo_mean` averages over the step's rows with a token; verl 0.9.1 takes `torch.mean` over each
  micro-batch's rows, empty ones included, without its global-batch normalisation, so there the
  loss's scale depends on the micro-batch split and on empty rows. Here the micro-batch size changes
  only the order of sums, as for every other loss.
- `clip_cov` draws its cut tokens with the trainer's seeded generator (verl: torch's global one), so
  the choice is reproducible here but not the same tokens as verl's.
"""


def shown(rule: Rule) -> str:
    """The key pattern of a row; a closed subtree lists its keys: `prefix.{a, b}`."""
    if not rule.keys:
        return rule.pattern
    return f"{rule.pattern.removesuffix('.**')}.{{{', '.join(rule.keys)}}}"


def _first_line(fn: Callable) -> str:
    return " ".join((fn.__doc__ or "").strip().split("\n\n")[0].split())


def main(argv: Sequence[str] | None = None) -> int:
    return write_or_check(argv, prog="python -m pfppo_mega.config.verl_doc", description="Generate or check docs/verl.md.",
                          generate=generate_doc, default_path=DEFAULT_PATH, source="pfppo_mega/config/verl/",
                          command=COMMAND)


if __name__ == "__main__":
    sys.exit(main())
