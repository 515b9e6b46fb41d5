"""Atomic, verified training checkpoints that hold data only (nothing is ever unpickled).

Layout of ``<dir>/step_000040/``:
  ``<group>.safetensors``  model weights, one file per group ("actor", "critic", "pool", ...);
  ``state.json``           everything else as JSON: counters, config, optimizer hyper-parameters,
                           with every tensor replaced by a reference into ``state.safetensors``;
  ``state.safetensors``    the tensors of the state (optimizer moments, RNG states as uint8, ...);
  ``manifest.json``        ``{"format": 2, "step": 40, "files": {name: {"sha256", "bytes"}}}``.

With ``parallel.use_distributed_optimizer`` each optimizer's entry of ``state.json`` is
``{"distributed_optimizer": [{"state_dict", "param_state"}]}``: megatron's non-parameter state and
the parameter state (fp32 main params, exp_avg, exp_avg_sq per grad buffer) gathered over the
data-parallel ranks to dp_rank 0, which writes it; on resume dp_rank 0 scatters it back.

Loading reads JSON and safetensors only. A checkpoint is refused (CheckpointError, which names
the file, the value and the rule) when its manifest does not follow the schema above, when the
manifest's step is not the directory's, when any entry of the directory is not listed in the
manifest (or is not a regular file), when a listed file is missing, has another size or sha256,
or is neither ``.json`` nor ``.safetensors``. Older checkpoints (format 1, a pickled ``state.pt``)
are refused, never loaded.

Writing: into ``step_000040.tmp-<pid>``, every file fsynced, renamed into place, and only then is
``latest`` (a one-line pointer file, itself replaced atomically) moved to it. Re-saving a step
that already exists moves the old directory aside (``.step_000040.old-<pid>``) and deletes it only
once the new one is in place and ``latest`` names it; a kill in between is repaired on load (the
aside directory is moved back). A crash or kill at any point leaves the checkpoint ``latest``
names loadable. After a save, temporary and
aside directories and ``.latest.tmp-*`` files left by killed writers are removed, and so are step
directories newer than the saved step (a superseded timeline ``latest`` can no longer name).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import stat
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

MANIFEST = "manifest.json"
LATEST = "latest"
FORMAT = 2
STATE_JSON = "state.json"
STATE_TENSORS = "state.safetensors"
_STEP_DIR = re.compile(r"^step_(\d{6,})$")
_GROUP = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_FILE = re.compile(r"^[A-Za-z0-9_-]{1,64}\.(json|safetensors)$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_RUN_ID = re.compile(r"^[0-9a-f]{32}$")  # uuid4().hex: the run that wrote a checkpoint (made at its first save)
_MAX_JSON_BYTES = 64 << 20  # a manifest or state.json larger than this is not ours
# JSON markers for what JSON has no type for (a key starting with "__" is reserved for them).
_TENSOR, _TUPLE, _INTDICT = "__tensor__", "__tuple__", "__intdict__"


class CheckpointError(ValueError):
    """A checkpoint that cannot be trusted or does not fit the run (the message says why)."""


class PartBindingError(CheckpointError):
    """A part of a sharded step that another run or another step wrote: the step's parts are not one
    save. Refused (not a fallback to an older step): someone put it there, and must decide."""


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


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a fsynced temp file and a rename (readers see old or new)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


# ---------------------------------------------------------------------------- state <-> data


def encode_state(obj: Any, tensors: dict[str, torch.Tensor], path: str = "") -> Any:
    """A JSON-able copy of `obj` (dicts, lists, tuples, str, int, float, bool, None, tensors);
    each tensor goes into `tensors` under its path and is replaced by {"__tensor__": path}."""
    if isinstance(obj, torch.Tensor):
        if path in tensors:
            raise CheckpointError(f"state {path}: two tensors map to this path (a key holding '/'?)")
        tensors[path] = obj.detach()
        return {_TENSOR: path}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, (list, tuple)):
        items = [encode_state(v, tensors, f"{path}/{i}") for i, v in enumerate(obj)]
        return {_TUPLE: items} if isinstance(obj, tuple) else items
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            bad = [k for k in obj if k.startswith("__")]
            if bad:
                raise CheckpointError(f"state key {path}/{bad[0]}: keys starting with '__' are reserved")
            return {k: encode_state(v, tensors, f"{path}/{k}") for k, v in obj.items()}
        if all(isinstance(k, int) and not isinstance(k, bool) for k in obj):
            return {_INTDICT: [[k, encode_state(v, tensors, f"{path}/{k}")] for k, v in obj.items()]}
        raise CheckpointError(f"state {path or '/'}: dict keys must be all str or all int, got "
                              f"{sorted({type(k).__name__ for k in obj})}")
    raise CheckpointError(f"state {path or '/'}: a {type(obj).__name__} cannot be stored as data "
                          f"(allowed: tensor, dict, list, tuple, str, int, float, bool, None)")


def decode_state(obj: Any, tensors: dict[str, torch.Tensor], used: set[str], where: str) -> Any:
    """Inverse of encode_state; every marker is checked (`where` names the file in messages)."""
    if isinstance(obj, list):
        return [decode_state(v, tensors, used, where) for v in obj]
    if not isinstance(obj, dict):
        return obj
    marked = [k for k in obj if k.startswith("__")]
    if not marked:
        return {k: decode_state(v, tensors, used, where) for k, v in obj.items()}
    if len(obj) != 1 or marked[0] not in (_TENSOR, _TUPLE, _INTDICT):
        raise CheckpointError(f"{where}: object with keys {sorted(obj)[:5]}: a key starting with '__' must be "
                              f"the only key and one of {[_TENSOR, _TUPLE, _INTDICT]}")
    (key, value), = obj.items()
    if key == _TENSOR:
        if not isinstance(value, str) or value not in tensors:
            raise CheckpointError(f"{where}: tensor reference {value!r} is not in {STATE_TENSORS}")
        used.add(value)
        return tensors[value]
    if key == _TUPLE:
        if not isinstance(value, list):
            raise CheckpointError(f"{where}: {_TUPLE} must hold a list, got {type(value).__name__}")
        return tuple(decode_state(v, tensors, used, where) for v in value)
    if not (isinstance(value, list) and all(isinstance(p, list) and len(p) == 2 and type(p[0]) is int
                                            for p in value)):
        raise CheckpointError(f"{where}: {_INTDICT} must hold a list of [int, value] pairs")
    return {k: decode_state(v, tensors, used, where) for k, v in value}


# ---------------------------------------------------------------------------- save


def _private(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU tensors that each own their whole storage, as safetensors needs. Only views, shared or
    non-contiguous tensors are copied: a pool of private host snapshots is not duplicated."""
    out, seen = {}, set()
    for k, v in sd.items():
        v = v.detach().cpu()
        storage = v.untyped_storage()
        if (not v.is_contiguous() or v.storage_offset() or storage.nbytes() != v.numel() * v.element_size()
                or storage.data_ptr() in seen):
            v = v.contiguous().clone()
        seen.add(v.untyped_storage().data_ptr())
        out[k] = v
    return out


