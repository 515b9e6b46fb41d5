"""Device-check mode: catch on a CPU-only machine the device mistakes a GPU run would hit.

The rule (docs/scaling.md, "Where tensors live"):
- everything that meets a model (packed inputs, engine results, loss inputs, rewards, advantages,
  IS weights) lives on the model's device (``ParallelInfo.device``: cuda:LOCAL_RANK with NCCL);
- every collective gets its tensors on the group's device (``parallel.comm_device``); the
  reductions in ``pfppo_mega.parallel`` move them there and back themselves;
- host memory holds only what never meets a model: engine prompts, texts, pool snapshots
  (pinned), offloaded trainer states, checkpoint bytes.

On a CPU the model's device and the host are the same device, so a plain ``t.device ==
model_device`` test can never fail. The check mode therefore tells them apart by provenance:
while it is on, a torch function mode tags every tensor made without an explicit ``device=``
(``torch.tensor(list)``, ``torch.zeros(n)``, ``.cpu()``, ...) as a *host* tensor -- on a GPU
machine that is exactly a CPU tensor -- and the tag follows the tensor through every op. An
explicit move (``.to(device)``, ``.cuda()``, a factory with ``device=``) clears it. Then:

- an op whose inputs mix a host tensor and a device tensor (both with dims: torch lets a 0-dim
  CPU tensor meet CUDA tensors) raises ``DeviceViolation`` naming the op: on a GPU it would
  raise "Expected all tensors to be on the same device";
- ``expect(where, device, **tensors)`` (called by the trainer at every loss call, engine result
  and phase boundary) raises when a tensor is host-tagged or not on ``device``;
- every torch.distributed collective (patched for the session) raises when a tensor argument is
  host-tagged (NCCL takes only CUDA tensors) or not on the group's device.

Turn it on for a run with ``PFPPO_DEVICE_CHECK=1`` (the trainer runs every step inside
``session``) or in code with ``with devicecheck.session(device): ...``. ``session(expect=...)``
replaces the expected device of every check (tests use ``meta`` to show that each check fires).
The mode costs a Python call per torch op: a debugging and test tool, off by default.
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

ENV = "PFPPO_DEVICE_CHECK"
_TAG = "_pfppo_host"


class DeviceViolation(AssertionError):
    """A tensor is where the device rule says it must not be (the message names it and why)."""


def requested() -> bool:
    """True when the environment asks for the check mode (PFPPO_DEVICE_CHECK=1)."""
    value = os.environ.get(ENV, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV}={value!r} must be 0 or 1")
    return value == "1"


def is_host(t: torch.Tensor) -> bool:
    """Whether ``t`` was made on the host (no explicit device) while the mode was on."""
    return bool(getattr(t, _TAG, False))


def mark_host(*tensors: Optional[torch.Tensor]) -> None:
    """Declare tensors host-side (e.g. an engine's outputs: the engine's device is not the model's)."""
    for t in tensors:
        if isinstance(t, torch.Tensor):
            setattr(t, _TAG, True)


@dataclass
class Session:
    """One active check: the model's device, an optional override, and what was checked."""

    device: torch.device
    expect_override: Optional[torch.device] = None
    checks: int = 0          # expect() calls
    collectives: int = 0     # collectives checked
    where: list[str] = field(default_factory=list)  # distinct expect() sites seen

    def expected(self, device: torch.device) -> torch.device:
        return self.expect_override if self.expect_override is not None else device


_active: Optional[Session] = None
_paused = False
TOTALS = {"sessions": 0, "checks": 0, "collectives": 0}  # over every session of this process


def active() -> Optional[Session]:
    return _active


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dist.P2POp):
        yield obj.tensor
    elif hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            yield from _tensors(getattr(obj, name))


def _same(device: torch.device, expected: torch.device) -> bool:
    if device.type != expected.type:
        return False
    return expected.index is None or device.index is None or device.index == expected.index


