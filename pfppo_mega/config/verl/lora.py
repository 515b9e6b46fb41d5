"""Rows for verl's LoRA keys of the actor: the FSDP spelling (actor_rollout_ref.model.lora_rank, lora_alpha,
target_modules, exclude_modules, lora_adapter_path) and the megatron one (actor_rollout_ref.model.lora.*),
onto model.lora (pfppo_mega/models/lora.py).

verl's two spellings have different defaults (lora_alpha 16; lora.alpha 32 and lora.lora_A_init_method
xavier), so a rank > 0 also sets the alpha (and the megatron spelling the A init) its own spelling would
use when the script leaves them out; a script that sets them gets its values. Rank 0 asks for nothing.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from pfppo_mega import constants as C
from pfppo_mega.config.tree import lora_target_problem
from pfppo_mega.config.verl.keys import M_
from pfppo_mega.config.verl.rule import I, Ignore, M, Out, R, Refuse, Rule, View, _typed

L = f"{M_}.lora"  # verl's megatron LoRA subtree
# verl's defaults of the keys a rank reads (verl_megatron_defaults.json; tests/test_verl_layout.py checks them)
FSDP_ALPHA, MEGATRON_ALPHA, MEGATRON_INIT = 16, 32, "xavier"
_INITS = {"kaiming": "kaiming", "xavier": "xavier"}


def _rank(alpha_key: str, alpha_default: float, init: Optional[tuple[str, str]] = None) -> Callable[[Any, View], Any]:
    """rank > 0 -> model.lora.rank, with the alpha (and init) of the same spelling."""
    def convert(value: Any, v: View) -> Any:
        rank = _typed(value, Optional[int])
        if not rank:
            raise Ignore("0: LoRA off (every weight trains)")
        alpha = v.get(alpha_key)
        out = {"model.lora.rank": rank, "model.lora.alpha": float(alpha_default if alpha is None else _typed(alpha, float))}
        if init is not None:
            name = v.get(init[0])
            out["model.lora.init_a"] = _init_a(init[1] if name is None else name, v)
        return Out(out, "LoRA: the base frozen, adapters on the decoder's linears (models/lora.py)")
    return convert


def _alpha(value: Any, v: View) -> Any:
    return float(_typed(value, float))


def _targets(value: Any, v: View) -> Any:
    names = [value] if isinstance(value, str) else _typed(value, list[str])
    problem = lora_target_problem(names)
    if problem is not None:
        raise Refuse(problem)
    return Out({"model.lora.target_modules": list(names)})


def _exclude(value: Any, v: View) -> Any:
    if value is None or value == []:
        raise Ignore("nothing excluded")
    names = [value] if isinstance(value, str) else _typed(value, list[str])
    return Out({"model.lora.exclude_modules": list(names)},
               "regular expressions over the module names (a text-only decoder has no vision modules to match)")


def _init_a(value: Any, v: View) -> Any:
    name = _typed(value, str)
    if name not in _INITS:
        raise Refuse(f"A initialised by {name!r}: here {' or '.join(C.LORA_INITS)} (model.lora.init_a)")
    return _INITS[name]


def _adapter(value: Any, v: View) -> Any:
    if value is None:
        raise Ignore("no adapter to load")
    return Out({"model.lora.adapter_path": _typed(value, str)},
               "a PEFT adapter loaded onto the base; rank, alpha and targets from its adapter_config.json "
               "unless a rank is set")


def _when_on(rank_key: str, convert: Callable[[Any, View], Any]) -> Callable[[Any, View], Any]:
    """A setting of one spelling's adapters: mapped while that spelling's rank is > 0, else ignored (verl's
    composed config carries both spellings' defaults, with different alphas and target names)."""
    def when_on(value: Any, v: View) -> Any:
        rank = v.get(rank_key)
        if not (isinstance(rank, int) and not isinstance(rank, bool) and rank > 0):
            raise Ignore(f"LoRA of this spelling is off ({rank_key} = {rank!r})")
        return convert(value, v)
    return when_on


_FR, _MR = f"{M_}.lora_rank", f"{L}.rank"
_OFF_FSDP = "ignored while lora_rank is 0"
_OFF_MEGATRON = "ignored while lora.rank is 0"

RULES: tuple[Rule, ...] = (
    # FSDP spelling
    M(_FR, "model.lora.rank", _rank(f"{M_}.lora_alpha", FSDP_ALPHA),
      why=f"0 = off; > 0 also sets model.lora.alpha (lora_alpha, verl's default {FSDP_ALPHA})"),
    M(f"{M_}.lora_alpha", "model.lora.alpha", why=_OFF_FSDP, convert=_when_on(_FR, _alpha)),
    M(f"{M_}.target_modules", "model.lora.target_modules", why=_OFF_FSDP, convert=_when_on(_FR, _targets)),
    M(f"{M_}.exclude_modules", "model.lora.exclude_modules", why=_OFF_FSDP, convert=_when_on(_FR, _exclude)),
    M(f"{M_}.lora_adapter_path", "model.lora.adapter_path", _adapter,
      "a PEFT adapter loaded onto the base; with rank 0 its adapter_config.json gives rank, alpha and targets"),
    # megatron spelling
    M(_MR, "model.lora.rank", _rank(f"{L}.alpha", MEGATRON_ALPHA, (f"{L}.lora_A_init_method", MEGATRON_INIT)),
      why=f"0 = off; > 0 also sets model.lora.alpha (lora.alpha, verl's default {MEGATRON_ALPHA}) and "
          f"model.lora.init_a (lora.lora_A_init_method, verl's default {MEGATRON_INIT})"),
    M(f"{L}.alpha", "model.lora.alpha", _when_on(_MR, _alpha), _OFF_MEGATRON),
    M(f"{L}.target_modules", "model.lora.target_modules", _when_on(_MR, _targets), _OFF_MEGATRON),
    M(f"{L}.exclude_modules", "model.lora.exclude_modules", _when_on(_MR, _exclude), _OFF_MEGATRON),
    M(f"{L}.adapter_path", "model.lora.adapter_path", _adapter,
      "a PEFT adapter loaded onto the base; with rank 0 its adapter_config.json gives rank, alpha and targets"),
    M(f"{L}.lora_A_init_method", "model.lora.init_a", _when_on(_MR, _init_a), _OFF_MEGATRON),
    M(f"{L}.dropout", "model.lora.dropout", _when_on(_MR, _alpha), _OFF_MEGATRON),
    R(f"{L}.type", "LoRA variants other than plain LoRA (dora, canonical_lora): not implemented here", ok=("lora",),
      fix="set it to lora"),
    R(f"{L}.lora_B_init_method", "B initialised other than to zero (step 0 would not be the base model)",
      ok=("zero",), fix="set it to zero"),
    R(f"{L}.dtype", "adapters in a dtype of their own: here they take model.params_dtype", ok=(None,),
      fix="remove it (the adapters then take the parameters' dtype)"),
    I(f"{L}.merge", "the rollout engines, pool snapshots and exports always get the merged weights W + s B A here"),
    I(f"{L}.dropout_position", "the adapter's dropout is 0 here (model.lora.dropout)"),
    I(f"{L}.a2a_experimental", "mixture-of-experts only (not supported here)"),
    *(I(f"{L}.{k}", "vision-language models only; under LoRA every base weight is frozen here")
      for k in ("freeze_vision_model", "freeze_vision_projection", "freeze_language_model")),
)
