"""Reads a YAML config (or a dict) into the typed tree of ``pfppo_mega.config.tree``.

Every step collects :class:`Problem` s instead of stopping at the first one; one
:class:`ConfigError` lists them all at the end:

0. read the file: it must exist, be a file, be UTF-8 text without NUL bytes, and be at most
   MAX_FILE_BYTES;
1. parse the YAML, bounded: at most MAX_DEPTH nested collections and MAX_NODES values once
   every alias is expanded (a few hundred bytes of nested aliases expand to billions); a key
   given twice in one mapping is a problem (PyYAML keeps the last silently);
2. expand literal dotted keys: ``{"algorithm.lam": 0.9}`` -> ``{"algorithm": {"lam": 0.9}}``;
3. canonicalise section by section from the root: move each alias (``Section.ALIASES``, a key
   path relative to the section) to its canonical key, report unknown keys with a did-you-mean;
4. apply the ``key.path=value`` overrides (alias paths allowed; they replace file values; two
   spellings of one key with different values are a problem, as in a file);
   a config or overrides in verl's layout (``pfppo_mega.config.verl``) are translated first: its
   verl keys through the table, ours as usual, then merged (one setting in both: a problem);
5. build: coerce each value to its field type (rules in :func:`coerce`), construct each section,
   which runs its own ``_check``, and prefix the section's problems with its path.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import difflib
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from pfppo_mega.config import verl as verl_layout
from pfppo_mega.config.tree import Config, ConfigError, Problem, Section, field_types
from pfppo_mega.config.values import as_float as _as_float, coerce, kind as _kind, type_name as _type_name

_field_types = field_types  # the name reference.py and the tests use
_MISSING = object()

# A config is a few KiB, three sections deep and about a hundred values; these bounds are far
# above that and keep a hostile file (deep nesting, an alias bomb) to milliseconds.
MAX_FILE_BYTES = 256 << 10
MAX_DEPTH = 32  # nested mappings / lists
MAX_NODES = 2_000  # keys, values and collections, with every alias expanded (a config: ~250)


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


@dataclass(frozen=True)
class IgnoredUse:
    """A key of another project accepted and ignored (``Section.IGNORED``)."""

    key: str
    value: Any
    why: str

    def __str__(self) -> str:
        return f"{self.key} = {self.value!r} ignored: {self.why}"


@dataclass
class Resolved:
    """A loaded config and the alternative spellings it was written with."""

    config: Config  # or the `root` section given to resolve_config_dict
    aliases: list[AliasUse] = field(default_factory=list)
    value_aliases: list[ValueAliasUse] = field(default_factory=list)
    ignored: list[IgnoredUse] = field(default_factory=list)
    verl: verl_layout.Translation | None = None  # what each verl key became, when in verl's layout

    def notes(self) -> list[str]:
        out = [str(u) for u in (*self.aliases, *self.value_aliases, *self.ignored)]
        return out + verl_notes(self.verl)


def verl_notes(translation: verl_layout.Translation | None) -> list[str]:
    """The translation of a verl-layout config, one line per verl key, after a summary."""
    if translation is None:
        return []
    return [translation.summary(), *(str(u) for u in translation.uses)]


@dataclass
class _Ctx:
    problems: list[Problem] = field(default_factory=list)
    aliases: list[AliasUse] = field(default_factory=list)
    value_aliases: list[ValueAliasUse] = field(default_factory=list)
    ignored: list[IgnoredUse] = field(default_factory=list)
    # override key text that set each canonical key (two spellings of one key must agree)
    override_keys: dict[str, tuple[str, Any]] = field(default_factory=dict)
    verl: verl_layout.Translation | None = None

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

    A file that cannot be read (missing, a directory, binary, not UTF-8, too large) or parsed
    raises ConfigError too, with one problem keyed by the path."""
    ctx = _Ctx()
    raw = _parse_yaml(_read_text(path), "config file", str(path), ctx, "")
    if ctx.problems:
        raise ConfigError(ctx.problems)
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


def load_config_cli(prog: str, path: str | Path, overrides: Sequence[str] = (), *,
                    output_dirs: Sequence[str] = ()) -> Config:
    """load_config for a command: prints one "note: ..." line per alias or ignored key on
    stderr; on any problem prints them all and exits with status 2 (no traceback).
    `output_dirs`: dotted keys of the directories the command will create (output_dir_problem)."""
    try:
        resolved = resolve_config(path, overrides)
        problems = []
        for key in output_dirs:
            value: Any = resolved.config
            for part in key.split("."):
                value = getattr(value, part)
            problems.append(output_dir_problem(key, value))
        if any(problems):
            raise ConfigError([p for p in problems if p])
    except ConfigError as e:
        _print_problems(prog, path, e.problems)
        for note in verl_notes(getattr(e, "verl", None)):
            print(f"{prog}: note: {note}", file=sys.stderr)
        raise SystemExit(2) from None
    for note in resolved.notes():
        print(f"{prog}: note: {note}", file=sys.stderr)
    return resolved.config


