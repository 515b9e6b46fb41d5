"""The typed config tree. The YAML mirrors it 1:1: one section a dataclass, one key a field.

Each field carries its documentation in ``metadata["doc"]`` (the config reference is generated
from it, see ``pfppo_mega.config.reference``). Each section checks its own values in
``__post_init__`` and reports every problem it finds with the key, the value and the rule.
Types, unknown keys, aliases and command-line overrides are handled by
``pfppo_mega.config.loader`` before the sections are built.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Optional

from pfppo_mega import constants as C
from pfppo_mega.registry import ADV_ESTIMATORS, ROLLOUT_ENGINES


# ----------------------------------------------------------------------------- error reporting


@dataclass(frozen=True)
class Problem:
    """One thing wrong in a config: the dotted key, the value found and the rule it breaks."""

    key: str
    value: Any
    rule: str

    def prefixed(self, prefix: str) -> "Problem":
        return Problem(f"{prefix}.{self.key}" if prefix else self.key, self.value, self.rule)

    def __str__(self) -> str:
        shown = repr(self.value)
        if len(shown) > 120:  # e.g. a hostile override value: its start and its length
            shown = f"{shown[:80]}... ({len(shown)} characters)"
        return f"{self.key} = {shown}: {self.rule}"


class ConfigError(ValueError):
    """Raised with every problem found, so one run of `pfppo validate` lists them all."""

    def __init__(self, problems: list[Problem]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} config problem(s):\n{lines}")


def opt(default: Any = dataclasses.MISSING, doc: str = "", *, factory: Any = None) -> Any:
    """A config field with its documentation (shown in docs/config_reference.md)."""
    if factory is not None:
        return field(default_factory=factory, metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


class Section:
    """Base of every section: collects the problems of ``_check`` and raises them together.

    Before a section's own rules, every float key must be finite (no inf, -inf or nan: none of
    them means "off" anywhere in the tree; null does where a key allows it). After them, an int
    key that no rule bounded is still refused beyond +-constants.INT_LIMIT. One problem per key.
    """

    # verl / article spellings accepted on load: alias key path -> canonical key (in this section).
    ALIASES: ClassVar[dict[str, str]] = {}
    # key -> the values it may take; checked before ``_check`` and listed in the reference.
    CHOICES: ClassVar[dict[str, tuple]] = {}
    # key -> {alternative spelling of a value: canonical value}; applied by the section itself,
    # declared here so the loader can note the rewrite and the reference can list it.
    VALUE_ALIASES: ClassVar[dict[str, dict[str, str]]] = {}
    # keys of other projects accepted and ignored (with a printed note): key -> (type, why).
    IGNORED: ClassVar[dict[str, tuple[type, str]]] = {}

    def __post_init__(self) -> None:
        problems: list[Problem] = []
        types_ = field_types(type(self))
        for key, tp in types_.items():
            value = getattr(self, key)
            if value_type(tp) is float and isinstance(value, (int, float)) \
                    and not isinstance(value, bool) and not math.isfinite(value):
                problems.append(Problem(key, value, "must be a finite number (not inf or nan)"))
        for key, allowed in self.CHOICES.items():
            _choice(problems, key, getattr(self, key), allowed)
        self._check(problems)
        reported = {q.key for q in problems}
        for key, tp in types_.items():
            value = getattr(self, key)
            if value_type(tp) is int and isinstance(value, int) and key not in reported:
                _range(problems, key, value, ge=-C.INT_LIMIT, le=C.INT_LIMIT)
        if problems:
            raise ConfigError(problems)

    def _check(self, p: list[Problem]) -> None:  # overridden by sections with rules
        pass


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """Field name -> resolved type (the tree uses `from __future__ import annotations`)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def value_type(tp: Any) -> Any:
    """X for X and Optional[X]; other types unchanged."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is not Literal and len(args) == 1 and len(typing.get_args(tp)) == 2:
        return args[0]
    return tp


def _choice(p: list[Problem], key: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        p.append(Problem(key, value, f"must be one of {', '.join(map(repr, allowed))}"))


def _nonblank_dir(p: list[Problem], key: str, value: Any) -> None:
    """A run directory: an empty or blank name would write into the current directory."""
    if isinstance(value, str) and not value.strip():
        p.append(Problem(key, value, "must name a directory (empty or blank would write into the current "
                                     "directory); set it, e.g. runs/my_run"))


def _range(
    p: list[Problem], key: str, value: Any, *, ge=None, gt=None, le=None, lt=None, optional=False
) -> None:
    if any(q.key == key for q in p):  # one problem per key (e.g. "must be finite" came first)
        return
    if value is None:
        if not optional:
            p.append(Problem(key, value, "must be set"))
        return
    rules = [(ge, ">=", value >= ge if ge is not None else True),
             (gt, ">", value > gt if gt is not None else True),
             (le, "<=", value <= le if le is not None else True),
             (lt, "<", value < lt if lt is not None else True)]
    bounds = [f"{op} {bound}" for bound, op, _ in rules if bound is not None]
    if not all(ok for _, _, ok in rules):
        p.append(Problem(key, value, "must be " + " and ".join(bounds)))


# ----------------------------------------------------------------------------- sections



@dataclass
class LoraConfig(Section):
    """LoRA training of the actor (pfppo_mega/models/lora.py): the base weights stay frozen (no gradients,
    no optimizer state) and a low-rank adapter W + (alpha / rank) * B @ A learns on each targeted linear of
    the decoder layers. B starts at zero, so step 0 is the base model. The reference policy is the actor
    with its adapters off (no second copy of the weights); rollout engines, pool snapshots and HF exports
    get the merged weights."""

    rank: int = opt(0, "Adapter rank r; 0 = LoRA off (every weight trains).")
    alpha: float = opt(16.0, "Scale numerator: the adapter adds (alpha / rank) * B @ A.")
    target_modules: list[str] = opt(
        factory=lambda: [C.LORA_ALL],
        doc=f"Linears that get an adapter: {C.LORA_ALL!r} (every one of the decoder layers; not the LM head), "
            f"megatron names ({', '.join(C.LORA_LINEARS)}) or Hugging Face ones "
            f"({', '.join(n for parts in C.LORA_HF_PARTS.values() for n in parts)}). A fused megatron linear "
            f"takes one adapter, so q/k/v_proj come together and gate/up_proj come together.")
    exclude_modules: list[str] = opt(
        factory=list, doc="Regular expressions; a targeted linear whose megatron or HF module name "
                          "(decoder.layers.3.mlp.linear_fc1, model.layers.3.mlp.gate_proj) matches one is left "
                          "without an adapter (both parts of a fused linear, or neither).")
    init_a: str = opt("kaiming", "Initialisation of A: kaiming (PEFT's kaiming_uniform with a = sqrt 5) or "
                                 "xavier (megatron's / verl-megatron's); B is always zero.")
    dropout: float = opt(0.0, "Dropout on the adapter input: only 0 (a dropout would make the recomputed "
                              "old log-probs differ from the update's).")
    adapter_path: Optional[str] = opt(None, "A PEFT adapter directory (adapter_model.safetensors + "
                                            "adapter_config.json) loaded onto the base at start; rank null or 0 "
                                            "takes rank, alpha and target_modules from its adapter_config.json.")

    CHOICES: ClassVar[dict[str, tuple]] = {"init_a": C.LORA_INITS}

    @property
    def enabled(self) -> bool:
        return self.rank > 0 or self.adapter_path is not None

    def _check(self, p: list[Problem]) -> None:
        _range(p, "rank", self.rank, ge=0, le=C.MAX_MODEL_DIM)
        _range(p, "alpha", self.alpha, gt=0)
        _range(p, "dropout", self.dropout, ge=0, le=0)
        if isinstance(self.adapter_path, str) and not self.adapter_path.strip():
            p.append(Problem("adapter_path", self.adapter_path, "must name a directory or be null"))
        problem = lora_target_problem(self.target_modules)
        if problem is not None:
            p.append(Problem("target_modules", self.target_modules, problem))
        for pattern in self.exclude_modules:
            try:
                re.compile(pattern)
            except (re.error, TypeError) as e:
                p.append(Problem("exclude_modules", pattern, f"not a regular expression ({e})"))
                break


def lora_targets(names: list[str]) -> tuple[str, ...]:
    """The megatron linears (in C.LORA_LINEARS order) that target_modules ``names`` select (ValueError
    names what cannot be expressed: an unknown name, part of a fused linear's projections)."""
    problem = lora_target_problem(names)
    if problem is not None:
        raise ValueError(f"model.lora.target_modules = {names!r}: {problem}")
    chosen = set(names)
    if C.LORA_ALL in chosen:
        return C.LORA_LINEARS
    return tuple(m for m, parts in C.LORA_HF_PARTS.items() if m in chosen or set(parts) & chosen)


def lora_target_problem(names: Any) -> Optional[str]:
    """Why ``names`` is not a valid target_modules, or None."""
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        return "must be a non-empty list of module names"
    known = {C.LORA_ALL, *C.LORA_LINEARS, *(n for parts in C.LORA_HF_PARTS.values() for n in parts)}
    unknown = [n for n in names if n not in known]
    if unknown:
        return (f"unknown module name(s) {unknown}: use {C.LORA_ALL!r}, {', '.join(C.LORA_LINEARS)} or "
                f"{', '.join(n for parts in C.LORA_HF_PARTS.values() for n in parts)} (the LM head and embedding "
                f"take no adapter)")
    chosen = set(names)
    for linear, parts in C.LORA_HF_PARTS.items():
        some = [n for n in parts if n in chosen]
        if some and len(some) < len(parts):
            return (f"{', '.join(some)} without {', '.join(n for n in parts if n not in chosen)}: megatron fuses "
                    f"{' / '.join(parts)} into one {linear}, whose adapter (one A and one B over the whole output) "
                    f"covers all of them; name all of them (or {linear})")
    return None


@dataclass
class ModelConfig(Section):
    """Shape of the Llama-style decoder shared by actor, critic and reference.

    Every field left unset (null) is read from the checkpoint's config.json
    (`actor_rollout.model_path`); a field that is set must match the checkpoint.
    """

    num_layers: Optional[int] = opt(None, "Transformer layers.")
    hidden_size: Optional[int] = opt(None, "Model width d_model.")
    ffn_hidden_size: Optional[int] = opt(None, "SwiGLU inner width (HF intermediate_size).")
    num_attention_heads: Optional[int] = opt(None, "Query heads.")
    num_query_groups: Optional[int] = opt(
        None, "Key/value heads for grouped-query attention (HF num_key_value_heads)."
    )
    vocab_size: Optional[int] = opt(None, "Vocabulary size (must equal the tokenizer's).")
    max_position_embeddings: Optional[int] = opt(None, "Longest prompt + response in tokens.")
    rope_theta: Optional[float] = opt(None, "RoPE base.")
    norm_epsilon: Optional[float] = opt(None, "RMSNorm epsilon.")
    tie_word_embeddings: Optional[bool] = opt(None, "Share the input embedding and the LM head.")
    params_dtype: str = opt(
        "float32", "Parameter and compute dtype of the trainer models. bfloat16: bf16 weights and compute, "
                   "with fp32 main weights, fp32 gradients and fp32 Adam states in megatron's optimizer. float16: "
                   "the same with fp16 weights and compute, and megatron's loss scaler (loss_scale, "
                   "initial_loss_scale, min_loss_scale, loss_scale_window, loss_scale_hysteresis): the loss is "
                   "multiplied by the scale before the backward, and a step whose gradients hold an inf/nan is "
                   "skipped (counted in guard/loss_scale_overflows and guard/skipped_updates) and lowers the "
                   "scale; the scaler's state is in the checkpoint. verl's megatron.dtype float16 (fp16 removes "
                   "much of the training/inference mismatch when the engine also runs float16).")
    loss_scale: Optional[float] = opt(
        None, "float16: a constant loss scale (> 0); null = dynamic (megatron's DynamicGradScaler). Read only "
              "with params_dtype float16.")
    initial_loss_scale: float = opt(2.0 ** 32, "float16, dynamic: the first scale (megatron's default 2^32; "
                                               "the first steps overflow and halve it).")
    min_loss_scale: float = opt(1.0, "float16, dynamic: the scale never falls below it, in (0, initial_loss_scale].")
    loss_scale_window: int = opt(1000, "float16, dynamic: the scale doubles after this many steps without "
                                       "an inf/nan gradient.")
    loss_scale_hysteresis: int = opt(2, "float16, dynamic: inf/nan steps tolerated before the first halving "
                                        "(megatron's hysteresis); later ones halve at once until a clean window.")
    layer_spec: str = opt(
        "auto", "Transformer layer implementation: local (megatron's layers in pure torch, any machine; with "
                "training.fused_layers their fused version: SDPA / flash attention, fused RMSNorm, SwiGLU and "
                "RoPE), transformer_engine (TE's layers and attention; GPUs with transformer-engine installed, "
                "refused at start otherwise) or auto (transformer_engine on GPUs where it is installed, local "
                "elsewhere). All three have the same parameters and checkpoint layout "
                "(pfppo_mega/models/fused_layers.py).")
    lora: LoraConfig = opt(factory=LoraConfig, doc="LoRA training of the actor (rank 0: off).")

    ALIASES: ClassVar[dict[str, str]] = {
        "num_hidden_layers": "num_layers",
        "intermediate_size": "ffn_hidden_size",
        "num_key_value_heads": "num_query_groups",
        "rms_norm_eps": "norm_epsilon",
        "seq_length": "max_position_embeddings",
    }
    CHOICES: ClassVar[dict[str, tuple]] = {"params_dtype": C.PARAMS_DTYPES, "layer_spec": C.LAYER_SPECS}

    SHAPE_FIELDS: ClassVar[tuple[str, ...]] = (
        "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
        "num_query_groups", "vocab_size", "max_position_embeddings", "rope_theta",
        "norm_epsilon", "tie_word_embeddings",
    )

    def _check(self, p: list[Problem]) -> None:
        for key in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                    "num_query_groups"):
            _range(p, key, getattr(self, key), ge=1, le=C.MAX_MODEL_DIM, optional=True)
        for key in ("vocab_size", "max_position_embeddings"):
            _range(p, key, getattr(self, key), ge=1, le=C.MAX_TOKENS, optional=True)
        _range(p, "rope_theta", self.rope_theta, gt=0, optional=True)
        _range(p, "norm_epsilon", self.norm_epsilon, gt=0, optional=True)
        self._check_loss_scaling(p)
        h, q = self.num_attention_heads, self.num_query_groups
        if h and self.hidden_size and self.hidden_size % h:
            p.append(Problem("hidden_size", self.hidden_size,
                             f"must be divisible by num_attention_heads ({h})"))
        if h and q and h % q:
            p.append(Problem("num_query_groups", q,
                             f"must divide num_attention_heads ({h})"))

    def is_complete(self) -> bool:
        return all(getattr(self, k) is not None for k in self.SHAPE_FIELDS)

    SCALER_DEFAULTS: ClassVar[dict[str, Any]] = {"loss_scale": None, "initial_loss_scale": 2.0 ** 32,
                                                  "min_loss_scale": 1.0, "loss_scale_window": 1000,
                                                  "loss_scale_hysteresis": 2}

    def _check_loss_scaling(self, p: list[Problem]) -> None:
        _range(p, "loss_scale", self.loss_scale, gt=0, le=C.MAX_LOSS_SCALE, optional=True)
        _range(p, "initial_loss_scale", self.initial_loss_scale, gt=0, le=C.MAX_LOSS_SCALE)
        _range(p, "min_loss_scale", self.min_loss_scale, gt=0, le=C.MAX_LOSS_SCALE)
        _range(p, "loss_scale_window", self.loss_scale_window, ge=1, le=C.MAX_STEPS)
        _range(p, "loss_scale_hysteresis", self.loss_scale_hysteresis, ge=1, le=C.MAX_STEPS)
        lo, hi = self.min_loss_scale, self.initial_loss_scale
        if not any(q.key in ("min_loss_scale", "initial_loss_scale") for q in p) and lo > hi:
            p.append(Problem("min_loss_scale", lo, f"must be <= initial_loss_scale ({hi})"))
        if self.params_dtype != "float16":
            for key, default in self.SCALER_DEFAULTS.items():
                if getattr(self, key) != default and not any(q.key == key for q in p):
                    p.append(Problem(key, getattr(self, key),
                                     f"is read only with params_dtype float16 (here {self.params_dtype!r}: "
                                     f"no loss scaler); remove it or set params_dtype float16"))


