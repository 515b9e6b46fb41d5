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


# ---------------------------------------------------------------------------------------------
# Independent references: plain torch ops written here from the formulas (not pfppo_mega.ppo,
# which the torch backend is), run at the input dtype (the error scale) and in float64 (the
# truth). A backend that computes something else fails the rule even when it is pfppo's own code.


def _ref_logprob(x, labels, temperature, vocab_size):
    y = x[..., :vocab_size] / temperature
    logq = torch.log_softmax(y, dim=-1)
    p = logq.exp()
    return logq.gather(-1, labels[..., None])[..., 0], -torch.where(p > 0, p * logq, 0.0).sum(-1)


def _ref_policy_loss(logp, old_logp, adv, mask, is_weights, *, clip_ratio_low, clip_ratio_high,
                     dual_clip_c, loss_agg_mode):
    m = mask.to(logp.dtype)
    log_ratio = (logp - old_logp).clamp(-20.0, 20.0)
    ratio = log_ratio.exp()
    pg1, pg2 = -adv * ratio, -adv * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    pg = torch.maximum(pg1, pg2)
    dual = (adv < 0) & (pg > -adv * dual_clip_c)
    pg = torch.where(dual, -adv * dual_clip_c, pg) * is_weights
    tokens = m.sum()
    row_tokens = m.sum(dim=1)
    rows = (row_tokens > 0).to(logp.dtype).sum()
    if loss_agg_mode == "token-mean":
        loss = (pg * m).sum() / tokens
    elif loss_agg_mode == "seq-mean-token-sum":
        loss = (pg * m).sum() / rows
    elif loss_agg_mode == "seq-mean-token-sum-norm":  # verl 0.9.1: over the rows with a token and the padded width
        loss = (pg * m).sum() / rows / logp.shape[-1]
    else:
        loss = ((pg * m).sum(dim=1) / row_tokens.clamp(min=1)).sum() / rows

    def mean(v):
        return (v.to(logp.dtype) * m).sum() / tokens

    return dict(loss=loss, pg_clipfrac=mean(pg2 > pg1), pg_clipfrac_lower=mean(dual),
                approx_kl=mean(ratio - 1 - log_ratio), is_weight_mean=mean(is_weights))


def _ref_gae(rewards, values, mask, *, gamma, lam, whiten):
    m = mask.to(values.dtype)
    adv = torch.zeros_like(values)
    for b in range(values.shape[0]):
        next_v = next_a = torch.zeros((), dtype=values.dtype)
        for t in reversed(range(values.shape[1])):
            if m[b, t] == 0:
                next_v = next_a = torch.zeros((), dtype=values.dtype)
                continue
            delta = rewards[b, t] + gamma * next_v - values[b, t]
            adv[b, t] = next_a = delta + gamma * lam * next_a
            next_v = values[b, t]
    returns = (adv + values) * m
    if whiten:
        n = m.sum()
        mean = (adv * m).sum() / n
        var = (((adv - mean) * m) ** 2).sum() / (n - 1)
        adv = (adv - mean) * torch.rsqrt(var + 1e-8) * m
    return adv, returns


def _logprob_run(fn, x, labels, upstream):
    x = x.detach().clone().requires_grad_()
    logp, ent = fn(x, labels)
    (logp.double() * upstream[0] + ent.double() * upstream[1]).sum().backward()
    return logp.detach(), ent.detach(), x.grad


def _loss_run(fn, inputs, mask, dtype, options):
    logp = inputs["logp"].to(dtype).clone().requires_grad_()
    out = fn(logp, inputs["old_logp"].to(dtype), inputs["advantages"].to(dtype), mask,
             inputs["is_weights"].to(dtype), options)
    out["loss"].backward()
    return out, logp.grad


def _backend_loss(backend):
    def run(logp, old_logp, adv, mask, is_weights, options):
        out = backend.policy_loss(logp, old_logp, adv, mask, is_weights=is_weights, **options)
        return {f: getattr(out, f) for f in LOSS_FIELDS}
    return run


