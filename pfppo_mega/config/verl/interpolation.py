"""OmegaConf's interpolations between verl keys (``${a.b}``, ``${.sibling}``, ``${oc.select:a.b,default}``),
resolved before any row reads a value. An interpolation this cannot resolve (an environment variable,
a cycle, a key that is not set and has no default) stays a string, which the row then refuses by name.
"""

from __future__ import annotations

import re
from typing import Any

from pfppo_mega.config.verl.keys import VERL_DEFAULTS

_MAX_INTERPOLATION_DEPTH = 8
_INTERP_RE = re.compile(r"\$\{((?:[^${}]|\{\})*)\}")  # ${...}; an empty {} inside (a default) allowed


class _Resolver:
    """The values of one config's verl keys with their interpolations resolved, each key once. A
    chain of more than _MAX_INTERPOLATION_DEPTH keys stops there: that key is taken as it is written."""

    def __init__(self, given: dict[str, Any]):
        self.given = given
        self.done: dict[str, Any] = {}

    def value_of(self, key: str, depth: int = 0) -> Any:
        if key in self.done:
            return self.done[key]
        value = self.given[key]
        if depth > _MAX_INTERPOLATION_DEPTH or not isinstance(value, str) or "${" not in value:
            return value
        whole = _INTERP_RE.fullmatch(value.strip())
        try:
            if whole:  # the value is one interpolation: the other key's value, with its type
                out = self.expression(whole.group(1), key, depth)
            else:  # interpolations inside a string: each one's text
                out = _INTERP_RE.sub(lambda m: str(self.expression(m.group(1), key, depth)), value)
        except (KeyError, RecursionError):
            out = value
        self.done[key] = out
        return out

    def expression(self, expr: str, owner: str, depth: int) -> Any:
        """What one ``${expr}`` of key `owner` stands for; KeyError when it cannot be resolved here."""
        expr = expr.strip()
        if expr.startswith("oc.select:"):
            ref, comma, default = expr[len("oc.select:"):].partition(",")
            try:
                return self.lookup(ref.strip(), owner, depth)
            except KeyError:
                return _select_default(default) if comma else None
        if ":" in expr:  # oc.env and other resolvers
            raise KeyError(expr)
        return self.lookup(expr, owner, depth)

    def lookup(self, ref: str, owner: str, depth: int) -> Any:
        """A key's value (``.sibling`` relative to `owner`): given in the config, else verl's default."""
        if ref.startswith("."):
            parent = owner.rsplit(".", 1)[0] if "." in owner else ""
            ref = f"{parent}.{ref.lstrip('.')}" if parent else ref.lstrip(".")
        if ref in self.given:
            return self.value_of(ref, depth + 1)
        if ref in VERL_DEFAULTS:
            return VERL_DEFAULTS[ref]
        raise KeyError(ref)


def _select_default(default: str) -> Any:
    """oc.select's default, read as YAML (a long one, or one YAML cannot read, stays text)."""
    import yaml

    text = default.strip()
    try:
        return yaml.safe_load(text) if len(text) < 200 else text
    except yaml.YAMLError:
        return text


def resolve_interpolations(given: dict[str, Any]) -> dict[str, Any]:
    """``${a.b}``, ``${.sibling}`` and ``${oc.select:a.b,default}`` between verl keys resolved (a
    value that is one interpolation takes the other key's value and type); one that cannot be
    resolved (an environment variable, a cycle, an absent key without default) stays a string."""
    resolver = _Resolver(given)
    return {k: resolver.value_of(k) for k in given}
