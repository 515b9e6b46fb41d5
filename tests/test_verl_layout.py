"""verl's config layout (pfppo_mega/config/verl/), tested on verl's own inputs: the key=value
overrides of every launch script of verl's examples/ and recipe/ that runs verl.trainer.main_ppo
(tests/data/verl_overrides.json) and the composed ppo_megatron_trainer.yaml
(tests/data/verl_megatron_defaults.json), both extracted by scripts/extract_verl_inputs.py at the
verl commit they record. Then the four places where a verl config used to mean something else
here: mini-batch units, KL, use_pf_ppo, and the math_dapo / aime rewards.

`python tests/test_verl_layout.py` prints the counts (keys mapped / ignored / refused, scripts
that load unchanged, the refused keys with their reasons)."""

from __future__ import annotations

import importlib.util
import io
import json
import re
import sys
from collections import Counter, defaultdict
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch

from pfppo_mega import ppo
from pfppo_mega.config import ConfigError, load_config_dict, resolve_config_dict
from pfppo_mega.config import verl as V
from pfppo_mega.config import verl_doc
from pfppo_mega.config.loader import validate_main
from pfppo_mega.config.tree import AlgorithmConfig, RewardConfig, field_types
from pfppo_mega.rewards.base import RuleReward
from pfppo_mega.types import Sample

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
SCRIPTS = json.loads((DATA / "verl_overrides.json").read_text())
DEFAULTS = json.loads((DATA / "verl_megatron_defaults.json").read_text())
VERL_COMMIT = "b178a3cd56f58b2d502255daba591e92833930a7"

# ----------------------------------------------------------------------------- the scripts' shell values

ENV = {"HOME": "/home/user", "PWD": "/work", "USER": "user"}


class Unresolved(Exception):
    pass


def _closing(text: str, start: int, open_: str, close: str) -> int:
    """Index just past the bracket closing the one opened at text[start]."""
    depth = 0
    for i in range(start, len(text)):
        depth += text[i] == open_
        depth -= text[i] == close
        if depth == 0:
            return i + 1
    raise Unresolved(text[start:])


def expand(text: str, variables: dict[str, str], depth: int = 0) -> str:
    """A script's value with its own variables substituted: $x, ${x}, ${x:-default} (nested),
    $((a * b)); an environment variable beyond ENV, a command substitution, a positional
    parameter or an empty variable (left for the user to fill in): Unresolved."""
    if depth > 10:
        raise Unresolved(text)

    def var(name: str) -> str:
        if name in variables:
            value = expand(variables[name], variables, depth + 1)
            if value == "":
                raise Unresolved(name)
            return value
        if name in ENV:
            return ENV[name]
        raise Unresolved(name)

    out, i = [], 0
    while i < len(text):
        if text[i] != "$" or i + 1 == len(text):
            out.append(text[i])
            i += 1
        elif text.startswith("$((", i):
            end = _closing(text, i + 1, "(", ")")
            expr = expand(text[i + 3:end - 2], variables, depth + 1)
            expr = re.sub(r"[A-Za-z_]\w*", lambda n: var(n.group(0)), expr)
            if not re.fullmatch(r"[\d\s+\-*/%()]+", expr):
                raise Unresolved(expr)
            out.append(str(eval(expr.replace("/", "//"), {"__builtins__": {}})))  # digits and operators only
            i = end
        elif text[i + 1] == "(":
            raise Unresolved(text[i:])  # command substitution
        elif text[i + 1] == "{":
            end = _closing(text, i + 1, "{", "}")
            inner = re.fullmatch(r"([A-Za-z_]\w*)(?::?[-=](.*))?", text[i + 2:end - 1], re.S)
            if not inner:
                raise Unresolved(text[i:end])
            try:
                out.append(var(inner.group(1)))
            except Unresolved:
                if inner.group(2) is None:
                    raise
                out.append(expand(inner.group(2).strip("\"'"), variables, depth + 1))
            i = end
        else:
            m = re.match(r"[A-Za-z_]\w*", text[i + 1:])
            if not m:
                raise Unresolved(text[i:])  # $@, $1, ...
            out.append(var(m.group(0)))
            i += 1 + m.end()
    return "".join(out)


# The keys that matter here of the config files a script names with --config-name, other than verl's
# two trainer configs: every multi-turn config (examples/sglang_multiturn/config/*_multiturn_*.yaml,
# recipe/deepeyes) sets rollout.multi_turn.enable true; read in verl's repository for
# gsm8k_multiturn_grpo, gsm8k_multiturn_grpo_server and search_multiturn_grpo, the rest by their name
# and folder. Without them 12 multi-turn scripts counted as loading.
CONFIG_FILE_KEYS = {"multiturn": ["actor_rollout_ref.rollout.multi_turn.enable=True"]}


def config_file_overrides(config_name: str) -> list[str]:
    return [o for marker, keys in CONFIG_FILE_KEYS.items() if marker in config_name for o in keys]


