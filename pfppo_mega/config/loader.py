"""Reads a YAML config (or a dict) into the typed tree of ``pfppo_mega.config.tree``.

Every step collects :class:`Problem` s instead of stopping at the first one; one
:class:`ConfigError` lists them all at the end:

1. parse the YAML; a key given twice in one mapping is a problem (PyYAML keeps the last silently);
2. expand literal dotted keys: ``{"algorithm.lam": 0.9}`` -> ``{"algorithm": {"lam": 0.9}}``;
3. canonicalise section by section from the root: move each alias (``Section.ALIASES``, a key
   path relative to the section) to its canonical key, report unknown keys with a did-you-mean;
4. apply the ``key.path=value`` overrides (alias paths allowed; they replace file values);
5. build: coerce each value to its field type (rules in :func:`coerce`), construct each section,
   which runs its own ``_check``, and prefix the section's problems with its path.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import difflib
import functools
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence, Union

import yaml

from pfppo_mega.config.tree import Config, ConfigError, Problem, Section

_NONE = type(None)
_MISSING = object()
# What `float()` should accept from a string: YAML 1.1 reads `1e-6` (no dot) as a string.
_FLOAT_RE = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


# ----------------------------------------------------------------------------- results


@dataclass(frozen=True)
class AliasUse:
    """An alias key that was read as its canonical key (full dotted paths)."""

    alias: str
    canonical: str
    source: str  # "config" or "override"

    def __str__(self) -> str:
        where = " (override)" if self.source == "override" else ""
        return f"{self.alias} read as {self.canonical}{where}"


@dataclass(frozen=True)
class ValueAliasUse:
    """A value spelled another way (``Section.VALUE_ALIASES``), e.g. kl_estimator low_var_kl -> k3."""

    key: str
    value: str
    canonical: str

    def __str__(self) -> str:
        return f"{self.key} = {self.value!r} read as {self.canonical!r}"


@dataclass
class Resolved:
    """A loaded config and the alternative spellings it was written with."""

    config: Config  # or the `root` section given to resolve_config_dict
    aliases: list[AliasUse] = field(default_factory=list)
    value_aliases: list[ValueAliasUse] = field(default_factory=list)

    def notes(self) -> list[str]:
        return [str(u) for u in self.aliases] + [str(u) for u in self.value_aliases]


@dataclass
class _Ctx:
    problems: list[Problem] = field(default_factory=list)
    aliases: list[AliasUse] = field(default_factory=list)
    value_aliases: list[ValueAliasUse] = field(default_factory=list)

    def add(self, key: str, value: Any, rule: str) -> None:
        self.problems.append(Problem(key, value, rule))


# ----------------------------------------------------------------------------- public API


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> Config:
    """Read a YAML file into a Config; raises ConfigError listing every problem."""
    return resolve_config(path, overrides).config


def load_config_dict(d: Mapping[str, Any], overrides: Sequence[str] = ()) -> Config:
    """Build a Config from a dict shaped like the YAML; raises ConfigError listing every problem."""
    return resolve_config_dict(d, overrides).config


def resolve_config(path: str | Path, overrides: Sequence[str] = ()) -> Resolved:
    """As :func:`load_config`, also returning which aliases were used.

    Raises FileNotFoundError / OSError when the file cannot be read."""
    text = Path(path).read_text()
    ctx = _Ctx()
    try:
        _find_duplicate_keys(yaml.compose(text, Loader=yaml.SafeLoader), "", ctx)
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError([Problem(str(path), "(file)", f"is not valid YAML: {e}")]) from None
    return _resolve(raw, overrides, ctx)


def resolve_config_dict(d: Mapping[str, Any], overrides: Sequence[str] = (), *,
                        root: type[Section] = Config) -> Resolved:
    """As :func:`load_config_dict`, also returning which aliases were used. `root` may be any
    Section class (the loader knows nothing specific to Config)."""
    return _resolve(d, overrides, _Ctx(), root)


def apply_overrides(d: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Return the canonical raw dict of `d` with `overrides` ("key.path=value") applied.

    Aliases in `d` and in the override keys are rewritten to canonical keys. Raises ConfigError
    for unknown keys, alias conflicts and malformed overrides; values are not type-checked here
    (that happens when the dict is built, e.g. by load_config_dict)."""
    ctx = _Ctx()
    out = _canonical_with_overrides(d, overrides, ctx)
    if ctx.problems:
        raise ConfigError(ctx.problems)
    return out


