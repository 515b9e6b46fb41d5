"""Rows for verl's algorithm section (shared with our tree: a key listed here is verl's, else ours):
the estimator, GAE, KL (see kl.py), policy filtration (verl's use_pf_ppo), DAPO's dynamic sampling
and the rollout-correction keys.
"""

from __future__ import annotations

from typing import Any

from pfppo_mega.config.tree import AlgorithmConfig, field_types
from pfppo_mega.config.verl.convert import _choice
from pfppo_mega.config.verl.keys import A
from pfppo_mega.config.verl.kl import _kl_coef, _kl_ctrl_type, _kl_type, _use_kl_in_reward
from pfppo_mega.config.verl.reasons import NO_CORRECTION
from pfppo_mega.config.verl.rule import I, Ignore, M, Out, R, Refuse, Rule, View, _typed


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


def _norm_adv(value: Any, v: View) -> Any:
    _typed(value, bool)
    if "norm_adv_by_std_in_grpo" in field_types(AlgorithmConfig):
        return Out({"algorithm.norm_adv_by_std_in_grpo": value})
    if v.get("algorithm.adv_estimator") == "grpo":
        raise Refuse("mapping waits for key algorithm.norm_adv_by_std_in_grpo (GRPO's std normalisation)")
    raise Ignore("verl applies it to adv_estimator=grpo only")


RULES: tuple[Rule, ...] = (
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
)
