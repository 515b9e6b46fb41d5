"""Adversarial inputs for every kernel entry of every backend: empty and degenerate shapes
(B = 0, T = 0, N = 0, V = 0, V = 1, one row, one token, all masked), stride-0 (expanded) and
non-contiguous inputs, mismatched shapes, bad scalars.

Each case runs in a child process (`python this_file BACKEND`), one per backend, that prints
`CASE <name> OK` or `CASE <name> FAIL <why>` after each case: a kernel that kills its process
(SIGFPE on an empty batch before the fix) fails the case it died in, and the ones after it,
instead of killing pytest. Results on empty inputs must equal the pure-torch reference's (empty
outputs, zero loss); bad input must raise an error that names the argument and spells the
expected shape.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

F32 = torch.float32


def _close(got: torch.Tensor, want: torch.Tensor, tol: float = 2e-6) -> None:
    assert got.shape == want.shape, f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"dtype {got.dtype} != {want.dtype}"
    if want.numel():
        diff = (got.double() - want.double()).abs().max().item()
        assert diff <= tol, f"max |diff| {diff:.3e} > {tol}"


def _raises(fn, error, *fragments: str) -> None:
    try:
        fn()
    except error as e:
        for fragment in fragments:
            assert fragment in str(e), f"message {str(e)!r} lacks {fragment!r}"
        return
    except Exception as e:  # noqa: BLE001 - a different error is the failure being tested
        raise AssertionError(f"expected {error.__name__}, got {type(e).__name__}: {e}") from e
    raise AssertionError(f"expected {error.__name__}, nothing raised")


def _logprob_with_grad(backend, x, labels, **kw):
    x = x.detach().clone().requires_grad_()
    logp, ent = backend.logprob_entropy(x, labels, **kw)
    (logp.sum() + 0.5 * ent.sum()).backward()
    return logp.detach(), ent.detach(), x.grad


def _loss_with_grad(backend, logp, old, adv, mask, **kw):
    logp = logp.detach().clone().requires_grad_()
    out = backend.policy_loss(logp, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28, **kw)
    out.loss.backward()
    return out, logp.grad


def cases(backend) -> dict:
    """name -> zero-argument check of `backend` (raises AssertionError on a wrong outcome)."""
    from pfppo_mega.kernels import TorchBackend, vocab_parallel_logprob_entropy

    ref = TorchBackend()
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g)

    bt = rand(3, 4)

    def gae_case(b, t, *, whiten, mask=None):
        def run():
            r, v = rand(b, t), rand(b, t)
            m = torch.ones(b, t) if mask is None else mask
            got = backend.gae(r, v, m, gamma=0.99, lam=0.95, whiten=whiten)
            want = ref.gae(r.double(), v.double(), m, gamma=0.99, lam=0.95, whiten=whiten)
            for k, w in zip(got, want):
                _close(k, w.float(), tol=1e-5)
        return run

    def logprob_case(x, labels, **kw):
        def run():
            got = _logprob_with_grad(backend, x, labels, **kw)
            want = _logprob_with_grad(ref, x.double(), labels, **kw)
            for k, w in zip(got, want):
                _close(k, w.float())
        return run

    def loss_case(b, t, mask=None, **kw):
        def run():
            logp, old, adv = rand(b, t), rand(b, t), rand(b, t)
            m = torch.ones(b, t) if mask is None else mask
            out, grad = _loss_with_grad(backend, logp, old, adv, m, **kw)
            ref_out, ref_grad = _loss_with_grad(ref, logp.double(), old.double(), adv.double(), m, **kw)
            for f in ("loss", "pg_clipfrac", "pg_clipfrac_lower", "approx_kl", "is_weight_mean"):
                _close(getattr(out, f), getattr(ref_out, f).float(), tol=1e-5)
            _close(grad, ref_grad.float())
        return run

    def vocab_parallel_empty():
        x = torch.zeros(0, 5, requires_grad=True)
        labels = torch.zeros(0, dtype=torch.long)
        # vocab_start 5 of vocab_size 7: a shard, so the partials path (not the full op) runs.
        logp, ent = vocab_parallel_logprob_entropy(x, labels, vocab_start=5, vocab_size=7, group=None,
                                                   backend=backend)
        (logp.sum() + ent.sum()).backward()
        assert logp.shape == ent.shape == (0,) and x.grad.shape == (0, 5)

    def shard_of_only_padding():
        # Global columns 5..9 of a vocabulary of 5: all padding. The partials say "no mass".
        p = backend.logprob_entropy_partials(rand(3, 4), torch.tensor([0, 1, 4]), vocab_start=5,
                                             vocab_size=5, temperature=1.0)
        assert torch.equal(p.sumexp, torch.zeros(3)) and torch.equal(p.target, torch.zeros(3))
        assert bool((p.max == float("-inf")).all())

    def loss_stride0():
        adv, w, m = rand(1, 4).expand(3, 4), torch.full((), 0.5).expand(3, 4), torch.ones(1, 4).expand(3, 4)
        old = bt * 0.9
        got = backend.policy_loss(bt, old, adv, m, clip_ratio_low=0.2, clip_ratio_high=0.2, is_weights=w)
        want = ref.policy_loss(bt.double(), old.double(), adv.double().contiguous(), m.contiguous(),
                               clip_ratio_low=0.2, clip_ratio_high=0.2, is_weights=w.double().contiguous())
        _close(got.loss, want.loss.float(), tol=1e-5)

    x7 = rand(4, 7)
    lab4 = torch.tensor([0, 3, 6, 2])
    return {
        # Empty and degenerate shapes: the reference's result.
        "gae_B0": gae_case(0, 5, whiten=False),
        "gae_B0_whiten": gae_case(0, 5, whiten=True),
        "gae_T0": gae_case(3, 0, whiten=False),
        "gae_T0_whiten": gae_case(3, 0, whiten=True),
        "gae_one_token_whiten": gae_case(1, 1, whiten=True),
        "gae_all_masked_whiten": gae_case(2, 6, whiten=True, mask=torch.zeros(2, 6)),
        "logprob_N0": logprob_case(torch.zeros(0, 7), torch.zeros(0, dtype=torch.long)),
        "logprob_B0_T3": logprob_case(torch.zeros(0, 3, 7), torch.zeros(0, 3, dtype=torch.long)),
        "logprob_T0": logprob_case(torch.zeros(2, 0, 7), torch.zeros(2, 0, dtype=torch.long)),
        "logprob_V1": logprob_case(rand(3, 1), torch.zeros(3, dtype=torch.long)),
        "logprob_one_row": logprob_case(rand(1, 9), torch.tensor([8])),
        "logprob_V0": lambda: _raises(lambda: backend.logprob_entropy(torch.zeros(3, 0),
                                                                      torch.zeros(3, dtype=torch.long)),
                                      ValueError, "[..., V] with V >= 1", "(3, 0)"),
        "logprob_N0_V0": lambda: _raises(lambda: backend.logprob_entropy(torch.zeros(0, 0),
                                                                         torch.zeros(0, dtype=torch.long)),
                                         ValueError, "V >= 1"),
        "loss_B0": loss_case(0, 5),
        "loss_T0": loss_case(3, 0),
        "loss_all_masked_seq_mean": loss_case(3, 4, mask=torch.zeros(3, 4),
                                              loss_agg_mode="seq-mean-token-mean"),
        "loss_one_token": loss_case(1, 1, dual_clip_c=3.0),
        "vocab_parallel_N0": vocab_parallel_empty,
        "shard_of_only_padding": shard_of_only_padding,
        # Strides: made contiguous as documented, same result as the contiguous input.
        "logprob_stride0_rows": logprob_case(rand(1, 7).expand(4, 7), lab4),
        "logprob_stride0_vocab": logprob_case(rand(4, 1).expand(4, 7), lab4),
        "logprob_transposed": logprob_case(rand(7, 4).t(), lab4),
        "logprob_stride0_labels_int32": logprob_case(x7, torch.tensor([3], dtype=torch.int32).expand(4)),
        "logprob_padding_and_temperature": logprob_case(rand(4, 9), lab4, temperature=0.6, vocab_size=7),
        "gae_stride0_rewards": lambda: _close(
            backend.gae(bt[:1].expand(3, 4), bt, torch.ones(3, 4), gamma=1.0, lam=0.9)[0],
            ref.gae(bt[:1].expand(3, 4).contiguous().double(), bt.double(), torch.ones(3, 4), gamma=1.0,
                    lam=0.9)[0].float(), tol=1e-5),
        "gae_stride0_mask_transposed_values": lambda: _close(
            backend.gae(bt, bt.t().contiguous().t(), torch.ones(()).expand(3, 4), gamma=1.0, lam=0.9)[1],
            ref.gae(bt.double(), bt.double(), torch.ones(3, 4), gamma=1.0, lam=0.9)[1].float(), tol=1e-5),
        "loss_stride0_advantages_weights_mask": loss_stride0,
        # Bad input: a named error that spells the expected shape, the same on every backend.
        "logprob_labels_shape": lambda: _raises(lambda: backend.logprob_entropy(x7, lab4[:3]), ValueError,
                                                "labels.shape=(3,) must equal logits.shape[:-1]=(4,)"),
        "logprob_label_out_of_range": lambda: _raises(
            lambda: backend.logprob_entropy(x7, torch.tensor([0, 1, 7, 2])), ValueError, "7", "[0, 7)"),
        "logprob_label_in_padding": lambda: _raises(
            lambda: backend.logprob_entropy(x7, torch.tensor([0, 1, 6, 2]), vocab_size=6), ValueError,
            "6", "[0, 6)"),
        "logprob_float_labels": lambda: _raises(lambda: backend.logprob_entropy(x7, lab4.float()), TypeError,
                                                "labels must be an integer tensor"),
        "logprob_temperature_zero": lambda: _raises(lambda: backend.logprob_entropy(x7, lab4, temperature=0.0),
                                                    ValueError, "temperature=0.0 must be a finite number > 0"),
        "logprob_temperature_nan": lambda: _raises(
            lambda: backend.logprob_entropy(x7, lab4, temperature=float("nan")), ValueError, "temperature=nan"),
        "logprob_vocab_size_too_big": lambda: _raises(
            lambda: backend.logprob_entropy(x7, lab4, vocab_size=8), ValueError, "vocab_size=8 must be in [1, V]"),
        "loss_shape_mismatch": lambda: _raises(
            lambda: backend.policy_loss(bt, bt[:2], bt, torch.ones(3, 4), clip_ratio_low=0.2, clip_ratio_high=0.2),
            ValueError, "old_logp must have shape [B, T] = [3, 4] like logp; got [2, 4]"),
        "loss_1d": lambda: _raises(
            lambda: backend.policy_loss(bt[0], bt[0], bt[0], torch.ones(4), clip_ratio_low=0.2,
                                        clip_ratio_high=0.2),
            ValueError, "logp must have shape [B, T] (2-D); got (4,)"),
        "loss_3d": lambda: _raises(
            lambda: backend.policy_loss(bt[None], bt[None], bt[None], torch.ones(1, 3, 4), clip_ratio_low=0.2,
                                        clip_ratio_high=0.2),
            ValueError, "logp must have shape [B, T] (2-D); got (1, 3, 4)"),
        "loss_is_weights_shape": lambda: _raises(
            lambda: backend.policy_loss(bt, bt, bt, torch.ones(3, 4), clip_ratio_low=0.2, clip_ratio_high=0.2,
                                        is_weights=torch.ones(3, 5)),
            ValueError, "is_weights must have shape [B, T] = [3, 4] like logp; got [3, 5]"),
        "gae_shape_mismatch": lambda: _raises(
            lambda: backend.gae(bt[:, :3], bt, torch.ones(3, 4), gamma=1.0, lam=1.0), ValueError,
            "rewards must have shape [B, T] = [3, 4] like values; got [3, 3]"),
        "gae_1d": lambda: _raises(lambda: backend.gae(bt[0], bt[0], torch.ones(4), gamma=1.0, lam=1.0),
                                  ValueError, "values must have shape [B, T] (2-D); got (4,)"),
        "vocab_parallel_labels_shape": lambda: _raises(
            lambda: vocab_parallel_logprob_entropy(x7, lab4[:2], vocab_start=0, vocab_size=7, group=None,
                                                   backend=backend),
            ValueError, "labels must have shape [N] = [4]"),
    }


def main(backend_name: str) -> None:
    from pfppo_mega.kernels import get_backend

    torch.set_num_threads(1)
    backend = get_backend(backend_name)
    for name, check in cases(backend).items():
        print(f"START {name}", flush=True)
        try:
            check()
        except Exception as e:  # noqa: BLE001 - reported to the parent, which fails the case
            print(f"CASE {name} FAIL {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
        else:
            print(f"CASE {name} OK", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])


# ---------------------------------------------------------------------------------------------
# pytest side: one child process per backend, one test per (backend, case).


def _backend_names() -> list[str]:
    from pfppo_mega.kernels import available_backends

    return [b.name for b in available_backends()]


def _case_names() -> list[str]:
    from pfppo_mega.kernels import TorchBackend

    return list(cases(TorchBackend()))


BACKENDS, CASES = _backend_names(), _case_names()
_LINE = re.compile(r"^CASE (\S+) (OK|FAIL)(?: (.*))?$")


@pytest.fixture(scope="module")
def outcomes() -> dict[str, dict[str, str]]:
    """backend -> case -> "OK" | the failure (or how the child process died while running it)."""
    repo = Path(__file__).resolve().parents[2]
    procs = {name: subprocess.Popen([sys.executable, __file__, name], cwd=repo, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env={**__import__("os").environ,
                                                                            "OMP_NUM_THREADS": "1"})
             for name in BACKENDS}
    out: dict[str, dict[str, str]] = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=600)
        results: dict[str, str] = {}
        started = None
        for line in stdout.splitlines():
            if line.startswith("START "):
                started = line.split()[1]
            m = _LINE.match(line)
            if m:
                results[m.group(1)] = "OK" if m.group(2) == "OK" else m.group(3)
        if proc.returncode != 0:
            how = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit code {proc.returncode}"
            died = f"the child process died ({how}) in case {started}: {stderr.strip()[-500:]}"
            for case in CASES:
                results.setdefault(case, died)
        out[name] = results
    return out


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_kernel_entry_handles_adversarial_input(outcomes, backend, case):
    result = outcomes[backend].get(case, "no result line")
    assert result == "OK", f"{backend} {case}: {result}"
