"""verl's config layout, read as this trainer's tree: one translation table, RULES.

A config (YAML or `key=value` overrides, hydra's `+key` / `++key` / `~key` forms included) that
has one of verl's own top-level sections (``VERL_HEADS``: actor_rollout_ref, critic, trainer,
reward_model, custom_reward_function, ...) is read in verl's layout. Every verl key then goes
through the first rule of RULES that matches it (exact keys first, then patterns: ``*`` is one
key segment, ``**`` any tail; a closed subtree names verl's keys under it, so a typo there is an
unknown key) and is

    mapped    onto one or more of our keys, its value converted (verl's units and semantics:
              ppo_mini_batch_size counts prompts, use_pf_ppo is policy filtration, ...);
    ignored   accepted with a printed reason (Ray placement, FSDP-only, speed or memory only,
              logger names, settings of a feature that is off);
    refused   by name with the reason, where accepting it would change the result.

Keys of the shared sections (``algorithm.*``, ``data.*``) are verl's when the table knows them,
else ours; a verl key and one of ours that set the same key of ours is an error naming both.
verl's defaults that change the result and differ from ours (``VERL_DEFAULTS``: KL off, lam 1.0,
weight decay 0.01, ...) are applied to the keys a verl config leaves out, as verl would; one of
our own keys given explicitly wins over them. ``${key}`` / ``${oc.select:key,default}``
interpolations between verl keys are resolved first.

The loader (``pfppo_mega.config.loader``) calls :func:`translate`; ``pfppo validate`` prints
each record. docs/verl.md is generated from RULES (``pfppo_mega.config.verl_doc``).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

from pfppo_mega.config.tree import AlgorithmConfig, Config, Problem, field_types
from pfppo_mega.config.values import coerce

# verl's top-level sections that are not ours: any of them puts a config in verl's layout.
VERL_HEADS = ("actor_rollout_ref", "critic", "trainer", "reward_model", "custom_reward_function",
              "reward_manager", "global_profiler", "ray_kwargs", "transfer_queue", "ray_init")
SHARED_HEADS = ("algorithm", "data")  # sections both trees have; verl's keys there are the table's
# `trainer.total_training_steps` alone is also our native alias (Config.ALIASES): not a verl marker.
_NATIVE_TRAINER_KEYS = ("total_training_steps",)
_MAX_INTERPOLATION_DEPTH = 8

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

# ----------------------------------------------------------------------------- records


@dataclass(frozen=True)
class VerlUse:
    """What one verl key became: mapped (``detail`` = our keys and values), ignored or refused
    (``detail`` = why); ``source`` is config, override or "verl default"."""

    key: str
    value: Any
    outcome: str  # "mapped" | "ignored" | "refused"
    detail: str
    source: str = "config"

    def __str__(self) -> str:
        shown = repr(self.value)
        if len(shown) > 80:
            shown = f"{shown[:60]}... ({len(shown)} characters)"
        where = {"override": " (override)", "verl default": " (verl's default)"}.get(self.source, "")
        if self.key.startswith("("):  # one of VERL_FIXED: no verl key says it
            return f"verl layout -> {self.detail}"
        if self.outcome == "mapped":
            return f"verl {self.key} = {shown}{where} -> {self.detail}"
        return f"verl {self.key} = {shown}{where} {self.outcome}: {self.detail}"


@dataclass
class Translation:
    """Our keys set from verl's (dotted key -> value, and which verl key set it, explicitly or from
    verl's defaults), what each verl key became, and the problems."""

    values: dict[str, Any] = field(default_factory=dict)
    origin: dict[str, tuple[str, Any, bool]] = field(default_factory=dict)  # key -> (verl key, value, explicit)
    uses: list[VerlUse] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        given = [u for u in self.uses if u.source != "verl default"]
        return {o: sum(u.outcome == o for u in given) for o in ("mapped", "ignored", "refused")}

    def summary(self) -> str:
        c = self.counts()
        n_def = sum(u.source == "verl default" for u in self.uses)
        return (f"verl layout: {sum(c.values())} verl keys: {c['mapped']} mapped, {c['ignored']} ignored, "
                f"{c['refused']} refused; {n_def} of verl's defaults applied (see docs/verl.md)")


class Ignore(Exception):
    """Raised by a converter: the key is accepted and has no effect here (the message says why)."""


class Refuse(Exception):
    """Raised by a converter: accepting the key would change the result (the message says why)."""


class Bad(Exception):
    """Raised by a converter: the value has the wrong type or form (the message is the rule)."""


class _Unreadable(Exception):
    """A key a converter consults has a bad value; that key's own rule reports it."""


@dataclass(frozen=True)
class Out:
    """A converter's result for several of our keys, with a note for the record."""

    values: dict[str, Any]
    note: str = ""


# ----------------------------------------------------------------------------- the view of verl's keys


# verl keys a converter reads whose setting may come as one of our keys in a mixed config.
NATIVE_EQUIVALENTS = {
    f"{R_}.n": "actor_rollout.n_samples_per_prompt",
    f"{A}.megatron.tensor_model_parallel_size": "parallel.tensor_model_parallel_size",
    f"{M_}.path": "actor_rollout.model_path",
}


class View:
    """The verl keys of one config (interpolations resolved); under them our own keys of a mixed
    config (NATIVE_EQUIVALENTS), then verl's defaults."""

    def __init__(self, given: Mapping[str, Any], native: Mapping[str, Any] | None = None):
        self.given = dict(given)
        self.native = dict(native or {})

    def get(self, key: str) -> Any:
        if key in self.given:
            return self.given[key]
        if NATIVE_EQUIVALENTS.get(key) in self.native:
            return self.native[NATIVE_EQUIVALENTS[key]]
        return VERL_DEFAULTS.get(key)

    def typed(self, key: str, tp: Any) -> Any:
        value, error = coerce(self.get(key), tp)
        if error:
            raise _Unreadable(key)
        return value


def _typed(value: Any, tp: Any) -> Any:
    out, error = coerce(value, tp)
    if error:
        raise Bad(error)
    return out


def _native_type(key: str) -> Any:
    cls: Any = Config
    parts = key.split(".")
    for part in parts[:-1]:
        cls = field_types(cls)[part]
    return field_types(cls)[parts[-1]]


def _native_choices(key: str) -> tuple | None:
    cls: Any = Config
    parts = key.split(".")
    for part in parts[:-1]:
        cls = field_types(cls)[part]
    allowed = cls.CHOICES.get(parts[-1])
    return None if allowed is None else tuple(allowed)


# ----------------------------------------------------------------------------- rules


@dataclass(frozen=True)
class Rule:
    """One row of the table: verl key pattern -> map onto ``target`` (``convert(value, view)`` gives
    our value, or an Out for several keys), ignore with ``why``, or refuse with ``why`` unless the
    value is one of ``ok`` (values that ask for nothing: accepted and ignored)."""

    pattern: str
    action: str  # "map" | "ignore" | "refuse"
    target: str = ""
    why: str = ""
    convert: Callable[[Any, View], Any] | None = None
    ok: tuple = ()
    keys: tuple[str, ...] = ()  # a closed subtree `prefix.**`: the keys under it verl has (others are unknown)
    fix: str = ""  # refuse: what a verl user changes to run here (default: the value that asks for nothing)

    def matches(self, key: str) -> bool:
        if self.keys:
            prefix = self.pattern.removesuffix(".**")
            return key.startswith(prefix + ".") and key[len(prefix) + 1:] in self.keys
        return _pattern_re(self.pattern).fullmatch(key) is not None

    def spellings(self) -> list[str]:
        """The keys this rule names: the pattern, or each key of a closed subtree."""
        prefix = self.pattern.removesuffix(".**")
        return [f"{prefix}.{k}" for k in self.keys] if self.keys else [self.pattern]


@functools.cache
def _pattern_re(pattern: str) -> re.Pattern:
    out = []
    for part in pattern.split("."):
        out.append(".+" if part == "**" else re.escape(part).replace(r"\*", "[^.]*"))
    return re.compile(r"\.".join(out))


def M(pattern: str, target: str, convert: Callable[[Any, View], Any] | None = None, why: str = "") -> Rule:
    return Rule(pattern, "map", target, why, convert)


