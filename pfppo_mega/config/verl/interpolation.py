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


def resolve_interpolations(given: dict[str, Any]) -> dict[str, Any]:
    """``${a.b}``, ``${.sibling}`` and ``${oc.select:a.b,default}`` between verl keys resolved (a
    value that is one interpolation takes the other key's value and type); one that cannot be
    resolved (an environment variable, a cycle, an absent key without default) stays a string."""
    import yaml

    def lookup(ref: str, owner: str, depth: int) -> Any:
        if ref.startswith("."):
            parent = owner.rsplit(".", 1)[0] if "." in owner else ""
            ref = f"{parent}.{ref.lstrip('.')}" if parent else ref.lstrip(".")
        if ref in given:
            return value_of(ref, depth + 1)
        if ref in VERL_DEFAULTS:
            return VERL_DEFAULTS[ref]
        raise KeyError(ref)

    def one(expr: str, owner: str, depth: int) -> Any:
        expr = expr.strip()
        if expr.startswith("oc.select:"):
            ref, _, default = expr[len("oc.select:"):].partition(",")
            try:
                return lookup(ref.strip(), owner, depth)
            except KeyError:
                if not _:
                    return None
                text = default.strip()
                try:
                    return yaml.safe_load(text) if len(text) < 200 else text
                except yaml.YAMLError:
                    return text
        if ":" in expr:  # oc.env and other resolvers
            raise KeyError(expr)
        return lookup(expr, owner, depth)

    done: dict[str, Any] = {}

    def value_of(key: str, depth: int = 0) -> Any:
        if key in done:
            return done[key]
        value = given[key]
        if depth > _MAX_INTERPOLATION_DEPTH or not isinstance(value, str) or "${" not in value:
            return value
        whole = _INTERP_RE.fullmatch(value.strip())
        try:
            if whole:
                out = one(whole.group(1), key, depth)
            else:
                out = _INTERP_RE.sub(lambda m: str(one(m.group(1), key, depth)), value)
        except (KeyError, RecursionError):
            out = value
        done[key] = out
        return out

    return {k: value_of(k) for k in given}
