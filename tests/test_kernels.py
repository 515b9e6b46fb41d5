"""CPU kernels (pfppo_mega._C) against the pure-torch math in float64, forward and gradients.

Every comparison uses the rule of pfppo_mega.kernels.testing: kernel error <= 2 x the torch
error at the same input dtype + one unit of the output dtype.
"""

import os
import re
import shutil
import subprocess

import pytest
import torch

from pfppo_mega import ppo
from pfppo_mega.constants import KERNEL_LOSS_AGG_MODES
from pfppo_mega.kernels import ops
from pfppo_mega.kernels.testing import (
    assert_within_torch_error,
    gae_inputs,
    labels_for,
    logits,
    policy_inputs,
    ragged_mask,
)

torch.set_num_threads(1)

if os.environ.get("PFPPO_NO_EXT") == "1":
    pytest.skip("PFPPO_NO_EXT=1: pfppo_mega._C deliberately not built", allow_module_level=True)

DTYPES = [torch.float32, torch.bfloat16]


def test_extension_is_built():
    assert ops.is_built(), f"pfppo_mega._C does not import ({ops._IMPORT_ERROR}); {ops.BUILD_HINT}"


# ---------------------------------------------------------------------------------------------
# Token log-prob and entropy.


def _torch_logprob_entropy(x, labels):
    return ppo.logprobs_from_logits(x, labels), ppo.entropy_from_logits(x)