def config_to_dict(cfg: Section) -> dict[str, Any]:
    """The plain nested dict of a config; load_config_dict(config_to_dict(cfg)) == cfg."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        out[f.name] = config_to_dict(value) if isinstance(value, Section) else value
    return out


def dump_yaml(cfg: Section) -> str:
    """The config as YAML, keys in tree order (floats always carry a '.', so 1e-6 stays a float)."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=False)


def validate_main(argv: Sequence[str]) -> int:
    """`pfppo validate CONFIG [key.path=value ...]`.

    Prints the resolved config as YAML on stdout and one "note: ..." line per alias on stderr,
    returns 0; or prints every problem on stderr and returns 2."""
    parser = argparse.ArgumentParser(
        prog="pfppo validate", description="Check a config and print it resolved (defaults filled in)."
    )
    parser.add_argument("config", help="YAML config file")
    parser.add_argument("overrides", nargs="*", help="key.path=value, value read as YAML")
    try:
        args = parser.parse_args(list(argv))
    except SystemExit as e:  # --help (0) or a usage error (2), already printed by argparse
        return 0 if e.code in (0, None) else 2
    try:
        resolved = resolve_config(args.config, args.overrides)
    except OSError as e:
        print(f"error: cannot read {args.config}: {e.strerror or e}", file=sys.stderr)
        return 2
    except ConfigError as e:
        print(f"error: {args.config}: {len(e.problems)} config problem(s):", file=sys.stderr)
        for p in e.problems:
            print(f"  - {p}", file=sys.stderr)
        return 2
    for note in resolved.notes():
        print(f"note: {note}", file=sys.stderr)
    sys.stdout.write(dump_yaml(resolved.config))
    return 0


# ----------------------------------------------------------------------------- pipeline


def _resolve(raw: Any, overrides: Sequence[str], ctx: _Ctx, root: type = Config) -> Resolved:
    canonical = _canonical_with_overrides(raw, overrides, ctx, root)
    cfg, _ = _build(root, canonical, "", ctx)
    if ctx.problems:
        raise ConfigError(ctx.problems)
    return Resolved(cfg, ctx.aliases, ctx.value_aliases)


def _canonical_with_overrides(raw: Any, overrides: Sequence[str], ctx: _Ctx,
                              root: type = Config) -> dict[str, Any]:
    if raw is None:  # an empty file
        raw = {}
    if not isinstance(raw, Mapping):
        ctx.add("(top level)", raw, "the config must be a mapping of section names to sections")
        raw = {}
    d = _expand_dotted(copy.deepcopy(dict(raw)), "", ctx)
    d = _canonicalize(root, d, "", ctx, "config")
    for text in overrides:
        _apply_override(root, d, text, ctx)
    return d


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    """Field name -> resolved type (the tree uses `from __future__ import annotations`)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, Section)


def _same(a: Any, b: Any) -> bool:
    """Two spellings of one value agree: equal, and not a bool against a number (True == 1)."""
    if isinstance(a, bool) != isinstance(b, bool):
        return False
    if a == b:
        return True
    fa, fb = _as_float(a), _as_float(b)
    return fa is not None and fa == fb


def _as_float(v: Any) -> float | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str) and _FLOAT_RE.fullmatch(v.strip()):
        return float(v)
    return None


# ----------------------------------------------------------------------------- 1. duplicate keys


def _find_duplicate_keys(node: yaml.Node | None, path: str, ctx: _Ctx) -> None:
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
                continue
            key, line = key_node.value, key_node.start_mark.line + 1
            if key in seen:
                ctx.add(_join(path, key), f"lines {seen[key]} and {line}",
                        "key given twice in one mapping (YAML would silently keep the last)")
            seen.setdefault(key, line)
            _find_duplicate_keys(value_node, _join(path, key), ctx)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _find_duplicate_keys(item, f"{path}[{i}]", ctx)


# ----------------------------------------------------------------------------- 2. dotted keys


def _expand_dotted(d: dict, path: str, ctx: _Ctx) -> dict[str, Any]:
    """{"a.b": 1, "a": {"c": 2}} -> {"a": {"b": 1, "c": 2}}, recursively."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        if not isinstance(key, str):
            ctx.add(_join(path, str(key)), value,
                    f"keys must be strings, got {_kind(key)} (quote it in YAML)")
            continue
        parts = key.split(".")
        full = _join(path, key)
        if not all(parts):
            ctx.add(full, value, "empty key in a dotted path")
            continue
        if isinstance(value, dict):
            value = _expand_dotted(value, full, ctx)
        for part in reversed(parts[1:]):
            value = {part: value}
        _merge(out, parts[0], value, _join(path, parts[0]), ctx)
    return out