def write_dir(path: Path, step: int, tensors: dict[str, dict[str, torch.Tensor]], state: dict[str, Any],
              *, threads: int = 1, run_id: str | None = None) -> dict[str, Any]:
    """Write `tensors` (group -> name -> tensor) and `state` into the new directory `path` with its
    manifest, every file fsynced and hashed from what is on disk (read back). Returns the manifest.
    `run_id`: the run this part belongs to, recorded in the manifest (a sharded step's parts)."""
    bad = [g for g in tensors if not _GROUP.match(g) or g == "state"]
    if bad:
        raise CheckpointError(f"tensor group {bad[0]!r}: must match {_GROUP.pattern} and not be 'state'")
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    state_tensors: dict[str, torch.Tensor] = {}
    state_json = json.dumps(encode_state(state, state_tensors), allow_nan=True)
    files = []
    for group, sd in {**tensors, "state": state_tensors}.items():
        name = f"{group}.safetensors"
        save_file(_private(sd), str(path / name))
        files.append(name)
    (path / STATE_JSON).write_text(state_json)
    files.append(STATE_JSON)
    for name in files:
        _fsync_file(path / name)
    digests = _hash_files([path / n for n in files], threads)
    manifest = {"format": FORMAT, "step": step,
                "files": {n: {"sha256": digests[i], "bytes": (path / n).stat().st_size} for i, n in enumerate(files)}}
    if run_id is not None:
        manifest["run_id"] = _check_run_id(run_id, "write_dir")
    tmp = path / f".{MANIFEST}.tmp"  # the manifest appears whole or not at all
    tmp.write_text(json.dumps(manifest, indent=2))
    _fsync_file(tmp)
    os.replace(tmp, path / MANIFEST)
    _fsync_dir(path)
    return manifest


def _hash_files(paths: list[Path], threads: int) -> list[str]:
    """sha256 of each file, `threads` at a time (hashlib releases the GIL on large reads)."""
    if threads <= 1 or len(paths) <= 1:
        return [_sha256(f) for f in paths]
    with ThreadPoolExecutor(max_workers=min(threads, len(paths))) as pool:
        return list(pool.map(_sha256, paths))


def _publish(root: Path, step: int, tmp: Path, *, keep_last: int, keep: frozenset[str] = frozenset()) -> Path:
    """Move the finished directory `tmp` to step `step` and point `latest` at it (see the module
    docstring for the order that keeps `latest` loadable through a kill)."""
    final = root / f"step_{step:06d}"
    aside = None
    if final.exists():  # a re-save of this step: keep the old one until the new one is in place
        aside = root / f".{final.name}.old-{os.getpid()}"
        if aside.exists():
            shutil.rmtree(aside)
        os.rename(final, aside)
    os.replace(tmp, final)
    _fsync_dir(root)
    atomic_write_bytes(root / LATEST, (final.name + "\n").encode())
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    _prune(root, keep_last, saved_step=step, keep=keep)
    return final