def overrides_of(path: str) -> tuple[list[str], list[str]]:
    """The script's overrides with its variables filled in, after the keys its named config file
    sets (CONFIG_FILE_KEYS); a value that stays a placeholder takes verl's default for that key
    (dropped when there is none). Also the keys so filled in."""
    script = SCRIPTS["scripts"][path]
    out, filled = config_file_overrides(script["config_name"]), []
    for text in script["overrides"]:
        key, value = text.split("=", 1)
        try:
            value = expand(value, script["vars"])
        except Unresolved:
            filled.append(key)
            default = DEFAULTS["defaults"].get(V.strip_hydra(key))
            if default is None:
                continue
            value = json.dumps(default)
        out.append(f"{key}={value}")
    return out, filled


def nest(flat: dict) -> dict:
    out: dict = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


# ----------------------------------------------------------------------------- the inputs themselves


def test_inputs_record_the_verl_commit_and_hold_only_facts():
    assert SCRIPTS["commit"] == DEFAULTS["commit"] == VERL_COMMIT
    assert SCRIPTS["entrypoint"] == "verl.trainer.main_ppo" and len(SCRIPTS["scripts"]) >= 150
    for path, script in SCRIPTS["scripts"].items():
        assert path.endswith(".sh") and path.split("/")[0] in ("examples", "recipe")
        assert set(script) == {"config_name", "overrides", "vars"}
        assert all(re.match(r"[+~]*[a-z_]+\.", o) for o in script["overrides"]), path
    assert "examples/ppo_trainer/run_deepseek7b_llm_pfppo.sh" in SCRIPTS["scripts"]
    assert DEFAULTS["source"].endswith("_generated_ppo_megatron_trainer.yaml") and len(DEFAULTS["defaults"]) > 500


def test_extraction_reads_shell_as_meant():
    spec = importlib.util.spec_from_file_location("extract_verl_inputs", ROOT / "scripts" / "extract_verl_inputs.py")
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    text = """#!/bin/bash
n=5
ARGS=(
    data.train_batch_size=$((4 * 256))   # a comment
    +actor_rollout_ref.model.override_config.max_position_embeddings=32768
)
EXTRA="trainer.nnodes=2 trainer.n_gpus_per_node=8"
python3 -m verl.trainer.main_ppo --config-name='ppo_megatron_trainer.yaml' \\
    algorithm.use_pf_ppo=True \\  # ["pow"]
    actor_rollout_ref.rollout.n=$n \\
    trainer.logger='["console","wandb"]' \\
    "${ARGS[@]}" $EXTRA
"""
    facts = ex.script_facts(text)
    assert facts["config_name"] == "ppo_megatron_trainer"
    assert facts["overrides"] == [
        "data.train_batch_size=$((4 * 256))",
        "+actor_rollout_ref.model.override_config.max_position_embeddings=32768",
        "trainer.nnodes=2", "trainer.n_gpus_per_node=8",
        "algorithm.use_pf_ppo=True", "actor_rollout_ref.rollout.n=$n", 'trainer.logger=["console","wandb"]']
    assert facts["vars"]["n"] == "5"
    assert ex.script_facts("python3 -m verl.trainer.main_generation data.path=x\n") is None
    assert expand("$((4 * 256))", {}) == "1024" and expand("${X:-7}", {}) == "7"
    assert expand("${A:-${B:-/x}/y}", {}) == "/x/y" and expand("$(((a + 1) * 2))", {"a": "3"}) == "8"


def test_verl_defaults_used_here_are_verls():
    for key, value in V.VERL_DEFAULTS.items():
        assert DEFAULTS["defaults"][key] == value, key


# ----------------------------------------------------------------------------- verl's own scripts

