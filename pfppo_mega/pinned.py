"""Page-locked host buffers of exactly the bytes asked for.

torch's caching host allocator (``torch.empty(..., pin_memory=True)``, ``.pin_memory()``) rounds
every block up to the next power of two: a 16.4 GiB buffer pins 32 GiB, and the 70B plan's host
memory per node grows by half again (measured on an H200, torch 2.11). ``pinned_empty(nbytes)``
pins exactly ``nbytes``: an anonymous ``mmap`` of the exact size (pageable; the kernel maps whole
pages, so at most 4 KiB over) is page-locked with ``cudaHostRegister`` and unregistered once,
when the tensor's storage dies, before its memory is unmapped.

Why registration and not a slab allocator of power-of-two slabs sub-allocated exactly: the
buffers here are few and long-lived (TrainerOffload reuses its host buffers, the pool reuses its
wires), so the one-time cost of page-locking each is paid once; registration holds no slack at
all (a slab keeps its unused tail and, freed, its whole size), returns the memory to the OS when
the tensor dies, and needs no free lists. Registered memory is pinned for CUDA: ``non_blocking``
copies are DMA (``is_pinned()`` is true); the caller synchronizes before reading a device-to-host
copy or dropping its buffer (the caching allocator's per-block events do not cover it).

``pinned_bytes()`` counts the bytes pinned here and still alive (process-wide), for comparing
with the ledger; ``allocator_bytes(nbytes)`` is what torch's caching allocator would hold.
Without CUDA ``pinned_empty`` returns a plain tensor of exactly ``nbytes`` (nothing to pin).
Imports only torch and the standard library.
"""

from __future__ import annotations

import mmap
import threading
import weakref

import torch

REGISTER_DEFAULT = 0  # cudaHostRegisterDefault: with unified addressing, pinned for every device

_lock = threading.Lock()
_pinned = 0  # bytes registered by pinned_empty and not yet unregistered


def allocator_bytes(nbytes: int) -> int:
    """Bytes torch's caching host allocator holds for a pinned block of ``nbytes``: the next power
    of two (0 for 0)."""
    if nbytes < 0:
        raise ValueError(f"nbytes({nbytes}) must be >= 0")
    return 0 if nbytes == 0 else 1 << (nbytes - 1).bit_length()


def pinned_bytes() -> int:
    """Bytes page-locked by pinned_empty in this process now (their tensors still alive)."""
    return _pinned


def _count(delta: int) -> None:
    global _pinned
    with _lock:
        _pinned += delta


def _error(cudart, rc) -> str:
    try:
        return str(cudart.cudaGetErrorString(rc))
    except Exception:  # an error code the binding's enum cannot take
        return "no description"


def _unregister(cudart, ptr: int, nbytes: int, region: mmap.mmap) -> None:
    """The storage is gone: unlock the pages; ``region`` (held until here) is unmapped after."""
    rc = cudart.cudaHostUnregister(ptr)
    _count(-nbytes)
    if int(rc) != 0:  # a finalizer cannot raise into the program; the pages stay locked until exit
        print(f"pfppo_mega.pinned: cudaHostUnregister(0x{ptr:x}, {nbytes} bytes) returned {int(rc)} "
              f"({_error(cudart, rc)})")


def pinned_empty(nbytes: int) -> torch.Tensor:
    """An uninitialized ``[nbytes]`` uint8 host tensor, page-locked when CUDA is available, holding
    exactly ``nbytes`` (rounded up to whole pages by the kernel, never to a power of two)."""
    if nbytes < 0:
        raise ValueError(f"pinned_empty: nbytes({nbytes}) must be >= 0")
    if nbytes == 0 or not torch.cuda.is_available():
        return torch.empty(nbytes, dtype=torch.uint8)
    cudart = torch.cuda.cudart()
    region = mmap.mmap(-1, nbytes)  # anonymous, private, page-aligned: no page shared with another buffer
    t = torch.frombuffer(region, dtype=torch.uint8)  # [nbytes]; its storage keeps `region` alive
    ptr = t.data_ptr()
    rc = cudart.cudaHostRegister(ptr, nbytes, REGISTER_DEFAULT)
    if int(rc) != 0:
        raise RuntimeError(f"pinned_empty: cudaHostRegister(0x{ptr:x}, nbytes={nbytes}, flags={REGISTER_DEFAULT}) "
                           f"returned {int(rc)} ({_error(cudart, rc)}); page-locking needs free host memory within "
                           f"the locked-memory limit (ulimit -l)")
    _count(nbytes)
    # on the storage, not the tensor: views (.view(dtype), slices) share it and keep it alive
    fin = weakref.finalize(t.untyped_storage(), _unregister, cudart, ptr, nbytes, region)
    fin.atexit = False  # at exit the process's pages go with it
    return t
