"""GRPO (and Dr.GRPO, and verl's other losses) train end to end, with and without the PF-PPO pool:
no critic is built, the pool's is/* metrics are logged, every group the estimator sees holds the n
samples of one prompt, the actor's weights move, and every policy loss the update computes equals a
reference written here token by token in plain Python from the inputs the update passed it."""

import dataclasses
import json
import math
from itertools import combinations

import pytest
import torch

from pfppo_mega.registry import ADV_ESTIMATORS
from pfppo_mega.trainer.estimators import AdvantageEstimator, _grpo
from pfppo_mega.trainer.loop import PPOTrainer
from pfppo_mega.trainer.policy_loss import PolicyLossInputs, PolicyLossParams

from test_trainer import _cfg, sft_dir  # noqa: F401  (the module's SFT checkpoint fixture)

N = 4
SEEN: list[torch.Tensor] = []


@pytest.fixture
def watched_grpo():
    """grpo, recording the group ids each step's rows carry."""
    def compute(x, ctx):
        SEEN.append(x.group_ids.cpu())
        return _grpo(x, ctx)
    SEEN.clear()
    ADV_ESTIMATORS.register("grpo_watched", AdvantageEstimator("grpo_watched", needs_critic=False, compute=compute,
                                                               needs_groups=True))
    yield
    ADV_ESTIMATORS.unregister("grpo_watched")


def _train(tmp_path, sft_dir, **algorithm):  # noqa: F811
    """3 steps; returns the trainer, the step records, every policy-loss call of the update (inputs
    detached, params, the loss it returned) and the actor's weights before training."""
    sections = dict(algorithm={"use_pf_ppo": True, "pool": {"pool_size": 2, "snapshot_interval": 1}, **algorithm},
                    actor_rollout={"n_samples_per_prompt": N}, training={"rollout_batch_size": 16, "batch_size": 32,
                                                                          "total_training_steps": 3})
    tr = PPOTrainer(_cfg(tmp_path, sft_dir, **sections), log=lambda *_: None)
    assert tr.run.models.critic is None and tr.run.models.critic_opt is None
    calls: list[tuple[PolicyLossInputs, PolicyLossParams, float]] = []
    loss_fn = tr.run.strategies.policy_loss

    def watched(x, p):
        res = loss_fn(x, p)
        frozen = PolicyLossInputs(**{k: v.detach().clone() if torch.is_tensor(v) else v for k, v in x.__dict__.items()})
        calls.append((frozen, p, res.loss.item()))
        return res
    tr.run.strategies.policy_loss = dataclasses.replace(loss_fn, fn=watched)  # the same variant and declarations, watched
    before = {n: t.detach().clone() for n, t in tr.run.models.actor.named_parameters()}
    res = tr.fit()
    return tr, [json.loads(line) for line in open(res.metrics_path)][1:], calls, before  # step-0 eval record first


# ----------------------------------------------------------------------------- the references, token by token

LIMIT = 20.0  # the +-20 token log-ratio clamp of every loss but gspo (docs/verl.md)


def _tokens(x: PolicyLossInputs) -> list[list[dict]]:
    """Per row, its tokens of pg_mask: log-prob, old log-prob, advantage, IS weight (1 without)."""
    rows = []
    for i, mrow in enumerate(x.pg_mask.tolist()):
        rows.append([{"lp": float(x.logp[i, t]), "old": float(x.old_logp[i, t]), "a": float(x.advantages[i, t]),
                      "w": 1.0 if x.is_weights is None else float(x.is_weights[i, t])}
                     for t, m in enumerate(mrow) if m > 0])
    return rows


def _agg(rows: list[list[float]], mode: str, c: float | None) -> float:
    full = [r for r in rows if r]
    if mode == "token-mean":
        return sum(map(sum, full)) / sum(map(len, full))
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in full) / len(full)
    assert mode == "seq-mean-token-sum-norm", mode
    return sum(map(sum, full)) / len(full) / c


