"""The loss math against verl 0.9.1 (verl/trainer/ppo/core_algos.py), with expectations written out
as numbers or computed by an independent formula here (never by the function under test):

- seq-mean-token-sum-norm (Dr.GRPO): verl 0.9.1's agg_loss is, per data-parallel rank,
  sum_rows(sum_t l*m) / global_batch_size * dp_size / loss_scale_factor, global_batch_size = the
  optimizer step's rows (default: the rows with a token), and DDP averages the ranks' gradients.
  Our loss over one micro-batch == the sum of the shares over micro-batches and simulated DP
  ranks == that, in value and gradient; through the engine the step's loss and grad norm are
  verl's, whatever the micro-batch size.
- GSPO aggregates with loss_agg_mode (default token-mean) and does not clamp token log-ratios.
- Every registered loss: the weights of a tiny model move and the loss equals a written-out value.
- CISPO's canonical verl setting (clip_ratio_low = 10) is accepted.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from pfppo_mega import ppo
from pfppo_mega.constants import POLICY_LOSSES
from pfppo_mega.kernels import available_backends
from pfppo_mega.models import passes
from pfppo_mega.ppo import pg_variants as pgv
from pfppo_mega.trainer import policy_loss as tpl

DRGRPO = "seq-mean-token-sum-norm"
BACKENDS = available_backends()


def _dt(backend):
    """The fused kernels compute float32 (checked against torch's float64 formula at float32's tolerance)."""
    return (torch.float32, 1e-6) if backend.name == "fused" else (torch.float64, 1e-12)


# ----------------------------------------------------------------------------- Dr.GRPO, written out

# 4 rows, T = 4: lengths 3, 2, 0, 4 (row 2 has no token), one advantage per row (GRPO's).
LENGTHS = [3, 2, 0, 4]
ROW_ADV = [1.0, -2.0, 7.0, 0.5]  # row 2's advantage is on no token: it must not count


def _fixed(dtype=torch.float64):
    mask = torch.tensor([[1.0] * n + [0.0] * (4 - n) for n in LENGTHS], dtype=dtype)       # [4, 4]
    adv = torch.tensor(ROW_ADV, dtype=dtype)[:, None].expand(4, 4).clone()
    return mask, adv


def _split_shares(loss_of, mask, parts, mode):
    """sum over parts (micro-batches of every simulated DP rank) of loss_of(part) * share_scale, with the
    global normalisers of the whole step, as the engine's loss_fn returns them."""
    norm = passes.Normalizers(tokens=float(mask.sum()), rows=float((mask.sum(1) > 0).sum()))
    return sum(loss_of(idx) * passes.share_scale(mask[idx], norm, mode=mode, like=torch.zeros((), dtype=mask.dtype))
               for idx in parts)


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_dr_grpo_loss_and_gradient_written_out(backend):
    """logp == old_logp (ratio 1, no clip active): pg = -A per token. sum(-A m) = -3 + 4 - 2 = -1 over
    3 rows with a token and loss_scale_factor 8: -1 / 3 / 8 = -1/24 (the code before verl 0.9.1 gave
    -1/8). d loss / d logp = -A / 24 on each real token."""
    dtype, tol = _dt(backend)
    mask, adv = _fixed(dtype)
    logp = torch.full((4, 4), -1.3, dtype=dtype, requires_grad=True)
    old = torch.full((4, 4), -1.3, dtype=dtype)
    out = backend.policy_loss(logp, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode=DRGRPO,
                              loss_scale_factor=8.0)
    assert out.loss.item() == pytest.approx(-1 / 24, rel=tol, abs=0)
    out.loss.backward()
    want = torch.tensor([[-1 / 24] * 3 + [0.0], [2 / 24] * 2 + [0.0] * 2, [0.0] * 4, [-0.5 / 24] * 4], dtype=dtype)
    torch.testing.assert_close(logp.grad, want, rtol=tol, atol=tol * 1e-3)
    mask, adv = _fixed()
    # plain agg_loss on the same per-token loss, and the default constant T = 4: -1 / 3 / 4
    assert ppo.agg_loss(-adv, mask, mode=DRGRPO).item() == pytest.approx(-1 / 12, rel=1e-14, abs=0)