def _check_logprob_entropy(x, labels, tag):
    """Forward and backward of the op vs torch at x.dtype vs torch in fp64 (on the same values)."""
    g = torch.Generator().manual_seed(1)
    grad_logp = torch.randn(x.shape[0], generator=g, dtype=torch.float64)
    grad_ent = torch.randn(x.shape[0], generator=g, dtype=torch.float64)

    def run(fn, inp):
        inp = inp.detach().clone().requires_grad_()
        logp, ent = fn(inp, labels)
        (logp.double() * grad_logp + ent.double() * grad_ent).sum().backward()
        return logp.detach(), ent.detach(), inp.grad

    k_logp, k_ent, k_grad = run(ops.logprob_entropy, x)
    t_logp, t_ent, t_grad = run(_torch_logprob_entropy, x)
    r_logp, r_ent, r_grad = run(_torch_logprob_entropy, x.double())
    assert k_logp.dtype == torch.float32 and k_ent.dtype == torch.float32
    assert k_grad.dtype == x.dtype
    assert_within_torch_error(f"{tag} logp", k_logp, t_logp, r_logp)
    assert_within_torch_error(f"{tag} entropy", k_ent, t_ent, r_ent)
    assert_within_torch_error(f"{tag} grad", k_grad, t_grad, r_grad)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "rows,vocab",
    [(1, 1), (1, 7), (6, 1000), (3, 2049), (4, 4099), (2, 152064)],
    ids=lambda v: str(v),
)
def test_logprob_entropy_matches_fp64(rows, vocab, dtype):
    x = logits(rows, vocab, seed=rows * vocab, dtype=dtype)
    _check_logprob_entropy(x, labels_for(x, seed=3), f"[{rows}, {vocab}] {dtype}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_logprob_entropy_masked_vocab(dtype):
    """-inf logits (a masked vocabulary) add nothing and get a 0 gradient, not NaN."""
    x = logits(5, 3001, seed=5, dtype=dtype, neg_inf=True)
    _check_logprob_entropy(x, labels_for(x, seed=4), f"-inf {dtype}")


def test_logprob_entropy_row_stride():
    """Rows of a wider tensor (stride(0) > V) give the contiguous result, bit for bit."""
    wide = logits(4, 1030, seed=6, dtype=torch.float32)
    x = wide[:, :1000]
    labels = labels_for(x.contiguous(), seed=6)
    got = ops.logprob_entropy(x, labels)
    want = ops.logprob_entropy(x.contiguous(), labels)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_vocab_parallel_partials_combine_to_full(dtype):
    """Two shards (an uneven split) combined in pure torch equal the full vocabulary, and the
    shard backward, concatenated, equals the full gradient."""
    x = logits(7, 1000, seed=8, dtype=dtype)
    labels = labels_for(x, seed=8)
    split = 377
    shards = [(x[:, :split], 0), (x[:, split:], split)]
    combined = ops.combine_partials(
        [ops.logprob_entropy_partials(s, labels, start) for s, start in shards]
    )
    t_logp, t_ent = _torch_logprob_entropy(x, labels)
    r_logp, r_ent = _torch_logprob_entropy(x.double(), labels)
    assert_within_torch_error("combined logp", combined.logp, t_logp, r_logp)
    assert_within_torch_error("combined entropy", combined.entropy, t_ent, r_ent)

    g = torch.Generator().manual_seed(9)
    grad_logp = torch.randn(7, generator=g)
    grad_ent = torch.randn(7, generator=g)
    shard_grads = [
        ops.logprob_entropy_shard_backward(s, labels, start, combined, grad_logp, grad_ent)
        for s, start in shards
    ]
    k_grad = torch.cat(shard_grads, dim=1)

    def grad_of(inp):
        inp = inp.detach().clone().requires_grad_()
        logp, ent = _torch_logprob_entropy(inp, labels)
        (logp * grad_logp.to(logp.dtype) + ent * grad_ent.to(ent.dtype)).sum().backward()
        return inp.grad

    assert_within_torch_error("shard grads", k_grad, grad_of(x), grad_of(x.double()))


def _torch_tempered(x, labels, temperature, vocab_size):
    y = x[:, :vocab_size] / temperature
    return ppo.logprobs_from_logits(y, labels), ppo.entropy_from_logits(y)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("vocab,padded", [(1000, 1000), (1000, 1024), (2049, 4096), (1, 8)], ids=str)
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3], ids=lambda t: f"T{t}")
def test_logprob_entropy_temperature_and_padding(vocab, padded, temperature, dtype):
    """Full op with the temperature folded in and padding columns (holding huge logits) that must
    not count: forward and gradient vs torch on x[:, :vocab] / T, same-dtype and fp64; the padding
    gradient is exactly 0. Also the partials of two shards (one mostly padding) combined."""
    x = logits(5, padded, seed=vocab + padded, dtype=dtype)
    x[:, vocab:] = 1e4
    labels = labels_for(x[:, :vocab], seed=11)
    g = torch.Generator().manual_seed(12)
    grad_logp, grad_ent = torch.randn(5, generator=g), torch.randn(5, generator=g)

    def run(fn, inp):
        inp = inp.detach().clone().requires_grad_()
        logp, ent = fn(inp)
        (logp.double() * grad_logp.double() + ent.double() * grad_ent.double()).sum().backward()
        return logp.detach(), ent.detach(), inp.grad

    kernel = run(lambda a: ops.logprob_entropy(a, labels, temperature=temperature, vocab_size=vocab), x)
    same = run(lambda a: _torch_tempered(a, labels, temperature, vocab), x)
    exact = run(lambda a: _torch_tempered(a, labels, temperature, vocab), x.double())
    tag = f"V={vocab}/{padded} T={temperature} {dtype}"
    for name, k, t, r in zip(("logp", "entropy"), kernel, same, exact):
        assert_within_torch_error(f"{tag} {name}", k, t, r)
    assert_within_torch_error(f"{tag} grad", kernel[2][:, :vocab], same[2][:, :vocab], exact[2][:, :vocab])
    assert torch.count_nonzero(kernel[2][:, vocab:]) == 0

    split = max(1, vocab // 2)
    opts = dict(temperature=temperature, vocab_size=vocab)
    shards = [(x[:, :split], 0), (x[:, split:], split)]
    combined = ops.combine_partials([ops.logprob_entropy_partials(s, labels, st, **opts) for s, st in shards])
    assert_within_torch_error(f"{tag} combined logp", combined.logp, same[0], exact[0])
    assert_within_torch_error(f"{tag} combined entropy", combined.entropy, same[1], exact[1])
    shard_grad = torch.cat([ops.logprob_entropy_shard_backward(s, labels, st, combined, grad_logp, grad_ent, **opts)
                            for s, st in shards], dim=1)
    assert_within_torch_error(f"{tag} shard grad", shard_grad[:, :vocab], same[2][:, :vocab], exact[2][:, :vocab])
    assert torch.count_nonzero(shard_grad[:, vocab:]) == 0


def test_vocab_partials_shard_of_only_neg_inf():
    """A shard whose logits are all -inf (sumexp 0) contributes nothing to the combination."""
    x = logits(3, 50, seed=10, dtype=torch.float32)
    x[:, 30:] = float("-inf")
    labels = labels_for(x[:, :30].contiguous(), seed=10)
    combined = ops.combine_partials(
        [
            ops.logprob_entropy_partials(x[:, :30], labels, 0),
            ops.logprob_entropy_partials(x[:, 30:], labels, 30),
        ]
    )
    full_logp, full_ent = ops.logprob_entropy(x, labels)
    torch.testing.assert_close(combined.logp, full_logp, rtol=0, atol=2e-6)
    torch.testing.assert_close(combined.entropy, full_ent, rtol=0, atol=2e-6)


# ---------------------------------------------------------------------------------------------
# PPO policy loss.


def _check_policy_loss(inputs, mask, tag, *, with_weights, **options):
    def run(fn, dtype):
        logp = inputs["logp"].to(dtype).detach().clone().requires_grad_()
        weights = inputs["is_weights"].to(dtype) if with_weights else None
        out = fn(
            logp, inputs["old_logp"].to(dtype), inputs["advantages"].to(dtype), mask,
            is_weights=weights, **options,
        )
        out.loss.backward()
        return out, logp.grad

    dtype = inputs["logp"].dtype
    k_out, k_grad = run(ops.policy_loss, dtype)
    t_out, t_grad = run(ppo.policy_loss, dtype)
    r_out, r_grad = run(ppo.policy_loss, torch.float64)
    for name in ("loss", "pg_clipfrac", "pg_clipfrac_lower", "approx_kl", "is_weight_mean"):
        k = getattr(k_out, name)
        assert k.dtype == dtype and k.dim() == 0, f"{tag} {name}: {k.dtype} {tuple(k.shape)}"
        assert_within_torch_error(f"{tag} {name}", k, getattr(t_out, name), getattr(r_out, name))
    assert k_grad.dtype == dtype
    assert_within_torch_error(f"{tag} grad", k_grad, t_grad, r_grad)
    return r_out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_weights", [False, True], ids=["no_is", "is_weights"])
@pytest.mark.parametrize("dual_clip_c", [None, 3.0], ids=["no_dual", "dual3"])
@pytest.mark.parametrize("mode", KERNEL_LOSS_AGG_MODES)  # the op's own; the backend adds the norm mode
def test_policy_loss_matches_fp64(mode, dual_clip_c, with_weights, dtype):
    inputs = policy_inputs(6, 203, seed=11, dtype=dtype)
    mask = ragged_mask(6, 203, seed=11)
    ref = _check_policy_loss(
        inputs, mask, f"{mode} c={dual_clip_c} w={with_weights} {dtype}",
        clip_ratio_low=0.2, clip_ratio_high=0.28, dual_clip_c=dual_clip_c,
        loss_agg_mode=mode, with_weights=with_weights,
    )
    # The data reaches every branch (else the comparison would prove less than it claims).
    assert 0.0 < ref.pg_clipfrac.item() < 1.0
    assert (ref.pg_clipfrac_lower.item() > 0.0) == (dual_clip_c is not None)


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows,cols", [(1, 1), (2, 9000), (5, 17)], ids=str)
def test_policy_loss_shapes_and_masks(rows, cols, mask_dtype):
    """T = 1, rows longer than one parallel piece (8192) and one fp32 block (1024), holes."""
    inputs = policy_inputs(rows, cols, seed=rows + cols, dtype=torch.float32)
    mask = ragged_mask(rows, cols, seed=12, dtype=mask_dtype, holes=True, empty_rows=rows > 2)
    _check_policy_loss(
        inputs, mask, f"[{rows}, {cols}] mask {mask_dtype}", clip_ratio_low=0.2,
        clip_ratio_high=0.2, dual_clip_c=3.0, loss_agg_mode="seq-mean-token-mean",
        with_weights=True,
    )


def test_policy_loss_all_masked_is_zero():
    inputs = policy_inputs(3, 10, seed=13, dtype=torch.float32)
    logp = inputs["logp"].clone().requires_grad_()
    out = ops.policy_loss(
        logp, inputs["old_logp"], inputs["advantages"], torch.zeros(3, 10, dtype=torch.bool),
        clip_ratio_low=0.2, clip_ratio_high=0.2,
    )
    out.loss.backward()
    assert out.loss.item() == 0.0 and out.approx_kl.item() == 0.0
    assert out.is_weight_mean.item() == 0.0
    assert torch.equal(logp.grad, torch.zeros_like(logp))


def test_policy_loss_backward_scales_by_upstream_gradient():
    inputs = policy_inputs(4, 50, seed=14, dtype=torch.float32)
    mask = ragged_mask(4, 50, seed=14)
    grads = []
    for factor in (1.0, -2.5):
        logp = inputs["logp"].clone().requires_grad_()
        out = ops.policy_loss(
            logp, inputs["old_logp"], inputs["advantages"], mask, clip_ratio_low=0.2,
            clip_ratio_high=0.2,
        )
        (factor * out.loss).backward()
        grads.append(logp.grad)
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[1], -2.5 * grads[0], rtol=0, atol=0)