@dataclass
class ParallelConfig(Section):
    """Megatron parallel layout. data parallel size = world size / (tp * pp)."""

    tensor_model_parallel_size: int = opt(1, "Tensor-parallel degree (TP).")
    pipeline_model_parallel_size: int = opt(1, "Pipeline-parallel degree (PP).")
    backend: str = opt("auto", "torch.distributed backend: auto (nccl on GPUs, else gloo), gloo or nccl.")
    collective_timeout_s: float = opt(
        C.COLLECTIVE_TIMEOUT_S, "Longest wait (s) of any collective of the trainer's process groups (gloo and NCCL alike): a rank "
        "that stalls (SIGSTOP, a hung kernel, a dead node) ends the job with an error naming this key instead of "
        "leaving the others waiting. Refits have their own bound, actor_rollout.refit_timeout_s."
    )
    watchdog_s: float = opt(
        120.0, "Heartbeat watchdog (multi-rank runs): a rank whose heartbeat has not moved for this many seconds "
               "(stopped, hung in a collective, a frozen node) is named by its peers, which end with exit status "
               "75 instead of waiting collective_timeout_s. 0 = off. Independent of collective_timeout_s, which "
               "still covers slow collectives.")
    sequence_parallel: bool = opt(
        False, "Megatron sequence parallelism: activations outside attention / MLP split over the TP ranks "
               "along the sequence. Needs tensor_model_parallel_size > 1 and GPUs (refused on CPU at start).")
    use_distributed_optimizer: bool = opt(
        False, "Shard the fp32 main weights and Adam states over the data-parallel ranks (megatron's "
               "distributed optimizer, ZeRO-1 style).")
    virtual_pipeline_size: Optional[int] = opt(
        None, "Interleaved pipeline: model chunks per pipeline stage (>= 2; null = not interleaved). Needs "
              "pipeline_model_parallel_size >= 2 and num_layers divisible by pp x this.")

    ALIASES: ClassVar[dict[str, str]] = {
        "tp": "tensor_model_parallel_size",
        "pp": "pipeline_model_parallel_size",
        "tensor_parallel_size": "tensor_model_parallel_size",
        "pipeline_parallel_size": "pipeline_model_parallel_size",
    }
    CHOICES: ClassVar[dict[str, tuple]] = {"backend": C.PARALLEL_BACKENDS}

    def _check(self, p: list[Problem]) -> None:
        _range(p, "tensor_model_parallel_size", self.tensor_model_parallel_size, ge=1, le=C.MAX_PARALLEL)
        _range(p, "collective_timeout_s", self.collective_timeout_s, gt=0, le=C.MAX_REFIT_TIMEOUT_S)
        _range(p, "watchdog_s", self.watchdog_s, ge=0, le=C.MAX_REFIT_TIMEOUT_S)
        _range(p, "pipeline_model_parallel_size", self.pipeline_model_parallel_size, ge=1,
               le=C.MAX_PARALLEL)
        _range(p, "virtual_pipeline_size", self.virtual_pipeline_size, ge=2, le=C.MAX_PARALLEL, optional=True)
        if self.sequence_parallel is True and self.tensor_model_parallel_size == 1:
            p.append(Problem("sequence_parallel", True,
                             "needs tensor_model_parallel_size > 1 (it splits activations over the TP ranks; "
                             "at TP 1 there is nothing to split): set it false or raise the TP size"))
        if self.virtual_pipeline_size is not None and self.pipeline_model_parallel_size == 1:
            p.append(Problem("virtual_pipeline_size", self.virtual_pipeline_size,
                             "needs pipeline_model_parallel_size >= 2 (interleaving splits each pipeline stage "
                             "into chunks): set it null or raise the PP size"))




@dataclass
class MultiTurnConfig(Section):
    """Multi-turn rollouts with tool calls and a simulated user (verl's rollout.multi_turn;
    pfppo_mega/rollout/multiturn.py): the policy writes a turn, its tool calls are run and their
    answers appended (trained on with mask 0), and it writes the next turn, until it answers without a
    call, a limit below is met, or the response budget (algorithm.max_response_length, tool tokens
    included) runs out."""

    enable: bool = opt(False, "Run multi-turn rollouts (tools from tool_config_path, a simulated user from "
                              "interaction_config_path); false: one generation per row.")
    max_assistant_turns: Optional[int] = opt(None, "Most policy turns per row; null: no limit but the response "
                                                   "budget.")
    max_user_turns: Optional[int] = opt(None, "Most tool or user turns per row; null: no limit but the response "
                                              "budget.")
    tool_config_path: Optional[str] = opt(None, "verl's tool config YAML (tools: [{class_name, config, "
                                                "tool_schema}]); null: no tools.")
    interaction_config_path: Optional[str] = opt(None, "verl's interaction config YAML (interaction: [{name, "
                                                       "class_name, config}]); null: no simulated user.")
    max_parallel_calls: int = opt(1, "Tool calls of one turn that run (at once, in a thread pool); the calls "
                                     "past it in a turn are not run, as in verl (rollout/tool_calls_dropped).")
    tool_timeout_s: Optional[float] = opt(300.0, "Seconds a tool call may take; a call still running then answers "
                                                 "the policy with a timeout error (counted in "
                                                 "tool/<name>/timeouts and rollout/tool_call_errors) and the "
                                                 "rollout goes on. null: wait for ever (verl has no such limit).")
    max_tool_response_length: int = opt(256, "Longest tool answer in characters, as verl 0.9.1 counts it; longer "
                                             "ones are cut on tool_response_truncate_side.")
    tool_response_truncate_side: str = opt("middle", "Which part of a long tool answer is kept: left (the first "
                                                     "tokens), right (the last), middle (the first and the last "
                                                     "halves, '...' between).")
    tokenization_sanity_check_mode: str = opt(
        "strict", "After each row: re-tokenizing the whole conversation's text must give the token ids built turn "
                  "by turn (strict), or the same after stripping whitespace (ignore_strippable); a mismatch is "
                  "counted in rollout/tokenization_mismatches and its first occurrence logged. disable: no check.")
    format: str = opt("hermes", "How the policy writes tool calls: hermes (<tool_call>{json}</tool_call>, the "
                                "Qwen2.5 / Qwen3 templates).")

    CHOICES: ClassVar[dict[str, tuple]] = {"tool_response_truncate_side": C.TOOL_TRUNCATE_SIDES,
                                           "tokenization_sanity_check_mode": C.TOKENIZATION_CHECK_MODES,
                                           "format": C.TOOL_CALL_FORMATS}

    def _check(self, p: list[Problem]) -> None:
        _range(p, "max_assistant_turns", self.max_assistant_turns, ge=1, le=C.MAX_COUNT, optional=True)
        _range(p, "max_user_turns", self.max_user_turns, ge=0, le=C.MAX_COUNT, optional=True)
        _range(p, "max_parallel_calls", self.max_parallel_calls, ge=1, le=C.MAX_COUNT)
        _range(p, "max_tool_response_length", self.max_tool_response_length, ge=1, le=C.MAX_TOKENS)
        _range(p, "tool_timeout_s", self.tool_timeout_s, gt=0, le=C.MAX_TOOL_TIMEOUT_S, optional=True)
        for key in ("tool_config_path", "interaction_config_path"):
            value = getattr(self, key)
            if value is not None and not str(value).strip():
                p.append(Problem(key, value, "must name a file or be null"))