def test_dr_grpo_shares_over_micro_batches_and_dp_ranks_written_out():
    """Two simulated DP ranks (rows {0, 1} and {2, 3}), one row per micro-batch: verl 0.9.1 per rank
    = rank sum / 3 * 2 / 8: rank 0 = (-3 + 4) / 12 = 1/12, rank 1 = (0 - 2) / 12 = -1/6; DDP's mean
    of the two = -1/24, the single micro-batch's value."""
    mask, adv = _fixed()
    per_token = -adv
    for parts in ([torch.arange(4)], [torch.tensor([0, 1]), torch.tensor([2, 3])],
                  [torch.tensor([i]) for i in range(4)], [torch.tensor([3, 0]), torch.tensor([2]), torch.tensor([1])]):
        total = _split_shares(lambda idx: ppo.agg_loss(per_token[idx], mask[idx], mode=DRGRPO, loss_scale_factor=8.0),
                              mask, parts, DRGRPO)
        assert total.item() == pytest.approx(-1 / 24, rel=1e-12, abs=0), parts


def _verl_pg(logp, old, adv, eps_low, eps_high):
    """The clipped surrogate per token, written here (verl's compute_policy_loss_vanilla, no dual clip)."""
    ratio = torch.exp(logp - old)
    return torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps_low, 1 + eps_high))


def _verl_drgrpo_step_loss(pg, mask, rank_rows, c):
    """verl 0.9.1: each rank's agg_loss = sum_rows(sum_t pg m) / global_batch_size * dp_size / c, DDP
    averages the ranks: the step's effective loss is the mean over ranks of that."""
    dp = len(rank_rows)
    global_bs = float(sum(int((mask[r].sum(1) > 0).sum()) for r in rank_rows))
    per_rank = [(pg[r] * mask[r]).sum() / global_bs * dp / c for r in rank_rows]
    return sum(per_rank) / dp


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
@pytest.mark.parametrize("dp,micro", [(1, 12), (1, 5), (2, 3), (3, 1), (4, 2)])
def test_dr_grpo_equals_verl_091_under_micro_batching_and_dp(backend, dp, micro):
    """Random rows (some without a token): the sum of our shares over micro-batches of `micro` rows on
    `dp` simulated ranks == verl 0.9.1's step loss computed by its formula here, value and gradient."""
    gen = torch.Generator().manual_seed(11)
    B, T, C = 12, 9, 16.0
    lengths = torch.randint(0, T + 1, (B,), generator=gen)
    lengths[[2, 7]] = 0
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()                 # [B, T]
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    logp0 = old + 0.4 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    adv = torch.randn(B, T, generator=gen, dtype=torch.float64)
    ranks = list(torch.arange(B).chunk(dp))

    lp_verl = logp0.clone().requires_grad_()
    want = _verl_drgrpo_step_loss(_verl_pg(lp_verl, old, adv, 0.2, 0.28), mask, ranks, C)
    want.backward()

    dtype, tol = _dt(backend)
    lp = logp0.to(dtype).requires_grad_()
    parts = [mb for r in ranks for mb in r.split(micro)]
    got = _split_shares(lambda idx: backend.policy_loss(lp[idx], old[idx].to(dtype), adv[idx].to(dtype),
                                                        mask[idx].to(dtype), clip_ratio_low=0.2, clip_ratio_high=0.28,
                                                        loss_agg_mode=DRGRPO, loss_scale_factor=C).loss,
                        mask.to(dtype), parts, DRGRPO)
    got.backward()
    assert abs(got.item() - want.item()) < 10 * tol * max(1.0, abs(want.item())), (got.item(), want.item())
    torch.testing.assert_close(lp.grad.double(), lp_verl.grad, rtol=100 * tol, atol=tol * 1e-2)


# ----------------------------------------------------------------------------- GSPO


