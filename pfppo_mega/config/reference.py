"""Generates docs/config_reference.md from the config tree (field docs, types, defaults, CHOICES,
ALIASES), so the reference cannot drift from the code.

    python -m pfppo_mega.config.reference --write docs/config_reference.md
    python -m pfppo_mega.config.reference --check docs/config_reference.md   # exit 1 if stale
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import yaml

from pfppo_mega.config.loader import MAX_DEPTH, MAX_FILE_BYTES, MAX_NODES, _field_types, _is_section, _type_name
from pfppo_mega.config.tree import Config

DEFAULT_PATH = Path(__file__).resolve().parents[2] / "docs" / "config_reference.md"
COMMAND = "python -m pfppo_mega.config.reference --write docs/config_reference.md"

INTRO = f"""\
# Config reference

<!-- Generated from pfppo_mega/config/tree.py by `{COMMAND}`.
     Do not edit by hand: tests/test_config.py fails when this file is out of date. -->

A config is one YAML file that mirrors this tree one to one: each section below is a mapping,
each key a field. Every key is optional (the default is used); check a config and see it with
every default filled in with `pfppo validate CONFIG [key.path=value ...]`.
A complete example: `configs/article_example.yaml`.

How values are read:

- Unknown keys are errors (with a did-you-mean for near misses), never ignored.
- float keys accept ints and strings that read as a number: YAML reads `1e-6` (no dot) as a
  string, so `lr: 1e-6` works. int keys refuse floats, even `2.0`. true/false are never numbers
  and numbers never booleans. `null` is accepted only where the type says `or null`.
- Aliases (the spellings of verl and of the PF-PPO article) are accepted and rewritten to the
  canonical key; `pfppo validate` prints a note for each. Alias paths are relative to their
  section and may be nested mappings or literal dotted keys (`algorithm: {{kl_ctrl: {{kl_coef: 0.05}}}}`
  or `algorithm: {{"kl_ctrl.kl_coef": 0.05}}`). An alias and its canonical key given with
  different values is an error.
- Command-line overrides `key.path=value` (alias paths allowed) replace values of the file;
  the value is read as YAML (`training.lr=1e-6`, `algorithm.use_pf_ppo=true`,
  `algorithm.value_clip=null`). One key given twice in the same spelling: the last wins; in two
  spellings with different values (`algorithm.lam=0.5 algorithm.lmbda=0.9`): an error.
- Every float key must be finite: `.inf`, `-.inf`, `.nan` and `1e400` are refused (null, where
  a key allows it, is the way to say "off"). Every int key has an upper bound (sizes, steps and
  intervals far above any real run); the error names the range.
- Some keys of other projects are accepted and ignored with a note (listed per section).
- The file must be UTF-8 text of at most {MAX_FILE_BYTES} bytes, nest at most {MAX_DEPTH} mappings
  or lists deep, and hold at most {MAX_NODES} keys, values and lists once YAML aliases (`*name`) are expanded.
- Every problem of a config is reported at once, each with its key, its value and the rule.
"""


def generate_reference() -> str:
    """The markdown reference of the whole tree."""
    aliases = _aliases_by_canonical(Config, "")
    sections = list(_sections(Config, ""))
    out = [INTRO, "## Sections\n"]
    for path, cls in sections:
        title = path or "top level"
        out.append(f"- [`{title}`](#{_anchor(title)}): {_first_line(cls)}")
    out.append("")
    for path, cls in sections:
        out.append(_section_markdown(path, cls, aliases))
    return "\n".join(out).rstrip("\n") + "\n"


def _sections(cls: type, path: str) -> Iterator[tuple[str, type]]:
    """(path, class) of every section, the root first, children in field order."""
    yield path, cls
    for name, tp in _field_types(cls).items():
        if _is_section(tp):
            yield from _sections(tp, _join(path, name))


def _aliases_by_canonical(cls: type, path: str) -> dict[str, list[str]]:
    """Full canonical key -> full alias keys, over the whole tree."""
    out: dict[str, list[str]] = {}
    for sub_path, sub in _sections(cls, path):
        for alias, canonical in sub.ALIASES.items():
            out.setdefault(_join(sub_path, canonical), []).append(_join(sub_path, alias))
    return out


def _section_markdown(path: str, cls: type, aliases: dict[str, list[str]]) -> str:
    title = path or "top level"
    lines = [f"## `{title}`\n", f"{_doc(cls)}\n", f"Class `{cls.__name__}`.\n",
             "| key | type | default | allowed values | description | aliases |",
             "|---|---|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        tp, key = _field_types(cls)[f.name], _join(path, f.name)
        doc = f.metadata.get("doc", "")
        if _is_section(tp):
            row = [f"`{key}`", "section", "", "", f"{doc} See [`{key}`](#{_anchor(key)}).", ""]
        else:
            allowed = ", ".join(f"`{_yaml(v)}`" for v in cls.CHOICES.get(f.name, ()))
            spellings = cls.VALUE_ALIASES.get(f.name, {})
            if spellings:
                allowed += " (also " + ", ".join(
                    f"`{a}` = `{c}`" for a, c in spellings.items()) + ")"
            row = [f"`{key}`", _type_name(tp), f"`{_yaml(f.default_factory() if f.default is dataclasses.MISSING else f.default)}`", allowed, doc,
                   ", ".join(f"`{a}`" for a in aliases.get(key, []))]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |")
    for name, (tp, why) in cls.IGNORED.items():
        lines.append(f"\nAccepted and ignored, with a note: `{_join(path, name)}` "
                     f"({_type_name(tp)}): {why}.")
    return "\n".join(lines) + "\n"


def _yaml(value: Any) -> str:
    """A scalar as it would be written in the YAML file."""
    text = yaml.safe_dump(value, default_flow_style=True).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()


def _doc(cls: type) -> str:
    return " ".join((cls.__doc__ or "").split())


def _first_line(cls: type) -> str:
    """The first paragraph of the docstring, on one line."""
    return " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())


def _anchor(title: str) -> str:
    """GitHub's heading anchor for a heading of `title` in backticks."""
    return re.sub(r"[^a-z0-9 _-]", "", title.lower()).replace(" ", "-")


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def main(argv: Sequence[str] | None = None) -> int:
    return write_or_check(argv, prog="python -m pfppo_mega.config.reference",
                          description="Generate or check the config reference.", generate=generate_reference,
                          default_path=DEFAULT_PATH, source="pfppo_mega/config/tree.py", command=COMMAND)


def write_or_check(argv: Sequence[str] | None, *, prog: str, description: str, generate: Callable[[], str],
                   default_path: Path, source: str, command: str) -> int:
    """The command line of a generated doc: `--write [PATH]` writes generate()'s text, `--check [PATH]`
    exits 1 (naming `source` and the regenerating `command`) when the file differs from it."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", nargs="?", const=default_path, type=Path, metavar="PATH")
    mode.add_argument("--check", nargs="?", const=default_path, type=Path, metavar="PATH")
    args = parser.parse_args(argv)
    text = generate()
    if args.write:
        args.write.parent.mkdir(parents=True, exist_ok=True)
        args.write.write_text(text)
        print(f"wrote {args.write}")
        return 0
    current = args.check.read_text() if args.check.exists() else None
    if current != text:
        state = "is missing" if current is None else "is out of date"
        print(f"{args.check} {state} with {source}; regenerate it: {command}", file=sys.stderr)
        return 1
    print(f"{args.check} is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
