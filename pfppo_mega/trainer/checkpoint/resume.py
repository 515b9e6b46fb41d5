"""A run's checkpoints: what a step saves and how a run resumes from one (the file format, its
atomic writes and verification are trainer/checkpoint/store.py's).

Sharded (format 3): ``checkpoints/step_N/`` holds one part per rank, ``tp<t>-pp<p>-dp<d>/``,
written by that rank alone (no gather), and a global manifest that rank 0 writes last, once every
part's manifest is on disk (checkpoint.py). A part holds:
  - ``actor`` / ``critic`` .safetensors: the rank's tensor-parallel shard of the weights, under
    global names (pipeline layer index of the whole model), on dp_rank 0 only (DP replicas are equal);
  - ``optim.safetensors``: with parallel.use_distributed_optimizer, this rank's element ranges of
    the fp32 main params and Adam moments, by parameter name (checkpoint.optimizer_shard); a plain
    optimizer's state is in dp_rank 0's state;
  - ``pool.safetensors``: the PF-PPO pool's buckets. Every node keeps the same bytes (bucket k on
    node rank k mod L), so each bucket is written once per job, by its keeper on node
    (k // L) mod nodes (pool_writer): the pool's writes spread over every node;
  - ``state.json`` / ``state.safetensors``: this rank's counters, RNG streams, data position,
    config, pool statistics and the frozen reference's identity (path + hash, not its weights).

Saving: the training thread copies this rank's tensors to the host (the only time it is blocked;
the pool's buffers are written in place, and a capture does not reuse them while the write lasts:
ShardedSnapshotPool.hold_buffers), then a background thread writes, fsyncs and hashes (read back) the part; at most
checkpoint.max_saves_in_flight saves are in flight. Rank 0's writer waits for every part's manifest
(checkpoint.commit_timeout_s), then writes the global manifest, renames the step in and moves
``latest``: a kill at any moment leaves ``latest`` on a complete, verified checkpoint.

Resuming: the ranks agree on the newest step every rank can verify (each hashes only the parts it
reads, in threads, once); a part that another run or step wrote (its manifest's run_id and step
against the global manifest's) is refused on every rank before anything is loaded; then each rank
installs what it owns in this run's layout, and continues the job's prompt stream (the same on
every rank, so a resume at another DP size draws the uninterrupted run's rows and seeds). The
model and the prompt files are judged by content (MOVABLE), not by their paths. A DP change
re-slices the distributed optimizer by parameter name and element range; a TP/PP change reshards
the weights and moments (models/reshard.py); the PF-PPO pool (in the rollout layout) is re-dealt
to the keepers of the new node size. What cannot be resharded (a plain optimizer at another
TP/PP, a pool of another bucket plan) is refused by name, never restarted.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
import uuid
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open

from pfppo_mega import parallel
from pfppo_mega.config import config_to_dict
from pfppo_mega.models import gpt, lora, reshard
from pfppo_mega.trainer.checkpoint import store as ckpt
from pfppo_mega.trainer.build import Run

STATE_KEYS = frozenset({"step", "rank", "rng", "torch_rng", "assign_rng", "running_reward", "guards", "data",
                        "consecutive_skips", "actor_opt", "critic_opt", "opt_names", "config", "pool", "reference"})
OPT_MODEL = {"actor_opt": "actor", "critic_opt": "critic"}
OPTIM = "optim"  # the tensor group of a rank's distributed-optimizer shard


def tensor_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and tensor buffers of the unwrapped model (megatron's _extra_state dropped). Under
    model.lora the adapters alone: the frozen base is actor_rollout.model_path's, whose content a resume
    checks (reference_identity), so a checkpoint holds megabytes, not the model."""
    sd = {k: v for k, v in gpt.unwrap(module).state_dict().items() if isinstance(v, torch.Tensor)}
    if lora.spec_of(module) is not None:
        sd = {k: v for k, v in sd.items() if lora.is_adapter(k)}
    return sd


def load_tensor_state(module: torch.nn.Module, sd: dict[str, torch.Tensor]) -> None:
    own = tensor_state(module)
    if own.keys() != sd.keys():
        raise ValueError(f"checkpoint tensors differ from the model: missing {sorted(own.keys() - sd.keys())}, "
                         f"unexpected {sorted(sd.keys() - own.keys())}")
    with torch.no_grad():
        for k, v in own.items():
            if v.shape != sd[k].shape:
                raise ValueError(f"checkpoint tensor {k}: shape {tuple(sd[k].shape)}, model {tuple(v.shape)}")
            v.copy_(sd[k])


def _stage(run: Run) -> reshard.Stage:
    p = run.parallel
    return reshard.Stage(p.pp_rank, p.pp, run.models.model_cfg.num_layers)


def param_names(run: Run, model: torch.nn.Module) -> dict[torch.nn.Parameter, str]:
    """Each parameter of `model` -> its global name (layer index of the whole model)."""
    stage = _stage(run)
    return {p: stage.to_global(n) for n, p in gpt.unwrap(model).named_parameters()}


def my_part(run: Run) -> str:
    p = run.parallel
    return ckpt.part_name(p.tp_rank, p.pp_rank, p.dp_rank)


def layout_of(run: Run) -> dict[str, int]:
    p = run.parallel
    return {"tp": p.tp, "pp": p.pp, "dp": p.dp, "local_world": _local_world(run)}


def _local_world(run: Run) -> int:
    sync = getattr(run.colocation.gen, "sync", None) if hasattr(run, "colocation") else None
    ranks = getattr(sync, "node_ranks", None)
    return len(ranks) if ranks else int(os.environ.get("LOCAL_WORLD_SIZE", run.parallel.world_size))


# ============================================================================ the reference's identity

_IDENTITY: dict[tuple, dict] = {}


def reference_identity(model_path: str) -> dict[str, Any]:
    """{"path", "sha256"}: a hash over config.json and each weight file's name, size, safetensors
    header (tensor names, dtypes, shapes, offsets) and a sample of its bytes (the first, middle and
    last MiB) -- cheap at any size, yet weights rewritten in place change it; cached per file state."""
    root = Path(model_path)
    files = sorted(p for p in root.iterdir() if p.name == "config.json" or p.suffix == ".safetensors") \
        if root.is_dir() else []
    key = (str(root), tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files))
    if key not in _IDENTITY:
        h = hashlib.sha256()
        for p in files:
            h.update(f"{p.name}:{p.stat().st_size}|".encode())
            with open(p, "rb") as f:
                if p.suffix == ".safetensors":
                    n = int.from_bytes(f.read(8), "little")
                    h.update(f.read(min(n, 100 << 20)))
                    size = p.stat().st_size
                    for at in (8 + n, (8 + n + size) // 2, max(8 + n, size - (1 << 20))):
                        f.seek(at)
                        h.update(f.read(1 << 20))
                else:
                    h.update(f.read(1 << 20))
        _IDENTITY[key] = {"path": str(root), "sha256": h.hexdigest()}
    return dict(_IDENTITY[key])


# ============================================================================ save


@dataclass
class SaveInfo:
    """What resume.save started: this rank's bytes to write (its part) and how long the training
    thread was blocked (waiting for checkpoint.max_saves_in_flight, then the host copy; a
    synchronous save's write not included). `done` is the background write (None when synchronous)."""

    step: int
    path: Path
    bytes: int
    blocked_s: float
    done: Future | None = None


@dataclass
class _Saver:
    """The background writer of one checkpoint root in this process (saves run in step order)."""

    pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="ckpt"))
    inflight: deque = field(default_factory=deque)  # (tmp dir name, Future)

    def reap(self, keep: int) -> None:
        """Wait until at most `keep` saves are in flight; re-raise a failed one's error."""
        while self.inflight and (len(self.inflight) > keep or self.inflight[0][1].done()):
            _, fut = self.inflight.popleft()
            fut.result()


