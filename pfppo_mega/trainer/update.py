"""The update phase: ppo_epochs passes of shuffled mini-batches; each mini-batch is one critic
step (when the run has a critic) and one actor step, micro-batched by megatron's schedule."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from pfppo_mega import ppo
from pfppo_mega.config import Config
from pfppo_mega.models import passes as model_passes
from pfppo_mega.trainer import passes
from pfppo_mega.trainer.batch import ExperienceBatch
from pfppo_mega.trainer.build import DataParallel, Models, Strategies, TrainState
from pfppo_mega.trainer.instruments import devicecheck
from pfppo_mega.trainer.lr_schedule import lr_factor, warmup_steps
from pfppo_mega.trainer.policy_loss import PolicyLossInputs
from pfppo_mega.trainer.seeds import stream_seed
from pfppo_mega.trainer.value_guard import pre_update_value_loss


class TrainingHalted(RuntimeError):
    """The run cannot make progress (e.g. every update skipped for too long); the message says why.
    `pfppo train` exits non-zero with it."""


@dataclass
class Observed:
    """The actor's own log-probs and entropy of every row, as its first epoch's forward saw them
    (observe=True: the proximal log-probs were not recomputed, trainer/proximal.py). ``fresh``
    rows were in the first mini-batch, before any optimizer step of this update: their log-probs
    are those of the weights that generated them when the rows are on-policy."""

    logp: torch.Tensor      # [B, T]
    entropy: torch.Tensor   # [B, T]
    fresh: torch.Tensor     # [B] bool


def update(eb: ExperienceBatch, *, cfg: Config, models: Models, strategies: Strategies, state: TrainState,
           dp: DataParallel, device: torch.device, log: Callable[[str], None],
           observe: bool = False) -> tuple[dict[str, float], Optional[Observed]]:
    """batch_size / dp rows on this rank per mini-batch; means of every mini-batch's stats, and
    with ``observe`` what the actor's first epoch saw (None when the actor did not train)."""
    a, t, st = cfg.algorithm, cfg.training, state
    B = eb.advantages.shape[0]
    stats: dict[str, list[float]] = {}
    train_actor = st.step >= t.critic_warmup_steps
    train_critic = models.critic is not None
    if train_critic:  # value-loss spike guard (trainer/value_guard.py): judged on the loss before any update
        vl_pre = pre_update_value_loss(eb.old_values, eb.returns, eb.inputs.response_mask, reduce_sum=dp.sum)
        train_critic = not st.value_guard.is_spike(vl_pre)
        if not train_critic:
            st.guards["value_loss_spikes"] += 1
        stats["critic/value_loss_pre"] = [vl_pre]
    lrs = set_learning_rates(models, t, st.step, train_actor=train_actor)
    stats.update({f"optim/{k}": [v] for k, v in lrs.items()})
    g = torch.Generator().manual_seed(stream_seed("minibatches", t.seed, step=st.step))
    seen = _Observer(eb) if observe and train_actor else None
    parts = dict(cfg=cfg, models=models, strategies=strategies, state=state, device=device, log=log)
    for epoch in range(a.ppo_epochs):
        for k_mb, idx in enumerate(torch.randperm(B, generator=g).split(t.batch_size // dp.size)):
            mb = eb.select(idx)
            for k, v in (critic_step(mb, **parts) if train_critic else {}).items():
                stats.setdefault(k, []).append(v)
            if train_actor:
                sink = None if seen is None or epoch > 0 else seen.sink(idx, fresh=k_mb == 0)
                for k, v in actor_step(mb, **parts, sink=sink).items():
                    stats.setdefault(k, []).append(v)
    return {k: sum(v) / len(v) for k, v in stats.items()}, None if seen is None else seen.result(device)


def set_learning_rates(models: Models, training, step: int, *, train_actor: bool) -> dict[str, float]:
    """The one place the lr changes during training (trainer/lr_schedule.py): before this step's
    updates, each optimizer's param groups get base lr * lambda(k) (* the group's lr_mult, as
    megatron's scheduler), k = the updates that optimizer has made before: the critic's = the step,
    the actor's = the step - critic_warmup_steps (verl steps the actor's scheduler only when it updates)."""
    t = training
    actor_warm = warmup_steps(steps=t.lr_warmup_steps, ratio=t.lr_warmup_ratio, total_steps=t.total_training_steps)
    critic_warm = actor_warm if t.critic_lr_warmup_ratio is None else \
        warmup_steps(steps=None, ratio=t.critic_lr_warmup_ratio, total_steps=t.total_training_steps)
    out = {}
    for name, opt, base, k, warm in (("actor_lr", models.actor_opt, t.lr, step - t.critic_warmup_steps, actor_warm),
                                     ("critic_lr", models.critic_opt, t.critic_lr, step, critic_warm)):
        if opt is None or (name == "actor_lr" and not train_actor):
            continue
        lr = base * lr_factor(k, warmup=warm, total_steps=t.total_training_steps, schedule=t.lr_schedule,
                              min_lr_ratio=t.min_lr_ratio)
        for group in opt.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
        out[name] = lr
    return out


class _Observer:
    """Collects the first epoch's log-probs and entropy into [B, T] (on the last pipeline stage,
    where the loss runs; result() gives them to every stage)."""

    def __init__(self, eb: ExperienceBatch) -> None:
        m = eb.inputs.response_mask
        self.logp, self.entropy = torch.zeros_like(m, dtype=torch.float32), torch.zeros_like(m, dtype=torch.float32)
        self.fresh = torch.zeros(m.shape[0], dtype=torch.float32, device=m.device)

    def sink(self, idx: torch.Tensor, *, fresh: bool) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]:
        """For one mini-batch ``idx`` (rows of the batch): sink(rows of the mini-batch, logp, entropy)."""
        idx = idx.to(self.logp.device)

        def put(rows: torch.Tensor, logp: torch.Tensor, entropy: torch.Tensor) -> None:
            at = idx[rows]
            self.logp[at] = logp.detach().float()
            self.entropy[at] = entropy.detach().float()
            self.fresh[at] = float(fresh)
        return put

    def result(self, device: torch.device) -> Observed:
        both = model_passes.from_last_stage(torch.cat([self.logp, self.entropy, self.fresh[:, None]], dim=1), device)
        T = self.logp.shape[1]
        return Observed(logp=both[:, :T], entropy=both[:, T:2 * T], fresh=both[:, 2 * T] > 0.5)


def actor_step(eb: ExperienceBatch, *, cfg: Config, models: Models, strategies: Strategies, state: TrainState,
               device: torch.device, log: Callable[[str], None], sink: Optional[Callable] = None) -> dict[str, float]:
    """Policy loss (+ KL loss, - entropy bonus). The loss function returns each micro-batch's
    share of the mini-batch aggregate (see pfppo_mega.models.passes). ``sink(rows, logp,
    entropy)``, when given, receives each micro-batch's log-probs and entropy (update's Observed)."""
    a = cfg.algorithm
    mode, c = a.loss_agg_mode, strategies.policy_loss_params.loss_scale_factor
    # The mask the variant declares its aggregate is over: pg_mask, or every response token (tis).
    pg_norm = model_passes.global_normalizers(eb.pg_mask if strategies.policy_loss.trains_on_pg_mask
                                              else eb.inputs.response_mask)

    def loss_fn(logp, entropy, micro: model_passes.MicroBatch):
        r = micro.rows
        m = micro.inputs.response_mask
        pl_in = PolicyLossInputs(
            logp=logp, old_logp=eb.old_logp[r], behav_logp=eb.behav_logp[r], advantages=eb.advantages[r],
            mask=m, pg_mask=eb.pg_mask[r], is_weights=None if eb.is_weights is None else eb.is_weights[r],
            on_policy=eb.on_policy[r])
        devicecheck.expect("policy loss", device, inputs=pl_in, entropy=entropy, ref_logp=eb.ref_logp[r])
        if sink is not None:
            sink(r, logp, entropy)
        pl = strategies.policy_loss(pl_in, strategies.policy_loss_params)
        share = pl.loss * model_passes.share_scale(pl.mask, pg_norm, mode=pl.agg_mode or mode, like=pl.loss)
        resp_share = model_passes.share_scale(m, micro.norm, mode=mode, like=pl.loss)
        kl_loss = logp.new_zeros(())
        if a.use_kl_loss and a.kl_coeff > 0:
            kl_loss = ppo.agg_loss(kl_loss_tokens(a, logp, eb.ref_logp[r], None if eb.is_weights is None
                                                  else eb.is_weights[r]), m, mode=mode, loss_scale_factor=c)
            share = share + a.kl_coeff * kl_loss * resp_share
        ent = ppo.agg_loss(entropy, m, mode=mode, loss_scale_factor=c)
        if a.entropy_coeff > 0:
            share = share - a.entropy_coeff * ent * resp_share
        return share, {**pl.stats, "policy/kl_loss": kl_loss.detach(), "policy/entropy": ent.detach()}

    models.actor.train()
    res = model_passes.train_step(models.actor, models.actor_opt, eb.inputs, loss_fn,
                                  temperature=cfg.actor_rollout.temperature,
                                  micro_batch_size=passes.batching(cfg.training, eb.advantages.shape[0],
                                                                   models.passes.update_lm, update_on=device),
                                  kernels=models.kernels)
    count_skip(state, "actor", res, cfg=cfg, log=log)
    return {**res.stats, "policy/loss": res.loss, "policy/grad_norm": res.grad_norm, **_scale_metric("policy", res)}


def kl_loss_tokens(a, logp: torch.Tensor, ref_logp: torch.Tensor,
                   is_weights: Optional[torch.Tensor]) -> torch.Tensor:
    """The KL loss term per token [B, T]: the configured estimate to the reference, times the rows'
    behaviour importance weights (detached) with algorithm.kl_loss_is_weight (docs/async.md)."""
    kl = ppo.kl_estimate(logp, ref_logp, estimator=a.kl_estimator)                 # [B, T]
    if not a.kl_loss_is_weight:
        return kl
    if is_weights is None:  # the config check allows the option only where the behaviour gives weights
        raise RuntimeError("algorithm.kl_loss_is_weight: the rows carry no behaviour importance weights "
                           "(needs use_pf_ppo or async_rl.enable)")
    return kl * is_weights.detach()


def _scale_metric(prefix: str, res: "model_passes.StepResult") -> dict[str, float]:
    """fp16: the loss scale after the step (policy/loss_scale, critic/loss_scale)."""
    return {} if res.loss_scale is None else {f"{prefix}/loss_scale": res.loss_scale}


def critic_step(eb: ExperienceBatch, *, cfg: Config, models: Models, strategies: Strategies, state: TrainState,
                device: torch.device, log: Callable[[str], None]) -> dict[str, float]:
    a = cfg.algorithm

    def loss_fn(values, micro: model_passes.MicroBatch):
        r = micro.rows
        m = micro.inputs.response_mask
        devicecheck.expect("value loss", device, values=values, old_values=eb.old_values[r],
                           returns=eb.returns[r], mask=m)
        out = ppo.value_loss(values, eb.old_values[r], eb.returns[r], m, value_clip=a.value_clip,
                             loss_agg_mode=a.loss_agg_mode,
                             loss_scale_factor=strategies.policy_loss_params.loss_scale_factor)
        share = a.vf_coef * out.loss * model_passes.share_scale(m, micro.norm, mode=a.loss_agg_mode, like=out.loss)
        return share, {"critic/value_loss": out.loss.detach(), "critic/vf_clipfrac": out.vf_clipfrac}

    models.critic.train()
    res = model_passes.critic_train_step(models.critic, models.critic_opt, eb.inputs, loss_fn,
                                         micro_batch_size=passes.batching(cfg.training, eb.advantages.shape[0],
                                                                          models.passes.update_value))
    count_skip(state, "critic", res, cfg=cfg, log=log)
    return {**res.stats, "critic/grad_norm": res.grad_norm, **_scale_metric("critic", res)}


def count_skip(state: TrainState, model: str, res: "model_passes.StepResult", *, cfg: Config,
               log: Callable[[str], None]) -> None:
    """A NaN/inf loss, a NaN/inf grad norm (bf16 and fp32 have no grad scaler: gpt.optimizer_step
    skips it) or a refused step is skipped, logged and counted (loss and norm are global, so every
    rank skips together); training.max_consecutive_skipped_updates in a row of one model halt the
    run: it is not learning. An fp16 loss scaler's inf/nan step is counted in guard/skipped_updates and
    guard/loss_scale_overflows; it does not count towards the halt while the scaler could still lower its
    scale (the first steps from megatron's initial 2^32 overflow by design), only once it is at
    model.min_loss_scale (or constant)."""
    st = state
    if res.update_successful:
        st.consecutive_skips[model] = 0
        return
    st.guards["skipped_updates"] += 1
    why = skip_reason(res)
    if res.overflow:
        st.guards["loss_scale_overflows"] += 1
        m = cfg.model
        if m.loss_scale is None and res.loss_scale is not None and res.loss_scale > m.min_loss_scale:
            log(f"[pfppo] step {st.step + 1}: {model} update skipped ({why}); counted in "
                f"guard/loss_scale_overflows")
            return
    st.consecutive_skips[model] += 1
    log(f"[pfppo] step {st.step + 1}: {model} update skipped ({why}); counted in guard/skipped_updates")
    limit = cfg.training.max_consecutive_skipped_updates
    if limit and st.consecutive_skips[model] >= limit:
        raise TrainingHalted(
            f"step {st.step + 1}: {st.consecutive_skips[model]} consecutive {model} updates were skipped "
            f"(last: {why}) >= "
            f"training.max_consecutive_skipped_updates ({limit}); stopping: the run is not learning. "
            f"Check lr, kl_coeff, rewards and the model weights (0 disables this check).")


def skip_reason(res: "model_passes.StepResult") -> str:
    if res.overflow:
        return f"fp16 gradients hold an inf/nan, loss scale now {res.loss_scale:g}"
    if not math.isfinite(res.loss):
        return f"loss {res.loss}"
    if not math.isfinite(res.grad_norm):
        return f"grad norm {res.grad_norm} with loss {res.loss:.6g}"
    return f"refused by the optimizer, loss {res.loss:.6g}"
