"""Weights on their way into a rollout engine: layouts, buckets and weight sources.

An engine takes weights in its *layout*: an ordered list of (Hugging Face name, shape) in one
dtype (the engine's). They travel as a stream of *buckets*: flat buffers of about
``bucket_bytes`` each holding whole tensors, never a full-model dict. A bucket boundary never
splits a *fused group* -- q/k/v (weights and biases) of one layer, gate/up of one layer -- because
vLLM's loader fuses them into one parameter and must see the whole group in one call.

Every bucket carries the weight version it belongs to and a checksum over its header (index,
version, names, shapes, dtype) and a *fingerprint* of its bytes, taken where the bytes were
produced (a pool snapshot's checksum is taken at capture time). The engine recomputes it on
receipt: a bit flipped at rest or in transit, or a bucket of another version, is refused by name.
The fingerprint (``fingerprint``) is a 16-lane Fletcher-style sum over 64-bit words, computed in
the same pass that packs the bytes (``pack_fingerprint``: the C++ op pfppo::pack_fingerprint when
pfppo_mega._C is built, else the same definition in torch, which also runs on a GPU).

On the wire a bucket is one uint8 buffer (``new_wire``): its bytes, padded to 8, then a 32-byte
trailer (version, flag, 16-byte checksum), so one broadcast moves both.

The *weight sources* that produce the buckets of one version are in pfppo_mega.rollout.source, the
broadcasts that carry them between processes in pfppo_mega.rollout.refit; both import this module,
which imports only torch and the standard library.
"""

from __future__ import annotations

import hashlib
import math
import re
import struct
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import torch

from pfppo_mega.pinned import pinned_empty

_QKV = re.compile(r"^(.*\.layers\.\d+)\.self_attn\.[qkv]_proj\.(weight|bias)$")
_GATE_UP = re.compile(r"^(.*\.layers\.\d+)\.mlp\.(gate|up)_proj\.weight$")
CHECKSUM_BYTES = 32  # hex digits of the blake2b-128 digest
TRAILER_BYTES = 32  # on the wire after a bucket's bytes: version, flag (1 ok, -1 none), 16-byte checksum
FP_LANES = 16  # fingerprint lanes: rows of 16 x 8 = 128 bytes


class WeightUpdateError(ValueError):
    """A weight update was refused (wrong names or shapes, stale version, failed checksum)."""


def fused_group(name: str) -> str:
    """The group a tensor must travel with: '<layer>.qkv', '<layer>.gate_up', or its own name."""
    m = _QKV.match(name)
    if m:
        return m.group(1) + ".qkv"
    m = _GATE_UP.match(name)
    if m:
        return m.group(1) + ".gate_up"
    return name


@dataclass(frozen=True)
class WeightLayout:
    """What one engine takes: (name, shape) in order, one dtype. tie_word_embeddings: a
    ``lm_head.weight`` equal to the embedding is accepted and skipped by load_weights."""

    specs: tuple[tuple[str, tuple[int, ...]], ...]
    dtype: torch.dtype
    tie_word_embeddings: bool = False

    @classmethod
    def of(cls, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, *, tied: bool = False) -> "WeightLayout":
        return cls(tuple((n, tuple(s)) for n, s in shapes.items()), dtype, tied)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self.specs)

    @property
    def nbytes(self) -> int:
        return sum(math.prod(s) for _, s in self.specs) * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize  # no tensor made: spec.nbytes is asked several times per bucket


