"""The backend interface: one conformance test over every available backend, and the switch."""

import pytest
import torch

from pfppo_mega import ppo
from pfppo_mega.kernels import (
    FusedBackend,
    TorchBackend,
    available_backends,
    get_backend,
    is_built,
    ops,
)
from pfppo_mega.kernels.testing import (
    assert_within_torch_error,
    gae_inputs,
    labels_for,
    logits,
    policy_inputs,
    ragged_mask,
)

torch.set_num_threads(1)

BACKENDS = available_backends()
LOSS_FIELDS = ("loss", "pg_clipfrac", "pg_clipfrac_lower", "approx_kl", "is_weight_mean")


def _logprob_run(backend, x, labels, upstream):
    x = x.detach().clone().requires_grad_()
    logp, ent = backend.logprob_entropy(x, labels)
    (logp.double() * upstream[0] + ent.double() * upstream[1]).sum().backward()
    return logp.detach(), ent.detach(), x.grad


def _loss_run(backend, inputs, mask, dtype, options):
    logp = inputs["logp"].to(dtype).clone().requires_grad_()
    out = backend.policy_loss(
        logp, inputs["old_logp"].to(dtype), inputs["advantages"].to(dtype), mask,
        is_weights=inputs["is_weights"].to(dtype), **options,
    )
    out.loss.backward()
    return out, logp.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_backend_conformance(backend, dtype):
    """Each backend, at each dtype, is within the accuracy rule of the fp64 reference (the
    torch backend at the same dtype sets the error scale), forward and gradients."""
    reference = TorchBackend()

    # Token log-prob and entropy of [B, T, V] logits, as the trainer has them.
    x = logits(2 * 6, 517, seed=30, dtype=dtype)
    labels = labels_for(x, seed=30).view(2, 6)
    x = x.view(2, 6, 517)
    g = torch.Generator().manual_seed(30)
    upstream = (torch.randn(2, 6, generator=g, dtype=torch.float64),
                torch.randn(2, 6, generator=g, dtype=torch.float64))
    got = _logprob_run(backend, x, labels, upstream)
    same = _logprob_run(reference, x, labels, upstream)
    exact = _logprob_run(reference, x.double(), labels, upstream)
    for name, k, t, r in zip(("logp", "entropy", "grad"), got, same, exact):
        assert_within_torch_error(f"{backend.name} {name}", k, t, r)

    # Policy loss, every aggregation mode, dual clip and IS weights on.
    inputs = policy_inputs(5, 64, seed=31, dtype=dtype)
    mask = ragged_mask(5, 64, seed=31)
    for mode in ppo.LOSS_AGG_MODES:
        options = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, dual_clip_c=3.0, loss_agg_mode=mode)
        k_out, k_grad = _loss_run(backend, inputs, mask, dtype, options)
        t_out, t_grad = _loss_run(reference, inputs, mask, dtype, options)
        r_out, r_grad = _loss_run(reference, inputs, mask, torch.float64, options)
        for field in LOSS_FIELDS:
            assert_within_torch_error(
                f"{backend.name} {mode} {field}", getattr(k_out, field), getattr(t_out, field),
                getattr(r_out, field),
            )
        assert_within_torch_error(f"{backend.name} {mode} grad", k_grad, t_grad, r_grad)

    # GAE with and without whitening.
    gi = gae_inputs(4, 96, seed=32, dtype=dtype)
    mask = ragged_mask(4, 96, seed=32, dtype=torch.float32)
    for whiten in (False, True):
        k = backend.gae(gi["rewards"], gi["values"], mask, gamma=0.99, lam=0.95, whiten=whiten)
        t = reference.gae(gi["rewards"], gi["values"], mask, gamma=0.99, lam=0.95, whiten=whiten)
        r = reference.gae(gi["rewards"].double(), gi["values"].double(), mask, gamma=0.99,
                          lam=0.95, whiten=whiten)
        for name, kk, tt, rr in zip(("advantages", "returns"), k, t, r):
            assert_within_torch_error(f"{backend.name} gae whiten={whiten} {name}", kk, tt, rr)


def test_every_backend_is_exercised():
    names = [b.name for b in BACKENDS]
    assert names[0] == "torch"
    assert ("fused" in names) == is_built(), f"{names}; {ops.BUILD_HINT}"


def test_get_backend_modes():
    assert isinstance(get_backend("torch"), TorchBackend)
    assert isinstance(get_backend("auto"), FusedBackend if is_built() else TorchBackend)
    with pytest.raises(ValueError, match="kernels='triton' is not one of \\('auto', 'torch', 'fused'\\)"):
        get_backend("triton")


def test_fused_without_extension_says_how_to_build(monkeypatch):
    monkeypatch.setattr(ops, "_C", None)
    monkeypatch.setattr(ops, "_IMPORT_ERROR", ImportError("No module named 'pfppo_mega._C'"))
    assert isinstance(get_backend("auto"), TorchBackend)
    with pytest.raises(RuntimeError, match="pip install --no-build-isolation -e \\."):
        get_backend("fused")


@pytest.mark.skipif(not is_built(), reason="pfppo_mega._C not built")
def test_fused_backend_promotes_like_torch():
    """bf16 logp with fp32 old_logp promotes to fp32, as the reference's arithmetic does; the
    gradient comes back in logp's dtype. fp64 raises a TypeError that names the dtypes."""
    fused, reference = FusedBackend(), TorchBackend()
    inputs = policy_inputs(3, 40, seed=33, dtype=torch.float32)
    mask = ragged_mask(3, 40, seed=33).long()  # int masks become mask != 0
    results = []
    for backend in (fused, reference):
        logp = inputs["logp"].bfloat16().requires_grad_()
        out = backend.policy_loss(logp, inputs["old_logp"], inputs["advantages"], mask,
                                  clip_ratio_low=0.2, clip_ratio_high=0.2)
        out.loss.backward()
        results.append((out.loss, logp.grad))
    assert results[0][0].dtype == results[1][0].dtype == torch.float32
    assert results[0][1].dtype == torch.bfloat16
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(results[0][1], results[1][1])
    with pytest.raises(TypeError, match="logp: torch.float64.*Use `kernels: torch`"):
        fused.policy_loss(inputs["logp"].double(), inputs["old_logp"], inputs["advantages"], mask,
                          clip_ratio_low=0.2, clip_ratio_high=0.2)


@pytest.mark.skipif(not is_built(), reason="pfppo_mega._C not built")
def test_fused_backend_shifted_logits():
    """logits[:, :-1] of [B, T + 1, V] (not viewable as [N, V]) give the torch result."""
    full = logits(3 * 8, 211, seed=34, dtype=torch.float32).view(3, 8, 211)
    x = full[:, :-1]
    labels = torch.randint(0, 211, (3, 7), generator=torch.Generator().manual_seed(34))
    got = FusedBackend().logprob_entropy(x, labels)
    want = TorchBackend().logprob_entropy(x, labels)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=2e-6)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=2e-6)
