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
    from pfppo_mega.trainer.engine_sync import lost_peer

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