def I(pattern: str, why: str, keys: tuple[str, ...] = ()) -> Rule:  # noqa: E743 (I for ignore, next to M and R)
    return Rule(pattern, "ignore", why=why, keys=keys)


def R(pattern: str, why: str, ok: tuple = (), fix: str = "") -> Rule:
    return Rule(pattern, "refuse", why=why, ok=ok, fix=fix)


def refusal(rule: Rule) -> str:
    """A refusal's text: why, then what to change (the rule's fix, else the value that turns it off)."""
    why = rule.why if "here" in rule.why else f"{rule.why}: not available here"
    if rule.fix:
        return f"{why}; {rule.fix}"
    off = next((v for v in rule.ok if v is not None), None)
    if off is None:
        return f"{why}; remove the key to run without it"
    return f"{why}; remove the key or set it to {off!r} to run without it"


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


# KL: verl has two switches and no KL at all when both are off; here one kl_coeff with use_kl_loss
# choosing between a loss term and a per-token reward penalty.
KL_NAMES = {"kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}


def _kl_name(value: Any) -> str:
    name = _typed(value, str)
    if name in KL_NAMES:
        return KL_NAMES[name]
    if name == "full":
        raise Refuse("needs the full-vocabulary log-probs (verl itself raises NotImplementedError for it)")
    if name.endswith("+") and name[:-1] in KL_NAMES:
        raise Refuse(f"straight-through estimator (forward {name[:-1]}, k2's gradient): no such estimator here; "
                     f"use {name[:-1]!r}")
    raise Refuse(f"not one of verl's KL estimators ({', '.join(KL_NAMES)}, full, and the '+' forms)")


def _kl_switches(v: View) -> tuple[bool, bool]:
    return v.typed(f"{A}.use_kl_loss", bool), v.typed("algorithm.use_kl_in_reward", bool)


def _use_kl_loss(value: Any, v: View) -> Out:
    loss = _typed(value, bool)
    in_reward = v.typed("algorithm.use_kl_in_reward", bool)
    if loss and in_reward:
        raise Refuse("together with algorithm.use_kl_in_reward=True: verl applies both a KL loss and a KL reward "
                     "penalty; here there is one KL term (algorithm.use_kl_loss chooses loss or reward penalty)")
    if loss:
        return Out({"algorithm.use_kl_loss": True}, "KL is a loss term (coefficient actor.kl_loss_coef, "
                                                    "estimator actor.kl_loss_type)")
    if in_reward:
        return Out({"algorithm.use_kl_loss": False}, "KL is a per-token reward penalty "
                                                     "(algorithm.use_kl_in_reward=True)")
    return Out({"algorithm.use_kl_loss": False, "algorithm.kl_coeff": 0.0},
               "no KL at all, as in verl (neither use_kl_loss nor use_kl_in_reward): algorithm.kl_coeff = 0 "
               "(our default without verl's layout is a 0.05 reward penalty)")


def _use_kl_in_reward(value: Any, v: View) -> Any:
    _typed(value, bool)
    raise Ignore("read with actor_rollout_ref.actor.use_kl_loss (see that key)")


_KL_SWITCH = {"reward": "algorithm.use_kl_in_reward=True", "loss": "actor_rollout_ref.actor.use_kl_loss=True"}


def _kl_active(v: View, where: str) -> None:
    """Ignore a KL setting of the reward penalty / the loss term unless that one is on (alone)."""
    loss, in_reward = _kl_switches(v)
    if not ((in_reward and not loss) if where == "reward" else (loss and not in_reward)):
        raise Ignore(f"used only with {_KL_SWITCH[where]}")


def _kl_coef(where: str) -> Callable[[Any, View], Any]:
    def convert(value: Any, v: View) -> Any:
        _kl_active(v, where)
        return _typed(value, float)
    return convert


def _kl_type(where: str) -> Callable[[Any, View], Any]:
    def convert(value: Any, v: View) -> Any:
        _kl_active(v, where)
        name = _kl_name(value)
        return Out({"algorithm.kl_estimator": name}, _k3_note(name))
    return convert


def _kl_ctrl_type(value: Any, v: View) -> Any:
    kind = _typed(value, str)
    loss, in_reward = _kl_switches(v)
    if kind == "fixed" or not in_reward or loss:
        raise Ignore("fixed coefficient, as here" if kind == "fixed" else "used only with use_kl_in_reward=True")
    if kind == "adaptive":
        raise Refuse("adaptive KL controller (the coefficient follows target_kl): none here, the coefficient "
                     "is fixed (algorithm.kl_coeff)")
    raise Refuse("verl knows fixed and adaptive only")


def _k3_note(name: str) -> str:
    return "verl also clamps its k3 estimate at 10 per token; the same below that" if name == "k3" else ""


def _use_pf_ppo(value: Any, v: View) -> Out:
    on = _typed(value, bool)
    return Out({"algorithm.filtration.enable": on},
               "verl's use_pf_ppo is policy filtration (reward-weighted resampling, arXiv 2409.06957), "
               "read as algorithm.filtration.enable; this project's algorithm.use_pf_ppo (the snapshot pool, "
               "algorithm.pool) stays off" if on else "")


def _bypass_mode(value: Any, v: View) -> Out:
    """verl's bypass mode sets old_log_probs = rollout_log_probs and trains the vanilla PPO-clip
    loss (its loss_type ppo_clip) whatever policy_loss.loss_mode says; loss_type reinforce and the
    rollout IS / RS weights are refused at their own keys."""
    if not _typed(value, bool):
        return Out({"algorithm.recompute_old_logp": True})
    mode = v.get(f"{A}.policy_loss.loss_mode")
    if mode not in (None, "vanilla"):
        raise Refuse(f"verl's bypass mode trains the vanilla PPO-clip loss whatever {A}.policy_loss.loss_mode "
                     f"says ({mode!r} here); set loss_mode vanilla for what verl runs")
    return Out({"algorithm.recompute_old_logp": False},
               "the engine's log-probs are the proximal policy: the prepare pass runs no actor forward")


def _choice(target: str) -> Callable[[Any, View], Any]:
    """A value of one of our CHOICES / registries; verl's other names are refused by name."""
    def convert(value: Any, v: View) -> Any:
        name = _typed(value, str)
        allowed = _native_choices(target)
        if allowed is not None and name not in allowed:
            raise Refuse(f"{name!r} has no counterpart here ({target} is one of {', '.join(map(repr, allowed))})")
        return name
    return convert


def _norm_adv(value: Any, v: View) -> Any:
    _typed(value, bool)
    if "norm_adv_by_std_in_grpo" in field_types(AlgorithmConfig):
        return Out({"algorithm.norm_adv_by_std_in_grpo": value})
    if v.get("algorithm.adv_estimator") == "grpo":
        raise Refuse("mapping waits for key algorithm.norm_adv_by_std_in_grpo (GRPO's std normalisation)")
    raise Ignore("verl applies it to adv_estimator=grpo only")


def _when_ours(target: str, neutral: tuple = ()) -> Callable[[Any, View], Any]:
    """verl's key onto `target` once our tree has it; until then refused by name (ignored at a
    `neutral` value, which asks for nothing)."""
    def convert(value: Any, v: View) -> Any:
        section, _, leaf = target.rpartition(".")
        cls: Any = Config
        for part in section.split("."):
            cls = field_types(cls)[part]
        if leaf in field_types(cls):
            return _typed(value, field_types(cls)[leaf])
        if any(_same_value(value, n) for n in neutral):
            raise Ignore(f"nothing to honour at this value (mapping waits for key {target})")
        raise Refuse(f"mapping waits for key {target}")
    convert.__doc__ = f"refused until our tree has {target}" + (" (verl's default accepted)" if neutral else "")
    return convert


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


def _engine(value: Any, v: View) -> Any:
    name = _typed(value, str)
    if name == "???":
        raise Ignore("left unset (???) in verl's defaults: actor_rollout.engine keeps its default")
    engines = {"vllm": ("vllm", ""), "hf": ("builtin", "verl's HF rollout: generate() with the policy "
                                                        "itself, like the built-in engine"),
               "sglang": ("vllm", "SGLang is not an engine here; vLLM samples the same distribution"),
               "trtllm": ("vllm", "TensorRT-LLM is not an engine here; vLLM samples the same distribution")}
    if name not in engines:
        raise Refuse(f"unknown rollout engine (verl's: {', '.join(engines)})")
    ours, note = engines[name]
    return Out({"actor_rollout.engine": ours}, note)


def _top_k(value: Any, v: View) -> Any:
    if value in (-1, 0, None):
        raise Ignore("off (-1 in vLLM, 0 in HF): sampling here is top-p only")
    raise Refuse("top-k sampling: not implemented here (actor_rollout.top_p only)")


def _same_length(data_key: str) -> Callable[[Any, View], Any]:
    def convert(value: Any, v: View) -> Any:
        if value == v.get(data_key):
            raise Ignore(f"equal to {data_key}, as verl derives it")
        raise Refuse(f"differs from {data_key} = {v.get(data_key)!r}: here prompts and responses have one "
                     f"length limit each ({data_key})")
    return convert


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
    names = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32"}
    if name not in names:
        raise Refuse(f"{name!r} training: this trainer trains in float32 or bfloat16 (model.params_dtype); set "
                     f"it to bfloat16")
    return names[name]


def _rollout_dtype(value: Any, v: View) -> Any:
    name = _typed(value, str)
    names = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32", "auto": "auto"}
    if name not in names:
        raise Refuse(f"a {name!r} rollout engine: engines here run bfloat16 or float32 (actor_rollout.dtype); "
                     f"set it to bfloat16")
    return names[name]


def _overlong(value: Any, v: View) -> Any:
    if _typed(value, bool):
        return Out({"data.overlong_prompts": "filter"}, "prompts over data.max_prompt_length are dropped at start")
    raise Ignore("read with data.truncation (see that key)")


def _truncation(value: Any, v: View) -> Any:
    mode = _typed(value, str)
    if mode not in ("error", "left", "right", "middle"):
        raise Bad(f"must be one of 'error', 'left', 'right', 'middle' (verl's data.truncation), got {mode!r}")
    if v.typed("data.filter_overlong_prompts", bool):
        raise Ignore("prompts over max_prompt_length are dropped first (filter_overlong_prompts)")
    if mode == "error":
        return Out({"data.overlong_prompts": "error"}, "a prompt over data.max_prompt_length is refused")
    return Out({"data.overlong_prompts": mode}, f"a prompt over data.max_prompt_length is cut to it at the {mode}, "
                                                "after the chat template (verl's postprocess_data)")


def _files(target: str) -> Callable[[Any, View], Any]:
    def convert(value: Any, v: View) -> Any:
        files = _typed(value, list[str])
        out = {target: files}
        if target == "data.train_files":
            out["data.source"] = "files"
        note = "our held-out evaluation scores the first data.eval_size rows (verl: all)" \
            if target == "data.val_files" else ""
        return Out(out, note)
    return convert


def _gen_batch(value: Any, v: View) -> Any:
    if value is None or value == v.get("data.train_batch_size"):
        raise Ignore("equal to data.train_batch_size")
    gen, train = _typed(value, int), v.typed("data.train_batch_size", int)
    if v.typed("algorithm.filter_groups.enable", Optional[bool]) is not True:
        raise Refuse(f"{gen} prompts generated per step, {train} trained on, without algorithm.filter_groups."
                     f"enable: verl's DAPO trainer then trains on all {gen}; set data.train_batch_size={gen} for "
                     f"that, or algorithm.filter_groups.enable=True for dynamic sampling")
    if gen < train:
        raise Refuse(f"fewer prompts generated per round ({gen}) than trained on (data.train_batch_size = {train}): "
                     "verl's DAPO trainer needs several rounds even when no group is dropped; set gen_batch_size >= "
                     "train_batch_size")
    return gen


# verl's learning-rate schedule (verl 0.9.1: FSDP workers read warmup_style / lr_scheduler_type and
# min_lr_ratio, megatron workers lr_decay_style and min_lr; both lr_warmup_steps(_ratio)); ours is
# training.lr_warmup_steps / lr_warmup_ratio / lr_schedule / min_lr_ratio (trainer/lr_schedule.py),
# shared by actor and critic except the critic's warm-up fraction (training.critic_lr_warmup_ratio). verl's values of these keys when a config leaves them out:
OPTIM_DEFAULTS = {"lr_warmup_steps": -1, "lr_warmup_steps_ratio": 0.0, "warmup_style": None,
                  "lr_scheduler_type": "constant", "lr_decay_style": "constant", "min_lr_ratio": 0.0,
                  "min_lr": 0.0, "lr_warmup_init": 0.0, "num_cycles": 0.5, "lr_decay_steps": None}
SCHEDULES = ("constant", "cosine")


def _optim(v: View, section: str, leaf: str) -> Any:
    value = v.get(f"{section}.optim.{leaf}")
    return OPTIM_DEFAULTS[leaf] if value is None else value


def _warmup_steps(value: Any, v: View) -> Any:
    if value is None or _typed(value, int) < 0:
        raise Ignore("verl's -1: the warm-up is lr_warmup_steps_ratio x total_training_steps (see that key)")
    return Out({"training.lr_warmup_steps": _typed(value, int)},
               "the k-th actor update (k = 0, 1, ...) runs at lr x k / lr_warmup_steps until k reaches it, as verl")


def _warmup_ratio(value: Any, v: View) -> Any:
    ratio = _typed(value, float)
    if _typed(_optim(v, A, "lr_warmup_steps"), int) >= 0:
        raise Ignore("actor_rollout_ref.actor.optim.lr_warmup_steps >= 0 decides")
    return Out({"training.lr_warmup_ratio": ratio, "training.lr_warmup_steps": None},
               "warm-up steps = int(ratio x training.total_training_steps), as verl")


def _schedule(value: Any, v: View) -> Any:
    if value is None:
        raise Ignore("null: lr_scheduler_type decides")
    name = _typed(value, str)
    if name not in SCHEDULES:
        raise Refuse(f"learning-rate schedule {name!r}: constant and cosine only here (training.lr_schedule)")
    return Out({"training.lr_schedule": name})


def _min_lr_ratio(value: Any, v: View) -> Any:
    if value is None:
        raise Ignore("null: 0")
    return Out({"training.min_lr_ratio": _typed(value, float)}, "read with training.lr_schedule cosine")


def _min_lr(value: Any, v: View) -> Any:
    floor = _typed(value, float)
    if floor == 0:
        raise Ignore("0: cosine decays to 0, as training.min_lr_ratio's default")
    lr = v.typed(f"{A}.optim.lr", float)
    if not lr > 0:
        raise _Unreadable(f"{A}.optim.lr")  # reported at training.lr (must be > 0)
    return Out({"training.min_lr_ratio": floor / lr}, f"megatron's absolute floor over optim.lr ({lr})")


def _only_default(leaf: str, why: str) -> Callable[[Any, View], Any]:
    """A schedule detail whose verl default is what our schedule does; another value refused."""
    def convert(value: Any, v: View) -> Any:
        if value is None or _same_value(value, OPTIM_DEFAULTS[leaf]) or (
                leaf == "lr_decay_steps" and value == v.get("trainer.total_training_steps")):
            raise Ignore(f"{OPTIM_DEFAULTS[leaf]!r}: as here")
        raise Refuse(why)
    return convert


def _critic_warmup_ratio(value: Any, v: View) -> Any:
    ratio = _typed(value, float)
    if v.get("algorithm.adv_estimator") != "gae":
        raise Ignore(f"no critic with adv_estimator {v.get('algorithm.adv_estimator')!r}")
    if _typed(_optim(v, "critic", "lr_warmup_steps"), int) >= 0:
        raise Ignore("critic.optim.lr_warmup_steps >= 0 decides")
    return Out({"training.critic_lr_warmup_ratio": ratio},
               "the critic's warm-up steps = int(ratio x training.total_training_steps), apart from the actor's, "
               "as verl")


def _critic_optim(leaf: str) -> Callable[[Any, View], Any]:
    """A critic schedule key: one schedule here, so it must agree with the actor's."""
    def convert(value: Any, v: View) -> Any:
        if v.get("algorithm.adv_estimator") != "gae":
            raise Ignore(f"no critic with adv_estimator {v.get('algorithm.adv_estimator')!r}")
        actor = _optim(v, A, leaf)
        if _same_value(value, actor) or (value is None and OPTIM_DEFAULTS[leaf] == actor):
            raise Ignore(f"equal to {A}.optim.{leaf} (one learning-rate schedule here, for actor and critic)")
        raise Refuse(f"differs from {A}.optim.{leaf} = {actor!r}: the learning-rate schedule is one setting "
                     f"here (training.lr_warmup_steps / lr_schedule / min_lr_ratio, for actor and critic; only the "
                     f"critic's warm-up ratio is its own); set them equal")
    return convert


def _critic_enable(value: Any, v: View) -> Any:
    if value is False and v.get("algorithm.adv_estimator") == "gae":
        raise Refuse("gae needs the critic")
    raise Ignore("the critic is built when the advantage estimator needs it (gae), as verl's null does")


def _critic_path(value: Any, v: View) -> Any:
    if value in (None, v.get(f"{M_}.path")):
        raise Ignore("the critic starts from actor_rollout.model_path (trunk) with a zero-initialised value head")
    raise Refuse(f"a critic from another checkpoint than the actor ({v.get(f'{M_}.path')!r}): here the critic "
                 "always starts from actor_rollout.model_path")


def _reward_model(value: Any, v: View) -> Any:
    """verl 0.9.1 scores a sample with the discriminative reward model alone, on its legacy path and
    in its reward loop when no custom_reward_function is given (RewardLoopWorker.compute_score);
    with one, the user's function computes the reward and may query the model (GenRM, hybrids)."""
    if not _typed(value, bool):
        raise Ignore("no reward model")
    loop = v.typed("reward_model.use_reward_loop", bool)
    if loop and v.get("custom_reward_function.path") is not None:
        raise Refuse("with verl's reward loop and custom_reward_function.path, the user's function computes the "
                     "reward and may query the reward model through verl's reward router (a generative reward "
                     "model needs that); a reward function here cannot query the model. Drop "
                     "custom_reward_function to train on the model's score alone, or mix the model's and the "
                     "rule-based scores in our keys: reward.model_path, reward.model_weight, reward.rule_weight")
    path = v.get("reward_model.model.path")
    where = "verl's reward loop without a custom_reward_function" if loop else "verl's legacy path"
    return Out({"reward.model_path": _typed(path, str), "reward.rule_weight": 0.0},
               f"{where} trains on the reward model's score alone (reward.rule_weight = 0); it must be a "
               "sequence classifier sharing the policy's vocabulary (checked at start)")


def _reward_manager(value: Any, v: View) -> Any:
    name = _typed(value, str)
    same = {"naive": "each sample scored by its data_source's scorer, as here",
            "prime": "verl's prime manager runs the same scorers in a process pool",
            "batch": "verl's batch manager runs the same scorers on a batch",
            "dapo": "verl's dapo manager is the naive one plus the overlong buffer (reward.overlong_buffer, from "
                    "its overlong_buffer keys)"}
    if name in same:
        raise Ignore(same[name])
    raise Refuse(f"reward manager {name!r}: only verl's naive scoring (and dapo / prime / batch, which score "
                 "the same) exists here; remove it and write the scoring as custom_reward_function.path")


OVERLONG = "reward_model.reward_kwargs.overlong_buffer_cfg"  # verl's examples (main_ppo, dapo reward manager)
OVERLONG_RECIPE = "reward_model.overlong_buffer"  # verl's recipe/dapo (dapo_trainer.yaml): the same three keys


def _overlong_on(v: View, prefix: str = OVERLONG) -> bool:
    return v.typed(f"{prefix}.enable", Optional[bool]) is True


def _overlong_param(target: str, prefix: str = OVERLONG) -> Callable[[Any, View], Any]:
    """A parameter of DAPO's overlong penalty: ours when it is enabled."""
    ours = _when_ours(target)

    def convert(value: Any, v: View) -> Any:
        if not _overlong_on(v, prefix):
            raise Ignore(f"used only with {prefix}.enable=True")
        return ours(value, v)
    return convert


def _overlong_max_len(value: Any, v: View) -> Any:
    if not _overlong_on(v):
        raise Ignore(f"used only with {OVERLONG}.enable=True")
    if _typed(value, int) != v.typed("data.max_response_length", int):
        raise Refuse(f"differs from data.max_response_length ({v.get('data.max_response_length')!r}): here the "
                     "overlong penalty ends at algorithm.max_response_length")
    raise Ignore("equal to data.max_response_length, where our penalty ends")


def _save_freq(value: Any, v: View) -> Any:
    n = _typed(value, int)
    if n <= 0:
        return Out({"checkpoint.save_interval": 0}, "verl saves none; here only the final checkpoint")
    return n


def _test_freq(value: Any, v: View) -> Any:
    n = _typed(value, int)
    return Out({"logging.eval_interval": max(n, 0)}, "only at start and end" if n <= 0 else "")


def _resume(value: Any, v: View) -> Any:
    mode = _typed(value, str)
    if mode == "auto":
        return Out({"checkpoint.resume": True})
    if mode == "disable":
        return Out({"checkpoint.resume": False})
    raise Refuse(f"resume_mode {mode!r}: here a run resumes from the latest checkpoint in logging.output_dir "
                 "(auto) or not at all (disable)")


def _resume_from_path(value: Any, v: View) -> Any:
    """verl's _load_checkpoint reads resume_from_path only with resume_mode resume_path (auto: the latest
    checkpoint under default_local_dir; disable: none)."""
    mode = v.get("trainer.resume_mode")
    if mode != "resume_path":
        raise Ignore(f"read only with trainer.resume_mode=resume_path (verl too ignores it with {mode!r})")
    raise Refuse("resuming from another directory: here a run resumes from the latest checkpoint in "
                 "logging.output_dir; copy or link that checkpoint there and set trainer.resume_mode=auto")


def _keep(value: Any, v: View) -> Any:
    if value is None:
        raise Ignore("null (keep all): checkpoint.keep_last keeps its default")
    return _typed(value, int)


def _total_steps(value: Any, v: View) -> Any:
    if value is None:
        raise Ignore("null: see trainer.total_epochs")
    return _typed(value, int)


def _total_epochs(value: Any, v: View) -> Any:
    _typed(value, int)
    raise Ignore("this trainer stops after training.total_training_steps (one rollout batch each); verl stops at "
                 "whichever comes first, total_epochs passes over the data or trainer.total_training_steps. "
                 "Set trainer.total_training_steps to the steps verl would run")


def _float(value: Any, v: View) -> Any:
    return _typed(value, float)


def _betas(value: Any, v: View) -> Any:
    betas = _typed(value, list[float])
    if betas == [0.9, 0.999]:
        raise Ignore("AdamW (0.9, 0.999), as here")
    raise Refuse("AdamW betas are (0.9, 0.999) here")


def _optimizer(value: Any, v: View) -> Any:
    if str(value).lower() in ("adam", "adamw"):
        raise Ignore("AdamW, as here")
    raise Refuse(f"optimizer {value!r}: AdamW only here")


def _max_pos(value: Any, v: View) -> Any:
    return Out({"model.max_position_embeddings": _typed(value, int)},
               "a set model field must match the checkpoint's config.json (checked at start)")


def _same_weight_decay(value: Any, v: View) -> Any:
    return _same_as(f"{A}.optim.weight_decay", "weight decay")(value, v)


def _critic_mini(value: Any, v: View) -> Any:
    return _same_as(f"{A}.ppo_mini_batch_size", "mini-batch size")(value, v)


LORA_KEYS = ("a2a_experimental", "alpha", "dropout", "dropout_position", "dtype", "exclude_modules", "freeze_language_model", "freeze_vision_model", "freeze_vision_projection", "lora_A_init_method", "lora_B_init_method", "merge", "target_modules", "type")

RULES: tuple[Rule, ...] = (
    # ---------------------------------------------------------------- hydra and whole subtrees
    I("defaults", "hydra's defaults list (verl's defaults that change the result are built in: VERL_DEFAULTS)"),
    I("hydra.**", "hydra's own settings"),
    I("**._target_", HYDRA),
    I("global_profiler.**", PROFILE),
    I("*.profiler.**", PROFILE), I("*.*.profiler.**", PROFILE),
    I("ray_kwargs.**", RAY), I("ray_init.**", RAY),
    R("transfer_queue.enable", "verl's TransferQueue data path", ok=(False,)),
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
    R(f"{M_}.lora_rank", "LoRA training (only the low-rank adapters learn): not implemented here", ok=(0, None),
      fix="remove it to train every weight instead (full fine-tuning: gradients and Adam states for all parameters; `pfppo plan` shows whether that fits)"),
    R(f"{M_}.lora.rank", "LoRA training (only the low-rank adapters learn): not implemented here", ok=(0, None),
      fix="remove it to train every weight instead (full fine-tuning: gradients and Adam states for all parameters; `pfppo plan` shows whether that fits)"),
    R(f"{M_}.lora_adapter_path", "LoRA adapters: not implemented here", ok=(None,), fix=MERGE_ADAPTER),
    R(f"{M_}.lora.adapter_path", "LoRA adapters: not implemented here", ok=(None,), fix=MERGE_ADAPTER),
    I(f"{M_}.lora_alpha", "LoRA only (lora_rank > 0 is refused)"),
    I(f"{M_}.target_modules", "LoRA only (lora_rank > 0 is refused)"),
    I(f"{M_}.exclude_modules", "LoRA only (lora_rank > 0 is refused)"),
    I(f"{M_}.lora.**", "LoRA only (lora.rank > 0 is refused)", LORA_KEYS),
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
    I(f"{A}.calculate_sum_pi_squared", "a logged statistic"),
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
    M(f"{A}.megatron.dtype", "model.params_dtype", _dtype, why='bfloat16 / float32; float16 refused'),
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
    I("actor_rollout_ref.ref.log_prob_micro_batch_size", FORWARD_MICRO),
    I("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", FORWARD_MICRO),
    I("actor_rollout_ref.ref.log_prob_use_dynamic_bsz", FORWARD_MICRO),
    I("actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", FORWARD_MICRO),
    I("actor_rollout_ref.ref.*", REF_LAYOUT + "; " + SPEED),
    I("actor_rollout_ref.ref.**", REF_LAYOUT),
    # ---------------------------------------------------------------- rollout
    M(f"{R_}.name", "actor_rollout.engine", _engine, why='vllm; hf -> builtin; sglang, trtllm -> vllm (same distribution); others refused'),
    I(f"{R_}.mode", "sync or async serving inside verl; " + SPEED),
    M(f"{R_}.n", "actor_rollout.n_samples_per_prompt"),
    M(f"{R_}.temperature", "actor_rollout.temperature"),
    M(f"{R_}.top_p", "actor_rollout.top_p"),
    M(f"{R_}.top_k", "(top-k sampling)", _top_k, why='-1 / 0 (off) accepted; top-k refused'),
    M(f"{R_}.prompt_length", "data.max_prompt_length", _same_length("data.max_prompt_length"), why='must equal data.max_prompt_length'),
    M(f"{R_}.response_length", "algorithm.max_response_length", _same_length("data.max_response_length"), why='must equal data.max_response_length'),
    M(f"{R_}.gpu_memory_utilization", "actor_rollout.gpu_memory_utilization"),
    M(f"{R_}.tensor_model_parallel_size", "actor_rollout.tensor_model_parallel_size"),
    M(f"{R_}.checkpoint_engine.update_weights_bucket_megabytes", "actor_rollout.refit_bucket_mb"),
    I(f"{R_}.checkpoint_engine.**", "weight transfer to the engine (here actor_rollout.refit_*); " + SPEED,
      ("backend", "engine_kwargs")),
    I(f"{R_}.checkpoint_engine.engine_kwargs.**", "weight transfer to the engine; " + SPEED),
    R(f"{R_}.do_sample", "greedy training rollouts", ok=(True,)),
    R(f"{R_}.ignore_eos", "sampling past the end-of-sequence token", ok=(False,)),
    R(f"{R_}.over_sample_rate", "over-sampling and dropping the slowest rollouts", ok=(0, 0.0, None)),
    R(f"{R_}.skip_rollout", "replaying dumped rollouts", ok=(False,)),
    R(f"{R_}.quantization", "quantised rollouts", ok=(None,)),
    R(f"{R_}.quantization_config_file", "quantised rollouts", ok=(None,)),
    R(f"{R_}.multi_turn.enable", "multi-turn / tool-calling rollouts: not implemented here", ok=(False,),
      fix=SINGLE_TURN),
    I(f"{R_}.multi_turn.**", "multi-turn only (multi_turn.enable=True is refused)",
      ("format", "interaction_config_path", "max_assistant_turns", "max_parallel_calls", "max_tool_response_length",
       "max_user_turns", "num_repeat_rollouts", "tokenization_sanity_check_mode", "tool_config_path",
       "tool_response_truncate_side", "use_inference_chat_template")),
    R(f"{R_}.agent.default_agent_loop", "agent loops: single-turn generation only here", ok=("single_turn_agent",)),
    R(f"{R_}.agent.agent_loop_config_path", "agent loops: single-turn generation only here", ok=(None,)),
    R(f"{R_}.agent.custom_async_server.path", "a custom rollout server", ok=(None,)),
    I(f"{R_}.agent.**", "agent-loop workers; " + SPEED, ("num_workers", "custom_async_server.name")),
    I(f"{R_}.val_kwargs.**", "validation sampling; here every evaluation logs eval/accuracy (sampled at the "
                             "rollout temperature) and eval/accuracy_greedy",
      ("do_sample", "n", "temperature", "top_k", "top_p")),
    M(f"{R_}.dtype", "actor_rollout.dtype", _rollout_dtype, why="bfloat16 / float32; float16 refused"),
    M(f"{R_}.enforce_eager", "actor_rollout.enforce_eager", why="vLLM only; speed only"),
    M(f"{R_}.max_num_seqs", "actor_rollout.max_num_seqs", why="vLLM only; memory and speed only"),
    I(f"{R_}.log_prob_micro_batch_size", FORWARD_MICRO),
    I(f"{R_}.log_prob_micro_batch_size_per_gpu", FORWARD_MICRO),
    I(f"{R_}.log_prob_use_dynamic_bsz", FORWARD_MICRO),
    I(f"{R_}.log_prob_max_token_len_per_gpu", FORWARD_MICRO),
    I(f"{R_}.calculate_log_probs", "the engine's log-probs are always kept here"),
    I(f"{R_}.logprobs_mode", "the engine's log-probs feed only logged statistics and off-policy weights here"),
    *(I(f"{R_}.{k}", "a serving-engine setting; " + SPEED)
      for k in ("cudagraph_capture_sizes", "free_cache_engine", "data_parallel_size",
                "expert_parallel_size", "pipeline_model_parallel_size", "max_num_batched_tokens", "max_model_len",
                "enable_chunked_prefill", "enable_prefix_caching", "scheduling_policy",
                "load_format", "disable_log_stats", "multi_stage_wake_up", "layered_summon", "skip_dump_dir",
                "skip_tokenizer_init", "enable_rollout_routing_replay", "mtp")),
    I(f"{R_}.engine_kwargs.**", "a serving-engine setting; " + SPEED),
    I(f"{R_}.engine_kwargs", "a serving-engine setting; " + SPEED),
    I(f"{R_}.trace.**", "rollout tracing (logging)", ("backend", "max_samples_per_step_per_worker", "token2text")),
    I(f"{R_}.prometheus.**", "serving metrics (logging)", ("enable", "file", "port", "served_model_name")),
    I(f"{R_}.layer_name_map.**", "weight-name mapping of verl's refit (here pfppo_mega's)"),
    # ---------------------------------------------------------------- algorithm
    M("algorithm.adv_estimator", "algorithm.adv_estimator", _choice("algorithm.adv_estimator"), why='names in our registry; others refused'),
    M("algorithm.gamma", "algorithm.gamma"),
    M("algorithm.lam", "algorithm.lmbda"),
    M("algorithm.norm_adv_by_std_in_grpo", "algorithm.norm_adv_by_std_in_grpo", _norm_adv, why='ours once the tree has it'),
    M("algorithm.use_kl_in_reward", "(with actor.use_kl_loss)", _use_kl_in_reward, why='see actor.use_kl_loss'),
    M("algorithm.kl_penalty", "algorithm.kl_estimator", _kl_type("reward"), why='only with use_kl_in_reward alone (names as kl_loss_type)'),
    M("algorithm.kl_ctrl.kl_coef", "algorithm.kl_coeff", _kl_coef("reward"), why='only with use_kl_in_reward alone'),
    M("algorithm.kl_ctrl.type", "(fixed coefficient)", _kl_ctrl_type, why='fixed; adaptive refused when KL is in the reward'),
    I("algorithm.kl_ctrl.horizon", "adaptive KL controller only (refused)"),
    I("algorithm.kl_ctrl.target_kl", "adaptive KL controller only (refused)"),
    M("algorithm.use_pf_ppo", "algorithm.filtration.enable", _use_pf_ppo, why="verl's use_pf_ppo is policy filtration; our snapshot pool (algorithm.use_pf_ppo) stays off"),
    M("algorithm.pf_ppo.reweight_method", "algorithm.filtration.reweight_method",
      _choice("algorithm.filtration.reweight_method"), why="verl's three names are ours"),
    M("algorithm.pf_ppo.weight_pow", "algorithm.filtration.weight_pow"),
    M("algorithm.filter_groups.enable", "algorithm.filter_groups.enable", why="DAPO's dynamic sampling"),
    M("algorithm.filter_groups.max_num_gen_batches", "algorithm.filter_groups.max_num_gen_batches",
      why="verl stops the run when still short after them; here the batch is filled with agreeing groups "
          "(counted in dapo/filled_groups)"),
    R("algorithm.filter_groups.metric", "groups are compared on their raw rewards (verl's 'acc', 'score' and "
      "'seq_reward' for rule-based rewards); a KL-shaped metric is another rule", ok=("acc", "score", "seq_reward")),
    R("algorithm.rollout_correction.rollout_is", "verl's rollout importance weights", ok=(None,), fix=NO_CORRECTION),
    R("algorithm.rollout_correction.rollout_rs", "verl's rollout rejection sampling", ok=(None,), fix=NO_CORRECTION),
    M("algorithm.rollout_correction.bypass_mode", "algorithm.recompute_old_logp", _bypass_mode,
      why="true: recompute_old_logp false (the engine's log-probs are the proximal policy); only with "
          "loss_type ppo_clip, no rollout_is / rollout_rs, and loss_mode vanilla (what verl's bypass trains)"),
    R("algorithm.rollout_correction.loss_type", "verl's rollout-correction loss", ok=("ppo_clip",), fix=NO_CORRECTION),
    R("algorithm.rollout_correction.rollout_is_batch_normalize", "verl's rollout importance weights", ok=(False,),
      fix=NO_CORRECTION),
    I("algorithm.rollout_correction.**", "rollout correction only (refused when on)",
      ("rollout_is_threshold", "rollout_rs_threshold")),
    # ---------------------------------------------------------------- data
    M("data.train_files", "data.train_files, data.source", _files("data.train_files"), why='data.source = files'),
    M("data.val_files", "data.val_files", _files("data.val_files"), why='our evaluation scores the first data.eval_size rows'),
    M("data.prompt_key", "data.prompt_key"),
    M("data.reward_fn_key", "data.data_source_key"),
    M("data.max_prompt_length", "data.max_prompt_length"),
    M("data.max_response_length", "algorithm.max_response_length"),
    M("data.train_batch_size", "training.rollout_batch_size",
      why="prompts per step in both trees"),
    M("data.gen_batch_size", "algorithm.filter_groups.gen_batch_size", _gen_batch,
      why="prompts per round of DAPO's dynamic sampling (needs algorithm.filter_groups.enable; >= train_batch_size)"),
    M("data.shuffle", "data.shuffle"),
    M("data.filter_overlong_prompts", "data.overlong_prompts", _overlong, why='true: filter'),
    M("data.truncation", "data.overlong_prompts", _truncation,
      why="error / left / right / middle (without filtering): the same name; prompts cut as verl does"),
    R("data.tokenizer", "a tokenizer apart from the checkpoint's", ok=(None,), fix=COPY_TOKENIZER),
    R("data.train_max_samples", "training on a subset of the rows", ok=(-1, None)),
    I("data.val_max_samples", "validation only: here the first data.eval_size rows are scored"),
    I("data.val_batch_size", "validation batching; " + SPEED),
    I("data.seed", "every random draw here is seeded by training.seed"),
    I("data.use_shm", SPEED), I("data.dataloader_num_workers", SPEED), I("data.filter_overlong_prompts_workers", SPEED),
    I("data.return_raw_input_ids", "how verl passes prompts to its workers"),
    I("data.return_raw_chat", "how verl passes prompts to its workers (here rendered with the chat template)"),
    I("data.return_full_prompt", "how verl passes prompts to its workers"),
    I("data.trust_remote_code", "no checkpoint code is run here"),
    I("data.validation_shuffle", "validation order"),
    *(I(f"data.{k}", MULTIMODAL) for k in ("image_key", "video_key", "image_patch_size",
                                           "return_multi_modal_inputs")),
    I("data.tool_config_path", "multi-turn tools only (multi_turn.enable=True is refused)"),
    R("data.custom_cls.path", "a user's dataset class", ok=(None,),
      fix="write the rows as parquet or jsonl in verl's columns (prompt, data_source, reward_model.ground_truth) "
          "and remove data.custom_cls"), I("data.custom_cls.name", "custom_cls.path only"),
    R("data.sampler.class_path", "a user's curriculum sampler", ok=(None,),
      fix="remove it to draw the prompts in the data loader's order, without a curriculum"),
    I("data.sampler.class_name", "sampler.class_path only"),
    R("data.datagen.path", "a user's data generator", ok=(None,)), I("data.datagen.name", "datagen.path only"),
    R("data.apply_chat_template_kwargs", "extra chat-template arguments change the prompts", ok=({},)),
    R("data.apply_chat_template_kwargs.**", "extra chat-template arguments change the prompts",
      fix="remove it (the template's defaults apply), or make the value the default in the checkpoint's chat "
          "template"),
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
                                             "(training.micro_batch_size); " + SPEED),
    I("critic.ppo_micro_batch_size", "one micro-batch size for actor and critic here; " + SPEED),
    I("critic.forward_micro_batch_size", FORWARD_MICRO), I("critic.forward_micro_batch_size_per_gpu", FORWARD_MICRO),
    I("critic.use_dynamic_bsz", DYNAMIC_BSZ), I("critic.ppo_max_token_len_per_gpu", DYNAMIC_BSZ),
    I("critic.forward_max_token_len_per_gpu", DYNAMIC_BSZ),
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
    R("critic.model.lora_rank", "LoRA training: not implemented here", ok=(0, None), fix="remove it to train every weight instead (full fine-tuning: gradients and Adam states for all parameters; `pfppo plan` shows whether that fits)"),
    R("critic.model.lora.rank", "LoRA training: not implemented here", ok=(0, None), fix="remove it to train every weight instead (full fine-tuning: gradients and Adam states for all parameters; `pfppo plan` shows whether that fits)"),
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
    # ---------------------------------------------------------------- reward
    M("reward_model.enable", "reward.model_path, reward.rule_weight", _reward_model,
      why="the model's score alone (verl's legacy path, and its reward loop without custom_reward_function); "
          "the reward loop with a custom_reward_function refused"),
    I("reward_model.use_reward_loop", "read with reward_model.enable"),
    I("reward_model.model.path", "read with reward_model.enable"),
    I("reward_model.model.input_tokenizer", "here the reward model must share the policy's vocabulary "
                                            "(refused at start otherwise)"),
    R("reward_model.model.external_lib", "importing a user's model library", ok=(None,)),
    I("reward_model.model.**", "reward-model loading detail; " + SPEED,
      ("override_config", "trust_remote_code", "use_fused_kernels", "use_remove_padding", "use_shm")),
    I("reward_model.model.fsdp_config.**", FSDP),
    M("reward_model.reward_manager", "(rule-based scoring)", _reward_manager, why='naive, dapo, prime, batch score the same; others refused'),
    M(f"{OVERLONG}.enable", "reward.overlong_buffer.enable", _when_ours("reward.overlong_buffer.enable", (False, None)),
      why="DAPO's overlong penalty; refused until our tree has reward.overlong_buffer"),
    M(f"{OVERLONG}.len", "reward.overlong_buffer.len", _overlong_param("reward.overlong_buffer.len")),
    M(f"{OVERLONG}.penalty_factor", "reward.overlong_buffer.penalty_factor",
      _overlong_param("reward.overlong_buffer.penalty_factor")),
    I(f"{OVERLONG}.log", "logging of the overlong penalty"),
    M(f"{OVERLONG_RECIPE}.enable", "reward.overlong_buffer.enable",
      _when_ours("reward.overlong_buffer.enable", (False, None)), why="DAPO's overlong penalty (verl's recipe/dapo "
      "spelling; it ends at data.max_response_length)"),
    M(f"{OVERLONG_RECIPE}.len", "reward.overlong_buffer.len",
      _overlong_param("reward.overlong_buffer.len", OVERLONG_RECIPE)),
    M(f"{OVERLONG_RECIPE}.penalty_factor", "reward.overlong_buffer.penalty_factor",
      _overlong_param("reward.overlong_buffer.penalty_factor", OVERLONG_RECIPE)),
    I(f"{OVERLONG_RECIPE}.log", "logging of the overlong penalty"),
    M("reward_model.reward_kwargs.max_resp_len", "(algorithm.max_response_length)", _overlong_max_len,
      why="the overlong penalty's length: must equal data.max_response_length"),
    R("reward_model.reward_kwargs.**", "arguments of a verl reward manager",
      fix="remove them with the reward manager that reads them; write its scoring as custom_reward_function.path"),
    R("reward_model.reward_loop_source", "a user's reward loop", ok=("register",)),
    R("reward_model.reward_loop_module_path", "a user's reward loop", ok=(None,)),
    R("reward_model.reward_loop_class_name", "a user's reward loop", ok=(None,)),
    R("reward_model.sandbox_fusion.url", "code execution rewards (sandbox fusion)", ok=(None,),
      fix="remove it and run the code check in your own custom_reward_function.path"),
    I("reward_model.sandbox_fusion.**", "sandbox fusion only (refused)", ("max_concurrent", "memory_limit_mb")),
    I("reward_model.launch_reward_fn_async", SPEED),
    I("reward_model.rollout.**", "a generative reward model's server (refused with reward_model.enable)"),
    *(I(f"reward_model.{k}", "reward-model placement and batching; " + SPEED)
      for k in ("enable_resource_pool", "n_gpus_per_node", "nnodes", "strategy", "micro_batch_size",
                "micro_batch_size_per_gpu", "max_length", "use_dynamic_bsz", "forward_max_token_len_per_gpu",
                "nccl_timeout", "load_weight", "num_workers", "ulysses_sequence_parallel_size")),
    I("reward_model.megatron.**", "the reward model uses the actor's layout here"),
    M("reward_manager.name", "(rule-based scoring)", _reward_manager, why='naive, dapo, prime, batch score the same; others refused'),
    R("reward_manager.source", "a user's reward manager", ok=("register",)),
    R("reward_manager.module.path", "a user's reward manager", ok=(None,)),
    I("reward_manager.module.name", "reward_manager.module.path only"),
    M("custom_reward_function.path", "reward.custom_function.path"),
    M("custom_reward_function.name", "reward.custom_function.name"),
    R("custom_reward_function.reward_kwargs", "extra arguments of the reward function", ok=({},)),
    R("custom_reward_function.reward_kwargs.**", "extra arguments of the reward function"),
    # ---------------------------------------------------------------- trainer
    M("trainer.total_training_steps", "training.total_training_steps", _total_steps, why='null: see total_epochs'),
    M("trainer.total_epochs", "(run length)", _total_epochs, why='ignored: our run length is training.total_training_steps (set trainer.total_training_steps)'),
    M("trainer.critic_warmup", "training.critic_warmup_steps"),
    M("trainer.save_freq", "checkpoint.save_interval", _save_freq, why='-1: only the final checkpoint'),
    M("trainer.test_freq", "logging.eval_interval", _test_freq, why='-1: only at start and end'),
    M("trainer.resume_mode", "checkpoint.resume", _resume, why='auto: resume; disable: not; resume_path refused'),
    M("trainer.resume_from_path", "checkpoint.resume", _resume_from_path,
      why="read only with resume_mode resume_path (refused), as verl"),
    M("trainer.default_local_dir", "logging.output_dir", why="checkpoints go under it here"),
    M("trainer.max_actor_ckpt_to_keep", "checkpoint.keep_last", _keep, why='null: our default'),
    I("trainer.max_critic_ckpt_to_keep", "one checkpoint holds actor and critic here (checkpoint.keep_last)"),
    I("trainer.val_before_train", "here the held-out set is always scored at start and end"),
    I("trainer.val_only", "here `pfppo train` always trains"),
    I("trainer.log_val_generations", LOGS), I("trainer.rollout_data_dir", LOGS),
    I("trainer.validation_data_dir", LOGS),
    I("trainer.logger", LOGS), I("trainer.project_name", LOGS), I("trainer.experiment_name", LOGS),
    I("trainer.tensorboard_dir", LOGS), I("trainer.rl_logging_board_dir", LOGS),
    I("trainer.nnodes", RAY), I("trainer.n_gpus_per_node", RAY),
    I("trainer.ray_wait_register_center_timeout", RAY),
    R("trainer.device", "only CUDA GPUs (or the CPU for tests) here", ok=("cuda",),
      fix="set it to cuda (or remove it) and run on NVIDIA GPUs"),
    I("trainer.balance_batch", "reorders rows over data-parallel ranks by length; " + SPEED),
    I("trainer.esi_redundant_time", "checkpointing before a preemption deadline"),
    I("trainer.del_local_ckpt_after_load", "checkpoint housekeeping"),
    I("trainer.default_hdfs_dir", "checkpoint copies to HDFS"),
    I("trainer.use_legacy_worker_impl", "verl's choice of worker implementation"),
)

