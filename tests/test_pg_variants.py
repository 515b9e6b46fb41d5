"""verl's policy losses (pfppo_mega.ppo.pg_variants, registered in trainer/policy_loss.py) against
float64 references written from the formulas (verl 0.9.1's verl/trainer/ppo/core_algos.py; GSPO's
aggregation and seq-mean-token-sum-norm new in 0.9.1), token by token in plain Python, on ragged masks with NaN padding; with and without behaviour IS
weights (PF-PPO), through the registry as the trainer calls them; seq-mean-token-sum-norm."""

import math

import pytest
import torch

from pfppo_mega import ppo
from pfppo_mega.constants import POLICY_LOSSES
from pfppo_mega.ppo import pg_variants as pgv
from pfppo_mega.trainer import policy_loss as tpl

B, T = 5, 7
LENGTHS = [7, 1, 4, 0, 6]  # row 3 has no token
EPS_LOW, EPS_HIGH = 0.2, 0.28


def _inputs(seed=0, weights=False):
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, T, dtype=torch.float64)
    for i, n in enumerate(LENGTHS):
        mask[i, :n] = 1
    nan = torch.where(mask.bool(), torch.zeros(B, T, dtype=torch.float64), torch.full((B, T), float("nan"),
                                                                                       dtype=torch.float64))
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    logp = (old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3 + nan).requires_grad_()
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    w = torch.rand(B, T, generator=g, dtype=torch.float64) + 0.5 if weights else None
    return logp, old, adv, mask, w


def _tok(x, i, t):
    return float(x[i, t])


def _seq_mean(per_token_rows):
    rows = [r for r in per_token_rows if r]
    return sum(sum(r) / len(r) for r in rows) / len(rows)


def _token_mean(per_token_rows):
    toks = [v for r in per_token_rows for v in r]
    return sum(toks) / len(toks)


def _w(w, i, t):
    return 1.0 if w is None else _tok(w, i, t)


def ref_gspo(logp, old, adv, w, agg=_token_mean):
    """verl 0.9.1: the sequence ratio, no token clamp, aggregated by loss_agg_mode (token-mean default)."""
    rows = []
    for i, n in enumerate(LENGTHS):
        if not n:
            rows.append([])
            continue
        s = math.exp(min(sum(_tok(logp, i, t) - _tok(old, i, t) for t in range(n)) / n, 10.0))
        rows.append([max(-_tok(adv, i, t) * s, -_tok(adv, i, t) * min(max(s, 1 - EPS_LOW), 1 + EPS_HIGH))
                     * _w(w, i, t) for t in range(n)])
    return agg(rows)


def ref_cispo(logp, old, adv, w):
    rows = []
    for i, n in enumerate(LENGTHS):
        row = []
        for t in range(n):
            r = math.exp(_tok(logp, i, t) - _tok(old, i, t))
            row.append(-min(max(r, 1 - EPS_LOW), 1 + EPS_HIGH) * _tok(adv, i, t) * _tok(logp, i, t) * _w(w, i, t))
        rows.append(row)
    return _token_mean(rows)


def ref_gpg(logp, adv, w):
    return _token_mean([[-_tok(logp, i, t) * _tok(adv, i, t) * _w(w, i, t) for t in range(n)]
                        for i, n in enumerate(LENGTHS)])


def ref_sapo(logp, old, adv, w, tau_pos=1.0, tau_neg=1.05):
    rows = []
    for i, n in enumerate(LENGTHS):
        row = []
        for t in range(n):
            r, a = math.exp(_tok(logp, i, t) - _tok(old, i, t)), _tok(adv, i, t)
            tau = tau_pos if a > 0 else tau_neg
            row.append(-(1 / (1 + math.exp(-tau * (r - 1)))) * 4 / tau * a * _w(w, i, t))
        rows.append(row)
    return _seq_mean(rows)