def save_checkpoint(
    root: Path, step: int, tensors: dict[str, dict[str, torch.Tensor]], state: dict[str, Any],
    *, keep_last: int,
) -> Path:
    """Write `tensors` (group -> name -> tensor) and `state` (data + tensors) as step `step`."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"step_{step:06d}.tmp-{os.getpid()}"
    write_dir(tmp, step, tensors, state)
    return _publish(root, step, tmp, keep_last=keep_last)


def _step_of(path: Path) -> int:
    return int(_STEP_DIR.match(path.name).group(1))


def _step_dirs(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p.is_dir() or p.is_symlink())]
    return sorted(found, key=_step_of)


def _prune(root: Path, keep_last: int, *, saved_step: int, keep: frozenset[str] = frozenset()) -> None:
    """Remove what killed writers left (but not the temp dirs named in `keep`: saves still in
    flight), step dirs newer than the one `latest` now names, and all but the newest keep_last."""
    for stale in [*root.glob("step_*.tmp-*"), *root.glob(".step_*.old-*")]:
        m = re.match(r"^\.?step_(\d+)\.", stale.name)
        if stale.name not in keep and not (m and int(m.group(1)) > saved_step):  # a later save may be writing
            shutil.rmtree(stale, ignore_errors=True)
    for stale in root.glob(f".{LATEST}.tmp-*"):
        stale.unlink(missing_ok=True)
    dirs = _step_dirs(root)
    for newer in (d for d in dirs if _step_of(d) > saved_step):
        shutil.rmtree(newer, ignore_errors=True)
    dirs = [d for d in dirs if _step_of(d) <= saved_step]
    for old in dirs[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------------- verify / load


def _regular_file(path: Path, missing: str) -> os.stat_result:
    """lstat of `path`; CheckpointError(missing) when absent, or when not a regular file."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise CheckpointError(missing) from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{path}: must be a regular file (not a link, directory or device)")
    return st


