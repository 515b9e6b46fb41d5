"""Rows for verl's reward_model, reward_manager and custom_reward_function sections: a reward model's
score, rule-based scoring (verl's naive / dapo / prime managers score the same; batch only with a
per-sample function), a user's
reward function, and DAPO's overlong penalty under both of verl's spellings.
"""

from __future__ import annotations

from typing import Any, Callable
from typing import Optional

from pfppo_mega.config.verl.convert import _when_ours
from pfppo_mega.config.verl.reasons import FSDP, SPEED
from pfppo_mega.config.verl.rule import Bad, I, Ignore, M, Out, R, Refuse, Rule, View, _native_type, _typed


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
    if not isinstance(path, str) or not path.strip():
        raise Bad(f"reward_model.enable=True needs reward_model.model.path, the reward model's checkpoint directory "
                  f"(a sequence classifier sharing the policy's vocabulary); got {path!r}: set it, or remove "
                  f"reward_model.enable to score with the rule-based reward alone")
    where = "verl's reward loop without a custom_reward_function" if loop else "verl's legacy path"
    return Out({"reward.model_path": _typed(path, str), "reward.rule_weight": 0.0},
               f"{where} trains on the reward model's score alone (reward.rule_weight = 0); it must be a "
               "sequence classifier sharing the policy's vocabulary (checked at start)")


def _reward_manager(value: Any, v: View) -> Any:
    name = _typed(value, str)
    same = {"naive": "each sample scored by its data_source's scorer, as here",
            "prime": "verl's prime manager runs the same scorers in a process pool",
            "batch": "verl's batch manager calls the reward function once per batch with lists; here it is "
                     "called once per sample, so a per-sample function (or the built-in scorers) scores the "
                     "same and a batch-style function (lists in, a list out) is refused at start: rewrite it "
                     "per sample",
            "dapo": "verl's dapo manager is the naive one plus the overlong buffer (reward.overlong_buffer, from "
                    "its overlong_buffer keys)"}
    if name in same:
        raise Ignore(same[name])
    raise Refuse(f"reward manager {name!r}: only verl's naive scoring (and dapo / prime, which score the same, "
                 "and batch with a per-sample function) exists here; remove it and write the scoring as custom_reward_function.path")


MANAGERS = ("naive, dapo, prime score the same; batch calls the reward function with lists, here it is called per "
            "sample: a batch-style function is refused at start (write it per sample); others refused")
OVERLONG = "reward_model.reward_kwargs.overlong_buffer_cfg"  # verl's examples (main_ppo, dapo reward manager)
OVERLONG_RECIPE = "reward_model.overlong_buffer"  # verl's recipe/dapo (dapo_trainer.yaml): the same three keys


def _overlong_on(v: View, prefix: str = OVERLONG) -> bool:
    return v.typed(f"{prefix}.enable", Optional[bool]) is True


def _overlong_enable(prefix: str) -> Callable[[Any, View], Any]:
    """DAPO's overlong penalty on or off; on, it needs its buffer length under verl's own spelling."""
    ours = _when_ours("reward.overlong_buffer.enable", (False, None))

    def convert(value: Any, v: View) -> Any:
        on = _typed(value, Optional[bool])
        if on and v.get(f"{prefix}.len") is None and "reward.overlong_buffer.len" not in v.native:
            raise Bad(f"{prefix}.enable=True needs {prefix}.len, the buffer in tokens (the penalty grows over the "
                      f"last len tokens before data.max_response_length): set it to a length >= 1 and below "
                      f"data.max_response_length, or remove {prefix}.enable")
        return ours(value, v)
    return convert


def _overlong_param(target: str, prefix: str = OVERLONG) -> Callable[[Any, View], Any]:
    """A parameter of DAPO's overlong penalty: ours when it is enabled."""
    ours = _when_ours(target)

    def convert(value: Any, v: View) -> Any:
        _typed(value, Optional[_native_type(target)])  # a number (or null) even where unused: a typo is caught now
        if not _overlong_on(v, prefix):
            raise Ignore(f"used only with {prefix}.enable=True")
        return ours(value, v)
    return convert