def ref_geo_mean(logp, old, adv, w):
    out = []
    for i, n in enumerate(LENGTHS):
        if not n:
            continue
        acc, a_sum, lw = 0.0, 0.0, 0.0
        for t in range(n):
            lr, a = _tok(logp, i, t) - _tok(old, i, t), _tok(adv, i, t)
            sg = (a > 0) - (a < 0)
            clamped = min(max(lr, -EPS_LOW), EPS_HIGH)
            acc += sg * min(sg * lr, sg * clamped)
            a_sum += a
            lw += math.log(_w(w, i, t) + 1e-10)
        out.append(-(a_sum / n) * math.exp(acc / n) * math.exp(lw / n))
    return sum(out) / len(out)


def _cov(logp, adv):
    toks = [(i, t) for i, n in enumerate(LENGTHS) for t in range(n)]
    ma = sum(_tok(adv, i, t) for i, t in toks) / len(toks)
    ml = sum(_tok(logp, i, t) for i, t in toks) / len(toks)
    return {(i, t): (_tok(adv, i, t) - ma) * (_tok(logp, i, t) - ml) for i, t in toks}


def ref_kl_cov(logp, old, adv, w, ratio, coef):
    cov = _cov(logp, adv)
    k = max(1, int(len(cov) * ratio))
    top = set(sorted(cov, key=lambda it: -cov[it])[:k])
    rows = []
    for i, n in enumerate(LENGTHS):
        row = []
        for t in range(n):
            lr = _tok(logp, i, t) - _tok(old, i, t)
            v = -_tok(adv, i, t) * math.exp(lr) + (coef * abs(lr) if (i, t) in top else 0.0)
            row.append(v * _w(w, i, t))
        rows.append(row)
    return _token_mean(rows)


def ref_clip_cov_all_cut(logp, old, adv, w, lb, ub):
    """clip_cov_ratio 1: every eligible token (lb < cov < ub, not clipped by the ratio) is cut."""
    cov = _cov(logp, adv)
    rows = []
    for i, n in enumerate(LENGTHS):
        row = []
        for t in range(n):
            r, a = math.exp(_tok(logp, i, t) - _tok(old, i, t)), _tok(adv, i, t)
            pg1, pg2 = -a * r, -a * min(max(r, 1 - EPS_LOW), 1 + EPS_HIGH)
            cut = lb < cov[(i, t)] < ub and not pg2 > pg1
            row.append(0.0 if cut else max(pg1, pg2) * _w(w, i, t))
        rows.append(row)
    return _token_mean(rows)


def _check(loss, want, name=""):
    assert torch.isfinite(loss)
    tol = 1e-7 if name == "geo_mean" else 1e-12  # geo_mean: verl's 1e-8 in the row denominators
    assert abs(loss.item() - want) < tol * max(1.0, abs(want)), (name, loss.item(), want)
    loss.backward()


