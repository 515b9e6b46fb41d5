"""The worker process that runs a user's reward function (standard library only: a spawned
worker starts in well under a second and never loads torch unless the user's code does).

First the worker confines itself (pfppo_mega.rewards.sandbox: own session, killed with the trainer,
the run directory not writable, signals to the trainer refused), then imports the user's file.
Protocol over one pipe. The trainer sends pickles (its own data); the worker answers only in JSON
(send_bytes), so nothing the user's code puts on the pipe is ever unpickled in the trainer:
    ["started", pid] first (a worker that ends before it never ran this module: spawn failed);
    ["ready", [what the sandbox applied]] or ["fail", message], once; then for each request
    (nonce, kwargs) one answer [nonce, worker pid, kind, payload] with kind
    value   a float (a dict's "score" taken; bool / int read as numbers)
    raised  the exception's type and message
    type    the repr of a return value that is not a number (or a dict without a numeric "score")
A process the user's function forked that returns into this loop exits at once without
answering (its pid is not the worker's); the trainer also refuses an answer whose nonce or pid is
not the one it expects. A request of None ends the worker.
"""

from __future__ import annotations

import importlib.util
import faulthandler
import inspect
import json
import numbers
import os
import sys
from pathlib import Path
from typing import Any, Callable

# verl's custom_reward_function signature, called with these keywords.
ARG_NAMES = ("data_source", "solution_str", "ground_truth", "extra_info")
# verl's BatchRewardManager calls compute_score(data_sources=[...], solution_strs=[...], ...) instead
BATCH_ARG_NAMES = ("data_sources", "solution_strs", "ground_truths", "extra_infos")


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
        batch = ("; it has the batch reward manager's signature (lists in, a list out: verl's "
                 "reward_manager batch), but here it is called once per sample"
                 if set(BATCH_ARG_NAMES) & set(sig.parameters) else "")
        raise CustomFunctionError(
            f"{where}: signature {name}{sig} cannot be called as "
            f"{name}({', '.join(f'{k}=...' for k in ARG_NAMES)}) ({e}){batch}; it must take verl's "
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


def send(conn, message: list) -> None:
    """One JSON message (floats' inf / nan as JSON's Infinity / NaN)."""
    conn.send_bytes(json.dumps(message).encode())


class _StartLog:
    """While the worker starts, its stderr (fd 2) goes to the file the trainer named, so that a
    worker that dies at start (a crash in an extension the user's file imports, os._exit after a
    message, a traceback in the sandbox) is refused with its last lines; faulthandler dumps the
    Python stack of a crash (SIGSEGV, SIGABRT, ...) there. Once ready, what was written is passed on
    to the real stderr and fd 2 restored (faulthandler then writes to the real stderr)."""

    def __init__(self, path: str | None):
        self.saved = None
        if path is None:
            return
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        sys.stderr.flush()
        self.saved = os.dup(2)
        os.dup2(fd, 2)
        os.close(fd)
        self.path = path
        faulthandler.enable(file=sys.stderr)

    def done(self) -> None:
        if self.saved is None:
            return
        sys.stderr.flush()
        os.dup2(self.saved, 2)
        os.close(self.saved)
        with open(self.path, "rb") as f:
            written = f.read()
        if written:
            os.write(2, written)


def main(conn, path: str, name: str, protected: tuple[str, ...] = (), landlock: bool = True,
         start_log: str | None = None) -> None:
    """The worker process's entry point."""
    send(conn, ["started", os.getpid()])
    log = _StartLog(start_log)
    from pfppo_mega.rewards import sandbox

    notes = sandbox.enter(list(protected), landlock=landlock)
    try:
        fn = load_function(path, name)
    except CustomFunctionError as e:
        log.done()
        send(conn, ["fail", str(e)])
        return
    log.done()
    send(conn, ["ready", notes])
    me = os.getpid()
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        nonce, kwargs = msg
        try:
            kind, payload = as_score(fn(**kwargs))
        except BaseException as e:  # anything user code raises is a counted outcome, SystemExit too
            kind, payload = "raised", f"{type(e).__name__}: {e}"[:500]
        if os.getpid() != me:  # a child the function forked came back here: only the worker answers
            os._exit(0)
        try:
            send(conn, [nonce, me, kind, payload])
        except (EOFError, OSError, BrokenPipeError):
            sys.exit(0)
