"""verl 0.9.1's rollout correction in bypass mode (algorithm.rollout_correction, issue 36): the IS weights
and the rejection criteria against element-by-element references written here from verl's formulas,
the bypass losses against their definitions, verl's two example scripts translated, and a tiny run."""

import math

import pytest
import torch

from pfppo_mega import ppo
from pfppo_mega.config import ConfigError, load_config_dict, resolve_config_dict
from pfppo_mega.kernels.backends import TorchBackend
from pfppo_mega.ppo import rollout_correction as rc
from pfppo_mega.trainer.policy_loss import PolicyLossInputs, PolicyLossParams, RolloutCorrection, get_policy_loss
from test_trainer_resume import sft_small  # noqa: F401
from test_verl_layout import overrides_of

torch.manual_seed(0)
B, T = 5, 7
DELTA = torch.randn(B, T, dtype=torch.float64) * 0.6
MASK = torch.ones(B, T, dtype=torch.float64)
MASK[1, 4:] = 0
MASK[3, 2:] = 0
MASK[4, :] = 0  # a row without a token


def _rows():
    return [[t for t in range(T) if MASK[b, t] > 0] for b in range(B)]


# ----------------------------------------------------------------------------- IS weights


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("lower", [None, 0.7])
def test_is_weights_match_the_formula(level, lower):
    upper = 1.3
    w = rc.is_weights(DELTA, MASK, level=level, upper=upper, lower=lower)
    for b, toks in enumerate(_rows()):
        row = math.exp(max(-20, min(20, sum(DELTA[b, t].item() for t in toks))))
        for t in range(T):
            if t not in toks:
                assert w[b, t] == 0
                continue
            raw = math.exp(DELTA[b, t].item()) if level == "token" else row
            want = min(raw, upper) if lower is None else (raw if lower <= raw <= upper else 0.0)
            assert w[b, t].item() == pytest.approx(want, rel=1e-12)
    assert not w.requires_grad


def test_batch_normalisation_divides_by_the_mean_weight():
    w = rc.is_weights(DELTA, MASK, level="token", upper=5.0)
    vals = [w[b, t].item() for b, toks in enumerate(_rows()) for t in toks]
    n = rc.normalize_weights(w, MASK, level="token")
    torch.testing.assert_close(n, w / (sum(vals) / len(vals)))
    ws = rc.is_weights(DELTA, MASK, level="sequence", upper=5.0)
    per_row = [ws[b, toks[0]].item() for b, toks in enumerate(_rows()) if toks]  # one weight per row with a token
    ns = rc.normalize_weights(ws, MASK, level="sequence")
    torch.testing.assert_close(ns, ws / (sum(per_row) / len(per_row)))


# ----------------------------------------------------------------------------- rejection


def _k(name, d):
    return {"k1": -d, "k2": 0.5 * d * d, "k3": math.exp(d) - 1 - d}[name[-2:]]


@pytest.mark.parametrize("name,lower,upper", [
    ("token_k1", 0.6, 1.6), ("token_k2", None, 0.1), ("token_k3", None, 0.1),
    ("seq_sum_k1", 0.5, 1.5), ("seq_sum_k2", None, 0.9), ("seq_sum_k3", None, 0.9),
    ("seq_mean_k1", 0.8, 1.2), ("seq_mean_k2", None, 0.2), ("seq_mean_k3", None, 0.22),
    ("seq_max_k2", None, 0.3), ("seq_max_k3", None, 0.4),
])
def test_each_rejection_criterion_matches_the_formula(name, lower, upper):
    keep = rc.rejection_mask(DELTA, MASK, [(name, lower, upper)])
    dropped = 0
    for b, toks in enumerate(_rows()):
        vals = [_k(name, DELTA[b, t].item()) for t in toks]
        for t in range(T):
            if t not in toks:
                assert keep[b, t] == 0
                continue
            if name.startswith("token_"):
                stat = _k(name, DELTA[b, t].item())
            else:
                stat = {"sum": sum(vals), "mean": sum(vals) / len(vals), "max": max(vals)}[name.split("_")[1]]
            ok = math.log(lower) <= stat <= math.log(upper) if name.endswith("k1") else stat <= upper
            assert keep[b, t].item() == float(ok), (name, b, t, stat)
            dropped += not ok
    assert 0 < dropped < MASK.sum()  # the bounds were chosen so each criterion drops some, not all


def test_criteria_combine_by_and():
    both = rc.rejection_mask(DELTA, MASK, [("token_k1", 0.6, 1.6), ("seq_max_k2", None, 0.3)])
    a = rc.rejection_mask(DELTA, MASK, [("token_k1", 0.6, 1.6)])
    b = rc.rejection_mask(DELTA, MASK, [("seq_max_k2", None, 0.3)])
    torch.testing.assert_close(both, a * b)


# ----------------------------------------------------------------------------- the bypass loss


def _inputs():
    logp = (torch.log(torch.rand(B, T, dtype=torch.float64)) * 0.5).requires_grad_()
    old = logp.detach() - DELTA  # the engine's log-probs: log pi_theta - log pi_rollout = DELTA
    adv = torch.randn(B, T, dtype=torch.float64)
    return PolicyLossInputs(logp=logp, old_logp=old, behav_logp=old, advantages=adv, mask=MASK, pg_mask=MASK,
                            is_weights=None, on_policy=torch.ones(B, dtype=torch.bool))


