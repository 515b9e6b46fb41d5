"""CUDA kernels: always compiled with nvcc here (sm_90, compile only); run where a GPU is.

On a machine without a GPU the runtime tests skip with the reason printed (pytest -rs); the
compile test runs wherever nvcc is installed. scripts/gpu_kernels_check.sh runs this file and
the GPU benchmark on a GPU machine.
"""

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from pfppo_mega import ppo
from pfppo_mega.kernels import ops
from pfppo_mega.kernels.backends import FusedBackend
from pfppo_mega.kernels.testing import (
    assert_within_torch_error,
    gae_inputs,
    labels_for,
    logits,
    policy_inputs,
    ragged_mask,
)

ROOT = Path(__file__).resolve().parents[1]
HAS_GPU = torch.cuda.is_available() and ops.has_cuda()
GPU_REASON = (
    "no CUDA device" if not torch.cuda.is_available()
    else "pfppo_mega._C built without CUDA kernels (PFPPO_BUILD_CUDA=1 on a CUDA torch)"
)
gpu = pytest.mark.skipif(not HAS_GPU, reason=GPU_REASON)
DTYPES = [torch.float32, torch.bfloat16]


def test_cuda_sources_compile():
    """Every .cu compiles with nvcc for sm_90, and the host wrappers' CUDA paths compile
    (syntax: csrc/ops.cpp, which holds every op header's host part, and csrc/api.cpp, with
    PFPPO_WITH_CUDA)."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not on PATH: the CUDA sources cannot be compiled here")
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "check_cuda_compile.sh")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("  ok ") == len(list((ROOT / "csrc" / "cuda").glob("*.cu"))) + 2


# ---------------------------------------------------------------------------------------------
# Runtime (GPU only): the CUDA ops against torch on the same GPU at the same dtype and fp64.


def _lpe_run(fn, x, labels, upstream):
    x = x.detach().clone().requires_grad_()
    logp, ent = fn(x, labels)
    (logp.double() * upstream[0] + ent.double() * upstream[1]).sum().backward()
    return logp.detach(), ent.detach(), x.grad


def _torch_lpe(x, labels):
    return ppo.logprobs_from_logits(x, labels), ppo.entropy_from_logits(x)


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,vocab,pad", [(4, 152064, 0), (3, 1001, 0), (5, 2048, 8), (1, 1, 0)], ids=str)
def test_cuda_logprob_entropy(rows, vocab, pad, dtype):
    """Aligned rows take 16-byte loads; V = 1001 or padded rows take the scalar path."""
    wide = logits(rows, vocab + pad, seed=50, dtype=dtype).cuda()
    x = wide[:, :vocab]
    labels = labels_for(x.cpu().contiguous(), seed=50).cuda()
    g = torch.Generator().manual_seed(51)
    upstream = tuple(torch.randn(rows, generator=g, dtype=torch.float64).cuda() for _ in range(2))
    got = _lpe_run(ops.logprob_entropy, x, labels, upstream)
    same = _lpe_run(_torch_lpe, x, labels, upstream)
    exact = _lpe_run(_torch_lpe, x.double(), labels, upstream)
    for name, k, t, r in zip(("logp", "entropy", "grad"), got, same, exact):
        assert_within_torch_error(f"cuda {name}", k, t, r)


@gpu
def test_cuda_vocab_partials_combine_to_full():
    x = logits(6, 3000, seed=52, dtype=torch.float32).cuda()
    labels = labels_for(x.cpu(), seed=52).cuda()
    combined = ops.combine_partials([
        ops.logprob_entropy_partials(x[:, :1200], labels, 0),
        ops.logprob_entropy_partials(x[:, 1200:], labels, 1200),
    ])
    full = ops.logprob_entropy(x, labels)
    torch.testing.assert_close(combined.logp, full[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(combined.entropy, full[1], rtol=0, atol=1e-5)


@gpu
def test_cuda_bad_label_gives_nan_and_devices_are_checked():
    x = logits(3, 10, seed=53, dtype=torch.float32).cuda()
    logp, _ = ops.logprob_entropy(x, torch.tensor([0, 10, 1], device="cuda"))
    assert torch.isnan(logp[1]) and torch.isfinite(logp[[0, 2]]).all()
    with pytest.raises(ValueError, match="labels \\[N\\] is on cpu but logits is on cuda"):
        torch.ops.pfppo.logprob_entropy(x, torch.tensor([0, 1, 2]))


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dual_clip_c", [None, 3.0], ids=["no_dual", "dual3"])
@pytest.mark.parametrize("mode", ppo.LOSS_AGG_MODES)
def test_cuda_policy_loss(mode, dual_clip_c, dtype):
    inputs = {k: v.cuda() for k, v in policy_inputs(6, 2500, seed=54, dtype=dtype).items()}
    mask = ragged_mask(6, 2500, seed=54).cuda()

    def run(fn, dt):
        logp = inputs["logp"].to(dt).clone().requires_grad_()
        out = fn(logp, inputs["old_logp"].to(dt), inputs["advantages"].to(dt), mask,
                 clip_ratio_low=0.2, clip_ratio_high=0.28, dual_clip_c=dual_clip_c,
                 loss_agg_mode=mode, is_weights=inputs["is_weights"].to(dt))
        out.loss.backward()
        return out, logp.grad

    # through the backend the trainer calls: it maps seq-mean-token-sum-norm onto the op's own
    # seq-mean-token-sum (the op takes 3 modes; calling it with the 4th is refused by name)
    k_out, k_grad = run(FusedBackend().policy_loss, dtype)
    t_out, t_grad = run(ppo.policy_loss, dtype)
    r_out, r_grad = run(ppo.policy_loss, torch.float64)
    for name in ("loss", "pg_clipfrac", "pg_clipfrac_lower", "approx_kl", "is_weight_mean"):
        assert_within_torch_error(f"cuda {mode} {name}", getattr(k_out, name),
                                  getattr(t_out, name), getattr(r_out, name))
    assert_within_torch_error(f"cuda {mode} grad", k_grad, t_grad, r_grad)


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "rows,cols,row_chunks,mode",
    [(3, 5000, 0, "none"), (3, 5000, 1, "whiten"), (300, 700, 0, "whiten"), (2, 1, 0, "none"),
     (4, 9000, 5, "none"), (5, 4099, 3, "whiten"),  # T not a multiple of the 16-byte span
     *[(3, 5000, 0, m) for m in ops.GAE_WHITEN_MODES]],  # every row of the op's table
    ids=str,
)
def test_cuda_gae(rows, cols, row_chunks, mode, dtype):
    """3 x 5000: few rows, so rows are cut into pieces (chunked scan) unless row_chunks=1."""
    whiten, shift_mean = ops.GAE_WHITEN_FLAGS[mode]
    g = {k: v.cuda() for k, v in gae_inputs(rows, cols, seed=55, dtype=dtype).items()}
    mask = ragged_mask(rows, cols, seed=55, holes=True).cuda()

    def reference(r, v):
        adv, ret = ppo.compute_gae(r, v, mask, gamma=0.99, lam=0.95)
        return (ppo.masked_whiten(adv, mask, shift_mean=shift_mean) if whiten else adv), ret

    k = ops.gae(g["rewards"], g["values"], mask, gamma=0.99, lam=0.95, whiten=whiten,
                shift_mean=shift_mean, row_chunks=row_chunks)
    t = reference(g["rewards"], g["values"])
    r = reference(g["rewards"].double(), g["values"].double())
    for name, kk, tt, rr in zip(("advantages", "returns"), k, t, r):
        assert_within_torch_error(f"cuda gae {name}", kk, tt, rr)


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("vocab,padded", [(1000, 1024), (2049, 4096), (4096, 4096)], ids=str)
def test_cuda_temperature_and_padding(vocab, padded, dtype):
    """The full op and the shard ops with temperature 0.7 and padding columns (huge logits that
    must not count; gradient exactly 0), vs torch on x[:, :vocab] / T; and empty batches."""
    x = logits(6, padded, seed=vocab, dtype=dtype).cuda()
    x[:, vocab:] = 1e4
    labels = labels_for(x[:, :vocab].cpu(), seed=57).cuda()
    g = torch.Generator().manual_seed(58)
    upstream = (torch.randn(6, generator=g, dtype=torch.float64).cuda(),
                torch.randn(6, generator=g, dtype=torch.float64).cuda())

    def tempered(a, y):
        a = a[:, :vocab] / 0.7
        return _torch_lpe(a, y)

    k = _lpe_run(lambda a, y: ops.logprob_entropy(a, y, temperature=0.7, vocab_size=vocab), x, labels, upstream)
    t = _lpe_run(tempered, x, labels, upstream)
    r = _lpe_run(tempered, x.double(), labels, upstream)
    for name, kk, tt, rr in zip(("logp", "entropy"), k, t, r):
        assert_within_torch_error(f"cuda tempered {name}", kk, tt, rr)
    assert_within_torch_error("cuda tempered grad", k[2][:, :vocab], t[2][:, :vocab], r[2][:, :vocab])
    assert torch.count_nonzero(k[2][:, vocab:]) == 0
    opts = dict(temperature=0.7, vocab_size=vocab)
    half = padded // 2
    combined = ops.combine_partials([ops.logprob_entropy_partials(x[:, :half].contiguous(), labels, 0, **opts),
                                     ops.logprob_entropy_partials(x[:, half:].contiguous(), labels, half, **opts)])
    assert_within_torch_error("cuda tempered combined logp", combined.logp, t[0], r[0])
    empty = ops.logprob_entropy(x[:0], labels[:0], temperature=0.7, vocab_size=vocab)
    assert empty[0].shape == (0,)
    for b, t_ in ((0, 5), (3, 0)):
        z = torch.zeros(b, t_, device="cuda")
        adv, ret = ops.gae(z, z, z.bool(), gamma=1.0, lam=0.9, whiten=True)
        assert adv.shape == ret.shape == (b, t_)


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_logprob_split_rows_match_whole_rows(dtype):
    """Few rows split each row across blocks (then a combine pass); a batch of many rows does
    not: both give the same values within fp32 summation-order noise, and both the rule."""
    rows, vocab = 1200, 20000  # >= 4 blocks per SM on an H100 / H200: no split
    x = logits(rows, vocab, seed=60, dtype=dtype, device="cuda")
    labels = labels_for(x, seed=60)
    whole = ops.logprob_entropy(x, labels)
    few = ops.logprob_entropy(x[:3], labels[:3])  # 3 rows: split
    ref = (ppo.logprobs_from_logits(x[:3].double(), labels[:3]), ppo.entropy_from_logits(x[:3].double()))
    same = (ppo.logprobs_from_logits(x[:3], labels[:3]), ppo.entropy_from_logits(x[:3]))
    for name, w, f, t, r in zip(("logp", "entropy"), whole, few, same, ref):
        torch.testing.assert_close(f, w[:3], rtol=0, atol=2e-5)
        assert_within_torch_error(f"cuda split {name}", f, t, r)


@gpu
@pytest.mark.parametrize("cols", [1001, 4096], ids=str)
def test_cuda_policy_loss_matches_cpu_kernel(cols):
    """Both devices run csrc/policy_loss.h's math: per-token gradients agree to fp32 rounding
    (exp and the summation order differ), with odd rows taking the scalar path."""
    inputs = policy_inputs(7, cols, seed=61, dtype=torch.float32)
    mask = ragged_mask(7, cols, seed=61, holes=True)
    opts = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, dual_clip_c=3.0,
                loss_agg_mode="seq-mean-token-mean")
    args = (inputs["logp"], inputs["old_logp"], inputs["advantages"], mask)
    cpu = ops.policy_loss(*args, is_weights=inputs["is_weights"], **opts)
    gpu_out = ops.policy_loss(*(a.cuda() for a in args), is_weights=inputs["is_weights"].cuda(), **opts)
    torch.testing.assert_close(gpu_out.grad_logp.cpu(), cpu.grad_logp, rtol=1e-6, atol=1e-9)
    for name in ("loss", "pg_clipfrac", "pg_clipfrac_lower", "approx_kl", "is_weight_mean"):
        torch.testing.assert_close(getattr(gpu_out, name).cpu(), getattr(cpu, name), rtol=1e-5, atol=1e-7)


@gpu
def test_cuda_matches_cpu_kernels():
    """The same inputs give the CPU kernels' results (different summation orders only)."""
    x = logits(8, 5000, seed=56, dtype=torch.float32)
    labels = labels_for(x, seed=56)
    cpu = ops.logprob_entropy(x, labels)
    gpu_out = ops.logprob_entropy(x.cuda(), labels.cuda())
    torch.testing.assert_close(gpu_out[0].cpu(), cpu[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(gpu_out[1].cpu(), cpu[1], rtol=0, atol=1e-5)
