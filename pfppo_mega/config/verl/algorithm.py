"""Rows for verl's algorithm section (shared with our tree: a key listed here is verl's, else ours):
the estimator, GAE, KL (see kl.py), policy filtration (verl's use_pf_ppo), DAPO's dynamic sampling
and the rollout-correction keys.
"""

from __future__ import annotations

from typing import Any, Optional

from pfppo_mega.config.tree import AlgorithmConfig, field_types
from pfppo_mega.config.verl.convert import _choice
from pfppo_mega.config.verl.keys import A
from pfppo_mega.config.verl.kl import _kl_coef, _kl_ctrl_type, _kl_type, _use_kl_in_reward
from pfppo_mega.config.verl.rule import Bad, I, Ignore, M, Out, R, Refuse, Rule, View, _typed
from pfppo_mega.constants import ROLLOUT_IS_LEVELS


def _use_pf_ppo(value: Any, v: View) -> Out:
    on = _typed(value, bool)
    return Out({"algorithm.filtration.enable": on},
               "verl's use_pf_ppo is policy filtration (reward-weighted resampling, arXiv 2409.06957), "
               "read as algorithm.filtration.enable; this project's algorithm.use_pf_ppo (the snapshot pool, "
               "algorithm.pool) stays off" if on else "")


def _bypass_mode(value: Any, v: View) -> Out:
    """verl's bypass mode sets old_log_probs = rollout_log_probs and trains its rollout_correction.loss_type
    (ppo_clip or reinforce) whatever policy_loss.loss_mode says: a loss_mode other than vanilla is refused."""
    if not _typed(value, bool):
        return Out({"algorithm.recompute_old_logp": True})
    mode = v.get(f"{A}.policy_loss.loss_mode")
    if mode not in (None, "vanilla"):
        raise Refuse(f"verl's bypass mode trains the vanilla PPO-clip loss whatever {A}.policy_loss.loss_mode "
                     f"says ({mode!r} here); set loss_mode vanilla for what verl runs")
    return Out({"algorithm.recompute_old_logp": False},
               "the engine's log-probs are the proximal policy: the prepare pass runs no actor forward")


RC = "algorithm.rollout_correction"  # verl's keys
_RC = "algorithm.rollout_correction"  # ours (the same path)


def _bypass_only(what: str, v: View) -> None:
    """verl's rollout correction is built here in its bypass mode only."""
    bypass = v.get(f"{RC}.bypass_mode")  # verl's default: false
    if bypass is None or not _typed(bypass, bool):
        raise Refuse(f"{what} in verl's decoupled mode (bypass_mode false: weights from the recomputed old "
                     f"log-probs, a third policy) is not built; set {RC}.bypass_mode=true for verl's bypass mode "
                     f"(the engine's log-probs are the proximal policy, the correction is taken in the loss)")


def _rollout_is(value: Any, v: View) -> Any:
    level = _typed(value, Optional[str])
    if level is None:
        return Out({f"{_RC}.rollout_is": None})
    if level not in ROLLOUT_IS_LEVELS:
        raise Bad(f"must be null or one of {', '.join(ROLLOUT_IS_LEVELS)}")
    _bypass_only("rollout importance weights", v)
    return Out({f"{_RC}.rollout_is": level})


def _threshold(spec: Any, what: str) -> tuple[Optional[float], float]:
    """verl's threshold spelling: a number (upper), or the string 'lower_upper'."""
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise Bad(f"{what}: must be a number or a 'lower_upper' string")
    text = str(spec).strip()
    lo, _, up = text.rpartition("_") if "_" in text else ("", "", text)
    try:
        lower, upper = (float(lo) if lo else None), float(up)
    except ValueError:
        raise Bad(f"{what}: {spec!r} must be a number or a 'lower_upper' string of two numbers") from None
    return lower, upper


def _rollout_is_threshold(value: Any, v: View) -> Any:
    lower, upper = _threshold(value, "rollout_is_threshold")
    return Out({f"{_RC}.rollout_is_threshold": upper, f"{_RC}.rollout_is_threshold_lower": lower})


def _criteria(v: View) -> list[str]:
    names = v.get(f"{RC}.rollout_rs")
    return [] if names is None else [n.strip() for n in str(names).split(",") if n.strip()]


def _rollout_rs(value: Any, v: View) -> Any:
    names = _criteria(v)
    if names:
        _bypass_only("rollout rejection sampling", v)
        if v.get(f"{RC}.rollout_rs_threshold") is None:
            raise Bad(f"needs {RC}.rollout_rs_threshold, which must be set when rollout_rs is (verl refuses "
                      f"rejection sampling without it)")
    return Out({f"{_RC}.rollout_rs": list(dict.fromkeys(names))})  # verl drops a repeated name


def _rollout_rs_threshold(value: Any, v: View) -> Any:
    """One threshold shared by every criterion or one each (comma-separated), as verl 0.9.1 reads them;
    a k1 criterion's single number u means [1/u, u]."""
    names = list(dict.fromkeys(_criteria(v)))
    if not names:
        return Out({})
    if value is None:
        raise Bad("must be set when rollout_rs is (verl refuses rejection sampling without it)")
    specs = [p.strip() for p in str(value).split(",") if p.strip()] if isinstance(value, str) else [value]
    if len(specs) not in (1, len(names)):
        raise Bad(f"must give one threshold for all {len(names)} rollout_rs criteria or one each")
    specs = specs * len(names) if len(specs) == 1 else specs
    lowers, uppers = [], []
    for name, spec in zip(names, specs):
        lower, upper = _threshold(spec, name)
        if lower is not None and not name.endswith("k1"):
            raise Bad(f"{name}: only the k1 criteria take a 'lower_upper' threshold")
        lowers.append(lower)
        uppers.append(upper)
    return Out({f"{_RC}.rollout_rs_upper": uppers, f"{_RC}.rollout_rs_lower": lowers})


def _loss_type(value: Any, v: View) -> Any:
    kind = _typed(value, str)
    if kind not in ("ppo_clip", "reinforce"):
        raise Bad("must be ppo_clip or reinforce")
    if kind == "reinforce":
        _bypass_only("loss_type reinforce", v)
    return Out({f"{_RC}.loss_type": kind})


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
    M(f"{RC}.rollout_is", f"{_RC}.rollout_is", _rollout_is, why="token / sequence, bypass mode only"),
    M(f"{RC}.rollout_is_threshold", f"{_RC}.rollout_is_threshold", _rollout_is_threshold,
      why="a number: TIS's upper bound; 'lower_upper': IcePop's bounds"),
    M(f"{RC}.rollout_is_batch_normalize", f"{_RC}.rollout_is_batch_normalize",
      why="over the micro-batch, as verl's bypass loss"),
    M(f"{RC}.rollout_rs", f"{_RC}.rollout_rs", _rollout_rs, why="comma-separated criteria -> a list; bypass mode only"),
    M(f"{RC}.rollout_rs_threshold", f"{_RC}.rollout_rs_upper / rollout_rs_lower", _rollout_rs_threshold,
      why="one shared or one per criterion; k1: 'lower_upper' or u = [1/u, u]"),
    M(f"{RC}.bypass_mode", "algorithm.recompute_old_logp", _bypass_mode,
      why="true: recompute_old_logp false (the engine's log-probs are the proximal policy), with loss_mode "
          "vanilla (what verl's bypass trains); the decoupled mode's weights are refused at their keys"),
    M(f"{RC}.loss_type", f"{_RC}.loss_type", _loss_type, why="ppo_clip / reinforce (bypass mode)"),
)