# Keys the table refuses by name in verl's scripts: a phrase of the reason each refusal gives, and a
# phrase of the fix it names (what a verl user changes to run the script here).
MANAGER_FIX = "remove them with the reward manager that reads them"
EXPECTED_REFUSED = {
    "actor_rollout_ref.actor.megatron.override_transformer_config.fp8": ("fp8 training",
                                                                         "remove the key or set it to False"),
    "actor_rollout_ref.actor.router_replay.mode": ("MoE settings", "remove the key or set it to 'disabled'"),
    "actor_rollout_ref.model.mtp.enable": ("multi-token prediction", "remove the key or set it to False"),
    "actor_rollout_ref.rollout.multi_turn.format": ("tool-call format 'gpt-oss'",
                                                    "set it to hermes with a model whose template writes that"),
    "actor_rollout_ref.rollout.agent.agent_loop_config_path": ("agent loops", "remove the key to run without it"),
    "data.custom_cls.path": ("a user's dataset class", "write the rows as parquet or jsonl"),
    "reward_model.enable": ("a reward function here cannot query the model",  # FAPO's generative RM
                            "Drop custom_reward_function"),
    "reward_model.reward_manager": ("reward manager 'collabllm'", "write the scoring as custom_reward_function"),
    "trainer.device": ("only CUDA GPUs", "set it to cuda (or remove it)"),
    **{f"reward_model.reward_kwargs.{k}": ("arguments of a verl reward manager", MANAGER_FIX)
       for k in ("llm_judge_kwargs.max_tokens", "llm_judge_kwargs.model", "llm_judge_kwargs.temperature",
                 "metric_weights.accuracy", "metric_weights.interactivity", "metric_weights.token_amount")},
}
# Every script that does not load, with the keys refused there (nothing else fails). Before issue 36's
# mappings (warm-up, truncation, gen_batch_size, the overlong buffer, the serving keys) 79 of 157 loaded;
# remax 114; trainer.resume_from_path ignored unless resume_mode is resume_path (as verl reads it) 115;
# fp16 training (megatron's loss scaler) 117; verl's rollout correction in bypass mode 119; over_sample_rate
# ignored as verl 0.9.1 ignores it (declared, read nowhere) 121; chat-template arguments 122;
# optimal_token_baseline 123; LoRA (model.lora: the 13 scripts refused only for lora_rank / lora.rank /
# lora_adapter_path) 136; the
# multi-turn config files 16 scripts name read (CONFIG_FILE_KEYS: 12 of them had counted as loading) 124;
# code rewards through reward.sandbox_fusion (run_deepseek7b_llm_sandbox_fusion.sh) 125;
# multi-turn rollouts (actor_rollout.multi_turn: the 15 scripts refused only for multi_turn.enable; the two
# gpt-oss ones are now refused for multi_turn.format instead) 140; a user's sampler (data.sampler_path: the
# two sglang multi-turn curriculum scripts) 142.
REFUSED_SCRIPTS = {
    'examples/grpo_trainer/run_minicpmo2_6.sh':
        ('data.custom_cls.path',),
    'examples/gspo_trainer/run_qwen3_32b_gspo_npu.sh':
        ('trainer.device',),
    'examples/mtp_trainer/test_dapo_mimo_7b_with_mtp_math_megatron.sh':
        ('actor_rollout_ref.model.mtp.enable',),
    'examples/router_replay/run_qwen30_a3b_megatron_sglang.sh':
        ('actor_rollout_ref.actor.router_replay.mode',),
    'examples/router_replay/run_qwen30_a3b_megatron_vllm.sh':
        ('actor_rollout_ref.actor.router_replay.mode',),
    'recipe/collabllm/train_rl_collabllm.sh':
        ('reward_model.reward_kwargs.llm_judge_kwargs.max_tokens', 'reward_model.reward_kwargs.llm_judge_kwargs.model', 'reward_model.reward_kwargs.llm_judge_kwargs.temperature', 'reward_model.reward_kwargs.metric_weights.accuracy', 'reward_model.reward_kwargs.metric_weights.interactivity', 'reward_model.reward_kwargs.metric_weights.token_amount', 'reward_model.reward_manager'),
    'recipe/dapo/test_dapo_8b_megatron_fp8train.sh':
        ('actor_rollout_ref.actor.megatron.override_transformer_config.fp8',),
    'recipe/fapo/run_fapo_32b.sh':
        ('reward_model.enable',),
    'recipe/fapo/run_fapo_7b.sh':
        ('reward_model.enable',),
    'recipe/langgraph_agent/example/run_gpt_oss_20b_bf16.sh':
        ('actor_rollout_ref.rollout.agent.agent_loop_config_path', 'actor_rollout_ref.rollout.multi_turn.format'),
    'recipe/langgraph_agent/example/run_qwen2.5_3b.sh':
        ('actor_rollout_ref.rollout.agent.agent_loop_config_path',),
    'recipe/retool/run_gpt_oss_ppo.sh':
        ('actor_rollout_ref.rollout.multi_turn.format', 'data.custom_cls.path'),
    'recipe/retool/run_qwen2-32b_dapo.sh':
        ('data.custom_cls.path',),
    'recipe/retool/run_qwen2-32b_ppo.sh':
        ('data.custom_cls.path',),
    'recipe/retool/run_qwen2_7b_dapo.sh':
        ('data.custom_cls.path',),
}
LOADED = 157 - len(REFUSED_SCRIPTS)  # 142


def survey():
    """Per script: loads unchanged, or the keys refused; the other problems; what each distinct
    verl key became (over every script: key -> outcomes)."""
    loaded, refused, other = [], defaultdict(set), []
    outcomes: dict[str, set[str]] = defaultdict(set)
    for path in SCRIPTS["scripts"]:
        try:
            translation = resolve_config_dict({}, overrides_of(path)[0]).verl
            loaded.append(path)
        except ConfigError as e:
            translation = e.verl
            for p in e.problems:
                if "refused (verl layout)" in p.rule:
                    refused[p.key].add(path)
                else:
                    other.append((path, p.key, str(p)))
        for u in translation.uses:
            if u.source != "verl default":
                outcomes[u.key].add(u.outcome)
    return loaded, refused, other, outcomes