def _read_json(path: Path, what: str) -> Any:
    """JSON of a regular file (never follows a symlink); any failure -> CheckpointError."""
    st = _regular_file(path, f"{path}: no {what} (incomplete write?)")
    if st.st_size > _MAX_JSON_BYTES:
        raise CheckpointError(f"{path}: {what} has {st.st_size} bytes > {_MAX_JSON_BYTES}")
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{path}: unreadable {what} ({type(e).__name__}: {str(e)[:200]})") from None


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of checkpoint dir `path`, its schema checked (not the files)."""
    mpath = path / MANIFEST
    m = _read_json(mpath, MANIFEST)
    if not isinstance(m, dict):
        raise CheckpointError(f"{mpath}: must be a JSON object {{format, step, files}}, got {type(m).__name__}")
    if m.get("format") != FORMAT:
        if "format" not in m and isinstance(m.get("files"), dict) and "state.pt" in m["files"]:
            raise CheckpointError(f"{mpath}: format 1 (a pickled state.pt) is never loaded, since unpickling "
                                  f"can run code; resume from a checkpoint written by this version")
        raise CheckpointError(f"{mpath}: format = {m.get('format')!r}, must be {FORMAT}")
    if set(m) - {"run_id"} != {"format", "step", "files"}:
        raise CheckpointError(f"{mpath}: keys {sorted(m)} must be exactly ['files', 'format', 'step'] "
                              f"(and 'run_id' in a sharded step's part)")
    _check_run_id(m.get("run_id"), f"{mpath}: run_id")
    step, files = m["step"], m["files"]
    if type(step) is not int or step < 0:
        raise CheckpointError(f"{mpath}: step = {step!r} must be an integer >= 0")
    dir_match = _STEP_DIR.match(path.name)
    if dir_match and int(dir_match.group(1)) != step:
        raise CheckpointError(f"{mpath}: step = {step} but the directory is {path.name}: they must agree")
    if not isinstance(files, dict) or not files:
        raise CheckpointError(f"{mpath}: files must be a non-empty object {{name: {{sha256, bytes}}}}, "
                              f"got {type(files).__name__}")
    for name, meta in files.items():
        if not _FILE.match(name) or name == MANIFEST:
            raise CheckpointError(f"{mpath}: file name {name!r} is not allowed: only plain names ending in "
                                  f".safetensors or .json (other than {MANIFEST}) are loaded")
        if not (isinstance(meta, dict) and set(meta) == {"sha256", "bytes"} and isinstance(meta["sha256"], str)
                and _SHA256.match(meta["sha256"]) and type(meta["bytes"]) is int and meta["bytes"] >= 0):
            raise CheckpointError(f"{mpath}: entry of {name!r} = {str(meta)[:120]} must be "
                                  f"{{\"sha256\": <64 hex digits>, \"bytes\": <int >= 0>}}")
    for need in (STATE_JSON, STATE_TENSORS):
        if need not in files:
            raise CheckpointError(f"{mpath}: {need} is not listed (every checkpoint has one)")
    return m


def verify(path: Path, *, threads: int = 1, hash_files: bool = True) -> dict[str, Any]:
    """Raise CheckpointError unless the manifest is well-formed, the directory holds exactly the
    files it lists (plus itself), all regular files, each with its size and sha256. Returns it."""
    if path.is_symlink() or not path.is_dir():
        raise CheckpointError(f"{path}: must be a directory, not a link or a file")
    manifest = read_manifest(path)
    files = manifest["files"]
    for entry in os.scandir(path):
        if entry.name != MANIFEST and entry.name not in files:
            raise CheckpointError(f"{path}: {entry.name!r} is not listed in {MANIFEST}; a checkpoint holds "
                                  f"only the files its manifest lists (refusing the whole checkpoint)")
    for name, meta in files.items():
        f = path / name
        st = _regular_file(f, f"{path}: file {name} listed in the manifest is missing")
        if st.st_size != meta["bytes"]:
            raise CheckpointError(f"{f}: size {st.st_size} != manifest {meta['bytes']}")
    if hash_files:
        check_hashes([(path / n, files[n]["sha256"]) for n in files], threads)
    return manifest


def check_hashes(expected: list[tuple[Path, str]], threads: int) -> None:
    """Every file's sha256 against its manifest's, `threads` files at a time."""
    for (f, want), digest in zip(expected, _hash_files([f for f, _ in expected], threads)):
        if digest != want:
            raise CheckpointError(f"{f}: sha256 mismatch (corrupted)")


def _pointer_step(root: Path, log) -> int | None:
    """The step `latest` names, or None (no pointer, or one that is not a step dir name)."""
    pointer = root / LATEST
    if not pointer.exists() and not pointer.is_symlink():
        return None
    try:
        if pointer.is_symlink() or not pointer.is_file() or pointer.stat().st_size > 256:
            raise CheckpointError("not a small regular file")
        name = pointer.read_bytes().decode("ascii").strip()
        m = _STEP_DIR.match(name)
        if not m:
            raise CheckpointError(f"content {name[:40]!r} is not a step_NNNNNN name")
    except (CheckpointError, UnicodeDecodeError) as e:
        log(f"[checkpoint] ignoring {pointer}: {e}")
        return None
    return int(m.group(1))


def _candidates(root: Path, log=print) -> list[Path]:
    """Step dirs up to the step `latest` names, oldest first. A newer dir was never pointed to (or
    belongs to a superseded timeline) and is not trusted. If the named dir is missing because a
    re-save was killed after moving it aside, it is moved back first."""
    limit = _pointer_step(root, log)
    if limit is not None:
        named = root / f"step_{limit:06d}"
        for aside in sorted(root.glob(f".{named.name}.old-*")) if not named.is_dir() else []:
            try:  # a re-save was killed between moving the old dir aside and moving the new one in
                os.rename(aside, named)
            except OSError:
                continue
            log(f"[checkpoint] restored {named.name} from {aside.name} (an interrupted re-save)")
            break
    candidates = _step_dirs(root)
    if limit is not None:
        candidates = [c for c in candidates if _step_of(c) <= limit]
    return candidates


def step_dirs(root: Path) -> list[Path]:
    """Every step directory under root, oldest first (valid or not)."""
    return _step_dirs(root)


def latest_valid_step(root: Path, *, log=print) -> int | None:
    """The newest step whose checkpoint verifies (refused ones are reported), or None."""
    for path in reversed(_candidates(root, log)):
        try:
            verify(path)
        except CheckpointError as e:
            log(f"[checkpoint] skipping {path.name}: {e}")
            continue
        return _step_of(path)
    return None


def _load_safetensors(f: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(f))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{f}: not a readable safetensors file ({type(e).__name__}: {str(e)[:200]})") from None


def load_step(root: Path, step: int) -> Checkpoint:
    """Load (and verify) the checkpoint of `step`: JSON and safetensors only."""
    path = root / f"step_{step:06d}"
    return load_dir(path, verify(path), step)


def load_dir(path: Path, manifest: dict[str, Any], step: int, *, groups: bool = True) -> Checkpoint:
    """Load the directory `path` whose files `manifest` (verify's result) lists: not hashed again.
    groups=False: the state only (the tensor groups are left on disk, `tensors` is empty)."""
    names = sorted(manifest["files"])
    tensors = {n[: -len(".safetensors")]: _load_safetensors(path / n)
               for n in names if groups and n.endswith(".safetensors") and n != STATE_TENSORS}
    extra_json = [n for n in names if n.endswith(".json") and n != STATE_JSON]
    if extra_json:
        raise CheckpointError(f"{path}: unexpected JSON file(s) {extra_json}: only {STATE_JSON} is read")
    flat = _load_safetensors(path / STATE_TENSORS)
    used: set[str] = set()
    state = decode_state(_read_json(path / STATE_JSON, STATE_JSON), flat, used, str(path / STATE_JSON))
    if not isinstance(state, dict):
        raise CheckpointError(f"{path / STATE_JSON}: must hold a JSON object, got {type(state).__name__}")
    unused = sorted(set(flat) - used)
    if unused:
        raise CheckpointError(f"{path / STATE_TENSORS}: tensors {unused[:5]} are referenced by nothing in "
                              f"{STATE_JSON}")
    return Checkpoint(step=step, path=path, tensors=tensors, state=state)


def load_latest(root: Path, *, log=print) -> Checkpoint | None:
    """The newest checkpoint that verifies, or None when there is none. Refused ones are reported."""
    step = latest_valid_step(root, log=log)
    return None if step is None else load_step(root, step)


# ---------------------------------------------------------------------------- sharded (format 3)
# A step directory of a sharded checkpoint holds one part per rank (``tp<t>-pp<p>-dp<d>``), each
# a directory in the format above (its own files and format-2 manifest, written by that rank),
# and one global ``manifest.json`` written last, by rank 0, once every part's manifest is on disk:
#   {"format": 3, "step": 40, "run_id": <32 hex>, "layout": {"tp", "pp", "dp", "local_world"},
#    "parts": {"tp0-pp0-dp0": {"sha256": <of the part's manifest.json>, "bytes": <its files' bytes>}, ...}}
# The part's manifest holds the sha256 of each of its files, so the global manifest pins every byte;
# it also names the run and the step that wrote it (check_binding), so a part of another save is
# refused by name even when the global manifest was re-signed around it.
FORMAT_SHARDED = 3
_PART_NAME = re.compile(r"^tp(\d+)-pp(\d+)-dp(\d+)$")
_LAYOUT_KEYS = ("tp", "pp", "dp", "local_world")


def part_name(tp_rank: int, pp_rank: int, dp_rank: int) -> str:
    return f"tp{tp_rank}-pp{pp_rank}-dp{dp_rank}"


def part_coords(name: str) -> tuple[int, int, int]:
    m = _PART_NAME.match(name)
    if not m:
        raise CheckpointError(f"part {name!r}: must be named tp<T>-pp<P>-dp<D>")
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def part_digest(part: Path) -> dict[str, Any]:
    """{"sha256": of the part's manifest, "bytes": its files' bytes}: the part's entry in the global manifest."""
    m = read_manifest(part)
    return {"sha256": _sha256(part / MANIFEST), "bytes": sum(f["bytes"] for f in m["files"].values())}


def _check_run_id(run_id: Any, where: str) -> Any:
    if run_id is not None and not (isinstance(run_id, str) and _RUN_ID.match(run_id)):
        raise CheckpointError(f"{where} = {str(run_id)[:80]!r} must be 32 lowercase hex digits (a uuid4)")
    return run_id


def write_sharded_manifest(tmp: Path, step: int, layout: dict[str, int], parts: dict[str, dict[str, Any]],
                           run_id: str | None = None) -> None:
    manifest = {"format": FORMAT_SHARDED, "step": step, "layout": dict(layout), "parts": parts}
    if run_id is not None:
        manifest["run_id"] = _check_run_id(run_id, "write_sharded_manifest")
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
    _fsync_file(tmp / MANIFEST)
    _fsync_dir(tmp)


def commit_sharded(root: Path, step: int, tmp: Path, layout: dict[str, int], parts: dict[str, dict[str, Any]],
                   *, keep_last: int, keep: frozenset[str] = frozenset(), run_id: str | None = None) -> Path:
    """Rank 0, once every part of `tmp` is on disk: the global manifest, then the rename and `latest`."""
    write_sharded_manifest(tmp, step, layout, parts, run_id)
    return _publish(root, step, tmp, keep_last=keep_last, keep=keep)


def manifest_format(path: Path) -> Any:
    """The "format" a step directory's manifest claims (None when unreadable): which reader applies."""
    try:
        m = _read_json(path / MANIFEST, MANIFEST)
    except CheckpointError:
        return None
    return m.get("format") if isinstance(m, dict) else None


def read_sharded_manifest(path: Path) -> dict[str, Any]:
    """The global manifest of sharded step directory `path`, its schema and the directory listing
    checked (not the parts' files: verify_part does that, for the parts a rank reads)."""
    mpath = path / MANIFEST
    m = _read_json(mpath, MANIFEST)
    if not isinstance(m, dict) or m.get("format") != FORMAT_SHARDED:
        got = m.get("format") if isinstance(m, dict) else type(m).__name__
        raise CheckpointError(f"{mpath}: format = {got!r}, a sharded checkpoint has format {FORMAT_SHARDED}")
    if set(m) - {"run_id"} != {"format", "step", "layout", "parts"}:
        raise CheckpointError(f"{mpath}: keys {sorted(m)} must be exactly ['format', 'layout', 'parts', 'step'] "
                              f"and 'run_id'")
    _check_run_id(m.get("run_id"), f"{mpath}: run_id")
    step, layout, parts = m["step"], m["layout"], m["parts"]
    dir_match = _STEP_DIR.match(path.name)
    if type(step) is not int or step < 0 or (dir_match and int(dir_match.group(1)) != step):
        raise CheckpointError(f"{mpath}: step = {step!r} must be an integer >= 0 equal to the directory's ({path.name})")
    if not (isinstance(layout, dict) and set(layout) == set(_LAYOUT_KEYS)
            and all(type(layout[k]) is int and layout[k] >= 1 for k in _LAYOUT_KEYS)):
        raise CheckpointError(f"{mpath}: layout = {str(layout)[:120]} must be {{{', '.join(_LAYOUT_KEYS)}}} of "
                              f"integers >= 1")
    want = {part_name(t, p, d) for t in range(layout["tp"]) for p in range(layout["pp"]) for d in range(layout["dp"])}
    if not isinstance(parts, dict) or set(parts) != want:
        have = sorted(parts) if isinstance(parts, dict) else type(parts).__name__
        raise CheckpointError(f"{mpath}: parts {str(have)[:200]} must be the {len(want)} ranks of layout "
                              f"tp={layout['tp']} pp={layout['pp']} dp={layout['dp']}")
    for name, meta in parts.items():
        if not (isinstance(meta, dict) and set(meta) == {"sha256", "bytes"} and isinstance(meta["sha256"], str)
                and _SHA256.match(meta["sha256"]) and type(meta["bytes"]) is int and meta["bytes"] >= 0):
            raise CheckpointError(f"{mpath}: entry of part {name!r} = {str(meta)[:120]} must be "
                                  f"{{\"sha256\": <64 hex digits>, \"bytes\": <int >= 0>}}")
    for entry in os.scandir(path):
        if entry.name != MANIFEST and entry.name not in parts:
            raise CheckpointError(f"{path}: {entry.name!r} is not listed in {MANIFEST} as a part (refusing the "
                                  f"whole checkpoint)")
    for name in parts:
        try:
            st = os.lstat(path / name)
        except FileNotFoundError:
            raise CheckpointError(f"{path}: part {name} listed in the manifest is missing") from None
        if not stat.S_ISDIR(st.st_mode):
            raise CheckpointError(f"{path / name}: a part must be a directory (not a link or a file)")
    return m


def verify_part(path: Path, name: str, entry: dict[str, Any], step: int, *, threads: int = 1,
                hash_files: bool = True, run_id: str | None = None) -> dict[str, Any]:
    """Verify part `name` of sharded step directory `path` against its global manifest entry: first
    that it belongs to this save (its manifest's run_id and step are the global manifest's: `run_id`
    and `step`; else PartBindingError), then its manifest's sha256, then every file's (`threads` at a
    time; hash_files=False: the caller hashes them, e.g. several parts' files in one pool). Returns
    the part's manifest."""
    part = path / name
    mpath = part / MANIFEST
    _regular_file(mpath, f"{part}: no {MANIFEST} (this rank's write did not finish)")
    check_binding(path, name, read_manifest(part), run_id, step)
    if _sha256(mpath) != entry["sha256"]:
        raise CheckpointError(f"{mpath}: sha256 differs from the global manifest's entry for part {name} "
                              f"(replaced or corrupted)")
    return verify(part, threads=threads, hash_files=hash_files)


def check_binding(path: Path, name: str, manifest: dict[str, Any], run_id: str | None, step: int) -> None:
    """Raise PartBindingError unless part `name`'s manifest names the run and step of the step
    directory `path` (its global manifest's `run_id`, None before run identities existed, and `step`)."""
    found = (manifest.get("run_id"), manifest["step"])
    if found == (run_id, step):
        return
    def who(r, s):
        return f"run {r or '(none: written before run identities)'} at step {s}"
    raise PartBindingError(
        f"{path / name}: this part was written by {who(*found)}, but {path.name}'s global manifest belongs to "
        f"{who(run_id, step)}: a part copied from another run or another step, not this save; a step's parts "
        f"are loaded only together. Put back the part this save wrote, or remove {path.name} to resume from "
        f"the previous step, or set checkpoint.resume=false")


# ---------------------------------------------------------------------------- fit to the run


def check_optimizer_state(opt: Any, sd: Any, where: str) -> None:
    """Raise CheckpointError unless `sd` is a state dict `opt` can take: the same groups over the
    same parameter indices, and every per-parameter tensor of the parameter's shape, floating
    point and finite (torch's load_state_dict checks none of these shapes)."""
    if _distributed_parts(opt) is not None:
        check_shard_meta(opt, sd, where)
        return
    if isinstance(sd, dict) and _DIST in sd:
        raise CheckpointError(f"{where}: the checkpoint holds a distributed optimizer state but this run has "
                              f"parallel.use_distributed_optimizer=false; resume with the setting it was written with")
    subs = getattr(opt, "chained_optimizers", None)
    if isinstance(sd, list):
        if subs is None or len(subs) != len(sd):
            raise CheckpointError(f"{where}: a list of {len(sd)} optimizer states, the run has "
                                  f"{len(subs) if subs else 1} optimizer(s)")
        for i, (o, s) in enumerate(zip(subs, sd)):
            check_optimizer_state(o, s, f"{where}[{i}]")
        return
    if subs is not None and len(subs) == 1:
        opt = subs[0]
    ref = opt.state_dict()
    if set(ref) != {"state", "param_groups"}:  # a wrapper's layout (e.g. mixed precision): keys only
        if not isinstance(sd, dict) or set(sd) != set(ref):
            raise CheckpointError(f"{where}: keys {sorted(sd) if isinstance(sd, dict) else type(sd).__name__} "
                                  f"must be {sorted(ref)}")
        return
    if not (isinstance(sd, dict) and set(sd) == set(ref) and isinstance(sd.get("state"), dict)
            and isinstance(sd.get("param_groups"), list)):
        raise CheckpointError(f"{where}: keys {sorted(sd) if isinstance(sd, dict) else type(sd).__name__} "
                              f"must be {sorted(ref)} with state a dict and param_groups a list")
    if len(sd["param_groups"]) != len(ref["param_groups"]):
        raise CheckpointError(f"{where}: {len(sd['param_groups'])} param groups, the run's optimizer has "
                              f"{len(ref['param_groups'])}")
    shapes: dict[int, tuple[int, ...]] = {}
    params = [p for g in opt.param_groups for p in g["params"]]
    for i, (g, r) in enumerate(zip(sd["param_groups"], ref["param_groups"])):
        if not isinstance(g, dict) or g.get("params") != r["params"]:
            raise CheckpointError(f"{where}: param group {i} covers parameters "
                                  f"{g.get('params') if isinstance(g, dict) else g!r}, the run's covers {r['params']}")
        for k, v in g.items():
            if k != "params" and isinstance(v, float) and not math.isfinite(v):
                raise CheckpointError(f"{where}: param group {i} {k} = {v} must be finite")
    for idx in (i for r in ref["param_groups"] for i in r["params"]):
        shapes[idx] = tuple(params[len(shapes)].shape)
    for idx, per in sd["state"].items():
        if idx not in shapes or not isinstance(per, dict):
            raise CheckpointError(f"{where}: state for parameter {idx!r}, the run's optimizer has "
                                  f"parameters 0..{len(shapes) - 1}")
        for k, v in per.items():
            if not isinstance(v, torch.Tensor):
                continue
            if not v.is_floating_point() or not bool(v.isfinite().all()):
                raise CheckpointError(f"{where}: state[{idx}][{k}] must be finite floating point ({v.dtype})")
            if v.dim() and tuple(v.shape) != shapes[idx]:
                raise CheckpointError(f"{where}: state[{idx}][{k}] has shape {tuple(v.shape)}, parameter {idx} "
                                      f"has {shapes[idx]}")


# ---------------------------------------------------------------------------- distributed optimizer
# megatron's DistributedOptimizer shards the parameter state (fp32 main params, exp_avg,
# exp_avg_sq) over the data-parallel ranks: each rank owns a contiguous element range of each
# parameter it holds a share of (the grad buffer's split, which ignores parameter boundaries).
# Every rank saves its own share, keyed by parameter NAME and element range within the flattened
# (tensor-parallel-local) parameter -- not by grad-buffer offsets, which move with the DP size
# (each bucket is padded to a multiple of it). The state of a sub-optimizer:
#   {"state_dict": megatron's state_dict() (param groups with the step),
#    "slices": [[name, local shape, start, end], ...]}       (both None before the first step)
# with tensors "<name>/param", "<name>/exp_avg", "<name>/exp_avg_sq" of shape [end - start].
# A resume at any DP size installs, on each rank, the range it owns now from whichever saved
# slices cover it (resume.py); no collective, no gather to one rank.
_DIST = "distributed_optimizer"
_PARAM_KEYS = ("param", "exp_avg", "exp_avg_sq")


def _distributed_parts(opt: Any) -> list | None:
    """The sub-optimizers of `opt` when they are megatron DistributedOptimizers, else None."""
    subs = getattr(opt, "chained_optimizers", None) or [opt]
    sharded = [hasattr(o, "gbuf_ranges") and hasattr(o, "model_param_group_index_map") for o in subs]
    if not any(sharded):
        return None
    if not all(sharded):
        raise CheckpointError(f"optimizer chain mixes distributed and plain optimizers "
                              f"({[type(o).__name__ for o in subs]}): not supported by checkpoints")
    return subs


def is_distributed(opt: Any) -> bool:
    return _distributed_parts(opt) is not None


def _stepped(o: Any) -> bool:
    """Whether every rank of `o`'s DP group has optimizer moments (a collective over that group)."""
    has = 1 if len(o.optimizer.state) else 0
    flags = torch.tensor([has, -has], dtype=torch.long)
    group = o.data_parallel_group_gloo
    if group is not None and torch.distributed.is_initialized() and group.size() > 1:
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MIN, group=group)
    if int(flags[0]) != -int(flags[1]):
        raise CheckpointError("distributed optimizer: some data-parallel ranks have optimizer moments and "
                              "others not; cannot checkpoint a state the ranks disagree on")
    return bool(flags[0])


