"""A stopped rank (SIGSTOP) no longer hangs the job: every collective of the trainer's groups waits
at most parallel.collective_timeout_s (init_parallel's timeout, megatron's groups included), then the
ranks still running raise, and `pfppo train` names the key (issue 24.6)."""

import json
import os
import signal
import socket
import time
from pathlib import Path

import torch.multiprocessing as mp

TIMEOUT_S = 3.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from pfppo_mega import parallel
    from pfppo_mega.trainer.colocation.engine_sync import lost_peer

    parallel.init_parallel(tp=1, pp=1, backend="gloo", seed=0, timeout_s=TIMEOUT_S)
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # a stalled rank: alive, silent
        return
    time.sleep(0.5)
    result = {}
    for name, group in (("world", None), ("megatron data-parallel", parallel_state.get_data_parallel_group())):
        t0 = time.perf_counter()
        try:
            dist.all_reduce(torch.ones(4), group=group)
            result[name] = {"error": None}
        except Exception as e:  # the backend's timeout
            result[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}", "lost_peer": lost_peer(e),
                            "elapsed": time.perf_counter() - t0}
    Path(out).write_text(json.dumps(result))
    os._exit(0)  # the peer never answers: no clean teardown


def test_a_stopped_rank_ends_in_an_error_within_the_timeout(tmp_path):
    out = str(tmp_path / "rank0.json")
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        procs[0].join(timeout=120)
        assert not procs[0].is_alive(), "rank 0 still waits on the stopped rank"
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join(timeout=10)
    result = json.loads(Path(out).read_text())
    for name, r in result.items():
        print(f"{name} group: stopped peer -> {r['error'][:80]!r} after {r['elapsed']:.2f} s "
              f"(timeout {TIMEOUT_S} s)")
        assert r["error"] is not None and r["lost_peer"], r
        assert TIMEOUT_S * 0.8 <= r["elapsed"] <= TIMEOUT_S * 3 + 5, r


def test_the_timeout_key_is_validated():
    import pytest

    from pfppo_mega.config import ConfigError
    from pfppo_mega.config.tree import ParallelConfig

    assert ParallelConfig().collective_timeout_s == 1800.0
    for bad in (0.0, -1.0, 1e9):
        with pytest.raises(ConfigError, match=rf"collective_timeout_s = {bad}: must be > 0 and <= 86400"):
            ParallelConfig(collective_timeout_s=bad)


# ----------------------------------------------------------------------------- the watchdog (issue 40)

WATCHDOG_S = 2.0


def _rank_with_watchdog(rank: int, port: int, err: str) -> None:
    fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)  # the watchdog's message goes to stderr
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    from pfppo_mega import parallel

    # a collective timeout far beyond the test: only the watchdog can end rank 0's wait
    parallel.init_parallel(tp=1, pp=1, backend="gloo", seed=0, timeout_s=600, watchdog_s=WATCHDOG_S)
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    dist.all_reduce(torch.ones(4))  # waits on the stopped rank
    os._exit(0)


def test_the_watchdog_names_a_stopped_rank_long_before_the_collective_timeout(tmp_path):
    """Rank 1 stops; rank 0 waits in an all-reduce whose timeout is 600 s. Within a few watchdog
    periods rank 0 names rank 1 and ends with EXIT_STALLED (before: silence until the timeout)."""
    from pfppo_mega.watchdog import EXIT_STALLED

    errs = [tmp_path / f"rank{r}.err" for r in (0, 1)]
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_rank_with_watchdog, args=(r, port, str(errs[r]))) for r in (0, 1)]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    try:
        procs[0].join(timeout=90)
        elapsed = time.monotonic() - t0
        assert not procs[0].is_alive(), "rank 0 still waits on the stopped rank"
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join(timeout=10)
    text = errs[0].read_text()
    print(f"rank 0 ended after {elapsed:.1f} s (exit {procs[0].exitcode}): {text.strip()[:200]}")
    assert procs[0].exitcode == EXIT_STALLED, (procs[0].exitcode, text[-2000:])
    assert "rank 1 stopped answering" in text and "parallel.watchdog_s = 2" in text, text[-2000:]
    assert elapsed < 60, elapsed  # spawn and imports included; the collective timeout is 600 s


class _Store:
    def __init__(self):
        self.kv = {}

    def set(self, key, value):
        self.kv[key] = value.encode()

    def get(self, key):
        if key not in self.kv:
            raise KeyError(key)
        return self.kv[key]


def test_the_watchdog_judges_by_counters_on_its_own_clock():
    """A peer is stalled when its counter has not moved for stall_s on this rank's clock: a slow start
    counts from the first look, a moving counter never stalls, this rank never reports itself."""
    import pytest

    from pfppo_mega.watchdog import Watchdog

    now = [0.0]
    store = _Store()
    dog = Watchdog(store, rank=0, world_size=3, stall_s=10, clock=lambda: now[0])
    peer1 = Watchdog(store, rank=1, world_size=3, stall_s=10)
    dog.beat()
    assert dog.check() is None  # first look at both peers (rank 2 has not started yet)
    for t in range(1, 30):
        now[0] = float(t)
        peer1.beat()  # rank 1 alive throughout
        if t < 5:
            Watchdog(store, rank=2, world_size=3, stall_s=10).beat() if t == 3 else None
        stall = dog.check()
        if stall is not None:
            break
    assert stall is not None and stall.rank == 2 and stall.silent_s >= 10 and 12 <= now[0] <= 14, (stall, now)
    assert "rank 2 stopped answering" in stall.message()
    with pytest.raises(ValueError, match=r"stall_s\(0\) must be > 0"):
        Watchdog(store, rank=0, world_size=2, stall_s=0)


def test_the_watchdog_key_is_validated():
    import pytest

    from pfppo_mega.config import ConfigError
    from pfppo_mega.config.tree import ParallelConfig

    assert ParallelConfig().watchdog_s == 120.0 and ParallelConfig(watchdog_s=0).watchdog_s == 0
    with pytest.raises(ConfigError, match=r"watchdog_s = -1.0"):
        ParallelConfig(watchdog_s=-1.0)


def test_a_rank_that_ended_cleanly_is_never_reported():
    from pfppo_mega.watchdog import Watchdog

    now = [0.0]
    store = _Store()
    dog = Watchdog(store, rank=0, world_size=2, stall_s=5, clock=lambda: now[0])
    other = Watchdog(store, rank=1, world_size=2, stall_s=5)
    other.beat()
    dog.check()
    other.stop()  # rank 1 finished its part and exits; rank 0 goes on alone
    for t in range(1, 20):
        now[0] = float(t)
        assert dog.check() is None
