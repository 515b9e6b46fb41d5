"""The row type of the translation table and the vocabulary its converters speak.

A row (:class:`Rule`) is built with ``M`` (map onto our key, value converted), ``I`` (ignore, with
the reason) or ``R`` (refuse, with the reason and the fix). A converter is ``convert(value, view)``:
it returns our value (or an :class:`Out` for several of our keys) or raises :class:`Ignore`,
:class:`Refuse` or :class:`Bad` with the message the user reads; :class:`View` shows it the other
verl keys of the same config (then our own keys of a mixed config, then verl's defaults).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from pfppo_mega.config.tree import Config, field_types
from pfppo_mega.config.values import coerce
from pfppo_mega.config.verl.keys import NATIVE_EQUIVALENTS, VERL_DEFAULTS


class Ignore(Exception):
    """Raised by a converter: the key is accepted and has no effect here (the message says why)."""


class Refuse(Exception):
    """Raised by a converter: accepting the key would change the result (the message says why)."""


class Bad(Exception):
    """Raised by a converter: the value has the wrong type or form (the message is the rule)."""


class _Unreadable(Exception):
    """A key a converter consults has a bad value; that key's own rule reports it."""


@dataclass(frozen=True)
class Out:
    """A converter's result for several of our keys, with a note for the record."""

    values: dict[str, Any]
    note: str = ""


class View:
    """The verl keys of one config (interpolations resolved); under them our own keys of a mixed
    config (NATIVE_EQUIVALENTS), then verl's defaults."""

    def __init__(self, given: Mapping[str, Any], native: Mapping[str, Any] | None = None):
        self.given = dict(given)
        self.native = dict(native or {})

    def get(self, key: str) -> Any:
        if key in self.given:
            return self.given[key]
        if NATIVE_EQUIVALENTS.get(key) in self.native:
            return self.native[NATIVE_EQUIVALENTS[key]]
        return VERL_DEFAULTS.get(key)

    def typed(self, key: str, tp: Any) -> Any:
        value, error = coerce(self.get(key), tp)
        if error:
            raise _Unreadable(key)
        return value


def _typed(value: Any, tp: Any) -> Any:
    out, error = coerce(value, tp)
    if error:
        raise Bad(error)
    return out


def _native_type(key: str) -> Any:
    cls: Any = Config
    parts = key.split(".")
    for part in parts[:-1]:
        cls = field_types(cls)[part]
    return field_types(cls)[parts[-1]]


def _native_choices(key: str) -> tuple | None:
    cls: Any = Config
    parts = key.split(".")
    for part in parts[:-1]:
        cls = field_types(cls)[part]
    allowed = cls.CHOICES.get(parts[-1])
    return None if allowed is None else tuple(allowed)


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, bool) != isinstance(b, bool):
        return False
    return type(a) is type(b) and a == b or (isinstance(a, (int, float)) and isinstance(b, (int, float))
                                             and not isinstance(a, bool) and a == b)


@dataclass(frozen=True)
class Rule:
    """One row of the table: verl key pattern -> map onto ``target`` (``convert(value, view)`` gives
    our value, or an Out for several keys), ignore with ``why``, or refuse with ``why`` unless the
    value is one of ``ok`` (values that ask for nothing: accepted and ignored)."""

    pattern: str
    action: str  # "map" | "ignore" | "refuse"
    target: str = ""
    why: str = ""
    convert: Callable[[Any, View], Any] | None = None  # ignore: a check raising Bad (see ``I``)
    ok: tuple = ()
    keys: tuple[str, ...] = ()  # a closed subtree `prefix.**`: the keys under it verl has (others are unknown)
    fix: str = ""  # refuse: what a verl user changes to run here (default: the value that asks for nothing)

    def matches(self, key: str) -> bool:
        if self.keys:
            prefix = self.pattern.removesuffix(".**")
            return key.startswith(prefix + ".") and key[len(prefix) + 1:] in self.keys
        return _pattern_re(self.pattern).fullmatch(key) is not None

    def spellings(self) -> list[str]:
        """The keys this rule names: the pattern, or each key of a closed subtree."""
        prefix = self.pattern.removesuffix(".**")
        return [f"{prefix}.{k}" for k in self.keys] if self.keys else [self.pattern]


@functools.cache
def _pattern_re(pattern: str) -> re.Pattern:
    out = []
    for part in pattern.split("."):
        out.append(".+" if part == "**" else re.escape(part).replace(r"\*", "[^.]*"))
    return re.compile(r"\.".join(out))


def M(pattern: str, target: str, convert: Callable[[Any, View], Any] | None = None, why: str = "") -> Rule:
    return Rule(pattern, "map", target, why, convert)


def I(pattern: str, why: str, keys: tuple[str, ...] = (),  # noqa: E743 (I for ignore, next to M and R)
      check: Callable[[Any, View], Any] | None = None) -> Rule:
    """Ignored; `check` (raising Bad) still refuses a value verl itself could not use (a typo, -1 tokens)."""
    return Rule(pattern, "ignore", why=why, keys=keys, convert=check)


def positive_int(value: Any, v: View) -> Any:
    """an int >= 1 or null, as verl needs; other values are refused."""
    n = _typed(value, Optional[int])
    if n is not None and not 1 <= n <= _LARGEST:
        raise Bad(f"must be >= 1 and <= {_LARGEST} (or null for verl's default); it is ignored here, "
                  "but verl could not use this value: fix it or remove the key")
    return n


_LARGEST = 2 ** 40  # a size or token count no machine reaches


def R(pattern: str, why: str, ok: tuple = (), fix: str = "") -> Rule:
    return Rule(pattern, "refuse", why=why, ok=ok, fix=fix)


def refusal(rule: Rule) -> str:
    """A refusal's text: why, then what to change (the rule's fix, else the value that turns it off)."""
    why = rule.why if "here" in rule.why else f"{rule.why}: not available here"
    if rule.fix:
        return f"{why}; {rule.fix}"
    off = next((v for v in rule.ok if v is not None), None)
    if off is None:
        return f"{why}; remove the key to run without it"
    return f"{why}; remove the key or set it to {off!r} to run without it"