def _params(**c):
    base = dict(is_level=None, is_upper=2.0, is_lower=None, is_normalize=False, criteria=(), loss_type="ppo_clip")
    return PolicyLossParams(kernel_policy_loss=TorchBackend().policy_loss, clip_ratio_low=0.2, clip_ratio_high=0.28,
                            dual_clip_c=None, loss_agg_mode="token-mean", is_clip=2.0,
                            correction=RolloutCorrection(**{**base, **c}))


def test_reinforce_with_sequence_weights_is_minus_w_a_logp():
    x = _inputs()
    out = get_policy_loss("rollout_correction")(x, _params(is_level="sequence", is_upper=2.0, is_normalize=True,
                                                           loss_type="reinforce"))
    w = rc.normalize_weights(rc.is_weights(DELTA, MASK, level="sequence", upper=2.0), MASK, level="sequence")
    want = -(w * x.advantages * x.logp.detach() * MASK).sum() / MASK.sum()
    assert out.loss.item() == pytest.approx(want.item(), rel=1e-12)
    out.loss.backward()
    torch.testing.assert_close(x.logp.grad, -(w * x.advantages * MASK) / MASK.sum())  # w carries no gradient


def test_ppo_clip_trains_only_the_kept_tokens_with_the_step_count_as_denominator():
    from pfppo_mega.models.passes import Normalizers, share_scale

    x = _inputs()
    crit = (("token_k1", 0.6, 1.6), ("seq_max_k2", None, 2.5))
    out = get_policy_loss("rollout_correction")(x, _params(is_level="token", criteria=crit))
    keep = rc.rejection_mask(DELTA, MASK, list(crit))
    assert 0 < keep.sum() < MASK.sum()
    torch.testing.assert_close(out.mask, keep)
    ratio = torch.exp(x.logp.detach() - x.old_logp)
    surr = torch.maximum(-x.advantages * ratio, -x.advantages * ratio.clamp(0.8, 1.28))
    # verl: the kept tokens' sum over the mini-batch's tokens (its batch_num_tokens counts the rejected ones)
    share = out.loss * share_scale(out.mask, Normalizers(tokens=MASK.sum().item(), rows=4.0), mode="token-mean")
    assert share.item() == pytest.approx(((surr * keep).sum() / MASK.sum()).item(), rel=1e-10)


# ----------------------------------------------------------------------------- verl's scripts


def test_verls_rollout_correction_scripts_translate():
    c = resolve_config_dict({}, overrides_of("examples/rollout_correction/run_with_rollout_corr.sh")[0]).config
    r = c.algorithm.rollout_correction
    assert (r.rollout_is, r.rollout_is_threshold, r.rollout_is_threshold_lower, r.rollout_is_batch_normalize,
            r.rollout_rs, r.loss_type) == ("sequence", 2.0, None, True, [], "reinforce")
    assert c.algorithm.recompute_old_logp is False and r.enabled
    c = resolve_config_dict({}, overrides_of("examples/rollout_correction/run_with_rollout_corr_multi_rs.sh")[0]).config
    r = c.algorithm.rollout_correction
    assert (r.rollout_is, r.rollout_rs, r.loss_type) == ("token", ["token_k1", "seq_max_k2"], "ppo_clip")
    assert r.criteria() == [("token_k1", 0.6, 1.6), ("seq_max_k2", None, 2.5)]


def test_a_single_k1_threshold_means_its_inverse_to_it():
    r = load_config_dict({}, ["algorithm.rollout_correction.rollout_rs=token_k1,seq_sum_k3",
                              "algorithm.rollout_correction.rollout_rs_threshold=2.0",
                              "algorithm.rollout_correction.bypass_mode=true",
                              "actor_rollout_ref.model.path=/m"]).algorithm.rollout_correction
    assert r.criteria() == [("token_k1", 0.5, 2.0), ("seq_sum_k3", None, 2.0)]


def test_decoupled_mode_is_refused_with_the_fix():
    with pytest.raises(ConfigError) as e:
        load_config_dict({}, ["algorithm.rollout_correction.rollout_is=token", "actor_rollout_ref.model.path=/m"])
    assert "algorithm.rollout_correction.rollout_is" in str(e.value) and "bypass_mode=true" in str(e.value)


# ----------------------------------------------------------------------------- a tiny run


@pytest.mark.parametrize("correction", [
    {"rollout_is": "sequence", "rollout_is_batch_normalize": True, "loss_type": "reinforce"},
    {"rollout_is": "token", "rollout_rs": ["token_k1", "seq_max_k2"], "rollout_rs_upper": [1.6, 2.5],
     "rollout_rs_lower": [0.6, None]},
])
def test_tiny_runs_train(sft_small, tmp_path, correction):
    from pfppo_mega.models import gpt
    from pfppo_mega.trainer.loop import PPOTrainer
    from test_trainer import _cfg

    cfg = _cfg(tmp_path, sft_small, algorithm={"recompute_old_logp": False, "rollout_correction": correction},
               training={"total_training_steps": 2})
    tr = PPOTrainer(cfg, log=lambda *_: None)
    assert tr.run.strategies.policy_loss.name == "rollout_correction"
    actor = gpt.unwrap(tr.run.models.actor)
    before = {k: v.clone() for k, v in actor.state_dict().items() if isinstance(v, torch.Tensor)}
    rec = [tr.train_step() for _ in range(2)]
    assert all(math.isfinite(r["policy/pg_loss"]) and "rollout_corr/rs_masked_frac" in r for r in rec)
    assert any(not torch.equal(v, actor.state_dict()[k]) for k, v in before.items())
    assert rec[-1]["guard/skipped_updates"] == 0