@pytest.mark.parametrize("weights", [False, True], ids=["no_is", "is_weights"])
def test_losses_match_the_formulas(weights):
    clip = dict(clip_ratio_low=EPS_LOW, clip_ratio_high=EPS_HIGH)
    agg = dict(loss_agg_mode="token-mean")
    for seed in range(3):
        logp, old, adv, m, w = _inputs(seed, weights)
        cases = {
            "gspo": (lambda: pgv.gspo_loss(logp, old, adv, m, **clip, is_weights=w), ref_gspo(logp, old, adv, w)),
            "gspo_seq": (lambda: pgv.gspo_loss(logp, old, adv, m, **clip, loss_agg_mode="seq-mean-token-mean",
                                               is_weights=w), ref_gspo(logp, old, adv, w, _seq_mean)),
            "cispo": (lambda: pgv.cispo_loss(logp, old, adv, m, **clip, **agg, is_weights=w),
                      ref_cispo(logp, old, adv, w)),
            "gpg": (lambda: pgv.gpg_loss(logp, adv, m, **agg, is_weights=w), ref_gpg(logp, adv, w)),
            "sapo": (lambda: pgv.sapo_loss(logp, old, adv, m, tau_pos=1.0, tau_neg=1.05, is_weights=w),
                     ref_sapo(logp, old, adv, w)),
            "geo_mean": (lambda: pgv.geo_mean_loss(logp, old, adv, m, **clip, is_weights=w),
                         ref_geo_mean(logp, old, adv, w)),
            "kl_cov": (lambda: pgv.kl_cov_loss(logp, old, adv, m, kl_cov_ratio=0.2, ppo_kl_coef=0.1, **agg,
                                               is_weights=w), ref_kl_cov(logp, old, adv, w, 0.2, 0.1)),
            "clip_cov": (lambda: pgv.clip_cov_loss(logp, old, adv, m, **clip, clip_cov_ratio=1.0, clip_cov_lb=-0.05,
                                                   clip_cov_ub=0.3, **agg, is_weights=w),
                         ref_clip_cov_all_cut(logp, old, adv, w, -0.05, 0.3)),
        }
        for name, (fn, want) in cases.items():
            logp.grad = None
            loss, stats = fn()
            _check(loss, want, name)
            assert torch.isfinite(logp.grad).all() and (logp.grad[m == 0] == 0).all(), name


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "token-mean"])
def test_gspo_gradient_is_the_sequence_ratio_gradient(mode):
    """sg[s_i] pi / sg[pi] per token, aggregated, has the gradient of the sequence loss
    max(-A s_i, -A clip(s_i)) with s_i = exp(mean_t log r) (one advantage per row, as GRPO's),
    weighted 1 / rows (seq-mean-token-mean) or n_i / tokens (token-mean, verl 0.9.1's default)."""
    logp, old, _, m, _ = _inputs(4)
    adv = torch.tensor([0.7, -1.2, 0.4, 0.0, -0.3], dtype=torch.float64)[:, None].expand(B, T).clone()
    loss, _ = pgv.gspo_loss(logp, old, adv, m, clip_ratio_low=EPS_LOW, clip_ratio_high=EPS_HIGH, loss_agg_mode=mode)
    loss.backward()
    got = logp.grad.clone()
    lp = logp.detach().clone().requires_grad_()
    terms = []
    for i, n in enumerate(LENGTHS):
        if n:
            s = torch.exp((lp[i, :n] - old[i, :n]).mean())
            a = adv[i, 0]
            weight = 1 / 4 if mode == "seq-mean-token-mean" else n / sum(LENGTHS)  # 4 rows with tokens
            terms.append(weight * torch.maximum(-a * s, -a * s.clamp(1 - EPS_LOW, 1 + EPS_HIGH)))
    torch.stack(terms).sum().backward()
    want = torch.where(m.bool(), lp.grad, torch.zeros_like(lp.grad))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_clip_cov_cuts_clip_cov_ratio_of_the_tokens_at_random():
    logp, old, adv, m, _ = _inputs(5)
    n_tokens = int(m.sum())
    g = torch.Generator().manual_seed(0)
    _, stats = pgv.clip_cov_loss(logp, old, adv, m, clip_ratio_low=EPS_LOW, clip_ratio_high=EPS_HIGH,
                                 clip_cov_ratio=0.1, clip_cov_lb=-10.0, clip_cov_ub=10.0,
                                 loss_agg_mode="token-mean", generator=g)
    assert stats["pg_clipfrac"].item() == pytest.approx(max(int(0.1 * n_tokens), 1) / n_tokens)


def _registry_inputs(weights):
    logp, old, adv, m, w = _inputs(7, weights)
    return tpl.PolicyLossInputs(logp=logp, old_logp=old, behav_logp=old - 0.1, advantages=adv, mask=m,
                                pg_mask=m, is_weights=w, on_policy=torch.zeros(B, dtype=torch.bool))


def _params(**kw):
    return tpl.PolicyLossParams(kernel_policy_loss=ppo.policy_loss, clip_ratio_low=EPS_LOW, clip_ratio_high=EPS_HIGH,
                                dual_clip_c=None, loss_agg_mode="token-mean", is_clip=2.0, **kw)


@pytest.mark.parametrize("name", [n for n in POLICY_LOSSES if n != "ppo_clip"])
def test_the_pool_is_weights_reach_every_registered_loss(name):
    """PF-PPO's behaviour weights (PolicyLossInputs.is_weights) change every loss: a constant
    weight c scales it by c (geo_mean: the row's geometric mean weight, also c)."""
    fn = tpl.get_policy_loss(name)
    x = _registry_inputs(False)
    base = fn(x, _params(generator=torch.Generator().manual_seed(0)))
    c = 1.7
    xw = tpl.PolicyLossInputs(**{**x.__dict__, "is_weights": torch.full((B, T), c, dtype=torch.float64)})
    scaled = fn(xw, _params(generator=torch.Generator().manual_seed(0)))
    assert scaled.loss.item() == pytest.approx(c * base.loss.item(), rel=1e-7)
    assert "policy/pg_loss" in scaled.stats and torch.equal(scaled.mask, x.pg_mask)
    assert scaled.agg_mode == pgv.AGG_MODE.get(name)