@dataclass
class ActorRolloutConfig(Section):
    """The policy checkpoint and how rollouts are sampled from it."""

    model_path: Optional[str] = opt(
        None, "Hugging Face Llama-format checkpoint dir (config.json, *.safetensors, tokenizer)."
    )
    engine: str = opt("builtin", "Rollout engine: builtin (pure-torch, KV cache) or vllm.")
    temperature: float = opt(1.0, "Sampling temperature (> 0).")
    top_p: float = opt(1.0, "Nucleus sampling mass, in (0, 1].")
    gpu_memory_utilization: float = opt(
        0.85, "Fraction of GPU memory a colocated vLLM engine may take (ignored by builtin)."
    )
    n_samples_per_prompt: int = opt(1, "Responses sampled for each prompt.")
    tensor_model_parallel_size: int = opt(
        1, "Rollout tensor parallelism: ranks per vLLM engine (vLLM's external launcher, no extra processes); "
        "may differ from parallel.tensor_model_parallel_size and must divide the world size. builtin: 1."
    )
    refit_bucket_mb: float = opt(
        64.0, "Size (MB) of the flat buckets weights travel in from the trainer or the pool to the engines; "
        "a fused group (q/k/v or gate/up of a layer) is never split."
    )
    dtype: str = opt(
        "auto", "The engine's weight and KV-cache dtype: auto = the training dtype (model.params_dtype), or "
        "float32 / bfloat16. Refit buckets and pool snapshots travel in it."
    )
    max_num_seqs: int = opt(64, "Most sequences a vLLM engine schedules at once (its KV cache holds that many).")
    enforce_eager: Optional[bool] = opt(
        None, "vLLM without CUDA graphs / torch.compile (true), or compiled (false); null: eager on CPU, compiled "
        "on GPUs."
    )
    sleep_level: int = opt(
        2, "What a sleeping vLLM engine frees between rollouts: 1 = KV cache freed, weights kept in host memory; "
        "2 = KV cache and weights freed (the next refit refills them). A no-op on CPU."
    )
    refit_timeout_s: float = opt(
        C.REFIT_TIMEOUT_S, "Longest wait (s) of any collective of a refit or snapshot switch (the bucket broadcasts, the "
        "trainer-TP gather, the agreement after it) before the ranks still alive stop with an error naming the "
        "refit, the weight version and the bucket reached: a rank that died or stalled mid-refit never hangs the "
        "job for the process group's 30-minute default. Raise it if a rank can legitimately lag that long."
    )
    multi_turn: MultiTurnConfig = opt(factory=MultiTurnConfig, doc="Multi-turn rollouts with tools and a "
                                                                   "simulated user.")

    ALIASES: ClassVar[dict[str, str]] = {"n": "n_samples_per_prompt", "rollout.n": "n_samples_per_prompt",
                                         "rollout.temperature": "temperature", "rollout.top_p": "top_p",
                                         "model.path": "model_path"}
    CHOICES: ClassVar[dict[str, tuple]] = {"engine": ROLLOUT_ENGINES, "dtype": ("auto",) + C.PARAMS_DTYPES}

    def _check(self, p: list[Problem]) -> None:
        _range(p, "temperature", self.temperature, gt=0)
        _range(p, "top_p", self.top_p, gt=0, le=1)
        _range(p, "gpu_memory_utilization", self.gpu_memory_utilization, gt=0, le=1)
        _range(p, "tensor_model_parallel_size", self.tensor_model_parallel_size, ge=1, le=C.MAX_PARALLEL)
        _range(p, "refit_bucket_mb", self.refit_bucket_mb, gt=0)
        _range(p, "refit_timeout_s", self.refit_timeout_s, gt=0, le=C.MAX_REFIT_TIMEOUT_S)
        _range(p, "n_samples_per_prompt", self.n_samples_per_prompt, ge=1, le=C.MAX_COUNT)
        _range(p, "max_num_seqs", self.max_num_seqs, ge=1, le=C.MAX_COUNT)
        _range(p, "sleep_level", self.sleep_level, ge=1, le=2)


POOL_SAMPLING = C.POOL_SAMPLING  # kept importable from here (tests/test_pool.py)
IS_MODES = C.IS_MODES


@dataclass
class PoolConfig(Section):
    """PF-PPO behaviour-policy snapshot pool (used when algorithm.use_pf_ppo is true)."""

    # Defaults from `pfppo compare` on the built-in task (README): pool 3 / every 2 steps / recency
    # stayed closest to plain PPO; pool 5 / every 10 / uniform lagged it on accuracy and KL.
    pool_size: int = opt(3, "Snapshots kept; the oldest is evicted first.")
    snapshot_interval: int = opt(2, "Training steps between two snapshots of the current policy.")
    sampling: str = opt("recency", "How each rollout request picks its snapshot.")
    assign: str = opt(
        "group",
        "What a rollout request is: group (each prompt group draws its own snapshot; a step mixes "
        "several, one engine switch and one generate call per snapshot used) or step (one draw for "
        "the whole step: at most one switch per step; the mixture happens across steps). With the "
        "vLLM engine, step keeps the pool's cost per step small (docs/refit.md).")
    sampling_temperature: float = opt(1.0, "Temperature of the kl / reward / recency weighting (> 0).")
    include_current: bool = opt(False, "Always keep the current policy in the candidate set.")
    is_mode: str = opt(
        "truncate",
        "Behaviour importance weight pi_prox/pi_behav: truncate at is_clip, mask tokens beyond it, "
        "or tis (plain truncated IS on pi_theta/pi_behav).",
    )
    is_clip: float = opt(2.0, "Truncation / masking threshold of the importance weight (> 1).")
    reward_signal: str = opt(
        "trained", "The per-sample score behind a snapshot's mean reward (what sampling: reward weighs): "
                   "trained (the reward the policy is trained on) or honest (the honest metric when "
                   "reward.shaping is on: snapshots whose samples are not hacked are preferred).")

    CHOICES: ClassVar[dict[str, tuple]] = {"sampling": POOL_SAMPLING, "is_mode": IS_MODES,
                                           "reward_signal": C.POOL_REWARD_SIGNALS,
                                           "assign": C.POOL_ASSIGN}

    def _check(self, p: list[Problem]) -> None:
        _range(p, "pool_size", self.pool_size, ge=1, le=C.MAX_COUNT)
        _range(p, "snapshot_interval", self.snapshot_interval, ge=1, le=C.MAX_STEPS)
        _range(p, "sampling_temperature", self.sampling_temperature, gt=0)
        _range(p, "is_clip", self.is_clip, gt=1)


@dataclass
class FiltrationConfig(Section):
    """Policy filtration (verl's `pf_ppo`, arXiv 2409.06957): reward-weighted batch resampling."""

    enable: bool = opt(False, "Resample each rollout batch with weights computed from rewards.")
    reweight_method: str = opt(
        "pow",
        "How sequence scores s become sampling weights. verl's names give verl's weights: pow "
        "(|s|^weight_pow), max_min (1 for the max and min scores, 0 otherwise), max_random (0.4 for "
        "the max score, 0.1 otherwise). This project's variants: pow_minmax (min-max scaled s, then "
        "^weight_pow: monotone in s) and best_random (each sample's chance of being in a "
        "best-random pair).")
    weight_pow: float = opt(2.0, "Exponent of the pow and pow_minmax methods (> 0).")

    CHOICES: ClassVar[dict[str, tuple]] = {"reweight_method": C.REWEIGHT_METHODS}

    def _check(self, p: list[Problem]) -> None:
        _range(p, "weight_pow", self.weight_pow, gt=0)


@dataclass
class FilterGroupsConfig(Section):
    """DAPO's dynamic sampling (verl's algorithm.filter_groups): prompt groups whose rewards all agree
    carry no advantage for a group estimator; drop them and generate more prompts until the batch
    is full."""

    enable: bool = opt(False, "Drop prompt groups whose n_samples_per_prompt rewards are all equal; refill.")
    gen_batch_size: Optional[int] = opt(
        None, "Prompts generated per round (verl's data.gen_batch_size), at least training.rollout_batch_size: "
              "each round draws this many, the groups that disagree are kept, and the first "
              "rollout_batch_size kept are trained on (verl's DAPO trainer). null: rollout_batch_size.")
    max_num_gen_batches: int = opt(
        10, "Most generation rounds per step (the first included); when still short, the batch is filled "
            "with dropped groups (they add no gradient to a group estimator), counted in dapo/filled_groups. "
            "0 = no bound, except that a rank which keeps no group over a full pass over its prompts "
            "stops the run (SamplingStalled: rounds, groups kept, this key).")

    def _check(self, p: list[Problem]) -> None:
        _range(p, "max_num_gen_batches", self.max_num_gen_batches, ge=0, le=C.MAX_COUNT)
        _range(p, "gen_batch_size", self.gen_batch_size, ge=1, le=C.MAX_COUNT, optional=True)


