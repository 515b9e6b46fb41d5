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
from pfppo_mega.config.verl import RULES, VERL_DEFAULTS, VERL_FIXED, VERL_HEADS, Rule, _float

DEFAULT_PATH = Path(__file__).resolve().parents[2] / "docs" / "verl.md"
COMMAND = "python -m pfppo_mega.config.verl_doc --write docs/verl.md"


def generate_doc() -> str:
    lines = [
        "# verl's config layout",
        "",
        f"<!-- Generated from pfppo_mega/config/verl.py by `{COMMAND}`.",
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
    for r in RULES:
        if r.action == "map":
            converted = r.convert is not None and r.convert is not _float
            becomes = f"`{r.target}`" + (" (converted)" if converted else "")
            why = r.why or (_first_line(r.convert) if r.convert else "")
        elif r.action == "ignore":
            becomes, why = "ignored", r.why
        else:
            ok = ", ".join(f"`{o!r}`" for o in r.ok)
            becomes, why = "refused" + (f" unless {ok}" if ok else ""), r.why
        lines.append(f"| `{shown(r)}` | {becomes} | {why.replace('|', '/')} |")
    return "\n".join(lines + ["", MAPPING, "", LOSSES]) + "\n"


# What verl's DAPO recipe, warm-up, truncation and serving keys become (by hand: the code is
# pfppo_mega/trainer/collect.py, trainer/lr_schedule.py and data/files.py; tests named below).
MAPPING = """## Config mapping: DAPO, learning-rate schedule, truncation, serving keys (issue 36)

Counted over verl's 157 `main_ppo` example and recipe scripts (tests/data): 79 loaded unchanged
before these mappings, 112 after; tests/test_verl_layout.py writes out every refused script with
its keys, and each refusal's reason.

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
- **Serving keys**: `rollout.dtype` -> `actor_rollout.dtype` (float16 refused),
  `rollout.enforce_eager` -> `actor_rollout.enforce_eager`, `rollout.max_num_seqs` ->
  `actor_rollout.max_num_seqs`.
- **Reward model**: `reward_model.enable` maps to `reward.model_path` with `reward.rule_weight = 0`
  (the model's score alone) on verl's legacy path and in its reward loop without a
  `custom_reward_function` (verl's RewardLoopWorker scores with the discriminative model alone
  there). With a `custom_reward_function` the user's function computes the reward and may query the
  model through verl's reward router (FAPO's generative RM): refused, naming the fixes (drop the
  function, or mix the scores in `reward.model_path` / `model_weight` / `rule_weight`)."""


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

Policy losses (`algorithm.policy_loss`, verl's names): `gspo` follows verl 0.9.1: the sequence ratio
`exp(mean_t log r)`, clamped at `log s <= 10` as verl, aggregated with `loss_agg_mode` (verl's
default `token-mean`). Its token log-ratios are not clamped (as verl): only the clamped sequence
log-ratio is exponentiated, and a very negative one underflows to 0 with a finite gradient, so no
overflow is possible. CISPO accepts verl's canonical `clip_ratio_low = 10` (any value > 0: the lower
bound `1 - eps_low` binds only below it; every other loss keeps `0 < clip_ratio_low < 1`).

Remaining differences from verl 0.9.1, each with its reason:

- `global_batch_size` counts the step's rows with a token (verl's `agg_loss` default); verl's trainer
  passes `ppo_mini_batch_size * n`, which also counts rows with no token. Every generated response
  has a token, so the two differ only when PF-PPO's `pool.is_mode: mask` drops every token of a row
  (that row then leaves the denominator here). The same holds for the `seq-mean-*` modes.
- The token log-ratio is clamped to +-20 (`LOG_RATIO_LIMIT`) before `exp` in `ppo_clip` (as verl's
  vanilla loss), `cispo`, `sapo`, `clip_cov`, `kl_cov` and `geo_mean`: `exp` of a log-ratio
  above about 88 overflows float32 (a behaviour-sampled token far less likely under the current
  policy, PF-PPO's mixed snapshots), and an inf ratio turns the loss and every gradient into NaN. The
  gradient is 0 beyond the clamp. verl leaves `clip_cov`, `kl_cov` and `geo_mean` unclamped (for
  `cispo` and `sapo` not re-checked against 0.9.1); the results differ only where a ratio exceeds
  e^20 (or falls below e^-20), where verl's would be inf or NaN, or near 0.
- `geo_mean` averages over the rows with a token (verl's `torch.mean` also counts empty rows).
- `sapo` and `geo_mean` aggregate `seq-mean-token-mean` whatever `loss_agg_mode`; these and `gpg`,
  `cispo`, `clip_cov`, `kl_cov` follow the verl snapshot they were written from (b178a3c); only GSPO
  and the aggregation were re-checked against verl 0.9.1 (from issue 36's reading of its
  `core_algos.py`; verl's source is not vendored here).
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
                          generate=generate_doc, default_path=DEFAULT_PATH, source="pfppo_mega/config/verl.py",
                          command=COMMAND)


if __name__ == "__main__":
    sys.exit(main())