def test_gspo_token_log_ratios_are_not_clamped_and_nothing_overflows():
    """verl 0.9.1 takes the mean of the raw token log-ratios and clamps only the sequence one at 10.
    Row 0: log-ratios 25 and -5 -> mean 10 -> s = e^10 (a +-20 token clamp would give 7.5);
    row 1: -400 and -600 -> s = e^-500 = 0 in float32, finite loss and gradient. A = 1, token-mean over
    4 tokens, clip 0.2 / 0.28: row 0 pg = max(-e^10, -1.28) = -1.28 on 2 tokens; row 1 pg =
    max(-0, -0.8) = 0. Loss = -2.56 / 4 = -0.64."""
    old = torch.tensor([[-30.0, -1.0], [-1.0, -1.0]])
    logp = torch.tensor([[-5.0, -6.0], [-401.0, -601.0]], requires_grad=True)
    adv, mask = torch.ones(2, 2), torch.ones(2, 2)
    loss, _ = pgv.gspo_loss(logp, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28)
    assert loss.item() == pytest.approx(-0.64, rel=1e-6)
    loss.backward()
    assert torch.isfinite(logp.grad).all()
    # unclipped (eps_high large): row 0 gives -e^10 on 2 tokens, over 4 tokens
    loss2, _ = pgv.gspo_loss(logp, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=1e6)
    assert loss2.item() == pytest.approx(-2 * math.exp(10.0) / 4, rel=1e-6)


def test_gspo_takes_loss_agg_mode_through_the_registry():
    """Rows of 1 and 3 tokens, ratio 1, A = 1 and 3: token-mean -(1 + 9) / 4 = -2.5; seq-mean-token-mean
    -(1 + 3) / 2 = -2; Dr.GRPO with constant 3: -(1 + 9) / 2 / 3 = -5/3. The trainer scales by the run's
    loss_agg_mode (agg_mode None)."""
    mask = torch.tensor([[1.0, 0, 0], [1, 1, 1]], dtype=torch.float64)
    adv = torch.tensor([[1.0] * 3, [3.0] * 3], dtype=torch.float64)
    logp = torch.full((2, 3), -0.7, dtype=torch.float64, requires_grad=True)
    x = tpl.PolicyLossInputs(logp=logp, old_logp=logp.detach(), behav_logp=logp.detach(), advantages=adv, mask=mask,
                             pg_mask=mask, is_weights=None, on_policy=torch.ones(2, dtype=torch.bool))
    for mode, want in (("token-mean", -2.5), ("seq-mean-token-mean", -2.0), (DRGRPO, -5 / 3)):
        res = tpl.get_policy_loss("gspo")(x, _params(loss_agg_mode=mode, loss_scale_factor=3.0))
        assert res.loss.item() == pytest.approx(want, rel=1e-12), mode
        assert res.agg_mode is None


# ----------------------------------------------------------------------------- every loss: weights move

V, H = 5, 3
LOG_V = math.log(V)  # 1.6094379124341003: logits 0 at the start, every token's log-prob is -log 5
MB_LENGTHS = [3, 2, 0, 4]
MB_ADV = [1.0, -2.0, 7.0, 0.5]
# At the start ratio = 1 (old_logp = logp) and logp = -log 5 everywhere. Token-mean over the 9 tokens:
# sum A = 3 - 4 + 2 = 1. Row means of the rows with a token: 1, -2, 0.5.
WANT = {
    "ppo_clip": -1 / 9,                                  # -A
    "gspo": -1 / 9,                                      # s = 1: -A, token-mean (verl 0.9.1's default)
    "sapo": (-2.0 + 4 / 1.05 - 1.0) / 3,                 # -A f(1), f(1) = 2 / tau (tau 1.05 where A <= 0), seq-mean
    "gpg": LOG_V / 9,                                    # -logp A
    "cispo": LOG_V / 9,                                  # -sg[clip(1)] A logp
    "clip_cov": -1 / 9,                                  # covariance 0 (logp constant): no token cut
    "kl_cov": -1 / 9,                                    # |log r| = 0 on the chosen token
    "geo_mean": -(1.0 - 2.0 + 0.5) / 3,                  # rows: -mean_t A * exp(0)
}
# Dr.GRPO with loss_scale_factor 4 for the losses that take loss_agg_mode: sum / 3 rows / 4
WANT_DRGRPO = {"ppo_clip": -1 / 12, "gspo": -1 / 12, "gpg": LOG_V / 12, "cispo": LOG_V / 12}


def _params(**kw):
    base = dict(kernel_policy_loss=ppo.policy_loss, clip_ratio_low=0.2, clip_ratio_high=0.28, dual_clip_c=None,
                loss_agg_mode="token-mean", is_clip=2.0, generator=torch.Generator().manual_seed(0))
    return tpl.PolicyLossParams(**{**base, **kw})