@dataclass
class RolloutCorrectionConfig(Section):
    """verl 0.9.1's rollout correction in its bypass mode (verl's algorithm.rollout_correction with
    bypass_mode true; pfppo_mega/ppo/rollout_correction.py): the engine's log-probs are the proximal
    policy (algorithm.recompute_old_logp false), and inside the loss the trainer's log-probs against them
    give importance weights and a rejection mask. On when rollout_is or rollout_rs is set, or loss_type
    is reinforce."""

    rollout_is: Optional[str] = opt(
        None, "Importance weights w = pi_theta / pi_rollout: token (each token's ratio) or sequence (the row's "
              "product, on each of its tokens); log-ratios clamped to +-20; detached. null: none. Applied by "
              "loss_type reinforce; ppo_clip's ratio is already pi_theta / pi_rollout (verl: not applied).")
    rollout_is_threshold: float = opt(2.0, "Upper bound of w (> 0): TIS clamps w to it; with "
                                           "rollout_is_threshold_lower, IcePop zeroes w outside [lower, upper].")
    rollout_is_threshold_lower: Optional[float] = opt(
        None, "IcePop's lower bound (in (0, rollout_is_threshold]); null: TIS (verl's 'lower_upper' threshold).")
    rollout_is_batch_normalize: bool = opt(
        False, "Divide w by its mean (over the micro-batch's tokens, or rows for sequence), as verl 0.9.1's "
               "bypass loss does per micro-batch.")
    rollout_rs: list[str] = opt(
        factory=list, doc="Rejection criteria, every one must pass or the token (a seq_* criterion: the row) "
                          "leaves the loss: token_k1/k2/k3, seq_sum_k1/k2/k3, seq_mean_k1/k2/k3, seq_max_k2/k3 "
                          "(k1 = -log ratio, k2 = log ratio^2 / 2, k3 = ratio - 1 - log ratio; verl's rollout_rs).")
    rollout_rs_upper: list[float] = opt(
        factory=list, doc="Per criterion of rollout_rs, its upper bound (> 0): k1 a ratio bound "
                          "(log(lower) <= k1 <= log(upper)), k2 / k3 the value bound.")
    rollout_rs_lower: list[Optional[float]] = opt(
        factory=list, doc="Per criterion, the k1 criteria's lower ratio bound in (0, upper] (null: 1 / upper, as "
                          "verl); null for k2 / k3. Empty: null for each.")
    loss_type: str = opt("ppo_clip", "ppo_clip (the clipped surrogate on pi_theta / pi_rollout over the kept "
                                     "tokens) or reinforce (-w A log pi_theta; verl's compute_policy_loss_reinforce).")

    CHOICES: ClassVar[dict[str, tuple]] = {"loss_type": ("ppo_clip", "reinforce")}

    @property
    def enabled(self) -> bool:
        return self.rollout_is is not None or bool(self.rollout_rs) or self.loss_type != "ppo_clip"

    def criteria(self) -> list[tuple[str, Optional[float], float]]:
        """(name, lower, upper) per rollout_rs criterion, a k1's missing lower filled as 1 / upper."""
        lowers = self.rollout_rs_lower or [None] * len(self.rollout_rs)
        return [(n, (1.0 / u if lo is None else lo) if n.endswith("k1") else None, u)
                for n, lo, u in zip(self.rollout_rs, lowers, self.rollout_rs_upper)]

    def _check(self, p: list[Problem]) -> None:
        if self.rollout_is is not None:
            _choice(p, "rollout_is", self.rollout_is, C.ROLLOUT_IS_LEVELS)
        _range(p, "rollout_is_threshold", self.rollout_is_threshold, gt=0)
        _range(p, "rollout_is_threshold_lower", self.rollout_is_threshold_lower, gt=0,
               le=self.rollout_is_threshold if _finite(self.rollout_is_threshold) else None, optional=True)
        for name in self.rollout_rs:
            if name not in C.ROLLOUT_RS_CRITERIA:
                p.append(Problem("rollout_rs", name, f"must be one of {', '.join(C.ROLLOUT_RS_CRITERIA)}"))
        if len(set(self.rollout_rs)) != len(self.rollout_rs):
            p.append(Problem("rollout_rs", self.rollout_rs, "names a criterion twice"))
        n = len(self.rollout_rs)
        if len(self.rollout_rs_upper) != n:
            p.append(Problem("rollout_rs_upper", self.rollout_rs_upper, f"must have one bound per rollout_rs "
                             f"criterion ({n})"))
        if self.rollout_rs_lower and len(self.rollout_rs_lower) != n:
            p.append(Problem("rollout_rs_lower", self.rollout_rs_lower, f"must be empty or have one entry per "
                             f"rollout_rs criterion ({n})"))
        if any(q.key.startswith("rollout_rs") for q in p):
            return
        for name, lower, upper in zip(self.rollout_rs, self.rollout_rs_lower or [None] * n, self.rollout_rs_upper):
            if not (_finite(upper) and upper > 0):
                p.append(Problem("rollout_rs_upper", upper, f"{name}: must be a finite number > 0"))
            elif lower is not None and not name.endswith("k1"):
                p.append(Problem("rollout_rs_lower", lower, f"{name}: only the k1 criteria have a lower bound; "
                                 f"set it null"))
            elif lower is not None and not (_finite(lower) and 0 < lower <= upper):
                p.append(Problem("rollout_rs_lower", lower, f"{name}: must be in (0, upper = {upper}]"))


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class AsyncConfig(Section):
    """Asynchronous RL (pfppo_mega/trainer/asynchronous/, docs/async.md): a generator process
    produces samples continuously with the versions it holds while the trainer trains; the pool of
    versions that may still be in use is bounded by max_staleness, and the loss is decoupled PPO
    (behaviour log-probs for the importance weight, the recomputed proximal policy for the clip)."""

    enable: bool = opt(False, "Generate in a separate process, overlapped with training.")
    max_staleness: int = opt(2, "Most optimizer steps a trained sample may lag the current weights "
                                "(older samples are dropped, counted, and their prompts generated again).")
    prefetch_steps: int = opt(1, "Steps' worth of prompts queued ahead of the trainer (1 = one step "
                                 "off-policy); at most max_staleness.")
    sampling: str = opt("newest", "Which held version each request is generated with: newest, or uniform / "
                                  "recency over the versions no older than max_staleness - prefetch_steps "
                                  "behind the newest (PF-PPO's snapshot sampling as a rule over the pool).")
    sampling_temperature: float = opt(1.0, "Temperature of the recency rule (> 0).")
    request_prompts: int = opt(4, "Prompts per generator request; new weights enter between requests "
                                  "(and, with partial_rollouts, between two decode steps of one).")
    partial_rollouts: bool = opt(False, "New weights enter requests in flight at a token boundary (engine "
                                        "builtin or vllm; sampling newest): each token tagged with the version that drew "
                                        "it, the staleness bound counts a row's oldest token.")
    max_restarts: int = opt(3, "Generator process deaths tolerated (each restarted, its requests redone) "
                               "before the run stops.")
    result_timeout_s: float = opt(600.0, "Seconds the trainer waits for the generator's next result before "
                                         "it declares it hung, kills and restarts it.")
    logp_check_interval: int = opt(
        0, "Every this many steps the trainer keeps a host copy of the weights it publishes; when rows that "
           "version wrote arrive (within max_staleness), up to logp_check_rows of them are scored under those "
           "weights and compared with the engine's log-probs: rollout/logp_gap_check_* (the rollout/logp_gap_* "
           "check covers only rows of the current weights, none after the first step here). Costs one host "
           "copy of the actor and a forward pass over the rows. 0: off.")
    logp_check_rows: int = opt(8, "Rows scored by each logp_check_interval check (the first of that version "
                                  "in the batch).")

    CHOICES: ClassVar[dict[str, tuple]] = {"sampling": C.ASYNC_SAMPLING}

    def _check(self, p: list[Problem]) -> None:
        _range(p, "max_staleness", self.max_staleness, ge=1, le=C.MAX_STEPS)
        _range(p, "prefetch_steps", self.prefetch_steps, ge=1, le=C.MAX_STEPS)
        if not any(q.key in ("max_staleness", "prefetch_steps") for q in p) and self.prefetch_steps > self.max_staleness:
            p.append(Problem("prefetch_steps", self.prefetch_steps,
                             f"must be at most max_staleness ({self.max_staleness}): prompts queued further ahead "
                             f"would be generated by versions already too old when trained on"))
        _range(p, "sampling_temperature", self.sampling_temperature, gt=0)
        _range(p, "request_prompts", self.request_prompts, ge=1, le=C.MAX_COUNT)
        _range(p, "max_restarts", self.max_restarts, ge=0, le=C.MAX_COUNT)
        _range(p, "result_timeout_s", self.result_timeout_s, gt=0)
        _range(p, "logp_check_interval", self.logp_check_interval, ge=0, le=C.MAX_STEPS)
        _range(p, "logp_check_rows", self.logp_check_rows, ge=1, le=C.MAX_COUNT)
        if self.partial_rollouts and self.sampling != "newest":
            p.append(Problem("partial_rollouts", True, f"needs sampling newest (sampling = {self.sampling!r}): a "
                             f"request in flight switches to the newest version when one arrives, which a rule "
                             f"drawing an older version per request would contradict"))


