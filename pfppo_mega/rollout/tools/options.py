"""The ``config`` keys a built-in tool accepts (besides ``type``), each with its type, default and
range (the registry checks a tool config file's entries against them before anything is built), and
the per-row bookkeeping of the tools that keep no state per row."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Opt:
    kind: type                       # int, float, str or bool (an int is accepted for a float)
    default: Any                     # None: required
    ge: float | None = None
    le: float | None = None
    choices: tuple = ()
    url: bool = False                # an http:// or https:// URL
    doc: str = ""

    def allowed(self) -> str:
        if self.choices:
            return f"one of {list(self.choices)}"
        if self.url:
            return "an http:// or https:// URL"
        if self.kind is bool:
            return "true or false"
        rng = [f">= {self.ge:g}" if self.ge is not None else "", f"<= {self.le:g}" if self.le is not None else ""]
        return f"{'an integer' if self.kind is int else 'a number' if self.kind is float else 'a string'}" + \
            (" " + " and ".join(r for r in rng if r) if any(rng) else "")

    def problem(self, value: Any) -> str:
        """'' when ``value`` is allowed, else what is wrong."""
        if self.kind is bool:
            ok = isinstance(value, bool)
        elif self.kind is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif self.kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        else:
            ok = isinstance(value, str)
        if not ok:
            return f"is a {type(value).__name__}"
        if self.choices and value not in self.choices:
            return "is not a choice"
        if self.url and not value.startswith(("http://", "https://")):
            return "is not an http(s) URL"
        if self.ge is not None and value < self.ge or self.le is not None and value > self.le:
            return "is out of range"
        return ""


def with_defaults(opts: dict[str, Opt], config: dict[str, Any]) -> dict[str, Any]:
    """The config as a built-in tool reads it: every key, the defaults filled in (checked before)."""
    return {k: config.get(k, o.default) for k, o in opts.items()}


class PerRowNothing:
    """create / release of a tool that keeps nothing per row but checks that a call's row exists
    (a call for a row never created, or already released, is the loop's bug: KeyError)."""

    name: str

    def __init__(self) -> None:
        self._rows: set[str] = set()

    def create(self, instance_id: str, **create_kwargs: Any) -> None:
        self._rows.add(instance_id)

    def _check_row(self, instance_id: str) -> None:
        if instance_id not in self._rows:
            raise KeyError(f"tool {self.name!r}: no instance {instance_id!r}")

    def release(self, instance_id: str) -> None:
        self._check_row(instance_id)
        self._rows.discard(instance_id)