def _model_logp(model, x, labels):
    logits = model(x)                                                             # [B, T, V]
    return torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0]    # [B, T]


# Dr.GRPO only for the losses that take loss_agg_mode and have a written Dr.GRPO value (sapo and geo_mean
# aggregate their own way, pgv.AGG_MODE; clip_cov and kl_cov are checked at token-mean)
CASES = [(name, "token-mean") for name in POLICY_LOSSES] + [(name, DRGRPO) for name in WANT_DRGRPO]


@pytest.mark.parametrize("name, mode", CASES)
def test_every_loss_moves_the_weights_and_equals_the_written_value(name, mode):
    torch.manual_seed(0)
    model = torch.nn.Linear(H, V).double()
    torch.nn.init.zeros_(model.weight)
    torch.nn.init.zeros_(model.bias)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 4, H, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, V, (4, 4), generator=gen)
    mask = torch.tensor([[1.0] * n + [0.0] * (4 - n) for n in MB_LENGTHS], dtype=torch.float64)
    adv = torch.tensor(MB_ADV, dtype=torch.float64)[:, None].expand(4, 4).clone()
    with torch.no_grad():
        old = _model_logp(model, x, labels)
    params = _params(loss_agg_mode=mode, loss_scale_factor=4.0)

    def loss_now(loss_name=name):
        logp = _model_logp(model, x, labels)
        inp = tpl.PolicyLossInputs(logp=logp, old_logp=old, behav_logp=old, advantages=adv, mask=mask, pg_mask=mask,
                                   is_weights=None, on_policy=torch.ones(4, dtype=torch.bool))
        return tpl.get_policy_loss(loss_name)(inp, params).loss

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    # CISPO's value carries the detached ratio weight, which the step changes; its gradient at ratio 1 is
    # GPG's (-A grad logp), so the step must lower GPG's value
    descent_of = "gpg" if name == "cispo" else name
    with torch.no_grad():
        start = loss_now(descent_of).item()
    loss = loss_now()
    want = (WANT if mode == "token-mean" else WANT_DRGRPO)[name]
    tol = 1e-7 if name == "geo_mean" else 1e-12  # geo_mean: verl's 1e-8 in the row denominators
    assert abs(loss.item() - want) < tol * max(1.0, abs(want)), (name, mode, loss.item(), want)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loss.backward()
    opt.step()
    moved = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert moved == ["weight", "bias"], (name, moved)
    with torch.no_grad():
        after = loss_now(descent_of).item()
    assert after < start, (name, mode, descent_of, start, after)  # a descent step


# ----------------------------------------------------------------------------- CISPO's canonical setting


def test_cispo_accepts_verls_canonical_clip_ratio_low_and_others_still_refuse_it():
    from pfppo_mega.config import ConfigError, load_config, resolve_config_dict

    a = load_config("configs/tiny_cpu.yaml", ["algorithm.policy_loss=cispo", "algorithm.clip_ratio_low=10",
                                              "algorithm.clip_ratio_high=0.2"]).algorithm
    assert (a.policy_loss, a.clip_ratio_low, a.clip_ratio_high) == ("cispo", 10.0, 0.2)
    # as a verl launch script writes it
    a = resolve_config_dict({}, ["actor_rollout_ref.model.path=/m", "actor_rollout_ref.actor.policy_loss.loss_mode=cispo",
                                 "actor_rollout_ref.actor.clip_ratio_low=10",
                                 "actor_rollout_ref.actor.clip_ratio_high=0.2"]).config.algorithm
    assert (a.policy_loss, a.clip_ratio_low, a.clip_ratio_high) == ("cispo", 10.0, 0.2)
    with pytest.raises(ConfigError, match=r"algorithm.clip_ratio_low = 10.0: must be > 0 and < 1"):
        load_config("configs/tiny_cpu.yaml", ["algorithm.clip_ratio_low=10"])
    with pytest.raises(ConfigError, match=r"algorithm.clip_ratio_low = -1.0: must be > 0"):
        load_config("configs/tiny_cpu.yaml", ["algorithm.policy_loss=cispo", "algorithm.clip_ratio_low=-1"])