@dataclass
class AlgorithmConfig(Section):
    """PPO / PF-PPO hyper-parameters."""

    name: str = opt("ppo", "Algorithm family.")
    use_pf_ppo: bool = opt(False, "Sample behaviour policies from a pool of recent snapshots (PF-PPO).")
    kl_coeff: float = opt(0.05, "Coefficient of the KL to the reference policy (>= 0).")
    use_kl_loss: bool = opt(
        False, "true: KL is a loss term (kl_coeff * KL); false: a per-token reward penalty."
    )
    kl_estimator: str = opt("k3", "KL estimator: k1, k2, k3 (low variance, >= 0) or abs.")
    kl_loss_is_weight: bool = opt(False, "use_kl_loss with behaviour importance weights (use_pf_ppo or "
                                         "async_rl): multiply each token's KL loss term by its weight pi_prox / "
                                         "pi_behav (as pool.is_mode truncates or masks it), so that rows an older "
                                         "version wrote estimate the current policy's KL; unweighted, a token the "
                                         "updates since made far less likely than the reference does gives k3 = "
                                         "exp(log pi_ref - log pi_cur) - ... (docs/async.md, KL on stale rows).")
    clip_ratio: float = opt(0.2, "PPO clip epsilon.")
    clip_ratio_low: Optional[float] = opt(None, "Lower epsilon (defaults to clip_ratio).")
    clip_ratio_high: Optional[float] = opt(None, "Upper epsilon (defaults to clip_ratio).")
    dual_clip_c: Optional[float] = opt(3.0, "Dual-clip bound c > 1 for negative advantages; null = off.")
    adv_estimator: str = opt("gae", "Advantage estimator, from the registry pfppo_mega.registry.ADV_ESTIMATORS: "
                             "gae (needs the critic; an estimator that needs none builds no critic), "
                             "grpo, grpo_passk, rloo, opo, gpg, reinforce_plus_plus_baseline (group "
                             "baselines over each prompt's n_samples_per_prompt >= 2 samples), "
                             "reinforce_plus_plus (whitened discounted returns), remax (the baseline is "
                             "the reward of one extra greedy response per prompt, same engine and weights).")
    norm_adv_by_std_in_grpo: bool = opt(True, "grpo / grpo_passk: divide by the group's std + 1e-6 "
                                              "(false: Dr.GRPO, the mean is subtracted only).")
    lmbda: float = opt(0.95, "GAE lambda, in [0, 1].")
    gamma: float = opt(1.0, "Discount, in [0, 1].")
    whiten_advantages: bool = opt(True, "gae: whiten advantages over the batch's response tokens (the "
                                         "critic-free estimators follow verl: reinforce_plus_plus* always "
                                         "whiten, the others never).")
    vf_coef: float = opt(0.1, "Weight of the value loss.")
    value_clip: Optional[float] = opt(0.2, "Clip range of the value update; null = unclipped.")
    entropy_coeff: float = opt(0.0, "Entropy bonus weight (>= 0).")
    loss_agg_mode: str = opt("token-mean", "How token losses are averaged: token-mean, seq-mean-token-sum, "
                             "seq-mean-token-mean, or seq-mean-token-sum-norm (Dr.GRPO, as verl 0.9.1: the summed token "
                             "losses over the rows with a token of the optimizer step's batch and over the constant "
                             "loss_scale_factor; exact under micro-batching and data parallelism).")
    loss_scale_factor: Optional[float] = opt(None, "seq-mean-token-sum-norm's constant (> 0); null = "
                                                   "max_response_length (verl: the padded response length).")
    policy_loss: str = opt("ppo_clip", "Policy loss (verl's names; 'vanilla' = ppo_clip): ppo_clip, gspo "
                           "(sequence ratio), sapo (smooth gate), gpg (plain -logp A), clip_cov, kl_cov, "
                           "geo_mean (GMPO), cispo. gspo aggregates with loss_agg_mode (verl 0.9.1); sapo and geo_mean "
                           "aggregate seq-mean-token-mean whatever loss_agg_mode (as verl 0.9.1; docs/verl.md). "
                           "PF-PPO's is_mode tis is its own loss (ppo_clip only).")
    clip_cov_ratio: float = opt(0.0002, "clip_cov: fraction of tokens whose gradient is cut, in (0, 1].")
    clip_cov_lb: float = opt(1.0, "clip_cov: lower bound of the covariance of a token that may be cut.")
    clip_cov_ub: float = opt(5.0, "clip_cov: upper bound of that covariance (> clip_cov_lb).")
    kl_cov_ratio: float = opt(0.0002, "kl_cov: fraction of tokens (largest covariance) given the KL term, in (0, 1].")
    ppo_kl_coef: float = opt(0.1, "kl_cov: weight of |log ratio| on those tokens (>= 0).")
    tau_pos: float = opt(1.0, "sapo: gate temperature where the advantage is > 0 (> 0).")
    tau_neg: float = opt(1.05, "sapo: gate temperature where the advantage is <= 0 (> 0).")
    max_response_length: int = opt(32, "Longest response in tokens; generation stops there.")
    ppo_epochs: int = opt(1, "Passes over each rollout batch.")
    recompute_old_logp: bool = opt(
        True, "true: the trainer's actor recomputes the proximal (old) log-probs of the rows in the prepare pass. "
              "false: the engine's own log-probs are the proximal policy (verl's rollout-correction bypass "
              "mode): the prepare pass runs no actor forward, the PPO ratio is taken against the engine's "
              "log-probs, and policy/entropy_first10 and rollout/logp_gap_* come from the update's first "
              "epoch. Must be true with use_pf_ppo.")
    pool: PoolConfig = opt(factory=PoolConfig, doc="PF-PPO snapshot pool.")
    filtration: FiltrationConfig = opt(factory=FiltrationConfig, doc="Policy filtration.")
    filter_groups: FilterGroupsConfig = opt(factory=FilterGroupsConfig, doc="DAPO's dynamic sampling.")
    rollout_correction: RolloutCorrectionConfig = opt(
        factory=RolloutCorrectionConfig, doc="verl's rollout correction (bypass mode): IS weights and rejection "
                                             "of the trainer's vs the engine's log-probs.")
    async_rl: AsyncConfig = opt(factory=AsyncConfig, doc="Asynchronous RL: generation overlapped with training.")

    ALIASES: ClassVar[dict[str, str]] = {
        "lam": "lmbda",
        "kl_ctrl.kl_coef": "kl_coeff",
        "kl_coef": "kl_coeff",
        "kl_loss_coef": "kl_coeff",
        "kl_loss_type": "kl_estimator",
        "kl_penalty": "kl_estimator",
        "clip_ratio_c": "dual_clip_c",
        "cliprange_value": "value_clip",
    }  # verl's pf_ppo.* (policy filtration) is read in verl's layout only: here use_pf_ppo is the pool
    # verl's estimator names, accepted as values of kl_estimator.
    KL_VALUE_ALIASES: ClassVar[dict[str, str]] = C.KL_ESTIMATOR_ALIASES
    VALUE_ALIASES: ClassVar[dict[str, dict[str, str]]] = {"kl_estimator": KL_VALUE_ALIASES,
                                                          "policy_loss": C.POLICY_LOSS_ALIASES}
    # kl_estimator is checked after __post_init__ has rewritten the verl names above.
    CHOICES: ClassVar[dict[str, tuple]] = {
        "name": C.ALGORITHMS, "kl_estimator": C.KL_ESTIMATORS, "adv_estimator": ADV_ESTIMATORS,
        "loss_agg_mode": C.LOSS_AGG_MODES, "policy_loss": C.POLICY_LOSSES,
    }

    def __post_init__(self) -> None:
        self.kl_estimator = self.KL_VALUE_ALIASES.get(self.kl_estimator, self.kl_estimator)
        self.policy_loss = C.POLICY_LOSS_ALIASES.get(self.policy_loss, self.policy_loss)
        if self.clip_ratio_low is None:
            self.clip_ratio_low = self.clip_ratio
        if self.clip_ratio_high is None:
            self.clip_ratio_high = self.clip_ratio
        super().__post_init__()

    def _check(self, p: list[Problem]) -> None:
        _range(p, "kl_coeff", self.kl_coeff, ge=0)
        _range(p, "clip_ratio", self.clip_ratio, gt=0, lt=1)
        for key in ("clip_ratio_low", "clip_ratio_high"):  # when set apart from clip_ratio
            if key == "clip_ratio_low" and self.policy_loss == "cispo":
                # CISPO clips the detached ratio weight only; verl's canonical setting is
                # clip_ratio_low = 10 (1 - 10 < 0 < ratio: no lower clip), so any eps_low > 0 is valid
                _range(p, key, self.clip_ratio_low, gt=0)
            elif getattr(self, key) != self.clip_ratio:
                _range(p, key, getattr(self, key), gt=0, lt=1)
        _range(p, "dual_clip_c", self.dual_clip_c, gt=1, optional=True)
        _range(p, "lmbda", self.lmbda, ge=0, le=1)
        _range(p, "gamma", self.gamma, ge=0, le=1)
        _range(p, "vf_coef", self.vf_coef, ge=0)
        _range(p, "value_clip", self.value_clip, gt=0, optional=True)
        _range(p, "entropy_coeff", self.entropy_coeff, ge=0)
        _range(p, "max_response_length", self.max_response_length, ge=1, le=C.MAX_TOKENS)
        _range(p, "ppo_epochs", self.ppo_epochs, ge=1, le=C.MAX_STEPS)
        _range(p, "loss_scale_factor", self.loss_scale_factor, gt=0, optional=True)
        _range(p, "clip_cov_ratio", self.clip_cov_ratio, gt=0, le=1)
        _range(p, "kl_cov_ratio", self.kl_cov_ratio, gt=0, le=1)
        _range(p, "ppo_kl_coef", self.ppo_kl_coef, ge=0)
        _range(p, "tau_pos", self.tau_pos, gt=0)
        _range(p, "tau_neg", self.tau_neg, gt=0)
        if not self.clip_cov_lb < self.clip_cov_ub:  # name the bound that left its default
            if self.clip_cov_lb != type(self).clip_cov_lb:
                p.append(Problem("clip_cov_lb", self.clip_cov_lb, f"must be < clip_cov_ub ({self.clip_cov_ub})"))
            else:
                p.append(Problem("clip_cov_ub", self.clip_cov_ub, f"must be > clip_cov_lb ({self.clip_cov_lb})"))
        if self.use_pf_ppo and not self.recompute_old_logp:
            p.append(Problem("recompute_old_logp", self.recompute_old_logp, "must be true with use_pf_ppo: the "
                             "pool's importance weights (pool.is_mode) correct the mixed behaviour policies "
                             "towards the recomputed proximal policy; with the engine's log-probs as the proximal "
                             "policy each row would be clipped against its own, possibly older, snapshot instead "
                             "(untested here)"))
        if self.kl_loss_is_weight:
            self._check_kl_loss_is_weight(p)
        if self.async_rl.enable:
            self._check_async(p)
        if self.rollout_correction.enabled:
            self._check_rollout_correction(p)
        if (self.use_pf_ppo or self.async_rl.enable) and self.pool.is_mode == "tis" and self.policy_loss != "ppo_clip":
            p.append(Problem("policy_loss", self.policy_loss, "must be ppo_clip with use_pf_ppo and pool.is_mode "
                             "'tis': tis is a policy loss of its own (truncated IS, no proximal clip); use "
                             "pool.is_mode truncate or mask with this loss"))


    def _check_rollout_correction(self, p: list[Problem]) -> None:
        """verl's bypass mode only: the correction compares pi_theta with the engine's log-probs, which are
        the proximal policy; one policy loss (ppo_clip or reinforce, verl's loss_type)."""
        if self.recompute_old_logp:
            p.append(Problem("recompute_old_logp", True, "must be false with rollout_correction (verl's bypass "
                             "mode: the engine's log-probs are the proximal policy); verl's decoupled mode (IS "
                             "weights from recomputed old log-probs) is not built"))
        if self.policy_loss != "ppo_clip":
            p.append(Problem("policy_loss", self.policy_loss, "must be ppo_clip with rollout_correction (verl's "
                             "bypass mode trains rollout_correction.loss_type, ppo_clip or reinforce)"))
        if self.use_pf_ppo:
            p.append(Problem("use_pf_ppo", True, "must be false with rollout_correction (the pool corrects "
                             "its own behaviour policies)"))

    def _check_kl_loss_is_weight(self, p: list[Problem]) -> None:
        if not (self.use_kl_loss and self.kl_coeff > 0):
            p.append(Problem("kl_loss_is_weight", True, f"needs use_kl_loss true and kl_coeff > 0 (use_kl_loss = "
                             f"{self.use_kl_loss}, kl_coeff = {self.kl_coeff:g}): it weights the KL loss term"))
        if not (self.use_pf_ppo or self.async_rl.enable):
            p.append(Problem("kl_loss_is_weight", True, "needs use_pf_ppo or async_rl.enable: only their rows carry "
                             "behaviour importance weights (the current weights wrote every other run's rows)"))

    def _check_async(self, p: list[Problem]) -> None:
        """What async_rl.enable cannot run with (each named by its own key)."""
        if self.use_pf_ppo:
            p.append(Problem("use_pf_ppo", True, "must be false with async_rl.enable: the asynchronous mode's "
                             "version pool replaces PF-PPO's snapshot pool (pick its rule with async_rl.sampling)"))
        if not self.recompute_old_logp:
            p.append(Problem("recompute_old_logp", False, "must be true with async_rl.enable: decoupled PPO "
                             "clips against the proximal policy (the current weights before the update), and "
                             "the engine's log-probs of a stale sample are the behaviour policy's, not that"))
        if self.filter_groups.enable:
            p.append(Problem("filter_groups.enable", True, "must be false with async_rl.enable (dynamic sampling "
                             "is not built for the asynchronous mode)"))
        if self.adv_estimator == "remax":
            p.append(Problem("adv_estimator", "remax", "not with async_rl.enable: ReMax's greedy baseline needs "
                             "the current weights in the rollout, the asynchronous generator holds older ones"))

@dataclass
class CustomFunctionConfig(Section):
    """verl's custom_reward_function: `name(data_source, solution_str, ground_truth, extra_info)
    -> float | dict` (a dict's "score" is the reward) from the Python file `path`, run in worker
    processes with a timeout."""

    path: Optional[str] = opt(None, "Python file defining the function; null = rule-based scorers.")
    name: str = opt("compute_score", "Function name in that file.")

    def _check(self, p: list[Problem]) -> None:
        if not self.name.isidentifier():
            p.append(Problem("name", self.name, "must be a Python identifier"))
        if self.path is not None and not self.path:
            p.append(Problem("path", self.path, "must be a file path or null"))


@dataclass
class ShapingConfig(Section):
    """A gameable reward around the honest one, for experiments on reward hacking (rewards/shaping.py).
    The honest score stays logged apart: reward/honest, eval/honest_accuracy, reward/hacked_frac."""

    kind: str = opt("none", "none (train on the honest reward), length_bias (the honest score + length_bonus "
                            "per response token: pays for longer responses), phrase_exploit "
                            "(a response containing `phrase` scores phrase_score), noisy (the reward of a "
                            "fraction flip_rate of the (prompt, response) pairs is flipped: 1 - r), scaled "
                            "(a 0/1 reward mapped onto [-scale, scale]).")
    length_bonus: float = opt(0.25, "length_bias: reward per response token (> 0).")
    phrase: str = opt("99", "phrase_exploit: the string that scores phrase_score wherever it occurs.")
    phrase_score: float = opt(5.0, "phrase_exploit: the score of a response containing the phrase.")
    flip_rate: float = opt(0.3, "noisy: fraction of flipped rewards, in [0, 0.5).")
    scale: float = opt(100.0, "scaled: the reward's range is [-scale, scale] (> 0).")

    CHOICES: ClassVar[dict[str, tuple]] = {"kind": C.REWARD_SHAPINGS}

    def _check(self, p: list[Problem]) -> None:
        _range(p, "length_bonus", self.length_bonus, gt=0, le=C.MAX_SHAPED_REWARD)
        _range(p, "phrase_score", self.phrase_score, ge=-C.MAX_SHAPED_REWARD, le=C.MAX_SHAPED_REWARD)
        _range(p, "flip_rate", self.flip_rate, ge=0, lt=0.5)
        _range(p, "scale", self.scale, gt=0, le=C.MAX_SHAPED_REWARD)
        if self.kind == "phrase_exploit" and not self.phrase:
            p.append(Problem("phrase", self.phrase, "must be a non-empty string when kind = phrase_exploit"))


@dataclass
class OverlongBufferConfig(Section):
    """DAPO's overlong reward shaping (verl's reward_model.overlong_buffer)."""

    enable: bool = opt(False, "Penalise responses within `len` tokens of algorithm.max_response_length.")
    len: int = opt(0, "The buffer: the penalty grows linearly from 0 at max_response_length - len tokens to "
                      "-penalty_factor at max_response_length (must be < max_response_length when enabled).")
    penalty_factor: float = opt(1.0, "The penalty at max_response_length (>= 0).")

    def _check(self, p: list[Problem]) -> None:
        _range(p, "len", self.len, ge=1 if self.enable else 0, le=C.MAX_TOKENS)
        _range(p, "penalty_factor", self.penalty_factor, ge=0, le=C.MAX_SHAPED_REWARD)


@dataclass
class SandboxFusionConfig(Section):
    """Code rewards (verl's reward_model.sandbox_fusion): a row of a code data_source (codecontests, apps,
    codeforces, taco) is scored by running its response's code on the row's test cases through a
    SandboxFusion service (rewards/sandbox_fusion.py): the passed fraction of its first 10 cases."""

    url: Optional[str] = opt(None, "The service's run_code endpoint (http:// or https://); null = no code rewards "
                                   "(a code row is then refused at start unless reward.default_scorer covers it).")
    max_concurrent: int = opt(64, "Requests in flight at once (per reward function, i.e. per rank that scores).")
    memory_limit_mb: int = opt(1024, "Memory limit of one run, in MB (the service enforces it).")
    case_timeout_s: float = opt(10.0, "Run limit (and compile limit) of one test case, in seconds (verl: 10); a "
                                      "program past it fails that case. The request itself waits twice this + 10 s.")

    def _check(self, p: list[Problem]) -> None:
        if self.url is not None and not (isinstance(self.url, str) and self.url.startswith(("http://", "https://"))):
            p.append(Problem("url", self.url, "must be an http:// or https:// URL of the service's run_code API, or null"))
        _range(p, "max_concurrent", self.max_concurrent, ge=1, le=C.MAX_SANDBOX_CONCURRENT)
        _range(p, "memory_limit_mb", self.memory_limit_mb, ge=1, le=C.MAX_SANDBOX_MEMORY_MB)
        _range(p, "case_timeout_s", self.case_timeout_s, gt=0, le=C.MAX_REWARD_TIMEOUT_S)