def _owned(o: Any) -> list[tuple[torch.nn.Parameter, int, int]]:
    """(model param, start, end): the element range of each parameter this rank's shard of `o` holds."""
    out = []
    for ranges in o.gbuf_ranges:
        for buckets in ranges.values():
            for bucket in buckets:
                out += [(p, r["param"].start, r["param"].end) for p, r in bucket["param_map"].items()]
    return out


def _main_and_state(o: Any, model_param: torch.nn.Parameter) -> dict[str, torch.Tensor]:
    """The fp32 main-param shard of `model_param` and its Adam moments (1-D, [end - start])."""
    gi, go = o.model_param_group_index_map[model_param]
    main = o.optimizer.param_groups[gi]["params"][go]
    per = o.optimizer.state[main]
    return {"param": main, "exp_avg": per["exp_avg"], "exp_avg_sq": per["exp_avg_sq"]}


def optimizer_shard(opt: Any, names: dict[torch.nn.Parameter, str]) -> tuple[Any, dict[str, torch.Tensor]]:
    """This rank's share of a distributed optimizer: ({"distributed_optimizer": [per sub-optimizer
    {"state_dict", "slices"}]}, tensors "<name>/<param|exp_avg|exp_avg_sq>"), names from `names`.
    Every rank of the DP group calls this (one small all-reduce: whether there are moments yet).
    The tensors are the live ones: copy them before the next step."""
    subs = _distributed_parts(opt)
    parts, tensors = [], {}
    for o in subs:
        if not _stepped(o):
            parts.append({"state_dict": None, "slices": None})
            continue
        slices = []
        for p, start, end in _owned(o):
            name = names[p]
            for k, v in _main_and_state(o, p).items():
                tensors[f"{name}/{k}"] = v.detach()
            slices.append([name, list(p.shape), start, end])
        parts.append({"state_dict": o.state_dict(), "slices": slices})
    return {_DIST: parts}, tensors


