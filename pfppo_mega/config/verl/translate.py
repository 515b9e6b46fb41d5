"""The translation of one config: verl keys (file first, then overrides, hydra's ``~key`` deleting) go
through their rows; verl's defaults fill the keys the config leaves out; the result is our dotted keys
with their values, a record (VerlUse) per verl key, and the problems, each naming the verl key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from pfppo_mega.config.tree import Problem
from pfppo_mega.config.verl.interpolation import resolve_interpolations
from pfppo_mega.config.verl.keys import VERL_DEFAULTS, VERL_FIXED
from pfppo_mega.config.verl.layout import strip_hydra
from pfppo_mega.config.verl.rule import (Bad, Ignore, Out, Refuse, Rule, View, _native_type, _same_value, _typed,
                                         _Unreadable, refusal)
from pfppo_mega.config.verl.table import rule_for, suggest


@dataclass(frozen=True)
class VerlUse:
    """What one verl key became: mapped (``detail`` = our keys and values), ignored or refused
    (``detail`` = why); ``source`` is config, override or "verl default"."""

    key: str
    value: Any
    outcome: str  # "mapped" | "ignored" | "refused"
    detail: str
    source: str = "config"

    def __str__(self) -> str:
        shown = repr(self.value)
        if len(shown) > 80:
            shown = f"{shown[:60]}... ({len(shown)} characters)"
        where = {"override": " (override)", "verl default": " (verl's default)"}.get(self.source, "")
        if self.key.startswith("("):  # one of VERL_FIXED: no verl key says it
            return f"verl layout -> {self.detail}"
        if self.outcome == "mapped":
            return f"verl {self.key} = {shown}{where} -> {self.detail}"
        return f"verl {self.key} = {shown}{where} {self.outcome}: {self.detail}"


@dataclass
class Translation:
    """Our keys set from verl's (dotted key -> value, and which verl key set it, explicitly or from
    verl's defaults), what each verl key became, and the problems."""

    values: dict[str, Any] = field(default_factory=dict)
    origin: dict[str, tuple[str, Any, bool]] = field(default_factory=dict)  # key -> (verl key, value, explicit)
    uses: list[VerlUse] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        given = [u for u in self.uses if u.source != "verl default"]
        return {o: sum(u.outcome == o for u in given) for o in ("mapped", "ignored", "refused")}

    def summary(self) -> str:
        c = self.counts()
        n_def = sum(u.source == "verl default" for u in self.uses)
        return (f"verl layout: {sum(c.values())} verl keys: {c['mapped']} mapped, {c['ignored']} ignored, "
                f"{c['refused']} refused; {n_def} of verl's defaults applied (see docs/verl.md)")


def translate(items: Sequence[tuple[str, Any, str]], native: Mapping[str, Any] | None = None) -> Translation:
    """Translate verl keys: `items` are (dotted verl key, value, source) in order (file first, then
    overrides: a later one replaces an earlier one of the same key; `~key` deletes it). `native`:
    our own keys the config sets (dotted key -> value), read where a verl key depends on one."""
    given, sources, deleted = _merge(items)
    given = resolve_interpolations(given)
    view = View(given, native)
    out = Translation()
    for name, source in deleted:
        out.uses.append(VerlUse(name, None, "ignored", "deleted (~): verl's default applies", source))
    for key, value in given.items():
        _apply(key, value, sources[key], view, out, explicit=True)
    for key, value in VERL_DEFAULTS.items():
        if key not in given:
            _apply(key, value, "verl default", view, out, explicit=False)
    for key, (value, why) in VERL_FIXED.items():
        if key not in out.values:
            out.values[key] = value
            out.origin[key] = ("(verl layout)", value, False)
            out.uses.append(VerlUse("(verl layout)", value, "mapped", f"{key} = {value!r} ({why})", "verl default"))
    return out


def _merge(items: Sequence[tuple[str, Any, str]]) -> tuple[dict[str, Any], dict[str, str], list[tuple[str, str]]]:
    """Hydra's reading of the items in order: `+key` / `++key` set as `key` (a later setting replaces an
    earlier one and moves to the end), `~key` deletes the key and its subtree. Returns (key -> value,
    key -> source, the deleted (key, source))."""
    given: dict[str, Any] = {}
    sources: dict[str, str] = {}
    deleted: list[tuple[str, str]] = []
    for key, value, source in items:
        name = strip_hydra(key)
        if key.startswith("~"):
            given = {k: v for k, v in given.items() if k != name and not k.startswith(name + ".")}
            deleted.append((name, source))
            continue
        given.pop(name, None)  # re-insert: order of last setting
        given[name] = value
        sources[name] = source
    return given, sources, deleted


def _apply(key: str, value: Any, source: str, view: View, out: Translation, *, explicit: bool) -> None:
    """One verl key through its row, into `out`: a record, our values, or a problem naming the key."""
    rule = rule_for(key)
    if rule is None:
        out.problems.append(Problem(key, value, "unknown key (verl layout); " + suggest(key)))
        return
    try:
        result = _convert(rule, value, view)
    except Ignore as e:
        if explicit:
            out.uses.append(VerlUse(key, value, "ignored", str(e), source))
        return
    except Refuse as e:
        out.uses.append(VerlUse(key, value, "refused", str(e), source))
        out.problems.append(Problem(key, value, f"refused (verl layout): {e}"))
        return
    except Bad as e:
        out.problems.append(Problem(key, value, f"{e} (verl layout)"))
        return
    except _Unreadable:
        return  # the key it consults reports its own problem
    _set(key, value, source, result, out, explicit=explicit)


def _convert(rule: Rule, value: Any, view: View) -> Out:
    """What `rule` makes of `value`: our keys and values, or Ignore / Refuse / Bad / _Unreadable raised."""
    if rule.action == "ignore":
        if rule.convert is not None and not (isinstance(value, str) and "${" in value):
            rule.convert(value, view)  # raises Bad on a value verl could not use
        raise Ignore(rule.why)
    if rule.action == "refuse":
        if any(_same_value(value, ok) for ok in rule.ok):
            raise Ignore(f"nothing to honour at this value (others are refused: {rule.why})")
        raise Refuse(refusal(rule))
    if isinstance(value, str) and "${" in value:
        raise Bad("an interpolation that cannot be resolved here (an environment variable, a cycle, or a key "
                  "that is not set); give the value")
    result = rule.convert(value, view) if rule.convert else _typed(value, _native_type(rule.target))
    return result if isinstance(result, Out) else Out({rule.target: result}, rule.why)


def _set(key: str, value: Any, source: str, result: Out, out: Translation, *, explicit: bool) -> None:
    """A mapped key's values into `out`: an explicit verl key wins over verl's defaults; two explicit
    verl keys that set one of ours to different values are a problem naming both."""
    for target, v in result.values.items():
        earlier = out.origin.get(target)
        if earlier and earlier[2] and explicit and not _same_value(earlier[1], v):
            out.problems.append(Problem(key, value, f"sets {target} = {v!r}, but {earlier[0]} sets it to "
                                                    f"{earlier[1]!r}; keep one"))
            continue
        if earlier and earlier[2] and not explicit:
            continue  # an explicit verl key already set it
        out.values[target] = v
        out.origin[target] = (key, v, explicit)
    detail = ", ".join(f"{t} = {v!r}" for t, v in result.values.items())
    out.uses.append(VerlUse(key, value, "mapped", detail + (f" ({result.note})" if result.note else ""), source))