def _merge(dst: dict, key: str, value: Any, full: str, ctx: _Ctx) -> None:
    """dst[key] = value, merging mappings; the same leaf given twice must agree."""
    if key not in dst:
        dst[key] = value
    elif isinstance(dst[key], dict) and isinstance(value, dict):
        for k, v in value.items():
            _merge(dst[key], k, v, _join(full, k), ctx)
    elif not _same(dst[key], value):
        ctx.add(full, value, f"given twice with different values ({dst[key]!r} and {value!r}), "
                "as a dotted key and as a nested key; keep one")


# ----------------------------------------------------------------------------- 3. aliases, unknown keys


def _canonicalize(cls: type, d: dict, path: str, ctx: _Ctx, source: str) -> dict[str, Any]:
    """Move the aliases of section `cls` (at `path`) to their canonical keys, drop and report
    unknown keys, recurse into child sections."""
    placed_by: dict[str, str] = {}  # canonical key (relative) -> alias that set it
    for alias, canonical in cls.ALIASES.items():
        value = _pop_path(d, alias.split("."))
        if value is _MISSING:
            continue
        full_alias, full_canonical = _join(path, alias), _join(path, canonical)
        ctx.aliases.append(AliasUse(full_alias, full_canonical, source))
        parts = canonical.split(".")
        parent = d
        for i, part in enumerate(parts[:-1]):
            nxt = parent.setdefault(part, {})
            if not isinstance(nxt, dict):
                ctx.add(full_alias, value, f"cannot be read as {full_canonical}: "
                        f"{_join(path, '.'.join(parts[:i + 1]))} is not a mapping")
                break
            parent = nxt
        else:
            leaf = parts[-1]
            if leaf in parent and not _same(parent[leaf], value):
                if canonical in placed_by:  # two aliases of one key
                    why = f"conflicts with {_join(path, placed_by[canonical])} = {parent[leaf]!r} " \
                          f"(both are read as {full_canonical})"
                else:
                    why = f"conflicts with {full_canonical} = {parent[leaf]!r} ({alias} is an alias of it)"
                ctx.add(full_alias, value, why + "; keep one")
            elif leaf not in parent:
                parent[leaf] = value
                placed_by[canonical] = alias

    types_ = _field_types(cls)
    out: dict[str, Any] = {}
    for key, value in d.items():
        full = _join(path, key)
        if key not in types_:
            _report_unknown(cls, key, value, path, ctx)
        elif _is_section(types_[key]) and isinstance(value, dict):
            out[key] = _canonicalize(types_[key], value, full, ctx, source)
        else:
            out[key] = value
    return out


def _pop_path(d: dict, parts: list[str]) -> Any:
    """Remove and return d[p0][p1]...; parents left empty are removed. _MISSING if absent."""
    node = d
    for part in parts[:-1]:
        node = node.get(part)
        if not isinstance(node, dict):
            return _MISSING
    if parts[-1] not in node:
        return _MISSING
    value = node.pop(parts[-1])
    for i in range(len(parts) - 1, 0, -1):  # prune kl_ctrl: {} left by kl_ctrl.kl_coef
        parent = d
        for part in parts[:i - 1]:
            parent = parent[part]
        if parent[parts[i - 1]] == {}:
            del parent[parts[i - 1]]
    return value