_EXACT: dict[str, Rule] = {}
for _r in RULES:
    if "*" not in _r.pattern and _r.pattern not in _EXACT:
        _EXACT[_r.pattern] = _r
_PATTERNS = tuple(r for r in RULES if "*" in r.pattern)


def rule_for(key: str) -> Rule | None:
    """The first rule of RULES for verl key `key` (exact keys before patterns), or None."""
    if key in _EXACT:
        return _EXACT[key]
    for rule in _PATTERNS:
        if rule.matches(key):
            return rule
    return None


# ----------------------------------------------------------------------------- layout


def is_verl_layout(top_keys: Mapping[str, Any] | Iterable[str], override_keys: Iterable[str] = ()) -> bool:
    """True when a config (its top-level mapping) or an override key uses one of verl's own sections."""
    tops = top_keys if isinstance(top_keys, Mapping) else dict.fromkeys(top_keys)
    for head, value in tops.items():
        head = str(head).split(".")[0]
        if head == "trainer" and isinstance(value, Mapping) and set(map(str, value)) <= set(_NATIVE_TRAINER_KEYS):
            continue
        if head in VERL_HEADS:
            return True
    for key in override_keys:
        parts = strip_hydra(key.split("=", 1)[0]).split(".")
        if parts[0] == "trainer" and parts[1:] and parts[1] in _NATIVE_TRAINER_KEYS:
            continue
        if parts[0] in VERL_HEADS:
            return True
    return False


