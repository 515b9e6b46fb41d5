"""Run megatron-core 0.16.1 on a CPU-only build of torch. The one compatibility module.

megatron-core assumes CUDA: it passes ``torch.cuda.current_device()`` (an int) or ``"cuda"`` as
the device of new tensors, moves tensors with ``.cuda()``, keeps its tensor-parallel RNG
streams with ``torch.cuda`` RNG calls, calls ``torch.cuda.synchronize()`` and asserts parameter
types such as ``'torch.cuda.FloatTensor'``. On a torch build without CUDA every one of those
raises "Torch not compiled with CUDA enabled". This module makes them run on the CPU:

1. ``_CudaToCpu``, a ``TorchFunctionMode``: every torch function / Tensor method that receives a
   CUDA device (``"cuda"``, ``"cuda:0"``, ``torch.device("cuda")`` or an int index) gets ``cpu``
   instead; ``Tensor.cuda()`` returns the tensor itself; ``Tensor.type()`` called from megatron
   code reports a CPU float tensor as ``'torch.cuda.FloatTensor'`` (and so on), so megatron's
   type asserts (grad clipping, FP32/mixed-precision optimizer, distributed optimizer) pass.
   Torch function modes live on a THREAD-LOCAL stack: ``enable()`` must be called in every
   process and in every thread that runs megatron code (it is cheap and idempotent per thread).
   Autograd's backward pass inherits the mode of the thread that calls ``backward()``.
2. Process-wide replacements, applied once per process (see ``PATCHES``):
   ``torch.cuda.current_device`` returns 0 (the mode maps index 0 to cpu),
   ``torch.cuda.synchronize`` does nothing (CPU ops are synchronous), and megatron's CUDA RNG
   helpers (``_get_cuda_rng_state``, ``_set_cuda_rng_state``, ``CudaRNGStatesTracker.add``) act on
   the CPU default generator. On the CPU, the "CUDA" RNG stream of megatron IS the CPU default
   generator: ``tracker.fork()`` swaps the generator's state in and out exactly as it swaps the
   CUDA generator's state on a GPU, so dropout/init inside ``fork()`` draw from the tracked
   stream and code outside it from the default one.
3. A logging filter drops megatron's "CPU RNG state changed within GPU RNG context" warning,
   which always fires on CPU because the two streams are one generator here.

On a machine where ``torch.cuda.is_available()`` is true ``enable()`` changes nothing.

Caveats: ``torch.compile`` inside the mode traces through it (it is an ordinary torch function
mode); ``sequence_parallel=True`` is unsupported on CPU (megatron's torch norm refuses it); only
the code paths exercised by the tests (GPTModel forward/backward, megatron DDP,
``get_megatron_optimizer`` with and without the distributed optimizer, grad clipping) are
known to work.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

from pfppo_mega.compat import onednn

PINNED_MEGATRON_CORE = "0.16.1"

_RANDOM_MODULE = "megatron.core.tensor_parallel.random"
_SPURIOUS_RNG_WARNING = "CPU RNG state changed within GPU RNG context"


class MegatronVersionError(RuntimeError):
    """The installed megatron-core is not the version this layer was written and tested for."""


def check_megatron_version() -> str:
    """Return megatron.core.__version__; raise MegatronVersionError unless it is the pin."""
    import megatron.core

    found = getattr(megatron.core, "__version__", None)
    if found != PINNED_MEGATRON_CORE:
        raise MegatronVersionError(
            f"megatron-core {found} is installed but pfppo_mega.compat.megatron_cpu is pinned to "
            f"{PINNED_MEGATRON_CORE} (requirements.lock); its CPU patches touch megatron internals "
            f"that change between releases. Install megatron-core=={PINNED_MEGATRON_CORE}, or "
            f"re-verify every entry of PATCHES against {found} and move the pin."
        )
    return found


# ----------------------------------------------------------------------------- device mapping


def _is_cuda_device(device: Any) -> bool:
    """True for "cuda", "cuda:N", torch.device("cuda", N) and a bare int index.

    On a build without CUDA an int device can only mean a CUDA index (megatron passes
    ``torch.cuda.current_device()``), so ints map to the CPU as well.
    """
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


_CPU = torch.device("cpu")


def _called_from_megatron() -> bool:
    # Frame 0: this function, 1: __torch_function__, 2: the Python caller of Tensor.type().
    caller = sys._getframe(2)
    return caller.f_globals.get("__name__", "").startswith("megatron.")


class _CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA devices to cpu in every torch call made while the mode is on the stack."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.matmul or func is torch.Tensor.matmul:  # megatron's linears, inside onednn.packed_weights()
            out = onednn.routed_matmul(args, kwargs)
            if out is not None:
                return out
        kwargs = dict(kwargs) if kwargs else {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            if name.startswith("torch.") and not name.startswith("torch.cuda.") and _called_from_megatron():
                return "torch.cuda." + name[len("torch."):]
            return name
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = _CPU
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU) + tuple(args[2:])
        return func(*args, **kwargs)


_thread_state = threading.local()


def mode_active() -> bool:
    """True when enable() has pushed the CPU mode in the calling thread."""
    return getattr(_thread_state, "mode", None) is not None


# ----------------------------------------------------------------------------- process-wide patches


@dataclass(frozen=True)
class Patch:
    """One attribute replaced in the process: ``owner`` is a module (or ``module:Class``)."""

    owner: str
    name: str
    why: str

    def resolve_owner(self) -> Any:
        module_name, _, class_name = self.owner.partition(":")
        obj = importlib.import_module(module_name)
        return getattr(obj, class_name) if class_name else obj


def _cpu_current_device() -> int:
    return 0


def _cpu_synchronize(device: Any = None) -> None:
    return None


def _cpu_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    if graph_safe:
        raise NotImplementedError("graph-safe (CUDA graph) RNG states do not exist on the CPU")
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    if graph_safe:
        raise NotImplementedError("graph-safe (CUDA graph) RNG states do not exist on the CPU")
    torch.set_rng_state(new_state)


def _cpu_tracker_add(self, name: str, seed: int) -> None:
    """CudaRNGStatesTracker.add on the CPU: a named state seeded with ``seed``, no side effect."""
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception(f"cuda rng state {name} already exists")
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    self.states_[name] = generator.get_state()


_REPLACEMENTS: dict[tuple[str, str], Callable] = {
    ("torch.cuda", "current_device"): _cpu_current_device,
    ("torch.cuda", "synchronize"): _cpu_synchronize,
    (_RANDOM_MODULE, "_get_cuda_rng_state"): _cpu_get_rng_state,
    (_RANDOM_MODULE, "_set_cuda_rng_state"): _cpu_set_rng_state,
    (_RANDOM_MODULE + ":CudaRNGStatesTracker", "add"): _cpu_tracker_add,
}

PATCHES: tuple[Patch, ...] = (
    Patch("torch.cuda", "current_device",
          "~175 megatron call sites pass torch.cuda.current_device() as a device; returns 0, "
          "which the mode maps to cpu"),
    Patch("torch.cuda", "synchronize",
          "pipeline p2p, DDP and dist_checkpointing call it; CPU ops are synchronous"),
    Patch(_RANDOM_MODULE, "_get_cuda_rng_state",
          "the RNG tracker reads the CUDA generator; reads the CPU default generator instead"),
    Patch(_RANDOM_MODULE, "_set_cuda_rng_state",
          "the RNG tracker writes the CUDA generator; writes the CPU default generator instead"),
    Patch(_RANDOM_MODULE + ":CudaRNGStatesTracker", "add",
          "calls torch.cuda.get_rng_state/manual_seed; seeds a fresh CPU generator state"),
)

# The originals, kept so tests can check them and so the patches are applied only once.
ORIGINALS: dict[tuple[str, str], Any] = {}
_process_lock = threading.Lock()
_process_patched = False


class _DropSpuriousRngWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _SPURIOUS_RNG_WARNING not in record.getMessage()


def _patch_process() -> None:
    global _process_patched
    with _process_lock:
        if _process_patched:
            return
        check_megatron_version()
        for patch in PATCHES:
            owner = patch.resolve_owner()
            if not hasattr(owner, patch.name):
                raise MegatronVersionError(
                    f"{patch.owner}.{patch.name} no longer exists; pfppo_mega.compat.megatron_cpu "
                    f"must be revised ({patch.why})"
                )
            ORIGINALS[(patch.owner, patch.name)] = getattr(owner, patch.name)
            setattr(owner, patch.name, _REPLACEMENTS[(patch.owner, patch.name)])
        logging.getLogger(_RANDOM_MODULE).addFilter(_DropSpuriousRngWarning())
        _process_patched = True


# ----------------------------------------------------------------------------- public API


def needed() -> bool:
    """True when megatron must run on the CPU (no usable CUDA device in this process)."""
    return not torch.cuda.is_available()


def enable() -> bool:
    """Make megatron-core runnable on the CPU in this process and this thread.

    Idempotent. Call it in every process and every thread before building or running megatron
    models (the device-mapping mode is thread-local). On a CUDA machine it does nothing and
    returns False; otherwise it returns True once the layer is active in the calling thread.
    """
    if not needed():
        return False
    _patch_process()
    if not mode_active():
        mode = _CudaToCpu()
        mode.__enter__()  # pushed for the life of the thread
        _thread_state.mode = mode
    return True


def disable() -> None:
    """Pop this thread's device-mapping mode (for tests that need plain CPU torch afterwards).

    The process-wide patches stay. The mode must be the innermost torch function mode.
    """
    mode = getattr(_thread_state, "mode", None)
    if mode is None:
        return
    from torch.overrides import _get_current_function_mode

    if _get_current_function_mode() is not mode:
        raise RuntimeError(
            "cannot disable the megatron CPU mode: another torch function mode was pushed after it"
        )
    mode.__exit__(None, None, None)
    _thread_state.mode = None


def model_parallel_manual_seed(seed: int) -> None:
    """Seed the default generator and megatron's tensor-parallel RNG tracker.

    Wraps ``megatron.core.tensor_parallel.model_parallel_cuda_manual_seed``: on the CPU its
    ``torch.cuda.manual_seed(seed)`` of the default stream is a queued no-op, so the CPU default
    generator (which stands for the CUDA one here) is seeded explicitly with the same seed.
    """
    from megatron.core import tensor_parallel

    if needed():
        enable()
        torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


# ----------------------------------------------------------------------------- the placement test


_META = torch.device("meta")


class _CudaToMeta(TorchFunctionMode):
    """Rewrites CUDA devices (and int indices) to ``meta``; ``Tensor.cuda()`` moves to meta;
    ``Tensor.type()`` names a meta tensor ``torch.cuda.*`` (as a CUDA tensor would be named) and
    every other tensor by its real name, so megatron's type asserts pass for what is on the
    "device" and refuse what stayed on the host, exactly as on a GPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs) if kwargs else {}
        if func is torch.Tensor.cuda:
            return args[0].to(_META)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            with torch._C.DisableTorchFunction():  # the real name, past every mode
                name = args[0].type()
            return name.replace("torch.meta.", "torch.cuda.", 1) if args[0].device.type == "meta" else name
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = _META
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _META) + tuple(args[2:])
        return func(*args, **kwargs)