def check_shard_meta(opt: Any, sd: Any, where: str) -> list:
    """The sub-optimizer states of a saved distributed-optimizer entry, checked against the run's
    optimizer (schema and param groups; the tensors are checked as they are installed)."""
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    subs = _distributed_parts(opt)
    if not (isinstance(sd, dict) and set(sd) == {_DIST} and isinstance(sd[_DIST], list)):
        raise CheckpointError(f"{where}: this run has parallel.use_distributed_optimizer=true but the checkpoint "
                              f"holds a plain optimizer state (keys "
                              f"{sorted(sd) if isinstance(sd, dict) else type(sd).__name__}); resume with the "
                              f"setting it was written with")
    parts = sd[_DIST]
    if len(parts) != len(subs):
        raise CheckpointError(f"{where}: {len(parts)} distributed optimizer states, the run has {len(subs)}")
    for i, (o, part) in enumerate(zip(subs, parts)):
        w = f"{where}[{i}]"
        if not (isinstance(part, dict) and set(part) == {"state_dict", "slices"}):
            raise CheckpointError(f"{w}: must be an object with keys ['slices', 'state_dict']")
        state, slices = part["state_dict"], part["slices"]
        if (state is None) != (slices is None):
            raise CheckpointError(f"{w}: state_dict and slices must both be present or both null")
        if state is None:
            continue
        if not (isinstance(slices, list) and all(
                isinstance(e, list) and len(e) == 4 and isinstance(e[0], str) and isinstance(e[1], list)
                and all(type(x) is int and x >= 0 for x in e[1]) and type(e[2]) is int and type(e[3]) is int
                and 0 <= e[2] < e[3] <= math.prod(e[1]) for e in slices)):
            raise CheckpointError(f"{w}: slices must be a list of [name, shape, start, end] with "
                                  f"0 <= start < end <= numel(shape)")
        keys = {"optimizer"} | ({"grad_scaler"} if o.grad_scaler else set())
        inner = state.get("optimizer") if isinstance(state, dict) else None
        groups = inner.get("param_groups") if isinstance(inner, dict) else None
        if not (isinstance(state, dict) and set(state) == keys and isinstance(groups, list)):
            raise CheckpointError(f"{w}: state_dict must have keys {sorted(keys)} with optimizer.param_groups a list")
        run_groups = o.optimizer.param_groups
        if len(groups) != len(run_groups):
            raise CheckpointError(f"{w}: {len(groups)} param groups, the run's optimizer has {len(run_groups)}")
        for j, (g, r) in enumerate(zip(groups, run_groups)):
            if not isinstance(g, dict):
                raise CheckpointError(f"{w}: param group {j} must be an object, got {type(g).__name__}")
            ident = [(k, g.get(k), r.get(k)) for k in param_group_identifier_keys if k in r]
            if any(a != b for _, a, b in ident):
                raise CheckpointError(f"{w}: param group {j} is {[(k, a) for k, a, _ in ident]}, the run's is "
                                      f"{[(k, b) for k, _, b in ident]}")
            step = g.get("step")
            if isinstance(step, bool) or not isinstance(step, (int, float)) or not math.isfinite(step) or step < 0:
                raise CheckpointError(f"{w}: param group {j} step = {step!r} must be a finite number >= 0")
            for k, v in g.items():
                if isinstance(v, float) and not math.isfinite(v):
                    raise CheckpointError(f"{w}: param group {j} {k} = {v} must be finite")
    return parts