def strip_hydra(key: str) -> str:
    """`+key`, `++key` (hydra's additions) and `~key` (deletion) -> `key`."""
    return key.lstrip("+~").strip()


def is_verl_key(key: str) -> bool:
    """Whether a dotted key of a verl-layout config is verl's (else it is one of ours)."""
    head = key.split(".")[0]
    if head in VERL_HEADS or head in ("defaults", "hydra"):
        return True
    if head not in SHARED_HEADS:
        return False
    return rule_for(key) is not None or not native_knows(key)


def native_knows(key: str) -> bool:
    """Whether `key` is a key (or alias, or a section) of our tree."""
    cls: Any = Config
    parts = key.split(".")
    i = 0
    while i < len(parts):
        types_ = field_types(cls)
        if parts[i] in types_:
            tp = types_[parts[i]]
            i += 1
            if i == len(parts):
                return True
            if not (isinstance(tp, type) and dataclasses.is_dataclass(tp)):
                return False
            cls = tp
            continue
        rest = ".".join(parts[i:])
        return any(rest == a or rest.startswith(a + ".") for a in cls.ALIASES) or \
            any(a.startswith(rest + ".") for a in cls.ALIASES) or parts[i] in cls.IGNORED
    return True


# ----------------------------------------------------------------------------- interpolation