def _report_unknown(cls: type, key: str, value: Any, path: str, ctx: _Ctx) -> None:
    # A leftover under a dotted alias prefix (kl_ctrl: {type: fixed}): report its leaves.
    below = {a[len(key) + 1:]: c for a, c in cls.ALIASES.items() if a.startswith(key + ".")}
    if below and isinstance(value, dict):
        for k, v in value.items():
            ctx.add(_join(_join(path, key), k), v,
                    "unknown key; " + _suggest(k, below, _join(path, key), path))
        return
    ctx.add(_join(path, key), value, "unknown key; " + _suggest(key, _choices_of(cls), path, path))


def _choices_of(cls: type) -> dict[str, str]:
    """Spellings accepted in section `cls`: key -> canonical key (relative to the section)."""
    return {**{k: k for k in _field_types(cls)}, **cls.ALIASES}


def _suggest(key: str, spellings: dict[str, str], path: str, canonical_path: str) -> str:
    match = difflib.get_close_matches(key, list(spellings), n=1, cutoff=0.6)
    if match:
        return f"did you mean {_join(canonical_path, spellings[match[0]])}?"
    valid = [k for k, c in spellings.items() if k == c] or list(spellings)
    where = f"section {path}" if path else "the top level"
    return f"valid keys of {where}: {', '.join(valid)}"


# ----------------------------------------------------------------------------- 4. overrides


def _apply_override(root: type, d: dict, text: str, ctx: _Ctx) -> None:
    if "=" not in text:
        ctx.add("(override)", text, "an override must be written key.path=value (e.g. training.lr=1e-6)")
        return
    key, raw = text.split("=", 1)
    key = key.strip()
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        ctx.add(key, raw, f"override value is not valid YAML: {e}")
        return
    target = _resolve_key(root, key.split("."), "", key, value, ctx)
    if target is None:
        return
    parts, tp = target
    full = ".".join(parts)
    if _is_section(tp) and isinstance(value, dict):
        value = _canonicalize(tp, _expand_dotted(value, full, ctx), full, ctx, "override")
    node = d
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    _override(node, parts[-1], value)


def _override(dst: dict, key: str, value: Any) -> None:
    if isinstance(dst.get(key), dict) and isinstance(value, dict):
        for k, v in value.items():
            _override(dst[key], k, v)
    else:
        dst[key] = value


def _resolve_key(cls: type, parts: list[str], path: str, text: str, value: Any,
                 ctx: _Ctx) -> tuple[list[str], Any] | None:
    """Canonical key parts and type of an override key path (aliases allowed), or None after
    reporting why it is not a key of the tree."""
    types_ = _field_types(cls)
    head = parts[0]
    if head not in types_:
        for n in range(len(parts), 0, -1):  # longest alias that is a prefix of the path
            alias = ".".join(parts[:n])
            if alias in cls.ALIASES:
                canonical = cls.ALIASES[alias]
                ctx.aliases.append(AliasUse(_join(path, alias), _join(path, canonical), "override"))
                parts = canonical.split(".") + parts[n:]
                head = parts[0]
                break
        else:
            ctx.add(_join(path, ".".join(parts)), value,
                    f"unknown key (override {text}); " + _suggest(head, _choices_of(cls), path, path))
            return None
    tp = types_[head]
    if len(parts) == 1:
        return [head], tp
    if not _is_section(tp):
        ctx.add(_join(path, ".".join(parts)), value,
                f"unknown key (override {text}); {_join(path, head)} is a {_type_name(tp)}, not a section")
        return None
    rest = _resolve_key(tp, parts[1:], _join(path, head), text, value, ctx)
    return None if rest is None else ([head] + rest[0], rest[1])


# ----------------------------------------------------------------------------- 5. build