_SAVERS: dict[str, _Saver] = {}


def _host_copy(obj: Any) -> Any:
    """A private host copy of every tensor in `obj` (nested dicts/lists/tuples): the training
    thread's device -> host copy; the background writer then owns what it writes."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True).contiguous()
    if isinstance(obj, dict):
        return {k: _host_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        out = [_host_copy(v) for v in obj]
        return tuple(out) if isinstance(obj, tuple) else out
    return obj


def _collect(run: Run) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
    """This rank's part: tensor groups and state (live tensors; copied by the caller)."""
    st, b, p = run.state, run.strategies.behaviour, run.parallel
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    stage = _stage(run)
    if p.dp_rank == 0:
        tensors.update({name: {stage.to_global(k): v for k, v in tensor_state(m).items()}
                        for name, m in run.models.trained().items()})
    opt_states: dict[str, Any] = {"critic_opt": None}
    opt_names: dict[str, list] = {}
    shard: dict[str, torch.Tensor] = {}
    for name, opt in run.models.optimizers().items():
        if ckpt.is_distributed(opt):  # every rank its own share (one small all-reduce each)
            meta, ts = ckpt.optimizer_shard(opt, param_names(run, run.models.trained()[OPT_MODEL[name]]))
            opt_states[name] = meta
            shard.update({f"{name}/{k}": v for k, v in ts.items()})
        else:  # replicated over DP: dp_rank 0 writes it, with the name of each parameter index
            opt_states[name] = opt.state_dict() if p.dp_rank == 0 else None
            opt_names[name] = plain_param_names(opt, param_names(run, run.models.trained()[OPT_MODEL[name]]))
    if shard:
        tensors[OPTIM] = shard
    if b.keeps_state:  # the pool's bytes once per job: each bucket by its keeper on one node (pool_writer)
        L, nodes = _local_world(run), max(1, p.world_size // _local_world(run))
        mine = {n: t for n, t in b.state_tensors().items() if pool_writer(n, L, nodes) == p.rank // L}
        if mine:
            tensors["pool"] = mine
    state = {"step": st.step, "rank": {"rank": p.rank, "tp": p.tp_rank, "pp": p.pp_rank, "dp": p.dp_rank},
             "rng": run.state.rng.getstate(), "torch_rng": torch.get_rng_state(),
             "assign_rng": run.state.assign_gen.get_state(), "running_reward": st.running_reward.state_dict(),
             "guards": dict(st.guards), "consecutive_skips": dict(st.consecutive_skips),
             "data": run.prompts.state_dict(), **opt_states, "opt_names": opt_names, "config": config_to_dict(run.cfg),
             "pool": b.state_meta() if b.keeps_state else None,
             "reference": reference_identity(run.cfg.actor_rollout.model_path)}
    return tensors, state


def _subs(opt: Any) -> list:
    return getattr(opt, "chained_optimizers", None) or [opt]


def plain_param_names(opt: Any, names: dict[torch.nn.Parameter, str]) -> list[list[str]]:
    """Per sub-optimizer, the global name of each parameter index of its state_dict (torch numbers
    the parameters of its param groups in order; a mixed-precision wrapper's are the fp32 main
    copies, `param.main_param`)."""
    model_of = {id(getattr(q, "main_param", q)): q for q in names}
    return [[names[model_of[id(q)]] for g in o.optimizer.param_groups for q in g["params"]] for o in _subs(opt)]


def pool_writer(name: str, local_world: int, nodes: int) -> int:
    """The node whose keeper writes pool tensor `name` ("<slot>/bucket.<k>"): every node keeps the
    same bytes (bucket k on node rank k mod L), so bucket k is written by node (k // L) mod nodes
    only -- the job's writes spread over all nodes, each byte written once."""
    bucket = name.rsplit("bucket.", 1)[-1]
    return 0 if not bucket.isdigit() else (int(bucket) // local_world) % nodes


def pool_parts(rank: int, ranks: list[str], local_world: int) -> list[str]:
    """The parts holding the pool buckets global rank `rank` keeps: its node index's keeper on every node."""
    return [ranks[n * local_world + rank % local_world] for n in range(len(ranks) // local_world)]


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0


def save(run: Run, root: Path, *, background: bool | None = None) -> SaveInfo | None:
    """Checkpoint this step (once: a second call at the same step writes nothing). Every rank calls
    this; it returns once this rank's state is copied to the host, the write goes on in the
    background (checkpoint.background) -- wait(root) for it."""
    st, c = run.state, run.cfg.checkpoint
    if st.saved_step == st.step:
        return None
    st.saved_step = st.step
    saver = _SAVERS.setdefault(str(root), _Saver())
    t0 = time.perf_counter()  # the loop is blocked from here: waiting for the bound, then the host copy
    saver.reap(keep=c.max_saves_in_flight - 1)  # the bound on saves in flight (and earlier errors)
    tensors, state = _collect(run)  # collectives: each distributed optimizer's "stepped?" all-reduce
    # the step's temp dir name and, at a run's first save, its identity, from rank 0 (and every
    # rank's part name, for rank 0's commit)
    mine = (my_part(run), f"{os.getpid()}-{time.time_ns()}", st.run_id or uuid.uuid4().hex)
    agreed = parallel.dp_gather_objects(mine, parallel.world_group())
    parts, token = [a for a, _, _ in agreed], agreed[0][1]
    st.run_id = agreed[0][2]  # kept across resumes: every part of every step of this run names it
    bg = background if background is not None else c.background
    pool = getattr(run.strategies.behaviour, "pool", None) if "pool" in tensors else None
    held = tensors.pop("pool") if bg and hasattr(pool, "hold_buffers") else None  # written in place, held
    tensors, state = _host_copy(tensors), _host_copy(state)
    if held is not None:
        tensors["pool"] = held
    blocked = time.perf_counter() - t0
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"step_{st.step:06d}.tmp-{token}"
    job = _Write(root=root, step=st.step, tmp=tmp, part=my_part(run), run_id=st.run_id, tensors=tensors, state=state,
                 commit=run.parallel.rank == 0, parts=parts, layout=layout_of(run), keep_last=c.keep_last,
                 threads=c.io_threads, timeout_s=c.commit_timeout_s, log=run.log,
                 inflight=frozenset(n for n, _ in saver.inflight) | {tmp.name})
    info = SaveInfo(step=st.step, path=root / f"step_{st.step:06d}", bytes=_nbytes(tensors) + _nbytes(state),
                    blocked_s=blocked)
    if bg:
        info.done = saver.pool.submit(job)
        saver.inflight.append((tmp.name, info.done))
        if held is not None:
            pool.hold_buffers(info.done)
    else:
        job()
    return info


@dataclass
class _Write:
    """One rank's write of its part (and, on rank 0, the commit), run on the background thread."""

    root: Path
    step: int
    tmp: Path
    part: str
    tensors: dict
    state: dict
    commit: bool
    parts: list[str]
    layout: dict[str, int]
    keep_last: int
    threads: int
    timeout_s: float
    log: Callable[[str], None]
    inflight: frozenset
    run_id: str | None = None  # the run's identity, in the part's and the global manifest

    def __call__(self) -> None:
        self.tmp.mkdir(parents=True, exist_ok=True)
        ckpt.write_dir(self.tmp / self.part, self.step, self.tensors, self.state, threads=self.threads,
                       run_id=self.run_id)
        self.tensors = self.state = None  # the host copy is no longer needed
        if not self.commit:
            return
        deadline = time.monotonic() + self.timeout_s
        missing = list(self.parts)
        while missing:
            missing = [p for p in missing if not (self.tmp / p / ckpt.MANIFEST).is_file()]
            if missing and time.monotonic() > deadline:
                raise ckpt.CheckpointError(
                    f"checkpoint step {self.step}: parts {missing[:4]} were not written within "
                    f"checkpoint.commit_timeout_s = {self.timeout_s} s (a rank failed or was killed mid-save); "
                    f"the step is not committed and `latest` stays on the previous checkpoint")
            if missing:
                time.sleep(0.05)
        digests = {p: ckpt.part_digest(self.tmp / p) for p in self.parts}
        ckpt.commit_sharded(self.root, self.step, self.tmp, self.layout, digests, keep_last=self.keep_last,
                            keep=self.inflight, run_id=self.run_id)


def wait(root: Path) -> None:
    """Wait for this process's saves under `root` (re-raising a failed one), then for every rank's
    (a barrier): afterwards `latest` names the last saved step on every rank."""
    saver = _SAVERS.get(str(root))
    if saver is None:
        return
    try:
        saver.reap(keep=0)
    finally:
        if not saver.inflight:
            _SAVERS.pop(str(root), None)
            saver.pool.shutdown(wait=False)
    parallel.world_min(0)


# ============================================================================ resume

# What a resumed run depends on: a change would train another run under this one's name (the
# saved data position indexes another permutation, another estimator reads other state).
FIXED = ("training.seed", "data.source", "data.task", "data.num_digits", "algorithm.adv_estimator",
         "actor_rollout.n_samples_per_prompt")
# Paths whose content decides, not their spelling: the model (reference_identity, checked in
# _check_reference) and the training rows (their sha256, checked by the data source's
# load_state_dict). The same content at another path (./runs/sft for runs/sft, a copy staged on
# node-local disk) resumes, with a note; other content is refused by those checks, by name.
MOVABLE = ("actor_rollout.model_path", "data.train_files")
# The optimizer's hyper-parameters: the checkpoint's param groups would silently win; a change is applied.
HYPER = ("training.lr", "training.critic_lr", "training.weight_decay")


def _get(d: dict, key: str):
    for part in key.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d


def check_edits(saved, current: dict, need) -> tuple[list, list]:
    """Refuse a resume whose FIXED settings differ from the checkpoint's (naming the key and both
    values); return the HYPER settings that changed, to apply, and the MOVABLE ones that changed,
    whose content the caller checks: each a list of (key, saved value, current value)."""
    need(isinstance(saved, dict), "state config must be the config the checkpoint was written with (an object)")
    for key in FIXED:
        old, new = _get(saved, key), _get(current, key)
        need(old == new, f"{key} changed since this checkpoint was written ({old!r} -> {new!r}): the run would "
                         f"continue as another one; resume with the value it was written with, or start a new "
                         f"logging.output_dir (or checkpoint.resume=false)")

    def changed(keys):
        return [(key, _get(saved, key), _get(current, key)) for key in keys if _get(saved, key) != _get(current, key)]
    return changed(HYPER), changed(MOVABLE)


_KERNEL_KEYS = ("fused", "foreach")  # how torch's AdamW runs a step, not what it computes


def _kernel_choice(opts: dict) -> dict:
    """Each optimizer's param groups' implementation flags as this run built them (gpt.build_optimizer
    picks torch's fused AdamW): a checkpoint written before that, or on another device, holds others."""
    return {name: [[{k: g[k] for k in _KERNEL_KEYS if k in g} for g in o.optimizer.param_groups] for o in _subs(opt)]
            for name, opt in opts.items()}


def _restore_kernel_choice(opts: dict, choice: dict) -> None:
    """Put back _kernel_choice's flags after the checkpoint's param groups were installed over them."""
    for name, opt in opts.items():
        for o, groups in zip(_subs(opt), choice[name]):
            for g, flags in zip(o.optimizer.param_groups, groups):
                g.update(flags)


def _apply_hyper(opts: dict, key: str, value: float) -> None:
    names = {"training.lr": ("actor_opt",), "training.critic_lr": ("critic_opt",),
             "training.weight_decay": ("actor_opt", "critic_opt")}[key]
    field_, mult = ("weight_decay", "wd_mult") if key.endswith("weight_decay") else ("lr", "lr_mult")
    for name in names:
        if name in opts:
            for group in opts[name].param_groups:
                group[field_] = value * group.get(mult, 1.0)


def _refuse_old_format(root: Path) -> None:
    """Checkpoints written before the sharded format (format 2) are refused by name."""
    old = sorted(d.name for d in root.iterdir() if d.name.startswith("mp-tp")) if root.is_dir() else []
    old += [d.name for d in ckpt.step_dirs(root) if ckpt.manifest_format(d) == ckpt.FORMAT]
    if old:
        raise ckpt.CheckpointError(
            f"checkpoint.resume: {root} holds checkpoints of format {ckpt.FORMAT} ({', '.join(old[:3])}), written "
            f"before sharded checkpoints (format {ckpt.FORMAT_SHARDED}); they are not read by this version: resume "
            f"with the version that wrote them, or use another logging.output_dir, or checkpoint.resume=false")


class Saved:
    """One committed step as this rank reads it: the global manifest and the parts it needs,
    verified once (threads) and opened lazily (safetensors are memory-mapped, slices read alone)."""

    def __init__(self, path: Path, manifest: dict, threads: int) -> None:
        self.path, self.manifest, self.threads = path, manifest, threads
        self.step, self.layout = manifest["step"], manifest["layout"]
        self.run_id: str | None = manifest.get("run_id")  # None: written before run identities
        self._verified: dict[str, dict] = {}
        self._states: dict[str, dict] = {}
        self._files: dict[tuple[str, str], Any] = {}

    def verify(self, parts: list[str]) -> None:
        """Check the parts' manifests, then hash all their files in one pool of `threads`."""
        todo = [p for p in parts if p not in self._verified]
        manifests = {p: ckpt.verify_part(self.path, p, self.manifest["parts"][p], self.step, hash_files=False,
                                         run_id=self.run_id) for p in todo}
        ckpt.check_hashes([(self.path / p / n, meta["sha256"]) for p, m in manifests.items()
                           for n, meta in m["files"].items()], self.threads)
        self._verified.update(manifests)

    def groups(self, part: str) -> set[str]:
        files = self._verified[part]["files"]
        return {n[: -len(".safetensors")] for n in files if n.endswith(".safetensors") and n != ckpt.STATE_TENSORS}

    def state(self, part: str) -> dict:
        if part not in self._states:
            self._states[part] = ckpt.load_dir(self.path / part, self._verified[part], self.step, groups=False).state
        return self._states[part]

    def file(self, part: str, group: str):
        key = (part, group)
        if key not in self._files:
            f = self.path / part / f"{group}.safetensors"
            try:
                self._files[key] = safe_open(str(f), framework="pt")
            except Exception as e:  # noqa: BLE001 -- safetensors raises several types
                raise ckpt.CheckpointError(f"{f}: not a readable safetensors file ({type(e).__name__}: "
                                           f"{str(e)[:200]})") from None
        return self._files[key]

    def tensors(self, part: str, group: str) -> dict[str, torch.Tensor]:
        f = self.file(part, group)
        return {k: f.get_tensor(k) for k in f.keys()}


def _coords(layout: dict) -> list[str]:
    return [ckpt.part_name(t, p, d) for t in range(layout["tp"]) for p in range(layout["pp"])
            for d in range(layout["dp"])]


def needed_parts(run: Run, saved: dict, ranks: list[str], *, distributed: bool) -> list[str]:
    """The parts of a checkpoint written at layout `saved` this rank reads (and so verifies);
    `ranks` maps this run's global ranks to their part names."""
    p = run.parallel
    same_mp = (saved["tp"], saved["pp"]) == (p.tp, p.pp)
    if same_mp:
        parts = [ckpt.part_name(p.tp_rank, p.pp_rank, 0)]  # the weights (and a plain optimizer)
        if distributed and saved["dp"] != p.dp:  # re-sliced from every DP rank's share
            parts += [ckpt.part_name(p.tp_rank, p.pp_rank, d) for d in range(saved["dp"])]
    else:  # resharded from every stage and tensor-parallel rank
        parts = _coords(saved) if distributed else [ckpt.part_name(t, s, 0) for t in range(saved["tp"])
                                                    for s in range(saved["pp"])]
    parts.append(_state_part(run, saved))
    if run.strategies.behaviour.keeps_state:  # the pool's bytes: this node index's keepers (another layout: every part)
        parts += pool_parts(p.rank, ranks, saved["local_world"]) if saved == layout_of(run) else _coords(saved)
    return list(dict.fromkeys(parts))


def _state_part(run: Run, saved: dict) -> str:
    """Whose counters and streams this rank takes: its own part, or dp_rank min(d, saved dp - 1)'s."""
    p = run.parallel
    own = my_part(run)
    return own if own in _coords(saved) else ckpt.part_name(0, 0, min(p.dp_rank, saved["dp"] - 1))


def resume(run: Run) -> None:
    """Every rank resumes from the newest step that verifies on all ranks (see the module
    docstring). No checkpoint, or checkpoint.resume: false: the run starts at step 0."""
    root = run.out_dir / "checkpoints"
    wait(root)  # a save of this process still in flight (a trainer rebuilt in one process)
    if not run.cfg.checkpoint.resume:
        return
    refused: list[str] = []

    def note(msg: str) -> None:
        refused.append(msg)
        run.log(msg)

    _refuse_old_format(root)
    ranks = parallel.dp_gather_objects(my_part(run), parallel.world_group())  # global rank -> part name
    found = _agree(run, root, ranks, note)
    if found == -2:
        raise ckpt.CheckpointError(
            f"checkpoint.resume: no checkpoint under {root} can be used ({'; '.join(refused) or 'another rank'}); "
            f"repair or move them, or set checkpoint.resume=false")
    if found is None:
        return
    saved = found
    error = None
    try:
        _install(run, saved, ranks)
    except ckpt.CheckpointError as e:
        error = e
    if parallel.world_min(-1 if error is not None else 0) < 0:
        raise error or ckpt.CheckpointError(f"checkpoint step {saved.step}: refused on another rank (see its log)")
    run.state.saved_step = run.state.step
    run.state.run_id = saved.run_id or ""  # before run identities: the next save makes one
    moved = "" if saved.layout == layout_of(run) else (
        f" (written at tp={saved.layout['tp']} pp={saved.layout['pp']} dp={saved.layout['dp']}, resharded to "
        f"tp={run.parallel.tp} pp={run.parallel.pp} dp={run.parallel.dp})")
    run.log(f"[pfppo] resumed from {saved.path} (step {run.state.step}){moved}")


def _agree(run: Run, root: Path, ranks: list[str], note) -> Saved | int | None:
    """The newest step every rank verified (each its own parts, once); None when there is none,
    -2 when there are checkpoints and none can be used on some rank."""
    threads = run.cfg.checkpoint.io_threads
    distributed = any(ckpt.is_distributed(o) for o in run.models.optimizers().values())
    candidates = {ckpt._step_of(d): d for d in ckpt._candidates(root, note)}
    ok: dict[int, Saved | None] = {}
    foreign: list[str] = []  # parts another run or step wrote, found in the steps this rank checked

    def check(step: int) -> Saved | None:
        if step not in ok:
            path = candidates[step]
            try:
                m = ckpt.read_sharded_manifest(path)
                saved = Saved(path, m, threads)
                saved.verify(needed_parts(run, m["layout"], ranks, distributed=distributed))
                ok[step] = saved
            except ckpt.PartBindingError as e:
                foreign.append(f"rank {run.parallel.rank}: {e}")
                ok[step] = None
            except ckpt.CheckpointError as e:
                note(f"[checkpoint] skipping {path.name}: {e}")
                ok[step] = None
        return ok[step]

    limit = None
    while True:
        mine = next((s for s in sorted(candidates, reverse=True) if (limit is None or s <= limit) and check(s)), None)
        mine = -1 if mine is None else mine
        low, high = parallel.world_min(mine), -parallel.world_min(-mine)
        if low == high:
            break
        limit = low
    _refuse_foreign_parts(run, foreign, ok[low] if low >= 0 else None)
    if low >= 0:
        return ok[low]
    return -2 if parallel.world_min(-len(candidates)) < 0 else None  # some rank has checkpoints, none usable


def _refuse_foreign_parts(run: Run, foreign: list[str], saved: Saved | None) -> None:
    """Before anything is loaded, across ranks (each verified only the parts it reads): a part that
    another run or step wrote, found by any rank, is refused on every rank (PartBindingError), and
    every rank must have read the same run identity for the agreed step."""
    seen = parallel.dp_gather_objects((foreign[:1], None if saved is None else (saved.step, saved.run_id)),
                                      parallel.world_group())
    found = [msg for msgs, _ in seen for msg in msgs]
    if found:
        raise ckpt.PartBindingError(found[0])
    views = {view for _, view in seen}
    if len(views) > 1:
        raise ckpt.PartBindingError(f"the ranks read different steps or run identities (step, run_id) for the "
                                    f"agreed checkpoint: {sorted(views, key=str)}; every rank must see the same "
                                    f"files (a shared checkpoint directory)")


# ---------------------------------------------------------------------------- install


def _need_fn(where: Path):
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ckpt.CheckpointError(f"{where}: {what}")
    return need


class _Reshard:
    """The saved weights and optimizer shards, re-cut to this run's layout.

    Same TP size: a tensor is read from the saved rank of this TP rank (whichever stage holds its
    global name); an optimizer range from whichever saved DP shares cover it. Another TP size:
    the full tensor is rebuilt from every saved TP rank (reshard.unshard), its padded vocabulary
    rows re-padded, and cut for this rank (reshard.shard)."""

    def __init__(self, run: Run, saved: Saved) -> None:
        self.run, self.saved = run, saved
        self.old, p = saved.layout, run.parallel
        self.same_tp = self.old["tp"] == p.tp
        self.vocab = run.models.model_cfg.vocab_size
        self._weights: dict[str, dict[str, dict[int, str]]] = {}  # group -> name -> tp rank -> part
        self._slices: dict[str, dict[str, list]] = {}  # opt -> name -> [(tp rank, part, shape, start, end)]

    # --- index
    def _weight_index(self, group: str) -> dict[str, dict[int, str]]:
        if group not in self._weights:
            idx: dict[str, dict[int, str]] = {}
            for t in (range(self.old["tp"]) if not self.same_tp else [self.run.parallel.tp_rank]):
                for s in range(self.old["pp"]):
                    part = ckpt.part_name(t, s, 0)
                    if part not in self.saved._verified or group not in self.saved.groups(part):
                        continue
                    for k in self.saved.file(part, group).keys():
                        idx.setdefault(k, {}).setdefault(t, part)
            self._weights[group] = idx
        return self._weights[group]

    def _slice_index(self, opt: str) -> dict[str, list]:
        if opt not in self._slices:
            idx: dict[str, list] = {}
            for part in self.saved._verified:
                t, _, _ = ckpt.part_coords(part)
                if self.same_tp and t != self.run.parallel.tp_rank:
                    continue
                entry = self.saved.state(part).get(opt)
                if not (isinstance(entry, dict) and ckpt._DIST in entry):
                    continue
                for sub in entry[ckpt._DIST]:
                    for name, shape, start, end in sub.get("slices") or []:
                        idx.setdefault(name, []).append((t, part, tuple(shape), start, end))
            self._slices[opt] = idx
        return self._slices[opt]

    # --- tensor-parallel re-cut
    def _recut(self, group: str, name: str, shards: list[torch.Tensor], local_shape: tuple[int, ...]) -> torch.Tensor:
        critic_head = group in ("critic", "critic_opt") and name.startswith("output_layer.")
        split = reshard.Split.REPLICATED if critic_head else reshard.split_of(name)  # the value head: replicated
        full = reshard.unshard(shards, split)
        if split is reshard.Split.ROWS and name.endswith(("word_embeddings.weight", "output_layer.weight")):
            rows = local_shape[0] * self.run.parallel.tp
            if full.shape[0] != rows:  # the vocabulary is padded to a multiple of tp: re-pad
                full = reshard.pad_rows(full[: self.vocab], rows)
        return reshard.shard(full, split, self.run.parallel.tp, self.run.parallel.tp_rank)

    def _alias(self, name: str, idx: dict) -> str:
        """A tied output layer saved at pp = 1 lives under the embedding's name."""
        if name not in idx and name == "output_layer.weight" and "embedding.word_embeddings.weight" in idx:
            return "embedding.word_embeddings.weight"
        return name

    def weight(self, group: str, name: str, local_shape: tuple[int, ...]) -> torch.Tensor:
        idx = self._weight_index(group)
        key = self._alias(name, idx)
        where = idx.get(key)
        if not where:
            raise ckpt.CheckpointError(f"{self.saved.path}: {group} tensor {name} is in no saved part (layout "
                                       f"tp={self.old['tp']} pp={self.old['pp']}): another model")
        if self.same_tp:
            return self.saved.file(where[self.run.parallel.tp_rank], group).get_tensor(key)
        if sorted(where) != list(range(self.old["tp"])):
            raise ckpt.CheckpointError(f"{self.saved.path}: {group} tensor {name} is saved by tensor-parallel ranks "
                                       f"{sorted(where)} of {self.old['tp']}: cannot rebuild it")
        shards = [self.saved.file(where[t], group).get_tensor(key) for t in range(self.old["tp"])]
        return self._recut(group, name, shards, local_shape)

    def opt_range(self, opt: str, name: str, shape: tuple[int, ...], start: int, end: int) -> dict[str, torch.Tensor]:
        """{"param", "exp_avg", "exp_avg_sq"}[start:end] of parameter `name` (local shape `shape`)."""
        idx = self._slice_index(opt)
        key = self._alias(name, idx)
        entries = idx.get(key, [])
        if self.same_tp:
            return {k: self._cover(opt, key, k, entries, start, end) for k in ckpt._PARAM_KEYS}
        out = {}
        for k in ckpt._PARAM_KEYS:
            shards = []
            for t in range(self.old["tp"]):
                mine = [e for e in entries if e[0] == t]
                if not mine:
                    raise ckpt.CheckpointError(f"{self.saved.path}: {opt} {name}: no saved optimizer share of "
                                               f"tensor-parallel rank {t}")
                old_shape = mine[0][2]
                shards.append(self._cover(opt, key, k, mine, 0, math.prod(old_shape)).view(old_shape))
            out[k] = self._recut(opt, name, shards, shape).reshape(-1)[start:end].clone()
        return out

    def plain_state(self, opt: str, name: str, shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
        """A plain optimizer's {"step", "exp_avg", "exp_avg_sq"} of parameter `name` (local shape
        `shape`), rebuilt from the dp_rank 0 parts of every saved TP rank (another TP/PP layout)."""
        idx = self._weight_index(OPT_MODEL[opt])
        where = idx.get(self._alias(name, idx)) or {}
        tps = [self.run.parallel.tp_rank] if self.same_tp else list(range(self.old["tp"]))
        if any(t not in where for t in tps):
            raise ckpt.CheckpointError(f"{self.saved.path}: {opt} {name}: not saved by every tensor-parallel rank")
        per_rank = []
        for t in tps:
            st = self.saved.state(where[t])
            found = None
            for sub, names in zip(_as_list(st[opt]), st["opt_names"].get(opt) or []):
                key = self._alias(name, dict.fromkeys(names))
                if key in names and isinstance(sub, dict) and isinstance(sub.get("state"), dict):
                    found = sub["state"].get(names.index(key))
            if not isinstance(found, dict) or not all(isinstance(found.get(k), torch.Tensor)
                                                      for k in ("step", "exp_avg", "exp_avg_sq")):
                raise ckpt.CheckpointError(f"{self.saved.path / where[t]}: state {opt}: no Adam state for {name}")
            per_rank.append(found)
        out = {"step": per_rank[0]["step"].clone()}
        for k in ("exp_avg", "exp_avg_sq"):
            shards = [f[k] for f in per_rank]
            out[k] = shards[0].clone() if self.same_tp else self._recut(opt, name, shards, shape).contiguous()
        return out

    def _cover(self, opt: str, name: str, k: str, entries: list, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of `name`'s flat state `k`, from the saved slices that overlap it."""
        out = torch.empty(end - start, dtype=torch.float32)
        covered = 0
        for _, part, _, a, b in entries:
            lo, hi = max(a, start), min(b, end)
            if lo >= hi:
                continue
            src = self.saved.file(part, OPTIM).get_slice(f"{opt}/{name}/{k}")[lo - a: hi - a]
            out[lo - start: hi - start] = src
            covered += hi - lo
        if covered != end - start:  # the saved shares partition each parameter: anything else is damage
            raise ckpt.CheckpointError(f"{self.saved.path}: {opt} {name}/{k}: the saved shares cover {covered} of "
                                       f"elements [{start}, {end}) this rank owns")
        return out


def _as_list(state: Any) -> list:
    return state if isinstance(state, list) else [state]


def _check_layout(run: Run, saved: Saved, need) -> None:
    """What cannot be resharded is refused by name."""
    old, p = saved.layout, run.parallel
    if (old["tp"], old["pp"]) != (p.tp, p.pp):
        plain = [n for n, o in run.models.optimizers().items() if not ckpt.is_distributed(o)
                 and any(q.dtype != torch.float32 for q in run.models.trained()[OPT_MODEL[n]].parameters())]
        need(not plain, f"written at tp={old['tp']} pp={old['pp']}, this run has tp={p.tp} pp={p.pp}: a plain "
                        f"optimizer's state ({', '.join(plain)}) over {run.cfg.model.params_dtype} parameters keeps "
                        f"fp32 main copies by index and is not resharded to another tensor/pipeline layout; resume "
                        f"at the layout it was written at, or with parallel.use_distributed_optimizer=true on both "
                        f"sides, or use another logging.output_dir, or checkpoint.resume=false (the HF export of a "
                        f"run loads at any layout)")


def _pool_share(run: Run, saved: Saved, ranks: list[str], meta: Any, need) -> tuple[Any, dict[str, torch.Tensor]]:
    """The pool statistics and the bucket tensors this rank keeps. Same layout: its node index's
    buckets from the keeper on each node. Another layout (another world or node size): the buckets
    it keeps now (bucket k on node rank k mod L) picked from every part that wrote some, and each
    snapshot's entry rebuilt for that set (its checksum over those bytes, which the parts' sha256
    verified); the bucket plan must be the same (load_state compares it with the live pool)."""
    from pfppo_mega.pool.sharded import NONE
    from pfppo_mega.pool.snapshots import compute_checksum

    old, p = saved.layout, run.parallel
    if old == layout_of(run):
        pool: dict[str, torch.Tensor] = {}
        for part in pool_parts(p.rank, ranks, old["local_world"]):
            if "pool" in saved.groups(part):
                pool.update(saved.tensors(part, "pool"))
        return meta, pool
    need(isinstance(meta, dict) and isinstance(meta.get("snapshots"), list),
         "state pool must hold the pool's snapshots (a list)")
    everything: dict[str, str] = {}  # "<slot>/bucket.<k>" -> the part that wrote it
    for part in _coords(old):
        if "pool" in saved.groups(part):
            everything.update({n: part for n in saved.file(part, "pool").keys()})
    L = _local_world(run)
    j = p.rank % L
    pool, snapshots = {}, []
    for slot, entry in enumerate(meta["snapshots"]):
        need(isinstance(entry, dict), f"state pool snapshot {slot} must be an object")
        mine = sorted((int(n.rsplit(".", 1)[1]), n) for n in everything
                      if n.startswith(f"{slot}/bucket.") and n.rsplit(".", 1)[1].isdigit()
                      and int(n.rsplit(".", 1)[1]) % L == j)
        named = [(n.split("/", 1)[1], saved.file(everything[n], "pool").get_tensor(n)) for _, n in mine]
        if not named:  # more ranks per node than buckets: this rank keeps none
            named = [(NONE, torch.zeros(0, dtype=torch.uint8))]
        pool.update({f"{slot}/{n}": t for n, t in named})
        snapshots.append({**entry, "names": [n for n, _ in named], "checksum": compute_checksum(named, "fingerprint")})
    return {**meta, "snapshots": snapshots}, pool


def _plain_resharded(run: Run, re: "_Reshard", name: str, opt: Any, subs: list, need) -> list:
    """[(param groups, {main param: Adam state})] per sub-optimizer of a plain optimizer whose
    checkpoint was written at another TP/PP layout: each parameter's moments rebuilt by name."""
    names = param_names(run, run.models.trained()[OPT_MODEL[name]])
    model_of = {id(getattr(q, "main_param", q)): q for q in names}
    out = []
    for o, saved_sub in zip(_subs(opt), subs):
        need(len(saved_sub["param_groups"]) == len(o.optimizer.param_groups),
             f"state {name}: {len(saved_sub['param_groups'])} param groups, the run's optimizer has "
             f"{len(o.optimizer.param_groups)}")
        state = {}
        for g in o.optimizer.param_groups:
            for q in g["params"]:
                model = model_of[id(q)]
                rebuilt = re.plain_state(name, names[model], tuple(model.shape))
                need(tuple(rebuilt["exp_avg"].shape) == tuple(q.shape),
                     f"state {name}: {names[model]} rebuilt with shape {tuple(rebuilt['exp_avg'].shape)}, the "
                     f"parameter has {tuple(q.shape)}")
                state[q] = state_like_param(rebuilt, q, device_step=bool(g.get("fused") or g.get("capturable")))
        out.append((saved_sub["param_groups"], state))
    return out


def state_like_param(state: dict[str, torch.Tensor], param: torch.Tensor, *,
                     device_step: bool) -> dict[str, torch.Tensor]:
    """One parameter's optimizer state placed as torch's Optimizer.load_state_dict places it (state
    installed by hand skips that cast; the checkpoint's tensors are on the host): every tensor on the
    parameter's device, floating ones in its dtype, except ``step``, which stays as saved unless the
    group runs fused or capturable (``device_step``: then float32 on the parameter's device, where
    the fused kernel reads it)."""
    out = {}
    for k, v in state.items():
        if k == "step":
            out[k] = v.to(dtype=torch.float32, device=param.device) if device_step else v
        elif param.is_floating_point() and v.is_floating_point():
            out[k] = v.to(dtype=param.dtype, device=param.device)
        else:
            out[k] = v.to(device=param.device)
    return out


@dataclass
class _Checked:
    """What _install's checks read and built, before anything of the run is changed."""

    source: str                                 # the part whose counters and streams this rank takes
    state: dict                                 # that part's state
    weights_part: str                           # dp_rank 0's part of this TP/PP rank: weights, plain optimizer
    plain_source: dict                          # its state
    where: Path                                 # the source part's directory, for messages
    weights: dict[str, dict[str, torch.Tensor]]  # model -> this rank's tensors, resharded
    reshard: "_Reshard"
    opt_meta: dict[str, Any] = field(default_factory=dict)     # distributed optimizers' saved shares
    plain_moved: dict[str, list] = field(default_factory=dict)  # plain optimizers rebuilt by name
    edits: list = field(default_factory=list)   # HYPER settings changed since the checkpoint
    moved: list = field(default_factory=list)   # MOVABLE settings changed (same content decides)


def _install(run: Run, saved: Saved, ranks: list[str]) -> None:
    """Check a verified checkpoint against this run, then install this rank's share of it (no
    collectives). CheckpointError names the file, the value and the rule it breaks."""
    c = _check(run, saved)  # nothing of the run changes before every check passed
    _install_weights(run, c)
    _install_optimizers(run, c)
    _install_streams(run, c)
    if c.state["pool"] is not None:
        meta, pool = _pool_share(run, saved, ranks, c.state["pool"], _need_fn(c.where))
        run.strategies.behaviour.load_state(meta, pool, saved.step, _need_fn(c.where))
    st = run.state
    st.guards.update(c.state["guards"])
    st.consecutive_skips.update(c.state["consecutive_skips"])
    st.step = c.state["step"]
    for key, old, new in c.moved:
        run.log(f"[pfppo] resume: {key} is {new!r} now, {old!r} in the checkpoint: the same content "
                f"({_content_of(run, key)}), so the run resumes from it")


def _check(run: Run, saved: Saved) -> _Checked:
    """Every check of the checkpoint against this run, and the tensors this rank will install."""
    source = _state_part(run, saved.layout)
    where = saved.path / source
    need = _need_fn(where)
    _check_layout(run, saved, need)
    s = saved.state(source)
    _check_state(run, saved, s, need)
    weights_part = _weights_part(run, saved)
    _check_models_held(run, saved, weights_part, need)
    plain_source = saved.state(weights_part) if weights_part != source else s  # dp_rank 0's: every optimizer
    need(set(plain_source) == STATE_KEYS, f"{weights_part} state keys {sorted(plain_source)} must be {sorted(STATE_KEYS)}")
    need(("critic_opt" in run.models.optimizers()) == (plain_source["critic_opt"] is not None),
         f"state critic_opt is {'absent' if plain_source['critic_opt'] is None else 'present'} but this run "
         f"{'builds' if 'critic_opt' in run.models.optimizers() else 'has no'} a critic")
    re = _Reshard(run, saved)
    c = _Checked(source=source, state=s, weights_part=weights_part, plain_source=plain_source, where=where,
                 weights=_resharded_weights(run, re, need), reshard=re)
    _check_optimizers(run, saved, c, need)
    c.edits, c.moved = check_edits(s["config"], config_to_dict(run.cfg), need)  # before anything is installed
    _check_reference(run, s["reference"], need)
    _check_counters(run.state, s, need)
    return c


def _check_state(run: Run, saved: Saved, s: dict, need) -> None:
    t = run.cfg.training
    need(set(s) == STATE_KEYS, f"state keys {sorted(s)} must be {sorted(STATE_KEYS)}")
    need(type(s["step"]) is int and s["step"] == saved.step,
         f"state step = {s['step']!r} must equal the checkpoint's step {saved.step}")
    need(saved.step <= t.total_training_steps,
         f"step {saved.step} > training.total_training_steps ({t.total_training_steps}): this checkpoint is "
         f"from a longer run; raise total_training_steps, or use another logging.output_dir or "
         f"checkpoint.resume=false")
    has_pool, keeps = s["pool"] is not None, run.strategies.behaviour.keeps_state
    need(has_pool == keeps,
         f"the checkpoint {'holds' if has_pool else 'has no'} PF-PPO pool but this run has "
         f"algorithm.use_pf_ppo={keeps}: resume with the setting it was written with")


def _weights_part(run: Run, saved: Saved) -> str:
    """The part holding this rank's weights (and a plain optimizer): dp_rank 0 of its TP/PP rank,
    or of rank 0 when the TP/PP layout changed (resharding reads every rank's from there)."""
    old, p = saved.layout, run.parallel
    return ckpt.part_name(p.tp_rank if old["tp"] == p.tp else 0, p.pp_rank if old["pp"] == p.pp else 0, 0)


def _check_models_held(run: Run, saved: Saved, weights_part: str, need) -> None:
    models = run.models.trained()
    held = saved.groups(weights_part) - {OPTIM, "pool"}
    wants, holds = "critic" in models, "critic" in held
    hint = "" if wants == holds else (
        f" (algorithm.adv_estimator = {run.cfg.algorithm.adv_estimator!r} {'needs a' if wants else 'needs no'} "
        f"critic; this checkpoint {'has none' if wants else 'has one'}: resume with the estimator it was written with)")
    need(held == set(models), f"tensor files {sorted(held)} must be {sorted(models)}{hint}")


def _resharded_weights(run: Run, re: "_Reshard", need) -> dict[str, dict[str, torch.Tensor]]:
    """Each model's tensors for this rank, cut from the checkpoint, shapes and values checked."""
    stage = _stage(run)
    loaded: dict[str, dict[str, torch.Tensor]] = {}
    for group, model in run.models.trained().items():
        sd = {}
        for k, v in tensor_state(model).items():
            try:
                sd[k] = re.weight(group, stage.to_global(k), tuple(v.shape))
            except ckpt.CheckpointError as e:
                need(False, f"{group}.safetensors does not fit the configured model: {e}")
            need(tuple(sd[k].shape) == tuple(v.shape), f"{group}.safetensors does not fit the configured model: "
                                                       f"checkpoint tensor {k}: shape {tuple(sd[k].shape)}, model "
                                                       f"{tuple(v.shape)}")
        bad = [k for k, v in sd.items() if v.is_floating_point() and not bool(v.isfinite().all())]
        need(not bad, f"{group}.safetensors: tensors {bad[:3]} hold NaN/inf")
        loaded[group] = sd
    return loaded


def _check_optimizers(run: Run, saved: Saved, c: _Checked, need) -> None:
    """Each optimizer's saved state against the run's: a distributed one's shares (c.opt_meta), a
    plain one as saved (same TP/PP) or rebuilt by parameter name (c.plain_moved)."""
    old, p = saved.layout, run.parallel
    for name, opt in run.models.optimizers().items():
        if ckpt.is_distributed(opt):
            c.opt_meta[name] = ckpt.check_shard_meta(opt, c.state[name], f"{c.where}: state {name}")
        elif (old["tp"], old["pp"]) == (p.tp, p.pp):
            ckpt.check_optimizer_state(opt, c.plain_source[name], f"{saved.path / c.weights_part}: state {name}")
        else:  # rebuilt by parameter name (fp32 parameters: checked by _check_layout)
            subs = _as_list(c.plain_source[name])
            need(len(subs) == len(_subs(opt)) and all(isinstance(x, dict) and isinstance(x.get("param_groups"), list)
                                                      for x in subs),
                 f"state {name}: {len(subs)} optimizer states with param_groups, the run has {len(_subs(opt))}")
            c.plain_moved[name] = _plain_resharded(run, c.reshard, name, opt, subs, need)


def _check_reference(run: Run, ref: Any, need) -> None:
    """The frozen reference is rebuilt from actor_rollout.model_path: its content (reference_identity)
    must be the checkpoint's, wherever it lies now (a copy on node-local disk resumes)."""
    now = reference_identity(run.cfg.actor_rollout.model_path)
    then = ref.get("sha256") if isinstance(ref, dict) else ref
    was = ref.get("path") if isinstance(ref, dict) else "?"
    need(then == now["sha256"],
         f"the frozen reference ({now['path']}) is not the one this checkpoint was trained against (identity "
         f"{then!r} of {was} -> {now['sha256']}): other content than the checkpoint's model (config.json and "
         f"weights); resume with the model it was written with (at any path), or use another "
         f"logging.output_dir, or checkpoint.resume=false")


def _check_counters(st, s: dict, need) -> None:
    need(isinstance(s["guards"], dict) and set(s["guards"]) <= set(st.guards)
         and all(type(v) is int and v >= 0 for v in s["guards"].values()),
         f"guards = {str(s['guards'])[:200]}: keys must be among {sorted(st.guards)}, values ints >= 0")
    need(isinstance(s["consecutive_skips"], dict) and set(s["consecutive_skips"]) == set(st.consecutive_skips)
         and all(type(v) is int and v >= 0 for v in s["consecutive_skips"].values()),
         f"consecutive_skips = {str(s['consecutive_skips'])[:200]}: keys must be {sorted(st.consecutive_skips)}, "
         f"values ints >= 0")


def _install_weights(run: Run, c: _Checked) -> None:
    for group, model in run.models.trained().items():
        try:
            load_tensor_state(model, c.weights[group])
        except ValueError as e:
            _need_fn(c.where)(False, f"{group}.safetensors does not fit the configured model: {e}")


def _install_optimizers(run: Run, c: _Checked) -> None:
    """The optimizers' states (this build's AdamW implementation kept), then the changed HYPER settings."""
    opts, models = run.models.optimizers(), run.models.trained()
    kernels = _kernel_choice(opts)  # this build's AdamW implementation, not the checkpoint's
    for name, opt in opts.items():
        if name in c.opt_meta:
            ckpt.install_optimizer_shard(opt, c.opt_meta[name], param_names(run, models[OPT_MODEL[name]]),
                                         lambda n, shape, a, b, _o=name: c.reshard.opt_range(_o, n, shape, a, b),
                                         f"{c.where}: state {name}")
        elif name in c.plain_moved:
            for o, (groups, state) in zip(_subs(opt), c.plain_moved[name]):
                for g, saved_g in zip(o.optimizer.param_groups, groups):
                    g.update({k: v for k, v in saved_g.items() if k != "params"})
                o.optimizer.state.update(state)
        else:
            opt.load_state_dict(c.plain_source[name])
    _restore_kernel_choice(opts, kernels)
    for key, old_v, new in c.edits:  # the optimizer's saved hyper-parameters would win: the new value, on purpose
        _apply_hyper(opts, key, new)
        run.log(f"[pfppo] resume: {key} changed since the checkpoint ({old_v!r} -> {new!r}); the new value is "
                f"applied to the optimizer")


def _install_streams(run: Run, c: _Checked) -> None:
    """The random streams, running reward and data position. The prompt stream is the job's (every
    rank holds the same one: each replica draws the global batch and keeps its slice), so any rank
    continues it exactly from the part _state_part names -- its own, or, at a new TP/PP coordinate
    or a new replica, dp_rank min(d, saved dp - 1)'s tp0-pp0 part: resumes at a larger or smaller DP
    draw the uninterrupted run's rows and seeds. (A checkpoint from before the job-wide stream holds
    one stream per replica; each rank continues the one it takes.)"""
    s, st = c.state, run.state
    need = _need_fn(c.where)
    try:
        run.state.rng.setstate(s["rng"])
        for name in ("torch_rng", "assign_rng"):
            need(isinstance(s[name], torch.Tensor) and s[name].dtype == torch.uint8 and s[name].dim() == 1,
                 f"state {name} must be a 1-D uint8 tensor")
        torch.set_rng_state(s["torch_rng"])
        run.state.assign_gen.set_state(s["assign_rng"])
        st.running_reward.load_state_dict(s["running_reward"])
    except (TypeError, ValueError, RuntimeError, AttributeError) as e:
        need(False, f"RNG or running-reward state refused ({type(e).__name__}: {str(e)[:200]})")
    try:  # the data position (prompt files: epoch and offset; the built-in task: in `rng`)
        run.prompts.load_state_dict(s["data"])
    except (ValueError, KeyError, TypeError) as e:
        need(False, f"state data (the data position) refused: {type(e).__name__}: {e}")


def _content_of(run: Run, key: str) -> str:
    """What showed a MOVABLE setting's content to be the checkpoint's, for the resume note."""
    if key == "actor_rollout.model_path":
        return f"model identity {reference_identity(run.cfg.actor_rollout.model_path)['sha256'][:12]}"
    digest = getattr(run.prompts, "digest", None)
    return f"training rows sha256 {digest()[:12]}" if digest else "not read by data.source = task"


def load_part(root: Path, part: str = "tp0-pp0-dp0", step: int | None = None) -> ckpt.Checkpoint:
    """One rank's part of the newest (or the given) committed step, verified: for tests and tools."""
    if step is None:
        step = max((ckpt._step_of(d) for d in ckpt._candidates(root, lambda *_: None)), default=None)
        if step is None:
            raise ckpt.CheckpointError(f"{root}: no checkpoint")
    path = root / f"step_{step:06d}"
    m = ckpt.read_sharded_manifest(path)
    pm = ckpt.verify_part(path, part, m["parts"][part], step, run_id=m.get("run_id"))
    return ckpt.load_dir(path / part, pm, step)
