"""Advantage estimators, registered by name (``algorithm.adv_estimator``) and chosen once per run.

An estimator declares what it needs: ``needs_critic`` (GAE bootstraps from the critic's values;
an estimator without it gets no critic, no critic optimizer and no value pass, and the planner
counts none). It maps the step's rows to (advantages, returns), both [B, T] and zero on padding.
The arithmetic lives in ``pfppo_mega.ppo`` / the kernels backend; this module only binds the
run's settings to it.

Register a new one with ``pfppo_mega.registry.ADV_ESTIMATORS.register(name, AdvantageEstimator(...))``
(project estimators: one line in pfppo_mega/registry.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from pfppo_mega import ppo


@dataclass(frozen=True)
class AdvantageInputs:
    token_rewards: torch.Tensor           # [B, T] sequence score on the last token (- KL penalty in reward)
    mask: torch.Tensor                    # [B, T] 1 on real response tokens
    values: Optional[torch.Tensor]        # [B, T] critic values (None unless needs_critic)
    group_ids: torch.Tensor               # [B] long, rows answering the same prompt share one


@dataclass(frozen=True)
class EstimatorContext:
    """The run's settings an estimator may read, bound once."""

    algorithm: object                     # the config's AlgorithmConfig (gamma, lmbda, whiten_advantages)
    gae: Callable                         # the kernels backend's GAE
    reduce_sum: Optional[Callable]        # sum over the data-parallel ranks (None at dp = 1)


@dataclass(frozen=True)
class AdvantageEstimator:
    name: str
    needs_critic: bool
    compute: Callable[[AdvantageInputs, EstimatorContext], tuple[torch.Tensor, torch.Tensor]]


def _gae(x: AdvantageInputs, ctx: EstimatorContext) -> tuple[torch.Tensor, torch.Tensor]:
    a = ctx.algorithm
    adv, returns = ctx.gae(x.token_rewards, x.values, x.mask, gamma=a.gamma, lam=a.lmbda)  # [B, T] each
    if a.whiten_advantages:  # over the global batch's tokens (every DP rank's)
        adv = ppo.masked_whiten(adv, x.mask, reduce_sum=ctx.reduce_sum)
    return adv, returns


GAE = AdvantageEstimator("gae", needs_critic=True, compute=_gae)
