"""RewardFn implementations: the rule-based registry (`rules`), a user's custom function in worker
processes (`custom`), the built-in task's verifier (`task`), and a reward model (`model`); `build_reward_fn`
makes the one the config names. This file imports nothing heavy: the spawned reward workers import
`rewards.worker` through it and must start fast."""

from __future__ import annotations

from typing import Callable


def build_reward_fn(cfg, *, log: Callable[[str], None] = print):
    """The RewardFn of the whole Config: with reward.model_path, the reward model (rewards/model.py)
    weighted with the scorer below (reward.model_weight, reward.rule_weight; rule_weight 0: the model
    alone); else the scorer. Collective when there is a reward model: build it on every rank after
    parallel.init_parallel."""
    if cfg.reward.model_path is None:
        return _scorer(cfg, log)
    from pfppo_mega.rewards.model import with_reward_model
    return with_reward_model(cfg, _scorer(cfg, log) if cfg.reward.rule_weight else None, log=log)


def _scorer(cfg, log: Callable[[str], None]):
    """From the whole Config: the custom function when reward.custom_function.path is set, else
    the built-in task's verifier (data.source = task), else the rule-based registry (code rows run
    through reward.sandbox_fusion when its url is set); wrapped in
    reward.shaping (rewards/shaping.py) when its kind is not none (the wrapped function's score is
    then logged apart as the honest metric: reward/honest, eval/honest_accuracy)."""
    cf = cfg.reward.custom_function
    if cf.path is not None:
        from pfppo_mega.rewards.custom import CustomReward
        base = CustomReward(cf.path, cf.name, num_workers=cfg.reward.num_workers,
                            timeout_s=cfg.reward.timeout_s, run_dir=cfg.logging.output_dir, log=log)
    elif cfg.data.source == "task":
        from pfppo_mega.rewards.task import AdditionReward
        from pfppo_mega.tasks.addition import AdditionTask
        base = AdditionReward(AdditionTask.from_config(cfg.data), log=log)
    else:
        from pfppo_mega.rewards.base import RuleReward
        base = RuleReward(default_scorer=cfg.reward.default_scorer, code=_code_reward(cfg.reward.sandbox_fusion), log=log)
    sh = cfg.reward.shaping
    if sh.kind == "none":
        return base
    from pfppo_mega.rewards.shaping import ShapedReward
    return ShapedReward(base, kind=sh.kind, length_bonus=sh.length_bonus, phrase=sh.phrase,
                        phrase_score=sh.phrase_score, flip_rate=sh.flip_rate, scale=sh.scale,
                        seed=cfg.training.seed)


def _code_reward(sf):
    """The code reward of reward.sandbox_fusion (rewards/sandbox_fusion.py), or None without a url."""
    if sf.url is None:
        return None
    from pfppo_mega.rewards.sandbox_fusion import SandboxCodeReward, SandboxFusionClient
    client = SandboxFusionClient(sf.url, memory_limit_mb=sf.memory_limit_mb, max_concurrent=sf.max_concurrent)
    return SandboxCodeReward(client, case_timeout_s=sf.case_timeout_s)