def _r(k):
    return math.exp(min(max(k["lp"] - k["old"], -LIMIT), LIMIT))


def _clip(v, lo, hi):
    return min(max(v, lo), hi)


def _ppo_clip(k, p):
    r, a = _r(k), k["a"]
    pg = max(-a * r, -a * _clip(r, 1 - p.clip_ratio_low, 1 + p.clip_ratio_high))
    if p.dual_clip_c is not None and a < 0:
        pg = min(pg, -a * p.dual_clip_c)
    return pg


def _cov(rows):
    toks = [k for r in rows for k in r]
    ma, ml = sum(k["a"] for k in toks) / len(toks), sum(k["lp"] for k in toks) / len(toks)
    return [[(k["a"] - ma) * (k["lp"] - ml) for k in r] for r in rows]


def reference_losses(name: str, x: PolicyLossInputs, p: PolicyLossParams) -> list[float]:
    """The loss the update should have computed; clip_cov: every value its random cut could give."""
    rows, lo, hi = _tokens(x), 1 - p.clip_ratio_low, 1 + p.clip_ratio_high
    mode, c = p.loss_agg_mode, p.loss_scale_factor

    def per_token(f):
        return [[f(k) * k["w"] for k in r] for r in rows]
    if name == "ppo_clip":
        return [_agg(per_token(lambda k: _ppo_clip(k, p)), mode, c)]
    if name == "gpg":
        return [_agg(per_token(lambda k: -k["lp"] * k["a"]), mode, c)]
    if name == "cispo":
        return [_agg(per_token(lambda k: -_clip(_r(k), lo, hi) * k["a"] * k["lp"]), mode, c)]
    if name == "sapo":
        def gate(k):
            tau = p.tau_pos if k["a"] > 0 else p.tau_neg
            return -4 / tau / (1 + math.exp(-tau * (_r(k) - 1))) * k["a"]
        return [_agg(per_token(gate), "seq-mean-token-mean", c)]
    if name == "gspo":
        out = []
        for r in rows:
            s = math.exp(min(sum(k["lp"] - k["old"] for k in r) / len(r), 10.0)) if r else 0.0
            out.append([max(-k["a"] * s, -k["a"] * _clip(s, lo, hi)) * k["w"] for k in r])
        return [_agg(out, mode, c)]
    if name == "geo_mean":
        vals = []
        for r in rows:
            if r:
                def lr_min(k):
                    lr, sg = _clip(k["lp"] - k["old"], -LIMIT, LIMIT), (k["a"] > 0) - (k["a"] < 0)
                    return sg * min(sg * lr, sg * _clip(lr, -p.clip_ratio_low, p.clip_ratio_high))
                n = len(r)
                vals.append(-sum(k["a"] for k in r) / n * math.exp(sum(map(lr_min, r)) / n)
                            * math.exp(sum(math.log(k["w"] + 1e-10) for k in r) / n))
        return [sum(vals) / len(vals)]
    cov = _cov(rows)
    n_tok = sum(map(len, rows))
    if name == "kl_cov":
        k_top = max(1, int(n_tok * p.kl_cov_ratio))
        flat = sorted(((cov[i][t], i, t) for i, r in enumerate(rows) for t in range(len(r))), reverse=True)
        top = {(i, t) for _, i, t in flat[:k_top]}
        return [_agg([[(-k["a"] * _r(k) + (p.ppo_kl_coef * abs(_clip(k["lp"] - k["old"], -LIMIT, LIMIT))
                                             if (i, t) in top else 0.0)) * k["w"] for t, k in enumerate(r)]
                      for i, r in enumerate(rows)], mode, c)]
    assert name == "clip_cov", name
    k_cut = max(1, int(p.clip_cov_ratio * n_tok))
    eligible = [(i, t) for i, r in enumerate(rows) for t, k in enumerate(r)
                if p.clip_cov_lb < cov[i][t] < p.clip_cov_ub
                and not -k["a"] * _clip(_r(k), lo, hi) > -k["a"] * _r(k)]
    cuts = list(combinations(eligible, min(k_cut, len(eligible))))
    assert len(cuts) <= 5000, "too many ways to cut: lower clip_cov_ratio"
    return [_agg([[0.0 if (i, t) in cut else max(-k["a"] * _r(k), -k["a"] * _clip(_r(k), lo, hi)) * k["w"]
                   for t, k in enumerate(r)] for i, r in enumerate(rows)], mode, c) for cut in cuts]


