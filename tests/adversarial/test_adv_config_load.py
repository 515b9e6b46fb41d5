"""Bad configs, overrides, config files and command lines: each gets a named error (the key or
file, the value, the rule) within a bounded time, never a traceback, a hang or a silent load.

Table-driven. ``outcome(case)`` runs one case in this process under a wall-clock alarm and
classifies what happens:

    named      a ConfigError (or exit status 2 of a command) whose message contains every
               expected fragment (the key or file, and where asked the value)
    vague      a ConfigError / exit 2 that does not name the problem
    traceback  any other exception (or another exit status)
    hang       still running when the alarm fires
    silent     the config loads (for the `accept` cases: loads but means something else)
    ok         an `accept` case that loads and means what it says

The tests assert `named` (or `ok`), the rule's fragment, and the time. Every float key of the
tree is tried with inf, -inf, nan and 1e400, every int key with +-10^30 (read from the tree, so
a new key is covered without editing this file).

`python tests/adversarial/test_adv_config_load.py [--timeout S]` prints the count per class and
group (the before / after figures of issue 8; run it with PYTHONPATH pointing at an older tree
for the "before" column). Only the public config API and `pfppo_mega.cli.main` are used.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import signal
import sys
import time
import typing
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest

from pfppo_mega.config import Config, ConfigError, load_config_dict, resolve_config

CASE_SECONDS = 3.0  # every case, on a loaded 2-core machine; most take a millisecond
BASE = {"actor_rollout": {"model_path": "/nonexistent/model"}}  # the smallest config that loads
BASE_YAML = "actor_rollout:\n  model_path: /nonexistent/model\n"


class Hang(Exception):
    pass


@dataclass(frozen=True)
class Case:
    id: str
    group: str
    run: Callable[[Path], Any]  # raises, exits, or returns the loaded Config
    expect: tuple[str, ...] = ()  # fragments of the message that make it a named error
    rule: str = ""  # a fragment of the rule, asserted by the tests
    accept: Callable[[Config], bool] | None = None  # the case must load and satisfy this


# ----------------------------------------------------------------------------- runners


def from_file(data: bytes | str, overrides: tuple[str, ...] = ()) -> Callable[[Path], Any]:
    def run(tmp: Path) -> Any:
        path = tmp / "config.yaml"
        path.write_bytes(data.encode() if isinstance(data, str) else data)
        return resolve_config(path, list(overrides)).config
    return run


def from_path(make: Callable[[Path], Path]) -> Callable[[Path], Any]:
    return lambda tmp: resolve_config(make(tmp), []).config


def from_overrides(*overrides: str, base: dict | None = None) -> Callable[[Path], Any]:
    return lambda tmp: load_config_dict(base if base is not None else BASE, list(overrides))


def from_cli(*argv: str | Callable[[Path], str]) -> Callable[[Path], Any]:
    """`pfppo ARGV` in this process; an argument may be a function of the case's tmp dir."""
    def run(tmp: Path) -> Any:
        from pfppo_mega.cli import main

        args = [a(tmp) if callable(a) else a for a in argv]
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                rc = main(args)
            except SystemExit as e:
                rc = e.code
        raise CommandExit(rc, err.getvalue())
    return run


class CommandExit(Exception):
    def __init__(self, rc: Any, stderr: str):
        super().__init__(f"exit {rc}: {stderr}")
        self.rc, self.stderr = rc, stderr


def write(name: str, data: bytes | str) -> Callable[[Path], str]:
    def make(tmp: Path) -> str:
        path = tmp / name
        path.write_bytes(data.encode() if isinstance(data, str) else data)
        return str(path)
    return make


def a_dir(tmp: Path) -> str:
    (tmp / "cfgdir").mkdir(exist_ok=True)
    return str(tmp / "cfgdir")


def a_file(tmp: Path) -> str:
    (tmp / "taken").write_text("not a directory\n")
    return str(tmp / "taken")


# ----------------------------------------------------------------------------- hostile YAML


def alias_bomb(levels: int, width: int = 10) -> str:
    """The 'billion laughs': level i is a list of `width` aliases of level i-1 (width^levels
    leaves); 8 levels are 294 bytes, 9 are 332."""
    names = "abcdefghijklmnopqrstuvwxyz"
    lines = [f"a: &a [{','.join(['x'] * width)}]"]
    for i in range(1, levels):
        lines.append(f"{names[i]}: &{names[i]} [{','.join(['*' + names[i - 1]] * width)}]")
    return "\n".join(lines) + "\n"


