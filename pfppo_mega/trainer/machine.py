"""This machine's rates, measured in the run itself (once per process, cached): what the perf/
metrics compare the phases against (trainer/perf.py).

    matmul_rate(device, dtype)  FLOP/s of n x n @ n x n matmuls (n = 1024), the best of a few
                                timed repeats after a warm-up, at the process's torch threads
    memcpy_rate(device)         bytes copied per second (tensor.copy_ of 64 MiB; size / time, as
                                memcpy figures are quoted), the best of a few repeats

Best of repeats: on a shared machine the fastest repeat is the closest to what the hardware can
do; the phases it is compared with run under the same load.
"""

from __future__ import annotations

import functools
import time

import torch

MATMUL_N = 1024
MEMCPY_BYTES = 64 << 20
REPEATS = 5


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_seconds(fn, device: torch.device, repeats: int) -> float:
    fn()  # warm-up (allocation, kernel selection)
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


@functools.lru_cache(maxsize=None)
def _matmul_rate(device: str, dtype: torch.dtype, n: int, threads: int) -> float:
    dev = torch.device(device)
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    out = torch.empty(n, n, device=dev, dtype=dtype)
    calls = 4  # per timed repeat: long enough to time, short enough to stay under ~0.1 s on 2 CPU cores
    secs = _best_seconds(lambda: [torch.mm(a, b, out=out) for _ in range(calls)], dev, REPEATS)
    return calls * 2.0 * n ** 3 / secs


@functools.lru_cache(maxsize=None)
def _memcpy_rate(device: str, nbytes: int, threads: int) -> float:
    dev = torch.device(device)
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev).fill_(1)
    dst = torch.empty_like(src)
    return nbytes / _best_seconds(lambda: dst.copy_(src), dev, REPEATS)


def matmul_rate(device: torch.device, dtype: torch.dtype = torch.float32, n: int = MATMUL_N) -> float:
    """FLOP/s of square matmuls in ``dtype`` on ``device`` (measured once per process and thread count)."""
    return _matmul_rate(str(device), dtype, n, torch.get_num_threads())


def memcpy_rate(device: torch.device, nbytes: int = MEMCPY_BYTES) -> float:
    """Bytes per second of a device-to-device copy (measured once per process and thread count)."""
    return _memcpy_rate(str(device), nbytes, torch.get_num_threads())