_CUDA_AS_META: dict[str, Callable] = {  # torch.cuda as a GPU machine answers it, for the placement test
    "is_available": lambda: True,
    "device_count": lambda: 1,
    "set_device": lambda device: None,
    "is_bf16_supported": lambda *a, **k: True,
    "get_device_name": lambda *a, **k: "meta (pfppo placement test)",
    "memory_allocated": lambda *a, **k: 0,
    "max_memory_allocated": lambda *a, **k: 0,
    "reset_peak_memory_stats": lambda *a, **k: None,
    "empty_cache": lambda: None,
}


@contextlib.contextmanager
def cuda_on_meta() -> Iterator[None]:
    """The GPU code path on a CPU machine with CUDA mapped to the ``meta`` device, not to the CPU:
    inside it ``torch.cuda.is_available()`` is True, every tensor made for a CUDA device (megatron's
    ``current_device()``, ``"cuda"``, ``.cuda()``, ``.to(cuda)``) is a meta tensor, and a tensor made
    without a device is a CPU tensor, as on a GPU machine. So whatever a GPU run would leave on the
    host is on the CPU here, where a test can see it (the CPU compatibility layer, which makes the host
    the device, hides it). Nothing computes (meta tensors have shapes only): build, wrap and place,
    then assert where everything is. Needs the CPU layer enabled in this thread (``enable()``)."""
    if not mode_active():
        raise RuntimeError("cuda_on_meta() needs megatron_cpu.enable() in this thread first")
    saved = {name: getattr(torch.cuda, name) for name in _CUDA_AS_META}
    for name, fn in _CUDA_AS_META.items():
        setattr(torch.cuda, name, fn)
    mode = _CudaToMeta()
    try:
        with mode:
            yield
    finally:
        for name, fn in saved.items():
            setattr(torch.cuda, name, fn)
