"""How a config value is read as its field's type (``coerce``), and how types and values are named
in the messages. Shared by the loader and the verl translation (pfppo_mega.config.verl)."""

from __future__ import annotations

import math
import re
import types
import typing
from typing import Any, Literal, Union

from pfppo_mega.config.tree import Section

_NONE = type(None)
# What `float()` should accept from a string: YAML 1.1 reads `1e-6` (no dot) as a string.
_FLOAT_RE = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def as_float(v: Any) -> float | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        try:
            return float(v)
        except OverflowError:  # an int beyond 1.8e308: refused as not finite, like 1e400
            return math.inf if v > 0 else -math.inf
    if isinstance(v, float):
        return v
    if isinstance(v, str) and _FLOAT_RE.fullmatch(v.strip()):
        return float(v)
    return None



def coerce(value: Any, tp: Any) -> tuple[Any, str | None]:
    """(value as type `tp`, None) or (None, what was expected).

    int: an int (not a bool; 2.0 is refused rather than truncated silently).
    float: a float, an int, or a string that reads as a decimal number ("1e-6": YAML 1.1 reads
    an exponent without a dot as a string). bool: true/false only. str: a string.
    Optional[X]: null or X. Literal[...]: one of the listed values. list[X]: a list of X, or a
    single X read as a list of one."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not _NONE]
        if len(args) != 1 or len(typing.get_args(tp)) != 2:
            raise TypeError(f"config field type {tp} unsupported: only Optional[X] unions")
        if value is None:
            return None, None
        result, error = coerce(value, args[0])
        return result, error and error.replace(f"expected {type_name(args[0])}",
                                               f"expected {type_name(tp)}", 1)
    if value is None:
        return None, f"expected {type_name(tp)}, got null (this key cannot be null)"
    if origin is Literal:
        for allowed in typing.get_args(tp):
            if value == allowed and type(value) is type(allowed):
                return value, None
        return None, f"expected {type_name(tp)}, got {kind(value)}"
    if tp is bool:
        if isinstance(value, bool):
            return value, None
        return None, f"expected bool (true or false), got {kind(value)}"
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value, None
        hint = " (write it without a decimal point)" if isinstance(value, float) else ""
        return None, f"expected int, got {kind(value)}{hint}"
    if tp is float:
        number = as_float(value)
        if number is not None:
            return number, None
        return None, f"expected float, got {kind(value)}"
    if tp is str:
        if isinstance(value, str):
            return value, None
        return None, f"expected str, got {kind(value)} (quote it if it is meant as text)"
    if origin is list:  # list[X]: a list of X, or one X (a single file for a list of paths)
        (item,) = typing.get_args(tp)
        items = value if isinstance(value, list) else [value]
        out = []
        for i, v in enumerate(items):
            result, error = coerce(v, item)
            if error:
                return None, f"expected {type_name(tp)}; item {i}: {error}"
            out.append(result)
        return out, None
    raise TypeError(f"config field type {tp!r} unsupported (int, float, bool, str, Optional, "
                    f"Literal or a Section)")


def type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join("null" if a is _NONE else type_name(a) for a in typing.get_args(tp))
    if origin is Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(tp)))
    if origin is list:
        return f"list of {type_name(typing.get_args(tp)[0])}"
    if isinstance(tp, type) and issubclass(tp, Section):
        return f"section {tp.__name__}"
    return getattr(tp, "__name__", str(tp))


def kind(value: Any) -> str:
    """The YAML name of a value's type."""
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "mapping"
    if isinstance(value, (list, tuple)):
        return "list"
    return type(value).__name__
