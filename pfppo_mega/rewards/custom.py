"""A user's reward function (verl's `custom_reward_function`) run in worker processes.

`reward.num_workers` spawned processes each import the user's file once (pfppo_mega.rewards.worker)
and score one sample at a time. The parent hands samples out as workers free up and waits on the
pipes with the earliest deadline: a call running past `reward.timeout_s` has its worker killed
and replaced and scores 0 (guard/reward_timeouts); an exception or a return value that is not a
number scores 0 (guard/reward_errors); a worker that dies (segfault, os._exit, a signal) is
replaced and its sample counted as an error. The user's file is imported at start in a worker,
never in the trainer: an import error or a wrong signature is refused then, with the file and
function named.

What the user's code cannot do to the trainer (the worker's side: pfppo_mega.rewards.sandbox):
    answer for another row   every request carries a fresh nonce; an answer must repeat it and come
                             from the worker's pid, as JSON (never a pickle). Anything else (a forked
                             child writing to the pipe, a second answer, garbage) is refused: the row
                             counts in guard/reward_errors, the worker is replaced.
    kill the trainer         the worker has its own session (killpg of its group reaches only it);
                             where landlock scopes signals the kernel refuses the rest; a SIGTERM that
                             reaches the trainer while a call runs is named on stderr before the
                             trainer ends as SIGTERM asks.
    write the run directory  refused by landlock where the kernel has it; always checked: the run
                             directory's files (size, mtime, inode) are compared before and after
                             every call, and a change stops the run with RunDirectoryWritten naming
                             the files. Left out of that check: tensorboard/ and checkpoints/ (the
                             trainer's background threads write them; a checkpoint's files are
                             sha256-checked against its manifest when loaded).
    outlive the trainer      close() asks each worker to stop, waits `CLOSE_GRACE_S`, then SIGKILLs
                             the worker's whole tree (its descendants and its session); it runs on
                             success, on failure (the trainer's close, cli), at interpreter exit
                             (before multiprocessing's own atexit join, which would wait forever on a
                             worker that ignores SIGTERM) and when the workers' parent dies
                             (PDEATHSIG).
"""

from __future__ import annotations

import atexit
import json
import multiprocessing as mp
import os
import re
import secrets
import signal
import sys
import tempfile
import threading
import time
import weakref
from collections import deque
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Callable, Sequence

from pfppo_mega.rewards import worker as _worker
from pfppo_mega.rewards.base import OutcomeLog, RewardSetupError, result_of
from pfppo_mega.types import RewardResult, Sample

START_TIMEOUT_S = 120.0  # a worker's interpreter start + the user's imports
CLOSE_GRACE_S = 2.0      # a worker asked to stop has this long before its tree is SIGKILLed
MAX_ANSWER_BYTES = 1 << 16
WATCH_SKIP = ("tensorboard", "checkpoints")  # written by the trainer's background threads; checkpoints
# are sha256-verified against their manifest at load (a tampered one is refused)
WATCH_MAX_FILES = 20000


class RunDirectoryWritten(RuntimeError):
    """Files of the run directory changed while the custom reward function ran (the trainer writes
    none during a call): the run's records cannot be trusted, it stops; the message names them."""


