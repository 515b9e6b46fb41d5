"""Rows for verl's actor_rollout_ref.rollout: the engine, sampling and lengths mapped; serving-engine
settings ignored (speed or memory only); multi-turn / tool-calling rollouts mapped (Hermes calls); what else
changes the samples (greedy, agent loops, quantisation) refused.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from pfppo_mega.config.verl.keys import R_
from pfppo_mega.config.verl.reasons import FORWARD_MICRO, SPEED
from pfppo_mega.config.verl.rule import Bad, I, Ignore, M, Out, R, Refuse, Rule, View, _typed, positive_int


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


def _rate(value: Any, v: View) -> Any:
    """A fraction in [0, 1) or null (what verl's RolloutConfig declares)."""
    rate = _typed(value, Optional[float])
    if rate is not None and not 0 <= rate < 1:
        raise Bad("must be in [0, 1) (a fraction of the requests); it is ignored here, as verl 0.9.1 ignores it")
    return rate


def _turn_limit(value: Any, v: View) -> Any:
    """verl stops at the limit only when it is truthy: null and 0 both mean no limit."""
    n = _typed(value, Optional[int])
    return None if not n else n


def _tool_format(value: Any, v: View) -> Any:
    name = _typed(value, str)
    if name != "hermes":
        raise Refuse(f"tool-call format {name!r}: only hermes (<tool_call>{{json}}</tool_call>, the Qwen2.5 / Qwen3 "
                     f"templates) is parsed here; set it to hermes with a model whose template writes that")
    return name


def _rollout_dtype(value: Any, v: View) -> Any:
    name = _typed(value, str)
    names = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32", "auto": "auto",
             "float16": "float16", "fp16": "float16"}
    if name not in names:
        raise Bad("must be auto, bfloat16, float16 or float32 (actor_rollout.dtype)")
    return names[name]


RULES: tuple[Rule, ...] = (
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
    I(f"{R_}.over_sample_rate", "verl 0.9.1 declares it (RolloutConfig: abort the last over_sample_rate of a "
      "batch's requests) but no code of its reads it: it changes nothing there", check=_rate),
    R(f"{R_}.skip_rollout", "replaying dumped rollouts", ok=(False,)),
    R(f"{R_}.quantization", "quantised rollouts", ok=(None,)),
    R(f"{R_}.quantization_config_file", "quantised rollouts", ok=(None,)),
    M(f"{R_}.multi_turn.enable", "actor_rollout.multi_turn.enable"),
    M(f"{R_}.multi_turn.max_assistant_turns", "actor_rollout.multi_turn.max_assistant_turns", _turn_limit,
      why="null or 0 (verl: no limit) -> null"),
    M(f"{R_}.multi_turn.max_user_turns", "actor_rollout.multi_turn.max_user_turns", _turn_limit,
      why="null or 0 (verl: no limit) -> null"),
    M(f"{R_}.multi_turn.tool_config_path", "actor_rollout.multi_turn.tool_config_path"),
    M(f"{R_}.multi_turn.interaction_config_path", "actor_rollout.multi_turn.interaction_config_path"),
    M(f"{R_}.multi_turn.max_parallel_calls", "actor_rollout.multi_turn.max_parallel_calls"),
    M(f"{R_}.multi_turn.max_tool_response_length", "actor_rollout.multi_turn.max_tool_response_length"),
    M(f"{R_}.multi_turn.tool_response_truncate_side", "actor_rollout.multi_turn.tool_response_truncate_side"),
    M(f"{R_}.multi_turn.tokenization_sanity_check_mode", "actor_rollout.multi_turn.tokenization_sanity_check_mode"),
    M(f"{R_}.multi_turn.format", "actor_rollout.multi_turn.format", _tool_format,
      why="hermes; verl's other parsers (gpt-oss, llama3_json, ...) refused"),
    R(f"{R_}.multi_turn.use_inference_chat_template", "re-rendering each turn's conversation with the inference chat "
      "template (dropping e.g. reasoning content): here the token ids the policy wrote are trained on", ok=(False,)),
    I(f"{R_}.multi_turn.num_repeat_rollouts", "declared in verl 0.9.1's MultiTurnConfig, read by no code of its "
      "agent loop: it changes nothing there", check=positive_int),
    R(f"{R_}.agent.default_agent_loop", "agent loops: single-turn generation only here", ok=("single_turn_agent",)),
    R(f"{R_}.agent.agent_loop_config_path", "agent loops: single-turn generation only here", ok=(None,)),
    R(f"{R_}.agent.custom_async_server.path", "a custom rollout server", ok=(None,)),
    I(f"{R_}.agent.**", "agent-loop workers; " + SPEED, ("num_workers", "custom_async_server.name")),
    I(f"{R_}.val_kwargs.**", "validation sampling; here every evaluation logs eval/accuracy (sampled at the "
                             "rollout temperature) and eval/accuracy_greedy",
      ("do_sample", "n", "temperature", "top_k", "top_p")),
    M(f"{R_}.dtype", "actor_rollout.dtype", _rollout_dtype, why="auto / bfloat16 / float16 / float32"),
    M(f"{R_}.enforce_eager", "actor_rollout.enforce_eager", why="vLLM only; speed only"),
    M(f"{R_}.max_num_seqs", "actor_rollout.max_num_seqs", why="vLLM only; memory and speed only"),
    I(f"{R_}.log_prob_micro_batch_size", FORWARD_MICRO, check=positive_int),
    I(f"{R_}.log_prob_micro_batch_size_per_gpu", FORWARD_MICRO, check=positive_int),
    I(f"{R_}.log_prob_use_dynamic_bsz", FORWARD_MICRO),
    I(f"{R_}.log_prob_max_token_len_per_gpu", FORWARD_MICRO, check=positive_int),
    I(f"{R_}.calculate_log_probs", "the engine's log-probs are always kept here"),
    I(f"{R_}.logprobs_mode", "the engine's log-probs feed only logged statistics and off-policy weights here"),
    *(I(f"{R_}.{k}", "a serving-engine setting; " + SPEED, check=positive_int)
      for k in ("data_parallel_size", "expert_parallel_size", "pipeline_model_parallel_size",
                "max_num_batched_tokens", "max_model_len")),
    *(I(f"{R_}.{k}", "a serving-engine setting; " + SPEED)
      for k in ("cudagraph_capture_sizes", "free_cache_engine",
                "enable_chunked_prefill", "enable_prefix_caching", "scheduling_policy",
                "load_format", "disable_log_stats", "multi_stage_wake_up", "layered_summon", "skip_dump_dir",
                "skip_tokenizer_init", "enable_rollout_routing_replay", "mtp")),
    I(f"{R_}.engine_kwargs.**", "a serving-engine setting; " + SPEED),
    I(f"{R_}.engine_kwargs", "a serving-engine setting; " + SPEED),
    I(f"{R_}.trace.**", "rollout tracing (logging)", ("backend", "max_samples_per_step_per_worker", "token2text")),
    I(f"{R_}.prometheus.**", "serving metrics (logging)", ("enable", "file", "port", "served_model_name")),
    I(f"{R_}.layer_name_map.**", "weight-name mapping of verl's refit (here pfppo_mega's)"),
)