@dataclass
class RewardConfig(Section):
    """Preprocessing of the sequence-level scores before they enter GAE."""

    scaling: str = opt("none", "Score normalisation.")
    clip_range: Optional[float] = opt(None, "Clip scores to [-c, c] after scaling; null = off.")
    quantile_clip: Optional[float] = opt(
        None, "Clip scores to their [1-q, q] batch quantiles (e.g. 0.95); null = off."
    )
    length_penalty: float = opt(0.0, "Subtract coef * response_length / max_response_length.")
    overlong_buffer: OverlongBufferConfig = opt(factory=OverlongBufferConfig, doc="DAPO's soft overlong "
                                                "punishment of responses near the length limit.")
    default_scorer: Optional[str] = opt(
        None, "Rule-based scorer for a data_source the registry does not know (null: such a row is "
              "refused at start).")
    custom_function: CustomFunctionConfig = opt(
        factory=CustomFunctionConfig, doc="A user's Python reward function (replaces the "
        "rule-based scorers when path is set).")
    sandbox_fusion: SandboxFusionConfig = opt(factory=SandboxFusionConfig, doc="Code rewards: the responses' code run "
                                              "on the rows' test cases by a SandboxFusion service.")
    num_workers: int = opt(2, "Worker processes running the custom reward function.")
    timeout_s: float = opt(10.0, "Seconds one custom reward call may take; a hang scores 0 and is "
                                 "counted in guard/reward_timeouts.")
    model_path: Optional[str] = opt(
        None, "Reward model: a Hugging Face one-label sequence-classification checkpoint (Llama / Qwen2 / "
              "Qwen3 / Mistral *ForSequenceClassification, score.weight [1, hidden], no bias) with the "
              "policy's vocabulary and tokenizer files; scores prompt + response at its last token, on the "
              "actor's ranks and tensor x pipeline layout (rewards/model.py). null = no reward model.")
    model_weight: float = opt(
        1.0, "With model_path: the reward is model_weight * reward-model score + rule_weight * the "
             "rule-based / custom / built-in task score. Must be > 0 with model_path, 1.0 without.")
    rule_weight: float = opt(
        1.0, "With model_path: the weight of the rule-based / custom / built-in task score in that sum; "
             "0 = the reward model alone (then the data needs no scorer). Must be 1.0 without model_path "
             "(the score is then the reward as it is).")
    shaping: ShapingConfig = opt(factory=ShapingConfig, doc="A gameable reward wrapped around the honest "
                                 "one (experiments where plain PPO goes wrong; off by default).")

    CHOICES: ClassVar[dict[str, tuple]] = {"scaling": C.REWARD_SCALING}

    def _check(self, p: list[Problem]) -> None:
        _range(p, "clip_range", self.clip_range, gt=0, optional=True)
        _range(p, "quantile_clip", self.quantile_clip, gt=0.5, lt=1, optional=True)
        _range(p, "length_penalty", self.length_penalty, ge=0)
        if self.default_scorer is not None:
            _choice(p, "default_scorer", self.default_scorer, C.REWARD_SCORERS)
        _range(p, "num_workers", self.num_workers, ge=1, le=C.MAX_REWARD_WORKERS)
        _range(p, "timeout_s", self.timeout_s, gt=0, le=C.MAX_REWARD_TIMEOUT_S)
        if self.model_path is not None and not self.model_path:
            p.append(Problem("model_path", self.model_path, "must be a checkpoint directory or null"))
        _range(p, "model_weight", self.model_weight, ge=0, le=C.MAX_REWARD_WEIGHT)
        _range(p, "rule_weight", self.rule_weight, ge=0, le=C.MAX_REWARD_WEIGHT)
        if self.model_path is None:
            for key in ("model_weight", "rule_weight"):
                if getattr(self, key) != 1.0 and not any(q.key == key for q in p):
                    p.append(Problem(key, getattr(self, key), "weighs the reward model's score against the "
                                     "rule-based one: set reward.model_path, or leave it 1.0"))
        elif self.model_weight == 0:
            p.append(Problem("model_weight", self.model_weight, "must be > 0 when reward.model_path is set "
                             "(unset model_path to train on the rule-based score alone)"))
        if self.sandbox_fusion.url is not None and self.custom_function.path is not None:
            p.append(Problem("sandbox_fusion.url", self.sandbox_fusion.url, "is read by the rule-based scorers only; "
                             "with custom_function.path your function scores every row: run the code check there, "
                             "or unset one of the two"))


@dataclass
class TrainingConfig(Section):
    """Optimisation schedule."""

    rollout_batch_size: int = opt(64, "Prompts sampled per training step.")
    batch_size: int = opt(64, "Samples per optimiser step (mini-batch) within the PPO update.")
    lr: float = opt(1e-6, "Actor learning rate (AdamW), in (0, 1].")
    critic_lr: Optional[float] = opt(None, "Critic learning rate, in (0, 1] (defaults to lr).")
    weight_decay: float = opt(0.0, "AdamW weight decay.")
    grad_clip: float = opt(1.0, "Clip the global grad norm at this value; 0 = off.")
    critic_grad_clip: Optional[float] = opt(
        None, "Clip the critic's global grad norm at this value, apart from the actor's; 0 = off "
              "(defaults to grad_clip). pfppo doctor's remedy for a diverging value loss.")
    total_training_steps: int = opt(500, "Training steps (one rollout batch each).")
    micro_batch_size: Optional[int] = opt(
        None, "Rows per forward/backward micro-batch (per data-parallel rank); null = the whole "
              "mini-batch. Gradients accumulate over micro-batches through megatron's schedule.")
    use_dynamic_bsz: bool = opt(
        False, "Micro-batches by token budget (verl's use_dynamic_bsz), in the update and in the forward-only "
               "passes (old and reference log-probs, values): rows sorted by length, as many in a micro-batch as "
               "fit in max_tokens_per_micro_batch (rows x its longest row), each cut to its longest row, so little "
               "is computed on padding (perf/padding_frac). micro_batch_size, when set, caps its rows. Results "
               "change only by the order of floating-point sums (tests/test_token_budget.py).")
    max_tokens_per_micro_batch: int = opt(
        16384, "With use_dynamic_bsz: the token budget of one micro-batch per data-parallel rank, rows x its "
               "longest row (verl's ppo_max_token_len_per_gpu, same default); a row longer than it runs alone. "
               "Not read otherwise.")
    response_only_head: bool = opt(
        False, "Run the LM head (and the critic's value head) only at the response tokens: the decoder's "
               "hidden states are cut to those positions before the head, so no logits are computed for "
               "prompt or padding positions (perf/head_waste_frac). Log-probs change only by the order of "
               "floating-point sums.")
    sparse_vocab_grads: bool = opt(
        True, "The LM head's and the word embedding's weight gradients go straight into megatron DDP's "
              "gradient buffer: the head's as one product over many micro-batches' rows (megatron's "
              "defer_embedding_wgrad_compute idea, on any layout and device), the embedding's at the looked-up "
              "rows only, instead of a dense [vocab, hidden] gradient per micro-batch "
              "(pfppo_mega/models/vocab_grads.py). Gradients change only by the order of floating-point sums; "
              "false: megatron's own backward.")
    fused_head: Optional[bool] = opt(
        None, "The actor's LM head fused with the log-prob and entropy. null (auto): in prepare (old / "
              "reference log-probs) on every device, in the update on GPUs only (on the CPU its backward's "
              "recomputed logits make the head 0.66-0.77x as fast as megatron's, docs/perf.md); true: in "
              "prepare and in the update everywhere. Fused, the final hidden states are multiplied by the head's weight fused_head_chunk_tokens "
              "rows at a time, each chunk reduced to its softmax statistics at once and recomputed in the "
              "backward, so no [tokens, vocabulary] logits or gradient exist (pfppo_mega/kernels/fused_head.py; "
              "vocabulary-parallel at TP > 1 with the same all-reduces). Results change only by floating-point "
              "rounding. Not used under parallel.sequence_parallel (megatron's head there); false: megatron's "
              "output layer and the [tokens, vocabulary] logits (docs/perf.md, `pfppo bench head`).")
    fused_head_chunk_tokens: int = opt(
        128, "With fused_head: the rows of one chunk of logits [chunk, vocabulary / TP] computed at a time, in "
             "[1, 1048576]. Smaller holds less (128 x 151,936 fp32 is 78 MB; 128 x 49,152 is 25 MB, under glibc's "
             "32 MB mmap threshold, so the blocks are reused without page faults on the CPU); too small leaves the "
             "matrix products too thin to run fast (docs/perf.md).")
    fused_layers: bool = opt(
        True, "With the local layers (model.layer_spec local, or auto without transformer-engine), on GPUs in "
              "any dtype and on CPU fp32 models: each decoder layer's attention runs through torch's "
              "scaled_dot_product_attention (causal, GQA, no mask tensor: flash / cuDNN on Hopper, no "
              "[b, heads, s, s] buffer) and its RMSNorms, SwiGLU and RoPE as fused pieces (CPU fp32: "
              "csrc/cpu/layers.cpp; GPU: torch's rms_norm and autograd functions that save less), instead of "
              "megatron's chains of element-wise ops (pfppo_mega/models/fused_layers.py). The default path on "
              "GPUs without TE. Results change only by floating-point rounding; the parameters and their names "
              "do not change. Not read for CPU bf16 models; false: megatron's own local layers.")
    critic_warmup_steps: int = opt(0, "Steps that update only the critic (an estimator with a critic, gae; "
                                      "with one that has none, refused at start: those steps would update "
                                      "nothing).")
    lr_warmup_steps: Optional[int] = opt(
        None, "Linear learning-rate warm-up: the lr of an optimizer's k-th update step (k = 0, 1, ...; one per "
              "training step) is lr * k / lr_warmup_steps until k reaches it (verl's lr_warmup_steps: the first "
              "step trains at 0). null: lr_warmup_ratio * total_training_steps (truncated), as verl's -1. Both "
              "actor and critic; the actor counts from its first update (after critic_warmup_steps).")
    lr_warmup_ratio: float = opt(0.0, "With lr_warmup_steps null: the warm-up as a fraction of "
                                      "total_training_steps, in [0, 1) (verl's lr_warmup_steps_ratio).")
    critic_lr_warmup_ratio: Optional[float] = opt(
        None, "The critic's own warm-up as a fraction of total_training_steps, in [0, 1) (verl's "
              "critic.optim.lr_warmup_steps_ratio): int(ratio * total_training_steps) steps, whatever "
              "lr_warmup_steps says; null: the actor's warm-up (lr_warmup_steps / lr_warmup_ratio).")
    lr_schedule: str = opt(
        "constant", "After the warm-up: constant (lr), or cosine (from lr down to min_lr_ratio * lr at "
                    "total_training_steps, verl's get_cosine_schedule_with_warmup; pfppo_mega/trainer/lr_schedule.py).")
    min_lr_ratio: float = opt(0.0, "cosine: the floor as a fraction of lr, in [0, 1] (verl's min_lr_ratio). "
                                   "Not read with constant.")
    seed: int = opt(1, "Seed of every random draw (data, init, sampling).")
    num_threads: int = opt(1, "torch intra-op threads per process on CPU.")
    recompute: str = opt(
        "none", "Activation recomputation in the backward pass: none, selective (megatron's core-attention "
                "recompute: drops the s^2 attention terms) or full (each layer keeps only its input and "
                "recomputes the rest).")
    offload_during_rollout: Optional[bool] = opt(
        None, "Colocation: while the rollout engine generates, the actor's and critic's parameters and optimizer "
              "states and the reference's parameters wait in host memory (pinned, exactly their size) and "
              "come back bit-identical before they are needed, the gradient buffers are freed and come back "
              "zeroed (pfppo_mega/trainer/colocation/offload.py); the engine "
              "sleeps during the update. null = on for GPUs, off on CPU (host and device are one memory). "
              "`pfppo plan` reads the same key (null: on).")
    value_loss_spike_factor: float = opt(
        0.0, "Value-loss spike guard: skip the critic's update of a step whose value loss before the update "
             "exceeds this factor x the median of the 10 steps before it (needs 5 of them; counted in "
             "guard/value_loss_spikes; the actor still updates). 0 = off; e.g. 10.")
    max_consecutive_skipped_updates: int = opt(
        5, "Stop the run with an error (non-zero exit) after this many consecutive skipped optimizer "
           "updates of the actor or of the critic (non-finite loss or refused step): it is not learning. "
           "0 = never stop.")

    ALIASES: ClassVar[dict[str, str]] = {
        "train_batch_size": "rollout_batch_size",
        "ppo_mini_batch_size": "batch_size",
        "actor_lr": "lr",
    }
    CHOICES: ClassVar[dict[str, tuple]] = {"recompute": C.RECOMPUTE_MODES, "lr_schedule": C.LR_SCHEDULES}

    def _check(self, p: list[Problem]) -> None:
        _range(p, "rollout_batch_size", self.rollout_batch_size, ge=1, le=C.MAX_COUNT)
        _range(p, "batch_size", self.batch_size, ge=1, le=C.MAX_COUNT)
        _range(p, "lr", self.lr, gt=0, le=1)  # AdamW: a step of lr per parameter
        _range(p, "critic_lr", self.critic_lr, gt=0, le=1, optional=True)
        _range(p, "weight_decay", self.weight_decay, ge=0)
        _range(p, "grad_clip", self.grad_clip, ge=0)
        _range(p, "critic_grad_clip", self.critic_grad_clip, ge=0, optional=True)
        _range(p, "total_training_steps", self.total_training_steps, ge=1, le=C.MAX_STEPS)
        _range(p, "critic_warmup_steps", self.critic_warmup_steps, ge=0, le=C.MAX_STEPS)
        _range(p, "fused_head_chunk_tokens", self.fused_head_chunk_tokens, ge=1, le=C.MAX_HEAD_CHUNK_TOKENS)
        warm, total = self.critic_warmup_steps, self.total_training_steps
        if type(warm) is int and type(total) is int and 0 < warm >= total:
            p.append(Problem("critic_warmup_steps", warm,
                             f"must be less than the run's training.total_training_steps (verl: "
                             f"trainer.total_training_steps) = {total}: the warm-up steps "
                             f"update only the critic, so the policy would never change; lower the warm-up or "
                             f"raise the run's steps"))
        _range(p, "lr_warmup_steps", self.lr_warmup_steps, ge=0, le=C.MAX_STEPS, optional=True)
        _range(p, "lr_warmup_ratio", self.lr_warmup_ratio, ge=0, lt=1)
        _range(p, "critic_lr_warmup_ratio", self.critic_lr_warmup_ratio, ge=0, lt=1, optional=True)
        _range(p, "min_lr_ratio", self.min_lr_ratio, ge=0, le=1)
        _range(p, "micro_batch_size", self.micro_batch_size, ge=1, le=C.MAX_COUNT, optional=True)
        _range(p, "max_tokens_per_micro_batch", self.max_tokens_per_micro_batch, ge=1, le=C.MAX_COUNT * C.MAX_TOKENS)
        _range(p, "seed", self.seed, ge=0, le=C.MAX_SEED)
        _range(p, "num_threads", self.num_threads, ge=1, le=C.MAX_THREADS)
        _range(p, "max_consecutive_skipped_updates", self.max_consecutive_skipped_updates, ge=0, le=C.MAX_STEPS)
        if self.value_loss_spike_factor != 0:
            _range(p, "value_loss_spike_factor", self.value_loss_spike_factor, gt=1)
        if self.critic_lr is None:
            self.critic_lr = self.lr
        if self.critic_grad_clip is None:
            self.critic_grad_clip = self.grad_clip


