"""Layers point down only (docs/design.md, "Layers"): every module of pfppo_mega is read with `ast` (its
import and from-import statements, at module level and inside functions, relative ones resolved)
and placed in a layer by its package (LAYERS). An import may go to its own package, to a lower
layer, or to another package of its own layer where SIDEWAYS says so; no import cycle between
modules. A fresh interpreter then checks the same at run time (what importing a layer loads).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "pfppo_mega"
PKG = "pfppo_mega"

# Top to bottom; a package is the first name under pfppo_mega (a subpackage or a module).
LAYERS = (
    ("commands", ("__main__", "cli", "experiments", "bench", "planning", "doctor", "sft")),
    ("trainer", ("trainer",)),       # the loop in phases; owns no model, engine or task code
    ("components", ("rollout", "pool", "data", "rewards", "tasks", "ledger")),  # engines, pool, prompts, rewards;
    # ledger: the device-memory arithmetic that both the trainer and the planner read
    ("models", ("models",)),         # megatron models, HF import/export, resharding
    ("math", ("kernels", "ppo")),    # fused ops and pure-torch math
    ("base", ("parallel", "compat", "config", "types", "constants", "families", "tokenizer", "registry", "pinned",
              "watchdog", "_C")),
    # groups and collectives, shims, the typed tree, shared types, names and limits, exactly pinned host
    # buffers, the stalled-rank watchdog; _C: the C++ ops
)
# Same-layer imports between packages: importer -> what it may import (nothing else sideways).
SIDEWAYS = {
    "__main__": {"cli"},
    "cli": {"doctor", "experiments", "planning", "sft"},  # the commands it dispatches to
    "experiments": {"doctor"},       # a sweep's verdicts per run
    "bench": {"planning"},           # gpu_check reads the plan of the configs it checks
    "data": {"tasks"},               # data.source = task: the built-in task's prompts
    "rewards": {"tasks"},            # ... and its verifier (rewards/task.py)
    "pool": {"rollout"},             # a snapshot is a WeightSource of buckets in the rollout layout
    "rollout": {"rewards"},          # multi-turn tools grade answers with the reward rules and run code
                                     # through the reward's sandbox client (rollout/tools/)
    "kernels": {"ppo"},              # the backends take the pure-torch references' arguments
    "parallel": {"compat", "constants", "watchdog"},  # megatron-core on a CPU torch; the default collective
                                                      # timeout; the heartbeat watchdog it starts
    "config": {"constants", "registry"},  # the tree's choices and limits; registered names
}
# docs/design.md's words beyond the order: "trainer/ ... owns no ... task code"; the planner does not
# stand on the trainer (the memory arithmetic both read is ledger.py, below them).
FORBIDDEN = {("trainer", "tasks"), ("planning", "trainer")}
# The math: its packages may import these of the project, and torch.distributed or not (ppo/ is
# pure torch; kernels/ holds the collectives of its thin autograd wrappers, vocab_parallel.py).
PURE = {"ppo": ({"ppo", "constants"}, False),
        "kernels": ({"kernels", "ppo", "constants", "_C"}, True)}

LAYER_OF = {pkg: i for i, (_, pkgs) in enumerate(LAYERS) for pkg in pkgs}
NATIVE = {f"{PKG}._C"}  # compiled extension (setup.py), not a .py file


@dataclass(frozen=True)
class Import:
    importer: str
    target: str      # a pfppo_mega module (the deepest one the statement names)
    line: int
    lazy: bool       # inside a function


def _modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


MODULES = _modules()


def _exists(module: str) -> bool:
    return module in MODULES or module in NATIVE


def _external(node: ast.AST) -> list[str]:
    """Every name a statement may run, outside the project included (`from a import b`: a, a.b)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return []


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_pkg: bool) -> list[str]:
    """The pfppo_mega modules a statement runs (a name that is not a module: its package)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name == PKG or a.name.startswith(PKG + ".")]
    if node.level:
        base = (module if is_pkg else module.rpartition(".")[0]).split(".")
        base = base[: len(base) - (node.level - 1)]
        origin = ".".join(base + ([node.module] if node.module else []))
    else:
        origin = node.module or ""
    if origin != PKG and not origin.startswith(PKG + "."):
        return []
    subs = [f"{origin}.{a.name}" for a in node.names if _exists(f"{origin}.{a.name}")]
    return subs if len(subs) == len(node.names) else subs + [origin]


class _Visitor(ast.NodeVisitor):
    def __init__(self, module: str, is_pkg: bool):
        self.module, self.is_pkg = module, is_pkg
        self.imports: list[Import] = []
        self.external: list[tuple[str, int]] = []
        self.depth = 0

    def _fn(self, node):
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = _fn

    def _import(self, node):
        for t in _targets(node, self.module, self.is_pkg):
            self.imports.append(Import(self.module, t, node.lineno, self.depth > 0))
        self.external += [(name, node.lineno) for name in _external(node)
                          if name.split(".")[0] != PKG]

    visit_Import = visit_ImportFrom = _import


def _parse():
    imports, external = [], {}
    for module, (path, is_pkg) in MODULES.items():
        v = _Visitor(module, is_pkg)
        v.visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
        imports += v.imports
        external[module] = v.external
    return imports, external


IMPORTS, EXTERNAL = _parse()


def package(module: str) -> str:
    """pfppo_mega.rollout.weights -> rollout; pfppo_mega.cli -> cli; pfppo_mega -> ''."""
    return module.split(".")[1] if "." in module else ""


def layer(module: str) -> str:
    return LAYERS[LAYER_OF[package(module)]][0]


def _where(imp: Import) -> str:
    return f"{MODULES[imp.importer][0].relative_to(ROOT.parent)}:{imp.line}{' (inside a function)' if imp.lazy else ''}"


def test_every_module_has_a_layer():
    missing = sorted({package(m) for m in MODULES if m != PKG and package(m) not in LAYER_OF})
    assert not missing, (f"packages of pfppo_mega in no layer: {missing}; add each to LAYERS in tests/test_layers.py "
                         f"where docs/design.md's 'Layers' puts it")
    assert len(LAYER_OF) == sum(len(p) for _, p in LAYERS), "a package is in two layers of LAYERS"
    # the root package is what every submodule import runs first: it must stay empty
    assert [i for i in IMPORTS if i.importer == PKG] == [], "pfppo_mega/__init__.py imports the project"


def test_every_import_names_a_module_that_exists():
    bad = [f"{_where(i)}: imports {i.target}, which is no module of pfppo_mega" for i in IMPORTS
           if not _exists(i.target)]
    assert not bad, "\n".join(bad)


def test_imports_point_down():
    """Own package, a lower layer, or SIDEWAYS; never up, never sideways unless the table says so."""
    bad = []
    for i in IMPORTS:
        src, dst = package(i.importer), package(i.target)
        if dst == "" or src == dst:  # the (empty) root package; a package's own modules
            continue
        ls, ld = LAYER_OF[src], LAYER_OF[dst]
        if (src, dst) in FORBIDDEN:
            bad.append(f"{_where(i)}: {i.importer} ({layer(i.importer)}) imports {i.target} ({layer(i.target)}): "
                       f"docs/design.md forbids {src}/ -> {dst}/")
        elif ld < ls:
            bad.append(f"{_where(i)}: upward import: {i.importer} (layer {layer(i.importer)}) imports {i.target} "
                       f"(layer {layer(i.target)}, above it)")
        elif ld == ls and dst not in SIDEWAYS.get(src, ()):
            bad.append(f"{_where(i)}: sideways import: {i.importer} (layer {layer(i.importer)}) imports {i.target} "
                       f"(layer {layer(i.target)}), which SIDEWAYS does not allow {src} to import")
    assert not bad, "imports against the layers of docs/design.md:\n" + "\n".join(bad)


def test_sideways_table_is_honest():
    """Each SIDEWAYS pair joins two packages of one layer, is used, and the pairs form no cycle
    (so no two packages of a layer import each other)."""
    used = {(package(i.importer), package(i.target)) for i in IMPORTS}
    for src, dsts in SIDEWAYS.items():
        for dst in dsts:
            assert LAYER_OF[src] == LAYER_OF[dst], f"SIDEWAYS {src} -> {dst}: not one layer; drop the entry"
            assert (src, dst) in used, f"SIDEWAYS {src} -> {dst}: no module of {src}/ imports {dst}/; drop the entry"
    cycle = _find_cycle({s: set(d) for s, d in SIDEWAYS.items()})
    assert cycle is None, f"SIDEWAYS has a cycle: {' -> '.join(cycle)}"


def _graph() -> dict[tuple[str, str], Import]:
    """(module, module it makes Python run) -> the import statement: its target and the target's
    packages (pfppo_mega/rewards/__init__.py runs before rewards/base.py), not the importer's own
    packages, which are already running."""
    edges: dict[tuple[str, str], Import] = {}
    for i in IMPORTS:
        own = {i.importer.rsplit(".", k)[0] for k in range(i.importer.count(".") + 1)}
        parts = i.target.split(".")
        for k in range(2, len(parts) + 1):
            m = ".".join(parts[:k])
            if m not in own and m in MODULES:
                edges.setdefault((i.importer, m), i)
    return edges


def _find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `g` (a path that starts and ends at one node), or None; depth first."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(g.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(g):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def _components(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of `g` with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(n: str) -> None:
        index[n] = low[n] = len(index)
        stack.append(n)
        for m in g.get(n, ()):
            if m not in index:
                visit(m)
                low[n] = min(low[n], low[m])
            elif m in stack:
                low[n] = min(low[n], index[m])
        if low[n] == index[n]:
            comp = []
            while True:
                m = stack.pop()
                comp.append(m)
                if m == n:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for n in sorted(g):
        if n not in index:
            visit(n)
    return out


def test_no_import_cycle():
    """Lazy imports count: a cycle closed inside a function is still two modules that need each
    other. Every cycle found is printed, one per group of modules that import each other."""
    edges = _graph()
    g: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        g[a].add(b)
    report = []
    for comp in _components(g):
        cycle = _find_cycle({n: g[n] & set(comp) for n in comp})
        report.append("import cycle:\n" + "\n".join(
            f"  {a} -> {b}  ({_where(edges[a, b])}: imports {edges[a, b].target})" for a, b in zip(cycle, cycle[1:])))
    assert not report, "\n".join(report)


# trainer/ in wings (docs/design.md, "The trainer's wings"): the step (the modules directly in trainer/)
# runs the phases and may use every wing; a wing is one concern the step calls into. A wing imports
# its own modules, the wings WING_IMPORTS names, and of the step only STEP_TYPES.
WINGS = ("asynchronous", "checkpoint", "colocation", "instruments")
WING_IMPORTS = {"asynchronous": {"colocation", "instruments"}, "checkpoint": set(), "colocation": {"instruments"},
                "instruments": set()}
# the typed batches, the seed streams, the Run the phases share, and the behaviour-policy protocol that
# the asynchronous wing implements
STEP_TYPES = {"batch", "seeds", "build", "behaviour"}


def wing(module: str) -> str | None:
    """pfppo_mega.trainer.colocation.offload -> colocation; pfppo_mega.trainer.loop -> step; else None."""
    parts = module.split(".")
    if parts[:2] != [PKG, "trainer"]:
        return None
    return parts[2] if len(parts) > 3 or (len(parts) == 3 and MODULES.get(module, (None, False))[1]) else "step"


def test_trainer_wings():
    folders = sorted({m.split(".")[2] for m in MODULES if wing(m) not in (None, "step")})
    assert folders == sorted(WINGS), f"trainer/ subpackages {folders}: add each to WINGS (docs/design.md)"
    bad = []
    for i in IMPORTS:
        src, dst = wing(i.importer), wing(i.target)
        if src in (None, "step") or dst is None or src == dst or dst in WING_IMPORTS[src]:
            continue
        if dst == "step" and i.target.split(".")[-1] in STEP_TYPES:
            continue
        bad.append(f"{_where(i)}: trainer wing {src}/ imports {i.target} ({dst})")
    assert not bad, "imports against the trainer's wings:\n" + "\n".join(bad)


def test_math_imports_only_math():
    """ppo/ imports the standard library, torch (nothing distributed) and constants; kernels/ adds
    ppo/, its own ops and the collectives of its thin autograd wrappers. Nothing above them."""
    bad = []
    for i in IMPORTS:
        pkg = package(i.importer)
        if pkg in PURE and package(i.target) not in PURE[pkg][0]:
            bad.append(f"{_where(i)}: {i.importer} imports {i.target}")
    for module, names in EXTERNAL.items():
        pkg = package(module)
        if pkg not in PURE:
            continue
        for name, line in names:
            top = name.split(".")[0]
            if top in sys.stdlib_module_names or top == "__future__":
                continue
            distributed = name == "torch.distributed" or name.startswith("torch.distributed.")
            if top != "torch" or (distributed and not PURE[pkg][1]):
                bad.append(f"{MODULES[module][0].relative_to(ROOT.parent)}:{line}: {module} imports {name}")
    assert not bad, "the math modules import beyond torch and themselves:\n" + "\n".join(bad)


RUNTIME_CHECK = r"""
import importlib, json, sys
layers, modules, first = (json.loads(a) for a in sys.argv[1:4])
skipped, bad = [], []


