"""Hostile inputs for the fused LM head (pfppo_mega/kernels/fused_head.py), its config keys
(training.fused_head, training.fused_head_chunk_tokens) and `pfppo bench head`: each is refused
with an error that names the argument or key and the rule, or (empty, strided inputs) gives what
today's unfused path gives."""

from __future__ import annotations

import pytest
import torch

from pfppo_mega.bench import head as bench_head
from pfppo_mega.config import ConfigError, load_config_dict
from pfppo_mega.kernels import vocab_parallel_logprob_entropy
from pfppo_mega.kernels.fused_head import fused_linear_logprob_entropy

N, H, V = 9, 4, 20
BASE = {"actor_rollout": {"model_path": "x"}}


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, H, generator=g), torch.randn(V, H, generator=g), torch.randint(0, V, (N,), generator=g)


@pytest.mark.parametrize("chunk", [0, -1, 1.5, True, "256", None, (1 << 20) + 1])
def test_bad_chunk_tokens(chunk):
    x, w, labels = _inputs()
    with pytest.raises(ValueError, match=r"chunk_tokens=.*must be an int in \[1, 1048576\]"):
        fused_linear_logprob_entropy(x, w, labels, chunk_tokens=chunk)


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("nan"), float("inf"), True, "1"])
def test_bad_temperature(temperature):
    x, w, labels = _inputs()
    with pytest.raises(ValueError, match=r"temperature=.*must be a finite number > 0"):
        fused_linear_logprob_entropy(x, w, labels, temperature=temperature)


@pytest.mark.parametrize("case, error, fragment", [
    ("hidden_1d", ValueError, "hidden must be [N, H]"),
    ("hidden_3d", ValueError, "hidden must be [N, H]"),
    ("h_mismatch", ValueError, "same H"),
    ("weight_empty", ValueError, "V/tp >= 1"),
    ("labels_2d", ValueError, "labels must have shape [N] = [9]"),
    ("labels_float", TypeError, "labels must be int64"),
    ("hidden_fp64", TypeError, "hidden must be float32, bfloat16 or float16"),
    ("weight_int", TypeError, "weight must be float32, bfloat16 or float16"),
    ("label_negative", ValueError, "label -1 is outside [0, vocab_size)"),
    ("label_too_big", ValueError, "label 20 is outside [0, vocab_size)"),
    ("vocab_start_negative", ValueError, "vocab_start=-1 must be an int >= 0"),
    ("vocab_size_zero", ValueError, "vocab_size=0"),
    ("vocab_start_without_group", ValueError, "vocab_start=4 without a group"),
    ("into_wrong_shape", ValueError, "grad_weight_into must be float32 (20, 4)"),
    ("into_wrong_dtype", ValueError, "grad_weight_into must be float32"),
])
def test_bad_inputs_are_named(case, error, fragment):
    x, w, labels = _inputs()
    kw = {}
    if case == "hidden_1d":
        x = x[:, 0]
    elif case == "hidden_3d":
        x = x[None]
    elif case == "h_mismatch":
        w = torch.randn(V, H + 1)
    elif case == "weight_empty":
        w = w[:0]
    elif case == "labels_2d":
        labels = labels[:, None]
    elif case == "labels_float":
        labels = labels.float()
    elif case == "hidden_fp64":
        x = x.double()
    elif case == "weight_int":
        w = w.long()
    elif case == "label_negative":
        labels[3] = -1
    elif case == "label_too_big":
        labels[3] = V
    elif case == "vocab_start_negative":
        kw["vocab_start"] = -1
    elif case == "vocab_size_zero":
        kw["vocab_size"] = 0
    elif case == "vocab_start_without_group":
        kw["vocab_start"] = 4
    elif case == "into_wrong_shape":
        kw["grad_weight_into"] = torch.zeros(V + 1, H)
    elif case == "into_wrong_dtype":
        kw["grad_weight_into"] = torch.zeros(V, H, dtype=torch.float64)
    with pytest.raises(error) as info:
        fused_linear_logprob_entropy(x, w, labels, **kw)
    assert fragment in str(info.value), str(info.value)
    assert "fused_linear_logprob_entropy" in str(info.value)