def test_every_verl_script_loads_or_fails_only_on_keys_refused_by_name():
    loaded, refused, other, _ = survey()
    assert other == [], "problems other than refusals by name:\n" + "\n".join(map(str, other))
    by_script = defaultdict(set)
    for key, paths in refused.items():
        for path in paths:
            by_script[path].add(key)
    assert {p: tuple(sorted(k)) for p, k in by_script.items()} == REFUSED_SCRIPTS
    assert len(loaded) == LOADED == 142 and len(SCRIPTS["scripts"]) == 157


def test_each_refusal_gives_its_reason():
    for path, keys in REFUSED_SCRIPTS.items():
        with pytest.raises(ConfigError) as e:
            resolve_config_dict({}, overrides_of(path)[0])
        for p in e.value.problems:
            why, fix = EXPECTED_REFUSED[p.key]
            assert why in p.rule and fix in p.rule and "refused (verl layout)" in p.rule, (path, str(p))


def test_every_verl_key_of_the_scripts_is_in_the_table():
    keys = {V.strip_hydra(o.split("=", 1)[0]) for s in SCRIPTS["scripts"].values() for o in s["overrides"]}
    assert len(keys) >= 300
    assert [k for k in sorted(keys) if V.rule_for(k) is None] == []


def test_fp16_scripts_train_and_serve_in_float16():
    for path in ("recipe/dapo/test_dapo_8b_megatron_fp16.sh", "recipe/dapo/test_dapo_qwen3_moe_30b_megatron_fp16.sh"):
        c = resolve_config_dict({}, overrides_of(path)[0]).config
        assert (c.model.params_dtype, c.actor_rollout.dtype) == ("float16", "float16"), path
        assert c.model.loss_scale is None and c.model.initial_loss_scale == 2.0 ** 32  # megatron's dynamic scaler
    for key in ("actor_rollout_ref.actor.megatron.dtype", "actor_rollout_ref.rollout.dtype"):
        with pytest.raises(ConfigError) as e:
            resolve_config_dict({}, [f"{key}=fp8", "actor_rollout_ref.model.path=/m"])
        assert key in str(e.value) and "float16" in str(e.value)


def test_over_sample_rate_is_ignored_as_verl_091_ignores_it():
    res = resolve_config_dict({}, ["actor_rollout_ref.rollout.over_sample_rate=0.1", "actor_rollout_ref.model.path=/m"])
    (use,) = [u for u in res.verl.uses if u.key == "actor_rollout_ref.rollout.over_sample_rate"]
    assert use.outcome == "ignored" and "no code of its reads it" in use.detail
    with pytest.raises(ConfigError) as e:
        resolve_config_dict({}, ["actor_rollout_ref.rollout.over_sample_rate=1.5", "actor_rollout_ref.model.path=/m"])
    assert "over_sample_rate" in str(e.value) and "must be in [0, 1)" in str(e.value)


def test_megatron_defaults_load_as_a_config():
    res = resolve_config_dict(nest(DEFAULTS["defaults"]))
    assert res.verl.counts()["refused"] == 0 and res.verl.counts()["mapped"] >= 45
    c = res.config
    # verl's own defaults, in our keys
    assert (c.training.rollout_batch_size, c.training.batch_size, c.actor_rollout.n_samples_per_prompt) == (1024, 256, 1)
    assert (c.algorithm.kl_coeff, c.algorithm.use_kl_loss) == (0.0, False)  # no KL in verl's defaults
    assert (c.algorithm.lmbda, c.algorithm.gamma, c.algorithm.value_clip, c.algorithm.vf_coef) == (1.0, 1.0, 0.5, 1.0)
    assert (c.training.lr, c.training.critic_lr, c.training.weight_decay) == (1e-6, 1e-5, 0.01)
    assert (c.data.max_prompt_length, c.algorithm.max_response_length, c.data.overlong_prompts) == (512, 512, "error")
    assert (c.algorithm.use_pf_ppo, c.algorithm.filtration.enable) == (False, False)
    assert c.logging.output_dir == "checkpoints/verl_examples/gsm8k"  # ${trainer.project_name}/... resolved
    assert c.data.source == "files" and c.data.train_files == ["~/data/rlhf/gsm8k/train.parquet"]


def test_megatron_defaults_as_a_yaml_file(tmp_path):
    import yaml

    path = tmp_path / "verl.yaml"
    path.write_text(yaml.safe_dump(nest(DEFAULTS["defaults"])))
    err = io.StringIO()
    with redirect_stderr(err), redirect_stdout(io.StringIO()):
        assert validate_main([str(path)]) == 0
    assert "verl layout: 608 verl keys:" in err.getvalue()


# ----------------------------------------------------------------------------- trap 1: mini-batch units


