"""Critic-free estimators (pfppo_mega.ppo.outcome) against float64 references written from the
formulas (verl/trainer/ppo/core_algos.py at b178a3c), one row at a time in plain Python, on ragged
masks and several group layouts: singleton groups, ties (std 0), groups of unequal size, ids in
any order. Then the registry entries, the config key and the start-time group check."""

import math

import pytest
import torch

from pfppo_mega.ppo import outcome
from pfppo_mega.registry import ADV_ESTIMATORS

EPS = 1e-6

# (scores, group ids): each row's score and the prompt it answers
LAYOUTS = {
    "pairs": ([1.0, 0.0, 0.5, 0.5, 2.0, -1.0], [0, 0, 1, 1, 2, 2]),          # the middle pair ties
    "uneven": ([1.0, 0.0, 0.0, 3.0, 0.2, 0.7, 0.7], [5, 5, 5, 9, 1, 1, 1]),  # a singleton (9), ids unsorted
    "interleaved": ([0.3, 1.0, 0.0, 1.0, 1.0, 0.0], [2, 0, 2, 0, 0, 2]),
    "all_singletons": ([0.4, -0.2, 1.5], [0, 1, 2]),
    "one_group_tied": ([1.0, 1.0, 1.0, 1.0], [3, 3, 3, 3]),
}
PASSK_LAYOUTS = {k: v for k, v in LAYOUTS.items() if k in ("pairs", "interleaved", "one_group_tied")}


def _rows(scores, groups, seed=0):
    """token_rewards [B, T] with the score on each ragged row's last token, mask, group ids."""
    g = torch.Generator().manual_seed(seed)
    B, T = len(scores), 7
    lengths = torch.randint(1, T + 1, (B,), generator=g).tolist()
    mask = torch.zeros(B, T, dtype=torch.float64)
    tr = torch.zeros(B, T, dtype=torch.float64)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
        tr[i, n - 1] = scores[i]
    tr = tr + torch.where(mask.bool(), torch.zeros_like(tr), torch.full_like(tr, float("nan")))  # NaN padding
    return tr, mask, torch.tensor(groups), lengths


def _members(groups):
    out = {}
    for i, gid in enumerate(groups):
        out.setdefault(gid, []).append(i)
    return out


def _mean(xs):
    return sum(xs) / len(xs)


def _std(xs):  # unbiased, as torch.std
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def _expand(per_row, lengths, T=7):
    out = torch.zeros(len(per_row), T, dtype=torch.float64)
    for i, (a, n) in enumerate(zip(per_row, lengths)):
        out[i, :n] = a
    return out


def _whiten(values, lengths):
    """(x - mean) / sqrt(var_unbiased + 1e-8) over every real token (masked_whiten)."""
    flat = [v for row, n in zip(values, lengths) for v in row[:n]]
    m = _mean(flat)
    var = sum((x - m) ** 2 for x in flat) / (len(flat) - 1)
    return [[(v - m) / math.sqrt(var + 1e-8) for v in row[:n]] for row, n in zip(values, lengths)]


def _ref_grpo(scores, groups, norm):
    out = []
    mem = _members(groups)
    for i, s in enumerate(scores):
        xs = [scores[j] for j in mem[groups[i]]]
        mean, std = (0.0, 1.0) if len(xs) == 1 else (_mean(xs), _std(xs))
        out.append((s - mean) / (std + EPS) if norm else s - mean)
    return out


def _ref_rloo(scores, groups):
    mem = _members(groups)
    out = []
    for i, s in enumerate(scores):
        others = [scores[j] for j in mem[groups[i]] if j != i]
        out.append(s - _mean(others) if others else s)   # a singleton keeps its score (verl's rloo)
    return out


def _ref_opo(scores, groups, lengths):
    mem = _members(groups)
    out = []
    for i, s in enumerate(scores):
        js = mem[groups[i]]
        b = 0.0 if len(js) == 1 else sum(lengths[j] * scores[j] for j in js) / sum(lengths[j] for j in js)
        out.append(s - b)
    return out


def _ref_gpg(scores, groups):
    alpha = len(scores) / max(sum(1 for s in scores if s != 0), 1)
    mem = _members(groups)
    return [alpha * (s - (0.0 if len(mem[groups[i]]) == 1 else _mean([scores[j] for j in mem[groups[i]]])))
            for i, s in enumerate(scores)]


def _ref_passk(scores, groups, norm):
    out = [0.0] * len(scores)
    for js in _members(groups).values():
        xs = sorted((scores[j] for j in js), reverse=True)
        best = max(js, key=lambda j: scores[j])
        gap = xs[0] - xs[1]
        out[best] = gap / (_std([scores[j] for j in js]) + EPS) if norm else gap
    return out


def _ref_rpp_baseline(scores, groups, lengths):
    mem = _members(groups)
    centred = [s - (0.0 if len(mem[groups[i]]) == 1 else _mean([scores[j] for j in mem[groups[i]]]))
               for i, s in enumerate(scores)]
    return _whiten([[c] * n for c, n in zip(centred, lengths)], lengths)


def _close(got, want_per_row_or_tokens, lengths, mask):
    want = (_expand(want_per_row_or_tokens, lengths) if not isinstance(want_per_row_or_tokens[0], list)
            else torch.tensor([row + [0.0] * (7 - len(row)) for row in want_per_row_or_tokens], dtype=torch.float64))
    assert torch.isfinite(got).all()
    assert (got[mask == 0] == 0).all(), "non-zero advantage on padding"
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("norm", [True, False])
def test_grpo(layout, norm):
    scores, groups = LAYOUTS[layout]
    tr, m, gid, lengths = _rows(scores, groups)
    adv, ret = outcome.grpo_advantages(tr, m, gid, norm_adv_by_std_in_grpo=norm)
    _close(adv, _ref_grpo(scores, groups, norm), lengths, m)
    assert torch.equal(adv, ret)