def _overlong_max_len(value: Any, v: View) -> Any:
    _typed(value, Optional[int])  # a length (or null) even where unused: a typo is caught now
    if not _overlong_on(v):
        raise Ignore(f"used only with {OVERLONG}.enable=True")
    if _typed(value, int) != v.typed("data.max_response_length", int):
        raise Refuse(f"differs from data.max_response_length ({v.get('data.max_response_length')!r}): here the "
                     "overlong penalty ends at algorithm.max_response_length")
    raise Ignore("equal to data.max_response_length, where our penalty ends")


def _sandbox(target: str) -> Callable[[Any, View], Any]:
    """A key of verl's sandbox_fusion: ours when its url is set and no custom_reward_function replaces
    verl's default scorer (the only one that reads them)."""
    def convert(value: Any, v: View) -> Any:
        out = _typed(value, Optional[_native_type(target)])  # the right type even where unused: a typo is caught now
        if v.get("reward_model.sandbox_fusion.url") is None:
            raise Ignore("used only with reward_model.sandbox_fusion.url")
        if v.get("custom_reward_function.path") is not None:
            raise Ignore("verl's default scorer alone reads the sandbox; custom_reward_function.path replaces it")
        return out
    return convert


RULES: tuple[Rule, ...] = (
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
    M("reward_model.reward_manager", "(rule-based scoring)", _reward_manager, why=MANAGERS),
    M(f"{OVERLONG}.enable", "reward.overlong_buffer.enable", _overlong_enable(OVERLONG),
      why="DAPO's overlong penalty; refused until our tree has reward.overlong_buffer"),
    M(f"{OVERLONG}.len", "reward.overlong_buffer.len", _overlong_param("reward.overlong_buffer.len")),
    M(f"{OVERLONG}.penalty_factor", "reward.overlong_buffer.penalty_factor",
      _overlong_param("reward.overlong_buffer.penalty_factor")),
    I(f"{OVERLONG}.log", "logging of the overlong penalty"),
    M(f"{OVERLONG_RECIPE}.enable", "reward.overlong_buffer.enable",
      _overlong_enable(OVERLONG_RECIPE), why="DAPO's overlong penalty (verl's recipe/dapo "
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
    M("reward_model.sandbox_fusion.url", "reward.sandbox_fusion.url", _sandbox("reward.sandbox_fusion.url"),
      why="code rewards of the code data_sources (codecontests, apps, codeforces, taco) through the service; "
          "ignored with custom_reward_function.path, as verl ignores it"),
    M("reward_model.sandbox_fusion.max_concurrent", "reward.sandbox_fusion.max_concurrent",
      _sandbox("reward.sandbox_fusion.max_concurrent")),
    M("reward_model.sandbox_fusion.memory_limit_mb", "reward.sandbox_fusion.memory_limit_mb",
      _sandbox("reward.sandbox_fusion.memory_limit_mb")),
    I("reward_model.launch_reward_fn_async", SPEED),
    I("reward_model.rollout.**", "a generative reward model's server (refused with reward_model.enable)"),
    *(I(f"reward_model.{k}", "reward-model placement and batching; " + SPEED)
      for k in ("enable_resource_pool", "n_gpus_per_node", "nnodes", "strategy", "micro_batch_size",
                "micro_batch_size_per_gpu", "max_length", "use_dynamic_bsz", "forward_max_token_len_per_gpu",
                "nccl_timeout", "load_weight", "num_workers", "ulysses_sequence_parallel_size")),
    I("reward_model.megatron.**", "the reward model uses the actor's layout here"),
    M("reward_manager.name", "(rule-based scoring)", _reward_manager, why=MANAGERS),
    R("reward_manager.source", "a user's reward manager", ok=("register",)),
    R("reward_manager.module.path", "a user's reward manager", ok=(None,)),
    I("reward_manager.module.name", "reward_manager.module.path only"),
    M("custom_reward_function.path", "reward.custom_function.path"),
    M("custom_reward_function.name", "reward.custom_function.name"),
    R("custom_reward_function.reward_kwargs", "extra arguments of the reward function", ok=({},)),
    R("custom_reward_function.reward_kwargs.**", "extra arguments of the reward function"),
)
