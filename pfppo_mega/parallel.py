"""Process groups, in one place: torch.distributed, megatron's parallel state, seeds, CPU compat.

Layout (megatron's default order "tp-cp-ep-dp-pp"): WORLD_SIZE = tp * dp * pp; consecutive ranks
form a tensor-parallel group, data parallelism strides over them and pipeline stages are the
outermost factor. Call ``init_parallel`` once per process before building models and
``destroy_parallel`` at the end. Math code never reads these globals: it receives the groups it
needs (pfppo_mega.kernels.vocab_parallel, reshard). megatron's modules read parallel_state
internally, and so do the entry points built on them (pfppo_mega.models.passes, hf_io), which
look up the groups of the layout the model was built for and pass them down.
The same code runs on CPU / gloo and GPU / NCCL (backend "auto" picks by CUDA availability).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from pfppo_mega import watchdog
from pfppo_mega.compat import megatron_cpu
from pfppo_mega.constants import COLLECTIVE_TIMEOUT_S

_LAUNCH_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class ParallelInfo:
    """This process's place in the layout. dp = world_size / (tp * pp).

    Every rank of one model replica (same dp_rank) must be given the same batch; each dp_rank
    its own part of the global batch (pfppo_mega.models.passes).
    """

    world_size: int
    rank: int
    tp: int
    pp: int
    dp: int
    device: torch.device
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0


@dataclass
class _State:
    info: ParallelInfo
    store_dir: Optional[str]  # temp dir of the single-process FileStore, removed on destroy
    owns_process_group: bool


_state: Optional[_State] = None


def data_parallel_size(world_size: int, tp: int, pp: int) -> int:
    """dp = world_size / (tp * pp); every factor must be a positive integer."""
    for name, value in (("tp", tp), ("pp", pp), ("WORLD_SIZE", world_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}({value!r}) must be an integer >= 1")
    if world_size % (tp * pp):
        raise ValueError(
            f"tp({tp}) * pp({pp}) = {tp * pp} does not divide WORLD_SIZE({world_size})"
        )
    return world_size // (tp * pp)


def resolve_backend(backend: str) -> str:
    """auto -> nccl when CUDA devices are visible, else gloo. nccl without CUDA is an error."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend({backend!r}) must be one of 'auto', 'gloo', 'nccl'")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError(
            "backend('nccl') needs CUDA devices, but torch.cuda.is_available() is False; use gloo"
        )
    return backend


def _launched_by_env() -> bool:
    present = [k for k in _LAUNCH_ENV if k in os.environ]
    if present and len(present) < len(_LAUNCH_ENV):
        missing = [k for k in _LAUNCH_ENV if k not in os.environ]
        raise RuntimeError(
            f"distributed launch environment is incomplete: {', '.join(present)} set but "
            f"{', '.join(missing)} missing (torchrun / srun set all of {', '.join(_LAUNCH_ENV)})"
        )
    return bool(present)


def _init_process_group(backend: str, timeout: timedelta) -> tuple[Optional[str], bool]:
    """Start torch.distributed unless the caller already did. Returns (store dir, owned)."""
    if dist.is_initialized():
        return None, False
    if _launched_by_env():
        dist.init_process_group(backend=backend, init_method="env://", timeout=timeout)
        return None, True
    # One-process world: a FileStore in a fresh temp dir needs no free port.
    store_dir = tempfile.mkdtemp(prefix="pfppo_dist_")
    dist.init_process_group(
        backend=backend, init_method=f"file://{store_dir}/store", rank=0, world_size=1, timeout=timeout
    )
    return store_dir, True