def test_no_tokens():
    x, w, _ = _inputs()
    xx, ww = x[:0].clone().requires_grad_(True), w.clone().requires_grad_(True)
    logp, ent = fused_linear_logprob_entropy(xx, ww, torch.zeros(0, dtype=torch.long))
    assert logp.shape == ent.shape == (0,) and logp.dtype == torch.float32
    (logp.sum() + ent.sum()).backward()
    assert xx.grad.shape == (0, H) and (ww.grad is None or not ww.grad.any())


def test_strided_and_expanded_inputs_match_contiguous():
    x, w, labels = _inputs(1)
    want = fused_linear_logprob_entropy(x, w, labels, chunk_tokens=4)
    strided_x = torch.randn(H, N).t().copy_(x)  # transposed storage
    strided_w = torch.randn(V, 2 * H)[:, ::2].copy_(w)  # every other column
    got = fused_linear_logprob_entropy(strided_x, strided_w, labels, chunk_tokens=4)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    same_row = x[:1].expand(N, H)  # stride 0: every row the same hidden state
    logp, ent = fused_linear_logprob_entropy(same_row, w, labels, chunk_tokens=2)
    ref = vocab_parallel_logprob_entropy(same_row @ w.t(), labels, vocab_start=0, vocab_size=V, group=None)
    torch.testing.assert_close(logp, ref[0], rtol=1e-5, atol=1e-5)
    assert torch.allclose(ent, ent[:1].expand(N))


def test_inputs_never_written():
    x, w, labels = _inputs(2)
    before = [t.clone() for t in (x, w, labels)]
    xx, ww = x.requires_grad_(True), w.requires_grad_(True)
    logp, ent = fused_linear_logprob_entropy(xx, ww, labels, chunk_tokens=3, temperature=0.5)
    (logp.sum() - ent.sum()).backward()
    assert all(torch.equal(a, b) for a, b in zip((x.detach(), w.detach(), labels), before))


def test_non_finite_hidden_as_unfused():
    """A NaN hidden state gives NaN in its own row only, as today's path does."""
    x, w, labels = _inputs(3)
    x[2, 1] = float("nan")
    got = fused_linear_logprob_entropy(x, w, labels, chunk_tokens=4)
    want = vocab_parallel_logprob_entropy(x @ w.t(), labels, vocab_start=0, vocab_size=V, group=None)
    for a, b in zip(got, want):
        assert torch.equal(a.isnan(), b.isnan())
        assert bool(a.isnan()[2]) and not bool(a.isnan()[:2].any())


@pytest.mark.parametrize("value", [0, -5, (1 << 20) + 1, "big", 1.5, True, None])
def test_bad_chunk_key(value):
    with pytest.raises(ConfigError) as info:
        load_config_dict({**BASE, "training": {"fused_head_chunk_tokens": value}})
    assert "training.fused_head_chunk_tokens" in str(info.value)


@pytest.mark.parametrize("value", ["yes", 1, 0.5, "fast", [True]])
def test_bad_fused_head_key(value):
    with pytest.raises(ConfigError) as info:
        load_config_dict({**BASE, "training": {"fused_head": value}})
    assert "training.fused_head" in str(info.value)


@pytest.mark.parametrize("argv, fragment", [
    (["--shapes", "gpt5:100"], "MODEL one of"),
    (["--shapes", "smollm2"], "MODEL:TOKENS"),
    (["--shapes", "smollm2:abc"], "token count 'abc'"),
    (["--shapes", "smollm2:0"], "token count '0'"),
    (["--shapes", "smollm2:4096,"], "token count ''"),
    (["--chunk-tokens", "0"], "chunk_tokens=0"),
    (["--reps", "0"], "--reps 0"),
    (["--threads", "0"], "--threads 0"),
])
def test_bench_head_refuses_bad_arguments(argv, fragment, capsys):
    assert bench_head.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("pfppo bench head:") and fragment in err, err