@dataclass(frozen=True)
class BucketSpec:
    """Bucket ``index`` of a plan: which tensors, in which order, in ``flat``."""

    index: int
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype

    @property
    def numels(self) -> list[int]:
        return [math.prod(s) for s in self.shapes]

    @property
    def numel(self) -> int:
        return sum(self.numels)

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)

    def split(self, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """flat [numel] -> (name, view of its shape) for every tensor of the bucket."""
        return [(n, piece.view(s)) for n, s, piece in zip(self.names, self.shapes, flat.split(self.numels))]


def plan_buckets(layout: WeightLayout, bucket_bytes: int,
                 segment: Optional[Callable[[str], object]] = None) -> list[BucketSpec]:
    """Pack the layout's tensors, in order, into buckets of at most ``bucket_bytes``; a fused
    group is never split, and a group larger than bucket_bytes gets a bucket of its own.
    segment(name): buckets never mix names of two segments (e.g. two pipeline stages)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 1")
    groups: list[list[tuple[str, tuple[int, ...]]]] = []
    seen: set[str] = set()
    for name, shape in layout.specs:
        key = fused_group(name)
        if groups and fused_group(groups[-1][-1][0]) == key:
            groups[-1].append((name, shape))
            continue
        if key in seen:
            raise ValueError(f"layout order splits fused group {key!r} (at {name!r}); list its members together")
        seen.add(key)
        groups.append([(name, shape)])
    item = _itemsize(layout.dtype)
    plan: list[BucketSpec] = []
    current: list[tuple[str, tuple[int, ...]]] = []
    size = 0
    for group in groups:
        gbytes = sum(math.prod(s) for _, s in group) * item
        new_segment = segment is not None and current and segment(current[-1][0]) != segment(group[0][0])
        if current and (size + gbytes > bucket_bytes or new_segment):
            plan.append(BucketSpec(len(plan), *_unzip(current), layout.dtype))
            current, size = [], 0
        current += group
        size += gbytes
    if current:
        plan.append(BucketSpec(len(plan), *_unzip(current), layout.dtype))
    return plan


def _unzip(pairs):
    return tuple(n for n, _ in pairs), tuple(s for _, s in pairs)


# ------------------------------------------------------------------------------- fingerprint
_OPS: list = []  # [torch.ops.pfppo] once pfppo_mega._C imported with the fingerprint ops, [None] without


def _native():
    if not _OPS:
        try:
            import pfppo_mega._C  # noqa: F401  (registers the pfppo:: ops)

            _OPS.append(torch.ops.pfppo if hasattr(torch.ops.pfppo, "pack_fingerprint") else None)
        except (ImportError, OSError, RuntimeError, AttributeError):
            _OPS.append(None)
    return _OPS[0]


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor as a flat uint8 tensor (no copy when contiguous)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _fingerprint_torch(t: torch.Tensor) -> torch.Tensor:
    """The fingerprint in torch ops (any device): see csrc/cpu/fingerprint.cpp for the definition.
    Row j of R contributes w_j to s1 and (R - j) w_j to s2 (int64 arithmetic wraps like uint64)."""
    b = _byte_view(t)
    row = 8 * FP_LANES
    full, rest = divmod(b.numel(), row)
    n_rows = full + (1 if rest else 0)
    s1 = torch.zeros(FP_LANES, dtype=torch.int64, device=b.device)
    s2 = torch.zeros(FP_LANES, dtype=torch.int64, device=b.device)
    if full:
        body = b[:full * row]
        if body.storage_offset() % 8:
            body = body.clone()
        words = body.view(torch.int64).view(full, FP_LANES)
        step = 1 << 16
        for a in range(0, full, step):
            w = words[a:a + step]
            weight = torch.arange(n_rows - a, n_rows - a - w.shape[0], -1, dtype=torch.int64, device=b.device)
            s1 += w.sum(0)
            s2 += (w * weight[:, None]).sum(0)
    if rest:
        tail = torch.zeros(row, dtype=torch.uint8, device=b.device)
        tail[:rest] = b[full * row:]
        w = tail.view(torch.int64)
        s1 += w
        s2 += w  # the last row has weight 1
    return torch.cat([s1, s2])


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """int64 [32] fingerprint of a tensor's bytes (same value on every device and path)."""
    ops = _native()
    if ops is not None and t.is_cpu:
        return ops.fingerprint(t.contiguous())  # never differentiated: the op falls through autograd
    return _fingerprint_torch(t)


def pack_fingerprint(flat: torch.Tensor, tensors: list[torch.Tensor]) -> torch.Tensor:
    """Copy ``tensors`` (flattened, in order, flat's dtype) into the contiguous ``flat`` and return
    the fingerprint of flat's bytes -- one pass over memory with the C++ op (on torch's intra-op
    threads), two without it. Parameters go in as they are: the op is never differentiated."""
    ops = _native()
    if ops is not None and flat.is_cpu and all(t.is_cpu for t in tensors):
        return ops.pack_fingerprint(flat, tensors)
    tensors = [t.detach() for t in tensors]
    for piece, t in zip(flat.split([t.numel() for t in tensors]), tensors):
        piece.copy_(t.reshape(-1))
    return fingerprint(flat)


def bucket_checksum(spec: BucketSpec, version: int, flat: torch.Tensor, fp: Optional[torch.Tensor] = None) -> str:
    """blake2b-128 over the header (index, version, names, shapes, dtype) and the fingerprint of the
    bytes (``fp`` when the caller already has it, e.g. from pack_fingerprint)."""
    digest = hashlib.blake2b(digest_size=CHECKSUM_BYTES // 2)
    digest.update(f"{spec.index}|{version}|{spec.names}|{spec.shapes}|{spec.dtype}|{spec.nbytes}|".encode())
    fp = fingerprint(flat) if fp is None else fp
    digest.update((fp if fp.is_cpu else fp.cpu()).numpy().tobytes())
    return digest.hexdigest()


# ------------------------------------------------------------------------------------- wire
def wire_nbytes(nbytes: int) -> int:
    """Bytes of a wire buffer for ``nbytes`` of weights: padded to 8, then the trailer."""
    return -(-nbytes // 8) * 8 + TRAILER_BYTES


def new_wire(nbytes: int, device: torch.device | str = "cpu", *, pin: bool = False) -> torch.Tensor:
    """A [wire_nbytes(nbytes)] uint8 wire buffer; ``pin``: on the host, page-locked exactly its size
    (pfppo_mega.pinned: torch's pinned allocator would hold the next power of two)."""
    if pin:
        if torch.device(device).type != "cpu":
            raise ValueError(f"new_wire: pin=True is for a host buffer, not device {device}")
        return pinned_empty(wire_nbytes(nbytes))
    return torch.empty(wire_nbytes(nbytes), dtype=torch.uint8, device=device)


def wire_flat(wire: torch.Tensor, spec: BucketSpec) -> torch.Tensor:
    """The typed [spec.numel] view of a wire buffer's bytes."""
    return wire[:spec.nbytes].view(spec.dtype)


def write_trailer(wire: torch.Tensor, version: int, checksum: str, *, ok: bool = True) -> None:
    raw = struct.pack("=qq", version, 1 if ok else -1) + (bytes.fromhex(checksum) if ok else bytes(16))
    if wire.is_cpu:  # written in place (two torch calls, not five: this runs once per bucket)
        memoryview(wire[-TRAILER_BYTES:].numpy())[:] = raw
    else:
        wire[-TRAILER_BYTES:].copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))


def read_trailer(wire: torch.Tensor) -> tuple[int, int, str]:
    """(version, flag, checksum) from a received wire buffer."""
    t = wire[-TRAILER_BYTES:].cpu()
    version, flag = t[:16].clone().view(torch.int64).tolist()
    return version, flag, t[16:].numpy().tobytes().hex()


def stream_checksum(bucket_checksums: Iterable[str]) -> str:
    """One checksum for a whole update: blake2b over the buckets' checksums in order."""
    digest = hashlib.blake2b(digest_size=CHECKSUM_BYTES // 2)
    for c in bucket_checksums:
        digest.update(c.encode())
    return digest.hexdigest()


@dataclass
class Bucket:
    """The bytes of ``spec`` for weight ``version``; checksum as taken by the producer."""

    spec: BucketSpec
    version: int
    flat: torch.Tensor  # [spec.numel] contiguous, spec.dtype
    checksum: str
    source_rank: int = 0  # the rank whose bytes these are (named in errors)
    wire: Optional[torch.Tensor] = field(default=None, repr=False)  # uint8: flat's bytes + trailer (new_wire)
    fingerprint: Optional[torch.Tensor] = field(default=None, repr=False)  # of freshly packed bytes (producer only)

    @classmethod
    def pack(cls, spec: BucketSpec, version: int, tensors: list[torch.Tensor], *,
             source_rank: int = 0, wire: Optional[torch.Tensor] = None) -> "Bucket":
        """``tensors`` (cast to spec.dtype) packed into ``wire`` (a fresh one when None), fingerprinted
        in the same pass, with checksum and trailer written."""
        for name, shape, t in zip(spec.names, spec.shapes, tensors):  # a strided view of the same numel
            if tuple(t.shape) != shape and t.numel() != math.prod(shape):  # packs as its row-major flattening
                raise WeightUpdateError(f"bucket {spec.index}: {name} has shape {tuple(t.shape)}, expected {shape}")
        if len(tensors) != len(spec.names):
            raise WeightUpdateError(f"bucket {spec.index}: {len(tensors)} tensors for {len(spec.names)} names")
        if wire is None:
            wire = new_wire(spec.nbytes, device=tensors[0].device)
        flat = wire_flat(wire, spec)
        fp = pack_fingerprint(flat, list(tensors))
        checksum = bucket_checksum(spec, version, flat, fp)
        write_trailer(wire, version, checksum)
        return cls(spec, version, flat, checksum, source_rank, wire, fp)

    def to_wire(self) -> torch.Tensor:
        """This bucket as one wire buffer (its own when it has one, else a packed copy)."""
        if self.wire is None:
            self.wire = new_wire(self.spec.nbytes, device=self.flat.device)
            wire_flat(self.wire, self.spec).copy_(self.flat)
            write_trailer(self.wire, self.version, self.checksum)
        return self.wire

    def verify(self, version: int) -> None:
        """Raise WeightUpdateError unless this bucket is of ``version`` and its bytes match."""
        if self.version != version:
            raise WeightUpdateError(
                f"bucket {self.spec.index} from rank {self.source_rank} is of weight version {self.version}, "
                f"the update is to version {version}: stale bucket refused")
        if self.flat.numel() != self.spec.numel or self.flat.dtype != self.spec.dtype:
            raise WeightUpdateError(
                f"bucket {self.spec.index} from rank {self.source_rank} holds {self.flat.numel()} x {self.flat.dtype}, "
                f"its spec says {self.spec.numel} x {self.spec.dtype}")
        got = bucket_checksum(self.spec, self.version, self.flat, self.fingerprint)
        if got != self.checksum:
            raise WeightUpdateError(
                f"bucket {self.spec.index} ({self.spec.names[0]} ..) from rank {self.source_rank} failed its "
                f"checksum for version {version}: received {got}, producer said {self.checksum}; corrupt bytes refused")


def check_named_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]], layout: WeightLayout,
                        version: int) -> dict[str, torch.Tensor]:
    """Strict check of a full set of weights against ``layout``: every name exactly once, nothing
    else, exact shapes (a tied lm_head.weight equal to the embedding is accepted and dropped).
    Returns name -> tensor; raises WeightUpdateError listing every problem."""
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise WeightUpdateError(f"weight version={version!r} must be an int >= 0")
    expected = layout.shapes
    received: dict[str, torch.Tensor] = {}
    duplicates: list[str] = []
    for name, tensor in named_tensors:
        if name in received:
            duplicates.append(name)
        received[name] = tensor
    tied_head = received.pop("lm_head.weight") if layout.tie_word_embeddings and "lm_head.weight" in received else None
    missing = [n for n in expected if n not in received]
    unexpected = [n for n in received if n not in expected]
    misshaped = [f"{n}: got {tuple(t.shape)}, expected {expected[n]}"
                 for n, t in received.items() if n in expected and tuple(t.shape) != expected[n]]
    problems = []
    if missing:
        problems.append("missing: " + ", ".join(f"{n} {expected[n]}" for n in missing))
    if unexpected:
        problems.append("unexpected: " + ", ".join(unexpected))
    if duplicates:
        problems.append("given more than once: " + ", ".join(duplicates))
    if misshaped:
        problems.append("wrong shape: " + "; ".join(misshaped))
    if tied_head is not None and not problems:
        embed = received["model.embed_tokens.weight"]
        if tied_head.shape != embed.shape or not torch.equal(tied_head, embed):
            problems.append("unexpected: lm_head.weight differs from model.embed_tokens.weight "
                            "but tie_word_embeddings=True")
    if problems:
        raise WeightUpdateError("load_weights(version=%d) rejected: %s" % (version, " | ".join(problems)))
    return received