def expect(where: str, device: torch.device, **tensors: Any) -> None:
    """Every tensor in ``tensors`` (tensors, lists, dataclasses of tensors) must be on ``device``
    and not host-made. A no-op outside a session."""
    s = _active
    if s is None:
        return
    s.checks += 1
    if where not in s.where:
        s.where.append(where)
    want = s.expected(device)
    for name, value in tensors.items():
        for t in _tensors(value):
            if is_host(t):
                raise DeviceViolation(
                    f"{where}: {name} {tuple(t.shape)} {t.dtype} was made on the host (no explicit device); "
                    f"the rule puts everything that meets the model on the model's device {want}")
            if not _same(t.device, want):
                raise DeviceViolation(f"{where}: {name} {tuple(t.shape)} {t.dtype} is on {t.device}, "
                                      f"expected the model's device {want}")


# ----------------------------------------------------------------------------- host tagging

_FACTORIES = frozenset({
    torch.tensor, torch.zeros, torch.ones, torch.full, torch.empty, torch.arange, torch.randperm,
    torch.rand, torch.randn, torch.randint, torch.linspace, torch.eye, torch.empty_strided,
    torch.from_numpy, torch.frombuffer,
})
_MOVES = frozenset({torch.Tensor.to, torch.Tensor.cuda})
_NO_MIX_CHECK = frozenset({torch.Tensor.__setitem__, torch.Tensor.copy_})  # cross-device copies are legal
_INDEXING = frozenset({torch.Tensor.__getitem__})  # a CPU index tensor may index a CUDA tensor
# Only element-wise ops accept a 0-dim CPU tensor beside CUDA tensors; these do not.
_NO_SCALAR_EXEMPTION = frozenset({torch.stack, torch.cat, torch.concat, torch.concatenate, torch.where})


def _explicit_device(func, args, kwargs) -> Optional[bool]:
    """For .to()/.cuda(): True when a device is named, None when the target is another tensor."""
    if func is torch.Tensor.cuda:
        return True
    if "device" in kwargs and kwargs["device"] is not None:
        return True
    for a in args[1:]:
        if isinstance(a, (torch.device, str, int)) and not isinstance(a, bool):
            return True
        if isinstance(a, torch.Tensor):
            return None
    return False


def _tag_all(out: Any, value: bool) -> Any:
    for t in _tensors(out):
        setattr(t, _TAG, value)
    return out


def _site() -> str:
    """file:line of the project (else any non-torch) code that made the call being checked."""
    f, fallback = sys._getframe(1), None
    while f is not None:
        name = f.f_code.co_filename
        if not name.endswith(("devicecheck.py", "contextlib.py")) and "/torch/" not in name:
            where = f"{name.split('/site-packages/')[-1].split('/work/main/')[-1]}:{f.f_lineno}"
            if "pfppo_mega" in name:
                return where
            fallback = fallback or where
        f = f.f_back
    return fallback or "?"


def _tensor_type(t: torch.Tensor) -> str:
    """Tensor.type() as megatron's CPU compatibility mode answers it (it looks at its caller's frame,
    which would be this mode's): 'torch.cuda.X' to megatron code on a CPU build."""
    from pfppo_mega.compat import megatron_cpu

    name = torch.Tensor.type(t)  # the modes below this one answer (their caller is this frame)
    if megatron_cpu.mode_active() and name.startswith("torch.") and not name.startswith("torch.cuda."):
        caller = sys._getframe(2)  # 0: here, 1: __torch_function__, 2: the caller of Tensor.type()
        if caller.f_globals.get("__name__", "").startswith("megatron."):
            return "torch.cuda." + name[len("torch."):]
    return name


