"""A weight version as one shared-memory file: how the trainer hands weights to the generator
process without pickling them through the pipe.

The trainer writes each new version once (``WeightFiles.write``) into a directory of its own under
/dev/shm (or ``<output_dir>/async_weights`` where /dev/shm is absent), then sends only
``(version, path)``; the generator maps the file (``read``: no copy until the engine loads it) and
gets the version's checksummed buckets back, whose bytes the engine verifies as it loads them.

File layout (little-endian):

    magic   8 bytes  b"PFPPOWV1"
    hlen    8 bytes  uint64, the header's length
    header  hlen     JSON: version, total file size, and per bucket: index, names, shapes, dtype,
                     offset (from the file's start, 64-aligned), checksum (the producer's)
    hsum    16 bytes blake2b-128 of the header
    pad              to 64 bytes
    data             each bucket as a wire buffer at its offset (its bytes, padded to 8, and the
                     32-byte trailer of rollout.weights: version, flag, checksum)

The trainer packs the actor's weights straight into a shared mapping of the file (``pack``: the
one copy the bucket stream makes anyway), so pushing a version costs no copy more than the
engines' own refit.

A file is written under a temporary name and renamed (a reader never sees half of one); ``read``
still refuses, naming the file, one whose magic, size or header checksum is wrong (torn, truncated,
overwritten) or whose version is not the one announced (stale). Files of versions the pool evicts
are removed by ``WeightFiles.remove``; ``close`` removes the directory (nothing left behind).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Callable, Optional

import torch

from pfppo_mega.rollout.weights import CHECKSUM_BYTES, Bucket, BucketSpec, wire_flat, wire_nbytes, write_trailer

MAGIC = b"PFPPOWV1"
ALIGN = 64
SHM = Path("/dev/shm")
_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}


class WeightFileError(ValueError):
    """A weight file was refused: missing, torn, corrupt, or of another version (the message names it)."""


class WeightFileMissing(WeightFileError):
    """The weight file is not there (removed when its version left the pool)."""


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _header(version: int, specs: list[BucketSpec], checksums: list[str]) -> tuple[bytes, list[int], int]:
    """(header JSON, each bucket's offset, total file size). Each bucket gets a wire's room
    (rollout.weights.wire_nbytes: its bytes padded to 8, then a trailer) so a source can pack into
    it. Offsets depend on the header's length, fixed after at most three passes; checksums are of
    fixed length, so a header with placeholders has the length of the final one."""
    entries = [{"index": s.index, "names": list(s.names), "shapes": [list(x) for x in s.shapes], "dtype": str(s.dtype),
                "checksum": c} for s, c in zip(specs, checksums)]
    offsets, size, raw = [], 0, b""
    for _ in range(3):
        pos = _align(len(MAGIC) + 8 + len(raw) + 16)
        offsets = []
        for spec in specs:
            offsets.append(pos)
            pos = _align(pos + wire_nbytes(spec.nbytes))
        size = pos
        for e, off in zip(entries, offsets):
            e["offset"] = off
        new = json.dumps({"version": version, "size": size, "buckets": entries}, separators=(",", ":")).encode()
        if new == raw:
            break
        raw = new
    return raw, offsets, size


Produce = Callable[[BucketSpec, torch.Tensor], Optional[Bucket]]


def pack(path: Path, version: int, specs: list[BucketSpec], produce: Produce) -> None:
    """Write version ``version`` to ``path`` by letting ``produce(spec, wire)`` pack each bucket
    straight into its place in a shared mapping of the file (one copy from the weights; e.g.
    rollout.live.LiveWeights.produce), then the header; atomically (a temporary file, renamed)."""
    raw, offsets, size = _header(version, specs, ["0" * CHECKSUM_BYTES] * len(specs))
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.truncate(size)
    try:
        checksums = _fill(tmp, size, version, specs, offsets, produce)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    final, again, _ = _header(version, specs, checksums)
    assert len(final) == len(raw) and again == offsets, "a weight file's header changed length"
    with open(tmp, "r+b") as f:
        f.write(MAGIC + struct.pack("<Q", len(final)) + final + hashlib.blake2b(final, digest_size=16).digest())
    os.replace(tmp, path)


def _fill(tmp: Path, size: int, version: int, specs: list[BucketSpec], offsets: list[int],
          produce: Produce) -> list[str]:
    data = torch.from_file(str(tmp), shared=True, size=size, dtype=torch.uint8)            # [size] shared mapping
    checksums = []
    for spec, off in zip(specs, offsets):
        b = produce(spec, data[off:off + wire_nbytes(spec.nbytes)])
        if b is None or b.version != version or b.flat.data_ptr() != data[off:].data_ptr():
            raise WeightFileError(f"{tmp}: bucket {spec.index} was not packed in place as version {version}")
        checksums.append(b.checksum)
    return checksums


def write(path: Path, version: int, buckets: list[Bucket]) -> None:
    """Write ``buckets`` (all of ``version``, e.g. a pool's) to ``path`` (``pack`` copying each)."""
    by_index = {b.spec.index: b for b in buckets}
    for b in buckets:
        if b.version != version:
            raise WeightFileError(f"{path}: bucket {b.spec.index} is of version {b.version}, the file of {version}")

    def copy(spec: BucketSpec, wire: torch.Tensor) -> Bucket:
        b = by_index[spec.index]
        wire_flat(wire, spec).copy_(b.flat)
        write_trailer(wire, version, b.checksum)
        return Bucket(spec, version, wire_flat(wire, spec), b.checksum)

    pack(path, version, [b.spec for b in buckets], copy)


def read(path: str | Path, version: int) -> list[Bucket]:
    """The buckets of ``path``, views of a private mapping of it (bytes read on first touch).
    Raises WeightFileError naming the file when it is missing, torn or not of ``version``."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(len(MAGIC) + 8)
            if len(head) < len(MAGIC) + 8 or head[:len(MAGIC)] != MAGIC:
                raise WeightFileError(f"weight file {path}: not a weight file (bad magic): torn or overwritten; "
                                      "refused")
            (hlen,) = struct.unpack("<Q", head[len(MAGIC):])
            raw, hsum = f.read(hlen), f.read(16)
            actual = os.fstat(f.fileno()).st_size
    except FileNotFoundError as e:
        raise WeightFileMissing(f"weight file {path} (version {version}) is missing; refused") from e
    if len(raw) != hlen or hashlib.blake2b(raw, digest_size=16).digest() != hsum:
        raise WeightFileError(f"weight file {path}: header checksum mismatch: torn or corrupt; refused")
    header = json.loads(raw)
    if header["version"] != version:
        raise WeightFileError(f"weight file {path} holds version {header['version']}, version {version} was "
                              f"announced: stale file refused")
    if actual != header["size"]:
        raise WeightFileError(f"weight file {path}: {actual} bytes, its header says {header['size']}: torn; refused")
    data = torch.from_file(str(path), shared=False, size=actual, dtype=torch.uint8)  # [size] mapped, copy-on-write
    out = []
    for e in header["buckets"]:
        dtype = _DTYPES.get(e["dtype"])
        if dtype is None:
            raise WeightFileError(f"weight file {path}: bucket {e['index']} has dtype {e['dtype']!r}; refused")
        spec = BucketSpec(e["index"], tuple(e["names"]), tuple(tuple(s) for s in e["shapes"]), dtype)
        flat = data[e["offset"]:e["offset"] + spec.nbytes].view(dtype)                  # [numel]
        out.append(Bucket(spec, version, flat, e["checksum"]))
    return out


def weights_dir(output_dir: Optional[str | Path]) -> Path:
    """A fresh directory for one run's weight files: under /dev/shm when it exists and is writable,
    else under ``<output_dir>/async_weights``."""
    if SHM.is_dir() and os.access(SHM, os.W_OK):
        parent = SHM
    else:
        parent = Path(output_dir or ".") / "async_weights"
        parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"pfppo-weights-{os.getpid()}-", dir=parent))


class WeightFiles:
    """The trainer's weight files, one per version held by the pool."""

    def __init__(self, output_dir: Optional[str | Path] = None) -> None:
        self.output_dir = output_dir
        self.root: Optional[Path] = None

    def path(self, version: int) -> Path:
        if self.root is None:
            self.root = weights_dir(self.output_dir)
        return self.root / f"v{version}.weights"

    def write(self, version: int, buckets: list[Bucket]) -> str:
        p = self.path(version)
        write(p, version, buckets)
        return str(p)

    def pack(self, version: int, specs: list[BucketSpec], produce: Produce) -> str:
        p = self.path(version)
        pack(p, version, specs, produce)
        return str(p)

    def remove(self, versions: list[int]) -> None:
        """The files of versions the pool evicted (a generator that mapped one keeps its pages)."""
        if self.root is None:
            return
        for v in versions:
            self.path(v).unlink(missing_ok=True)

    def close(self) -> None:
        """Remove every file and the directory (idempotent)."""
        root, self.root = self.root, None
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)
