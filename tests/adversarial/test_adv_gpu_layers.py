"""Adversarial inputs for the fused layers' torch path (what a GPU runs, pfppo_mega/models/fused_layers.py)
and the speed step's arguments: empty batches give empty results and zero gradients; bad shapes and
layer specs raise errors that name the argument and spell the expected shape."""

from __future__ import annotations

import pytest
import torch

from pfppo_mega.bench import gpu_check
from pfppo_mega.models import fused_layers as fl


@pytest.fixture
def torch_path(monkeypatch):
    monkeypatch.setattr(fl, "usable", lambda *t: False)  # never the C++ kernels: the GPU's code


def test_empty_inputs(torch_path):
    h = torch.zeros(0, 3, 8, requires_grad=True)
    y = fl.swiglu(h)
    assert y.shape == (0, 3, 4)
    y.sum().backward()
    assert h.grad.shape == h.shape
    t = torch.zeros(0, 2, 4, 8, requires_grad=True)
    assert fl.rope(t, torch.zeros(0, 1, 1, 8)).shape == t.shape
    q, kv = torch.zeros(0, 2, 4, 8), torch.zeros(0, 2, 2, 8)
    assert fl.sdpa(q, kv, kv, None).shape == (0, 2, 32)


def test_bad_shapes_are_named(torch_path):
    with pytest.raises(ValueError, match=r"swiglu: h \[\.\.\., 2F\] must have an even last dimension, got shape "
                                         r"\(3, 7\)"):
        fl.swiglu(torch.randn(3, 7))
    with pytest.raises(ValueError, match=r"rope: t must be \[S, B, H, D\] with D even and freqs \[S, 1, 1, D\]; "
                                         r"got t \(5, 2, 3, 8\), freqs \(4, 1, 1, 8\)"):
        fl.rope(torch.randn(5, 2, 3, 8), torch.randn(4, 1, 1, 8))
    with pytest.raises(ValueError, match=r"rope: .* got t \(5, 2, 3, 7\)"):
        fl.rope(torch.randn(5, 2, 3, 7), torch.randn(5, 1, 1, 7))
    with pytest.raises(ValueError, match=r"sdpa: query must be \[s, b, n, d\] and key / value \[s, b, g, d\] with g "
                                         r"dividing n; got query \(4, 1, 6, 8\), key \(4, 1, 4, 8\)"):
        kv = torch.randn(4, 1, 4, 8)
        fl.sdpa(torch.randn(4, 1, 6, 8), kv, kv, None)
    with pytest.raises(ValueError, match=r"key \(4, 1, 2, 16\)"):  # head_dim differs
        kv = torch.randn(4, 1, 2, 16)
        fl.sdpa(torch.randn(4, 1, 4, 8), kv, kv, None)


def test_bad_layer_spec_is_named():
    with pytest.raises(ValueError, match=r"layer_spec\('te'\) must be one of 'local', 'transformer_engine', 'auto'"):
        fl.choose_layer_path("te", fused_layers=True, device_type="cuda", params_dtype="bfloat16", te_available=False)


@pytest.mark.parametrize("argv,msg", [
    (["speed", "--rows", "0"], "--rows (0) must be >= 1"),
    (["speed", "--steps", "-1"], "--reps and --steps must be >= 1"),
    (["speed", "--compare-layers", "0"], "--compare-layers (0) must be >= 1"),
    (["speed", "--seq", "10"], "--seq (10) must exceed the 64-token prompt"),
])
def test_speed_arguments_refused_by_name(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        gpu_check.main(argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err
