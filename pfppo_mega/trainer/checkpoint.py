"""Atomic, verified training checkpoints.

Layout: ``<dir>/step_000040/`` holding ``*.safetensors`` (model weights), ``state.pt`` (optimizer,
RNG, counters) and ``manifest.json`` (sha256 and size of every file). A checkpoint is written
into ``step_000040.tmp-<pid>``, every file fsynced, then renamed into place, and only then is
``latest`` (a one-line pointer file, itself replaced atomically) moved to it. A crash or kill
at any point leaves the previous checkpoint and pointer intact. Loading verifies every file
against the manifest; a corrupt newest checkpoint is reported and the previous one is used.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

MANIFEST = "manifest.json"
LATEST = "latest"
_STEP_DIR = re.compile(r"^step_(\d{6,})$")


class CheckpointError(RuntimeError):
    pass


@dataclass
class Checkpoint:
    step: int
    path: Path
    tensors: dict[str, dict[str, torch.Tensor]]  # group name -> state dict (e.g. "actor", "critic")
    state: dict[str, Any]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def save_checkpoint(
    root: Path, step: int, tensors: dict[str, dict[str, torch.Tensor]], state: dict[str, Any],
    *, keep_last: int,
) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f"{final.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    files = []
    for group, sd in tensors.items():
        name = f"{group}.safetensors"
        # safetensors refuses shared or non-contiguous storage: give it private contiguous copies.
        save_file({k: v.detach().contiguous().clone() for k, v in sd.items()}, str(tmp / name))
        files.append(name)
    torch.save(state, tmp / "state.pt")
    files.append("state.pt")
    for name in files:
        _fsync_file(tmp / name)
    manifest = {"step": step, "files": {n: {"sha256": _sha256(tmp / n), "bytes": (tmp / n).stat().st_size}
                                        for n in files}}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
    _fsync_file(tmp / MANIFEST)
    _fsync_dir(tmp)
    if final.exists():  # a re-save of the same step (e.g. after resume): replace it whole
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    _atomic_write_text(root / LATEST, final.name + "\n")
    _prune(root, keep_last)
    return final


def _step_dirs(root: Path) -> list[Path]:
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)] if root.exists() else []
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def _prune(root: Path, keep_last: int) -> None:
    for stale in root.glob("step_*.tmp-*"):  # left by a killed writer
        shutil.rmtree(stale, ignore_errors=True)
    dirs = _step_dirs(root)
    for old in dirs[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def verify(path: Path) -> None:
    """Raise CheckpointError unless every file matches the manifest."""
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(f"{path}: no {MANIFEST} (incomplete write?)")
    try:
        manifest = json.loads(mpath.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{mpath}: unreadable manifest ({e})") from e
    for name, meta in manifest["files"].items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{path}: file {name} listed in the manifest is missing")
        if f.stat().st_size != meta["bytes"]:
            raise CheckpointError(f"{f}: size {f.stat().st_size} != manifest {meta['bytes']}")
        if _sha256(f) != meta["sha256"]:
            raise CheckpointError(f"{f}: sha256 mismatch (corrupted)")


def _candidates(root: Path) -> list[Path]:
    """Step dirs up to the one `latest` names (a newer dir without the pointer moved is not trusted
    first, but is still a candidate below it only if older), oldest first."""
    candidates = _step_dirs(root)
    pointer = root / LATEST
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if named in candidates:
            limit = int(_STEP_DIR.match(named.name).group(1))
            candidates = [c for c in candidates if int(_STEP_DIR.match(c.name).group(1)) <= limit]
    return candidates


def latest_valid_step(root: Path, *, log=print) -> int | None:
    """The newest step whose checkpoint verifies (corrupt ones are reported), or None."""
    for path in reversed(_candidates(root)):
        try:
            verify(path)
        except CheckpointError as e:
            log(f"[checkpoint] skipping {path.name}: {e}")
            continue
        return int(_STEP_DIR.match(path.name).group(1))
    return None


def load_step(root: Path, step: int) -> Checkpoint:
    """Load (and verify) the checkpoint of `step`."""
    path = root / f"step_{step:06d}"
    verify(path)
    tensors = {f.stem: load_file(str(f)) for f in sorted(path.glob("*.safetensors"))}
    state = torch.load(path / "state.pt", weights_only=False)
    return Checkpoint(step=step, path=path, tensors=tensors, state=state)


def load_latest(root: Path, *, log=print) -> Checkpoint | None:
    """The newest checkpoint that verifies, or None when there is none. Corrupt ones are reported."""
    step = latest_valid_step(root, log=log)
    return None if step is None else load_step(root, step)
