"""The generator process (started by process.py with the spawn method; no trainer state in it).

It builds the run's engine, then loops: take every message waiting (weights of a new version,
requests, stop), pick the version of the next request by the sampling rule among the versions it
holds, push those weights into the engine when it holds another, generate, send the rows back.
New weights enter between requests; with ``partial`` (algorithm.async_rl.partial_rollouts) also
inside one: at every token boundary the engine asks (``switch``), the messages waiting are taken
and a newer version held is loaded, and the rest of the request is generated with it (each token
tagged with its version: Result.token_versions).

Messages in (trainer -> generator), tuples:
    ("weights", version, path)            the version's weight file (weightfile.py), mapped on
                                          receipt; older versions beyond the window are forgotten
    ("request", Request)                  n responses for each prompt of the request
    ("stop",)
Messages out: ("ready",), ("result", Result), ("error", text).

A weight file that is torn or of another version is refused by name (an "error": the trainer
restarts the process). A missing one is skipped: the trainer removes a version's file only after
announcing a version that evicts it from the pool, whose message follows in the pipe.

A reader thread receives the messages (so a trainer's push never waits for a request to end); when
the trainer's end of the pipe closes (the trainer died) the process exits at once, and on Linux
the kernel also kills it when its parent dies (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import os
import queue
import random
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from pfppo_mega.rollout import SamplingParams
from pfppo_mega.rollout.weights import WeightUpdateError
from pfppo_mega.trainer.asynchronous import weightfile
from pfppo_mega.trainer.asynchronous.buffer import VersionPool, choose_version


@dataclass(frozen=True)
class WorkerSpec:
    """What the generator process needs to build its engine (picklable)."""

    cfg: Any                   # the run's Config
    model_dir: str
    hf_cfg: dict
    pad_token_id: int
    window: int                # versions before the newest a request may use (buffer.version_window)
    rule: str                  # algorithm.async_rl.sampling
    temperature: float         # its recency temperature
    num_threads: int = 1
    partial: bool = False      # algorithm.async_rl.partial_rollouts: new weights inside a request too


@dataclass(frozen=True)
class Request:
    rid: int                   # request id (a redone request keeps it)
    prompts: list[list[int]]   # one per prompt group
    n: int                     # responses per prompt
    params: SamplingParams     # its seed makes the request reproducible on the same weights


@dataclass
class Result:
    rid: int
    version: int
    responses: torch.Tensor    # [P * n, T] rows of prompt p at p*n .. p*n+n-1
    mask: torch.Tensor
    logprobs: torch.Tensor
    finished: torch.Tensor     # [P * n]
    generate_s: float          # seconds in the engine (and its weight switch) for this request
    idle_s: float              # seconds the generator waited with no request before this one
    switch_s: float
    token_versions: Optional[torch.Tensor] = None  # [P * n, T] the version of each token (-1 on padding);
    # None: every token is ``version``'s. With partial rollouts ``version`` is the oldest token's.
    switches: int = 0          # versions loaded inside this request (partial rollouts)


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent thread dies (prctl PR_SET_PDEATHSIG)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except OSError:
        pass  # not Linux: the closed pipe still ends the process


def _own_process_group() -> str:
    """An in-process vLLM engine needs torch.distributed initialised first in its process: a gloo
    group of one, on a file store of its own (the trainer's MASTER_ADDR / MASTER_PORT, inherited
    through the environment, belong to the trainer's group). Returns the store's file: vLLM's own
    groups, made while it builds, use it; remove it after."""
    import tempfile

    import torch.distributed as dist

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    store = tempfile.NamedTemporaryFile(prefix="pfppo-generator-pg-", delete=False)
    store.close()
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    dist.init_process_group("gloo", init_method=f"file://{store.name}", rank=0, world_size=1)
    return store.name


def _reader(inbox, messages: "queue.Queue") -> None:
    try:
        while True:
            messages.put(inbox.recv())
    except (EOFError, OSError):
        os._exit(0)  # the trainer is gone: nothing may outlive it


def main(inbox, outbox, spec: WorkerSpec, parent_pid: int) -> None:
    _die_with_parent()
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)
    torch.set_num_threads(spec.num_threads)
    store = None
    try:
        from pfppo_mega.trainer.colocation.engine_sync import build_engine

        if spec.cfg.actor_rollout.engine == "vllm":
            store = _own_process_group()
        engine = build_engine(spec.cfg, Path(spec.model_dir), spec.hf_cfg, pad_token_id=spec.pad_token_id,
                              world_size=1, log=lambda *_: None)
    except Exception:
        outbox.send(("error", traceback.format_exc()))
        return
    finally:
        if store is not None:
            os.unlink(store)
    messages: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(inbox, messages), daemon=True).start()
    outbox.send(("ready",))
    try:
        serve(engine, messages, outbox, spec)
    except Exception:
        outbox.send(("error", traceback.format_exc()))


def _map(pool: VersionPool, version: int, path: str) -> None:
    """Version ``version``'s weight file into the pool (mapped, not yet read); a missing file is skipped."""
    try:
        pool.add(version, (path, weightfile.read(path, version)))
    except weightfile.WeightFileMissing:
        pass  # removed by the trainer: a version that evicts it is on its way


def _load(engine, pool: VersionPool, version: int) -> None:
    """Push held version ``version`` into the engine (verified bucket by bucket), naming its file on refusal."""
    path, buckets = pool.held[version]
    try:
        engine.update_weights(iter(buckets), version)
    except WeightUpdateError as e:
        raise weightfile.WeightFileError(f"weight file {path} (version {version}) refused by the engine: {e}") from e


class _Stop(Exception):
    """A stop message taken at a token boundary (partial rollouts): the request in flight is abandoned."""


def _take(messages: "queue.Queue", pool: VersionPool, pending: list, *, block: bool) -> None:
    """Every message waiting (waiting up to 1 s for the first when ``block``): weights mapped into
    the pool, requests queued; a stop raises _Stop."""
    try:
        msg = messages.get(timeout=1.0) if block else messages.get_nowait()
    except queue.Empty:
        return
    while True:
        kind = msg[0]
        if kind == "stop":
            raise _Stop
        if kind == "weights":
            _map(pool, msg[1], msg[2])
        elif kind == "request":
            pending.append(msg[1])
        try:
            msg = messages.get_nowait()
        except queue.Empty:
            return


def serve(engine, messages: "queue.Queue", outbox, spec: WorkerSpec) -> None:
    """The generator's loop (see the module docstring)."""
    pool: VersionPool = VersionPool(spec.window)
    pending: list[Request] = []
    idle_from = time.perf_counter()
    while True:
        try:
            _take(messages, pool, pending, block=not pending or pool.newest is None)
            if not pending or pool.newest is None:
                continue
            req = pending.pop(0)
            result = _answer(engine, messages, pool, pending, spec, req, idle_s=time.perf_counter() - idle_from)
        except _Stop:
            return
        outbox.send(("result", result))
        idle_from = time.perf_counter()


def _answer(engine, messages: "queue.Queue", pool: VersionPool, pending: list, spec: WorkerSpec, req: Request,
            *, idle_s: float) -> Result:
    """Generate one request: with the version the rule picks, and with partial rollouts each newer
    version that arrives while it runs, from the next token on."""
    t0 = time.perf_counter()
    version = choose_version(pool.versions, spec.rule, random.Random(req.params.seed), temperature=spec.temperature)
    if engine.weight_version != version:
        _load(engine, pool, version)
    switch_s = [time.perf_counter() - t0]
    switches = [0]

    def switch(t: int) -> bool:  # at a token boundary (partial rollouts): the newest held, if newer
        _take(messages, pool, pending, block=False)
        if pool.newest is None or pool.newest <= engine.weight_version:
            return False
        s0 = time.perf_counter()
        _load(engine, pool, pool.newest)
        switch_s[0] += time.perf_counter() - s0
        switches[0] += 1
        return True

    prompts = [p for p in req.prompts for _ in range(req.n)]
    if spec.partial:
        out = engine.generate_partial(prompts, req.params, switch)
        version, token_versions = int(out.versions.min()), out.token_versions
    else:
        out = engine.generate(prompts, req.params)
        version, token_versions = out.weight_version, None
    return Result(req.rid, version, out.responses, out.response_mask, out.logprobs, out.finished,
                  time.perf_counter() - t0, idle_s, switch_s[0], token_versions, switches[0])
