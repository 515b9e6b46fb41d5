"""A user's reward function (verl's `custom_reward_function`) run in worker processes.

`reward.num_workers` spawned processes each import the user's file once (pfppo_mega.rewards.worker)
and score one sample at a time. The parent hands samples out as workers free up and waits on the
pipes with the earliest deadline: a call running past `reward.timeout_s` has its worker killed
and replaced and scores 0 (guard/reward_timeouts); an exception or a return value that is not a
number scores 0 (guard/reward_errors); a worker that dies (segfault, os._exit) is replaced and
its sample counted as an error. The user's file is imported at start in a worker, never in the
trainer: an import error or a wrong signature is refused then, with the file and function named.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections import deque
from pathlib import Path
from multiprocessing.connection import wait
from typing import Any, Callable, Sequence

from pfppo_mega.rewards import worker as _worker
from pfppo_mega.rewards.base import OutcomeLog, RewardSetupError, result_of
from pfppo_mega.types import RewardResult, Sample

START_TIMEOUT_S = 120.0  # a worker's interpreter start + the user's imports


class _Proc:
    def __init__(self, ctx, path: str, name: str):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker.main, args=(child, path, name), daemon=True)
        self.proc.start()
        child.close()
        self.where = f"reward.custom_function: {name!r} in {path!r}"
        self.task: int | None = None     # sample index in flight
        self.deadline = 0.0

    def wait_ready(self, timeout: float) -> None:
        if not self.conn.poll(timeout):
            self.kill()
            raise RewardSetupError(f"{self.where}: the reward worker did not start within {timeout:.0f} s "
                                   f"(importing the file hangs?)")
        try:
            kind, msg = self.conn.recv()
        except (EOFError, OSError):
            self.proc.join(5)
            raise RewardSetupError(f"{self.where}: the reward worker exited at start (exit code "
                                   f"{self.proc.exitcode}): importing the file ended the process (sys.exit, "
                                   f"os._exit or a crash at import time)") from None
        if kind != "ready":
            self.kill()
            raise RewardSetupError(msg)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()


class CustomReward:
    def __init__(self, path: str, name: str, *, num_workers: int, timeout_s: float,
                 log: Callable[[str], None] = print):
        if not Path(path).is_file():  # before starting processes; the worker checks the rest
            raise RewardSetupError(f"reward.custom_function: {name!r} in {path!r}: no such file")
        self.path, self.name, self.timeout_s = path, name, timeout_s
        self.outcomes = OutcomeLog(log, f"custom reward {name!r} ({path})")
        self._ctx = mp.get_context("spawn")  # fork would copy the trainer's threads and CUDA state
        self._procs: list[_Proc] = []
        try:
            for _ in range(num_workers):
                self._procs.append(_Proc(self._ctx, path, name))
            for p in self._procs:
                p.wait_ready(START_TIMEOUT_S)
        except RewardSetupError:
            self.close()
            raise

    def _respawn(self, i: int) -> None:
        self._procs[i].kill()
        self._procs[i] = _Proc(self._ctx, self.path, self.name)
        self._procs[i].wait_ready(START_TIMEOUT_S)

    def __call__(self, samples: Sequence[Sample], texts: Sequence[str], finished: Sequence[bool]) -> RewardResult:
        calls: list[tuple[str, Any]] = [("died", "not scored")] * len(samples)
        todo = deque(range(len(samples)))
        while todo or any(p.task is not None for p in self._procs):
            for p in self._procs:  # hand out work to idle workers
                if p.task is None and todo:
                    i = todo.popleft()
                    s = samples[i]
                    p.conn.send((i, {"data_source": s.data_source, "solution_str": texts[i],
                                     "ground_truth": s.ground_truth, "extra_info": s.extra_info}))
                    p.task, p.deadline = i, time.monotonic() + self.timeout_s
            busy = [p for p in self._procs if p.task is not None]
            timeout = max(0.0, min(p.deadline for p in busy) - time.monotonic())
            ready = wait([p.conn for p in busy] + [p.proc.sentinel for p in busy], timeout)
            now = time.monotonic()
            for k, p in enumerate(self._procs):
                if p.task is None:
                    continue
                if p.conn in ready or p.conn.poll(0):
                    try:
                        index, kind, payload = p.conn.recv()
                        calls[index] = (kind, payload)
                        p.task = None
                        continue
                    except (EOFError, OSError):
                        pass  # died mid-call: handled below
                if not p.proc.is_alive():
                    calls[p.task] = ("died", f"exit code {p.proc.exitcode}")
                    self._respawn(k)
                elif now >= p.deadline:
                    calls[p.task] = ("timeout", self.timeout_s)
                    self._respawn(k)
        return result_of(calls, samples, texts, self.outcomes)

    def check(self, samples, where: str) -> None:  # scores any data_source
        pass

    def close(self) -> None:
        for p in self._procs:
            try:
                p.conn.send(None)
            except (OSError, BrokenPipeError):
                pass
        for p in self._procs:
            p.proc.join(2)
            p.kill()
        self._procs = []

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the daemon workers die with the parent anyway
            pass