def _independent_loss(logp, old_logp, adv, mask, is_weights, options):
    return _ref_policy_loss(logp, old_logp, adv, mask, is_weights, **options)


def check_conformance(backend, dtype) -> None:
    """`backend`, at `dtype`, obeys the accuracy rule against the independent references above,
    forward and gradients; AssertionError (naming the quantity) otherwise."""
    # Token log-prob and entropy of [B, T, V] logits with vocabulary padding and a temperature,
    # as the trainer has them.
    vocab, padded, temperature = 517, 520, 0.7
    x = logits(2 * 6, padded, seed=30, dtype=dtype)
    labels = labels_for(x[:, :vocab], seed=30).view(2, 6)
    x = x.view(2, 6, padded)
    g = torch.Generator().manual_seed(30)
    upstream = (torch.randn(2, 6, generator=g, dtype=torch.float64),
                torch.randn(2, 6, generator=g, dtype=torch.float64))
    got = _logprob_run(lambda a, y: backend.logprob_entropy(a, y, temperature=temperature, vocab_size=vocab),
                       x, labels, upstream)
    indep = lambda a, y: _ref_logprob(a, y, temperature, vocab)  # noqa: E731
    same, exact = _logprob_run(indep, x, labels, upstream), _logprob_run(indep, x.double(), labels, upstream)
    for name, k, t, r in zip(("logp", "entropy", "grad"), got, same, exact):
        assert_within_torch_error(f"{backend.name} {name}", k, t, r)

    # Policy loss, every aggregation mode, dual clip and IS weights on.
    inputs = policy_inputs(5, 64, seed=31, dtype=dtype)
    mask = ragged_mask(5, 64, seed=31)
    for mode in ppo.LOSS_AGG_MODES:
        options = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, dual_clip_c=3.0, loss_agg_mode=mode)
        k_out, k_grad = _loss_run(_backend_loss(backend), inputs, mask, dtype, options)
        t_out, t_grad = _loss_run(_independent_loss, inputs, mask, dtype, options)
        r_out, r_grad = _loss_run(_independent_loss, inputs, mask, torch.float64, options)
        for field in LOSS_FIELDS:
            assert_within_torch_error(f"{backend.name} {mode} {field}", k_out[field], t_out[field],
                                      r_out[field])
        assert_within_torch_error(f"{backend.name} {mode} grad", k_grad, t_grad, r_grad)

    # GAE with and without whitening.
    gi = gae_inputs(4, 96, seed=32, dtype=dtype)
    mask = ragged_mask(4, 96, seed=32, dtype=torch.float32)
    for whiten in (False, True):
        k = backend.gae(gi["rewards"], gi["values"], mask, gamma=0.99, lam=0.95, whiten=whiten)
        t = _ref_gae(gi["rewards"], gi["values"], mask, gamma=0.99, lam=0.95, whiten=whiten)
        r = _ref_gae(gi["rewards"].double(), gi["values"].double(), mask, gamma=0.99, lam=0.95,
                     whiten=whiten)
        for name, kk, tt, rr in zip(("advantages", "returns"), k, t, r):
            assert_within_torch_error(f"{backend.name} gae whiten={whiten} {name}", kk, tt, rr)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_backend_conformance(backend, dtype):
    """Each backend, at each dtype, is within the accuracy rule of the fp64 reference (an
    independent torch implementation at the same dtype sets the error scale), forward and
    gradients."""
    check_conformance(backend, dtype)


class _WrongLam(TorchBackend):
    def gae(self, rewards, values, mask, *, gamma, lam, whiten=False):
        return super().gae(rewards, values, mask, gamma=gamma, lam=lam * 0.999, whiten=whiten)


class _IgnoresTemperature(TorchBackend):
    def logprob_entropy(self, logits, labels, *, temperature=1.0, vocab_size=None):
        return super().logprob_entropy(logits, labels, vocab_size=vocab_size)


class _CountsPadding(TorchBackend):
    def logprob_entropy(self, logits, labels, *, temperature=1.0, vocab_size=None):
        return super().logprob_entropy(logits, labels, temperature=temperature)