class BucketReceiver:
    """The engine side of an update: verifies each bucket (version, checksum) and that the
    buckets, in order, cover the engine's layout exactly (same names, shapes and dtype), never
    splitting a fused group; at the end, that the stream was complete. Any plan that does so is
    accepted: the producer picks bucket boundaries (e.g. at pipeline-stage boundaries)."""

    def __init__(self, layout: WeightLayout, version: int) -> None:
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise WeightUpdateError(f"weight version={version!r} must be an int >= 0")
        self.layout, self.version = layout, version
        self.checksums: list[str] = []
        self.cursor = 0  # tensors of the layout received so far

    def accept(self, bucket: Bucket, *, verify: bool = True, views: bool = True) -> list[tuple[str, torch.Tensor]]:
        """Check the bucket's place in the layout and (verify=True) its version and checksum; returns
        its (name, view) pairs (an empty list with views=False). verify=False: the caller checks the
        bytes itself (or keeps none)."""
        spec, specs = bucket.spec, self.layout.specs
        want = specs[self.cursor:self.cursor + len(spec.names)]
        got = tuple(zip(spec.names, spec.shapes))
        if got != want or spec.dtype != self.layout.dtype:
            nxt = specs[self.cursor][0] if self.cursor < len(specs) else "nothing (the layout is complete)"
            raise WeightUpdateError(
                f"update to version {self.version}: bucket {spec.index} holds {list(got[:3])}.. in {spec.dtype}, "
                f"the engine expects {nxt} next in {self.layout.dtype}; the source used another layout")
        if self.cursor and fused_group(specs[self.cursor - 1][0]) == fused_group(spec.names[0]):
            raise WeightUpdateError(
                f"update to version {self.version}: bucket {spec.index} splits fused group "
                f"{fused_group(spec.names[0])!r}; vLLM must see q/k/v and gate/up of a layer in one call")
        if verify:
            bucket.verify(self.version)
        elif bucket.version != self.version:
            raise WeightUpdateError(
                f"bucket {spec.index} from rank {bucket.source_rank} is of weight version {bucket.version}, "
                f"the update is to version {self.version}: stale bucket refused")
        self.checksums.append(bucket.checksum)
        self.cursor += len(spec.names)
        return spec.split(bucket.flat) if views else []

    def finish(self) -> str:
        """The stream checksum; raises when tensors are missing (an interrupted refit)."""
        if self.cursor != len(self.layout.specs):
            raise WeightUpdateError(
                f"update to version {self.version} ended after {len(self.checksums)} bucket(s), "
                f"{self.cursor} of {len(self.layout.specs)} tensors (interrupted refit); "
                f"the engine's weights are incomplete")
        return stream_checksum(self.checksums)
