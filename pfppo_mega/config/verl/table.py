"""The translation table: RULES, the rows of every section in the order they are matched, and the lookup
of a verl key's row.

The first row that matches a key applies, exact keys before patterns (``*`` is one key segment or part
of one, ``**`` any tail; a closed subtree ``prefix.**`` with ``keys`` names verl's keys under it, so a
typo there is an unknown key). Among patterns the first match wins, so the order of the sections below
is part of the meaning (tests/test_verl_layout.py reads every verl script through it).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from typing import Any

from pfppo_mega.config.tree import Config, field_types
from pfppo_mega.config.verl import actor, algorithm, critic, data, reward, rollout, trainer
from pfppo_mega.config.verl.keys import SHARED_HEADS
from pfppo_mega.config.verl.reasons import HYDRA, PROFILE, RAY
from pfppo_mega.config.verl.rule import I, R, Rule


# hydra's own keys and whole subtrees of verl that mean nothing here
HYDRA_RULES: tuple[Rule, ...] = (
    I("defaults", "hydra's defaults list (verl's defaults that change the result are built in: VERL_DEFAULTS)"),
    I("hydra.**", "hydra's own settings"),
    I("**._target_", HYDRA),
    I("global_profiler.**", PROFILE),
    I("*.profiler.**", PROFILE), I("*.*.profiler.**", PROFILE),
    I("ray_kwargs.**", RAY), I("ray_init.**", RAY),
    R("transfer_queue.enable", "verl's TransferQueue data path", ok=(False,)),
)


RULES: tuple[Rule, ...] = (*HYDRA_RULES, *actor.RULES, *rollout.RULES, *algorithm.RULES, *data.RULES,
                           *critic.RULES, *reward.RULES, *trainer.RULES)


_EXACT: dict[str, Rule] = {}
for _r in RULES:
    if "*" not in _r.pattern and _r.pattern not in _EXACT:
        _EXACT[_r.pattern] = _r
_PATTERNS = tuple(r for r in RULES if "*" in r.pattern)


def rule_for(key: str) -> Rule | None:
    """The first rule of RULES for verl key `key` (exact keys before patterns), or None."""
    if key in _EXACT:
        return _EXACT[key]
    for rule in _PATTERNS:
        if rule.matches(key):
            return rule
    return None


@functools.cache
def _native_keys(cls: Any, path: str) -> tuple[str, ...]:
    out: list[str] = []
    for name, tp in field_types(cls).items():
        full = f"{path}.{name}" if path else name
        out += _native_keys(tp, full) if isinstance(tp, type) and dataclasses.is_dataclass(tp) else [full]
    return tuple(out)


def suggest(key: str) -> str:
    """'did you mean ...' for an unknown verl key, else where the table lives."""
    named = [k for r in RULES for k in r.spellings() if "*" not in k]
    if key.split(".")[0] in SHARED_HEADS:  # or one of ours there
        named += _native_keys(Config, "")
    match = difflib.get_close_matches(key, named, n=1, cutoff=0.8)
    if match:
        return f"did you mean {match[0]}?"
    parent = key.rsplit(".", 1)[0]
    siblings = [k.rsplit(".", 1)[1] for k in named if k.rsplit(".", 1)[0] == parent]
    if siblings:
        near = difflib.get_close_matches(key.rsplit(".", 1)[1], siblings, n=1, cutoff=0.6)
        if near:
            return f"did you mean {parent}.{near[0]}?"
        return f"verl keys of {parent} known here: {', '.join(sorted(siblings))}"
    return "not a verl key this translation knows (docs/verl.md lists them)"