@pytest.mark.parametrize("batch, mini, n, epochs", [(1024, 256, 5, 1), (512, 32, 16, 1), (128, 128, 4, 2), (64, 16, 1, 1)])
def test_mini_batch_counts_prompts_as_in_verl(batch, mini, n, epochs):
    c = load_config_dict({}, [f"data.train_batch_size={batch}", f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}",
                              f"actor_rollout_ref.rollout.n={n}", f"actor_rollout_ref.actor.ppo_epochs={epochs}",
                              "actor_rollout_ref.model.path=/m"])
    samples = c.training.rollout_batch_size * c.actor_rollout.n_samples_per_prompt
    assert c.training.batch_size == mini * n
    # pfppo_mega/trainer/update.py: ppo_epochs passes, each over samples / batch_size mini-batches
    steps = c.algorithm.ppo_epochs * samples // c.training.batch_size
    assert steps == epochs * batch // mini  # verl: train_batch_size / ppo_mini_batch_size per epoch
    if (batch, mini, n) == (1024, 256, 5):
        assert (steps, c.training.batch_size) == (4, 1280)


def test_micro_batch_and_dynamic_batching():
    res = resolve_config_dict({}, ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
                                   "actor_rollout_ref.actor.use_dynamic_bsz=True",
                                   "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384",
                                   "actor_rollout_ref.model.path=/m"])
    assert res.config.training.micro_batch_size == 16
    assert res.config.training.use_dynamic_bsz and res.config.training.max_tokens_per_micro_batch == 16384
    notes = "\n".join(res.notes())
    assert "normalised over the whole mini-batch" in notes


# ----------------------------------------------------------------------------- trap 2: KL


def _cfg(*overrides: str):
    return resolve_config_dict({}, ["actor_rollout_ref.model.path=/m", *overrides])


def test_no_kl_anywhere_when_both_verl_switches_are_off():
    res = _cfg("actor_rollout_ref.actor.use_kl_loss=False", "algorithm.use_kl_in_reward=False")
    a = res.config.algorithm
    assert (a.use_kl_loss, a.kl_coeff) == (False, 0.0)
    # the reward penalty (use_kl_loss false) adds kl_coeff * KL: with 0 the rewards are untouched
    logp, ref = torch.randn(2, 5), torch.randn(2, 5)
    rewards, mask = torch.randn(2, 5), torch.ones(2, 5)
    shaped, _ = ppo.apply_kl_penalty(rewards, logp, ref, mask, kl_coeff=a.kl_coeff, estimator=a.kl_estimator)
    assert torch.equal(shaped, rewards)
    assert any("no KL at all, as in verl" in n for n in res.notes())
    # the same with neither switch written (verl's defaults are both off)
    assert _cfg().config.algorithm.kl_coeff == 0.0
    # without verl's layout our own default stays (a 0.05 reward penalty)
    assert load_config_dict({"actor_rollout": {"model_path": "/m"}}).algorithm.kl_coeff == 0.05


def test_kl_in_reward_uses_kl_ctrl():
    a = _cfg("algorithm.use_kl_in_reward=True").config.algorithm
    assert (a.use_kl_loss, a.kl_coeff, a.kl_estimator) == (False, 0.001, "k1")  # verl: kl_coef 0.001, kl_penalty kl
    a = _cfg("algorithm.use_kl_in_reward=True", "algorithm.kl_ctrl.kl_coef=0.02", "algorithm.kl_penalty=low_var_kl",
             "actor_rollout_ref.actor.kl_loss_coef=0.5").config.algorithm
    assert (a.use_kl_loss, a.kl_coeff, a.kl_estimator) == (False, 0.02, "k3")


@pytest.mark.parametrize("name, ours", [("kl", "k1"), ("k1", "k1"), ("abs", "abs"), ("mse", "k2"), ("k2", "k2"),
                                        ("low_var_kl", "k3"), ("k3", "k3")])
def test_kl_loss_uses_kl_loss_coef_and_type(name, ours):
    a = _cfg("actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.01",
             f"actor_rollout_ref.actor.kl_loss_type={name}", "algorithm.kl_ctrl.kl_coef=0.9").config.algorithm
    assert (a.use_kl_loss, a.kl_coeff, a.kl_estimator) == (True, 0.01, ours)


@pytest.mark.parametrize("overrides, key, why", [
    (["actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_type=full"],
     "actor_rollout_ref.actor.kl_loss_type", "full-vocabulary"),
    (["actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_type=k3+"],
     "actor_rollout_ref.actor.kl_loss_type", "straight-through"),
    (["actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_type=k9"],
     "actor_rollout_ref.actor.kl_loss_type", "not one of verl's KL estimators"),
    (["actor_rollout_ref.actor.use_kl_loss=True", "algorithm.use_kl_in_reward=True"],
     "actor_rollout_ref.actor.use_kl_loss", "one KL term"),
    (["algorithm.use_kl_in_reward=True", "algorithm.kl_ctrl.type=adaptive"],
     "algorithm.kl_ctrl.type", "adaptive KL controller"),
    (["actor_rollout_ref.actor.optim.lr_scheduler_type=wsd"], "actor_rollout_ref.actor.optim.lr_scheduler_type",
     "constant and cosine only"),
    (["actor_rollout_ref.model.target_modules=[q_proj,v_proj]", "actor_rollout_ref.model.lora_rank=8"],
     "actor_rollout_ref.model.target_modules", "without k_proj"),
    (["actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.model.lora.type=dora"],
     "actor_rollout_ref.model.lora.type", "dora"),
    (["algorithm.adv_estimator=no_such_estimator"], "algorithm.adv_estimator", "no counterpart here"),
    (["actor_rollout_ref.rollout.top_k=50"], "actor_rollout_ref.rollout.top_k", "top-k"),
    (["reward_model.enable=True", "reward_model.model.path=/rm", "custom_reward_function.path=/f.py"],
     "reward_model.enable", "a reward function here cannot query the model"),
    (["data.gen_batch_size=2048"], "data.gen_batch_size", "without algorithm.filter_groups.enable"),
    (["trainer.resume_mode=resume_path", "trainer.resume_from_path=ck/global_step_5"], "trainer.resume_from_path",
     "copy or link that checkpoint there and set trainer.resume_mode=auto"),
])
def test_a_verl_key_that_cannot_be_honoured_is_refused_by_name(overrides, key, why):
    with pytest.raises(ConfigError) as e:
        _cfg(*overrides)
    p = next(p for p in e.value.problems if p.key == key)
    assert "refused (verl layout)" in p.rule and why in p.rule, p