def output_dir_problem(key: str, path: str | Path) -> Problem | None:
    """Why directory `path` (config key `key`) cannot be created or written into, or None.

    Checked by the commands before they start: the nearest existing ancestor must be a directory."""
    p = Path(path)
    for parent in (p, *p.parents):
        if parent.exists():
            if not parent.is_dir():
                what = "is" if parent == p else f"is under {str(parent)!r}, which is"
                return Problem(key, str(path), f"{what} an existing file, not a directory; "
                                               "choose a directory that does not exist or is one")
            if not os.access(parent, os.W_OK | os.X_OK):
                return Problem(key, str(path), f"cannot be created or written: {str(parent)!r} "
                                               "is not writable")
            return None
    return None


def _print_problems(prog: str, path: str | Path, problems: Sequence[Problem]) -> None:
    print(f"{prog}: error: {path}: {len(problems)} config problem(s):", file=sys.stderr)
    for p in problems:
        print(f"  - {p}", file=sys.stderr)


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
        cfg = load_config_cli("pfppo validate", args.config, args.overrides)
    except SystemExit as e:
        return int(e.code)
    sys.stdout.write(dump_yaml(cfg))
    return 0


# ----------------------------------------------------------------------------- pipeline


def _resolve(raw: Any, overrides: Sequence[str], ctx: _Ctx, root: type = Config) -> Resolved:
    canonical = _canonical_with_overrides(raw, overrides, ctx, root)
    n_before = len(ctx.problems)
    cfg, _ = _build(root, canonical, "", ctx)
    if ctx.verl is not None:  # a rule of ours broken by a translated value names the verl key too
        ctx.problems[n_before:] = [_from_verl(p, ctx.verl) for p in ctx.problems[n_before:]]
    if ctx.problems:
        error = ConfigError(ctx.problems)
        error.verl = ctx.verl  # type: ignore[attr-defined]  # printed by load_config_cli
        raise error
    return Resolved(cfg, ctx.aliases, ctx.value_aliases, ctx.ignored, ctx.verl)


def _from_verl(p: Problem, translation: verl_layout.Translation) -> Problem:
    origin = translation.origin.get(p.key)
    if origin is None:
        return p
    key, _, explicit = origin
    return dataclasses.replace(p, rule=f"{p.rule} (set from verl's {key}{'' if explicit else ', its default'})")


def _canonical_with_overrides(raw: Any, overrides: Sequence[str], ctx: _Ctx,
                              root: type = Config) -> dict[str, Any]:
    if raw is None:  # an empty file
        raw = {}
    if not isinstance(raw, Mapping):
        ctx.add("(top level)", raw, "the config must be a mapping of section names to sections")
        raw = {}
    d = _expand_dotted(copy.deepcopy(dict(raw)), "", ctx)
    if root is Config and verl_layout.is_verl_layout(d, [t.split("=", 1)[0] for t in overrides]):
        return _verl_layout(root, d, overrides, ctx)
    d = _canonicalize(root, d, "", ctx, "config")
    for text in overrides:
        _apply_override(root, d, text, ctx)
    return d


def _verl_layout(root: type, d: dict, overrides: Sequence[str], ctx: _Ctx) -> dict[str, Any]:
    """verl's keys of file and overrides through verl_layout.translate; ours as usual; then merged: a
    translated key of ours that is also given as ours is a problem naming both (a key only
    verl's defaults set gives way to ours)."""
    items: list[tuple[str, Any, str]] = []
    native: dict[str, Any] = {}
    for key, value in _leaves(d, ""):
        if verl_layout.is_verl_key(key):
            items.append((key, value, "config"))
        else:
            _set_path(native, key.split("."), value)
    native_overrides = []
    for text in overrides:
        key, sep, raw = text.partition("=")
        name = verl_layout.strip_hydra(key)
        if not (sep or key.strip().startswith("~")) or not verl_layout.is_verl_key(name):
            native_overrides.append(f"{name}{sep}{raw}" if sep else text)
            continue
        if key.strip().startswith("~"):
            items.append(("~" + name, None, "override"))
            continue
        value = _override_value(name, raw, ctx)
        if value is not _MISSING:
            items.append((name, value, "override"))
    native = _canonicalize(root, native, "", ctx, "config")
    for text in native_overrides:
        _apply_override(root, native, text, ctx)
    ours = {k: v for k, v in _leaves(native, "")}
    translation = verl_layout.translate(items, ours)
    ctx.verl = translation
    ctx.problems += translation.problems
    for key, value in translation.values.items():
        vkey, _, explicit = translation.origin[key]
        if key in ours:
            if explicit:
                spelled = next((u.alias for u in ctx.aliases if u.canonical == key), key)
                ctx.add(vkey, value, f"sets {key} = {value!r} (verl layout), and our {spelled} = {ours[key]!r} "
                                     f"sets it too; keep one")
            continue
        _set_path(native, key.split("."), value)
    return native


