"""The step's phases before the update, each a function of the parts of the run it reads
(trainer/build.py: ``Models``, ``Colocation``, ``Strategies``, ``TrainState``) and of a typed batch
(batch.py), never of the whole ``Run``. The loop (trainer/loop.py) calls them in order:

    rollout -> score -> (filtration) -> prepare -> advantages

What they read of the config are parameters, not modes: the reward shaping's coefficients
(score), where the KL goes, a reward penalty or a loss term (advantages), the passes' batching and
temperature (prepare).
"""

from __future__ import annotations

import torch

from pfppo_mega import parallel, ppo
from pfppo_mega.config import Config
from pfppo_mega.kernels import KernelBackend
from pfppo_mega.models import passes as model_passes
from pfppo_mega.trainer import passes
from pfppo_mega.trainer.batch import ExperienceBatch, PreparedBatch, RolloutBatch, ScoredBatch, pack
from pfppo_mega.trainer.build import Colocation, DataParallel, Models, Strategies, TrainState
from pfppo_mega.trainer.estimators import AdvantageInputs, EstimatorContext
from pfppo_mega.trainer.instruments import devicecheck
from pfppo_mega.trainer.passes import policy_logp, reference_logp
from pfppo_mega.trainer.update import TrainingHalted
from pfppo_mega.types import PromptSource, RewardFn, Sample, response_extent


def rollout(samples: list[Sample], *, colocation: Colocation, strategies: Strategies,
            step: int) -> tuple[RolloutBatch, dict[str, float]]:
    """The behaviour policy's rollout, colocated (the trainer's states on the host meanwhile)."""
    gen = colocation.gen
    with gen.colocated(step, refit=strategies.behaviour.refits_current):
        rb, stats = strategies.behaviour.rollout(samples, step)
        if strategies.estimator.needs_greedy_baseline:  # ReMax: one greedy response per prompt, current weights
            rb = gen.greedy_baseline(rb, samples, step=step)
    return rb, {**stats, **gen.offload_stats()}


def score(rb: RolloutBatch, *, cfg: Config, reward_fn: RewardFn, state: TrainState, dp: DataParallel,
          device: torch.device) -> ScoredBatch:
    """Task rewards through the guard (a raising / None / NaN reward scores 0 and is counted),
    then the reward preprocessing. z-scores and quantiles use the global batch (every DP rank's
    rows)."""
    r = cfg.reward
    with devicecheck.paused():  # reward functions run on the host (texts in, scores out)
        guarded = reward_fn(rb.samples, rb.texts, rb.finished.tolist())
    halt_if_no_reward(rows=len(rb.samples), errors=guarded.errors, group=dp.group, step=state.step)
    devicecheck.mark_host(guarded.scores, guarded.honest, guarded.hacked)
    raw = guarded.scores.to(device)                                                # [B] finite
    lengths = response_extent(rb.response_mask)  # a multi-turn row's tool tokens count, as verl's response length
    scores = raw
    if r.length_penalty:
        scores = ppo.length_penalty(scores, lengths, coef=r.length_penalty,
                                    max_length=cfg.algorithm.max_response_length)
    if r.overlong_buffer.enable:  # DAPO: the reward falls over the last overlong_buffer.len tokens
        ob = r.overlong_buffer
        scores = ppo.overlong_penalty(scores, lengths, max_length=cfg.algorithm.max_response_length,
                                      buffer_len=ob.len, penalty_factor=ob.penalty_factor)
    # The running moments are updated inside scale_rewards (once per batch, global batch).
    scores = ppo.scale_rewards(scores, method=r.scaling, running=state.running_reward, reduce_sum=dp.sum)
    scores = ppo.quantile_clip(scores, quantile=r.quantile_clip, gather=dp.gather)
    scores = ppo.clip_rewards(scores, clip_range=r.clip_range)
    baselines, (bad, errors, timeouts) = score_baselines(rb, cfg=cfg, reward_fn=reward_fn, device=device)
    return ScoredBatch(rollout=rb, raw_scores=raw, scores=scores, n_bad_rewards=guarded.nonfinite + bad,
                       n_reward_errors=guarded.errors + errors, n_reward_timeouts=guarded.timeouts + timeouts,
                       honest=None if guarded.honest is None else guarded.honest.to(device),
                       hacked=None if guarded.hacked is None else guarded.hacked.to(device),
                       baselines=baselines)