@dataclass
class DataConfig(Section):
    """The prompt source and its rule-based reward."""

    source: str = opt("task", "Where prompts come from: task (the built-in data.task) or files "
                              "(data.train_files / data.val_files).")
    task: str = opt("addition", "Built-in task with a verifiable reward (data.source = task).")
    num_digits: int = opt(3, "Largest operand has this many digits (addition).")
    eval_size: int = opt(256, "Held-out prompts scored at each evaluation (files: the first eval_size "
                              "rows of val_files).")
    max_prompt_length: int = opt(16, "Longest prompt in tokens (after the chat template).")
    train_files: list[str] = opt(factory=list, doc="JSONL (.jsonl) or Parquet (.parquet) prompt files in "
                                                   "verl's schema; one path or a list (data.source = files).")
    val_files: list[str] = opt(factory=list, doc="Held-out prompt files, same format; evaluated every "
                                                 "logging.eval_interval steps, scores per data_source.")
    prompt_key: str = opt("prompt", "Column holding the prompt: a list of chat messages "
                                    "({role, content}) or a string.")
    data_source_key: str = opt("data_source", "Column naming each row's dataset (picks its scorer).")
    ground_truth_key: str = opt("reward_model.ground_truth", "Column (dotted path into nested "
                                                             "mappings) holding the reference answer.")
    extra_info_key: str = opt("extra_info", "Column of free per-row metadata passed to the reward "
                                            "function (missing: {}).")
    apply_chat_template: bool = opt(True, "Render prompts with the checkpoint's chat template "
                                          "(tokenizer_config.json); a string prompt becomes one user message.")
    chat_template_kwargs: list[str] = opt(
        factory=list, doc="Variables for the chat template, each name=<JSON value> (e.g. enable_thinking=false, "
                          "reasoning_effort=\"medium\"), passed as transformers' apply_chat_template(**kwargs) "
                          "passes them (verl's data.apply_chat_template_kwargs). Read with apply_chat_template true.")
    overlong_prompts: str = opt("filter", "Prompts longer than max_prompt_length: filter (dropped, "
                                          "counted and reported at start), error (refused at start), or cut "
                                          "to max_prompt_length tokens (after the chat template) as verl's "
                                          "data.truncation: left (keep the last tokens), right (keep the "
                                          "first), middle (keep the first max_prompt_length // 2 and the last "
                                          "max_prompt_length - max_prompt_length // 2).")
    shuffle: bool = opt(True, "Shuffle the training rows each epoch (seeded by training.seed).")
    sampler_path: str = opt("", "A user's torch Sampler deciding which training rows each step draws (verl's "
                                "data.sampler.class_path): a module (a.b.c or pkg://a.b.c) or a .py file "
                                "(file://x.py, relative to the working directory); with data.sampler_class. It is "
                                "built as cls(data_source=rows, data_config=...); one with update(batch) is a "
                                "curriculum, given each step's rows and scores (docs/verl.md). Replaces "
                                "data.shuffle. Empty: the rows in seeded epochs.")
    sampler_class: str = opt("", "The class's name in data.sampler_path (verl's data.sampler.class_name).")
    addition_format: str = opt(
        "plain", "How the addition task writes problems: plain (123+45= -> 168), padded (every number "
                 "zero-padded: 123+045= -> 0168; each digit at a fixed position) or reversed (padded and "
                 "written least-significant digit first: 321+540= -> 8610).")

    CHOICES: ClassVar[dict[str, tuple]] = {"source": C.DATA_SOURCES, "task": C.TASKS,
                                           "overlong_prompts": C.OVERLONG_PROMPTS,
                                           "addition_format": C.ADDITION_FORMATS}

    def _check(self, p: list[Problem]) -> None:
        _range(p, "num_digits", self.num_digits, ge=1, le=9)
        _range(p, "eval_size", self.eval_size, ge=1, le=C.MAX_EVAL_PROMPTS)
        _range(p, "max_prompt_length", self.max_prompt_length, ge=1, le=C.MAX_TOKENS)
        for key in ("train_files", "val_files"):
            files = getattr(self, key)
            if len(files) > C.MAX_DATA_FILES:
                p.append(Problem(key, f"{len(files)} files", f"must list at most {C.MAX_DATA_FILES} files"))
            elif any(not f for f in files):
                p.append(Problem(key, files, "must not contain an empty path"))
        if self.source == "files" and not self.train_files:
            p.append(Problem("train_files", self.train_files, "must list at least one file when data.source = files"))
        if self.source == "task" and (self.train_files or self.val_files):
            p.append(Problem("source", self.source, "must be files when data.train_files / data.val_files are "
                                                    "set (they would be ignored)"))
        for key in ("prompt_key", "data_source_key", "ground_truth_key", "extra_info_key"):
            if not getattr(self, key) or any(not part for part in getattr(self, key).split(".")):
                p.append(Problem(key, getattr(self, key), "must be a column name (dotted path: no empty part)"))
        self._check_template_kwargs(p)
        if bool(self.sampler_path) != bool(self.sampler_class):
            key = "sampler_class" if self.sampler_path else "sampler_path"
            p.append(Problem(key, getattr(self, key), "must be set with data.sampler_path / data.sampler_class "
                                                      "(both or neither)"))
        elif self.sampler_path and self.source != "files":
            p.append(Problem("sampler_path", self.sampler_path, "draws rows of data.train_files: needs data.source "
                                                                "= files"))
        elif self.sampler_class and not self.sampler_class.isidentifier():
            p.append(Problem("sampler_class", self.sampler_class, "must be a class name (an identifier)"))

    def _check_template_kwargs(self, p: list[Problem]) -> None:
        """Each name=<JSON value>, a name once; only where a template is applied (data/chat.py reads them)."""
        names = []
        for item in self.chat_template_kwargs:
            name, sep, text = item.partition("=")
            if not (sep and name.isidentifier() and _is_json(text)):
                p.append(Problem("chat_template_kwargs", item, "each must be name=<JSON value> (a string quoted: "
                                 "reasoning_effort=\"medium\"; a flag: enable_thinking=false)"))
            names.append(name)
        if len(set(names)) != len(names):
            p.append(Problem("chat_template_kwargs", self.chat_template_kwargs, "names a variable twice"))
        if self.chat_template_kwargs and (not self.apply_chat_template or self.source == "task"):
            p.append(Problem("chat_template_kwargs", self.chat_template_kwargs, "are read only when a chat template "
                             "renders the prompts (data.source files with apply_chat_template true); remove them"))


@dataclass
class LoggingConfig(Section):
    """Where results go and how often."""

    output_dir: str = opt("runs/default", "Run directory (metrics, plots, checkpoints, export).")
    log_interval: int = opt(1, "Steps between metric records.")
    eval_interval: int = opt(10, "Steps between held-out evaluations; 0 = only at start and end.")
    tensorboard: bool = opt(True, "Write TensorBoard event files.")
    plots: bool = opt(True, "Write PNG plots of the main curves at the end.")
    progress: bool = opt(True, "Print a progress line per logged step.")
    kl_probe_size: int = opt(
        0, "If > 0: each step, sample this many held-out prompts from the current policy and log "
           "kl/probe_k1, an on-policy KL(current || reference) estimate that is the same for PPO and "
           "PF-PPO (costs one extra small generation + two forward passes).")
    perf_probe_interval: int = opt(
        0, "Steps between re-measurements of this machine's matmul and memcpy rates, which the perf/ "
           "fractions compare each phase against; 0 = measured once, at the first step. A shared machine's "
           "speed drifts: re-measure to keep the fractions honest (each costs ~0.5 s on a 2-core CPU, "
           "outside the step's time).")
    worst_samples: int = opt(
        2, "Each step, append the this-many longest, most repetitive and highest-reward samples (step, "
           "prompt, text, reward, honest score, snapshot version) to samples_worst.jsonl in output_dir "
           "(rank 0's rows); 0 = off. pfppo doctor quotes them at KL spikes.")

    def _check(self, p: list[Problem]) -> None:
        _nonblank_dir(p, "output_dir", self.output_dir)
        _range(p, "log_interval", self.log_interval, ge=1, le=C.MAX_STEPS)
        _range(p, "eval_interval", self.eval_interval, ge=0, le=C.MAX_STEPS)
        _range(p, "kl_probe_size", self.kl_probe_size, ge=0, le=C.MAX_EVAL_PROMPTS)
        _range(p, "worst_samples", self.worst_samples, ge=0, le=C.MAX_WORST_SAMPLES)
        _range(p, "perf_probe_interval", self.perf_probe_interval, ge=0, le=C.MAX_STEPS)