_INTERP_RE = re.compile(r"\$\{((?:[^${}]|\{\})*)\}")  # ${...}; an empty {} inside (a default) allowed


def resolve_interpolations(given: dict[str, Any]) -> dict[str, Any]:
    """``${a.b}``, ``${.sibling}`` and ``${oc.select:a.b,default}`` between verl keys resolved (a
    value that is one interpolation takes the other key's value and type); one that cannot be
    resolved (an environment variable, a cycle, an absent key without default) stays a string."""
    import yaml

    def lookup(ref: str, owner: str, depth: int) -> Any:
        if ref.startswith("."):
            parent = owner.rsplit(".", 1)[0] if "." in owner else ""
            ref = f"{parent}.{ref.lstrip('.')}" if parent else ref.lstrip(".")
        if ref in given:
            return value_of(ref, depth + 1)
        if ref in VERL_DEFAULTS:
            return VERL_DEFAULTS[ref]
        raise KeyError(ref)

    def one(expr: str, owner: str, depth: int) -> Any:
        expr = expr.strip()
        if expr.startswith("oc.select:"):
            ref, _, default = expr[len("oc.select:"):].partition(",")
            try:
                return lookup(ref.strip(), owner, depth)
            except KeyError:
                if not _:
                    return None
                text = default.strip()
                try:
                    return yaml.safe_load(text) if len(text) < 200 else text
                except yaml.YAMLError:
                    return text
        if ":" in expr:  # oc.env and other resolvers
            raise KeyError(expr)
        return lookup(expr, owner, depth)

    done: dict[str, Any] = {}

    def value_of(key: str, depth: int = 0) -> Any:
        if key in done:
            return done[key]
        value = given[key]
        if depth > _MAX_INTERPOLATION_DEPTH or not isinstance(value, str) or "${" not in value:
            return value
        whole = _INTERP_RE.fullmatch(value.strip())
        try:
            if whole:
                out = one(whole.group(1), key, depth)
            else:
                out = _INTERP_RE.sub(lambda m: str(one(m.group(1), key, depth)), value)
        except (KeyError, RecursionError):
            out = value
        done[key] = out
        return out

    return {k: value_of(k) for k in given}