class _HostTags(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return _tensor_type(args[0])
        out = func(*args, **kwargs)
        if _paused:
            return out
        if func in _FACTORIES or (func is torch.as_tensor and not isinstance(args[0], torch.Tensor)):
            if kwargs.get("device") is None and not (func is torch.tensor and isinstance(args[0], torch.Tensor)):
                _tag_all(out, True)
            return out
        if func is torch.Tensor.cpu:
            return _tag_all(out, True)
        if func in _MOVES:
            explicit = _explicit_device(func, args, kwargs)
            if explicit is None:  # .to(other): other's side
                other = next(a for a in args[1:] if isinstance(a, torch.Tensor))
                if out is args[0] and is_host(out) != is_host(other):
                    out = out.view_as(out)
                return _tag_all(out, is_host(other))
            if explicit:
                if out is args[0] and is_host(out):
                    out = out.view_as(out)  # same storage, now declared on the model's device
                return _tag_all(out, False)
            # dtype-only .to(): keeps its side (falls through)
        inputs = [t for t in _tensors(args[:1] if func in _INDEXING else list(args) + list(kwargs.values()))]
        if not inputs:
            return out
        shaped = inputs if func in _NO_SCALAR_EXEMPTION else [t for t in inputs if t.dim() > 0]
        judged = shaped or inputs
        host = [t for t in judged if is_host(t)]
        if host and len(host) < len(judged) and func not in _NO_MIX_CHECK and shaped:
            name = getattr(func, "__qualname__", getattr(func, "__name__", str(func)))
            dev = next(t for t in judged if not is_host(t))
            raise DeviceViolation(
                f"{name} at {_site()}: mixes a host tensor {tuple(host[0].shape)} {host[0].dtype} (made without an explicit "
                f"device) with a device tensor {tuple(dev.shape)} {dev.dtype}; on a GPU this op raises. Put the "
                f"host tensor on the model's device where it is made (see pfppo_mega.trainer.instruments.devicecheck)")
        if host and func not in _NO_MIX_CHECK and isinstance(out, (torch.Tensor, list, tuple)):
            _tag_all(out, True)
        return out


# ----------------------------------------------------------------------------- collectives

# isend / irecv stay unwrapped: P2POp(op, ...) accepts only the original functions; their tensors are
# checked where megatron's pipeline sends them, in batch_isend_irecv (or send / recv).
_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
                "reduce_scatter", "reduce", "gather", "scatter", "send", "recv",
                "all_to_all_single", "all_to_all", "batch_isend_irecv")


def _group_of(args, kwargs) -> Optional[dist.ProcessGroup]:
    g = kwargs.get("group")
    if g is None:
        g = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
    return g


def _checked(name: str, fn):
    def wrapper(*args, **kwargs):
        s = _active
        if s is not None:  # checked even while paused: the engine seam's collectives too
            s.collectives += 1
            from pfppo_mega.parallel import comm_device

            group = _group_of(args, kwargs)
            if name == "batch_isend_irecv":
                group = getattr(args[0][0], "group", None) if args and args[0] else None
            want = s.expected(comm_device(group if group is not None else dist.group.WORLD))
            for t in _tensors(list(args) + [v for k, v in kwargs.items() if k != "group"]):
                if is_host(t):
                    raise DeviceViolation(
                        f"torch.distributed.{name} at {_site()}: a tensor {tuple(t.shape)} {t.dtype} made on the host goes to "
                        f"a collective; the rule puts collective tensors on the group's device {want} "
                        f"(pfppo_mega.parallel.comm_device)")
                if not _same(t.device, want):
                    raise DeviceViolation(f"torch.distributed.{name} at {_site()}: a tensor {tuple(t.shape)} {t.dtype} is on "
                                          f"{t.device}, the group's device is {want}")
        return fn(*args, **kwargs)

    wrapper.__wrapped__ = fn
    return wrapper


@contextlib.contextmanager
def session(device: torch.device, *, expect: Optional[torch.device] = None) -> Iterator[Session]:
    """Check everything inside: host tags, expect() sites, every torch.distributed collective.

    ``device`` is the model's device; ``expect`` overrides the expected device of every check
    (tests: show that a check fires). Sessions do not nest (the inner one is the outer one)."""
    global _active
    if _active is not None:
        yield _active
        return
    s = Session(torch.device(device), None if expect is None else torch.device(expect))
    saved = {n: getattr(dist, n) for n in _COLLECTIVES if hasattr(dist, n)}
    _active = s
    try:
        for n, fn in saved.items():
            setattr(dist, n, _checked(n, fn))
        with _HostTags():
            yield s
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)
        _active = None
        TOTALS["sessions"] += 1
        TOTALS["checks"] += s.checks
        TOTALS["collectives"] += s.collectives


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Stop host tagging inside (a rollout engine's generate() and weight updates, a reward function:
    they live in their own device world; the trainer declares their outputs host and moves them).
    Collectives are still checked against their group's device."""
    global _paused
    before, _paused = _paused, True
    try:
        yield
    finally:
        _paused = before