def _device(backend: str) -> torch.device:
    """The models' device: this rank's GPU (LOCAL_RANK) whenever CUDA devices are visible, with
    gloo too (gloo's collectives run on host copies: parallel.comm_device), else the CPU."""
    if backend == "nccl" or torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _watchdog_store(timeout_s: float):
    """A store client of its own on the launcher's rendezvous store (MASTER_ADDR:MASTER_PORT): the
    watchdog's short read timeout stays off the process group's store."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def init_parallel(*, tp: int, pp: int, backend: str = "auto", seed: int,
                  timeout_s: float = COLLECTIVE_TIMEOUT_S, watchdog_s: float = 0.0) -> ParallelInfo:
    """Initialise torch.distributed, megatron's model-parallel groups and RNG, and CPU compat.

    Reads RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (LOCAL_RANK for the GPU) when a launcher
    set them, else starts a one-process gloo world. Calling it again with the same tp and pp
    returns the current layout; with another layout it raises (call destroy_parallel first).
    ``timeout_s`` (parallel.collective_timeout_s) bounds every collective of the world group and
    megatron's groups: a stalled rank makes the others raise instead of waiting forever.
    ``watchdog_s`` (parallel.watchdog_s; 0: off): a launched multi-rank world also runs the heartbeat
    watchdog (pfppo_mega.watchdog), which names a rank silent that long and ends this one.
    """
    global _state
    from megatron.core import parallel_state

    if _state is not None and not dist.is_initialized():
        # the process group went away under us (an in-process vLLM engine destroys the groups it
        # reused when it is freed): megatron's groups are stale, build everything again
        parallel_state.destroy_model_parallel()
        _state = None
    if _state is not None:
        if (_state.info.tp, _state.info.pp) != (tp, pp):
            raise RuntimeError(
                f"parallel state is already initialised with tp({_state.info.tp}) pp({_state.info.pp}); "
                f"call destroy_parallel() before init_parallel(tp={tp}, pp={pp})"
            )
        megatron_cpu.enable()  # this thread may have popped the CPU mode since (idempotent)
        return _state.info

    backend = resolve_backend(backend)
    # Validate the layout before any process group exists, from the launcher's WORLD_SIZE if set.
    if "WORLD_SIZE" in os.environ:
        data_parallel_size(int(os.environ["WORLD_SIZE"]), tp, pp)
    megatron_cpu.enable()  # no-op on a CUDA machine
    device = _device(backend)  # before the process group: NCCL binds to the current device
    store_dir, owned = _init_process_group(backend, timedelta(seconds=timeout_s))
    world_size, rank = dist.get_world_size(), dist.get_rank()
    dp = data_parallel_size(world_size, tp, pp)

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        distributed_timeout_minutes=timeout_s / 60,  # megatron builds timedelta(minutes=...) of it
    )
    megatron_cpu.model_parallel_manual_seed(seed)
    if watchdog_s and world_size > 1 and _launched_by_env():
        watchdog.start(_watchdog_store, rank=rank, world_size=world_size, stall_s=watchdog_s)

    info = ParallelInfo(world_size=world_size, rank=rank, tp=tp, pp=pp, dp=dp, device=device,
                        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
                        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
                        dp_rank=parallel_state.get_data_parallel_rank())
    _state = _State(info=info, store_dir=store_dir, owns_process_group=owned)
    return info


def current() -> Optional[ParallelInfo]:
    """The layout set by init_parallel, or None."""
    return _state.info if _state is not None else None


def destroy_parallel() -> None:
    """Tear down megatron's groups and, if init_parallel created it, the process group."""
    global _state
    from megatron.core import parallel_state

    if _state is None:
        return
    watchdog.stop()
    parallel_state.destroy_model_parallel()
    if _state.owns_process_group and dist.is_initialized():
        dist.destroy_process_group()
    if _state.store_dir is not None:
        shutil.rmtree(_state.store_dir, ignore_errors=True)
    _state = None


# ----------------------------------------------------------------------------- collectives
# The trainer's reductions, written once. Each takes the process group it reduces over (None, or a
# group of one rank, returns the input unchanged: the single-process computation) and runs the
# collective on the group's device (comm_device: cuda for nccl, cpu for gloo); the result comes
# back on the input's device and dtype. The device rule (docs/scaling.md): inputs that meet a
# model are on the model's device, collectives run on the group's device -- on a GPU both are the
# current CUDA device, so the copies below are no-ops there. Every other collective in the code
# base builds its tensors on comm_device(group) itself; PFPPO_DEVICE_CHECK=1 checks them all
# (pfppo_mega.trainer.instruments.devicecheck).


