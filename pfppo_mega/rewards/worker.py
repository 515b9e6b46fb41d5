"""The worker process that runs a user's reward function (standard library only: a spawned
worker starts in well under a second and never loads torch unless the user's code does).

Protocol over one pipe: the worker sends ("ready", None) or ("fail", message) once; then for
each request (index, kwargs) it answers (index, kind, payload) with kind
    value   a float (a dict's "score" taken; bool / int read as numbers)
    raised  the exception's type and message
    type    the repr of a return value that is not a number (or a dict without a numeric "score")
A request of None ends the worker.
"""

from __future__ import annotations

import importlib.util
import inspect
import numbers
import sys
from pathlib import Path
from typing import Any, Callable

# verl's custom_reward_function signature, called with these keywords.
ARG_NAMES = ("data_source", "solution_str", "ground_truth", "extra_info")


class CustomFunctionError(ValueError):
    """The custom reward function cannot be used; the message names the file, the name and why."""


def load_function(path: str, name: str) -> Callable[..., Any]:
    """Import `name` from the Python file `path` and check that it accepts verl's four arguments."""
    where = f"reward.custom_function: {name!r} in {path!r}"
    p = Path(path)
    if not p.is_file():
        raise CustomFunctionError(f"{where}: no such file")
    spec = importlib.util.spec_from_file_location(f"pfppo_custom_reward_{p.stem}", p)
    if spec is None or spec.loader is None:
        raise CustomFunctionError(f"{where}: not importable as a Python module (needs a .py file)")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except BaseException as e:  # the user's module may raise anything at import, SystemExit included
        raise CustomFunctionError(f"{where}: importing the file raised {type(e).__name__}: {e}") from None
    fn = getattr(module, name, None)
    if fn is None:
        defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise CustomFunctionError(f"{where}: the file defines no {name!r} (callables found: {defined})")
    if not callable(fn):
        raise CustomFunctionError(f"{where}: {name!r} is a {type(fn).__name__}, not a function")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without introspectable signature: try it at run time
        return fn
    try:
        sig.bind(**{k: None for k in ARG_NAMES})
    except TypeError as e:
        raise CustomFunctionError(
            f"{where}: signature {name}{sig} cannot be called as "
            f"{name}({', '.join(f'{k}=...' for k in ARG_NAMES)}) ({e}); it must take verl's "
            f"(data_source, solution_str, ground_truth, extra_info) and return a float or a dict "
            f"with a 'score'") from None
    return fn


def as_score(value: Any) -> tuple[str, Any]:
    """("value", float) for a number or a dict with a numeric "score"; else ("type", repr)."""
    if isinstance(value, dict) and "score" in value:
        value = value["score"]
    if not isinstance(value, numbers.Real) and callable(getattr(value, "item", None)):
        try:  # a 1-element numpy / torch value
            value = value.item()
        except Exception:  # its .item() refused (more than one element): not a number
            pass
    if isinstance(value, numbers.Real):
        return "value", float(value)
    return "type", repr(value)[:200]


def main(conn, path: str, name: str) -> None:  # the worker process's entry point
    try:
        fn = load_function(path, name)
    except CustomFunctionError as e:
        conn.send(("fail", str(e)))
        return
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        index, kwargs = msg
        try:
            kind, payload = as_score(fn(**kwargs))
        except BaseException as e:  # anything user code raises is a counted outcome, SystemExit too
            kind, payload = "raised", f"{type(e).__name__}: {e}"[:500]
        try:
            conn.send((index, kind, payload))
        except (EOFError, OSError, BrokenPipeError):
            sys.exit(0)