class _NoDualClip(TorchBackend):
    def policy_loss(self, logp, old_logp, advantages, mask, **options):
        return super().policy_loss(logp, old_logp, advantages, mask, **{**options, "dual_clip_c": None})


@pytest.mark.parametrize("wrong,fails_on", [(_WrongLam, "gae"), (_IgnoresTemperature, "logp"),
                                            (_CountsPadding, "logp"), (_NoDualClip, "token-mean")],
                         ids=["gae-lam", "logprob-temperature", "logprob-padding", "loss-dual-clip"])
def test_conformance_fails_for_a_wrong_backend(wrong, fails_on):
    """The conformance check can fail: a backend that is slightly wrong (lam off by 0.1%, the
    temperature or the vocabulary padding ignored, no dual clip) is caught, at fp32."""
    with pytest.raises(AssertionError, match=fails_on):
        check_conformance(wrong(), torch.float32)


def test_every_backend_is_exercised():
    names = [b.name for b in BACKENDS]
    assert names[0] == "torch"
    assert ("fused" in names) == is_built(), f"{names}; {ops.BUILD_HINT}"


def test_get_backend_modes():
    assert isinstance(get_backend("torch"), TorchBackend)
    # on the CPU auto is fused when built; on a GPU it also needs the GPU check's marker (its own test)
    assert isinstance(get_backend("auto", "cpu"), FusedBackend if is_built() else TorchBackend)
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


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_temperature_divides_bf16_logits_in_fp32(backend):
    """bf16 logits / T in bf16 would round the tempered logits to 8 bits (an error of ~1e-2 in
    log p here); every backend divides in fp32, as the vocab-parallel path does, so the result
    matches fp64 of the same bf16 values to fp32 rounding."""
    x = logits(8, 3000, seed=35, dtype=torch.bfloat16)
    labels = labels_for(x, seed=35)
    logp, ent = backend.logprob_entropy(x, labels, temperature=0.7)
    ref = torch.log_softmax(x.double() / 0.7, dim=-1)
    assert (logp.double() - ref.gather(1, labels[:, None])[:, 0]).abs().max() < 1e-4
    assert (ent.double() + (ref.exp() * ref).sum(-1)).abs().max() < 1e-4


def test_auto_on_a_gpu_means_torch_until_the_gpu_check_verified_that_machine_kind(monkeypatch, tmp_path):
    """kernels: auto on CUDA uses the fused kernels only where scripts/gpu_kernels_check.sh wrote a
    marker for the device's name; else torch, said once. `fused` stays available by name. The
    device-kind lookup and the CUDA build are faked (this machine has no GPU)."""
    from pfppo_mega.kernels import backends

    monkeypatch.setenv(backends.MARKER_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(backends, "_SAID", set())
    monkeypatch.setattr(ops, "_C", type("FakeC", (), {"has_cuda": True})())  # built, with CUDA kernels
    kind = {"name": "NVIDIA H200"}
    monkeypatch.setattr(backends, "device_kind", lambda device: kind["name"])
    said: list[str] = []
    for _ in range(2):
        assert isinstance(get_backend("auto", "cuda", log=said.append), TorchBackend)
    assert len(said) == 1 and "NVIDIA H200" in said[0] and "nvidia_h200.json" in said[0], said
    assert isinstance(get_backend("fused", "cuda"), FusedBackend)  # by name: always
    # the GPU check passed on this kind: the marker makes auto choose the fused kernels
    path = backends.write_marker("cuda")
    assert path == tmp_path / "nvidia_h200.json" and '"device": "NVIDIA H200"' in path.read_text()
    assert isinstance(get_backend("auto", "cuda", log=said.append), FusedBackend)
    # another machine kind is not covered by that marker
    kind["name"] = "NVIDIA H100 80GB HBM3"
    assert isinstance(get_backend("auto", "cuda", log=said.append), TorchBackend)
    assert len(said) == 2 and "nvidia_h100_80gb_hbm3.json" in said[1]
    # on CPU tensors auto is unchanged: fused when built (the CPU kernels are tested everywhere)
    assert isinstance(get_backend("auto", "cpu"), FusedBackend)
