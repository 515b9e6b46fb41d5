"""verl's tool and interaction config files, read into our tools and interactions.

A tool config file (verl's ``multi_turn.tool_config_path``)::

    tools:
      - class_name: verl.tools.gsm8k_tool.Gsm8kTool      # or module.Class of your own
        config: {type: native, ...}                      # the tool's keys; type native (mcp is refused)
        tool_schema:                                     # OpenAI function schema; its name is the tool's
          type: function
          function: {name: calc_gsm8k_reward, description: ..., parameters: {type: object, properties: {...}, required: [...]}}

An interaction config file (verl's ``multi_turn.interaction_config_path``)::

    interaction:
      - name: gsm8k                                      # optional: else the class name, less "Interaction", lower case
        class_name: verl.interactions.gsm8k_interaction.Gsm8kInteraction
        config: {}

Classes:
    verl's built-ins map onto ours (BUILTIN_TOOLS, BUILTIN_INTERACTIONS; their config keys are
    checked: unknown keys, wrong types and out-of-range values refused); verl classes that need
    what is not here are refused by name with the reason (REFUSED_CLASSES).
    ``module.Class`` of your own (importable from the working directory / PYTHONPATH) is built as
    ``Class(config=<config dict>, tool_schema=<schema dict>)`` (an interaction: ``Class(config=...)``,
    with ``config["name"]`` set) and must have ``create``, ``execute``, ``release`` (an interaction:
    ``start``, ``respond``, ``finish``, or verl's ``start_interaction``, ``generate_response``,
    ``finalize_interaction``). Methods may be ``async def`` (verl's style): they then run on one
    event loop in a thread of its own. ``execute`` may return a ToolResult, a string, or verl's
    ``(response, reward, metrics)`` (response a string or an object with ``.text``; images or videos
    are refused at the call; metrics that are not numbers are dropped); ``respond`` an
    InteractionTurn or verl's ``(terminate, text, score, metrics)``. A class that subclasses verl's
    BaseTool / BaseInteraction needs verl, which is not installed here: refused by name.
    verl's ``calc_reward`` (a tool's end-of-row reward) is not called; tools reward per call
    (ToolResult.reward).

Every problem raises ToolSetupError naming the file, the entry, the key, the value and what is
allowed. ``validate_tool_config`` / ``validate_interaction_config`` do every check that needs no
instance (parse, structure, schema, class resolution, built-in config keys; no network) for the
config loader; ``load_tools`` / ``load_interactions`` then build.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from pfppo_mega.rollout.tools.base import Interaction, InteractionTurn, Tool, ToolResult, ToolSetupError
from pfppo_mega.rollout.tools.options import Opt

# verl's class name -> ours (module, class), imported when used.
BUILTIN_TOOLS: dict[str, tuple[str, str]] = {
    "verl.tools.gsm8k_tool.Gsm8kTool": ("pfppo_mega.rollout.tools.answers", "Gsm8kTool"),
    "verl.tools.geo3k_tool.Geo3kTool": ("pfppo_mega.rollout.tools.answers", "Geo3kTool"),
    "verl.tools.search_tool.SearchTool": ("pfppo_mega.rollout.tools.search", "SearchTool"),
    "verl.tools.sandbox_fusion_tools.SandboxFusionTool": ("pfppo_mega.rollout.tools.code", "SandboxFusionTool"),
}
BUILTIN_INTERACTIONS: dict[str, tuple[str, str]] = {
    "verl.interactions.gsm8k_interaction.Gsm8kInteraction": ("pfppo_mega.rollout.tools.answers", "Gsm8kInteraction"),
}
_MCP = ("an MCP tool (tools listed by MCP servers and called through an MCP client session) is not available here; "
        "write the tool as a class with create/execute/release that calls the service itself")
REFUSED_CLASSES: dict[str, str] = {
    "verl.tools.mcp_base_tool.MCPBaseTool": _MCP,
    "verl.tools.mcp_search_tool.MCPSearchTool": _MCP,
    "verl.tools.image_zoom_in_tool.ImageZoomInTool": (
        "answers with an image (multimodal tool responses); multi-turn rollouts here are text only"),
    "verl.tools.base_tool.BaseTool": "verl's base class answers every call with a fixed text; name a tool class",
    "verl.interactions.base.BaseInteraction": (
        "verl's base class answers every turn with a fixed text and score 0.8; name an interaction class"),
    "verl.interactions.weather_interaction.WeatherInteraction": (
        "verl's weather demo (it echoes a fixed reply) is not provided here; write your own interaction class"),
}
TOOL_ENTRY_KEYS = ("class_name", "config", "tool_schema", "mcp")
INTERACTION_ENTRY_KEYS = ("name", "class_name", "config")
TOOL_METHODS = ("create", "execute", "release")
INTERACTION_METHODS = (("start", "respond", "finish"),
                       ("start_interaction", "generate_response", "finalize_interaction"))  # ours, verl's
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names


@dataclass(frozen=True)
class _Entry:
    where: str                       # "<file>: tools[i] (<name>)", for messages
    cls: type
    builtin: bool
    config: dict[str, Any]
    schema: dict[str, Any] | None    # tools only
    name: str


def _fail(where: str, key: str, value: Any, rule: str) -> ToolSetupError:
    shown = repr(value)
    return ToolSetupError(f"{where}: {key} = {shown[:120]}{'...' if len(shown) > 120 else ''}: {rule}")


def _read(path: str | Path, top: str) -> list[Any]:
    import yaml
    p = Path(path)
    if not p.is_file():
        raise ToolSetupError(f"{path}: no such file (the {top} config file)")
    try:
        doc = yaml.safe_load(p.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ToolSetupError(f"{path}: not YAML: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if not isinstance(doc, dict) or top not in doc:
        keys = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
        raise ToolSetupError(f"{path}: needs a top-level '{top}:' list; found {keys}")
    entries = doc[top]
    if not isinstance(entries, list):
        raise _fail(str(path), top, entries, "must be a list of entries")
    extra = sorted(set(doc) - {top})
    if extra:
        raise _fail(str(path), extra[0], doc[extra[0]], f"unknown top-level key; allowed: {top}")
    return entries


def _resolve(where: str, class_name: Any, builtins: dict[str, tuple[str, str]]) -> tuple[type, bool]:
    if not isinstance(class_name, str) or "." not in class_name or not all(
            part.isidentifier() for part in class_name.split(".")):
        raise _fail(where, "class_name", class_name, "must be a dotted Python name, module.Class; verl's built-ins: "
                    f"{sorted(builtins)}")
    if class_name in REFUSED_CLASSES:
        raise _fail(where, "class_name", class_name, f"refused: {REFUSED_CLASSES[class_name]}")
    if class_name in builtins:
        module, name = builtins[class_name]
        return getattr(importlib.import_module(module), name), True
    module_name, _, name = class_name.rpartition(".")
    if module_name == "verl" or module_name.startswith("verl."):
        raise _fail(where, "class_name", class_name, f"not a verl class provided here; provided: {sorted(builtins)}; "
                    f"refused with a reason: {sorted(REFUSED_CLASSES)}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (e.name == "verl" or e.name.startswith("verl.")):
            raise _fail(where, "class_name", class_name, f"its module imports {e.name}, and verl is not installed "
                        "here (a subclass of verl's BaseTool / BaseInteraction): write the class without verl, with "
                        "the methods of pfppo_mega/rollout/tools/base.py (sync or async)") from None
        raise _fail(where, "class_name", class_name, f"module {module_name!r} cannot be imported ({e}); it must be "
                    "importable from the working directory or PYTHONPATH") from None
    except Exception as e:  # the user's module failed while importing
        raise _fail(where, "class_name", class_name, f"importing {module_name!r} raised {type(e).__name__}: {e}") from None
    cls = getattr(module, name, None)
    builtin = any(cls is getattr(importlib.import_module(m), n) for m, n in builtins.values())
    if not isinstance(cls, type):
        raise _fail(where, "class_name", class_name, f"module {module_name!r} has no class {name!r}")
    return cls, builtin


def _check_config(where: str, config: Any, cls: type, builtin: bool, *, tool: bool) -> dict[str, Any]:
    if config is None and not tool:
        return {}
    if not isinstance(config, dict):
        raise _fail(where, "config", config, "must be a mapping" + (" with type: native" if tool else ""))
    config = dict(config)
    if tool:
        kind = config.pop("type", None)
        if kind == "mcp":
            raise _fail(where, "config.type", kind, f"refused: {_MCP}")
        if kind != "native":
            raise _fail(where, "config.type", kind, "allowed: native (verl's mcp is refused)")
    if not builtin:
        return config
    opts: dict[str, Opt] = cls.CONFIG
    for key, value in config.items():
        if key not in opts:
            raise _fail(where, f"config.{key}", value, f"unknown key of {cls.__name__}; allowed: "
                        f"{(['type'] if tool else []) + sorted(opts)}")
        bad = opts[key].problem(value)
        if bad:
            raise _fail(where, f"config.{key}", value, f"{bad}; allowed: {opts[key].allowed()}")
    missing = [k for k, o in opts.items() if o.default is None and k not in config]
    if missing:
        raise _fail(where, f"config.{missing[0]}", None, f"required by {cls.__name__}; allowed: {opts[missing[0]].allowed()}")
    return config


def _check_schema(where: str, schema: Any) -> str:
    """The tool's name, from a schema verl would accept (its pydantic model's required fields)."""
    if not isinstance(schema, dict):
        raise _fail(where, "tool_schema", schema, "must be a mapping {type: function, function: {name, description, "
                    "parameters}}")
    if schema.get("type") != "function":
        raise _fail(where, "tool_schema.type", schema.get("type"), "allowed: function")
    fn = schema.get("function")
    if not isinstance(fn, dict):
        raise _fail(where, "tool_schema.function", fn, "must be a mapping with name, description, parameters")
    name = fn.get("name")
    if not isinstance(name, str) or not _TOOL_NAME.match(name):
        raise _fail(where, "tool_schema.function.name", name, "must be a name of 1-64 letters, digits, _ or -")
    if not isinstance(fn.get("description"), str):
        raise _fail(where, "tool_schema.function.description", fn.get("description"), "must be a string")
    params = fn.get("parameters", {"type": "object", "properties": {}, "required": []})
    if not isinstance(params, dict):
        raise _fail(where, "tool_schema.function.parameters", params, "must be a mapping {type, properties, required}")
    props = params.get("properties")
    if not isinstance(params.get("type"), str):
        raise _fail(where, "tool_schema.function.parameters.type", params.get("type"), "must be a string (object)")
    if not isinstance(props, dict):
        raise _fail(where, "tool_schema.function.parameters.properties", props, "must be a mapping name -> {type, ...}")
    for pname, prop in props.items():
        if not isinstance(prop, dict) or not isinstance(prop.get("type"), str):
            raise _fail(where, f"tool_schema.function.parameters.properties.{pname}", prop,
                        "must be a mapping with a string 'type'")
    required = params.get("required")
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise _fail(where, "tool_schema.function.parameters.required", required, "must be a list of parameter names")
    unknown = [r for r in required if r not in props]
    if unknown:
        raise _fail(where, "tool_schema.function.parameters.required", required,
                    f"names {unknown}, not among the properties {sorted(props)}")
    return name


def _raw_entries(path: str | Path, top: str, keys: tuple[str, ...]) -> list[tuple[str, dict[str, Any]]]:
    """(where, entry) of each entry of a file: a mapping with no key outside ``keys``."""
    out = []
    for i, raw in enumerate(_read(path, top)):
        where = f"{path}: {top}[{i}]"
        if not isinstance(raw, dict):
            raise _fail(where, "entry", raw, f"must be a mapping with keys among {list(keys)}")
        unknown = sorted(set(raw) - set(keys))
        if unknown:
            raise _fail(where, unknown[0], raw[unknown[0]], f"unknown key; allowed: {list(keys)}")
        out.append((where, raw))
    return out


def _unique(entries: list[_Entry], key: str) -> list[_Entry]:
    seen: dict[str, str] = {}
    for e in entries:
        if e.name in seen:
            raise _fail(e.where, key, e.name, f"duplicate: {seen[e.name]} has it too; each needs its own name")
        seen[e.name] = e.where
    return entries


def _tool_entries(path: str | Path) -> list[_Entry]:
    out: list[_Entry] = []
    for where, raw in _raw_entries(path, "tools", TOOL_ENTRY_KEYS):
        cls, builtin = _resolve(where, raw.get("class_name"), BUILTIN_TOOLS)
        config = _check_config(where, raw.get("config"), cls, builtin, tool=True)
        if raw.get("tool_schema") is None:
            raise _fail(where, "tool_schema", None, "required: the OpenAI function schema the policy sees")
        name = _check_schema(where, raw["tool_schema"])
        out.append(_Entry(f"{where} ({name})", cls, builtin, config, raw["tool_schema"], name))
    return _unique(out, "tool_schema.function.name")


def _interaction_entries(path: str | Path) -> list[_Entry]:
    out: list[_Entry] = []
    for where, raw in _raw_entries(path, "interaction", INTERACTION_ENTRY_KEYS):
        cls, builtin = _resolve(where, raw.get("class_name"), BUILTIN_INTERACTIONS)
        name = raw.get("name")
        if name is None:  # verl's default: the class name less "Interaction", lower case
            short = raw["class_name"].rsplit(".", 1)[1]
            name = (short[:-len("Interaction")] if short.endswith("Interaction") else short).lower()
        if not isinstance(name, str) or not name:
            raise _fail(where, "name", name, "must be a non-empty string")
        config = _check_config(where, raw.get("config"), cls, builtin, tool=False)
        out.append(_Entry(f"{where} ({name})", cls, builtin, config, None, name))
    return _unique(out, "name")


def validate_tool_config(path: str | Path) -> list[str]:
    """The tool names a tool config file defines, after every check that builds nothing (module
    docstring); ToolSetupError otherwise."""
    return [e.name for e in _tool_entries(path)]


def validate_interaction_config(path: str | Path) -> list[str]:
    """The interaction names an interaction config file defines, checked as validate_tool_config does."""
    return [e.name for e in _interaction_entries(path)]


def load_tools(path: str | Path) -> dict[str, Tool]:
    """name -> tool, for every entry of a tool config file."""
    out: dict[str, Tool] = {}
    for e in _tool_entries(path):
        obj = _build(e, lambda: e.cls(config=dict(e.config), tool_schema=e.schema))
        out[e.name] = obj if e.builtin else _UserTool(e, obj)
    return out


def load_interactions(path: str | Path) -> dict[str, Interaction]:
    """name -> interaction, for every entry of an interaction config file."""
    out: dict[str, Interaction] = {}
    for e in _interaction_entries(path):
        obj = _build(e, lambda: e.cls(config={**e.config, "name": e.name}))
        out[e.name] = obj if e.builtin else _UserInteraction(e, obj)
    return out


def _build(e: _Entry, make: Callable[[], Any]) -> Any:
    try:
        return make()
    except ToolSetupError:
        raise
    except Exception as exc:  # the class's own constructor refused its config
        raise ToolSetupError(f"{e.where}: building {e.cls.__module__}.{e.cls.__qualname__}(config=...) raised "
                             f"{type(exc).__name__}: {exc}") from None


# ----------------------------------------------------------------------------- user classes

_loop_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None


def _run(value: Any) -> Any:
    """A method's result: awaited on the shared event loop (its own daemon thread) when it is a
    coroutine, else as it is."""
    global _loop
    if not inspect.isawaitable(value):
        return value
    with _loop_lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="pfppo-tool-loop", daemon=True).start()
    return asyncio.run_coroutine_threadsafe(_as_coroutine(value), _loop).result()


async def _as_coroutine(awaitable: Any) -> Any:
    return await awaitable


def _methods(e: _Entry, obj: Any, names: tuple[str, ...]) -> None:
    missing = [n for n in names if not callable(getattr(obj, n, None))]
    if missing:
        raise ToolSetupError(f"{e.where}: {e.cls.__module__}.{e.cls.__qualname__} has no method {missing}; a "
                             f"{'tool' if e.schema is not None else 'interaction'} needs {list(names)} "
                             "(pfppo_mega/rollout/tools/base.py; sync or async)")


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class _UserTool:
    """A user's tool class behind our Tool protocol (name and schema from the file)."""

    def __init__(self, e: _Entry, obj: Any):
        _methods(e, obj, TOOL_METHODS)
        self.name, self.schema, self._obj, self._where = e.name, e.schema, obj, e.where

    def create(self, instance_id: str, **create_kwargs: Any) -> None:
        _run(self._obj.create(instance_id, **create_kwargs))

    def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        out = _run(self._obj.execute(instance_id, arguments))
        if isinstance(out, ToolResult):
            return out
        if isinstance(out, str):
            return ToolResult(out)
        if isinstance(out, tuple) and len(out) == 3:
            response, reward, metrics = out
            if getattr(response, "image", None) or getattr(response, "video", None):
                raise ValueError(f"tool {self.name!r} answered with images or videos; multi-turn rollouts here are "
                                 "text only")
            text = response if isinstance(response, str) else getattr(response, "text", None)
            if reward is not None and not _number(reward):
                raise TypeError(f"tool {self.name!r}: execute's reward {reward!r} is not a finite number or None")
            kept = {k: float(v) for k, v in (metrics or {}).items() if _number(v)} if isinstance(metrics, dict) else {}
            return ToolResult("" if text is None else str(text), None if reward is None else float(reward), kept)
        raise TypeError(f"tool {self.name!r}: execute returned {type(out).__name__}; expected a ToolResult, a string "
                        "or verl's (response, reward, metrics)")

    def release(self, instance_id: str) -> None:
        _run(self._obj.release(instance_id))


