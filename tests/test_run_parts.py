"""The run in parts (docs/design.md, "The run in parts"): every field of ``Run`` and of its parts names
a type or a protocol, never ``object`` / ``Any``; no phase takes the whole ``Run`` (only the trainer's
own methods, which bind the phases to its parts, and the checkpoint, which saves and restores every
part). Read with ``ast``, nothing imported."""

from __future__ import annotations

import ast
import dataclasses
import typing
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "pfppo_mega"
TRAINER = PKG / "trainer"
PARTS = {"Models", "Colocation", "Strategies", "TrainState", "DataParallel"}
# the readers of the whole Run: the trainer (its methods bind each phase to the parts it reads) and the
# checkpoint (resume.py; the asynchronous mode's requests in flight beside it)
WHOLE_RUN_READERS = {TRAINER / "loop.py", TRAINER / "checkpoint" / "resume.py", TRAINER / "asynchronous" / "mode.py"}


def _classes(tree: ast.Module) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}


def _fields(cls: ast.ClassDef) -> dict[str, str]:
    return {s.target.id: ast.unparse(s.annotation) for s in cls.body
            if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}


def _takes_run(fn: ast.FunctionDef) -> bool:
    for a in [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]:
        ann = None if a.annotation is None else ast.unparse(a.annotation).strip("'\"")
        if ann == "Run" or (a.arg == "run" and ann is None):
            return True
    return False


def test_run_and_its_parts_name_their_types():
    classes = _classes(ast.parse((TRAINER / "build.py").read_text()))
    run = _fields(classes["Run"])
    assert PARTS - {"DataParallel"} <= set(run.values()), f"Run's parts: {run}"
    loose = [f"{cls}.{name}: {t}" for cls in ("Run", *PARTS) for name, t in _fields(classes[cls]).items()
             if t in ("object", "Any", "typing.Any")]
    assert not loose, f"fields typed object / Any where a type or a protocol can be named: {loose}"


def test_no_phase_takes_the_whole_run():
    bad = []
    for path in sorted(TRAINER.rglob("*.py")):
        if path in WHOLE_RUN_READERS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _takes_run(node):
                bad.append(f"{path.relative_to(PKG)}:{node.lineno} {node.name}")
    assert not bad, f"functions taking the whole Run (take the parts they read, trainer/build.py): {bad}"


def test_the_check_sees_a_whole_run_parameter():
    """The checks above can fail: a function taking the Run, and a field typed object, are caught."""
    fn = ast.parse("def f(sb, run): pass\ndef g(x: 'Run'): pass\ndef h(models: Models): pass").body
    assert [_takes_run(f) for f in fn] == [True, True, False]
    cls = ast.parse("class C:\n    a: object\n    b: int").body[0]
    assert _fields(cls) == {"a": "object", "b": "int"}


def test_the_built_parts_match_the_source():
    """The parts as dataclasses (imported): the fields the AST read are the dataclasses' own."""
    from pfppo_mega.trainer import build

    tree = _classes(ast.parse((TRAINER / "build.py").read_text()))
    for name in ("Run", *PARTS):
        cls = getattr(build, name)
        assert [f.name for f in dataclasses.fields(cls)] == list(_fields(tree[name])), name
        hints = typing.get_type_hints(cls)
        assert all(hints[f.name] is not object for f in dataclasses.fields(cls)), name