def halt_if_no_reward(*, rows: int, errors: int, group, step: int) -> None:
    """Collective (every rank of the data-parallel ``group``, every scored round): TrainingHalted on
    every rank when each reward call of the round, on every data-parallel rank, failed (raised,
    returned no number -- a list, a tuple, None --, or killed its worker). Each failure scores 0 and
    is counted, but when all fail no row carries a reward and the run would train on zeros, saying
    so once."""
    total_rows, total_errors = parallel.dp_sum(torch.tensor([rows, errors], dtype=torch.long), group).tolist()
    if total_rows and total_errors == total_rows:
        raise TrainingHalted(
            f"reward: every one of the {total_rows} reward calls of step {step} failed (raised, "
            f"returned no number, or killed its worker; the first failure of each kind is logged above): no "
            f"row carries a reward, the update would learn from zeros. Fix the reward function "
            f"(reward.custom_function, or the scorer of the rows' data_source): it must return a float or a "
            f"dict with a numeric 'score' for every sample")


def score_baselines(rb: RolloutBatch, *, cfg: Config, reward_fn: RewardFn,
                    device: torch.device) -> tuple[torch.Tensor | None, tuple[int, int, int]]:
    """[B] the greedy responses' scores (rb.baseline; None without one): the same guarded
    reward function, once per prompt, and the same per-row shaping as the sampled scores (the
    batch-statistic transforms are refused with a greedy baseline, trainer/build.py); and the
    guard's (non-finite, errors, timeouts) counts of those calls."""
    if rb.baseline is None:
        return None, (0, 0, 0)
    r, greedy = cfg.reward, rb.baseline
    g = rb.group_ids.tolist()
    first: dict[int, int] = {}                                                      # prompt -> its first row
    for i, gid in enumerate(g):
        first.setdefault(gid, i)
    rows = list(first.values())
    with devicecheck.paused():  # reward functions run on the host
        guarded = reward_fn([rb.samples[i] for i in rows], [greedy.texts[i] for i in rows],
                            greedy.finished[rows].tolist())
    per_prompt = guarded.scores.to(device)                                          # [prompts]
    lengths = greedy.lengths[rows].to(device)                                       # [prompts]
    if r.length_penalty:
        per_prompt = ppo.length_penalty(per_prompt, lengths, coef=r.length_penalty,
                                        max_length=cfg.algorithm.max_response_length)
    if r.overlong_buffer.enable:
        ob = r.overlong_buffer
        per_prompt = ppo.overlong_penalty(per_prompt, lengths, max_length=cfg.algorithm.max_response_length,
                                          buffer_len=ob.len, penalty_factor=ob.penalty_factor)
    per_prompt = ppo.clip_rewards(per_prompt, clip_range=r.clip_range)
    slot = {gid: k for k, gid in enumerate(first)}
    baselines = per_prompt[torch.tensor([slot[x] for x in g], dtype=torch.long, device=device)]  # [B]
    return baselines, (guarded.nonfinite, guarded.errors, guarded.timeouts)


@torch.no_grad()
def prepare(sb: ScoredBatch, *, cfg: Config, models: Models, strategies: Strategies, pad_id: int,
            device: torch.device) -> PreparedBatch:
    """The trainer's models on the rows: proximal log-probs (recomputed, or the engine's:
    trainer/proximal.py), reference log-probs, and the critic's values when the run has one."""
    rb = sb.rollout
    inp = pack(rb.prompt_ids, rb.responses, rb.response_mask, pad_id=pad_id, device=device)
    temperature, training, tally = cfg.actor_rollout.temperature, cfg.training, models.passes.prepare_lm

    def logp_of(model: torch.nn.Module):
        return lambda x: policy_logp(model, x, temperature=temperature, training=training, kernels=models.kernels,
                                     tally=tally)
    old_logp, entropy = strategies.proximal.old_logp(inp, rb, actor_logp=logp_of(models.actor),
                                                     device=device)                # entropy None: not recomputed
    ref_logp, _ = reference_logp(models.actor, models.ref, inp, temperature=temperature, training=training,
                                 kernels=models.kernels, tally=tally)  # the frozen copy, or the adapters off
    m = inp.response_mask
    values = None if models.critic is None else model_passes.forward_values(
        models.critic, inp,
        micro_batch_size=passes.batching(training, m.shape[0], models.passes.prepare_value))       # [B, T]
    spp = None if not strategies.estimator.needs_sum_pi_squared else model_passes.forward_sum_pi_squared(
        models.actor, inp, temperature=temperature,
        micro_batch_size=passes.batching(training, m.shape[0], models.passes.prepare_lm))           # [B, T]
    devicecheck.expect("prepare: model inputs and results", device, inputs=inp, old_logp=old_logp,
                       ref_logp=ref_logp, values=values, scores=sb.scores, sum_pi_squared=spp)
    return PreparedBatch(inputs=inp, old_logp=old_logp * m, ref_logp=ref_logp * m,
                         values=None if values is None else values * m,
                         entropy=None if entropy is None else entropy * m,
                         sum_pi_squared=None if spp is None else spp * m)


