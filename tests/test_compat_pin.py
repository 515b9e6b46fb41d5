"""The megatron-core CPU compatibility layer: version pin, patch targets, thread-local mode, RNG.

Fails loudly when requirements.lock, the installed megatron-core and the compat module's pin
disagree, or when an attribute the layer replaces no longer exists in megatron-core.
"""

from __future__ import annotations

import importlib.metadata
import logging
import re
import threading
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

from pfppo_mega.compat import megatron_cpu  # noqa: E402

LOCK = Path(__file__).resolve().parents[1] / "requirements.lock"
CUDA = torch.cuda.is_available()


def _locked_version(package: str) -> str:
    pins = re.findall(rf"^{re.escape(package)}==([^\s;#]+)", LOCK.read_text(), flags=re.M)
    assert len(pins) == 1, f"requirements.lock must pin {package} exactly once, found {pins}"
    return pins[0]


def test_pin_matches_lock_and_installed_version():
    locked = _locked_version("megatron-core")
    installed = importlib.metadata.version("megatron-core")
    import megatron.core

    assert locked == megatron_cpu.PINNED_MEGATRON_CORE, (
        f"requirements.lock pins megatron-core=={locked} but pfppo_mega.compat.megatron_cpu is written "
        f"for {megatron_cpu.PINNED_MEGATRON_CORE}: re-verify every entry of PATCHES, then move the pin")
    assert installed == locked, f"installed megatron-core {installed} != requirements.lock {locked}"
    assert megatron.core.__version__ == locked
    assert megatron_cpu.check_megatron_version() == locked


def test_version_check_refuses_another_release(monkeypatch):
    import megatron.core

    monkeypatch.setattr(megatron.core, "__version__", "0.17.0")
    with pytest.raises(megatron_cpu.MegatronVersionError, match=r"megatron-core 0\.17\.0 is installed .* pinned to 0\.16\.1"):
        megatron_cpu.check_megatron_version()


@pytest.mark.parametrize("patch", megatron_cpu.PATCHES, ids=lambda p: f"{p.owner}.{p.name}")
def test_patched_attribute_exists_upstream(patch):
    owner = patch.resolve_owner()
    assert hasattr(owner, patch.name), f"{patch.owner}.{patch.name} is gone: {patch.why}"
    original = megatron_cpu.ORIGINALS.get((patch.owner, patch.name), getattr(owner, patch.name))
    assert callable(original)
    assert not original.__module__.startswith("pfppo_mega"), "ORIGINALS must hold the upstream object"
    if patch.owner.startswith("megatron."):
        assert original.__module__ == patch.owner.partition(":")[0]


def test_rng_call_sites_still_use_the_patched_helpers():
    """The replacements only help while megatron's tracker calls these names."""
    import inspect

    from megatron.core.tensor_parallel import random as mp_random

    fork_src = inspect.getsource(mp_random.CudaRNGStatesTracker.fork)
    assert "_get_cuda_rng_state(" in fork_src and "_set_cuda_rng_state(" in fork_src
    seed_src = inspect.getsource(mp_random.model_parallel_cuda_manual_seed)
    assert "_CUDA_RNG_STATE_TRACKER.add(" in seed_src


@pytest.mark.skipif(CUDA, reason="CUDA build with a GPU: the compat layer is a no-op, tested below")
def test_mode_is_thread_local_and_enable_is_idempotent():
    results: dict[str, object] = {}

    def worker():
        try:
            torch.zeros(1, device="cuda")
            results["before"] = "no error"
        except (AssertionError, RuntimeError) as e:
            results["before"] = str(e)
        depth = torch._C._len_torch_function_stack()
        results["enabled"] = megatron_cpu.enable() and megatron_cpu.enable()
        results["depth_added"] = torch._C._len_torch_function_stack() - depth
        results["device"] = torch.zeros(1, device="cuda").device.type
        results["int_device"] = torch.ones(2, device=0).to(0).cuda().device.type
        results["own_type"] = torch.zeros(1).type()  # called from test code: not rewritten
        megatron_cpu.disable()
        results["after_disable"] = megatron_cpu.mode_active()

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert "not compiled with CUDA" in str(results["before"])
    assert results["enabled"] is True and results["depth_added"] == 1
    assert results["device"] == "cpu" and results["int_device"] == "cpu"
    assert results["own_type"] == "torch.FloatTensor"
    assert results["after_disable"] is False


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device to check the no-op path")
def test_enable_is_a_noop_with_cuda():
    assert megatron_cpu.enable() is False and not megatron_cpu.mode_active()


@pytest.mark.skipif(CUDA, reason="CPU-only behaviour")
def test_megatron_type_asserts_pass_on_cpu_tensors():
    """megatron's grad clipping asserts grad.type() == 'torch.cuda.FloatTensor'."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    megatron_cpu.enable()
    try:
        p = torch.nn.Parameter(torch.ones(4))
        p.grad = torch.full((4,), 2.0)
        clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=4.0)
        torch.testing.assert_close(p.grad, torch.full((4,), 2.0 * 1.0 / (4.0 + 1e-6)))
    finally:
        megatron_cpu.disable()


@pytest.mark.skipif(CUDA, reason="CPU-only behaviour")
def test_rng_tracker_streams_on_cpu(caplog):
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    megatron_cpu.enable()
    try:
        tracker = get_cuda_rng_tracker()
        saved = tracker.get_states()
        tracker.reset()
        tracker.add("stream", 123)

        torch.manual_seed(0)
        expected_default = torch.rand(5)
        torch.manual_seed(0)
        with caplog.at_level(logging.WARNING):
            with tracker.fork("stream"):
                first = torch.rand(3)
            default = torch.rand(5)
            with tracker.fork("stream"):
                second = torch.rand(3)
        # The fork does not disturb the default stream; the tracked stream continues.
        assert torch.equal(default, expected_default)
        gen = torch.Generator().manual_seed(123)
        assert torch.equal(first, torch.rand(3, generator=gen))
        assert torch.equal(second, torch.rand(3, generator=gen))
        assert not [r for r in caplog.records if "RNG" in r.getMessage()]
        with pytest.raises(Exception, match="seed 123 already exists"):
            tracker.add("other", 123)
        tracker.reset()
        tracker.set_states(saved)
    finally:
        megatron_cpu.disable()