def _build(cls: type, d: dict, path: str, ctx: _Ctx) -> tuple[Any, bool]:
    """Construct section `cls` from its canonical dict. Returns (section, checked).

    A value of the wrong type is reported and replaced by the field's default, so the section's
    own rules still run on the rest. When the section's rules fail, an unchecked instance (no
    __post_init__) is returned so that the parent can still run its cross-section rules."""
    kwargs: dict[str, Any] = {}
    children_checked = True
    for f in dataclasses.fields(cls):
        tp, full = _field_types(cls)[f.name], _join(path, f.name)
        if _is_section(tp):
            sub = d.get(f.name, {})
            if not isinstance(sub, dict):
                ctx.add(full, sub, f"expected a mapping (section {tp.__name__}), got {_kind(sub)}")
                sub = {}
            kwargs[f.name], checked = _build(tp, sub, full, ctx)
            children_checked &= checked
        elif f.name in d:
            value, error = coerce(d[f.name], tp)
            if error:
                ctx.add(full, d[f.name], error)
                continue
            mapped = cls.VALUE_ALIASES.get(f.name, {})
            if isinstance(value, str) and value in mapped:
                ctx.value_aliases.append(ValueAliasUse(full, value, mapped[value]))
            kwargs[f.name] = value
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            ctx.add(full, None, "must be set")

    reported = {p.key for p in ctx.problems}
    try:
        return cls(**kwargs), True
    except ConfigError as e:
        # keys already reported (wrong type replaced by the default, a bad child value
        # seen again by a parent rule) are not reported twice
        ctx.problems += [q for q in (p.prefixed(path) for p in e.problems) if q.key not in reported]
    except Exception:
        if children_checked:
            raise
        # a parent rule tripped over a child value that the child already reported
    return _unchecked(cls, kwargs), False


def _unchecked(cls: type, kwargs: dict[str, Any]) -> Any:
    obj = cls.__new__(cls)
    for f in dataclasses.fields(cls):
        if f.name in kwargs:
            value = kwargs[f.name]
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            value = f.default
        object.__setattr__(obj, f.name, value)
    return obj


def coerce(value: Any, tp: Any) -> tuple[Any, str | None]:
    """(value as type `tp`, None) or (None, what was expected).

    int: an int (not a bool; 2.0 is refused rather than truncated silently).
    float: a float, an int, or a string that reads as a decimal number ("1e-6": YAML 1.1 reads
    an exponent without a dot as a string). bool: true/false only. str: a string.
    Optional[X]: null or X. Literal[...]: one of the listed values."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not _NONE]
        if len(args) != 1 or len(typing.get_args(tp)) != 2:
            raise TypeError(f"config field type {tp} unsupported: only Optional[X] unions")
        if value is None:
            return None, None
        result, error = coerce(value, args[0])
        return result, error and error.replace(f"expected {_type_name(args[0])}",
                                               f"expected {_type_name(tp)}", 1)
    if value is None:
        return None, f"expected {_type_name(tp)}, got null (this key cannot be null)"
    if origin is Literal:
        for allowed in typing.get_args(tp):
            if value == allowed and type(value) is type(allowed):
                return value, None
        return None, f"expected {_type_name(tp)}, got {_kind(value)}"
    if tp is bool:
        if isinstance(value, bool):
            return value, None
        return None, f"expected bool (true or false), got {_kind(value)}"
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value, None
        hint = " (write it without a decimal point)" if isinstance(value, float) else ""
        return None, f"expected int, got {_kind(value)}{hint}"
    if tp is float:
        number = _as_float(value)
        if number is not None:
            return number, None
        return None, f"expected float, got {_kind(value)}"
    if tp is str:
        if isinstance(value, str):
            return value, None
        return None, f"expected str, got {_kind(value)} (quote it if it is meant as text)"
    raise TypeError(f"config field type {tp!r} unsupported (int, float, bool, str, Optional, "
                    f"Literal or a Section)")


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join("null" if a is _NONE else _type_name(a) for a in typing.get_args(tp))
    if origin is Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(tp)))
    if _is_section(tp):
        return f"section {tp.__name__}"
    return getattr(tp, "__name__", str(tp))


def _kind(value: Any) -> str:
    """The YAML name of a value's type."""
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "mapping"
    if isinstance(value, (list, tuple)):
        return "list"
    return type(value).__name__