def data_parallel_group() -> Optional[dist.ProcessGroup]:
    """megatron's data-parallel group (context parallelism excluded), or None when dp == 1 or the
    parallel state is not initialised. Entry points look it up here and pass it down."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized() or ps.get_data_parallel_world_size() == 1:
        return None
    return ps.get_data_parallel_group(with_context_parallel=False)


def model_parallel_group() -> Optional[dist.ProcessGroup]:
    """megatron's model-parallel group: the ranks of this rank's model replica (its TP ranks and
    pipeline stages, same dp_rank; the lowest global rank is tp_rank = pp_rank = 0), or None when
    tp * pp == 1 or the parallel state is not initialised."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized() or \
            ps.get_tensor_model_parallel_world_size() * ps.get_pipeline_model_parallel_world_size() == 1:
        return None
    return ps.get_model_parallel_group()


def world_group() -> Optional[dist.ProcessGroup]:
    """The default (world) group, or None in a one-process world or before init."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return dist.group.WORLD


def comm_device(group: Optional[dist.ProcessGroup]) -> torch.device:
    """Where a tensor for a collective on ``group`` must live (nccl: the current CUDA device).
    None is torch.distributed's default group (the world) when it is initialised, else CPU."""
    if group is None:
        if not dist.is_initialized():
            return torch.device("cpu")
        group = dist.group.WORLD
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _active(group: Optional[dist.ProcessGroup]) -> bool:
    return group is not None and dist.get_world_size(group) > 1


def _all_reduce(t: torch.Tensor, op, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    if not _active(group):
        return t
    buf = t.detach().to(comm_device(group), copy=True)
    dist.all_reduce(buf, op=op, group=group)
    return buf.to(device=t.device, dtype=t.dtype)


def dp_sum(t: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Element-wise sum of ``t`` over the ranks of ``group`` (every rank gets it). Not autograd."""
    return _all_reduce(t, dist.ReduceOp.SUM, group)


def dp_max(t: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Element-wise max of ``t`` over ``group``."""
    return _all_reduce(t, dist.ReduceOp.MAX, group)


def dp_min(t: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Element-wise min of ``t`` over ``group``."""
    return _all_reduce(t, dist.ReduceOp.MIN, group)


def dp_mean(t: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Element-wise unweighted mean of ``t`` over ``group`` (use dp_sum of weighted values and
    weights where the ranks' shares differ)."""
    if not _active(group):
        return t
    return dp_sum(t, group) / dist.get_world_size(group)


def dp_all_gather(t: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Every rank's ``t`` ([n, ...], the same shape on every rank) concatenated along dim 0 in rank
    order, on every rank. Not autograd."""
    if not _active(group):
        return t
    size = dist.get_world_size(group)
    shapes = [None] * size
    dist.all_gather_object(shapes, tuple(t.shape), group=group)
    if any(s != tuple(t.shape) for s in shapes):
        raise ValueError(f"dp_all_gather: the ranks' shapes {shapes} must be equal")
    buf = t.detach().to(comm_device(group)).contiguous()
    out = [torch.empty_like(buf) for _ in range(size)]
    dist.all_gather(out, buf, group=group)
    return torch.cat(out).to(device=t.device, dtype=t.dtype)


def world_min(value: int, group: Optional[dist.ProcessGroup] = None) -> int:
    """min of an int over ``group`` (default: the world). Used for agreements such as "the newest
    checkpoint every rank has" and "stop now"."""
    if group is None:
        group = world_group()
    if not _active(group):
        return value
    t = torch.tensor([value], dtype=torch.long, device=comm_device(group))  # made where the collective runs
    return int(dp_min(t, group).item())


def dp_gather_objects(obj, group: Optional[dist.ProcessGroup]) -> list:
    """[obj of rank 0, obj of rank 1, ...] of ``group`` on every rank (picklable objects; a host
    round trip, for small records such as per-rank metric dicts whose keys may differ)."""
    if not _active(group):
        return [obj]
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, obj, group=group)
    return everyone
