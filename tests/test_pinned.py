"""pfppo_mega.pinned: host buffers page-locked exactly their size. No GPU here: the registration
path runs against a fake cudart (``FakeCudart``) that records every register / unregister call;
with CUDA unavailable the plain path returns an ordinary tensor. The pool's wires and host copies
go through it too (the offload's host buffers: tests/test_offload.py)."""

from __future__ import annotations

import gc

import pytest
import torch

from pfppo_mega import pinned
from pfppo_mega.pool.snapshots import SnapshotPool
from pfppo_mega.rollout.weights import new_wire, wire_nbytes

GiB = 2 ** 30


class FakeCudart:
    """torch.cuda.cudart() as pinned_empty calls it: records (ptr, nbytes, flags) registrations and
    the pointers unregistered; ``fail``: the code cudaHostRegister returns (0: success)."""

    def __init__(self, fail: int = 0):
        self.fail = fail
        self.registered: list[tuple[int, int, int]] = []
        self.unregistered: list[int] = []

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        self.registered.append((ptr, nbytes, flags))
        return self.fail

    def cudaHostUnregister(self, ptr: int) -> int:
        self.unregistered.append(ptr)
        return 0

    def cudaGetErrorString(self, code: int) -> str:
        return {2: "out of memory"}.get(int(code), "unknown error")

    @property
    def live(self) -> list[int]:
        """Registered and not (yet) unregistered: the sizes pinned now."""
        gone = list(self.unregistered)
        out = []
        for ptr, n, _ in self.registered:
            if ptr in gone:
                gone.remove(ptr)
            else:
                out.append(n)
        return out


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA 'available' with a recording cudart; torch.cuda.synchronize / empty_cache no-ops (the
    host buffers are real host memory, the copies plain CPU copies)."""
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    yield fake
    gc.collect()


def test_allocator_bytes_is_the_next_power_of_two():
    assert [pinned.allocator_bytes(n) for n in (0, 1, 2, 3, 4096, 4097)] == [0, 1, 2, 4, 4096, 8192]
    grads_70b = 4 * 4_410_000_000  # one 70B stage's fp32 grad buffer: 16.43 GiB
    assert pinned.allocator_bytes(grads_70b) == 32 * GiB
    with pytest.raises(ValueError, match=r"nbytes\(-1\) must be >= 0"):
        pinned.allocator_bytes(-1)


def test_without_cuda_a_plain_tensor_of_exactly_nbytes(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: pytest.fail("cudart called without CUDA"))
    before = pinned.pinned_bytes()
    for n in (0, 1, 4097, 3 << 20):
        t = pinned.pinned_empty(n)
        assert t.dtype == torch.uint8 and t.device.type == "cpu" and t.shape == (n,)
        assert t.untyped_storage().nbytes() == n
    assert pinned.pinned_bytes() == before
    with pytest.raises(ValueError, match=r"nbytes\(-5\) must be >= 0"):
        pinned.pinned_empty(-5)


def test_registers_exactly_nbytes_and_unregisters_once_when_the_storage_dies(fake_cuda):
    n = (5 << 20) + 3  # 5 MiB + 3: torch's pinned allocator would hold 8 MiB
    before = pinned.pinned_bytes()
    t = pinned.pinned_empty(n)
    assert t.dtype == torch.uint8 and t.shape == (n,)
    assert fake_cuda.registered == [(t.data_ptr(), n, 0)]
    assert pinned.pinned_bytes() - before == n < pinned.allocator_bytes(n)
    t.fill_(7)  # the memory is real and writable
    ptr = t.data_ptr()
    view = t[: n - 3].view(torch.int32)  # a view keeps the storage, and the registration, alive
    del t
    gc.collect()
    assert fake_cuda.unregistered == [] and int(view[0]) == 0x07070707
    del view
    gc.collect()
    assert fake_cuda.unregistered == [ptr] and pinned.pinned_bytes() == before
    gc.collect()
    assert fake_cuda.unregistered == [ptr]  # exactly once


def test_a_failing_register_raises_naming_the_call_and_its_code(fake_cuda):
    fake_cuda.fail = 2
    before = pinned.pinned_bytes()
    with pytest.raises(RuntimeError, match=r"cudaHostRegister\(0x[0-9a-f]+, nbytes=4096, flags=0\) returned 2 "
                                           r"\(out of memory\)"):
        pinned.pinned_empty(4096)
    gc.collect()
    assert pinned.pinned_bytes() == before and fake_cuda.unregistered == []  # nothing to undo


def test_pool_wires_and_snapshot_copies_are_pinned_exactly(fake_cuda):
    """weights.new_wire (the sharded pool's buckets) and SnapshotPool's host copies: one
    registration per buffer, of exactly its bytes (torch.empty(pin_memory=True) cannot run here)."""
    wire = new_wire(1000, pin=True)
    assert wire.numel() == wire_nbytes(1000) and fake_cuda.live == [wire_nbytes(1000)]
    del wire
    gc.collect()
    assert fake_cuda.live == []
    pool = SnapshotPool(2, pin_memory=True, check_memory=False)
    named = [("w", torch.randn(3, 5)), ("b", torch.arange(7, dtype=torch.int64)), ("s", torch.tensor(2.5))]
    snap = pool.add(1, named)
    assert sorted(fake_cuda.live) == sorted(t.numel() * t.element_size() for _, t in named)
    for (_, want), (_, got) in zip(named, snap.tensors):
        assert got.shape == want.shape and got.dtype == want.dtype and torch.equal(got, want)
    assert pool.verify(snap)
