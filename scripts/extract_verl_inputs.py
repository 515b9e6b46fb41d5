#!/usr/bin/env python3
"""Regenerate the verl-derived test inputs from a verl checkout (facts only, no verl text).

    python scripts/extract_verl_inputs.py VERL_DIR [--recipe RECIPE_DIR] [--out tests/data]

VERL_DIR is a checkout of github.com/volcengine/verl (a work tree; `git -C VERL_DIR rev-parse
HEAD` names the commit, or pass --commit). Its `recipe/` is a git submodule
(verl-project/verl-recipe); point --recipe at a checkout of it (default VERL_DIR/recipe) and
--recipe-commit at its commit when it is not a git work tree.

Writes
  verl_overrides.json         {"commit", "recipe_commit", "entrypoint", "scripts": {path: {
                               "config_name", "overrides": ["key=value", ...], "vars": {NAME: text}}},
                               "skipped": {path: why}}
                              for every examples/**/*.sh and recipe/**/*.sh that launches
                              verl.trainer.main_ppo: the hydra overrides in order (`+key` kept),
                              shell variables left as written ($x, ${X:-d}, $((a * b))), and the
                              script's own simple assignments NAME=text so a reader can resolve them.
  verl_megatron_defaults.json {"commit", "source", "defaults": {dotted key: value}} the leaves of
                              verl/trainer/config/_generated_ppo_megatron_trainer.yaml (the composed
                              ppo_megatron_trainer.yaml), ${...} interpolations kept as strings.

Shell is read the way the scripts are meant, not re-implemented: continuation lines are joined
(also `\\  # comment`, which bash would end the command at), comments dropped, quotes removed,
`$(( ))` and `$( )` kept as one word.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import yaml

ENTRYPOINT = "verl.trainer.main_ppo"
# verl's top-level config sections: a dotted word under one of them is a hydra override.
VERL_HEADS = ("actor_rollout_ref", "critic", "algorithm", "data", "trainer", "reward_model",
              "custom_reward_function", "reward_manager", "global_profiler", "ray_kwargs",
              "transfer_queue", "ray_init")
_OVERRIDE_RE = re.compile(r"^(\+{0,2}|~)([A-Za-z_][\w\-]*(?:\.[\w\-]+)+)=(.*)$", re.S)
_ASSIGN_RE = re.compile(r"^([A-Za-z_]\w*)=(.*)$", re.S)
_SUBST_RE = re.compile(r"\$\(\((?:[^()]|\([^()]*\))*\)\)|\$\([^()]*\)")


def _git_head(path: Path) -> str | None:
    try:
        return subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _logical_lines(text: str) -> list[str]:
    """Continuation lines joined; `\\  # note` read as a continuation (what the author meant)."""
    out, cur = [], ""
    for line in text.splitlines():
        m = re.search(r"\\\s+#.*$", line) or re.search(r"\\$", line)
        if m:
            cur += line[:m.start()] + " "
            continue
        out.append(cur + line)
        cur = ""
    if cur:
        out.append(cur)
    return out


def words(text: str) -> list[str]:
    """The shell words of a script, quotes removed, `$(( ))` / `$( )` kept whole."""
    result: list[str] = []
    pending = ""
    for line in _logical_lines(text):
        chunk = pending + line
        kept: list[str] = []
        protected = _SUBST_RE.sub(lambda m: kept.append(m.group(0)) or f"\0{len(kept) - 1}\0", chunk)
        lex = shlex.shlex(protected, posix=True, punctuation_chars=";&|()<>")
        lex.whitespace_split = True
        lex.commenters = "#"
        try:
            toks = list(lex)
        except ValueError:  # a quote that closes on a later line
            pending = chunk + "\n"
            continue
        pending = ""
        result += [re.sub(r"\0(\d+)\0", lambda m: kept[int(m.group(1))], t) for t in toks]
    return result


def script_facts(text: str) -> dict | None:
    """config_name, overrides and vars of one launch script; None when it does not run main_ppo."""
    ws = words(text)
    if ENTRYPOINT not in ws:
        return None
    overrides: list[str] = []
    seen: set[str] = set()
    variables: dict[str, str] = {}
    config_name = "ppo_trainer"
    for i, w in enumerate(ws):
        if w.startswith("--config-name"):
            name = w.split("=", 1)[1] if "=" in w else (ws[i + 1] if i + 1 < len(ws) else "")
            config_name = name.removesuffix(".yaml")
            continue
        m = _OVERRIDE_RE.match(w)
        if m and m.group(2).split(".")[0] in VERL_HEADS:
            if w not in seen:
                seen.add(w)
                overrides.append(w)
            continue
        a = _ASSIGN_RE.match(w)
        if a:
            variables[a.group(1)] = a.group(2)
            # a variable holding several overrides ("ARGS='a.b=1 c.d=2'")
            if re.search(r"(?:^|\s)\+{0,2}[A-Za-z_]\w*\.[\w.\-]+=", a.group(2)):
                for inner in words(a.group(2)):
                    m = _OVERRIDE_RE.match(inner)
                    if m and m.group(2).split(".")[0] in VERL_HEADS and inner not in seen:
                        seen.add(inner)
                        overrides.append(inner)
    used = set(re.findall(r"\$\{?([A-Za-z_]\w*)", " ".join(overrides)))
    # variables the overrides use, and the ones those refer to (one level is enough in practice)
    for _ in range(3):
        used |= set(re.findall(r"\$\{?([A-Za-z_]\w*)", " ".join(variables.get(v, "") for v in used)))
        used |= set(re.findall(r"\b([A-Za-z_]\w*)\b", " ".join(
            variables.get(v, "") for v in used if "$((" in variables.get(v, ""))))
    return {"config_name": config_name, "overrides": overrides,
            "vars": {k: v for k, v in variables.items() if k in used}}


def flatten(d: dict, prefix: str = "") -> dict:
    out: dict = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and v:
            out.update(flatten(v, key))
        else:
            out[key] = v
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("verl", type=Path)
    ap.add_argument("--recipe", type=Path, default=None)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--recipe-commit", default=None)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "tests" / "data")
    args = ap.parse_args(argv)
    verl, recipe = args.verl, args.recipe or args.verl / "recipe"
    commit = args.commit or _git_head(verl)
    recipe_commit = args.recipe_commit or _git_head(recipe)
    if not commit:
        print("extract_verl_inputs: cannot tell the verl commit; pass --commit", file=sys.stderr)
        return 2

    scripts: dict[str, dict] = {}
    skipped: dict[str, str] = {}
    paths = sorted(verl.glob("examples/**/*.sh")) + sorted(recipe.glob("**/*.sh"))
    for path in paths:
        rel = path.relative_to(verl).as_posix() if path.is_relative_to(verl) else \
            "recipe/" + path.relative_to(recipe).as_posix()
        facts = script_facts(path.read_text(encoding="utf-8", errors="replace"))
        if facts is None:
            skipped[rel] = f"does not launch {ENTRYPOINT}"
        elif not facts["overrides"]:
            skipped[rel] = "launches it without key=value overrides"
        else:
            scripts[rel] = facts
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "verl_overrides.json").write_text(json.dumps(
        {"commit": commit, "recipe_commit": recipe_commit, "entrypoint": ENTRYPOINT,
         "scripts": scripts, "skipped": skipped}, indent=1, sort_keys=False) + "\n")

    source = "verl/trainer/config/_generated_ppo_megatron_trainer.yaml"
    defaults = flatten(yaml.safe_load((verl / source).read_text()))
    (args.out / "verl_megatron_defaults.json").write_text(json.dumps(
        {"commit": commit, "source": source, "defaults": defaults}, indent=1) + "\n")
    n_keys = len({o.split("=", 1)[0].lstrip("+~") for s in scripts.values() for o in s["overrides"]})
    print(f"extract_verl_inputs: verl {commit[:12]}: {len(scripts)} scripts, {n_keys} distinct keys, "
          f"{len(skipped)} skipped; {len(defaults)} megatron defaults -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