class _UserInteraction:
    """A user's interaction class (our method names or verl's) behind our Interaction protocol."""

    def __init__(self, e: _Entry, obj: Any):
        ours, verls = INTERACTION_METHODS
        names = ours if all(callable(getattr(obj, n, None)) for n in ours) else verls
        _methods(e, obj, names)
        self.name, self._obj = e.name, obj
        self._start, self._respond, self._finish = (getattr(obj, n) for n in names)

    def start(self, instance_id: str, **kwargs: Any) -> None:
        _run(self._start(instance_id, **kwargs))

    def respond(self, instance_id: str, messages: list[dict[str, Any]]) -> InteractionTurn:
        out = _run(self._respond(instance_id, messages))
        if isinstance(out, InteractionTurn):
            return out
        if isinstance(out, tuple) and len(out) == 4 and isinstance(out[0], bool) and _number(out[2]):
            metrics = {k: float(v) for k, v in out[3].items() if _number(v)} if isinstance(out[3], dict) else {}
            return InteractionTurn(out[0], "" if out[1] is None else str(out[1]), float(out[2]), metrics)
        raise TypeError(f"interaction {self.name!r}: respond returned {str(out)[:80]!r}; expected an InteractionTurn "
                        "or verl's (terminate: bool, text, score: number, metrics)")

    def finish(self, instance_id: str) -> None:
        params = inspect.signature(self._finish).parameters
        _run(self._finish(instance_id) if params else self._finish())
