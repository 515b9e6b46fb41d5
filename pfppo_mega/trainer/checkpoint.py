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
_MAX_JSON_BYTES = 64 << 20  # a manifest or state.json larger than this is not ours
# JSON markers for what JSON has no type for (a key starting with "__" is reserved for them).
_TENSOR, _TUPLE, _INTDICT = "__tensor__", "__tuple__", "__intdict__"


class CheckpointError(ValueError):
    """A checkpoint that cannot be trusted or does not fit the run (the message says why)."""


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


def save_checkpoint(
    root: Path, step: int, tensors: dict[str, dict[str, torch.Tensor]], state: dict[str, Any],
    *, keep_last: int,
) -> Path:
    """Write `tensors` (group -> name -> tensor) and `state` (data + tensors) as step `step`."""
    bad = [g for g in tensors if not _GROUP.match(g) or g == "state"]
    if bad:
        raise CheckpointError(f"tensor group {bad[0]!r}: must match {_GROUP.pattern} and not be 'state'")
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f"{final.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    state_tensors: dict[str, torch.Tensor] = {}
    state_json = json.dumps(encode_state(state, state_tensors), allow_nan=True)
    files = []
    for group, sd in {**tensors, "state": state_tensors}.items():
        name = f"{group}.safetensors"
        save_file(_private(sd), str(tmp / name))
        files.append(name)
    (tmp / STATE_JSON).write_text(state_json)
    files.append(STATE_JSON)
    for name in files:
        _fsync_file(tmp / name)
    manifest = {"format": FORMAT, "step": step,
                "files": {n: {"sha256": _sha256(tmp / n), "bytes": (tmp / n).stat().st_size} for n in files}}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
    _fsync_file(tmp / MANIFEST)
    _fsync_dir(tmp)
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
    _prune(root, keep_last, saved_step=step)
    return final


def _step_of(path: Path) -> int:
    return int(_STEP_DIR.match(path.name).group(1))


def _step_dirs(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p.is_dir() or p.is_symlink())]
    return sorted(found, key=_step_of)


def _prune(root: Path, keep_last: int, *, saved_step: int) -> None:
    """Remove what killed writers left, step dirs newer than the one `latest` now names, and all
    but the newest keep_last step dirs."""
    for stale in [*root.glob("step_*.tmp-*"), *root.glob(".step_*.old-*")]:
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
    if set(m) != {"format", "step", "files"}:
        raise CheckpointError(f"{mpath}: keys {sorted(m)} must be exactly ['files', 'format', 'step']")
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


def verify(path: Path) -> dict[str, Any]:
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
        if _sha256(f) != meta["sha256"]:
            raise CheckpointError(f"{f}: sha256 mismatch (corrupted)")
    return manifest


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
    manifest = verify(path)
    names = sorted(manifest["files"])
    tensors = {n[: -len(".safetensors")]: _load_safetensors(path / n)
               for n in names if n.endswith(".safetensors") and n != STATE_TENSORS}
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


# ---------------------------------------------------------------------------- fit to the run


def check_optimizer_state(opt: Any, sd: Any, where: str) -> None:
    """Raise CheckpointError unless `sd` is a state dict `opt` can take: the same groups over the
    same parameter indices, and every per-parameter tensor of the parameter's shape, floating
    point and finite (torch's load_state_dict checks none of these shapes)."""
    dist_subs = _distributed_parts(opt)
    if dist_subs is not None:
        _check_distributed(dist_subs, sd, where)
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
# exp_avg_sq) over the data-parallel ranks, and its state_dict() holds only the rest (param groups
# with the step). The checkpoint stores, per sub-optimizer, that state_dict and the parameter
# state gathered to dp_rank 0 (get_parameter_state_dp_zero, over the gloo DP group), one entry per
# grad buffer: {"dtype": [param dtype, grad dtype], "numel_unpadded", "param", "exp_avg",
# "exp_avg_sq"} (1-D float32 tensors of numel_unpadded). Before the first optimizer step both are
# None (there are no moments yet; the main params are refreshed from the loaded weights).
_DIST = "distributed_optimizer"
_PARAM_KEYS = ("param", "exp_avg", "exp_avg_sq")


def _distributed_parts(opt: Any) -> list | None:
    """The sub-optimizers of `opt` when they are megatron DistributedOptimizers, else None."""
    subs = getattr(opt, "chained_optimizers", None) or [opt]
    sharded = [hasattr(o, "get_parameter_state_dp_zero") for o in subs]
    if not any(sharded):
        return None
    if not all(sharded):
        raise CheckpointError(f"optimizer chain mixes distributed and plain optimizers "
                              f"({[type(o).__name__ for o in subs]}): not supported by checkpoints")
    return subs


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