def install_optimizer_shard(opt: Any, parts: list, names: dict[torch.nn.Parameter, str], fetch, where: str) -> None:
    """Install check_shard_meta's `parts` into the run's distributed optimizer, no collectives:
    for each element range [start, end) of a parameter this rank owns, fetch(name, shape, start,
    end) returns {"param", "exp_avg", "exp_avg_sq"} of [end - start] float32 (resume.py assembles
    them from the saved slices, at any DP size)."""
    for i, (o, part) in enumerate(zip(_distributed_parts(opt), parts)):
        if part["state_dict"] is None:
            o.reload_model_params()  # never stepped: fp32 main params from the loaded weights
            continue
        o.load_state_dict(part["state_dict"])
        for per in o.optimizer.state.values():  # megatron sets one shared step tensor, which
            if isinstance(per.get("step"), torch.Tensor):  # torch's AdamW would advance once per param
                per["step"] = per["step"].clone()
        with torch.no_grad():  # the main params may be views of leaves that require grad
            for p, start, end in _owned(o):
                name = names[p]
                src = fetch(name, tuple(p.shape), start, end)
                for k, dst in _main_and_state(o, p).items():
                    v = src[k]
                    if not (v.dtype == torch.float32 and tuple(v.shape) == (end - start,)):
                        raise CheckpointError(f"{where}[{i}]: {name}/{k} [{start}:{end}] must be float32 of shape "
                                              f"({end - start},), got {v.dtype} {tuple(v.shape)}")
                    if not bool(v.isfinite().all()):
                        raise CheckpointError(f"{where}[{i}]: {name}/{k} [{start}:{end}] holds NaN/inf")
                    dst.copy_(v)