@pytest.mark.parametrize("mode", [None, "auto", "disable"])
def test_resume_from_path_is_read_only_with_resume_path_as_in_verl(mode):
    res = _cfg("trainer.resume_from_path=ck/global_step_5", *([f"trainer.resume_mode={mode}"] if mode else []))
    assert res.config.checkpoint.resume is (mode != "disable")
    assert any("resume_from_path" in n and "read only with trainer.resume_mode=resume_path" in n for n in res.notes())


def test_unused_kl_settings_are_ignored_with_why():
    notes = "\n".join(_cfg("algorithm.kl_ctrl.type=adaptive", "actor_rollout_ref.actor.kl_loss_type=full").notes())
    assert "kl_ctrl.type = 'adaptive' (override) ignored: used only with use_kl_in_reward=True" in notes
    assert "kl_loss_type = 'full' (override) ignored: used only with" in notes


# ----------------------------------------------------------------------------- trap 3: use_pf_ppo


def test_use_pf_ppo_in_verl_layout_is_policy_filtration():
    res = resolve_config_dict({}, overrides_of("examples/ppo_trainer/run_deepseek7b_llm_pfppo.sh")[0])
    a = res.config.algorithm
    assert a.filtration.enable is True and (a.filtration.reweight_method, a.filtration.weight_pow) == ("pow", 2.0)
    assert a.use_pf_ppo is False  # our snapshot pool stays off
    assert any("use_pf_ppo is policy filtration" in n and "stays off" in n for n in res.notes())
    # natively, algorithm.use_pf_ppo is this project's pool
    native = load_config_dict({"actor_rollout": {"model_path": "/m"}, "algorithm": {"use_pf_ppo": True}})
    assert native.algorithm.use_pf_ppo is True and native.algorithm.filtration.enable is False


# ----------------------------------------------------------------------------- trap 4: rewards


@pytest.mark.parametrize("data_source", ["math_dapo", "aime", "aime2024", "aime_2025", "math_dapo_reasoning"])
def test_math_dapo_and_aime_sources_score_plus_minus_one_by_the_answer_rule(data_source):
    reward = RuleReward(default_scorer=None, log=lambda s: None)
    samples = [Sample(prompt_ids=(1,), data_source=data_source, ground_truth="42", row=f"r{i}") for i in range(4)]
    texts = ["... so Answer: 42", "Answer: 41", "\\boxed{42}", "answer: $42$ dollars"]
    reward.check(samples, "test")
    scores = reward(samples, texts, [True] * 4).scores.tolist()
    assert scores == [1.0, -1.0, -1.0, 1.0]  # a boxed answer without "Answer:" is wrong there


def test_our_math_source_keeps_the_boxed_rule():
    reward = RuleReward(default_scorer=None, log=lambda s: None)
    s = [Sample(prompt_ids=(1,), data_source="math", ground_truth="42", row="r")]
    assert reward(s, ["\\boxed{42}"], [True]).scores.tolist() == [1.0]


# ----------------------------------------------------------------------------- the layout itself


def test_mixed_spellings_of_one_setting_name_both():
    with pytest.raises(ConfigError) as e:
        _cfg("actor_rollout_ref.rollout.n=5", "actor_rollout.n_samples_per_prompt=4")
    p = e.value.problems[0]
    assert p.key == "actor_rollout_ref.rollout.n" and "our actor_rollout.n_samples_per_prompt = 4" in p.rule
    with pytest.raises(ConfigError) as e:  # our alias spelling is named as written
        _cfg("actor_rollout_ref.actor.optim.lr=1e-5", "training.actor_lr=1e-6")
    assert "training.actor_lr" in str(e.value) and "actor_rollout_ref.actor.optim.lr" in str(e.value)
    with pytest.raises(ConfigError) as e:  # two verl keys onto one of ours
        _cfg("actor_rollout_ref.actor.grad_clip=1.0", "actor_rollout_ref.actor.optim.clip_grad=0.5")
    assert "training.grad_clip" in str(e.value)