def test_grpo_tied_group_is_zero_and_singleton_is_scaled_score():
    tr, m, gid, lengths = _rows([2.0, 2.0, 0.7], [0, 0, 1])
    adv, _ = outcome.grpo_advantages(tr, m, gid)
    assert (adv[:2] == 0).all()                                           # std 0 -> epsilon, centred 0
    assert adv[2, 0].item() == pytest.approx(0.7 / (1 + EPS), rel=1e-15)  # mean 0, std 1


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rloo(layout):
    scores, groups = LAYOUTS[layout]
    tr, m, gid, lengths = _rows(scores, groups, seed=1)
    _close(outcome.rloo_advantages(tr, m, gid)[0], _ref_rloo(scores, groups), lengths, m)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_opo(layout):
    scores, groups = LAYOUTS[layout]
    tr, m, gid, lengths = _rows(scores, groups, seed=2)
    _close(outcome.opo_advantages(tr, m, gid)[0], _ref_opo(scores, groups, lengths), lengths, m)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpg(layout):
    scores, groups = LAYOUTS[layout]
    tr, m, gid, lengths = _rows(scores, groups, seed=3)
    _close(outcome.gpg_advantages(tr, m, gid)[0], _ref_gpg(scores, groups), lengths, m)


def test_gpg_alpha_over_the_global_batch():
    """reduce_sum sums (B, #non-zero) over the ranks: two halves see the whole batch's alpha."""
    scores, groups = [1.0, 0.0, 0.0, 0.0], [0, 0, 1, 1]
    tr, m, gid, _ = _rows(scores, groups)
    whole, _ = outcome.gpg_advantages(tr, m, gid)
    other = torch.tensor([4.0, 0.0], dtype=torch.float64)  # the other rank: 4 rows, all zero
    half, _ = outcome.gpg_advantages(tr, m, gid, reduce_sum=lambda t: t + other)
    torch.testing.assert_close(half, whole * 2)            # alpha 8 / 1 instead of 4 / 1


@pytest.mark.parametrize("layout", PASSK_LAYOUTS)
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_passk(layout, norm):
    scores, groups = PASSK_LAYOUTS[layout]
    tr, m, gid, lengths = _rows(scores, groups, seed=4)
    _close(outcome.grpo_passk_advantages(tr, m, gid, norm_adv_by_std_in_grpo=norm)[0],
           _ref_passk(scores, groups, norm), lengths, m)


def test_grpo_passk_refuses_a_singleton_group():
    tr, m, gid, _ = _rows([1.0, 0.0, 2.0], [0, 0, 7])
    with pytest.raises(ValueError, match="group 7 has 1 sample; pass@k needs at least 2"):
        outcome.grpo_passk_advantages(tr, m, gid)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus(gamma):
    g = torch.Generator().manual_seed(5)
    B, T = 5, 7
    lengths = [7, 1, 4, 3, 6]
    mask = torch.zeros(B, T, dtype=torch.float64)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    tr = torch.randn(B, T, generator=g, dtype=torch.float64) * mask   # per-token rewards (a KL penalty)
    ret_ref = []
    for i, n in enumerate(lengths):
        row, run = [0.0] * n, 0.0
        for t in reversed(range(n)):
            run = tr[i, t].item() + gamma * run
            row[t] = run
        ret_ref.append(row)
    adv, ret = outcome.reinforce_plus_plus_advantages(tr, mask, gamma=gamma)
    _close(ret, ret_ref, lengths, mask)
    _close(adv, _whiten(ret_ref, lengths), lengths, mask)


@pytest.mark.parametrize("layout", [k for k in LAYOUTS if k != "one_group_tied"])
def test_reinforce_plus_plus_baseline(layout):
    scores, groups = LAYOUTS[layout]
    tr, m, gid, lengths = _rows(scores, groups, seed=6)
    _close(outcome.reinforce_plus_plus_baseline_advantages(tr, m, gid)[0],
           _ref_rpp_baseline(scores, groups, lengths), lengths, m)


def test_the_estimators_are_registered_critic_free():
    from pfppo_mega.config import ConfigError, load_config

    for name in ("grpo", "grpo_passk", "rloo", "opo", "gpg", "reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        est = ADV_ESTIMATORS.get(name)
        assert est.name == name and est.needs_critic is False
        assert est.needs_groups is (name != "reinforce_plus_plus")
    cfg = load_config("configs/tiny_cpu.yaml", ["algorithm.adv_estimator=grpo"])
    assert cfg.algorithm.norm_adv_by_std_in_grpo is True                 # verl's default
    cfg = load_config("configs/tiny_cpu.yaml", ["algorithm.norm_adv_by_std_in_grpo=false"])
    assert cfg.algorithm.norm_adv_by_std_in_grpo is False
    with pytest.raises(ConfigError, match=r"algorithm.adv_estimator = 'no_such': must be one of"):
        load_config("configs/tiny_cpu.yaml", ["algorithm.adv_estimator=no_such"])


def test_a_group_estimator_with_one_sample_per_prompt_is_refused_at_start():
    from pfppo_mega.config import load_config
    from pfppo_mega.trainer.build import SetupError, check_groups

    cfg = load_config("configs/tiny_cpu.yaml", ["algorithm.adv_estimator=grpo", "actor_rollout.n_samples_per_prompt=1"])
    with pytest.raises(SetupError, match=r"actor_rollout.n_samples_per_prompt = 1"):
        check_groups(cfg, ADV_ESTIMATORS.get("grpo"))
    check_groups(cfg, ADV_ESTIMATORS.get("reinforce_plus_plus"))         # no groups: fine