def doubling_bomb(levels: int) -> str:
    lines = ["d0: &d0 [x, x]"] + [f"d{i}: &d{i} [*d{i - 1}, *d{i - 1}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def merge_bomb(levels: int) -> str:
    lines = ["m0: &m0 {k0: 1, k1: 2, k2: 3}"]
    for i in range(1, levels):
        lines.append(f"m{i}: &m{i} {{<<: [" + ", ".join([f"*m{i - 1}"] * 8) + f"], k{i + 2}: 0}}")
    return "\n".join(lines) + "\n"


def deep_block(depth: int) -> str:
    return "".join(" " * i + f"k{i}:\n" for i in range(depth)) + " " * depth + "v\n"


DEEP = 5000
BOMB_294 = alias_bomb(8)  # 10^8 leaves
BOMB_332 = alias_bomb(9)  # 10^9 leaves
assert (len(BOMB_294), len(BOMB_332)) == (294, 332), (len(BOMB_294), len(BOMB_332))
FLOW_BOMB = "[" + ", ".join(["&a [" + ", ".join(["x"] * 10) + "]"]
                            + ["&b [" + ", ".join(["*a"] * 10) + "]"]
                            + ["&c [" + ", ".join(["*b"] * 10) + "]"]
                            + ["&d [" + ", ".join(["*c"] * 10) + "]"]
                            + ["&e [" + ", ".join(["*d"] * 10) + "]"]
                            + ["&f [" + ", ".join(["*e"] * 10) + "]"]) + "]"
PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x01" + bytes(range(256))

FILE_CASES = [
    Case("missing_file", "file", from_path(lambda t: t / "nope.yaml"), ("nope.yaml", "no such file")),
    Case("directory", "file", from_path(lambda t: Path(a_dir(t))), ("cfgdir", "directory")),
    Case("binary_png", "file", from_file(PNG), ("config.yaml", "binary")),
    Case("latin1_text", "file", from_file(BASE_YAML.encode() + b"# caf\xe9\n"), ("config.yaml", "UTF-8")),
    Case("utf16_text", "file", from_file(BASE_YAML.encode("utf-16")), ("config.yaml",), "binary"),
    Case("too_large", "file", from_file(BASE_YAML + "#" * (2 << 20) + "\n"), ("config.yaml", "larger than")),
    Case("nul_in_comment", "file", from_file(BASE_YAML + "# a\x00b\n"), ("config.yaml", "NUL")),
    Case("bell_control_char", "file", from_file(BASE_YAML + "logging:\n  output_dir: a\x07b\n"),
         ("config.yaml", "YAML")),
    Case("syntax_error", "yaml", from_file("training: [1, 2\n"), ("config.yaml", "not valid YAML")),
    Case("tab_indent", "yaml", from_file("training:\n\tlr: 1\n"), ("config.yaml", "not valid YAML")),
    Case("top_level_list", "yaml", from_file("- a\n- b\n"), ("top level",), "mapping"),
    Case("top_level_scalar", "yaml", from_file("hello\n"), ("top level",), "mapping"),
    Case("two_documents", "yaml", from_file(BASE_YAML + "---\ntraining: {lr: 1}\n"),
         ("config.yaml", "single document")),
    Case("duplicate_key", "yaml", from_file(BASE_YAML + "training:\n  lr: 1.0e-6\n  lr: 1.0e-5\n"),
         ("training.lr", "twice")),
    Case("python_object_tag", "yaml",
         from_file(BASE_YAML + "training: !!python/object/apply:os.system ['echo pwned']\n"),
         ("config.yaml", "python/object")),
    Case("undefined_alias", "yaml", from_file(BASE_YAML + "training: *nowhere\n"),
         ("config.yaml", "undefined alias")),
    Case("self_alias", "yaml", from_file("a: &x [*x]\n"), ("config.yaml",), "alias"),
    Case("alias_bomb_294_bytes", "yaml", from_file(BOMB_294), ("config.yaml", "billion laughs")),
    Case("alias_bomb_332_bytes", "yaml", from_file(BOMB_332), ("config.yaml", "billion laughs")),
    Case("alias_bomb_doubling_60", "yaml", from_file(doubling_bomb(60)), ("config.yaml", "billion laughs")),
    Case("alias_bomb_merge_keys", "yaml", from_file(merge_bomb(12)), ("config.yaml", "billion laughs")),
    Case("alias_bomb_in_section", "yaml", from_file(BASE_YAML + "training:\n  lr: " + FLOW_BOMB + "\n"),
         ("config.yaml", "billion laughs")),
    Case("unknown_keys_300", "yaml", from_file("".join(f"k{i}: 1\n" for i in range(300))),
         ("k299",), "unknown key"),
    Case("too_many_keys_3000", "yaml", from_file("".join(f"k{i}: 1\n" for i in range(3000))),
         ("config.yaml", "more than 2000")),
    Case("deep_flow_mapping_5000", "yaml", from_file("{a: " * DEEP + "1" + "}" * DEEP),
         ("config.yaml", "deep")),
    Case("deep_flow_list_5000", "yaml", from_file("[" * DEEP + "]" * DEEP), ("config.yaml", "deep")),
    Case("deep_block_mapping_200", "yaml", from_file(deep_block(200)), ("config.yaml", "deep")),
    Case("deep_in_section_40", "yaml", from_file("training:\n  lr: " + "[" * 40 + "]" * 40 + "\n"),
         ("config.yaml", "deep")),
    Case("int_of_5000_digits", "yaml", from_file(BASE_YAML + "training:\n  seed: " + "9" * 5000 + "\n"),
         ("config.yaml",), "digits"),
    Case("float_of_400_digits", "yaml", from_file(BASE_YAML + "training:\n  lr: " + "9" * 400 + "\n"),
         ("training.lr",), "finite"),
    Case("unhashable_key", "yaml", from_file("? [a, b]\n: 1\n"), ("config.yaml",), "unhashable"),
    Case("int_key", "yaml", from_file(BASE_YAML + "1: 2\n"), ("1",), "keys must be strings"),
    Case("binary_tag_value", "yaml", from_file(BASE_YAML + "training:\n  lr: !!binary aGVsbG8=\n"),
         ("training.lr",), "expected float"),
    Case("timestamp_output_dir", "yaml", from_file(BASE_YAML + "logging:\n  output_dir: 2024-01-01\n"),
         ("logging.output_dir",), "expected str"),
    Case("set_as_section", "yaml", from_file(BASE_YAML + "training: !!set {a, b}\n"),
         ("training",), "mapping"),
    Case("list_as_section", "yaml", from_file(BASE_YAML + "training: [1, 2]\n"), ("training",), "mapping"),
    Case("inf_in_file", "yaml", from_file(BASE_YAML + "training:\n  lr: .inf\n"), ("training.lr",), "finite"),
    Case("1e400_in_file", "yaml", from_file(BASE_YAML + "algorithm:\n  kl_coeff: 1.0e+400\n"),
         ("algorithm.kl_coeff",), "finite"),
    Case("nan_in_file", "yaml", from_file(BASE_YAML + "algorithm:\n  lmbda: .nan\n"),
         ("algorithm.lmbda",), "finite"),
]

OVERRIDE_CASES = [
    Case("two_spellings_lam_lmbda", "override", from_overrides("algorithm.lam=0.5", "algorithm.lmbda=0.9"),
         ("algorithm.lmbda", "algorithm.lam"), "conflicts"),
    Case("two_spellings_kl_coef", "override",
         from_overrides("algorithm.kl_coef=0.1", "algorithm.kl_loss_coef=0.2"),
         ("algorithm.kl_loss_coef", "algorithm.kl_coef"), "conflicts"),
    Case("two_spellings_actor_lr", "override", from_overrides("training.actor_lr=1e-5", "training.lr=1e-4"),
         ("training.lr", "training.actor_lr"), "conflicts"),
    Case("two_spellings_in_file_and_overrides", "override",
         from_file(BASE_YAML, ("training.train_batch_size=8", "training.rollout_batch_size=16")),
         ("training.rollout_batch_size", "training.train_batch_size"), "conflicts"),
    Case("same_spelling_twice_last_wins", "override",
         from_overrides("training.lr=1e-5", "training.lr=1e-4"),
         accept=lambda c: c.training.lr == 1e-4),
    Case("two_spellings_same_value", "override",
         from_overrides("algorithm.lam=0.5", "algorithm.lmbda=0.5"),
         accept=lambda c: c.algorithm.lmbda == 0.5),
    Case("no_equals", "override", from_overrides("training.lr"), ("training.lr",), "key.path=value"),
    Case("unknown_key", "override", from_overrides("training.lrr=1"), ("training.lrr",), "did you mean"),
    Case("into_a_scalar", "override", from_overrides("training.lr.x=1"), ("training.lr.x",), "not a section"),
    Case("bad_yaml_value", "override", from_overrides("training.lr=[1, "), ("training.lr",), "not valid YAML"),
    Case("alias_bomb_value", "override", from_overrides("training.lr=" + FLOW_BOMB),
         ("training.lr",), "billion laughs"),
    Case("deep_value_5000", "override", from_overrides("training.lr=" + "[" * DEEP + "]" * DEEP),
         ("training.lr",), "deep"),
    Case("eval_size_10^12", "override", from_overrides("data.eval_size=1000000000000"),
         ("data.eval_size", "1000000000000"), "<= 100000"),
    Case("hex_lr_16", "override", from_overrides("training.lr=0x10"), ("training.lr", "16"), "<= 1"),
    Case("negative_seed", "override", from_overrides("training.seed=-1"), ("training.seed",), ">= 0"),
    Case("empty_output_dir", "override", from_overrides("logging.output_dir=''"),
         ("logging.output_dir",), "must name a directory"),
    Case("blank_sft_output_dir", "override", from_overrides("sft.output_dir='  '"),
         ("sft.output_dir",), "must name a directory"),
    Case("null_output_dir", "override", from_overrides("logging.output_dir=null"),
         ("logging.output_dir",), "null"),
    Case("bool_for_int", "override", from_overrides("training.batch_size=true"),
         ("training.batch_size",), "expected int"),
    Case("section_replaced_by_scalar", "override", from_overrides("training=3"), ("training",), "mapping"),
    Case("critic_warmup_covers_run", "override",
         from_overrides("training.critic_warmup_steps=3", "training.total_training_steps=2"),
         ("training.critic_warmup_steps = 3", "training.total_training_steps (verl: trainer.total_training_steps) = 2"),
         "the policy would never change"),
    Case("critic_warmup_short_of_run", "override",
         from_overrides("training.critic_warmup_steps=3", "training.total_training_steps=4"),
         accept=lambda c: c.training.critic_warmup_steps == 3),
]

# verl's norm_adv_by_std_in_grpo concerns GRPO only: it must not switch PPO whitening.
VERL_CASES = [
    Case("verl_grpo_std_false_in_file", "verl",
         from_file(BASE_YAML + "algorithm:\n  norm_adv_by_std_in_grpo: false\n"),
         accept=lambda c: c.algorithm.whiten_advantages is True),
    Case("verl_grpo_std_false_override", "verl", from_overrides("algorithm.norm_adv_by_std_in_grpo=false"),
         accept=lambda c: c.algorithm.whiten_advantages is True),
    Case("verl_grpo_std_with_whitening_off", "verl",
         from_overrides("algorithm.norm_adv_by_std_in_grpo=true", "algorithm.whiten_advantages=false"),
         accept=lambda c: c.algorithm.whiten_advantages is False),
]

# verl's layout (pfppo_mega/config/verl/): wrong types and hostile values of translated keys get
# the verl key named; a value our tree refuses names both; verl's semantics where they differ.
MINI = "actor_rollout_ref.actor.ppo_mini_batch_size"
VERL_LAYOUT_CASES = [
    Case(f"verl_{name}", "verl", from_overrides(*ov), expect, rule)
    for name, ov, expect, rule in (
        ("mini_batch_text", (f"{MINI}=abc",), (MINI,), "expected int"),
        ("mini_batch_bool", (f"{MINI}=true",), (MINI,), "expected int"),
        ("mini_batch_float", (f"{MINI}=2.5",), (MINI,), "expected int"),
        ("mini_batch_list", (f"{MINI}=[1, 2]",), (MINI,), "expected int"),
        ("mini_batch_zero", (f"{MINI}=0",), ("training.batch_size", MINI), ">= 1"),
        ("mini_batch_negative", (f"{MINI}=-256",), ("training.batch_size", MINI), ">= 1"),
        ("mini_batch_10^30", (f"{MINI}={10**30}",), ("training.batch_size", MINI), "<="),
        ("rollout_n_10^30", (f"actor_rollout_ref.rollout.n={10**30}",), ("actor_rollout.n_samples_per_prompt",), "<="),
        ("rollout_n_zero", ("actor_rollout_ref.rollout.n=0",), ("actor_rollout.n_samples_per_prompt",), ">= 1"),
        ("kl_loss_type_int", ("actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_type=3"),
         ("actor_rollout_ref.actor.kl_loss_type",), "expected str"),
        ("kl_loss_type_plus", ("actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_type=k3+"),
         ("actor_rollout_ref.actor.kl_loss_type",), "straight-through"),
        ("kl_loss_type_empty", ("actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_type=''"),
         ("actor_rollout_ref.actor.kl_loss_type",), "not one of verl's KL estimators"),
        ("kl_coef_inf", ("trainer.nnodes=1", "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.kl_coef=.inf"),
         ("algorithm.kl_coeff", "algorithm.kl_ctrl.kl_coef"), "finite"),
        ("kl_coef_negative", ("trainer.nnodes=1", "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.kl_coef=-1"),
         ("algorithm.kl_coeff",), ">= 0"),
        ("use_kl_loss_text", ("actor_rollout_ref.actor.use_kl_loss=yes_please",), ("actor_rollout_ref.actor.use_kl_loss",),
         "expected bool"),
        ("use_kl_both", ("actor_rollout_ref.actor.use_kl_loss=true", "algorithm.use_kl_in_reward=true"),
         ("actor_rollout_ref.actor.use_kl_loss",), "refused"),
        ("use_pf_ppo_int", ("actor_rollout_ref.rollout.n=2", "algorithm.use_pf_ppo=1"), ("algorithm.use_pf_ppo",),
         "expected bool"),
        ("engine_path", ("actor_rollout_ref.rollout.name=../../bin/sh",), ("actor_rollout_ref.rollout.name",),
         "unknown rollout engine"),
        ("train_files_mapping", ("data.train_files={a: 1}",), ("data.train_files",), "expected list of str"),
        ("train_files_ints", ("data.train_files=[1, 2]",), ("data.train_files",), "expected list of str"),
        ("response_length_10^12", ("trainer.nnodes=1", "data.max_response_length=1000000000000"), ("algorithm.max_response_length",), "<="),
        ("temperature_zero", ("actor_rollout_ref.rollout.temperature=0",), ("actor_rollout.temperature",), "> 0"),
        ("save_freq_text", ("trainer.save_freq=often",), ("trainer.save_freq",), "expected int"),
        ("micro_batch_negative", ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=-3",),
         ("training.micro_batch_size",), ">= 1"),
        ("bad_yaml_value", ("trainer.critic_warmup=[1, ",), ("trainer.critic_warmup",), "not valid YAML"),
        ("alias_bomb_value", ("actor_rollout_ref.actor.optim.lr=" + FLOW_BOMB,), ("actor_rollout_ref.actor.optim.lr",),
         "billion laughs"),
        ("unknown_key", ("actor_rollout_ref.actor.ppo_mini_batch_sise=4",), ("ppo_mini_batch_sise",), "did you mean"),
        ("typo_in_closed_subtree", ("actor_rollout_ref.model.lora.rnak=8",), ("lora.rnak",), "unknown key"),
        ("two_verl_keys_one_setting", ("actor_rollout_ref.actor.grad_clip=1.0", "actor_rollout_ref.actor.optim.clip_grad=2"),
         ("training.grad_clip",), "keep one"),
        ("verl_and_ours", ("actor_rollout_ref.actor.optim.lr=1e-5", "training.lr=1e-6"),
         ("actor_rollout_ref.actor.optim.lr", "training.lr"), "keep one"),
        ("lr_schedule_wsd", ("actor_rollout_ref.actor.optim.lr_scheduler_type=wsd",), ("lr_scheduler_type",),
         "constant and cosine only"),
        ("lr_warmup_negative_ratio", ("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=-0.5",),
         ("training.lr_warmup_ratio",), ">= 0"),
        ("adaptive_kl", ("trainer.nnodes=1", "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive"),
         ("algorithm.kl_ctrl.type",), "adaptive KL controller"),
        ("verl_key_without_verl_layout", ("algorithm.use_kl_in_reward=true",), ("algorithm.use_kl_in_reward",),
         "verl's layout is read when"),
        # issue 40: a critic warm-up covering the run trained only the critic and exited 0
        ("critic_warmup_covers_run", ("trainer.critic_warmup=5", "trainer.total_training_steps=5"),
         ("training.critic_warmup_steps = 5", "verl's trainer.critic_warmup", "trainer.total_training_steps) = 5"),
         "the policy would never change"),
        ("critic_warmup_past_default_run", ("trainer.critic_warmup=600",),
         ("training.critic_warmup_steps = 600", "verl's trainer.critic_warmup", "trainer.total_training_steps) = 500"),
         "the policy would never change"),
        # a hostile sweep of the verl layout: each verl key named as written, with its value and rule
        ("critic_enable_text", ("critic.enable=abc",), ("critic.enable", "'abc'"), "expected bool"),
        ("critic_enable_list", ("critic.enable=[1, 2]",), ("critic.enable", "[1, 2]"), "expected bool"),
        ("critic_enable_int", ("critic.enable=0",), ("critic.enable", "= 0"), "expected bool"),
        ("critic_enable_false_gae", ("critic.enable=false",), ("critic.enable", "gae needs the critic"),
         "algorithm.adv_estimator=grpo"),
        ("max_resp_len_text", ("reward_model.reward_kwargs.max_resp_len=abc",),
         ("reward_model.reward_kwargs.max_resp_len", "'abc'"), "expected int"),
        ("overlong_len_text", ("reward_model.overlong_buffer.len=abc",), ("reward_model.overlong_buffer.len",),
         "expected int"),
        ("overlong_penalty_text", ("reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=x",),
         ("reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor",), "expected float"),
        ("overlong_recipe_no_len", ("reward_model.overlong_buffer.enable=true",),
         ("reward_model.overlong_buffer.enable", "needs reward_model.overlong_buffer.len"), "set it"),
        ("overlong_kwargs_no_len", ("reward_model.reward_kwargs.overlong_buffer_cfg.enable=true",),
         ("reward_model.reward_kwargs.overlong_buffer_cfg.enable", "needs reward_model.reward_kwargs.overlong_buffer_cfg.len"),
         "set it"),
        ("overlong_enable_text", ("reward_model.overlong_buffer.enable=abc",), ("reward_model.overlong_buffer.enable",),
         "expected bool"),
        ("reward_model_no_path", ("reward_model.enable=true",), ("reward_model.enable", "needs reward_model.model.path"),
         "checkpoint directory"),
        ("reward_model_empty_path", ("reward_model.enable=true", "reward_model.model.path=''"),
         ("reward_model.enable", "needs reward_model.model.path", "got ''"), "checkpoint directory"),
        ("clip_cov_lb_1e32", ("actor_rollout_ref.actor.policy_loss.clip_cov_lb=1e32",),
         ("algorithm.clip_cov_lb", "1e+32", "actor_rollout_ref.actor.policy_loss.clip_cov_lb"), "< clip_cov_ub (5.0)"),
        ("clip_cov_ub_below_lb", ("actor_rollout_ref.actor.policy_loss.clip_cov_ub=0.5",),
         ("algorithm.clip_cov_ub", "actor_rollout_ref.actor.policy_loss.clip_cov_ub"), "> clip_cov_lb (1.0)"),
        ("max_num_batched_tokens_negative", ("actor_rollout_ref.rollout.max_num_batched_tokens=-1",),
         ("actor_rollout_ref.rollout.max_num_batched_tokens", "= -1"), ">= 1"),
        ("max_model_len_text", ("actor_rollout_ref.rollout.max_model_len=long",),
         ("actor_rollout_ref.rollout.max_model_len",), "expected int"),
        ("critic_micro_batch_zero", ("critic.ppo_micro_batch_size_per_gpu=0",),
         ("critic.ppo_micro_batch_size_per_gpu",), ">= 1"),
        ("ref_log_prob_micro_empty", ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=''",),
         ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",), "expected int"),
        ("total_epochs_10^32", (f"trainer.total_epochs={10**32}",), ("trainer.total_epochs", str(10**32)),
         "<= 100000000"),
        ("total_epochs_negative", ("trainer.total_epochs=-1",), ("trainer.total_epochs",), ">= 1"),
        ("kl_loss_coef_text_unused", ("actor_rollout_ref.actor.kl_loss_coef=abc",),
         ("actor_rollout_ref.actor.kl_loss_coef",), "expected float"),
        ("kl_ctrl_coef_text_unused", ("trainer.nnodes=1", "algorithm.kl_ctrl.kl_coef=[1, 2]"),
         ("algorithm.kl_ctrl.kl_coef",), "expected float"),
        ("kl_loss_type_int_unused", ("actor_rollout_ref.actor.kl_loss_type=3",),
         ("actor_rollout_ref.actor.kl_loss_type",), "expected str"),
        ("resume_from_path_mapping", ("trainer.resume_from_path={a: 1}",), ("trainer.resume_from_path",),
         "expected str"),
        ("default_local_dir_empty", ("trainer.default_local_dir=''",),
         ("logging.output_dir", "trainer.default_local_dir"), "must name a directory"),
    )
] + [
    Case("verl_interpolation_cycle", "verl",
         from_file("trainer:\n  default_local_dir: ${trainer.default_local_dir}\n"
                   "actor_rollout_ref:\n  model: {path: /m}\n"), ("trainer.default_local_dir",), "interpolation"),
    Case("verl_interpolation_chain_200", "verl",
         from_file("actor_rollout_ref:\n  model: {path: /m}\n  actor:\n    optim:\n      lr: ${trainer.k0}\n"
                   "trainer:\n" + "".join(f"  k{i}: ${{trainer.k{i + 1}}}\n" for i in range(200))),
         ("actor_rollout_ref.actor.optim.lr",), "interpolation"),
    Case("verl_no_kl_by_default", "verl", from_overrides("actor_rollout_ref.rollout.n=4"),
         accept=lambda c: c.algorithm.kl_coeff == 0.0 and c.training.batch_size == 1024),
    Case("verl_pf_ppo_is_filtration", "verl", from_overrides("algorithm.use_pf_ppo=true", "trainer.nnodes=1"),
         accept=lambda c: c.algorithm.filtration.enable and not c.algorithm.use_pf_ppo),
    Case("verl_max_num_batched_tokens_null", "verl", from_overrides("actor_rollout_ref.rollout.max_num_batched_tokens=null"),
         accept=lambda c: True),
    Case("verl_critic_enable_null", "verl", from_overrides("critic.enable=null"),
         accept=lambda c: c.algorithm.adv_estimator == "gae"),
    Case("verl_reward_manager_batch", "verl", from_overrides("reward_model.reward_manager=batch"),
         accept=lambda c: c.reward.custom_function.path is None),
    Case("verl_hydra_delete", "verl", from_overrides("~trainer.logger", "+trainer.critic_warmup=2"),
         accept=lambda c: c.training.critic_warmup_steps == 2),
]

VALID = write("ok.yaml", BASE_YAML)
CLI_CASES = [
    Case(f"{cmd}_{what}", "cli", from_cli(cmd, make), (frag,))
    for cmd in ("train", "sft", "validate")
    for what, make, frag in (
        ("missing_file", lambda t: str(t / "nope.yaml"), "no such file"),
        ("directory", a_dir, "directory"),
        ("binary_file", write("bin.yaml", PNG), "binary"),
        ("not_utf8", write("latin.yaml", b"training:\n  lr: 1.0\n# \xff\xfe\n"), "UTF-8"),
    )
] + [
    Case("plan_binary_file", "cli", from_cli("plan", write("bin.yaml", PNG)), ("binary",)),
    Case("train_bad_value", "cli", from_cli("train", VALID, "training.lr=.inf"), ("training.lr", "finite")),
    Case("train_output_dir_is_file", "cli",
         from_cli("train", VALID, lambda t: f"logging.output_dir={a_file(t)}"),
         ("logging.output_dir", "existing file")),
    Case("train_output_dir_under_file", "cli",
         from_cli("train", VALID, lambda t: f"logging.output_dir={a_file(t)}/run1"),
         ("logging.output_dir", "existing file")),
    Case("sft_output_dir_is_file", "cli",
         from_cli("sft", VALID, lambda t: f"sft.output_dir={a_file(t)}"),
         ("sft.output_dir", "existing file")),
    Case("train_two_spellings", "cli", from_cli("train", VALID, "algorithm.lam=0.5", "algorithm.lmbda=0.9"),
         ("algorithm.lmbda", "conflicts")),
]


# ----------------------------------------------------------------------------- generated from the tree


def _leaves(cls: type = Config, path: str = ""):
    """(dotted key, type) of every leaf of the tree."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp, key = hints[f.name], f"{path}.{f.name}" if path else f.name
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            yield from _leaves(tp, key)
        else:
            yield key, tp


def _is(tp: Any, base: type) -> bool:
    return tp is base or base in typing.get_args(tp) and len(typing.get_args(tp)) == 2


NONFINITE = {"inf": ".inf", "-inf": "-.inf", "nan": ".nan", "1e400": "1e400"}
GENERATED = [
    Case(f"float_{key}_{name}", "float_nonfinite", from_overrides(f"{key}={text}"), (key,), "finite")
    for key, tp in _leaves() if _is(tp, float) for name, text in NONFINITE.items()
] + [
    Case(f"int_{key}_{sign}10^30", "int_range", from_overrides(f"{key}={sign}{10**30}"), (key,), "and <=")
    for key, tp in _leaves() if _is(tp, int) for sign in ("", "-")
]

CASES = FILE_CASES + OVERRIDE_CASES + VERL_CASES + VERL_LAYOUT_CASES + CLI_CASES + GENERATED


# ----------------------------------------------------------------------------- classification


def _alarm(signum, frame):
    raise Hang()


def outcome(case: Case, tmp: Path, timeout: float = CASE_SECONDS) -> tuple[str, str, float]:
    """(class, message, seconds) of one case; see the module docstring."""
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    t0 = time.perf_counter()
    try:
        try:
            cfg = case.run(tmp)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
    except Hang:
        return "hang", "", time.perf_counter() - t0
    except ConfigError as e:
        text = str(e)
        return ("named" if all(f in text for f in case.expect) else "vague"), text, time.perf_counter() - t0
    except CommandExit as e:
        if e.rc == 2:
            cls = "named" if all(f in e.stderr for f in case.expect) else "vague"
            return cls, e.stderr, time.perf_counter() - t0
        return "traceback", f"exit {e.rc}: {e.stderr}", time.perf_counter() - t0
    except BaseException as e:  # noqa: BLE001 - classifying is the point
        return "traceback", f"{type(e).__name__}: {str(e)[:300]}", time.perf_counter() - t0
    dt = time.perf_counter() - t0
    if case.accept is not None and case.accept(cfg):
        return "ok", "", dt
    return "silent", "", dt


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_config_gets_a_named_error_quickly(case: Case, tmp_path: Path):
    cls, text, seconds = outcome(case, tmp_path)
    want = "ok" if case.accept is not None else "named"
    assert cls == want, f"{case.id}: {cls} (want {want}, fragments {case.expect}): {text}"
    assert case.rule in text, f"{case.id}: rule fragment {case.rule!r} missing from: {text}"
    assert seconds < CASE_SECONDS, f"{case.id}: took {seconds:.2f}s (bound {CASE_SECONDS}s)"


def test_suite_covers_the_issue():
    groups = Counter(c.group for c in CASES)
    assert len(CASES) >= 80 and set(groups) == {"file", "yaml", "override", "verl", "cli",
                                                 "float_nonfinite", "int_range"}, groups
    # every float key of the tree is tried with the four non-finite spellings
    floats = [k for k, tp in _leaves() if _is(tp, float)]
    assert {"training.lr", "algorithm.kl_coeff", "actor_rollout.temperature", "algorithm.vf_coef",
            "training.grad_clip"} <= set(floats)
    assert groups["float_nonfinite"] == 4 * len(floats)


def main(argv: list[str] | None = None) -> int:
    import tempfile

    ap = argparse.ArgumentParser(description="Count the outcome classes of the adversarial config suite.")
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds before a case counts as a hang")
    ap.add_argument("-v", action="store_true", help="print every case")
    ap.add_argument("--preimport", action="store_true",
                    help="import the trainer and SFT first, so that a slow torch import is not "
                         "counted as a hang (older trees import them before reading the config)")
    args = ap.parse_args(argv)
    if args.preimport:
        import pfppo_mega.sft  # noqa: F401
        import pfppo_mega.trainer.loop  # noqa: F401
    by_group: dict[str, Counter] = {}
    total, slowest = Counter(), (0.0, "")
    for case in CASES:
        with tempfile.TemporaryDirectory() as d:
            cls, text, seconds = outcome(case, Path(d), args.timeout)
        by_group.setdefault(case.group, Counter())[cls] += 1
        total[cls] += 1
        slowest = max(slowest, (seconds, case.id))
        if args.v or case.group in ("file", "yaml") and "bomb" in case.id:
            print(f"{case.id:45s} {cls:9s} {seconds:8.3f}s  {text.splitlines()[-1][:100] if text else ''}")
    for group, counts in by_group.items():
        print(f"{group:16s} {sum(counts.values()):4d}  {dict(counts)}")
    print(f"{'total':16s} {sum(total.values()):4d}  {dict(total)}   slowest {slowest[1]} {slowest[0]:.3f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
