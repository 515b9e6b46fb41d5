"""Advantage estimators, registered by name (``algorithm.adv_estimator``) and chosen once per run.

An estimator declares what it needs: ``needs_critic`` (GAE bootstraps from the critic's values;
an estimator without it gets no critic, no critic optimizer and no value pass, and the planner
counts none) and ``needs_groups`` (a baseline over each prompt's n samples: the run must
sample n >= 2 per prompt, checked at start in trainer/build.py) and ``needs_greedy_baseline`` (one
extra greedy response per prompt from the same engine and weights, scored by the same reward
function: the rollout phase generates it, the score phase scores it, and its reward reaches the
estimator as ``baselines``; its tokens are never trained on) and ``needs_sum_pi_squared`` (the
prepare pass adds sum_v pi(v)^2 per token from one more actor forward; with the proximal log-probs it
reaches the estimator: verl's optimal_token_baseline). It maps the step's rows to (advantages, returns), both [B, T] and zero on padding.
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
from pfppo_mega.ppo import outcome


@dataclass(frozen=True)
class AdvantageInputs:
    token_rewards: torch.Tensor           # [B, T] sequence score on the last token (- KL penalty in reward)
    mask: torch.Tensor                    # [B, T] 1 on real response tokens
    values: Optional[torch.Tensor]        # [B, T] critic values (None unless needs_critic)
    group_ids: torch.Tensor               # [B] long, rows answering the same prompt share one
    baselines: Optional[torch.Tensor] = None  # [B] greedy response's score of each row's prompt
    #                                           (None unless needs_greedy_baseline)
    old_logp: Optional[torch.Tensor] = None   # [B, T] proximal log-probs (read by needs_sum_pi_squared ones)
    sum_pi_squared: Optional[torch.Tensor] = None  # [B, T] sum_v pi(v)^2 (None unless needs_sum_pi_squared)


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
    needs_groups: bool = False            # its baseline is a statistic of each prompt's n samples
    needs_greedy_baseline: bool = False   # its baseline is the reward of a greedy response per prompt
    needs_sum_pi_squared: bool = False    # it reads sum_v pi(v)^2 per token (one more actor forward in prepare)


def _gae(x: AdvantageInputs, ctx: EstimatorContext) -> tuple[torch.Tensor, torch.Tensor]:
    a = ctx.algorithm
    adv, returns = ctx.gae(x.token_rewards, x.values, x.mask, gamma=a.gamma, lam=a.lmbda)  # [B, T] each
    if a.whiten_advantages:  # over the global batch's tokens (every DP rank's)
        adv = ppo.masked_whiten(adv, x.mask, reduce_sum=ctx.reduce_sum)
    return adv, returns


GAE = AdvantageEstimator("gae", needs_critic=True, compute=_gae)


# ----------------------------------------------------------------------------- critic-free (outcome)
# verl's estimators under verl's names (verl/trainer/ppo/core_algos.py); math in pfppo_mega.ppo.outcome.
# Groups are the rows of one prompt; every rank generates all n samples of its prompts, so the group
# statistics are local and only the batch-wide ones (whitening, GPG's alpha) reduce over DP ranks.

def _grpo(x: AdvantageInputs, ctx: EstimatorContext):
    return outcome.grpo_advantages(x.token_rewards, x.mask, x.group_ids,
                                   norm_adv_by_std_in_grpo=ctx.algorithm.norm_adv_by_std_in_grpo)


def _grpo_passk(x: AdvantageInputs, ctx: EstimatorContext):
    return outcome.grpo_passk_advantages(x.token_rewards, x.mask, x.group_ids,
                                         norm_adv_by_std_in_grpo=ctx.algorithm.norm_adv_by_std_in_grpo)


def _rloo(x: AdvantageInputs, ctx: EstimatorContext):
    return outcome.rloo_advantages(x.token_rewards, x.mask, x.group_ids)


def _opo(x: AdvantageInputs, ctx: EstimatorContext):
    return outcome.opo_advantages(x.token_rewards, x.mask, x.group_ids)


def _gpg(x: AdvantageInputs, ctx: EstimatorContext):
    return outcome.gpg_advantages(x.token_rewards, x.mask, x.group_ids, reduce_sum=ctx.reduce_sum)


def _rpp(x: AdvantageInputs, ctx: EstimatorContext):
    return outcome.reinforce_plus_plus_advantages(x.token_rewards, x.mask, gamma=ctx.algorithm.gamma,
                                                  reduce_sum=ctx.reduce_sum)


def _rpp_baseline(x: AdvantageInputs, ctx: EstimatorContext):
    return outcome.reinforce_plus_plus_baseline_advantages(x.token_rewards, x.mask, x.group_ids,
                                                           reduce_sum=ctx.reduce_sum)


GRPO = AdvantageEstimator("grpo", needs_critic=False, compute=_grpo, needs_groups=True)
GRPO_PASSK = AdvantageEstimator("grpo_passk", needs_critic=False, compute=_grpo_passk, needs_groups=True)
RLOO = AdvantageEstimator("rloo", needs_critic=False, compute=_rloo, needs_groups=True)
OPO = AdvantageEstimator("opo", needs_critic=False, compute=_opo, needs_groups=True)
GPG = AdvantageEstimator("gpg", needs_critic=False, compute=_gpg, needs_groups=True)
REINFORCE_PLUS_PLUS = AdvantageEstimator("reinforce_plus_plus", needs_critic=False, compute=_rpp)
REINFORCE_PLUS_PLUS_BASELINE = AdvantageEstimator("reinforce_plus_plus_baseline", needs_critic=False,
                                                  compute=_rpp_baseline, needs_groups=True)


def _remax(x: AdvantageInputs, ctx: EstimatorContext):
    if x.baselines is None:
        raise ValueError("remax: the rows carry no greedy baselines (the rollout generates them when the "
                         "estimator declares needs_greedy_baseline)")
    return outcome.remax_advantages(x.token_rewards, x.mask, x.baselines)


REMAX = AdvantageEstimator("remax", needs_critic=False, compute=_remax, needs_greedy_baseline=True)


def _otb(x: AdvantageInputs, ctx: EstimatorContext):
    if x.sum_pi_squared is None or x.old_logp is None:
        raise ValueError("optimal_token_baseline: the rows carry no sum_pi_squared / old_logp (the prepare pass "
                         "computes them when the estimator declares needs_sum_pi_squared)")
    return outcome.optimal_token_baseline_advantages(x.token_rewards, x.mask, x.group_ids, x.old_logp,
                                                     x.sum_pi_squared)


OPTIMAL_TOKEN_BASELINE = AdvantageEstimator("optimal_token_baseline", needs_critic=False, compute=_otb,
                                            needs_groups=True, needs_sum_pi_squared=True)
