"""The KL term on rows an older version wrote (docs/async.md, "KL on stale rows"): k3 of such a row
is unbounded where the current policy has since made a token far less likely than the reference
does; the behaviour importance weight pi_cur / pi_behav undoes it (algorithm.kl_loss_is_weight), and
kl/ref_token_max / kl/ref_mean_is show it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pfppo_mega import ppo
from pfppo_mega.trainer.step_metrics import kl_tail
from pfppo_mega.trainer.update import kl_loss_tokens

# The token measured on SmolLM2 (issue 39, async seed 2, step 3): '7' in "11 + 4 = 17", written by
# version 1, scored under version 2 (cur), the reference and version 1's engine log-prob (behav).
CUR, REF, BEHAV = -10.966, -1.578, -2.379


def _rows():
    cur = torch.tensor([[-0.26, -0.02, CUR, -1.14], [-2.63, -0.32, -0.56, 0.0]])    # [B=2, T=4]
    ref = torch.tensor([[-0.73, -0.05, REF, -0.40], [-2.06, -0.48, -0.50, 0.0]])
    behav = torch.tensor([[-0.44, -0.03, BEHAV, -0.50], [-2.06, -0.48, -0.50, 0.0]])
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 1, 0]])
    return cur, ref, behav, mask


def _truncated_weights(cur, behav, mask, clip=2.0):
    return torch.exp(cur - behav).clamp(max=clip) * mask                           # pool.is_mode truncate


def test_one_stale_token_carries_the_mean_and_the_metrics_name_it():
    cur, ref, behav, mask = _rows()
    kl = ppo.kl_estimate(cur, ref, estimator="k3") * mask
    mean = float(kl.sum() / mask.sum())
    hot = float(torch.expm1(torch.tensor(REF - CUR)) - (REF - CUR))                # exp(d) - d - 1, d = 9.39
    assert hot > 10_000 and float(kl[0, 2]) == pytest.approx(hot, rel=1e-5)
    assert float(kl[0, 2]) / float(kl.sum()) > 0.999                               # the whole mean
    m = kl_tail(kl, mask, _truncated_weights(cur, behav, mask))
    assert m["kl/ref_token_max"] == pytest.approx(hot, rel=1e-5)
    assert mean > 1000 and m["kl/ref_mean_is"] < 1.0                               # weighted: w = e^-8.6 on it


def test_kl_tail_ignores_padding_and_omits_what_it_cannot_say():
    kl = torch.tensor([[0.5, 99.0]])
    mask = torch.tensor([[1.0, 0.0]])
    assert kl_tail(kl, mask, None) == {"kl/ref_token_max": 0.5}                   # no weights: no _is key
    assert kl_tail(kl, torch.zeros(1, 2), None) == {}                               # no token
    assert "kl/ref_mean_is" not in kl_tail(kl, mask, torch.zeros(1, 2))            # every weight 0
    neg = kl_tail(torch.tensor([[-0.3, 0.0]]), mask, None)                          # k1 can be < 0
    assert neg["kl/ref_token_max"] == pytest.approx(-0.3)


def test_weighting_by_pi_cur_over_pi_behav_recovers_the_current_policys_kl():
    """Monte Carlo on one categorical step: tokens drawn from the behaviour policy; plain k3 is
    biased far above KL(cur || ref) once cur has dropped a token the behaviour policy still writes;
    weighted by cur / behav it is unbiased."""
    ref = torch.tensor([0.40, 0.30, 0.20, 0.10])
    behav = torch.tensor([0.35, 0.30, 0.25, 0.10])
    cur = torch.tensor([0.50, 0.35, 0.15, 1e-4])
    cur = cur / cur.sum()
    true_kl = float((cur * (cur.log() - ref.log())).sum())
    g = torch.Generator().manual_seed(0)
    x = torch.multinomial(behav, 400_000, replacement=True, generator=g)           # [N] tokens
    k3 = ppo.kl_estimate(cur.log()[x], ref.log()[x], estimator="k3")               # [N]
    w = (cur / behav)[x]
    assert float(k3.mean()) > 20 * true_kl                                          # biased: 1e-4 vs 0.1
    assert float((w * k3).mean()) == pytest.approx(true_kl, rel=0.05)


def test_kl_loss_tokens_unchanged_by_default_weighted_and_detached_with_the_option():
    cur, ref, behav, mask = _rows()
    w = _truncated_weights(cur, behav, mask)
    off = SimpleNamespace(kl_estimator="k3", kl_loss_is_weight=False)
    on = SimpleNamespace(kl_estimator="k3", kl_loss_is_weight=True)
    assert torch.equal(kl_loss_tokens(off, cur, ref, w), ppo.kl_estimate(cur, ref, estimator="k3"))
    assert torch.equal(kl_loss_tokens(off, cur, ref, None), ppo.kl_estimate(cur, ref, estimator="k3"))
    logp = cur.clone().requires_grad_(True)
    w_graph = w.clone().requires_grad_(True)
    out = kl_loss_tokens(on, logp, ref, w_graph)
    assert torch.allclose(out, ppo.kl_estimate(cur, ref, estimator="k3") * w)
    assert float(out.detach()[0, 2]) < 5                                                    # 11926 unweighted
    (out * mask).sum().backward()
    assert logp.grad is not None and w_graph.grad is None                          # the weight is a constant


def test_kl_loss_tokens_refuses_missing_weights():
    cur, ref, _, _ = _rows()
    with pytest.raises(RuntimeError, match="kl_loss_is_weight"):
        kl_loss_tokens(SimpleNamespace(kl_estimator="k3", kl_loss_is_weight=True), cur, ref, None)


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory):
    """The tiny model after a short SFT (as tests/test_async.py's): responses worth training on."""
    from pathlib import Path

    from pfppo_mega.config import load_config
    from pfppo_mega.sft import run_sft

    out = tmp_path_factory.mktemp("kl_stale_sft")
    config = Path(__file__).resolve().parents[1] / "configs" / "async_tiny.yaml"
    run_sft(load_config(config, [f"sft.output_dir={out}", f"actor_rollout.model_path={out}", "sft.steps=40"]),
            log=lambda *_: None)
    return out


def test_async_tiny_logs_the_tail_and_weights_its_kl_loss(sft_dir, tmp_path, monkeypatch):
    """End to end (configs/async_tiny.yaml, stale rows from step 2 on): every step logs
    kl/ref_token_max and kl/ref_mean_is, and the actor's KL loss is given the rows' weights."""
    import json
    from pathlib import Path

    from pfppo_mega.config import load_config
    from pfppo_mega.trainer import update
    from pfppo_mega.trainer.loop import PPOTrainer

    seen = []
    real = update.kl_loss_tokens

    def spy(a, logp, ref_logp, is_weights):
        seen.append((a.kl_loss_is_weight, is_weights is not None))
        return real(a, logp, ref_logp, is_weights)

    monkeypatch.setattr(update, "kl_loss_tokens", spy)
    config = Path(__file__).resolve().parents[1] / "configs" / "async_tiny.yaml"
    cfg = load_config(config, [f"actor_rollout.model_path={sft_dir}", f"logging.output_dir={tmp_path}",
                               "training.total_training_steps=3", "algorithm.use_kl_loss=true",
                               "algorithm.kl_estimator=k3", "algorithm.kl_loss_is_weight=true"])
    with PPOTrainer(cfg, log=lambda *_: None) as t:
        res = t.fit()
    steps = [json.loads(line) for line in open(res.metrics_path) if '"kl/ref_mean"' in line]
    assert len(steps) == 3
    for r in steps:
        assert r["kl/ref_token_max"] >= r["kl/ref_mean"] >= 0
        assert r["kl/ref_mean_is"] == r["kl/ref_mean_is"]                           # logged, not NaN
    assert seen and all(seen_on and has_w for seen_on, has_w in seen)


def test_the_script_names_the_tokens_that_carry_each_step(sft_dir, tmp_path, capsys):
    """scripts/kl_stale_rows.py (the command docs/async.md gives): a row per top token a step, the
    shares of one step adding up to at most 1, and the rows saved."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "kl_stale_rows.py"
    spec = importlib.util.spec_from_file_location("kl_stale_rows", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    kl = torch.tensor([[0.1, 5.0, 0.0], [2.0, 0.5, 9.0]])
    mask = torch.tensor([[1.0, 1, 0], [1, 1, 0]])                                 # 9.0 is padding
    assert [(b, t) for b, t, _, _ in mod.top_tokens(kl, mask, 2)] == [(0, 1), (1, 0)]
    assert mod.top_tokens(kl, mask, 2)[0][3] == pytest.approx(5.0 / 7.6)
    config = path.parents[1] / "configs" / "async_tiny.yaml"
    assert mod.main([str(config), f"actor_rollout.model_path={sft_dir}", f"logging.output_dir={tmp_path}",
                     "training.total_training_steps=2", "algorithm.kl_estimator=k3", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("[kl_stale_rows] step ") == 2 and out.count("    row ") == 4
    saved = torch.load(tmp_path / "kl_rows.pt", weights_only=False)
    assert [r["step"] for r in saved] == [1, 2]
    assert saved[1]["kl"].shape == saved[1]["cur"].shape == saved[1]["mask"].shape
    with pytest.raises(SystemExit):
        mod.main([str(config), "--top", "0"])
