"""A heartbeat watchdog that names the rank that stopped answering, in bounded time.

A rank that stops (SIGSTOP, a hung NCCL call, a frozen node) leaves its peers waiting inside a
collective until ``parallel.collective_timeout_s`` (30 minutes by default, long enough for a slow
collective) and then says only that a peer was lost. Here every rank runs a daemon thread that,
every ``interval_s``, bumps its own counter in the process group's key-value store (the rendezvous
store torchrun / init_process_group already made) and reads its peers'. A peer whose counter has not
moved for ``stall_s`` (``parallel.watchdog_s``) is stalled: the thread reports it by rank, with the
seconds since it last answered and the key, and calls ``on_stall`` (default: print to stderr and end
this process with EXIT_STALLED, so the launcher tears the job down; a thread cannot interrupt a
collective blocked in C++). A stalled rank's own threads are stopped too, so it never reports
itself. A rank that ends cleanly (``stop()``, at exit) marks itself done and is never reported, so
the others may go on alone (rank 0's export after the last step). The store host answering nobody (its process stopped) is the same fault: a read that times
out names the store's host rank (0). Stalls are judged on this rank's monotonic clock: no clock is
compared across nodes.

The heartbeat costs one store write and world_size - 1 reads per interval per rank.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

EXIT_STALLED = 75  # the process's exit status when the watchdog ends it (EX_TEMPFAIL: a requeue may help)
_KEY = "pfppo/heartbeat/{rank}"
_DONE = b"done"


@dataclass(frozen=True)
class Stall:
    """A peer that stopped answering: its rank and how long since its counter last moved."""

    rank: int
    silent_s: float
    stall_s: float
    store_unreachable: bool = False

    def message(self) -> str:
        what = ("the rendezvous store (hosted by rank 0) stopped answering" if self.store_unreachable
                else f"rank {self.rank} stopped answering")
        return (f"pfppo watchdog: {what}: no heartbeat for {self.silent_s:.0f} s (parallel.watchdog_s = "
                f"{self.stall_s:g}); it is stopped, hung in a collective or its node is frozen. Ending this rank "
                f"(exit {EXIT_STALLED}) instead of waiting parallel.collective_timeout_s; look at rank "
                f"{self.rank}'s log and node")


def _default_on_stall(stall: Stall) -> None:
    print(stall.message(), file=sys.stderr, flush=True)
    os._exit(EXIT_STALLED)


class Watchdog:
    """The heartbeat thread of one rank (see the module docstring). ``store``: a torch.distributed
    Store shared by the ranks; ``start()`` once; ``stop()`` ends the thread (tests, clean shutdown)."""

    def __init__(self, store, *, rank: int, world_size: int, stall_s: float, interval_s: Optional[float] = None,
                 on_stall: Callable[[Stall], None] = _default_on_stall, clock: Callable[[], float] = time.monotonic):
        if not stall_s > 0:
            raise ValueError(f"Watchdog: stall_s({stall_s}) must be > 0 (parallel.watchdog_s; 0 turns it off)")
        self.store, self.rank, self.world_size = store, rank, world_size
        self.stall_s = stall_s
        self.interval_s = interval_s if interval_s is not None else max(0.05, min(5.0, stall_s / 6))
        self.on_stall, self.clock = on_stall, clock
        self._beats = 0
        self._seen: dict[int, tuple[bytes, float]] = {}  # peer -> (last value read, when it changed)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.reported: Optional[Stall] = None

    def beat(self) -> None:
        self._beats += 1
        self.store.set(_KEY.format(rank=self.rank), str(self._beats))

    def check(self) -> Optional[Stall]:
        """Read every peer's counter once; the first peer silent for stall_s, else None."""
        now = self.clock()
        for peer in range(self.world_size):
            if peer == self.rank:
                continue
            try:
                value = self.store.get(_KEY.format(rank=peer))
            except Exception:  # not written yet (a slow start) or the store did not answer in time
                value = None
            last = self._seen.get(peer)
            if last is None:
                self._seen[peer] = (value, now)  # first look: the clock starts now
                continue
            if value == _DONE:  # it ended cleanly (its process exits; the rest may still work alone)
                continue
            if value is not None and value != last[0]:
                self._seen[peer] = (value, now)
            elif now - last[1] >= self.stall_s:
                return Stall(peer, now - last[1], self.stall_s)
        return None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.beat()
            except Exception:  # the store host is gone: the peers' reads tell who
                pass
            stall = self.check()
            if stall is not None:
                self.reported = stall
                self.on_stall(stall)
                return

    def start(self) -> "Watchdog":
        self.beat()
        self._thread = threading.Thread(target=self._run, name="pfppo-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the thread and tell the peers this rank is done (not stalled): a rank that finishes
        first must not be reported while another still writes alone (rank 0's export, say)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            self.store.set(_KEY.format(rank=self.rank), _DONE.decode())
        except Exception:  # the store's host already ended: nobody is left to report us
            pass


_active: Optional[Watchdog] = None


def start(store_factory: Callable[[float], object], *, rank: int, world_size: int, stall_s: float,
          **kw) -> Optional[Watchdog]:
    """This process's watchdog (one per process; None when stall_s is 0 or the world has one rank).
    ``store_factory(timeout_s)`` makes the watchdog's own store client: its short read timeout must not
    be the one of the store the process group and NCCL's rendezvous use."""
    global _active
    if _active is not None:
        return _active
    if not stall_s or world_size < 2:
        return None
    dog = Watchdog(None, rank=rank, world_size=world_size, stall_s=stall_s, **kw)
    dog.store = store_factory(max(1.0, dog.interval_s * 2))
    _active = dog.start()
    atexit.register(stop)  # a clean exit marks this rank done
    return _active


def stop() -> None:
    global _active
    if _active is not None:
        _active.stop()
        _active = None