def test_policy_loss_nan_in_padding_is_never_read():
    inputs = policy_inputs(3, 20, seed=15, dtype=torch.float32)
    mask = ragged_mask(3, 20, seed=15)
    poisoned = {k: v.masked_fill(~mask, float("nan")) for k, v in inputs.items()}
    logp = poisoned["logp"].clone().requires_grad_()
    out = ops.policy_loss(
        logp, poisoned["old_logp"], poisoned["advantages"], mask, clip_ratio_low=0.2,
        clip_ratio_high=0.2, dual_clip_c=3.0, is_weights=poisoned["is_weights"],
    )
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(out.approx_kl)
    assert torch.isfinite(logp.grad).all() and (logp.grad[~mask] == 0).all()


# ---------------------------------------------------------------------------------------------
# GAE.


def _check_gae(inputs, mask, tag, *, gamma, lam, whiten=False, shift_mean=True, row_chunks=0):
    def reference(r, v):
        with torch.no_grad():
            adv, ret = ppo.compute_gae(r, v, mask, gamma=gamma, lam=lam)
            if whiten:
                adv = ppo.masked_whiten(adv, mask, shift_mean=shift_mean)
        return adv, ret

    r, v = inputs["rewards"], inputs["values"]
    k_adv, k_ret = ops.gae(
        r, v, mask, gamma=gamma, lam=lam, whiten=whiten, shift_mean=shift_mean,
        row_chunks=row_chunks,
    )
    t_adv, t_ret = reference(r, v)
    r_adv, r_ret = reference(r.double(), v.double())
    assert k_adv.dtype == v.dtype and k_ret.dtype == v.dtype
    assert_within_torch_error(f"{tag} advantages", k_adv, t_adv, r_adv)
    assert_within_torch_error(f"{tag} returns", k_ret, t_ret, r_ret)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("holes", [False, True], ids=["right_padded", "holes"])