# ----------------------------------------------------------------------------- translate


def translate(items: Sequence[tuple[str, Any, str]], native: Mapping[str, Any] | None = None) -> Translation:
    """Translate verl keys: `items` are (dotted verl key, value, source) in order (file first, then
    overrides: a later one replaces an earlier one of the same key; `~key` deletes it). `native`:
    our own keys the config sets (dotted key -> value), read where a verl key depends on one."""
    given: dict[str, Any] = {}
    sources: dict[str, str] = {}
    deleted: list[tuple[str, str]] = []
    for key, value, source in items:
        if key.startswith("~"):
            name = strip_hydra(key)
            given = {k: v for k, v in given.items() if k != name and not k.startswith(name + ".")}
            deleted.append((name, source))
            continue
        name = strip_hydra(key)
        given.pop(name, None)  # re-insert: order of last setting
        given[name] = value
        sources[name] = source
    given = resolve_interpolations(given)
    view = View(given, native)
    out = Translation()
    for name, source in deleted:
        out.uses.append(VerlUse(name, None, "ignored", "deleted (~): verl's default applies", source))
    for key, value in given.items():
        _apply(key, value, sources[key], view, out, explicit=True)
    for key, value in VERL_DEFAULTS.items():
        if key not in given:
            _apply(key, value, "verl default", view, out, explicit=False)
    for key, (value, why) in VERL_FIXED.items():
        if key not in out.values:
            out.values[key] = value
            out.origin[key] = ("(verl layout)", value, False)
            out.uses.append(VerlUse("(verl layout)", value, "mapped", f"{key} = {value!r} ({why})", "verl default"))
    return out


