"""PF-PPO filtration weights (hand-computed) and resampling."""

import math

import pytest
import torch

from pfppo_mega.ppo import REWEIGHT_METHODS, filtration_weights, resample_indices

torch.set_num_threads(1)
F64 = torch.float64


def weights(scores, method, weight_pow=2.0):
    s = torch.tensor(scores, dtype=F64)
    return filtration_weights(s, method=method, weight_pow=weight_pow).tolist()


def approx(xs):
    return pytest.approx(xs, abs=1e-12)


def test_pow_minmax_hand_computed():
    # shift by min: [0, 1, 2, 4] -> squared [0, 1, 4, 16] / 21
    assert weights([1.0, 2.0, 3.0, 5.0], "pow_minmax", 2.0) == approx([0, 1 / 21, 4 / 21, 16 / 21])
    # negative scores, pow 1: shift [0, 2, 1] / 3
    assert weights([-3.0, -1.0, -2.0], "pow_minmax", 1.0) == approx([0, 2 / 3, 1 / 3])
    # pow 0: every weight 1 -> uniform
    assert weights([0.0, 1.0, 9.0], "pow_minmax", 0.0) == approx([1 / 3] * 3)
    # large pow on a tiny spread must not underflow to 0/0
    tiny = 2.0**-50
    assert weights([0.0, 1e-30, 2e-30], "pow_minmax", 50.0) == approx([0, tiny / (1 + tiny), 1 / (1 + tiny)])


# verl's definitions (verl/trainer/ppo/core_algos.py, compute_pf_ppo_reweight_data), written out:
# w = |s|^p, indicator of max/min, 0.4 / 0.1; then clamp(w + 1e-8, min=1e-8), not normalised.
EPS = 1e-8


def test_verl_pow_is_abs_power():
    assert weights([1.0, -2.0, 3.0, 0.0], "pow", 2.0) == approx([1 + EPS, 4 + EPS, 9 + EPS, EPS])
    # not monotone for negative scores: -3 weighs more than 1 (verl's behaviour, kept under its name)
    w = weights([-3.0, 1.0], "pow", 1.0)
    assert w[0] > w[1]


def test_verl_max_min_indicator():
    assert weights([0.1, 0.9, 0.5, 0.9, 0.1, 0.3], "max_min") == approx(
        [1 + EPS, 1 + EPS, EPS, 1 + EPS, 1 + EPS, EPS])
    assert weights([0.7] * 3, "max_min") == approx([1 + EPS] * 3)


def test_verl_max_random_point_four_point_one():
    assert weights([1.0, 0.0, 0.2, 1.0, -1.0], "max_random") == approx([0.4 + EPS, 0.1 + EPS, 0.1 + EPS,
                                                                        0.4 + EPS, 0.1 + EPS])


def test_verl_weights_in_scores_dtype_and_draws_match_verl():
    """float32 scores -> float32 weights, and the draw is torch.multinomial of exactly those weights
    (batch size, with replacement), so a seeded verl run and ours pick the same rows."""
    s = torch.tensor([0.5, -1.0, 2.0, 0.0, 1.5, 2.0])
    for method in ("pow", "max_min", "max_random"):
        w = filtration_weights(s, method=method, weight_pow=2.0)
        assert w.dtype == torch.float32
        if method == "pow":
            expect = torch.clamp(torch.pow(torch.abs(s), 2.0) + 1e-8, min=1e-8)
        elif method == "max_min":
            expect = torch.clamp(torch.where((s == s.max()) | (s == s.min()), 1.0, 0.0) + 1e-8, min=1e-8)
        else:
            expect = torch.clamp(torch.where(s == s.max(), 0.4, 0.1) + 1e-8, min=1e-8)
        assert torch.equal(w, expect), method
        ours = resample_indices(w, num_samples=6, generator=torch.Generator().manual_seed(7))
        verl = torch.multinomial(expect, 6, replacement=True, generator=torch.Generator().manual_seed(7))
        assert torch.equal(ours, verl), method


def test_best_random_hand_computed():
    # one maximum among 5: 0.5 on it, 0.5 / 4 on each other one (= verl's 0.4/0.1 normalised)
    assert weights([1.0, 0.0, 0.2, 0.0, -1.0], "best_random") == approx([0.5] + [0.125] * 4)
    verl = [0.4, 0.1, 0.1, 0.1, 0.1]
    assert weights([1.0, 0.0, 0.2, 0.0, -1.0], "best_random") == approx([w / sum(verl) for w in verl])
    # two tied maxima among 6: the best draw is one of them (1/4 each); the random draw is
    # uniform over the 5 others, which include the other maximum: maxima 1/4 + 1/2 * 1/2 * 1/5
    assert weights([2.0, 2.0, 0.0, 1.0, 1.0, 0.0], "best_random") == approx([0.3, 0.3] + [0.1] * 4)
    # three maxima, one other: 1/6 + 2/(6*3) = 5/18 each, the other 1/6 (not more than a max)
    assert weights([1.0, 1.0, 0.0, 1.0], "best_random") == approx([5 / 18, 5 / 18, 1 / 6, 5 / 18])