@pytest.mark.parametrize(
    "rows,cols", [(1, 1), (3, 1), (9, 300), (2, 5000)], ids=str
)
def test_gae_matches_fp64(rows, cols, holes, dtype):
    """9 rows: 8 scanned as groups of 4 + 1 alone; 2 x 5000: few long rows (chunked scan)."""
    inputs = gae_inputs(rows, cols, seed=rows * cols, dtype=dtype)
    mask = ragged_mask(rows, cols, seed=16, holes=holes)
    _check_gae(inputs, mask, f"[{rows}, {cols}] {dtype}", gamma=0.99, lam=0.95)


@pytest.mark.parametrize("row_chunks", [1, 2, 3, 7, 64])
def test_gae_chunked_scan(row_chunks):
    """Cutting each row into pieces (scanned in parallel, then carried) changes nothing."""
    inputs = gae_inputs(3, 640, seed=17, dtype=torch.float32)
    mask = ragged_mask(3, 640, seed=17, holes=True)
    _check_gae(inputs, mask, f"row_chunks={row_chunks}", gamma=1.0, lam=0.9, row_chunks=row_chunks)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.0, 0.0), (0.5, 1.0)])
def test_gae_discount_edges(gamma, lam):
    inputs = gae_inputs(5, 64, seed=18, dtype=torch.float32)
    mask = ragged_mask(5, 64, seed=18)
    _check_gae(inputs, mask, f"gamma={gamma} lam={lam}", gamma=gamma, lam=lam)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shift_mean", [True, False])
def test_gae_fused_whitening(shift_mean, dtype):
    inputs = gae_inputs(6, 333, seed=19, dtype=dtype)
    mask = ragged_mask(6, 333, seed=19, dtype=torch.float32)
    _check_gae(inputs, mask, f"whiten shift={shift_mean}", gamma=0.99, lam=0.95, whiten=True,
               shift_mean=shift_mean)


def test_gae_against_scalar_loop():
    """An independent reference: the recursion written token by token in Python floats (gaps skipped)."""
    inputs = gae_inputs(3, 12, seed=20, dtype=torch.float32)
    mask = ragged_mask(3, 12, seed=20, holes=True)
    gamma, lam = 0.9, 0.8
    adv, ret = ops.gae(inputs["rewards"], inputs["values"], mask, gamma=gamma, lam=lam)
    r, v, m = inputs["rewards"].tolist(), inputs["values"].tolist(), mask.tolist()
    for b in range(3):
        next_value, next_adv = 0.0, 0.0
        for t in reversed(range(12)):
            if m[b][t]:
                a = r[b][t] + gamma * next_value - v[b][t] + gamma * lam * next_adv
                want_adv, want_ret, next_value, next_adv = a, a + v[b][t], v[b][t], a
            else:  # a gap (tool tokens in a multi-turn row): 0 here, skipped by the recursion
                want_adv, want_ret = 0.0, 0.0
            assert adv[b, t].item() == pytest.approx(want_adv, abs=1e-5), (b, t)
            assert ret[b, t].item() == pytest.approx(want_ret, abs=1e-5), (b, t)


def test_gae_nan_in_padding_is_never_read():
    inputs = gae_inputs(4, 30, seed=21, dtype=torch.float32)
    mask = ragged_mask(4, 30, seed=21, holes=True)
    r = inputs["rewards"].masked_fill(~mask, float("nan"))
    v = inputs["values"].masked_fill(~mask, float("inf"))
    adv, ret = ops.gae(r, v, mask, gamma=0.99, lam=0.95, whiten=True)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()


def test_gae_is_not_differentiable():
    inputs = gae_inputs(2, 5, seed=22, dtype=torch.float32)
    values = inputs["values"].requires_grad_()
    mask = torch.ones(2, 5, dtype=torch.bool)
    adv, _ = ops.gae(inputs["rewards"], values, mask, gamma=1.0, lam=1.0)
    with pytest.raises(RuntimeError):
        adv.sum().backward()


# ---------------------------------------------------------------------------------------------
# Bad input: an error from the op that names the argument and the expected shape.

_X = torch.randn(4, 10)
_Y = torch.randint(0, 10, (4,))
_BT = torch.randn(3, 5)
_M = torch.ones(3, 5, dtype=torch.bool)
_ONES = torch.ones(4)