def _apply(key: str, value: Any, source: str, view: View, out: Translation, *, explicit: bool) -> None:
    rule = rule_for(key)
    if rule is None:
        out.problems.append(Problem(key, value, "unknown key (verl layout); " + suggest(key)))
        return
    try:
        if rule.action == "ignore":
            raise Ignore(rule.why)
        if rule.action == "refuse":
            if any(_same_value(value, ok) for ok in rule.ok):
                raise Ignore(f"nothing to honour at this value (others are refused: {rule.why})")
            raise Refuse(refusal(rule))
        if isinstance(value, str) and "${" in value:
            raise Bad("an interpolation that cannot be resolved here (an environment variable, a cycle, or a key "
                      "that is not set); give the value")
        result = rule.convert(value, view) if rule.convert else _typed(value, _native_type(rule.target))
        if not isinstance(result, Out):
            result = Out({rule.target: result}, rule.why)
    except Ignore as e:
        if explicit:
            out.uses.append(VerlUse(key, value, "ignored", str(e), source))
        return
    except Refuse as e:
        out.uses.append(VerlUse(key, value, "refused", str(e), source))
        out.problems.append(Problem(key, value, f"refused (verl layout): {e}"))
        return
    except Bad as e:
        out.problems.append(Problem(key, value, f"{e} (verl layout)"))
        return
    except _Unreadable:
        return  # the key it consults reports its own problem
    for target, v in result.values.items():
        earlier = out.origin.get(target)
        if earlier and earlier[2] and explicit and not _same_value(earlier[1], v):
            out.problems.append(Problem(key, value, f"sets {target} = {v!r}, but {earlier[0]} sets it to "
                                                    f"{earlier[1]!r}; keep one"))
            continue
        if earlier and earlier[2] and not explicit:
            continue  # an explicit verl key already set it
        out.values[target] = v
        out.origin[target] = (key, v, explicit)
    detail = ", ".join(f"{t} = {v!r}" for t, v in result.values.items())
    out.uses.append(VerlUse(key, value, "mapped", detail + (f" ({result.note})" if result.note else ""), source))


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, bool) != isinstance(b, bool):
        return False
    return type(a) is type(b) and a == b or (isinstance(a, (int, float)) and isinstance(b, (int, float))
                                             and not isinstance(a, bool) and a == b)


