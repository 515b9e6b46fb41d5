"""Converters that rows of several sections share: a plain float, a name from one of our CHOICES, and
a verl key waiting for its counterpart in our tree.
"""

from __future__ import annotations

from typing import Any, Callable

from pfppo_mega.config.tree import Config, field_types
from pfppo_mega.config.verl.rule import Ignore, Refuse, View, _native_choices, _same_value, _typed


def _float(value: Any, v: View) -> Any:
    return _typed(value, float)


def _choice(target: str) -> Callable[[Any, View], Any]:
    """A value of one of our CHOICES / registries; verl's other names are refused by name."""
    def convert(value: Any, v: View) -> Any:
        name = _typed(value, str)
        allowed = _native_choices(target)
        if allowed is not None and name not in allowed:
            raise Refuse(f"{name!r} has no counterpart here ({target} is one of {', '.join(map(repr, allowed))})")
        return name
    return convert


def _when_ours(target: str, neutral: tuple = ()) -> Callable[[Any, View], Any]:
    """verl's key onto `target` once our tree has it; until then refused by name (ignored at a
    `neutral` value, which asks for nothing)."""
    def convert(value: Any, v: View) -> Any:
        section, _, leaf = target.rpartition(".")
        cls: Any = Config
        for part in section.split("."):
            cls = field_types(cls)[part]
        if leaf in field_types(cls):
            return _typed(value, field_types(cls)[leaf])
        if any(_same_value(value, n) for n in neutral):
            raise Ignore(f"nothing to honour at this value (mapping waits for key {target})")
        raise Refuse(f"mapping waits for key {target}")
    convert.__doc__ = f"refused until our tree has {target}" + (" (verl's default accepted)" if neutral else "")
    return convert