def _lpe(logits=_X, labels=_Y):
    return lambda: torch.ops.pfppo.logprob_entropy(logits, labels)


def _lpe_bwd(grad_logp=_ONES, row_max=_ONES):
    return lambda: torch.ops.pfppo.logprob_entropy_backward(
        grad_logp, _ONES, _X, _Y, row_max, _ONES, _ONES, 0
    )


def _partials(labels=_Y, vocab_start=0):
    return lambda: torch.ops.pfppo.logprob_entropy_partials(_X, labels, vocab_start)


def _loss(**over):
    args = dict(logp=_BT, old_logp=_BT, advantages=_BT, mask=_M, is_weights=None,
                clip_ratio_low=0.2, clip_ratio_high=0.2, dual_clip_c=None,
                loss_agg_mode="token-mean")
    args.update(over)
    return lambda: torch.ops.pfppo.policy_loss(*args.values())


def _gae(**over):
    args = dict(rewards=_BT, values=_BT, mask=_M, gamma=0.99, lam=0.95)
    args.update(over)
    return lambda: torch.ops.pfppo.gae(*args.values())


# name: (call, error type, message fragment)
BAD_INPUTS = {
    "logits 3-D": (_lpe(logits=_X[None]), ValueError, "logits must have shape [N, V]"),
    "logits fp64": (_lpe(logits=_X.double()), TypeError,
                    "logits [N, V] must be float32 or bfloat16"),
    "logits int": (_lpe(logits=_Y[:, None].expand(4, 3).contiguous()), TypeError,
                   "logits [N, V] must be float32 or bfloat16; got Long"),
    "logits transposed": (_lpe(logits=torch.randn(10, 4).t()), ValueError,
                          "logits [N, V] must be contiguous along V"),
    "labels rows": (_lpe(labels=_Y[:3]), ValueError, "labels must have shape [N] = [4]"),
    "labels int32": (_lpe(labels=_Y.int()), TypeError, "labels [N] must be int64"),
    "labels range": (_lpe(labels=torch.tensor([0, 1, 10, 2])), ValueError,
                     "labels[2] = 10 is outside [0, V) = [0, 10)"),
    "labels negative": (_lpe(labels=torch.tensor([0, -100, 1, 2])), ValueError,
                        "labels[1] = -100 is outside [0, V)"),
    "backward grad rows": (_lpe_bwd(grad_logp=torch.ones(3)), ValueError,
                           "grad_logp must have shape [N] = [4]"),
    "backward max dtype": (_lpe_bwd(row_max=_ONES.double()), TypeError,
                           "row_max [N] must be float32"),
    "partials negative label": (_partials(labels=torch.tensor([0, 1, -1, 2])), ValueError,
                                "labels[2] = -1 must be a vocabulary index >= 0"),
    "partials vocab_start": (_partials(vocab_start=-1), ValueError, "vocab_start must be >= 0"),
    "temperature zero": (lambda: torch.ops.pfppo.logprob_entropy(_X, _Y, 0.0, -1), ValueError,
                         "temperature=0 must be a finite number > 0"),
    "temperature inf": (lambda: torch.ops.pfppo.logprob_entropy(_X, _Y, float("inf"), -1), ValueError,
                        "temperature=inf must be a finite number > 0"),
    "vocab_size above V": (lambda: torch.ops.pfppo.logprob_entropy(_X, _Y, 1.0, 11), ValueError,
                           "vocab_size=11 must be in [1, V] = [1, 10]"),
    "vocab_size zero": (lambda: torch.ops.pfppo.logprob_entropy_partials(_X, _Y, 0, 1.0, 0), ValueError,
                        "vocab_size=0 must be >= 1, or -1"),
    "label in padding": (lambda: torch.ops.pfppo.logprob_entropy(_X, torch.tensor([0, 1, 8, 2]), 1.0, 8),
                         ValueError, "labels[2] = 8 is outside [0, vocab_size) = [0, 8)"),
    "shard label beyond vocab_size": (lambda: torch.ops.pfppo.logprob_entropy_partials(
        _X, torch.tensor([0, 1, 30, 2]), 10, 1.0, 30), ValueError, "labels[2] = 30 is outside [0, vocab_size)"),
    "logits V=0": (_lpe(logits=torch.zeros(4, 0)), ValueError, "logits [N, V] needs V >= 1"),
    "loss logp 1-D": (_loss(logp=_BT[0]), ValueError, "logp must have shape [B, T]"),
    "loss old_logp shape": (_loss(old_logp=_BT[:2]), ValueError,
                            "old_logp must have shape [B, T] = [3, 5] like logp; got [2, 5]"),
    "loss advantages dtype": (_loss(advantages=_BT.bfloat16()), TypeError,
                              "advantages [B, T] must have the dtype of logp"),
    "loss mask dtype": (_loss(mask=_M.long()), TypeError,
                        "mask [B, T] must be bool, float32 or bfloat16"),
    "loss logp strided": (_loss(logp=torch.randn(5, 3).t()), ValueError,
                          "logp [B, T] must be contiguous"),
    "loss is_weights shape": (_loss(is_weights=_BT[:, :4]), ValueError,
                              "is_weights must have shape [B, T] = [3, 5]"),
    "loss clip low": (_loss(clip_ratio_low=1.0), ValueError, "clip_ratio_low=1 must be in [0, 1)"),
    "loss dual clip": (_loss(dual_clip_c=0.5), ValueError, "dual_clip_c=0.5 must be > 1"),
    "loss agg mode": (_loss(loss_agg_mode="sum"), ValueError, "loss_agg_mode='sum' is not one of"),
    "gae values 3-D": (_gae(values=_BT[None]), ValueError, "values must have shape [B, T]"),
    "gae rewards dtype": (_gae(rewards=_BT.double()), TypeError,
                          "rewards [B, T] must have the dtype of values"),
    "gae mask shape": (_gae(mask=_M[:, :4]), ValueError, "mask must have shape [B, T] = [3, 5]"),
    "gae values fp16": (_gae(values=_BT.half(), rewards=_BT.half()), TypeError,
                        "values [B, T] must be float32 or bfloat16"),
    "gae gamma": (_gae(gamma=1.5), ValueError, "gamma=1.5 must be in [0, 1]"),
    "gae rewards strided": (_gae(rewards=torch.randn(5, 3).t()), ValueError,
                            "rewards [B, T] must be contiguous"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_names_argument_and_shape(case):
    call, error, fragment = BAD_INPUTS[case]
    with pytest.raises(error, match=re.escape(fragment)):
        call()


# ---------------------------------------------------------------------------------------------
# Registration: schema, fake (meta) implementation and autograd pass torch's checks.


def _opcheck_cases():
    x = logits(3, 40, seed=23, dtype=torch.float32).requires_grad_()
    y = labels_for(x.detach(), seed=23)
    inputs = policy_inputs(3, 9, seed=23, dtype=torch.float32)
    mask = ragged_mask(3, 9, seed=23)
    g = gae_inputs(3, 9, seed=23, dtype=torch.float32)
    logp = inputs["logp"].clone().requires_grad_()
    return {
        "logprob_entropy": (torch.ops.pfppo.logprob_entropy.default, (x, y)),
        "logprob_entropy_partials": (
            torch.ops.pfppo.logprob_entropy_partials.default, (x.detach(), torch.clamp(y, max=34), 0, 0.8, 35)
        ),
        "logprob_entropy_tempered": (
            torch.ops.pfppo.logprob_entropy.default, (x, torch.clamp(y, max=34), 0.8, 35)
        ),
        "policy_loss": (
            torch.ops.pfppo.policy_loss.default,
            (logp, inputs["old_logp"], inputs["advantages"], mask, None, 0.2, 0.2, 3.0,
             "token-mean"),
        ),
        "gae": (
            torch.ops.pfppo.gae.default,
            (g["rewards"], g["values"], mask, 0.99, 0.95, True, True, 0),
        ),
    }


@pytest.mark.parametrize(
    "name", ["logprob_entropy", "logprob_entropy_tempered", "logprob_entropy_partials", "policy_loss", "gae"]
)
def test_opcheck(name):
    op, args = _opcheck_cases()[name]
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(op, args, test_utils=checks)


def test_ops_compile_fullgraph():
    """torch.compile traces through the ops (fake implementations, autograd) without breaks."""
    inputs = policy_inputs(4, 33, seed=24, dtype=torch.float32)
    mask = ragged_mask(4, 33, seed=24)

    def loss(logp):
        out = ops.policy_loss(logp, inputs["old_logp"], inputs["advantages"], mask,
                              clip_ratio_low=0.2, clip_ratio_high=0.2, dual_clip_c=3.0)
        return 2.0 * out.loss

    grads = []
    for fn in (torch.compile(loss, fullgraph=True), loss):
        logp = inputs["logp"].clone().requires_grad_()
        fn(logp).backward()
        grads.append(logp.grad)
    assert torch.equal(grads[0], grads[1])


# ---------------------------------------------------------------------------------------------
# One table of modes per fused op (csrc/<op>.h) for Python, the CPU and the CUDA sources.

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(rel: str) -> str:
    with open(os.path.join(_ROOT, rel)) as f:
        return f.read()


# op: its header, the X-macro of its table, the enum, the shared functions that switch on the
# mode (each needs a case per row), Python's table (from the extension) and Python's own
# knowledge of each row (what the reference / autograd does with it), and a probe expression
# that calls the shared switches for mode k (host and device; `buf` is a float[4]).
_TABLES = {
    "policy_loss": dict(
        header="csrc/policy_loss.h", macro="PFPPO_POLICY_LOSS_AGG_MODES", enum="AggMode",
        switches=["agg_scale"], python=lambda: ops.POLICY_LOSS_AGG_MODES,
        known=lambda: KERNEL_LOSS_AGG_MODES,
        probe="pfppo::agg_scale(static_cast<pfppo::AggMode>(k), 2, 10, 3)",
        calls=["agg_scale(", "ppo_token(", "clamp_log_ratio(", "k3_term("]),
    "gae": dict(
        header="csrc/gae.h", macro="PFPPO_GAE_WHITEN_MODES", enum="GaeWhiten",
        switches=["whitens", "whiten_scale"], python=lambda: ops.GAE_WHITEN_MODES,
        known=lambda: tuple(ops.GAE_WHITEN_FLAGS),
        probe="double(pfppo::whiten_scale(static_cast<pfppo::GaeWhiten>(k), 3.0, 1.0, 2.0).rstd)"
              " + pfppo::whitens(static_cast<pfppo::GaeWhiten>(k))",
        calls=["whitens(", "whiten_scale(", "whiten_token(", "gae_delta(", "gae_advantage(",
               "gae_return("]),
    "logprob_entropy": dict(
        header="csrc/logprob_entropy.h", macro="PFPPO_LOGPROB_MODES", enum="LogProbMode",
        switches=["with_logprob_mode", "write_row"], python=lambda: ops.LOGPROB_MODES,
        known=lambda: tuple(ops._LOGPROB_AUTOGRAD),
        probe="(pfppo::write_row(static_cast<pfppo::LogProbMode>(k), "
              "pfppo::LogProbRows{{buf, buf + 1, buf + 2, buf + 3}}, 0, 1.0f, 2.0f, 0.5f, true, "
              "0.25f), double(buf[0]))",
        calls=["write_row(", "rescale_sums(", "softmax_logp(", "softmax_grad("]),
}
_DEVICES = {"cpu": "csrc/cpu/{op}.cpp", "cuda": "csrc/cuda/{op}.cu"}


def _header_table(op: str) -> list[tuple[str, str]]:
    t = _TABLES[op]
    text = _read(t["header"])
    block = text[text.index(f"#define {t['macro']}(X)"):]
    block = block[: block.index("\n\n")]
    return re.findall(r'X\((k\w+), "([^"]+)"\)', block)


def _function_body(text: str, name: str) -> str:
    start = re.search(rf"^(?:template <[^>]*>\n)?(?:PFPPO_HD |auto )[^\n]*\b{name}\(", text, re.M)
    assert start, f"{name} not found"
    body = text[start.start():]
    return body[: body.index("\n}\n")]


@pytest.mark.parametrize("op", list(_TABLES))
def test_mode_table_is_one_for_python_and_both_devices(op):
    """Python's modes are the extension's (built from the header's table) and Python knows each
    row; every shared switch of the header has a case per row; both device kernels include the
    header, call its shared math, and neither lists or branches on modes of its own."""
    t = _TABLES[op]
    table = _header_table(op)
    names = tuple(name for _, name in table)
    assert len(names) >= 2, f"{op}: {t['macro']} not parsed from {t['header']}"
    assert t["python"]() == names, f"{op}: pfppo_mega._C's table differs from {t['header']}"
    assert tuple(t["known"]()) == names, f"{op}: Python lacks (or adds) a mode of {t['macro']}"
    header = _read(t["header"])
    for fn in t["switches"]:
        body = _function_body(header, fn)
        for ident, _ in table:
            assert f"case {t['enum']}::{ident}:" in body, f"{op}: {fn} has no case for {ident}"
    for device, pattern in _DEVICES.items():
        src = pattern.format(op=op)
        text = _read(src)
        assert f'#include "../{os.path.basename(t["header"])}"' in text, src
        for call in t["calls"]:
            assert call in text, f"{src} does not call the shared {call[:-1]} ({t['header']})"
        assert f"{t['enum']}::" not in text, f"{src} branches on {t['enum']} itself"
        assert not any(f'"{name}"' in text for name in names), f"{src} spells a mode name"


@pytest.mark.parametrize("mode", ops.GAE_WHITEN_MODES or ["(not built)"])
def test_gae_every_whiten_mode_matches_reference(mode):
    """Every row of the extension's GAE table runs on the CPU kernel and matches the reference
    with the row's (whiten, shift_mean)."""
    whiten, shift_mean = ops.GAE_WHITEN_FLAGS[mode]
    g = gae_inputs(5, 40, seed=31, dtype=torch.float32)
    mask = ragged_mask(5, 40, seed=31, holes=True)
    adv, ret = ops.gae(g["rewards"], g["values"], mask, gamma=0.99, lam=0.95, whiten=whiten,
                       shift_mean=shift_mean)
    r64, v64 = g["rewards"].double(), g["values"].double()
    adv64, ret64 = ppo.compute_gae(r64, v64, mask, gamma=0.99, lam=0.95)
    if whiten:
        adv64 = ppo.masked_whiten(adv64, mask, shift_mean=shift_mean)
    adv32, ret32 = ppo.compute_gae(g["rewards"], g["values"], mask, gamma=0.99, lam=0.95)
    if whiten:
        adv32 = ppo.masked_whiten(adv32, mask, shift_mean=shift_mean)
    assert_within_torch_error(f"gae {mode} advantages", adv, adv32, adv64)
    assert_within_torch_error(f"gae {mode} returns", ret, ret32, ret64)


@pytest.mark.parametrize("op", ops.LOGPROB_MODES or ["(not built)"])
def test_logprob_every_mode_is_registered(op):
    """Every forward of the log-prob table is a registered op with a fake and an autograd."""
    x = logits(3, 40, seed=23, dtype=torch.float32)
    y = labels_for(x, seed=23)
    args = (x, y) if op == "logprob_entropy" else (x, y, 0)
    out = getattr(torch.ops.pfppo, op)(*args)
    assert len(out) == 4 and all(o.shape == (3,) and o.dtype == torch.float32 for o in out)
    torch.library.opcheck(getattr(torch.ops.pfppo, op).default, args,
                          test_utils=("test_schema", "test_faketensor"))


def test_policy_loss_options_from_schema():
    """The keyword list is the C++ schema's; the wrapper names a keyword it does not know."""
    assert ops.POLICY_LOSS_OPTIONS == (
        "is_weights", "clip_ratio_low", "clip_ratio_high", "dual_clip_c", "loss_agg_mode")
    x = policy_inputs(2, 5, seed=1, dtype=torch.float32)
    mask = torch.ones(2, 5, dtype=torch.bool)
    with pytest.raises(TypeError, match="clip_ratio"):
        ops.policy_loss(x["logp"], x["old_logp"], x["advantages"], mask, clip_ratio=0.2)
    with pytest.raises(ValueError, match="is not one of"):
        ops.policy_loss(x["logp"], x["old_logp"], x["advantages"], mask, clip_ratio_low=0.2,
                        clip_ratio_high=0.2, loss_agg_mode="seq-sum")


def _compile_probe(op: str, compiler: list[str], header_dir: str, tmp_path,
                   suffix: str) -> subprocess.CompletedProcess:
    t = _TABLES[op]
    n = len(t["python"]())
    header = os.path.basename(t["header"])
    kernel = (
        "__global__ void probe(double* out) { float buf[4] = {}; const int k = threadIdx.x; "
        f"out[k] = {t['probe']}; }}\n" if suffix == ".cu" else "")
    probe = tmp_path / f"probe_{op}{suffix}"
    probe.write_text(
        f'#include "{header}"\n'
        f"static_assert(sizeof(pfppo::{_names_array(op)}) / sizeof(const char*) == {n}, "
        '"the C++ table and Python differ");\n'
        + kernel
        + f"double host(int k) {{ float buf[4] = {{}}; return {t['probe']}; }}\n")
    return subprocess.run(compiler + [f"-I{header_dir}", f"-I{os.path.join(_ROOT, 'csrc')}",
                                      "-c", str(probe), "-o", str(tmp_path / "probe.o")],
                          capture_output=True, text=True, timeout=120)


def _names_array(op: str) -> str:
    text = _read(_TABLES[op]["header"])
    return re.search(rf"constexpr const char\* (k\w+)\[\] = \{{{_TABLES[op]['macro']}\(", text).group(1)


@pytest.mark.parametrize("suffix", [".cpp", ".cu"])
@pytest.mark.parametrize("op", list(_TABLES))
def test_mode_table_compiles_per_backend(op, suffix, tmp_path):
    """Each op's table compiles for each backend with Python's mode count; a row added without
    its cases fails the build (-Werror=switch, as build_ext.py builds) -- for nvcc too,
    compiled here for sm_90."""
    if suffix == ".cu":
        if shutil.which("nvcc") is None:
            pytest.skip("nvcc not on PATH: the CUDA side of the table cannot be compiled here")
        cc = ["nvcc", "-arch=sm_90", "-std=c++17", "-Xcompiler", "-Wall,-Werror=switch"]
    else:
        cc = ["g++", "-std=c++17", "-Wall", "-Werror=switch"]
    if not _TABLES[op]["python"]():
        pytest.skip("pfppo_mega._C is not built: no Python table to compare with")
    ok = _compile_probe(op, cc, os.path.join(_ROOT, "csrc"), tmp_path, suffix)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    # One more row without its cases: every backend's build must fail.
    broken = tmp_path / "broken"
    broken.mkdir()
    header = _TABLES[op]["header"]
    last_id, last_name = _header_table(op)[-1]
    row = f'X({last_id}, "{last_name}")'
    text = _read(header).replace(row, row + ' \\\n  X(kNewMode, "new-mode")', 1)
    assert "kNewMode" in text
    (broken / os.path.basename(header)).write_text(text)
    (broken / "kernel_types.h").write_text(_read("csrc/kernel_types.h"))
    bad = _compile_probe(op, cc, str(broken), tmp_path, suffix)
    assert bad.returncode != 0, f"{op}: a mode without its cases compiled"
