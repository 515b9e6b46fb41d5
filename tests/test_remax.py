"""ReMax (algorithm.adv_estimator = remax): the formula against a reference written from verl's
compute_remax_outcome_advantage one token at a time; the estimator's declaration; verl's key; and a
2-step CPU run whose baselines are the rewards of greedy responses from the current weights."""

import json

import pytest
import torch

from pfppo_mega.ppo import outcome
from pfppo_mega.registry import ADV_ESTIMATORS
from pfppo_mega.rollout import SamplingParams
from pfppo_mega.trainer.estimators import AdvantageEstimator, _remax
from pfppo_mega.trainer.colocation.generation import check_colocation_order
from pfppo_mega.trainer.loop import PPOTrainer

from test_trainer import _cfg, sft_dir  # noqa: F401  (the module's SFT checkpoint fixture)


def _reference(token_rewards, lengths, baselines):
    """verl: returns_t = sum_{t' >= t} r_t' (reversed cumulative sum); A_t = returns_t - b; 0 on padding."""
    B, T = token_rewards.shape
    adv, ret = torch.zeros(B, T, dtype=torch.float64), torch.zeros(B, T, dtype=torch.float64)
    for i in range(B):
        running = 0.0
        for t in reversed(range(lengths[i])):
            running += float(token_rewards[i, t])
            ret[i, t] = running
            adv[i, t] = running - float(baselines[i])
    return adv, ret


@pytest.mark.parametrize("kl_in_reward", [False, True])
def test_remax_advantages_match_verls_formula(kl_in_reward):
    g = torch.Generator().manual_seed(0)
    lengths, T = [7, 1, 4, 3, 6], 7
    B = len(lengths)
    mask = torch.zeros(B, T, dtype=torch.float64)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    scores = torch.tensor([1.0, 0.0, 0.5, -1.0, 2.0], dtype=torch.float64)
    tr = torch.zeros(B, T, dtype=torch.float64)
    for i, n in enumerate(lengths):
        tr[i, n - 1] = scores[i]
    if kl_in_reward:  # a per-token penalty: the returns vary along the response
        tr = tr + torch.randn(B, T, generator=g, dtype=torch.float64) * mask
    tr = torch.where(mask.bool(), tr, torch.full_like(tr, float("nan")))  # NaN padding must not leak
    baselines = torch.tensor([0.5, 0.0, 1.0, -1.0, 3.0], dtype=torch.float64)
    adv, ret = outcome.remax_advantages(tr, mask, baselines)
    ref_adv, ref_ret = _reference(torch.nan_to_num(tr), lengths, baselines)
    torch.testing.assert_close(adv, ref_adv, rtol=0, atol=1e-12)
    torch.testing.assert_close(ret, ref_ret, rtol=0, atol=1e-12)
    if not kl_in_reward:  # outcome reward only: score - baseline on every response token
        torch.testing.assert_close(adv, (scores - baselines)[:, None] * mask, rtol=0, atol=1e-12)


def test_remax_is_registered_declares_a_greedy_baseline_and_loads_from_verls_key():
    from pfppo_mega.config import load_config, resolve_config_dict

    est = ADV_ESTIMATORS.get("remax")
    assert est.needs_greedy_baseline and not est.needs_critic and not est.needs_groups
    assert not any(ADV_ESTIMATORS.get(n).needs_greedy_baseline for n in ADV_ESTIMATORS if n != "remax")
    assert load_config("configs/tiny_cpu.yaml", ["algorithm.adv_estimator=remax"]).algorithm.adv_estimator == "remax"
    from test_verl_layout import overrides_of

    for script in ("examples/remax_trainer/run_qwen2.5-3b_seq_balance.sh",
                   "examples/remax_trainer/run_qwen2.5-7b_seq_balance.sh"):  # verl's own, unchanged
        overrides = overrides_of(script)[0]
        assert "algorithm.adv_estimator=remax" in overrides
        assert resolve_config_dict({}, overrides).config.algorithm.adv_estimator == "remax"


def test_remax_with_batch_scaled_rewards_is_refused_at_start():
    from pfppo_mega.config import load_config
    from pfppo_mega.trainer.build import SetupError, check_groups

    cfg = load_config("configs/tiny_cpu.yaml", ["algorithm.adv_estimator=remax", "reward.scaling=batch_zscore"])
    with pytest.raises(SetupError, match=r"reward.scaling = 'batch_zscore'"):
        check_groups(cfg, ADV_ESTIMATORS.get("remax"))