def _leaves(d: Any, path: str) -> list[tuple[str, Any]]:
    """(dotted key, value) of every leaf; an empty mapping and a list are leaves."""
    if not isinstance(d, dict) or (not d and path):
        return [(path, d)]
    out = []
    for k, v in d.items():
        out += _leaves(v, _join(path, str(k)))
    return out


def _set_path(d: dict, parts: list[str], value: Any) -> None:
    for part in parts[:-1]:
        if not isinstance(d.get(part), dict):
            d[part] = {}
        d = d[part]
    d[parts[-1]] = value


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


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


# ----------------------------------------------------------------------------- 0, 1. read and parse


def _read_text(path: str | Path) -> str:
    """The file's text, or ConfigError keyed by the path saying why it is not a config file."""
    def refuse(rule: str) -> ConfigError:
        return ConfigError([Problem("config file", str(path), rule)])

    p = Path(path)
    try:
        if p.is_dir():
            raise refuse("is a directory; give the YAML config file")
        with p.open("rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise refuse("no such file") from None
    except OSError as e:
        raise refuse(f"cannot be read: {e.strerror or e}") from None
    if len(data) > MAX_FILE_BYTES:
        raise refuse(f"is larger than {MAX_FILE_BYTES} bytes; a config is a few KiB of YAML text")
    nul = data.find(b"\0")
    if nul >= 0:
        raise refuse(f"is a binary file (NUL byte at offset {nul}), not YAML text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise refuse(f"is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
                     "save it as UTF-8") from None


def _parse_yaml(text: str, key: str, value: Any, ctx: _Ctx, path: str) -> Any:
    """yaml.safe_load(text) within MAX_DEPTH and MAX_NODES, duplicate keys reported; on a
    problem adds it (keyed `key`, shown with `value`) and returns None."""
    loader = None
    try:
        _check_size(text, key, value)
        loader = yaml.SafeLoader(text)
        node = loader.get_single_node()
        _find_duplicate_keys(node, path, ctx, set())
        return None if node is None else loader.construct_document(node)
    except ConfigError as e:
        ctx.problems += e.problems
    except yaml.YAMLError as e:
        ctx.add(key, value, f"is not valid YAML: {e}")
    except ValueError as e:  # an int of more digits than Python converts
        ctx.add(key, value, f"holds a number of more digits than Python reads ({str(e).split(';')[0]})")
    finally:
        if loader is not None:
            loader.dispose()
    return None


def _check_size(text: str, key: str, value: Any) -> None:
    """Refuses nesting deeper than MAX_DEPTH and more than MAX_NODES nodes with every alias
    expanded, from one pass over the parse events (no tree is built; the composer and the
    constructor that run after it recurse once per level and copy what aliases share).

    libyaml's parser when PyYAML has it (the pure-Python one scans deep flow nesting in
    quadratic time); a document libyaml refuses is checked again with the pure-Python one."""
    if yaml.__with_libyaml__:
        try:
            return _check_events(yaml.CSafeLoader(text), key, value)
        except yaml.YAMLError:
            pass
    try:
        _check_events(yaml.SafeLoader(text), key, value)
    except yaml.YAMLError:
        pass  # reported, with its position, by the parse that follows


def _check_events(loader: Any, key: str, value: Any) -> None:
    def refuse(rule: str) -> ConfigError:
        return ConfigError([Problem(key, value, rule)])

    sizes: dict[str, int] = {}  # anchor -> nodes of the anchored node, aliases expanded
    open_sizes, open_anchors = [0], [None]  # per open collection (and the document)
    try:
        while loader.check_event():
            event = loader.get_event()
            n = 0
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                if len(open_sizes) > MAX_DEPTH:
                    raise refuse(f"nests mappings/lists more than {MAX_DEPTH} deep (line "
                                 f"{event.start_mark.line + 1}); a config is a few sections deep")
                open_sizes.append(1)
                open_anchors.append(event.anchor)
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                n, anchor = open_sizes.pop(), open_anchors.pop()
                if anchor is not None:
                    sizes[anchor] = n
            elif isinstance(event, yaml.ScalarEvent):
                n = 1
                if event.anchor is not None:
                    sizes[event.anchor] = 1
            elif isinstance(event, yaml.AliasEvent):
                if event.anchor in open_anchors:
                    raise refuse(f"holds a recursive alias (*{event.anchor} inside the collection "
                                 f"&{event.anchor}, line {event.start_mark.line + 1})")
                n = sizes.get(event.anchor, 1)  # an undefined one is reported by the composer
            open_sizes[-1] += n
            if open_sizes[-1] > MAX_NODES:
                raise refuse(f"holds more than {MAX_NODES} keys, values and lists with every alias "
                             "(*name) expanded (nested aliases: a YAML 'billion laughs'); a config "
                             "holds a few hundred")
    finally:
        loader.dispose()


def _find_duplicate_keys(node: yaml.Node | None, path: str, ctx: _Ctx, seen_nodes: set[int]) -> None:
    """Report keys given twice in one mapping. A node shared through aliases is scanned once
    (at its first path): walking every alias again made this exponential in the nesting."""
    if node is None or id(node) in seen_nodes:
        return
    seen_nodes.add(id(node))
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
            _find_duplicate_keys(value_node, _join(path, key), ctx, seen_nodes)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _find_duplicate_keys(item, f"{path}[{i}]", ctx, seen_nodes)


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
    for key in cls.IGNORED:
        if key in d:
            _ignore(cls, key, d.pop(key), path, ctx)
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


def _ignore(cls: type, key: str, value: Any, path: str, ctx: _Ctx) -> None:
    """Accept key `key` of `cls.IGNORED` if its value has the declared type, and note it."""
    tp, why = cls.IGNORED[key]
    value, error = coerce(value, tp)
    if error:
        ctx.add(_join(path, key), value, error)
    else:
        ctx.ignored.append(IgnoredUse(_join(path, key), value, why))


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
    ctx.add(_join(path, key), value, "unknown key; " + _suggest(key, _choices_of(cls), path, path)
            + _verl_hint(_join(path, key), value))


def _verl_hint(full: str, value: Any) -> str:
    """For an unknown key of ours that is one of verl's (algorithm.use_kl_in_reward): how to have it read."""
    keys = [k for k, _ in _leaves(value, full)] if isinstance(value, dict) else [full]
    if full.split(".")[0] in verl_layout.SHARED_HEADS and any(verl_layout.rule_for(k) for k in keys):
        return (f" ({full} is verl's: verl's layout is read when the config has one of its own sections, "
                f"{', '.join(verl_layout.VERL_HEADS[:5])}, ...)")
    return ""


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
    value = _override_value(key, raw, ctx)
    if value is _MISSING:
        return
    target = _resolve_key(root, key.split("."), "", key, value, ctx)
    if target is None:
        return
    parts, tp = target
    full = ".".join(parts)
    earlier = ctx.override_keys.get(full)
    if earlier and earlier[0] != key and not _same(earlier[1], value):
        ctx.add(key, value, f"conflicts with the override {earlier[0]}={earlier[1]!r} (both are "
                            f"read as {full}); keep one")
        return
    ctx.override_keys[full] = (key, value)
    if _is_section(tp) and isinstance(value, dict):
        value = _canonicalize(tp, _expand_dotted(value, full, ctx), full, ctx, "override")
    node = d
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    _override(node, parts[-1], value)


def _override_value(key: str, raw: str, ctx: _Ctx) -> Any:
    """The YAML value of an override, or _MISSING after reporting why it is not one."""
    n_problems = len(ctx.problems)
    value = _parse_yaml(raw, key, raw, ctx, key)
    if len(ctx.problems) > n_problems:
        ctx.problems[n_problems:] = [dataclasses.replace(p, rule="override value " + p.rule)
                                     for p in ctx.problems[n_problems:]]
        return _MISSING
    return value


def _override(dst: dict, key: str, value: Any) -> None:
    if isinstance(dst.get(key), dict) and isinstance(value, dict):
        for k, v in value.items():
            _override(dst[key], k, v)
    else:
        dst[key] = value


def _resolve_key(cls: type, parts: list[str], path: str, text: str, value: Any,
                 ctx: _Ctx) -> tuple[list[str], Any] | None:
    """Canonical key parts and type of an override key path (aliases allowed), or None after
    reporting why it is not a key of the tree (or noting that it is an ignored key)."""
    types_ = _field_types(cls)
    head = parts[0]
    if head in cls.IGNORED and len(parts) == 1:
        _ignore(cls, head, value, path, ctx)
        return None
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
                    f"unknown key (override {text}); " + _suggest(head, _choices_of(cls), path, path)
                    + _verl_hint(_join(path, ".".join(parts)), value))
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
