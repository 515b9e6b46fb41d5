"""The figures issue 37 asks for, measured on the source tree (docs/design.md, "Where a change goes"):

    .venv/bin/python scripts/house_metrics.py [ROOT]

files and lines per folder of trainer/, the largest function of the package, what the planner
imports of the trainer, the functions that take the whole ``Run`` (a parameter annotated ``Run``,
or an unannotated ``run``, or a method that reads ``self.run``), and ``Run``'s fields: how many,
how many typed ``object`` / ``Any`` / unannotated, and its parts' fields.
"""

from __future__ import annotations

import ast
import sys
from collections import Counter
from pathlib import Path

LOOSE = {"object", "Any"}


def modules(pkg: Path):
    for path in sorted(pkg.rglob("*.py")):
        yield path, ast.parse(path.read_text(), str(path))


def functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def takes_whole_run(fn: ast.FunctionDef) -> bool:
    for a in [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]:
        ann = a.annotation
        name = ann.id if isinstance(ann, ast.Name) else ann.value if isinstance(ann, ast.Constant) else None
        if name == "Run" or (a.arg == "run" and ann is None):
            return True
    return any(isinstance(n, ast.Attribute) and n.attr == "run" and isinstance(n.value, ast.Name)
               and n.value.id == "self" for n in ast.walk(fn))


def dataclass_fields(tree: ast.Module, name: str) -> list[tuple[str, str]]:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return [(s.target.id, ast.unparse(s.annotation)) for s in node.body
                    if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
    return []


def main(root: Path) -> None:
    pkg = root / "pfppo_mega"
    trainer = pkg / "trainer"
    print("trainer/ folders (files, lines):")
    for folder in sorted({p.parent for p in trainer.rglob("*.py")}):
        files = sorted(folder.glob("*.py"))
        lines = sum(len(f.read_text().splitlines()) for f in files)
        print(f"  {folder.relative_to(pkg)}/: {len(files)} files, {lines} lines")
    parsed = list(modules(pkg))
    sizes = [(fn.end_lineno - fn.lineno + 1, f"{path.relative_to(root)}:{fn.name}")
             for path, tree in parsed for fn in functions(tree)]
    print("largest functions (lines):", ", ".join(f"{w} {n}" for n, w in sorted(sizes, reverse=True)[:3]))
    planner = Counter()
    for path, tree in parsed:
        if path.is_relative_to(pkg / "planning"):
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pfppo_mega.trainer"):
                    planner.update(a.name for a in node.names)
    print(f"planner imports of trainer/: {len(planner)} names {sorted(planner)}")
    whole = [f"{path.relative_to(pkg)}:{fn.name}" for path, tree in parsed for fn in functions(tree)
             if takes_whole_run(fn) and not path.is_relative_to(pkg / "planning")]  # planning's run: RunShape
    by_file = Counter(w.split(":")[0] for w in whole)
    print(f"functions taking the whole Run: {len(whole)} ({dict(sorted(by_file.items()))})")
    build = ast.parse((trainer / "build.py").read_text())
    fields = dataclass_fields(build, "Run")
    loose = [f"{n}: {t}" for n, t in fields if t in LOOSE]
    print(f"Run: {len(fields)} fields, {len(loose)} typed object/Any {loose}")
    for n, t in fields:
        part = dataclass_fields(build, t)
        if part:
            bad = [f"{k}: {v}" for k, v in part if v in LOOSE]
            print(f"  {n}: {t}, {len(part)} fields, {len(bad)} typed object/Any {bad}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve())
