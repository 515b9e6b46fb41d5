"""The trainer's handle on the generator process (worker.py).

``GeneratorProcess`` starts it (spawn: a fresh interpreter, nothing of the trainer's state or
threads), pushes weights and requests, and collects results through a reader thread (so the
generator never blocks on a full pipe while the trainer trains). It remembers every request not
yet answered and the versions of the pool: when the process dies (killed, crashed) or stays silent
past result_timeout_s, a new one is started, given the pool's versions again and asked the
unanswered requests again (same ids and seeds), at most max_restarts times (then GeneratorFailed).
``stop()`` ends it and waits; a trainer that dies ends it too (closed pipe, PR_SET_PDEATHSIG).

Weights travel as files (weightfile.py): each pushed version is written once into shared memory
and only (version, path) goes through the pipe; the pool holds the paths, a version it evicts has
its file removed, and ``stop()`` removes them all.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import threading
import time
from typing import Callable, Optional

from pfppo_mega.trainer.asynchronous.buffer import VersionPool
from pfppo_mega.trainer.asynchronous.weightfile import WeightFiles
from pfppo_mega.trainer.asynchronous.worker import Request, Result, WorkerSpec, main

START_TIMEOUT_S = 300.0  # a spawned interpreter imports torch and builds the engine


class GeneratorFailed(RuntimeError):
    """The generator process could not be started, or died more than algorithm.async_rl.max_restarts
    times; the message says which and why."""


class GeneratorProcess:
    def __init__(self, spec: WorkerSpec, *, max_restarts: int, result_timeout_s: float,
                 log: Callable[[str], None] = print, output_dir: Optional[str] = None) -> None:
        self.spec, self.max_restarts, self.result_timeout_s, self.log = spec, max_restarts, result_timeout_s, log
        self.pool: VersionPool = VersionPool(spec.window)   # version -> its file's path, while it may still be used
        self.files = WeightFiles(output_dir)                # under /dev/shm, else <output_dir>/async_weights
        self.in_flight: dict[int, Request] = {}             # requests sent and not answered, by id
        self.restarts = 0
        self.proc: Optional[mp.Process] = None
        self._results: "queue.Queue" = queue.Queue()
        self._incarnation = 0
        self._to_child = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def pid(self) -> Optional[int]:
        return None if self.proc is None else self.proc.pid

    def start(self) -> None:
        ctx = mp.get_context("spawn")
        inbox, to_child = ctx.Pipe(duplex=False)
        from_child, outbox = ctx.Pipe(duplex=False)
        self._incarnation += 1
        self.proc = ctx.Process(target=main, args=(inbox, outbox, self.spec, os.getpid()), daemon=True,
                                name=f"pfppo-generator-{self._incarnation}")
        self.proc.start()
        inbox.close()
        outbox.close()
        self._to_child = to_child
        threading.Thread(target=self._read, args=(from_child, self._incarnation), daemon=True).start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            kind, inc, payload = self._get(deadline)
            if inc != self._incarnation:
                continue  # a message of an earlier, dead process
            if kind == "ready":
                break
            code = self.proc.exitcode if self.proc is not None else None
            self.stop()
            why = str(payload).strip() if payload else (f"no answer in {START_TIMEOUT_S:g} s" if kind == "timeout"
                                                         else f"it exited with code {code}")
            raise GeneratorFailed(f"the generator process did not start: {why}")
        for version, path in sorted(self.pool.held.items()):  # a restarted process gets the pool again
            self._send(("weights", version, path))
        for rid in sorted(self.in_flight):  # and the requests it had not answered, same ids and seeds
            self._send(("request", self.in_flight[rid]))

    def _read(self, conn, incarnation: int) -> None:
        try:
            while True:
                msg = conn.recv()
                self._results.put((msg[0], incarnation, msg[1] if len(msg) > 1 else None))
        except (EOFError, OSError):
            self._results.put(("dead", incarnation, None))

    def _get(self, deadline: float):
        wait = deadline - time.monotonic()
        if wait <= 0:
            return ("timeout", self._incarnation, None)
        try:
            return self._results.get(timeout=wait)
        except queue.Empty:
            return ("timeout", self._incarnation, None)

    def _send(self, msg) -> None:
        if self._to_child is None:  # stopped, or never started: the next start sends the pool again
            return
        try:
            self._to_child.send(msg)
        except (BrokenPipeError, OSError):
            pass  # the process died; the next wait notices it and restarts it

    def stop(self, timeout_s: float = 10.0) -> None:
        """End the process and wait for it (killed when it does not stop in time), then remove the
        weight files (the pool is emptied). Idempotent."""
        proc, self.proc = self.proc, None
        if proc is not None:
            self._send(("stop",))
            proc.join(timeout_s)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout_s)
        if self._to_child is not None:
            self._to_child.close()
            self._to_child = None
        self.pool.held.clear()
        self.files.close()

    def restart(self, why: str) -> None:
        self.restarts += 1
        if self.restarts > self.max_restarts:
            self.stop()
            raise GeneratorFailed(f"the generator process {why} for the {self.restarts}th time "
                                  f"(algorithm.async_rl.max_restarts = {self.max_restarts}); stopping")
        self.log(f"[pfppo] async: the generator process {why}; restarting it "
                 f"({len(self.in_flight)} request(s) redone, restart {self.restarts} of {self.max_restarts})")
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()
        if self.proc is not None:
            self.proc.join(10.0)
        self.proc = None
        self.start()

    # ------------------------------------------------------------------ traffic

    def push_weights(self, version: int, buckets: list) -> None:
        """``push_file`` of ``buckets`` written to version ``version``'s file."""
        self.push_file(version, self.files.write(version, buckets))

    def push_file(self, version: int, path: str) -> None:
        """Version ``version`` (its file written: self.files) enters the pool and the generator (only
        its path goes through the pipe); the files of older versions beyond the window are removed."""
        gone = self.pool.add(version, path)
        self._send(("weights", version, path))
        self.files.remove(gone)  # after the message of the version that evicts them (worker.py)

    def submit(self, request: Request) -> None:
        self.in_flight[request.rid] = request
        self._send(("request", request))

    def next_result(self, *, block: bool = True) -> Optional[Result]:
        """The next answered request, restarting the process as often as allowed when it dies or
        stays silent past result_timeout_s. ``block`` False: None when no result is here yet."""
        deadline = time.monotonic() + self.result_timeout_s
        while True:
            if not block and self._results.empty():
                return None
            if block and not self.in_flight:
                raise RuntimeError("GeneratorProcess.next_result: no request in flight")
            kind, inc, payload = self._get(deadline)
            if inc != self._incarnation:
                continue
            if kind == "result":
                if payload.rid not in self.in_flight:
                    continue  # answered already (by a process before a restart)
                del self.in_flight[payload.rid]
                return payload
            if kind == "dead" or (kind == "timeout" and self.proc is not None and not self.proc.is_alive()):
                code = None if self.proc is None else self.proc.exitcode
                self.restart(f"died (exit code {code})")
            elif kind == "timeout":
                self.restart(f"sent no result for {self.result_timeout_s:g} s (algorithm.async_rl.result_timeout_s)")
            elif kind == "error":
                self.restart(f"failed: {str(payload).strip().splitlines()[-1] if payload else '?'}")
            deadline = time.monotonic() + self.result_timeout_s
