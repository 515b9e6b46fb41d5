"""This machine's rates, measured in the run itself (cached per process until remeasure()): what
the perf/ metrics compare the phases against (trainer/instruments/perf.py).

    matmul_rates(device, dtype) FLOP/s of n x n @ n x n matmuls (n = 1024), the best of a few timed
                                repeats after a warm-up, at the process's torch threads, through each
                                library torch offers here: "torch_mm" (torch.mm: MKL on a CPU, cuBLAS
                                on a GPU; what the trainer's megatron layers get) and, on a CPU in
                                fp32, "onednn" (a oneDNN-prepacked weight: what the built-in engine
                                uses; docs/perf.md has both rates on two machine kinds)
    matmul_rate(device, dtype)  the best of those: the machine's rate, that the perf/ fractions use
    memcpy_rate(device)         bytes copied per second (tensor.copy_ of 256 MiB, 8x this CPU's L3;
                                size / time, as memcpy figures are quoted), the best of a few repeats

Best of repeats: on a shared machine the fastest repeat is the closest to what the hardware can
do; the phases it is compared with run under the same load.
"""

from __future__ import annotations

import functools
import time

import torch

from pfppo_mega.compat import onednn

MATMUL_N = 1024
MEMCPY_BYTES = 256 << 20
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
def _onednn_rate(n: int, threads: int) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    packed = onednn.pack(b, batch_hint=n)
    calls = 4
    secs = _best_seconds(lambda: [onednn.linear(a, b, None, packed) for _ in range(calls)], torch.device("cpu"),
                         REPEATS)
    return calls * 2.0 * n ** 3 / secs


@functools.lru_cache(maxsize=None)
def _memcpy_rate(device: str, nbytes: int, threads: int) -> float:
    dev = torch.device(device)
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev).fill_(1)
    dst = torch.empty_like(src)
    return nbytes / _best_seconds(lambda: dst.copy_(src), dev, REPEATS)


def remeasure() -> None:
    """Forget the measured rates: the next call measures them again (the trainer does so every
    logging.perf_probe_interval steps, so its fractions compare against the machine as it is now)."""
    for measured in (_matmul_rate, _onednn_rate, _memcpy_rate):
        measured.cache_clear()


def matmul_rates(device: torch.device, dtype: torch.dtype = torch.float32, n: int = MATMUL_N) -> dict[str, float]:
    """FLOP/s of square matmuls in ``dtype`` on ``device`` per library (cached per process and
    thread count): {"torch_mm": ..., "onednn": ... (CPU fp32 where torch has it)}."""
    threads = torch.get_num_threads()
    rates = {"torch_mm": _matmul_rate(str(device), dtype, n, threads)}
    if torch.device(device).type == "cpu" and onednn.available(dtype):
        rates["onednn"] = _onednn_rate(n, threads)
    return rates


def matmul_rate(device: torch.device, dtype: torch.dtype = torch.float32, n: int = MATMUL_N) -> float:
    """The machine's matmul rate: the best of matmul_rates()."""
    return max(matmul_rates(device, dtype, n).values())


def memcpy_rate(device: torch.device, nbytes: int = MEMCPY_BYTES) -> float:
    """Bytes per second of a device-to-device copy (cached per process and thread count until remeasure())."""
    return _memcpy_rate(str(device), nbytes, torch.get_num_threads())