def load(names):
    for m in names:
        try:
            importlib.import_module(m)
        except ImportError as e:  # an optional dependency (vllm, transformer-engine) not installed
            if (e.name or "").startswith("pfppo_mega"):
                raise
            skipped.append(f"{m} ({e.name})")


def loaded(pkgs):
    return sorted(n for n in sys.modules if n.startswith("pfppo_mega.") and n.split(".")[1] in pkgs)


for k in range(len(layers) - 1, 0, -1):  # bottom layer first; the first layer that loads too much
    if first[k]:
        load(first[k])
        if loaded({"trainer", "tasks"}):
            bad.append(f"importing {first[k]} loaded {loaded({'trainer', 'tasks'})}")
    load(modules[k])
    above = loaded({p for _, pkgs in layers[:k] for p in pkgs})
    if above:
        bad.append(f"importing layer {layers[k][0]} ({', '.join(layers[k][1])}) loaded {above}, of layers above it")
    if bad:
        break
print(json.dumps({"bad": bad, "skipped": skipped}))
"""
# docs/design.md: models/ never imports a task; the built-in task is reached only through the builders
# (data.build_prompt_data, rewards.build_reward_fn): these load neither it nor the trainer.
NO_TASK = ("pfppo_mega.types", "pfppo_mega.tokenizer", "pfppo_mega.models.passes", "pfppo_mega.models.gpt",
           "pfppo_mega.models.hf_io", "pfppo_mega.data", "pfppo_mega.data.files", "pfppo_mega.rewards",
           "pfppo_mega.rewards.base", "pfppo_mega.rewards.custom")


def test_importing_a_layer_loads_nothing_above_it():
    """What the parse cannot see (importlib, a plug-in registry): a fresh interpreter imports the
    layers bottom up and, after each, has loaded no module of a layer above it; NO_TASK, imported
    first in its layer, has loaded neither the trainer nor a task. The commands (top) are not
    imported: __main__ runs the CLI."""
    layers = [[name, list(p)] for name, p in LAYERS]
    modules = [[m for m in sorted(MODULES) if m != PKG and LAYER_OF[package(m)] == k] for k in range(len(LAYERS))]
    first = [[m for m in NO_TASK if LAYER_OF[package(m)] == k] for k in range(len(LAYERS))]
    assert sorted(m for f in first for m in f) == sorted(NO_TASK) and all(m in MODULES for m in NO_TASK)
    out = subprocess.run([sys.executable, "-c", RUNTIME_CHECK, *map(json.dumps, (layers, modules, first))],
                         capture_output=True, text=True, timeout=600, cwd=ROOT.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if result["skipped"]:
        print("not importable here (an optional dependency missing), so not checked at run time:", result["skipped"])
    assert result["bad"] == [], "\n".join(result["bad"])
