"""RewardFn implementations: the rule-based registry (`rules`), a user's custom function in worker
processes (`custom`), and the built-in task's verifier; `build_reward_fn` makes the one the config
names. This file imports nothing heavy: the spawned reward workers import `rewards.worker` through
it and must start fast."""

from __future__ import annotations

from typing import Callable


def build_reward_fn(cfg, *, log: Callable[[str], None] = print):
    """From the whole Config: the custom function when reward.custom_function.path is set, else
    the built-in task's verifier (data.source = task), else the rule-based registry."""
    cf = cfg.reward.custom_function
    if cf.path is not None:
        from pfppo_mega.rewards.custom import CustomReward
        return CustomReward(cf.path, cf.name, num_workers=cfg.reward.num_workers,
                            timeout_s=cfg.reward.timeout_s, log=log)
    if cfg.data.source == "task":
        from pfppo_mega.tasks.addition import AdditionReward, AdditionTask
        return AdditionReward(AdditionTask(cfg.data.num_digits), log=log)
    from pfppo_mega.rewards.base import RuleReward
    return RuleReward(default_scorer=cfg.reward.default_scorer, log=log)