def _exit_reason(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _processes() -> dict[int, tuple[int, int]]:
    """pid -> (ppid, session) of every process, from Linux /proc ({} elsewhere)."""
    out: dict[int, tuple[int, int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state ppid pgrp session
        out[int(name)] = (int(fields[1]), int(fields[3]))
    return out


def _tree(root: int, *, descendants: bool) -> list[int]:
    """The processes of the session `root` leads (a double-forked child is no descendant any more
    but stays in the session unless it setsid()s) and, with `descendants`, root's descendants.
    Session ids are safe to use after root is reaped (Linux never reuses a pid that is still a
    session id); parent links are not, so `descendants` only while root is unreaped."""
    procs = _processes()
    out = {p for p, (_, sid) in procs.items() if sid == root}
    frontier = [root] if descendants else []
    while frontier:
        parent = frontier.pop()
        kids = [p for p, (pp, _) in procs.items() if pp == parent and p not in out]
        out.update(kids)
        frontier += kids
    out.discard(root)
    return sorted(out)


def _sigkill(pids) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def kill_tree(proc) -> None:
    """SIGKILL a worker (a multiprocessing.Process) and its tree (see _tree); twice, to catch
    children forked meanwhile. The worker's own pid only while it is unreaped (exitcode None), so
    a pid reused by another process is never signalled."""
    pid = proc.pid
    if pid is None:
        return
    for _ in range(2):
        alive = proc.exitcode is None  # reaps it if it has exited: then only its session is swept
        _sigkill(([pid] if alive else []) + _tree(pid, descendants=alive))


def snapshot(root: Path | None) -> dict[str, tuple[int, int, int]]:
    """relative path -> (size, mtime_ns, inode) of the files under `root` (WATCH_SKIP left out)."""
    out: dict[str, tuple[int, int, int]] = {}
    if root is None or not root.is_dir():
        return out
    for d, dirs, files in os.walk(root):
        if d == str(root):
            dirs[:] = [x for x in dirs if x not in WATCH_SKIP]
        for f in files:
            p = os.path.join(d, f)
            try:
                st = os.lstat(p)
            except OSError:
                continue
            out[os.path.relpath(p, root)] = (st.st_size, st.st_mtime_ns, st.st_ino)
            if len(out) >= WATCH_MAX_FILES:
                return out
    return out


def changes(before: dict, after: dict) -> list[str]:
    """What differs between two snapshots, in words (at most 5 files)."""
    out = []
    for k in sorted(set(before) | set(after)):
        b, a = before.get(k), after.get(k)
        if b == a:
            continue
        out.append(f"{k} (created, {a[0]} bytes)" if b is None else f"{k} (deleted)" if a is None
                   else f"{k} (size {b[0]} -> {a[0]} bytes{', replaced' if a[2] != b[2] else ''})")
    return out[:5] + ([f"... {len(out) - 5} more"] if len(out) > 5 else [])


class _Proc:
    def __init__(self, ctx, path: str, name: str, protected: tuple[str, ...], landlock: bool):
        self.conn, child = ctx.Pipe()
        fd, self.start_log = tempfile.mkstemp(prefix="pfppo-reward-worker-", suffix=".stderr")
        os.close(fd)
        self.proc = ctx.Process(target=_worker.main, args=(child, path, name, protected, landlock, self.start_log),
                                daemon=True)
        self.proc.start()
        child.close()
        self.where = f"reward.custom_function: {name!r} in {path!r}"
        self.task: int | None = None     # sample index in flight
        self.nonce = ""                  # the request's, which its answer must repeat
        self.deadline = 0.0
        self.notes: list[str] = []       # what the worker's sandbox applied

    def recv(self) -> Any:
        """One JSON message, or ValueError / EOFError / OSError."""
        return json.loads(self.conn.recv_bytes(MAX_ANSWER_BYTES))

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        try:
            self._next_at_start(deadline, timeout, started=False)              # ["started", pid]
            kind, msg = self._next_at_start(deadline, timeout, started=True)   # ["ready" | "fail", ...]
        finally:
            _remove(self.start_log)
        if kind != "ready":
            self.kill()
            raise RewardSetupError(msg)
        self.notes = list(msg)

    def _next_at_start(self, deadline: float, timeout: float, *, started: bool) -> list:
        """The worker's next message at start; a worker silent until ``deadline``, or one that ends
        first, is refused with what is known of why (its exit, its last lines on stderr)."""
        if not self.conn.poll(max(0.0, deadline - time.monotonic())):
            tail = _tail(self.start_log)
            self.kill()
            raise RewardSetupError(f"{self.where}: the reward worker did not start within {timeout:.0f} s "
                                   f"(importing the file hangs?){tail}")
        try:
            return self.recv()
        except (EOFError, OSError, ValueError, TypeError):
            self.proc.join(5)
            code = self.proc.exitcode
            tail = _tail(self.start_log)
            self.kill()
        if not started:
            raise RewardSetupError(
                f"{self.where}: the reward worker process ended ({_exit_reason(code)}) before it ran any of "
                f"pfppo's worker code: Python's multiprocessing (spawn) could not start it and the file was never "
                f"imported. Spawn re-imports the trainer's main script; one that starts training when imported "
                f"(no `if __name__ == '__main__':` guard) fails so. Its traceback is on the trainer's stderr above")
        raise RewardSetupError(f"{self.where}: the reward worker exited at start ({_exit_reason(code)}) while "
                               f"importing the file (os._exit, a crash or a signal at import time)"
                               f"{tail or '; it wrote nothing on stderr'}")

    def send(self, index: int, request: dict, timeout_s: float) -> None:
        self.nonce = secrets.token_hex(8)
        self.conn.send((self.nonce, request))
        self.task, self.deadline = index, time.monotonic() + timeout_s

    def answer(self) -> tuple[str, Any]:
        """The in-flight request's (kind, payload); ("died", why) when the message is not its answer."""
        try:
            msg = self.recv()
        except (EOFError, OSError):
            raise
        except (ValueError, TypeError) as e:
            return "died", f"the worker's pipe carried something that is not an answer ({type(e).__name__}); " \
                           f"the worker is replaced"
        ok = isinstance(msg, list) and len(msg) == 4 and msg[0] == self.nonce and msg[1] == self.proc.pid
        if not ok or msg[2] not in ("value", "raised", "type") or \
                (msg[2] == "value" and not isinstance(msg[3], (int, float))):
            sender = msg[1] if isinstance(msg, list) and len(msg) > 1 else "?"
            return "died", f"an answer not from the worker for this row (pid {sender}, worker {self.proc.pid}: a " \
                           f"process the function forked wrote to the pipe?); the worker is replaced"
        return msg[2], msg[3]

    def kill(self) -> None:
        kill_tree(self.proc)
        self.proc.join(5)
        self.conn.close()
        _remove(self.start_log)


TAIL_LINES = 12       # of a worker's stderr at start, quoted when it dies there
TAIL_BYTES = 4000
# lines of a faulthandler dump that name no user code (the spawn and import machinery, this worker)
_NOISE = re.compile(r'^\s*(File "(<string>|<frozen importlib[^"]*|[^"]*/multiprocessing/[^"]*|[^"]*/pfppo_mega/rewards/'
                    r'worker\.py)"|Extension modules:)')


def _tail(path: str) -> str:
    """'; its last lines on stderr:\n  ...' of what a starting worker wrote ('' if nothing)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - TAIL_BYTES))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    lines = [x.rstrip() for x in text.splitlines() if x.strip() and not _NOISE.search(x)][-TAIL_LINES:]
    return "; its last lines on stderr:\n  " + "\n  ".join(lines) if lines else ""


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


_LIVE: "weakref.WeakSet[CustomReward]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """At interpreter exit, before multiprocessing's atexit join (registered earlier, runs later):
    that join has no timeout and waits forever on a worker that ignores SIGTERM."""
    for r in list(_LIVE):
        r.close()


class CustomReward:
    def __init__(self, path: str, name: str, *, num_workers: int, timeout_s: float,
                 run_dir: str | Path | None = None, landlock: bool = True, log: Callable[[str], None] = print):
        if not Path(path).is_file():  # before starting processes; the worker checks the rest
            raise RewardSetupError(f"reward.custom_function: {name!r} in {path!r}: no such file")
        self.path, self.name, self.timeout_s = path, name, timeout_s
        self.where = f"reward.custom_function: {name!r} in {path!r}"
        self.run_dir = None if run_dir is None else Path(run_dir)
        self.outcomes = OutcomeLog(log, f"custom reward {name!r} ({path})")
        self._ctx = mp.get_context("spawn")  # fork would copy the trainer's threads and CUDA state
        self._protected = () if self.run_dir is None else (str(self.run_dir),)
        self._landlock = landlock  # False: only the trainer's own checks (tests; kernels without it)
        self._procs: list[_Proc] = []
        _LIVE.add(self)
        try:
            for _ in range(num_workers):
                self._procs.append(_Proc(self._ctx, path, name, self._protected, self._landlock))
            for p in self._procs:
                p.wait_ready(START_TIMEOUT_S)
        except RewardSetupError:
            self.close()
            raise
        if self._procs:
            log(f"[pfppo] custom reward {name!r}: {num_workers} worker(s), each: {'; '.join(self._procs[0].notes)}")

    def _respawn(self, i: int) -> None:
        self._procs[i].kill()
        self._procs[i] = _Proc(self._ctx, self.path, self.name, self._protected, self._landlock)
        self._procs[i].wait_ready(START_TIMEOUT_S)

    def __call__(self, samples: Sequence[Sample], texts: Sequence[str], finished: Sequence[bool]) -> RewardResult:
        before = snapshot(self.run_dir)
        with self._sigterm_named():
            calls = self._score(samples, texts)
        written = changes(before, snapshot(self.run_dir))
        if written:
            raise RunDirectoryWritten(
                f"{self.where}: files of the run directory {self.run_dir} changed while the custom reward function "
                f"ran (the trainer writes none during a call): {', '.join(written)}; the run stops, its records "
                f"may be damaged. A reward function must not write under logging.output_dir")
        return result_of(calls, samples, texts, self.outcomes)

    def _score(self, samples: Sequence[Sample], texts: Sequence[str]) -> list[tuple[str, Any]]:
        if samples and not self._procs:
            raise RuntimeError(f"{self.where}: called after close() (its workers are gone)")
        calls: list[tuple[str, Any]] = [("died", "not scored")] * len(samples)
        todo = deque(range(len(samples)))
        while todo or any(p.task is not None for p in self._procs):
            for p in self._procs:  # hand out work to idle workers
                if p.task is None and todo:
                    i = todo.popleft()
                    s = samples[i]
                    p.send(i, {"data_source": s.data_source, "solution_str": texts[i],
                               "ground_truth": s.ground_truth, "extra_info": s.extra_info}, self.timeout_s)
            busy = [p for p in self._procs if p.task is not None]
            timeout = max(0.0, min(p.deadline for p in busy) - time.monotonic())
            ready = wait([p.conn for p in busy] + [p.proc.sentinel for p in busy], timeout)
            now = time.monotonic()
            for k, p in enumerate(self._procs):
                if p.task is None:
                    continue
                if p.conn in ready or p.conn.poll(0):
                    try:
                        kind, payload = p.answer()
                    except (EOFError, OSError):
                        kind = None  # died mid-call: handled below
                    if kind is not None:
                        calls[p.task] = (kind, payload)
                        p.task = None
                        if kind == "died":
                            self._respawn(k)
                        continue
                if not p.proc.is_alive():
                    p.proc.join(1)
                    calls[p.task] = ("died", _exit_reason(p.proc.exitcode))
                    self._respawn(k)
                elif now >= p.deadline:
                    calls[p.task] = ("timeout", self.timeout_s)
                    self._respawn(k)
        return calls

    class _Named:
        """While a call runs (main thread only): a SIGTERM is named on stderr, the workers closed,
        then the signal goes on to the trainer's own disposition (unless the trainer ignores it)."""

        def __init__(self, reward: "CustomReward"):
            self.reward, self.armed, self.prev = reward, False, None

        def __enter__(self):
            if threading.current_thread() is threading.main_thread() and \
                    signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN:
                self.prev = signal.signal(signal.SIGTERM, self._on_sigterm)
                self.armed = True

        def __exit__(self, *exc):
            self._disarm()

        def _disarm(self):
            if self.armed:
                signal.signal(signal.SIGTERM, signal.SIG_DFL if self.prev is None else self.prev)
                self.armed = False

        def _on_sigterm(self, signum, frame):
            r = self.reward
            pids = [p.proc.pid for p in r._procs]
            print(f"pfppo: SIGTERM reached the trainer (pid {os.getpid()}) while {r.where} ran in its workers "
                  f"(pids {pids}); the sender is that function if it signals processes (os.kill, os.killpg, a "
                  f"kill command), else the launcher (torchrun, Slurm, a user). The trainer ends as SIGTERM asks.",
                  file=sys.stderr, flush=True)
            self._disarm()
            r.close()
            signal.raise_signal(signal.SIGTERM)  # the disposition the trainer had (default: end)

    def _sigterm_named(self) -> "_Named":
        return CustomReward._Named(self)

    def check(self, samples, where: str) -> None:  # scores any data_source
        pass

    def close(self) -> None:
        """Ask every worker to stop; after CLOSE_GRACE_S SIGKILL each worker's tree. Idempotent."""
        procs, self._procs = self._procs, []
        for p in procs:
            try:
                p.conn.send(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + CLOSE_GRACE_S
        for p in procs:
            p.proc.join(max(0.0, deadline - time.monotonic()))
            p.kill()
        _LIVE.discard(self)

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: atexit and PDEATHSIG end the workers anyway
            pass