def test_our_keys_next_to_verl_keys():
    c = _cfg("actor_rollout_ref.actor.ppo_mini_batch_size=4", "data.train_batch_size=8",
             "actor_rollout.n_samples_per_prompt=2", "parallel.backend=gloo", "algorithm.whiten_advantages=false",
             "algorithm.lmbda=0.9").config
    assert (c.training.batch_size, c.parallel.backend, c.algorithm.whiten_advantages) == (8, "gloo", False)
    assert c.algorithm.lmbda == 0.9  # ours over verl's default lam 1.0


def test_hydra_forms_and_yaml_interpolation(tmp_path):
    c = _cfg("+actor_rollout_ref.model.override_config.max_position_embeddings=4096",
             "++trainer.critic_warmup=3", "~trainer.logger").config
    assert (c.model.max_position_embeddings, c.training.critic_warmup_steps) == (4096, 3)
    path = tmp_path / "v.yaml"
    path.write_text("trainer:\n  project_name: p\n  default_local_dir: runs/${trainer.project_name}\n"
                    "actor_rollout_ref:\n  model: {path: /m}\n  actor: {ppo_mini_batch_size: '${data.train_batch_size}'}\n"
                    "data:\n  train_batch_size: 16\n")
    from pfppo_mega.config import resolve_config

    c = resolve_config(path).config
    assert (c.logging.output_dir, c.training.batch_size) == ("runs/p", 16)
    path.write_text("trainer:\n  default_local_dir: ${trainer.default_local_dir}\n")
    with pytest.raises(ConfigError, match="interpolation that cannot be resolved"):
        resolve_config(path)


def test_unknown_verl_key_gets_did_you_mean():
    with pytest.raises(ConfigError) as e:
        _cfg("actor_rollout_ref.actor.ppo_mini_batch_sise=4", "critic.optim.lrr=1")
    rules = {p.key: p.rule for p in e.value.problems}
    assert "did you mean actor_rollout_ref.actor.ppo_mini_batch_size?" in rules["actor_rollout_ref.actor.ppo_mini_batch_sise"]
    assert "did you mean critic.optim.lr?" in rules["critic.optim.lrr"]


def test_a_broken_rule_of_ours_names_the_verl_key():
    with pytest.raises(ConfigError) as e:
        _cfg("actor_rollout_ref.actor.ppo_mini_batch_size=0")
    assert "training.batch_size" in str(e.value) and \
        "set from verl's actor_rollout_ref.actor.ppo_mini_batch_size" in str(e.value)


def test_native_configs_are_not_read_as_verl():
    assert not V.is_verl_layout({"algorithm": {"lam": 0.9}, "data": {}}, ["trainer.total_training_steps=7"])
    assert V.is_verl_layout({}, ["+actor_rollout_ref.rollout.n=2"])
    res = resolve_config_dict({"actor_rollout": {"model_path": "/m"}}, ["trainer.total_training_steps=7"])
    assert res.verl is None and res.config.training.total_training_steps == 7 and res.config.algorithm.kl_coeff == 0.05