@pytest.mark.parametrize("name", sorted(tpl.POLICY_LOSSES))
def test_every_loss_aggregates_over_the_mask_it_declares(name):
    """The update counts the declared mask before the micro-batches run (trainer/update.py): a
    variant whose result aggregates over another mask would be scaled by the wrong count."""
    x = _registry_inputs(False)
    pg_mask = x.mask.clone()
    pg_mask[:, 0] = 0                                  # the IS mask mode dropped the first tokens
    x = tpl.PolicyLossInputs(**{**x.__dict__, "pg_mask": pg_mask})
    loss = tpl.get_policy_loss(name)
    # rollout_correction without a rejection criterion keeps pg_mask (its criteria drop tokens from the
    # aggregate, not from the count: tests/test_rollout_correction.py)
    none = tpl.RolloutCorrection(is_level="token", is_upper=2.0, is_lower=None, is_normalize=False, criteria=(),
                                 loss_type="reinforce")
    out = loss(x, _params(generator=torch.Generator().manual_seed(0), correction=none))
    want = x.pg_mask if loss.trains_on_pg_mask else x.mask
    assert torch.equal(out.mask, want), (name, loss.trains_on_pg_mask)


def test_every_configurable_loss_is_registered_and_tis_is_refused_with_another():
    assert set(POLICY_LOSSES) | {"tis", "rollout_correction"} == set(tpl.POLICY_LOSSES)
    assert tpl.choose_policy_loss(use_pool=False, is_mode="truncate", rollout_correction=True) == "rollout_correction"
    assert tpl.choose_policy_loss(use_pool=False, is_mode="tis", name="gspo") == "gspo"
    assert tpl.choose_policy_loss(use_pool=True, is_mode="tis") == "tis"
    assert tpl.choose_policy_loss(use_pool=True, is_mode="truncate", name="cispo") == "cispo"
    with pytest.raises(ValueError, match=r"algorithm.policy_loss = 'gspo' with algorithm.pool.is_mode = 'tis'"):
        tpl.choose_policy_loss(use_pool=True, is_mode="tis", name="gspo")


def test_policy_loss_config_keys():
    from pfppo_mega.config import ConfigError, load_config

    a = load_config("configs/tiny_cpu.yaml", ["algorithm.policy_loss=vanilla"]).algorithm
    assert a.policy_loss == "ppo_clip"
    assert (a.clip_cov_ratio, a.clip_cov_lb, a.clip_cov_ub, a.kl_cov_ratio, a.ppo_kl_coef) == (0.0002, 1.0, 5.0,
                                                                                               0.0002, 0.1)
    with pytest.raises(ConfigError, match=r"algorithm.policy_loss = 'gspo': must be ppo_clip with use_pf_ppo"):
        load_config("configs/tiny_cpu.yaml", ["algorithm.policy_loss=gspo", "algorithm.use_pf_ppo=true",
                                              "algorithm.pool.is_mode=tis"])


def test_seq_mean_token_sum_norm_is_the_token_sum_over_rows_and_the_constant():
    """verl 0.9.1: sum / global_batch_size / loss_scale_factor, global_batch_size = the rows with a
    token (4 of the 5 here)."""
    logp, old, adv, m, _ = _inputs(8)
    loss_mat = (adv * 0.3).detach()
    want = sum(float(loss_mat[i, t]) for i, n in enumerate(LENGTHS) for t in range(n)) / 4 / 12.0
    assert ppo.agg_loss(loss_mat, m, mode="seq-mean-token-sum-norm", loss_scale_factor=12).item() == \
        pytest.approx(want, rel=1e-14)
    # verl's default constant: the padded width
    assert ppo.agg_loss(loss_mat, m, mode="seq-mean-token-sum-norm").item() == pytest.approx(want * 12 / T, rel=1e-14)
