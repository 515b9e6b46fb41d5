"""verl 0.9.1's optimal_token_baseline (issue 36): the advantage against a reference written here from
verl's formula (loops over groups and positions), sum_v pi(v)^2 from the actor against softmax of its
logits, verl's OTB script translated, and a tiny run that trains with it."""

import math

import pytest
import torch

from pfppo_mega.config import resolve_config_dict
from pfppo_mega.ppo.outcome import optimal_token_baseline_advantages
from pfppo_mega.registry import ADV_ESTIMATORS
from test_trainer_resume import sft_small  # noqa: F401
from test_verl_layout import overrides_of


def _reference(r, m, gids, old_logp, spp, zero_tail=True):
    """verl's definition, one group and one position at a time."""
    B, T = len(r), len(r[0])
    G = [[sum(r[i][u] * m[i][u] for u in range(t, T)) for t in range(T)] for i in range(B)]
    W = [[sum((1 - 2 * math.exp(old_logp[i][u]) + spp[i][u]) * m[i][u] for u in range(t + 1)) for t in range(T)]
         for i in range(B)]
    base = [[0.0] * T for _ in range(B)]
    for g in set(gids):
        rows = [i for i in range(B) if gids[i] == g]
        if len(rows) == 1:
            continue
        for t in range(T):
            num = sum(G[i][t] * W[i][t] * m[i][t] for i in rows)
            den = sum(W[i][t] * m[i][t] for i in rows) + 1e-8
            for i in rows:
                base[i][t] = num / den
        lengths = sorted(sum(m[i]) for i in rows)
        longest = [i for i in rows if sum(m[i]) == lengths[-1]]
        if zero_tail and len(longest) == 1 and lengths[-1] > lengths[-2]:
            for t in range(int(lengths[-2]), T):
                base[longest[0]][t] = 0.0
    return [[(G[i][t] - base[i][t]) * m[i][t] for t in range(T)] for i in range(B)], \
        [[G[i][t] * m[i][t] for t in range(T)] for i in range(B)]


@pytest.mark.parametrize("zero_tail", [True, False])
def test_matches_verls_formula(zero_tail):
    torch.manual_seed(3)
    B, T = 7, 6
    lengths = [6, 4, 4, 3, 5, 2, 6]  # group 0: a unique longest (6 > 4); groups 2 and 3: one row each
    gids = [0, 0, 0, 1, 1, 2, 3]
    m = torch.tensor([[1.0] * n + [0.0] * (T - n) for n in lengths], dtype=torch.float64)
    r = torch.zeros(B, T, dtype=torch.float64)
    r[torch.arange(B), torch.tensor(lengths) - 1] = torch.randn(B, dtype=torch.float64)  # score on the last token
    r += 0.01 * torch.randn(B, T, dtype=torch.float64) * m                              # a per-token term
    old = torch.log(torch.rand(B, T, dtype=torch.float64).clamp_min(0.05))
    spp = torch.rand(B, T, dtype=torch.float64) * 0.5 + torch.exp(old) ** 2
    adv, ret = optimal_token_baseline_advantages(r, m, torch.tensor(gids), old, spp, handle_zero_tail=zero_tail)
    want_adv, want_ret = _reference(r.tolist(), m.tolist(), gids, old.tolist(), spp.tolist(), zero_tail)
    torch.testing.assert_close(adv, torch.tensor(want_adv, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret, torch.tensor(want_ret, dtype=torch.float64))
    assert torch.equal(adv[5], ret[5]) and torch.equal(adv[6], ret[6])  # groups of one: no baseline
    if zero_tail:
        assert torch.equal(adv[0, 4:], ret[0, 4:])  # the lone tail of group 0 keeps its return


def test_sum_pi_squared_is_that_of_the_actors_softmax():
    from pfppo_mega.config import load_config_dict
    from pfppo_mega.models import gpt, passes
    from pfppo_mega.types import pack

    from pfppo_mega import parallel

    cfg = load_config_dict({"model": {"num_layers": 1, "hidden_size": 32, "ffn_hidden_size": 64,
                                      "num_attention_heads": 2, "num_query_groups": 1, "vocab_size": 24,
                                      "max_position_embeddings": 16, "rope_theta": 10000.0, "norm_epsilon": 1e-5,
                                      "tie_word_embeddings": False}})
    parallel.init_parallel(tp=1, pp=1, seed=3)
    actor = gpt.build_actor(cfg.model)
    prompts, responses = [[1, 2, 3], [4, 5]], [[6, 7, 8, 9], [10, 11]]
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    inp = pack(prompts, torch.tensor([[6, 7, 8, 9], [10, 11, 0, 0]]), mask, pad_id=0, device=torch.device("cpu"))
    for response_only in (False, True):
        spp = passes.forward_sum_pi_squared(actor, inp, temperature=0.7,
                                            micro_batch_size=passes.Batching(1, response_only=response_only))
        with torch.no_grad():
            logits = gpt.actor_logits(actor, inp.input_ids).float()[..., :24] / 0.7     # [B, S, V]
        for b in range(2):
            for t in range(int(mask[b].sum())):
                p = torch.softmax(logits[b, inp.resp_pos[b, t]], -1)
                assert spp[b, t].item() == pytest.approx((p * p).sum().item(), rel=1e-5)
    assert responses  # the rows above are the packed responses


def test_verls_otb_script_translates():
    c = resolve_config_dict({}, overrides_of("examples/otb_trainer/run_qwen2_5-7b.sh")[0]).config
    assert c.algorithm.adv_estimator == "optimal_token_baseline"
    est = ADV_ESTIMATORS.get("optimal_token_baseline")
    assert est.needs_groups and est.needs_sum_pi_squared and not est.needs_critic
    assert not any(ADV_ESTIMATORS.get(n).needs_sum_pi_squared for n in ADV_ESTIMATORS if n != "optimal_token_baseline")


def test_a_tiny_run_trains_with_it(sft_small, tmp_path):
    from pfppo_mega.models import gpt
    from pfppo_mega.trainer.loop import PPOTrainer
    from test_trainer import _cfg

    tr = PPOTrainer(_cfg(tmp_path, sft_small, algorithm={"adv_estimator": "optimal_token_baseline"},
                         actor_rollout={"n_samples_per_prompt": 4}, training={"total_training_steps": 2}),
                    log=lambda *_: None)
    assert tr.run.models.critic is None
    actor = gpt.unwrap(tr.run.models.actor)
    before = {k: v.clone() for k, v in actor.state_dict().items() if isinstance(v, torch.Tensor)}
    rec = [tr.train_step() for _ in range(2)]
    assert all(math.isfinite(r["policy/pg_loss"]) for r in rec)
    assert any(not torch.equal(v, actor.state_dict()[k]) for k, v in before.items())