OURS = ("pow_minmax", "best_random")


@pytest.mark.parametrize("method", REWEIGHT_METHODS)
def test_degenerate_inputs_uniform(method):
    w = torch.tensor(weights([0.7] * 4, method))
    assert (w / w.sum()).tolist() == approx([0.25] * 4)
    assert weights([-3.0], method)[0] > 0


@pytest.mark.parametrize("method", OURS)
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_weights_nonnegative_sum_to_one(method, dtype):
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        n = 1 + trial
        s = torch.randint(-3, 4, (n,), generator=g).to(dtype) * 0.5  # many ties
        w = filtration_weights(s, method=method, weight_pow=1.5)
        assert w.dtype == dtype and w.shape == (n,)
        assert (w >= 0).all()
        assert w.sum().item() == pytest.approx(1.0, abs=1e-6)
        # the best sample is never given less than any other
        assert w[s.argmax()].item() == pytest.approx(w.max().item())


def test_integer_scores_give_float_weights():
    w = filtration_weights(torch.tensor([0, 1, 1]), method="pow_minmax", weight_pow=1.0)
    assert w.dtype == torch.float32
    assert w.tolist() == approx([0.0, 0.5, 0.5])
    assert filtration_weights(torch.tensor([0, 1, 1]), method="pow", weight_pow=1.0).dtype == torch.float32


def test_weight_errors():
    s = torch.tensor([0.0, 1.0])
    with pytest.raises(ValueError, match="method='best_of_n'.*'pow', 'max_min', 'max_random', 'pow_minmax', 'best_random'"):
        filtration_weights(s, method="best_of_n", weight_pow=1.0)
    for method in ("pow", "pow_minmax"):
        with pytest.raises(ValueError, match="weight_pow=-1"):
            filtration_weights(s, method=method, weight_pow=-1.0)
    with pytest.raises(ValueError, match="1 of 2 scores are NaN/inf"):
        filtration_weights(torch.tensor([0.0, float("nan")]), method="max_min", weight_pow=1.0)
    with pytest.raises(ValueError, match=r"scores.shape=\(0,\)"):
        filtration_weights(torch.tensor([]), method="pow", weight_pow=1.0)


def test_resample_reproducible_and_matches_weights():
    w = torch.tensor([0.0, 0.1, 0.2, 0.7], dtype=F64)
    a = resample_indices(w, num_samples=50, generator=torch.Generator().manual_seed(3))
    b = resample_indices(w, num_samples=50, generator=torch.Generator().manual_seed(3))
    assert a.dtype == torch.long and a.shape == (50,)
    assert torch.equal(a, b)
    n = 40_000
    idx = resample_indices(w, num_samples=n, generator=torch.Generator().manual_seed(4))
    counts = torch.bincount(idx, minlength=4).tolist()
    assert counts[0] == 0, "zero-weight samples are never drawn"
    for i in range(1, 4):
        p = w[i].item()
        assert abs(counts[i] / n - p) < 5 * math.sqrt(p * (1 - p) / n), (i, counts)
    # unnormalised weights are fine
    assert resample_indices(torch.tensor([0.0, 3.0]), num_samples=5, generator=None).tolist() == [1] * 5


def test_resample_errors():
    with pytest.raises(ValueError, match="positive sum"):
        resample_indices(torch.zeros(3), num_samples=2, generator=None)
    with pytest.raises(ValueError, match="positive sum"):
        resample_indices(torch.tensor([1.0, -0.5]), num_samples=2, generator=None)
    with pytest.raises(ValueError, match="num_samples=0"):
        resample_indices(torch.ones(3), num_samples=0, generator=None)


def test_filtration_end_to_end_max_min_keeps_extremes():
    scores = torch.tensor([0.2, 0.9, 0.5, 0.1, 0.6])
    w = filtration_weights(scores, method="max_min", weight_pow=1.0)
    idx = resample_indices(w, num_samples=200, generator=torch.Generator().manual_seed(5))
    assert set(idx.tolist()) == {1, 3}