def optimizer_state(opt: Any) -> Any:
    """The optimizer's state as data for save_checkpoint. A plain optimizer: its state_dict().
    A distributed one: {"distributed_optimizer": [per sub-optimizer {"state_dict", "param_state"}]},
    gathered over the data-parallel group, so EVERY DP rank must call this; the result is whole on
    dp_rank 0 (the writer) and None on the others."""
    subs = _distributed_parts(opt)
    if subs is None:
        return opt.state_dict()
    parts, writer = [], True
    for o in subs:
        if not _stepped(o):
            parts.append({"state_dict": None, "param_state": None})
            continue
        gathered = o.get_parameter_state_dp_zero(use_gloo_comm=True)  # collective; None off dp_rank 0
        if gathered is None:
            writer = False
            continue
        buffers = []
        for gbuf_idx in range(len(o.gbuf_ranges)):
            (dtypes, world), = gathered[gbuf_idx].items()
            buffers.append({"dtype": [str(d) for d in dtypes], "numel_unpadded": int(world["numel_unpadded"]),
                            **{k: world[k] for k in _PARAM_KEYS}})
        parts.append({"state_dict": o.state_dict(), "param_state": buffers})
    return {_DIST: parts} if writer else None


def _run_buffers(o: Any) -> list[tuple[list[str], int]]:
    """[(dtype names, numel_unpadded)] of the run's grad buffers, the layout of its param_state."""
    out = []
    for gbuf_idx, ranges in enumerate(o.gbuf_ranges):
        (dtypes, _), = ranges.items()
        out.append(([str(d) for d in dtypes], int(o.buffers[gbuf_idx].numel_unpadded)))
    return out


def _check_distributed(subs: list, sd: Any, where: str) -> None:
    """check_optimizer_state for a run with the distributed optimizer (no collectives)."""
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

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
        if not (isinstance(part, dict) and set(part) == {"state_dict", "param_state"}):
            raise CheckpointError(f"{w}: must be an object with keys ['param_state', 'state_dict']")
        state, params = part["state_dict"], part["param_state"]
        if (state is None) != (params is None):
            raise CheckpointError(f"{w}: state_dict and param_state must both be present or both null")
        if state is None:
            continue
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
        run = _run_buffers(o)
        if not isinstance(params, list) or len(params) != len(run):
            raise CheckpointError(f"{w}: param_state must be a list of {len(run)} grad buffer(s), got "
                                  f"{len(params) if isinstance(params, list) else type(params).__name__}")
        for b, (buf, (dtypes, numel)) in enumerate(zip(params, run)):
            need = {"dtype", "numel_unpadded", *_PARAM_KEYS}
            if not (isinstance(buf, dict) and set(buf) == need):
                raise CheckpointError(f"{w}: param_state[{b}] must have keys {sorted(need)}")
            if buf["dtype"] != dtypes or buf["numel_unpadded"] != numel:
                raise CheckpointError(f"{w}: param_state[{b}] is dtype {buf['dtype']} with {buf['numel_unpadded']} "
                                      f"elements, the run's grad buffer {b} is {dtypes} with {numel} (another "
                                      f"model, model.params_dtype or layout)")
            for k in _PARAM_KEYS:
                v = buf[k]
                if not (isinstance(v, torch.Tensor) and v.dtype == torch.float32 and tuple(v.shape) == (numel,)):
                    raise CheckpointError(f"{w}: param_state[{b}].{k} must be a float32 tensor of shape ({numel},), "
                                          f"got {tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__}")
                if not bool(v.isfinite().all()):
                    raise CheckpointError(f"{w}: param_state[{b}].{k} holds NaN/inf")


def load_optimizer_state(opt: Any, sd: Any) -> list:
    """Install a state check_optimizer_state accepted, without collectives. Returns the collective
    remainder as [(sub-optimizer, param_state)]: pass it to scatter_parameter_state on every DP
    rank once all ranks have accepted the checkpoint (empty for a plain optimizer)."""
    subs = _distributed_parts(opt)
    if subs is None:
        opt.load_state_dict(sd)
        return []
    pending = []
    for o, part in zip(subs, sd[_DIST]):
        if part["state_dict"] is None:
            o.reload_model_params()  # never stepped: fp32 main params from the loaded weights
            continue
        o.load_state_dict(part["state_dict"])
        for per in o.optimizer.state.values():  # megatron sets one shared step tensor, which
            if isinstance(per.get("step"), torch.Tensor):  # torch's AdamW would advance once per param
                per["step"] = per["step"].clone()
        pending.append((o, part["param_state"]))
    return pending


def scatter_parameter_state(pending: list) -> None:
    """Load the parameter state of load_optimizer_state's remainder: dp_rank 0 scatters it over the
    gloo DP group (a collective: every DP rank calls this with the same sub-optimizers)."""
    for o, buffers in pending:
        state = {gbuf_idx: {next(iter(o.gbuf_ranges[gbuf_idx])): {"numel_unpadded": buf["numel_unpadded"],
                                                                  **{k: buf[k] for k in _PARAM_KEYS}}}
                 for gbuf_idx, buf in enumerate(buffers)}
        # megatron copies every entry of a parameter's optimizer state from what it received, which
        # has no "step" (torch's own AdamW, without Apex/TE, keeps one per parameter): set it aside
        steps = {p: per.pop("step") for p, per in o.optimizer.state.items() if "step" in per}
        try:
            o.load_parameter_state_from_dp_zero(state)
        finally:
            for p, step in steps.items():
                o.optimizer.state[p]["step"] = step