def check_losses_and_weights(tr, calls, before, name: str) -> None:
    """Every policy-loss call of the 3 steps equals its reference (float32 model: rel 1e-5); the weights
    moved; the step records are stamped with the clock at each step's end."""
    assert len(calls) >= 3, len(calls)
    for x, p, got in calls:
        want = reference_losses(name, x, p)
        assert any(abs(got - v) <= 1e-5 * max(1.0, abs(v)) for v in want), (name, got, want[:4])
    after = dict(tr.run.models.actor.named_parameters())
    moved = [n for n, t in before.items() if not torch.equal(t, after[n].detach())]
    assert moved == list(before), sorted(set(before) - set(moved))


def test_grpo_with_the_pool_trains_without_a_critic(sft_dir, tmp_path, watched_grpo):  # noqa: F811
    tr, steps, calls, before = _train(tmp_path, sft_dir, adv_estimator="grpo_watched")
    assert [s["step"] for s in steps] == [1, 2, 3]
    for s in steps:
        assert any(k.startswith("is/") for k in s), sorted(s)
        assert "critic/value_loss" not in s and "critic/grad_norm" not in s  # no critic step ran
        # a group's N rows share their prompt: the shared floor prefills it once (trainer/instruments/perf.py)
        assert 0 < s["perf/rollout_floor_shared_s"] < s["perf/rollout_floor_s"], s
    check_losses_and_weights(tr, calls, before, "ppo_clip")
    # the clock at each step's end (pfppo bench trl): steps end in order, and a step's own work fits between
    ends = [s["perf/step_end_s"] for s in steps]
    assert all(b - a >= s["perf/step_s"] for a, b, s in zip(ends, ends[1:], steps[1:])), (ends, steps)
    # groups: each prompt's n samples, all on this rank (every rank generates all n of its prompts)
    assert len(SEEN) == 3
    for ids in SEEN:
        _, counts = torch.unique(ids, return_counts=True)
        assert (counts == N).all() and len(ids) == 16 * N


@pytest.mark.parametrize("policy_loss", ["gspo", "cispo", "geo_mean", "clip_cov", "kl_cov", "gpg", "sapo"])
def test_verl_losses_train_with_the_pool(sft_dir, tmp_path, policy_loss):  # noqa: F811
    extra = {"clip_cov_lb": -1.0, "clip_cov_ub": 1.0} if policy_loss == "clip_cov" else {}  # tokens to cut
    tr, steps, calls, before = _train(tmp_path, sft_dir, adv_estimator="grpo", policy_loss=policy_loss, **extra)
    assert tr.run.strategies.policy_loss.name == policy_loss
    assert all("is/mean" in s for s in steps)
    assert any(x.is_weights is not None for x, _, _ in calls)  # the pool's weights reach the loss
    check_losses_and_weights(tr, calls, before, policy_loss)


def test_dr_grpo_trains(sft_dir, tmp_path):  # noqa: F811
    tr, steps, calls, before = _train(tmp_path, sft_dir, adv_estimator="grpo", norm_adv_by_std_in_grpo=False,
                                      loss_agg_mode="seq-mean-token-sum-norm", use_pf_ppo=False)
    assert tr.run.strategies.policy_loss_params.loss_scale_factor == tr.run.cfg.algorithm.max_response_length
    assert all(p.loss_agg_mode == "seq-mean-token-sum-norm" for _, p, _ in calls)
    check_losses_and_weights(tr, calls, before, "ppo_clip")
