"""The refit fingerprint (pfppo_mega.rollout.weights; C++ op in csrc/cpu/fingerprint.cpp) keeps ONE
definition -- pools and checkpoints store it -- on every path: the torch reference, the C++ op on
one thread, and the C++ op chunked over several threads (chunks summed from zero and combined in
order), for sizes that are not multiples of a 128-byte row, several sources, contiguous, q/k/v-like
(each slab contiguous) and arbitrarily strided sources.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from pfppo_mega.rollout import weights as W

MB = 1 << 20


@pytest.fixture
def threads():
    """Set torch's intra-op thread count for one call, restored afterwards."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _definition(b: bytes) -> list[int]:
    """The definition, word by word in Python (slow: small inputs only)."""
    b = b + bytes(-len(b) % 128)
    s1, s2, m = [0] * 16, [0] * 16, (1 << 64) - 1
    for r in range(0, len(b), 128):
        for lane in range(16):
            s1[lane] = (s1[lane] + int.from_bytes(b[r + 8 * lane:r + 8 * lane + 8], "little")) & m
            s2[lane] = (s2[lane] + s1[lane]) & m
    return [x - (1 << 64) if x >> 63 else x for x in s1 + s2]  # as int64


def _sources(g: torch.Generator) -> list[torch.Tensor]:
    """~3.3 MB of float32 in five pieces, odd sizes: contiguous, q/k/v-like views of a fused
    weight (slabs contiguous, dim 0 strided), a transposed view (no contiguous slab), a 0-dim one."""
    fused = torch.randn(8, 3 * 40 + 7, 301, generator=g)  # [groups, q+k+v rows per group, hidden]
    q, k, _ = torch.split(fused, [3 * 40, 5, 2], dim=1)
    return [
        torch.randn(333_333, generator=g),
        q,
        k,
        torch.randn(211, 523, generator=g).t(),
        torch.randn((), generator=g),
        torch.randn(77, generator=g),
    ]


def test_the_definition_is_pinned():
    """The torch reference computes the definition, and its value for a fixed input is pinned (a
    change of definition would orphan every stored pool checksum)."""
    data = torch.arange(1000, dtype=torch.int32).view(torch.uint8)  # 4000 bytes: 31 rows + 32 bytes
    ref = W._fingerprint_torch(data)
    assert ref.tolist() == _definition(data.numpy().tobytes())
    assert hashlib.sha256(ref.numpy().tobytes()).hexdigest()[:16] == "02260821d6403192"  # the op and reference before threading


def test_chunks_combine_exactly():
    """A row-aligned prefix with sums (A, B) then the rest, m rows with sums from zero (A', B'),
    gives (A + A', B + m A + B') -- the rule the threaded op combines its chunks with."""
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, 256, (128 * 37 + 45,), dtype=torch.uint8, generator=g)
    for rows in (1, 5, 36, 37):
        head, tail = W._fingerprint_torch(data[:128 * rows]), W._fingerprint_torch(data[128 * rows:])
        a = head[:16] + tail[:16]
        m = -(-(data.numel() - 128 * rows) // 128)  # rows of the rest, its last one padded
        b = head[16:] + m * head[:16] + tail[16:]
        assert torch.equal(torch.cat([a, b]), W._fingerprint_torch(data)), rows


@pytest.mark.parametrize("n_threads", [1, 2])
def test_native_threaded_equals_reference(threads, n_threads):
    """pack_fingerprint and fingerprint on 1 and 2 threads == the torch reference == each other, and
    the packed bytes are the concatenation, on sizes that are not multiples of 128 bytes."""
    assert W._native() is not None, "pfppo_mega._C is not built (make setup): the C++ op is what is tested here"
    g = torch.Generator().manual_seed(0)
    threads(n_threads)
    for drop in (0, 1, 3):  # total 4-byte words: odd multiples and remainders of a 32-word row
        srcs = _sources(g)
        srcs[0] = srcs[0][:srcs[0].numel() - drop]
        total = sum(t.numel() for t in srcs)
        assert total * 4 > 2 * MB and (total * 4) % 128 != 0
        flat = torch.full((total,), float("nan"))
        fp = W.pack_fingerprint(flat, srcs)
        assert torch.equal(flat, torch.cat([t.reshape(-1) for t in srcs]))
        ref = W._fingerprint_torch(flat)
        assert torch.equal(fp, ref), (n_threads, drop)
        assert torch.equal(W.fingerprint(flat), ref), (n_threads, drop)
        tail = flat[1:]  # a start that is not row aligned in memory
        assert torch.equal(W.fingerprint(tail.clone()), W._fingerprint_torch(tail)), (n_threads, drop)


def test_thread_count_does_not_change_the_result(threads):
    g = torch.Generator().manual_seed(2)
    srcs = _sources(g)
    flat = torch.empty(sum(t.numel() for t in srcs))
    got = []
    for n in (1, 2, 3):
        threads(n)
        got.append(W.pack_fingerprint(flat, srcs))
    assert torch.equal(got[0], got[1]) and torch.equal(got[0], got[2])


def test_parameters_go_in_without_detach():
    """The op never takes part in autograd: parameters pack as they are and the bucket does not
    become part of a graph (the Python side no longer detaches each tensor)."""
    p = torch.nn.Parameter(torch.randn(1000))
    w = torch.nn.Parameter(torch.randn(24, 10))
    flat = torch.empty(1240)
    fp = W.pack_fingerprint(flat, [p, w.t()])
    assert not flat.requires_grad and not fp.requires_grad and flat.grad_fn is None
    assert torch.equal(fp, W._fingerprint_torch(torch.cat([p.detach(), w.detach().t().reshape(-1)])))