def advantages(sb: ScoredBatch, prep: PreparedBatch, *, algorithm, strategies: Strategies, kernels: KernelBackend,
               dp: DataParallel, step: int, device: torch.device) -> ExperienceBatch:
    """Token rewards (with the KL penalty when the KL is a reward term), the estimator's advantages
    and returns, and the behaviour policy's importance correction. ``algorithm``: the config's
    algorithm section."""
    a = algorithm
    inp, old_logp, ref_logp = prep.inputs, prep.old_logp, prep.ref_logp
    m = inp.response_mask
    token_rewards = ppo.scores_to_token_rewards(sb.scores, m)                   # [B, T]
    if not a.use_kl_loss and a.kl_coeff > 0:
        token_rewards, kl_ref = ppo.apply_kl_penalty(token_rewards, old_logp, ref_logp, m,
                                                     kl_coeff=a.kl_coeff, estimator=a.kl_estimator)
    else:
        kl_ref = ppo.kl_estimate(old_logp, ref_logp, estimator=a.kl_estimator) * m
    rows = AdvantageInputs(token_rewards=token_rewards, mask=m, values=prep.values, group_ids=sb.rollout.group_ids,
                           baselines=sb.baselines, old_logp=old_logp, sum_pi_squared=prep.sum_pi_squared)
    ctx = EstimatorContext(algorithm=a, gae=kernels.gae, reduce_sum=dp.sum)
    adv, returns = strategies.estimator.compute(rows, ctx)                      # [B, T] each
    behav_logp = sb.rollout.behav_logp * m
    # Rows generated by the current weights: behaviour == proximal policy, IS weight exactly 1.
    on_policy = sb.rollout.versions == step                                     # [B]
    is_weights, pg_mask, is_stats = strategies.behaviour.correction(old_logp, behav_logp, m, on_policy,
                                                                    reduce_sum=dp.sum, reduce_max=dp.max)
    eb = ExperienceBatch(inputs=inp, old_logp=old_logp, behav_logp=behav_logp,
                         ref_logp=ref_logp, old_values=prep.values, token_rewards=token_rewards,
                         advantages=adv, returns=returns, kl_ref=kl_ref, entropy=prep.entropy,
                         pg_mask=pg_mask, is_weights=is_weights, on_policy=on_policy, is_stats=is_stats)
    devicecheck.expect("advantages: experience batch", device, experience=eb)
    return eb


def feed_back(scored: ScoredBatch, *, prompts: PromptSource, dp: DataParallel, step: int) -> None:
    """Phase `log`'s first part: a prompt source that observes (a curriculum sampler) gets every rank's rows
    of the step and their scores, in rank order, so each rank's copy of it learns the same thing. A
    host round trip of the rows' names and scores, only when the source observes."""
    if not prompts.observes:
        return
    mine = ([s for s in scored.rollout.samples], scored.raw_scores.detach().float().cpu(),
            scored.scores.detach().float().cpu())
    everyone = parallel.dp_gather_objects(mine, dp.group)
    rows = [s for r, _, _ in everyone for s in r]
    prompts.observe(rows, torch.cat([s for _, s, _ in everyone]), torch.cat([w for _, _, w in everyone]), step)