def test_cispo_with_eps_low_10_does_not_clip_a_small_ratio():
    """eps_low = 10: the lower bound 1 - 10 < 0 never binds. Ratios 0.01 and 3 (eps_high 0.2 -> 1.2),
    A = 1, logp = -1 and -2: token-mean of -w A logp = (0.01 * 1 + 1.2 * 2) / 2 = 1.205."""
    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.0 - math.log(0.01), -2.0 - math.log(3.0)]], dtype=torch.float64)
    loss, st = pgv.cispo_loss(logp, old, torch.ones(1, 2, dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64),
                              clip_ratio_low=10.0, clip_ratio_high=0.2, loss_agg_mode="token-mean")
    assert loss.item() == pytest.approx(1.205, rel=1e-12)
    assert st["pg_clipfrac"].item() == pytest.approx(0.5)


# ----------------------------------------------------------------------------- through the engine

sys.path.insert(0, str(Path(__file__).resolve().parent / "multirank"))


@pytest.fixture(scope="module")
def tiny_actor(tmp_path_factory):
    import common  # noqa: E402

    from pfppo_mega import parallel
    from pfppo_mega.compat import megatron_cpu
    from pfppo_mega.models import gpt, hf_io

    parallel.init_parallel(tp=1, pp=1, seed=1234)
    path = common.make_checkpoints(tmp_path_factory.mktemp("verl091"))["llama"]

    def build():
        cfg, arch = common.model_config(path)
        actor = gpt.build_actor(cfg, arch=arch)
        hf_io.load_actor_from_hf(actor, path)
        ddp = gpt.wrap_ddp(actor)
        return ddp, gpt.build_optimizer(ddp, lr=common.LR, weight_decay=common.WEIGHT_DECAY, grad_clip=1e9)
    yield common, build
    parallel.destroy_parallel()
    megatron_cpu.disable()


def test_engine_dr_grpo_step_loss_and_grad_norm_are_verls_at_any_micro_batch_size(tiny_actor):
    """passes.train_step with the trainer's Dr.GRPO share: the step's loss and grad norm at micro-batch
    sizes 8, 3 and 1 equal verl 0.9.1's loss (sum of pg m / rows with a token / C) and the norm of its
    gradient, both computed here by a plain backward of that formula through the same model."""
    from pfppo_mega.kernels import get_backend
    from pfppo_mega.models import gpt

    common, build = tiny_actor
    kernels = get_backend("torch")
    batch = common.ppo_batch()
    inp, mask = batch.inputs, batch.inputs.response_mask
    C = 6.0
    rows = float((mask.sum(1) > 0).sum())
    ddp, opt = build()
    with torch.no_grad():
        logp0, _ = passes.forward_logp_entropy(ddp, inp, temperature=common.TEMPERATURE, micro_batch_size=8)
    old = (logp0 + batch.logp_noise) * mask

    # verl's formula, a plain backward through the model
    ddp.train()
    gpt.zero_grads(ddp, opt)
    res_ref = passes.train_step(
        ddp, opt, inp, lambda logp, ent, mb: (
            (_verl_pg(logp, old[mb.rows], batch.advantages[mb.rows], 0.2, 0.28) * mb.inputs.response_mask).sum()
            / rows / C, {}),
        temperature=common.TEMPERATURE, micro_batch_size=8, kernels=kernels)
    results = []
    for micro in (8, 3, 1):
        ddp, opt = build()
        ddp.train()

        def loss_fn(logp, ent, mb):
            m = mb.inputs.response_mask
            out = kernels.policy_loss(logp, old[mb.rows], batch.advantages[mb.rows], m, clip_ratio_low=0.2,
                                      clip_ratio_high=0.28, loss_agg_mode=DRGRPO, loss_scale_factor=C)
            return out.loss * passes.share_scale(m, mb.norm, mode=DRGRPO, like=out.loss), {}
        res = passes.train_step(ddp, opt, inp, loss_fn, temperature=common.TEMPERATURE, micro_batch_size=micro,
                                kernels=kernels)
        results.append((micro, res.loss, res.grad_norm))
    for micro, loss, norm in results:
        assert loss == pytest.approx(res_ref.loss, rel=1e-5), (micro, loss, res_ref.loss)
        assert norm == pytest.approx(res_ref.grad_norm, rel=1e-4), (micro, norm, res_ref.grad_norm)
