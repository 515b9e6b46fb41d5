"""Generates docs/verl.md from the translation table of ``pfppo_mega.config.verl``, so the doc
cannot drift from the code.

    python -m pfppo_mega.config.verl_doc --write docs/verl.md
    python -m pfppo_mega.config.verl_doc --check docs/verl.md   # exit 1 if stale
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, Sequence

from pfppo_mega.config.reference import write_or_check
from pfppo_mega.config.verl import RULES, VERL_DEFAULTS, VERL_FIXED, VERL_HEADS, Rule, _float

DEFAULT_PATH = Path(__file__).resolve().parents[2] / "docs" / "verl.md"
COMMAND = "python -m pfppo_mega.config.verl_doc --write docs/verl.md"


def generate_doc() -> str:
    lines = [
        "# verl's config layout",
        "",
        f"<!-- Generated from pfppo_mega/config/verl.py by `{COMMAND}`.",
        "     Do not edit by hand: tests/test_verl_layout.py fails when this file is out of date. -->",
        "",
        "A config or a launch script's `key=value` overrides written in verl's tree (any of "
        + ", ".join(f"`{h}`" for h in VERL_HEADS) + ") are read through this table: each verl key is",
        "**mapped** onto ours (value converted), **ignored** with the reason printed, or **refused** by name",
        "where accepting it would change the result (a refusal's *ok* values ask for nothing and are",
        "accepted). Keys of `algorithm` and `data` are verl's when listed here, else ours. `pfppo validate`",
        "prints what each key became. The first row that matches a key applies (exact keys first); `*`",
        "is one key segment (or part of one), `**` any tail, `{a, b}` the keys of a subtree verl has (any",
        "other key there is unknown).",
        "",
        "## verl's defaults applied",
        "",
        "Keys a verl config leaves out take verl's default (its `ppo_megatron_trainer.yaml`), as in verl;",
        "one of our keys given explicitly wins.",
        "",
        "| verl key | default |",
        "|---|---|",
        *(f"| `{k}` | `{v!r}` |" for k, v in VERL_DEFAULTS.items()),
        *(f"| (our `{k}`) | `{v!r}`: {why} |" for k, (v, why) in VERL_FIXED.items()),
        "",
        "## The table",
        "",
        "| verl key | becomes | why / notes |",
        "|---|---|---|",
    ]
    for r in RULES:
        if r.action == "map":
            converted = r.convert is not None and r.convert is not _float
            becomes = f"`{r.target}`" + (" (converted)" if converted else "")
            why = r.why or (_first_line(r.convert) if r.convert else "")
        elif r.action == "ignore":
            becomes, why = "ignored", r.why
        else:
            ok = ", ".join(f"`{o!r}`" for o in r.ok)
            becomes, why = "refused" + (f" unless {ok}" if ok else ""), r.why
        lines.append(f"| `{shown(r)}` | {becomes} | {why.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def shown(rule: Rule) -> str:
    """The key pattern of a row; a closed subtree lists its keys: `prefix.{a, b}`."""
    if not rule.keys:
        return rule.pattern
    return f"{rule.pattern.removesuffix('.**')}.{{{', '.join(rule.keys)}}}"


def _first_line(fn: Callable) -> str:
    return " ".join((fn.__doc__ or "").strip().split("\n\n")[0].split())


def main(argv: Sequence[str] | None = None) -> int:
    return write_or_check(argv, prog="python -m pfppo_mega.config.verl_doc", description="Generate or check docs/verl.md.",
                          generate=generate_doc, default_path=DEFAULT_PATH, source="pfppo_mega/config/verl.py",
                          command=COMMAND)


if __name__ == "__main__":
    sys.exit(main())