N = 2
SEEN: list = []


@pytest.fixture
def watched_remax():
    """remax, recording what each step's estimator saw and returned."""
    def compute(x, ctx):
        adv, ret = _remax(x, ctx)
        SEEN.append((x, adv))
        return adv, ret
    SEEN.clear()
    ADV_ESTIMATORS.register("remax_watched", AdvantageEstimator("remax_watched", needs_critic=False, compute=compute,
                                                                needs_greedy_baseline=True))
    yield
    ADV_ESTIMATORS.unregister("remax_watched")


@pytest.mark.parametrize("pool", [False, True], ids=["current", "pf_ppo_pool"])
def test_remax_trains_with_greedy_baselines_from_the_current_weights(sft_dir, tmp_path, watched_remax, pool):  # noqa: F811
    """With the PF-PPO pool the engine may hold an older snapshot after the rollout: the greedy
    baseline must still come from the current weights (checked against a greedy generation made
    with the current weights, apart from the trainer, before the update)."""
    algorithm = {"adv_estimator": "remax_watched", "kl_coeff": 0.0}
    if pool:
        algorithm.update(use_pf_ppo=True, pool={"pool_size": 2, "snapshot_interval": 10})  # step 2 samples from version 0
    cfg = _cfg(tmp_path, sft_dir, algorithm=algorithm,
               actor_rollout={"n_samples_per_prompt": N, "temperature": 1.5},
               training={"rollout_batch_size": 16, "batch_size": 32, "total_training_steps": 2})
    tr = PPOTrainer(cfg, log=lambda *_: None)
    run = tr.run
    assert run.models.critic is None
    greedy_seen = []
    score = tr.score

    def score_and_check(rb):
        """The step's prompts answered greedily by the engine, apart from the trainer, with the weights
        the rollout used (before this step's update), and scored by the run's reward function."""
        sb = score(rb)
        first = {}
        for i, gid in enumerate(rb.group_ids.tolist()):
            first.setdefault(gid, i)
        samples = [rb.samples[i] for i in first.values()]
        params = SamplingParams(temperature=1.0, top_p=1.0, greedy=True, max_new_tokens=cfg.algorithm.max_response_length,
                                eos_token_id=run.tokenizer.eos_id, seed=123)
        with run.colocation.gen.colocated(run.state.step, refit=True):
            out = run.colocation.gen.run_engine([list(s.prompt_ids) for s in samples], params, step=run.state.step, what="test")
        texts = [run.tokenizer.decode(r[: int(n)].tolist()) for r, n in zip(out.responses, out.lengths)]
        rewards = run.reward_fn(samples, texts, out.finished.tolist()).scores.double()
        greedy_seen.append((rb, sb, list(first), texts, rewards))
        return sb

    tr.score = score_and_check
    before = [p.detach().clone() for p in run.models.actor.parameters()]
    res = tr.fit()
    after = list(run.models.actor.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, after)), "the weights did not move"
    check_colocation_order([name for name, _ in run.colocation.gen.events])   # the greedy call sits in the rollout's frame
    steps = [json.loads(line) for line in open(res.metrics_path)][1:]
    assert [s["step"] for s in steps] == [1, 2] and len(SEEN) == 2 and len(greedy_seen) == 2
    for s, (x, adv), (rb, sb, groups, texts, rewards) in zip(steps, SEEN, greedy_seen):
        slot = {g: k for k, g in enumerate(groups)}
        per_row = [slot[g] for g in rb.group_ids.tolist()]
        if pool and s["step"] == 2:  # the rollout used the initial snapshot; the baseline the current weights
            assert (rb.versions == 0).all()
        assert (rb.baseline.versions == s["step"] - 1).all()              # the current weights, before the update
        assert rb.baseline.texts == [texts[k] for k in per_row]          # greedy, from the current weights
        assert len(rb.texts) == len(rb.baseline.texts) == 16 * N        # trained rows: the sampled ones only
        assert rb.texts != rb.baseline.texts                             # the samples are not the greedy ones
        torch.testing.assert_close(x.baselines.double().cpu(), rewards[per_row])
        assert s["remax/baseline_mean"] == pytest.approx(float(rewards[per_row].mean()))
        m = x.mask
        want = (sb.scores.double().cpu() - rewards[per_row])[:, None] * m.double().cpu()  # kl_coeff 0: outcome only
        torch.testing.assert_close(adv.double().cpu(), want)
