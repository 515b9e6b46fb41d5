"""Whether a config is in verl's layout, and which of its keys are verl's.

A config is in verl's layout when its top level (or an override's key) names one of verl's own
sections (VERL_HEADS); ``trainer.total_training_steps`` alone is our alias, not a marker. In the
sections both trees have (algorithm, data) a key is verl's when the table has a row for it or our
tree does not know it. Hydra's override prefixes (``+key``, ``++key``, ``~key``) are stripped.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping

from pfppo_mega.config.tree import Config, field_types
from pfppo_mega.config.verl.keys import _NATIVE_TRAINER_KEYS, SHARED_HEADS, VERL_HEADS
from pfppo_mega.config.verl.table import rule_for


def is_verl_layout(top_keys: Mapping[str, Any] | Iterable[str], override_keys: Iterable[str] = ()) -> bool:
    """True when a config (its top-level mapping) or an override key uses one of verl's own sections."""
    tops = top_keys if isinstance(top_keys, Mapping) else dict.fromkeys(top_keys)
    for head, value in tops.items():
        head = str(head).split(".")[0]
        if head == "trainer" and isinstance(value, Mapping) and set(map(str, value)) <= set(_NATIVE_TRAINER_KEYS):
            continue
        if head in VERL_HEADS:
            return True
    for key in override_keys:
        parts = strip_hydra(key.split("=", 1)[0]).split(".")
        if parts[0] == "trainer" and parts[1:] and parts[1] in _NATIVE_TRAINER_KEYS:
            continue
        if parts[0] in VERL_HEADS:
            return True
    return False


def strip_hydra(key: str) -> str:
    """`+key`, `++key` (hydra's additions) and `~key` (deletion) -> `key`."""
    return key.lstrip("+~").strip()


def is_verl_key(key: str) -> bool:
    """Whether a dotted key of a verl-layout config is verl's (else it is one of ours)."""
    head = key.split(".")[0]
    if head in VERL_HEADS or head in ("defaults", "hydra"):
        return True
    if head not in SHARED_HEADS:
        return False
    return rule_for(key) is not None or not native_knows(key)


def native_knows(key: str) -> bool:
    """Whether `key` is a key (or alias, or a section) of our tree."""
    cls: Any = Config
    parts = key.split(".")
    i = 0
    while i < len(parts):
        types_ = field_types(cls)
        if parts[i] in types_:
            tp = types_[parts[i]]
            i += 1
            if i == len(parts):
                return True
            if not (isinstance(tp, type) and dataclasses.is_dataclass(tp)):
                return False
            cls = tp
            continue
        rest = ".".join(parts[i:])
        return any(rest == a or rest.startswith(a + ".") for a in cls.ALIASES) or \
            any(a.startswith(rest + ".") for a in cls.ALIASES) or parts[i] in cls.IGNORED
    return True
