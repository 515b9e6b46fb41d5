"""Colocation: the trainer's states leave the device while the rollout engine generates.

While the engine generates, the actor's and critic's parameters, gradient buffers and optimizer
states (fp32 main weights, Adam moments) and the reference policy's parameters are not needed on
the device; the engine's KV cache is. ``TrainerOffload.offloaded()`` copies every such storage to
a host buffer (page-locked on a GPU machine by pfppo_mega.pinned, exactly its size, so the copies
are DMA) and frees the device storage with ``storage.resize_(0)`` -- the same mechanism megatron's
``_ParamAndGradBuffer.offload_to_cpu`` uses. Every tensor viewing a storage (a parameter,
``param.main_grad`` into DDP's grad buffer, a distributed-optimizer shard) stays the same Python
object; on reload the storage is re-allocated at its old size and the bytes copied back, so the
values come back bit-identical and no reference held by megatron, the optimizer or the trainer
goes stale. An offloaded tensor must not be touched (its storage is empty: a CPU op on it crashes
the process); ``on_device()`` brings the states back for the one thing the rollout phase may need
them for, a live refit.

Gradient storages (a source's ``main_grad`` -- DDP's grad buffer -- and ``.grad``) are freed
without a host copy and come back zeroed: the update starts with ``zero_grads`` before its first
backward (models.passes.train_step), so nothing reads last step's gradients across a rollout
phase. That saves the host half the bytes of the fp32 grad buffers and their two copies.

On a CPU the host and the device are the same memory: the code path is identical (a separate
host buffer, the original storage freed) and tested, it just saves nothing; the config default
(``training.offload_during_rollout: null``) therefore turns it on only for CUDA devices.

``device_bytes()`` counts the bytes of those storages that are allocated on the device: what
the planner's rollout-phase figure (pfppo_mega.planning.memory, "trainer states") predicts.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

import torch

from pfppo_mega.pinned import pinned_empty


def offload_enabled(setting: Optional[bool], device: torch.device) -> bool:
    """training.offload_during_rollout: null -> on for CUDA devices (the planner's assumption for
    GPUs), off on CPU (host == device: only copies); true / false as given."""
    return device.type == "cuda" if setting is None else bool(setting)


def optimizer_tensors(optimizer) -> Iterator[torch.Tensor]:
    """The tensors a megatron optimizer (chained or not) keeps: its parameters (the fp32 main
    copies under mixed precision, the model's own parameters in fp32), their .grad, and the
    per-parameter state (exp_avg, exp_avg_sq, step)."""
    for opt in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                yield p
                if p.grad is not None:
                    yield p.grad
        for state in inner.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def module_tensors(module: torch.nn.Module) -> Iterator[torch.Tensor]:
    """Parameters and their gradients (megatron DDP's ``main_grad`` views into its grad buffer)."""
    for p in module.parameters():
        yield p
        for g in (getattr(p, "main_grad", None), p.grad):
            if isinstance(g, torch.Tensor):
                yield g


@dataclass
class _Held:
    storage: torch.UntypedStorage  # the device storage; size 0 while offloaded
    nbytes: int
    host: Optional[torch.Tensor]   # [nbytes] uint8 on the host (pinned on GPU machines); None: a gradient
    late: bool = False             # one of the late storages (the actor's weights)


def _whole(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def unique_storages(tensors: Iterable[torch.Tensor], device: torch.device) -> list[torch.UntypedStorage]:
    """The distinct allocated storages behind ``tensors`` that live on ``device``."""
    seen: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        st = t.untyped_storage()
        if st.device.type != device.type or (device.index is not None and st.device.index != device.index):
            continue
        if st.nbytes() > 0:
            seen.setdefault(st.data_ptr(), st)
    return list(seen.values())


def gradient_storages(tensors: Iterable[torch.Tensor]) -> set[int]:
    """data_ptrs of the storages that hold gradients only: those of the ``main_grad`` and ``.grad``
    of ``tensors``, less any that a non-gradient tensor among them also views."""
    tensors = list(tensors)
    grads = [g for t in tensors for g in (getattr(t, "main_grad", None), t.grad)
             if isinstance(g, torch.Tensor) and g.untyped_storage().nbytes() > 0]
    grad_ids = {id(g) for g in grads}
    others = {t.untyped_storage().data_ptr() for t in tensors if id(t) not in grad_ids}
    return {g.untyped_storage().data_ptr() for g in grads} - others


class TrainerOffload:
    """Moves the named modules' and optimizers' storages to the host and back.

    ``sources`` is called at each offload (optimizer states appear after the first step), and
    returns the tensors to move; storages are deduplicated (a distributed-optimizer parameter and
    its bucket share one). ``pin``: page-lock the host buffers (None: when the device is CUDA)."""

    def __init__(self, sources, *, device: torch.device, enabled: bool, late=None, pin: Optional[bool] = None,
                 log=print):
        self._sources = sources
        self._late = late or (lambda: ())  # what offload(stage="early") leaves: the weights a refit reads
        self.device = torch.device(device)
        self.enabled = enabled
        self.pin = self.device.type == "cuda" if pin is None else pin
        self._held: list[_Held] = []
        self._host: list[torch.Tensor] = []  # host buffers, reused by size (pinning is slow)
        self.last_offload_s = 0.0
        self.last_reload_s = 0.0
        self.temporary_reloads = 0  # on_device() round trips (a live refit inside the rollout phase)
        self.log = log

    @property
    def is_offloaded(self) -> bool:
        return bool(self._held)

    def device_bytes(self) -> int:
        """Bytes of the trainer's parameter / gradient / optimizer storages allocated on the device now."""
        return sum(st.nbytes() for st in unique_storages(self._sources(), self.device))

    def host_bytes(self) -> int:
        """Bytes of the host buffers this offload holds (kept after a reload, for the next one)."""
        return sum(int(t.numel()) for t in self._host)

    def _free_buffers(self) -> dict[int, list[torch.Tensor]]:
        """Host buffers no held storage uses, by size."""
        busy = {id(h.host) for h in self._held if h.host is not None}
        free: dict[int, list[torch.Tensor]] = {}
        for buf in self._host:
            if id(buf) not in busy:
                free.setdefault(buf.numel(), []).append(buf)
        return free

    def _host_buffer(self, n: int, free: dict[int, list[torch.Tensor]]) -> torch.Tensor:
        """A free [n] uint8 host buffer, or a new one (page-locked, exactly n bytes, when pinning)."""
        if free.get(n):
            return free[n].pop()
        buf = pinned_empty(n) if self.pin else torch.empty(n, dtype=torch.uint8)
        self._host.append(buf)
        return buf

    def offload(self, stage: str = "all") -> int:
        """Free storages on the device, copying each to the host unless it holds gradients (those
        come back zeroed); returns the bytes freed on the device. stage "early": all but the late
        ones (the actor's weights, which a refit still reads); "late": those; "all": both."""
        if self._held and stage != "late":
            raise RuntimeError("TrainerOffload.offload(): already offloaded (reload() first)")
        import time

        t0 = time.perf_counter()
        freed = 0
        tensors = list(self._sources())
        late = {st.data_ptr() for st in unique_storages(self._late(), self.device)}
        grads = gradient_storages(tensors)
        todo = [st for st in unique_storages(tensors, self.device)
                if stage == "all" or (st.data_ptr() in late) == (stage == "late")]
        first = len(self._held)
        free = self._free_buffers()
        for st in todo:
            if not st.resizable():
                raise RuntimeError(f"trainer storage of {st.nbytes()} bytes on {st.device} cannot be freed "
                                   f"(not resizable); set training.offload_during_rollout=false")
            n = st.nbytes()
            host = None
            if st.data_ptr() not in grads:
                host = self._host_buffer(n, free)
                host.copy_(_whole(st), non_blocking=self.pin)
            self._held.append(_Held(st, n, host, late=st.data_ptr() in late))
            freed += n
        if self.pin:
            torch.cuda.synchronize(self.device)  # the copies must land before the storages go
        for h in self._held[first:]:
            h.storage.resize_(0)
        if stage != "early":  # everything that will be held is held: drop buffers no storage uses
            unused = {id(b) for bufs in free.values() for b in bufs}
            self._host = [b for b in self._host if id(b) not in unused]
        if self.pin:
            torch.cuda.empty_cache()
        self.last_offload_s = (self.last_offload_s if stage == "late" else 0.0) + time.perf_counter() - t0
        return freed

    def reload(self, stage: str = "all") -> None:
        """Re-allocate the offloaded storages (all, or the late ones) at their size and copy their
        bytes back; a gradient storage is zeroed instead."""
        import time

        t0 = time.perf_counter()
        back = [h for h in self._held if stage == "all" or h.late]
        for h in back:
            h.storage.resize_(h.nbytes)
            if h.host is None:
                _whole(h.storage).zero_()
            else:
                _whole(h.storage).copy_(h.host, non_blocking=self.pin)
        if self.pin:
            torch.cuda.synchronize(self.device)
        self._held = [h for h in self._held if not (stage == "all" or h.late)]
        self.last_reload_s = time.perf_counter() - t0

    @contextlib.contextmanager
    def offloaded(self) -> Iterator[None]:
        """The trainer's states off the device inside (a no-op when disabled); back on exit, also
        when the body raises."""
        if not self.enabled:
            yield
            return
        self.offload()
        try:
            yield
        finally:
            self.reload()

    @contextlib.contextmanager
    def on_device(self) -> Iterator[None]:
        """The late storages (the actor's weights a refit reads) temporarily back on the device
        inside an offloaded phase (e.g. a live refit when a snapshot was refused); offloaded again on
        exit. Everything else stays on the host."""
        if not any(h.late for h in self._held):
            yield
            return
        self.temporary_reloads += 1
        self.reload("late")
        try:
            yield
        finally:
            self.offload("late")