def test_validate_prints_the_translation(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    out, err = io.StringIO(), io.StringIO()
    overrides = overrides_of("examples/ppo_trainer/run_deepseek7b_llm_pfppo.sh")[0]
    with redirect_stdout(out), redirect_stderr(err):
        assert validate_main([str(empty), *overrides]) == 0
    text = err.getvalue()
    assert "pfppo validate: note: verl layout: 42 verl keys: 23 mapped, 19 ignored, 0 refused" in text
    assert "actor_rollout_ref.actor.ppo_mini_batch_size = 256 (override) -> training.batch_size = 1280" in text
    assert "trainer.nnodes = 1 (override) ignored: Ray placement" in text
    assert "algorithm.lam = 1.0 (verl's default) -> algorithm.lmbda = 1.0" in text
    assert "batch_size: 1280" in out.getvalue()
    err = io.StringIO()
    with redirect_stdout(io.StringIO()), redirect_stderr(err):  # a refusal, and the translation so far
        assert validate_main([str(empty), *overrides, "actor_rollout_ref.actor.optim.lr_scheduler_type=wsd"]) == 2
    assert "refused (verl layout): learning-rate schedule 'wsd'" in err.getvalue() and "verl layout:" in err.getvalue()


def test_docs_verl_is_up_to_date_and_lists_every_rule():
    assert verl_doc.main(["--check", str(ROOT / "docs" / "verl.md")]) == 0
    text = (ROOT / "docs" / "verl.md").read_text()
    assert all(f"`{verl_doc.shown(r)}`" in text for r in V.RULES)


def test_batch_reward_manager_is_documented_as_it_behaves(tmp_path):
    """verl's batch manager calls the function with lists; here it is called per sample, so the row and the
    record say a batch-style function is refused at start, and it is (issue 40: the row said "the same")."""
    from pfppo_mega.rewards.worker import CustomFunctionError, load_function
    row = next(line for line in (ROOT / "docs" / "verl.md").read_text().splitlines()
               if line.startswith("| `reward_model.reward_manager` |"))
    assert "batch score the same" not in row and "batch-style function is refused at start" in row
    note = [u.detail for u in _cfg("reward_model.reward_manager=batch").verl.uses
            if u.key == "reward_model.reward_manager"]
    assert note and "refused at start" in note[0]
    fn = tmp_path / "batch_fn.py"
    fn.write_text("def compute_score(data_sources, solution_strs, ground_truths, extra_infos):\n"
                  "    return [0.0] * len(solution_strs)\n")
    with pytest.raises(CustomFunctionError, match="batch reward manager's signature"):
        load_function(str(fn), "compute_score")


def test_dapo_overlong_penalty_maps_in_both_spellings():
    ov = ("reward_model.reward_kwargs.overlong_buffer_cfg.enable=True", "reward_model.reward_kwargs.overlong_buffer_cfg.len=64",
          "reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=0.5", "reward_model.reward_kwargs.max_resp_len=512",
          "data.max_response_length=512")
    b = _cfg(*ov).config.reward.overlong_buffer
    assert (b.enable, b.len, b.penalty_factor) == (True, 64, 0.5)
    with pytest.raises(ConfigError, match="differs from data.max_response_length"):
        _cfg(*ov[:3], "reward_model.reward_kwargs.max_resp_len=256")
    assert _cfg(ov[1]).config.reward == load_config_dict({"actor_rollout": {"model_path": "/m"}}).reward  # off: ignored
    # verl's recipe/dapo spelling (dapo_trainer.yaml)
    b = _cfg("reward_model.overlong_buffer.enable=True", "reward_model.overlong_buffer.len=32",
             "reward_model.overlong_buffer.penalty_factor=0.25").config.reward.overlong_buffer
    assert (b.enable, b.len, b.penalty_factor) == (True, 32, 0.25)
    assert not _cfg("reward_model.overlong_buffer.len=32").config.reward.overlong_buffer.enable
    with pytest.raises(ConfigError, match="reward.overlong_buffer.len"):  # two spellings, two values
        _cfg("reward_model.overlong_buffer.enable=True", "reward_model.overlong_buffer.len=32",
             *ov[:2], "reward_model.reward_kwargs.max_resp_len=512", "data.max_response_length=512")


def test_serving_keys_map_to_ours():
    ar = _cfg("actor_rollout_ref.rollout.dtype=bfloat16", "actor_rollout_ref.rollout.enforce_eager=True",
              "actor_rollout_ref.rollout.max_num_seqs=128").config.actor_rollout
    assert (ar.dtype, ar.enforce_eager, ar.max_num_seqs) == ("bfloat16", True, 128)
    assert _cfg("actor_rollout_ref.rollout.dtype=float32").config.actor_rollout.dtype == "float32"


@pytest.mark.parametrize("loop", ["False", "True"])
def test_reward_model_maps_to_our_reward_model(loop):
    # verl 0.9.1: the legacy path, and the reward loop without custom_reward_function, score with the model alone
    res = _cfg("reward_model.enable=True", f"reward_model.use_reward_loop={loop}", "reward_model.model.path=/rm")
    assert (res.config.reward.model_path, res.config.reward.rule_weight) == ("/rm", 0.0)
    assert any("score alone" in n for n in res.notes())


def test_norm_adv_maps_once_the_tree_has_it():
    res = _cfg("algorithm.norm_adv_by_std_in_grpo=False", "algorithm.adv_estimator=grpo")
    if "norm_adv_by_std_in_grpo" in field_types(AlgorithmConfig):
        assert res.config.algorithm.norm_adv_by_std_in_grpo is False
    else:
        assert any("norm_adv_by_std_in_grpo" in n for n in res.notes())


def main() -> int:
    loaded, refused, other, outcomes = survey()
    keys = {V.strip_hydra(o.split("=", 1)[0]) for s in SCRIPTS["scripts"].values() for o in s["overrides"]}
    kinds = Counter("refused" if "refused" in o else "mapped" if "mapped" in o else "ignored"
                    for k, o in outcomes.items() if k in keys)
    print(f"verl {SCRIPTS['commit'][:12]} (recipe {str(SCRIPTS['recipe_commit'])[:12]}): "
          f"{len(SCRIPTS['scripts'])} scripts, {len(keys)} distinct keys: {kinds['mapped']} mapped, "
          f"{kinds['ignored']} ignored, {kinds['refused']} refused in some script "
          f"({len(keys - set(outcomes))} never reached)")
    print(f"scripts that load unchanged: {len(loaded)} of {len(SCRIPTS['scripts'])}")
    print(f"keys refused by name ({len(refused)}):")
    for key, paths in sorted(refused.items()):
        print(f"  {key}: {len(paths)} scripts ({' -> '.join(EXPECTED_REFUSED.get(key, ('not in the table',)))})")
    print(f"other problems: {len(other)}")
    for path, _, text in other:
        print(f"   {path}: {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