@dataclass
class CheckpointConfig(Section):
    """Atomic, verified training checkpoints."""

    save_interval: int = opt(0, "Steps between checkpoints; 0 = only the final one.")
    keep_last: int = opt(2, "Checkpoints kept on disk (older are removed after a good save).")
    resume: bool = opt(True, "Resume from the latest valid checkpoint in output_dir if one exists.")
    export_hf: bool = opt(True, "Export the final actor as a Hugging Face checkpoint.")
    background: bool = opt(
        True, "Write checkpoints on a background thread: the training loop waits only for the copy of "
              "this rank's state to the host; the step is committed once every rank's part is on disk.")
    max_saves_in_flight: int = opt(
        1, "Saves that may be writing at once (each holds a host copy of its rank's part); a save beyond "
           "it waits for the oldest to finish.")
    commit_timeout_s: float = opt(
        600.0, "How long rank 0 waits for every rank's part of a save before giving up on that step "
               "(`latest` then stays on the previous checkpoint), in seconds.")
    io_threads: int = opt(4, "Threads that hash a rank's checkpoint files (on save and on resume).")

    def _check(self, p: list[Problem]) -> None:
        _range(p, "save_interval", self.save_interval, ge=0, le=C.MAX_STEPS)
        _range(p, "keep_last", self.keep_last, ge=1, le=C.MAX_COUNT)
        _range(p, "max_saves_in_flight", self.max_saves_in_flight, ge=1, le=8)
        _range(p, "commit_timeout_s", self.commit_timeout_s, gt=0, le=86400)
        _range(p, "io_threads", self.io_threads, ge=1, le=64)


@dataclass
class SFTConfig(Section):
    """Supervised warm start (`pfppo sft`): trains the model section's shape from scratch on
    demonstrations of the built-in task and writes a Hugging Face checkpoint."""

    output_dir: str = opt("runs/sft", "Where the SFT checkpoint (config.json, model.safetensors, tokenizer) goes.")
    steps: int = opt(300, "Optimiser steps.")
    batch_size: int = opt(64, "Demonstrations per step.")
    lr: float = opt(3e-3, "AdamW learning rate, in (0, 1] (cosine decay to 10%).")
    noise: float = opt(0.3, "Fraction of demonstrations with one wrong digit (imperfect labels).")
    carry_drop: float = opt(
        0.0, "Systematic demonstrator error: in this fraction of the problems that carry into digit "
             "carry_digit, the demonstration drops that carry (a + b - 10**carry_digit); the exact PPO "
             "reward then has something to teach that the demonstrations do not. In [0, 1].")
    carry_digit: int = opt(2, "The digit whose incoming carry carry_drop drops (1 = tens, 2 = hundreds, ...; "
                              "at most data.num_digits).")
    warmup_steps: int = opt(0, "Linear learning-rate warmup over this many steps (then cosine decay to 10%).")
    init_gain: float = opt(
        0.0, "Initialise every weight matrix from N(0, init_gain**2 / fan_in) instead of megatron's N(0, 0.02) "
             "(the demo's 128-wide model sat on a long loss plateau with the latter); 0 = megatron's init.")
    min_accuracy: float = opt(
        0.0, "Held-out greedy accuracy (data.eval_size prompts, exact reward) the warm start must reach: "
             "below it pfppo sft exits with an error (the checkpoint stays, for inspection) and pfppo demo "
             "does not start PPO. 0 = no check.")
    max_seconds: float = opt(
        0.0, "Safety limit on wall time: SFT always runs sft.steps steps and fails with an error (writing "
             "nothing) if they take longer than this; 0 = no limit.")

    def _check(self, p: list[Problem]) -> None:
        _nonblank_dir(p, "output_dir", self.output_dir)
        _range(p, "steps", self.steps, ge=1, le=C.MAX_STEPS)
        _range(p, "batch_size", self.batch_size, ge=1, le=C.MAX_COUNT)
        _range(p, "lr", self.lr, gt=0, le=1)
        _range(p, "noise", self.noise, ge=0, lt=1)
        _range(p, "carry_drop", self.carry_drop, ge=0, le=1)
        _range(p, "carry_digit", self.carry_digit, ge=1, le=9)
        _range(p, "warmup_steps", self.warmup_steps, ge=0, le=C.MAX_STEPS)
        _range(p, "init_gain", self.init_gain, ge=0, le=10)
        _range(p, "min_accuracy", self.min_accuracy, ge=0, le=1)
        _range(p, "max_seconds", self.max_seconds, ge=0)


@dataclass
class Config(Section):
    """Root of the tree."""

    model: ModelConfig = opt(factory=ModelConfig, doc="Model shape.")
    parallel: ParallelConfig = opt(factory=ParallelConfig, doc="Parallel layout.")
    actor_rollout: ActorRolloutConfig = opt(factory=ActorRolloutConfig, doc="Policy and sampling.")
    algorithm: AlgorithmConfig = opt(factory=AlgorithmConfig, doc="PPO / PF-PPO.")
    reward: RewardConfig = opt(factory=RewardConfig, doc="Reward preprocessing.")
    training: TrainingConfig = opt(factory=TrainingConfig, doc="Optimisation.")
    data: DataConfig = opt(factory=DataConfig, doc="Task and prompts.")
    logging: LoggingConfig = opt(factory=LoggingConfig, doc="Outputs.")
    checkpoint: CheckpointConfig = opt(factory=CheckpointConfig, doc="Checkpoints.")
    sft: SFTConfig = opt(factory=SFTConfig, doc="Supervised warm start (pfppo sft).")
    kernels: str = opt("auto", "PPO math kernels: auto (fused when built), torch or fused.")

    ALIASES: ClassVar[dict[str, str]] = {"trainer.total_training_steps": "training.total_training_steps"}
    CHOICES: ClassVar[dict[str, tuple]] = {"kernels": C.KERNEL_MODES}

    def _check(self, p: list[Problem]) -> None:
        samples = self.training.rollout_batch_size * self.actor_rollout.n_samples_per_prompt
        # batch_size < 1 is already reported by TrainingConfig (and would divide by zero here).
        if self.training.batch_size >= 1 and samples % self.training.batch_size:
            p.append(Problem(
                "training.batch_size", self.training.batch_size,
                f"must divide rollout_batch_size * n_samples_per_prompt ({samples})"))
        vpp, pp, layers = self.parallel.virtual_pipeline_size, self.parallel.pipeline_model_parallel_size, self.model.num_layers
        if isinstance(vpp, int) and vpp >= 2 and pp >= 2 and layers and layers % (pp * vpp):
            p.append(Problem("parallel.virtual_pipeline_size", vpp,
                             f"model.num_layers ({layers}) must be divisible by pipeline_model_parallel_size x "
                             f"virtual_pipeline_size ({pp} x {vpp} = {pp * vpp} chunks)"))
        if self.parallel.sequence_parallel is True and self.parallel.tensor_model_parallel_size != 1 \
                and self.model.layer_spec == "local":  # on any device (models.gpt.check_features)
            p.append(Problem("parallel.sequence_parallel", True,
                             "must be false with model.layer_spec 'local': megatron's local spec norms "
                             "(WrappedTorchNorm) refuse sequence parallelism on every device; sequence parallelism "
                             "needs model.layer_spec transformer_engine (where transformer-engine is installed)"))
        if self.algorithm.filter_groups.enable and self.actor_rollout.n_samples_per_prompt < 2:
            p.append(Problem("algorithm.filter_groups.enable", True,
                             "needs actor_rollout.n_samples_per_prompt >= 2 (a group of one always agrees)"))
        fg, prompts = self.algorithm.filter_groups, self.training.rollout_batch_size
        if isinstance(fg.gen_batch_size, int) and isinstance(prompts, int) and fg.gen_batch_size != prompts:
            if not fg.enable:
                p.append(Problem("algorithm.filter_groups.gen_batch_size", fg.gen_batch_size,
                                 f"differs from training.rollout_batch_size ({prompts}) with "
                                 f"algorithm.filter_groups.enable false: extra prompts are generated only to "
                                 f"replace dropped groups; enable filter_groups or set it null"))
            elif fg.gen_batch_size < prompts:
                p.append(Problem("algorithm.filter_groups.gen_batch_size", fg.gen_batch_size,
                                 f"must be >= training.rollout_batch_size ({prompts}): each round generates at "
                                 f"least the prompts trained on"))
        ob = self.reward.overlong_buffer
        if ob.enable and isinstance(ob.len, int) and ob.len >= self.algorithm.max_response_length >= 1:
            p.append(Problem("reward.overlong_buffer.len", ob.len,
                             f"must be less than algorithm.max_response_length ({self.algorithm.max_response_length})"))
        if self.actor_rollout.model_path is None and not self.model.is_complete():
            missing = [k for k in ModelConfig.SHAPE_FIELDS if getattr(self.model, k) is None]
            p.append(Problem("model", "incomplete",
                             f"set actor_rollout.model_path or every shape field (missing: {', '.join(missing)})"))
        if self.sft.carry_drop > 0 and isinstance(self.sft.carry_digit, int) and \
                isinstance(self.data.num_digits, int) and self.sft.carry_digit > self.data.num_digits:
            p.append(Problem("sft.carry_digit", self.sft.carry_digit,
                             f"must be at most data.num_digits ({self.data.num_digits}) when sft.carry_drop > 0 "
                             f"(no carry reaches a higher digit)"))
        self._check_multi_turn(p)
        ar = self.algorithm.async_rl
        if ar.enable and self.actor_rollout.tensor_model_parallel_size > 1:
            p.append(Problem("actor_rollout.tensor_model_parallel_size", self.actor_rollout.tensor_model_parallel_size,
                             "must be 1 with algorithm.async_rl.enable: not built yet, each model replica's generator "
                             "is one engine in one process (the trainer's own parallel.tensor_model_parallel_size and "
                             "pipeline_model_parallel_size are supported; docs/async.md)"))
        if ar.enable and ar.partial_rollouts and self.actor_rollout.engine not in C.PARTIAL_ROLLOUT_ENGINES:
            p.append(Problem("algorithm.async_rl.partial_rollouts", True,
                             f"needs actor_rollout.engine in {C.PARTIAL_ROLLOUT_ENGINES} (got "
                             f"{self.actor_rollout.engine!r}): only they take new weights between two decode steps "
                             f"of a request (docs/async.md, Partial rollouts)"))
        if self.sft.warmup_steps >= self.sft.steps >= 1:
            p.append(Problem("sft.warmup_steps", self.sft.warmup_steps, f"must be less than sft.steps ({self.sft.steps})"))

    def _check_multi_turn(self, p: list[Problem]) -> None:
        """What actor_rollout.multi_turn.enable cannot run with (each named by its own key)."""
        if not self.actor_rollout.multi_turn.enable:
            return
        if self.algorithm.async_rl.enable:
            p.append(Problem("algorithm.async_rl.enable", True, "must be false with actor_rollout.multi_turn.enable: "
                             "the asynchronous generator runs one generation per request (no tool calls); "
                             "multi-turn rollouts run in the colocated (synchronous) mode"))
        if self.algorithm.adv_estimator == "remax":
            p.append(Problem("algorithm.adv_estimator", "remax", "not with actor_rollout.multi_turn.enable: ReMax's "
                             "greedy baseline is one single-turn response per prompt, not a conversation with the "
                             "tools; use grpo or rloo for a baseline over each prompt's multi-turn samples"))
        if self.data.source != "files" or not self.data.apply_chat_template:
            key, value = ("data.source", self.data.source) if self.data.source != "files" else \
                ("data.apply_chat_template", False)
            p.append(Problem(key, value, "actor_rollout.multi_turn.enable needs prompt files rendered with the "
                             "checkpoint's chat template (data.source files, data.apply_chat_template true): tool "
                             "and user turns are written with that template"))