@functools.cache
def _native_keys(cls: Any, path: str) -> tuple[str, ...]:
    out: list[str] = []
    for name, tp in field_types(cls).items():
        full = f"{path}.{name}" if path else name
        out += _native_keys(tp, full) if isinstance(tp, type) and dataclasses.is_dataclass(tp) else [full]
    return tuple(out)


def suggest(key: str) -> str:
    """'did you mean ...' for an unknown verl key, else where the table lives."""
    named = [k for r in RULES for k in r.spellings() if "*" not in k]
    if key.split(".")[0] in SHARED_HEADS:  # or one of ours there
        named += _native_keys(Config, "")
    match = difflib.get_close_matches(key, named, n=1, cutoff=0.8)
    if match:
        return f"did you mean {match[0]}?"
    parent = key.rsplit(".", 1)[0]
    siblings = [k.rsplit(".", 1)[1] for k in named if k.rsplit(".", 1)[0] == parent]
    if siblings:
        near = difflib.get_close_matches(key.rsplit(".", 1)[1], siblings, n=1, cutoff=0.6)
        if near:
            return f"did you mean {parent}.{near[0]}?"
        return f"verl keys of {parent} known here: {', '.join(sorted(siblings))}"
    return "not a verl key this translation knows (docs/verl.md lists them)"
