"""verl's KL settings read as ours: verl has two switches (actor.use_kl_loss, algorithm.use_kl_in_reward)
and no KL at all when both are off; here one algorithm.kl_coeff, with algorithm.use_kl_loss choosing a
loss term or a per-token reward penalty. Rows of the actor and of algorithm use these converters.
"""

from __future__ import annotations

from typing import Any, Callable

from pfppo_mega.config.verl.keys import A
from pfppo_mega.config.verl.rule import Ignore, Out, Refuse, View, _typed


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
        coef = _typed(value, float)  # a number even where unused: a typo is caught now
        _kl_active(v, where)
        return coef
    return convert


def _kl_type(where: str) -> Callable[[Any, View], Any]:
    def convert(value: Any, v: View) -> Any:
        _typed(value, str)  # a name even where unused: a typo of type is caught now
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
