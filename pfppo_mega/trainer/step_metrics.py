"""One step's metrics record: rewards, KL, entropy, lengths, repetition, critic, guards, timings
(the behaviour policy adds its own), made global over the data-parallel ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from pfppo_mega import parallel, ppo
from pfppo_mega.trainer import worst_samples
from pfppo_mega.trainer.batch import ExperienceBatch, ScoredBatch
from pfppo_mega.trainer.build import DataParallel
from pfppo_mega.trainer.metrics import aggregate_rank_metrics, quantiles, repetition_rate
from pfppo_mega.trainer.update import Observed
from pfppo_mega.types import response_extent


def step_metrics(sb: ScoredBatch, eb: ExperienceBatch, upd: dict[str, float], times: dict[str, float],
                 step_s: float, *, guards: dict[str, int], dp: DataParallel, observes_in_update: bool,
                 seen: Optional[Observed] = None) -> dict[str, float]:
    """reward/* and response/* describe every generated row (`sb`, before policy filtration);
    the KL, entropy, critic and update metrics the rows trained on (`eb`). Without recomputed
    proximal log-probs (trainer/proximal.py) the entropy and the engine/trainer gap are the
    update's first epoch's (`seen`), and absent in a step whose actor did not train
    (``observes_in_update``: the proximal strategy's declaration). ``guards``: the run's counters."""
    rb, m = sb.rollout, eb.inputs.response_mask
    lengths = response_extent(rb.response_mask).float()  # [B] response tokens (a multi-turn row's tool tokens too)
    # std and quantiles of the global batch (every DP rank's rewards), not a mean of the ranks'
    raw = sb.raw_scores if dp.gather is None else dp.gather(sb.raw_scores)  # [B * dp]
    first10 = m.clone()
    first10[:, 10:] = 0
    gen_tokens = float(rb.response_mask.sum())          # generated: the policy's tokens
    k1 = ppo.masked_mean(eb.old_logp - eb.ref_logp, m).item()
    # KL(current || ref) per token on the current policy's own distribution: under PF-PPO the
    # samples come from older snapshots, so weight each sequence by pi_cur(y)/pi_behav(y)
    # (self-normalised). Plain PPO: weights ~1 and this equals kl/ref_k1.
    seq_w = torch.softmax(((eb.old_logp - eb.behav_logp) * m).sum(1).double(), dim=0)   # [B]
    kl_cur = float((seq_w * ((eb.old_logp - eb.ref_logp) * m).sum(1)).sum() / (seq_w * m.sum(1)).sum())
    critic = {} if eb.old_values is None else {"critic/value_mean": ppo.masked_mean(eb.old_values, m).item()}
    return {
        "reward/mean": raw.mean().item(), "reward/std": raw.std().item() if len(raw) > 1 else 0.0,
        **{f"reward/{k}": v for k, v in quantiles(raw).items()},
        "reward/scaled_mean": sb.scores.mean().item(),
        **honest_metrics(sb),
        "kl/ref_mean": ppo.masked_mean(eb.kl_ref, m).item(), "kl/ref_k1": k1, "kl/ref_k1_current": kl_cur,
        **kl_tail(eb.kl_ref, m, eb.is_weights),
        "response/length_mean": lengths.mean().item(), "response/length_max": lengths.max().item(),
        "response/finished_frac": rb.finished.float().mean().item(),
        "response/repetition_rate": sum(repetition_rate(r[: int(l)].tolist())
                                        for r, l in zip(rb.responses, lengths)) / len(lengths),
        **entropy_first10(eb, seen, first10),
        **(logp_gap(eb, seen) if seen is not None or not observes_in_update else {GAP_ROWS: 0.0}),
        **critic,
        "critic/return_mean": ppo.masked_mean(eb.returns, m).item(),
        **{f"guard/{k}": float(guards[k]) for k in ("bad_rewards", "reward_errors", "reward_timeouts",
                                                   "skipped_updates", "engine_failures", "value_loss_spikes",
                                                   "loss_scale_overflows")},
        "perf/step_s": step_s, "perf/tokens_per_s": gen_tokens / step_s,
        **{f"time/{k}_s": v for k, v in times.items()},
        **upd,
    }


def kl_tail(kl_ref: torch.Tensor, mask: torch.Tensor, is_weights: Optional[torch.Tensor]) -> dict[str, float]:
    """What kl/ref_mean hides (docs/async.md, "KL on stale rows"). kl_ref, mask, is_weights: [B, T].

    kl/ref_token_max   the largest per-token KL estimate of the rows. k3 on a token is
                       exp(log pi_ref - log pi_cur) - ... : on a row an older version wrote, a token
                       the updates since made far less likely than the reference does is unbounded,
                       and one such token can be the whole step's kl/ref_mean.
    kl/ref_mean_is     with behaviour importance weights (PF-PPO, async_rl): the token mean weighted
                       by them, self-normalised (sum w kl / sum w): the rows reweighted towards the
                       current policy, whose KL the term is meant to estimate.
    Tokens with mask 0 (or weight 0) take no part; a key with no token to describe is absent."""
    out = {}
    real = mask > 0
    if bool(real.any()):
        out["kl/ref_token_max"] = kl_ref.masked_fill(~real, float("-inf")).max().item()
    if is_weights is not None:
        w = is_weights * mask                                                          # [B, T]
        total = w.sum()
        if float(total) > 0:
            out["kl/ref_mean_is"] = ((w * kl_ref).sum() / total).item()
    return out


def honest_metrics(sb: ScoredBatch) -> dict[str, float]:
    """reward/honest (the honest metric, apart from the trained-on reward/mean) and
    reward/hacked_frac, when the reward function reports them (rewards/shaping.py)."""
    out = {}
    if sb.honest is not None:
        out["reward/honest"] = sb.honest.double().mean().item()
    if sb.hacked is not None:
        out["reward/hacked_frac"] = sb.hacked.double().mean().item()
    return out


def entropy_first10(eb: ExperienceBatch, seen: Optional[Observed], first10: torch.Tensor) -> dict[str, float]:
    """Mean policy entropy over the first 10 response tokens: the prepare pass's, else the
    update's first epoch's (each row under the weights of its mini-batch, before its step)."""
    entropy = eb.entropy if eb.entropy is not None else None if seen is None else seen.entropy
    return {} if entropy is None else {"policy/entropy_first10": ppo.masked_mean(entropy, first10).item()}


GAP_ROWS = "rollout/logp_gap_rows"  # summed over the data-parallel ranks (trainer/metrics.py)


def logp_gap(eb: ExperienceBatch, seen: Optional[Observed] = None) -> dict[str, float]:
    """|engine log-prob - trainer log-prob| per token over the on-policy rows only (the same
    weights on both sides, so it measures engine/trainer numerics; under PF-PPO and in the
    asynchronous mode the other rows come from older versions and differ by design). The trainer's
    side is the recomputed proximal log-prob, or without one (``seen``) the update's first
    mini-batch's, before its optimizer step. rollout/logp_gap_rows counts the rows it covered, in
    every record: 0 says the check saw nothing this step (every row an older version's: the
    asynchronous mode after its first step), where the gap keys are absent (`pfppo doctor`'s
    engine_gap_unchecked reads it)."""
    rows = eb.on_policy if seen is None else eb.on_policy & seen.fresh
    trainer = eb.old_logp if seen is None else seen.logp
    m = eb.inputs.response_mask * rows[:, None]                                    # [B, T]
    covered = {GAP_ROWS: float((m.sum(1) > 0).sum())}
    if not bool(m.any()):
        return covered
    gap = (eb.behav_logp - trainer).abs()
    return {**covered, "rollout/logp_gap_max": float(torch.where(m.bool(), gap, 0.0).max()),
            "rollout/logp_gap_mean": ppo.masked_mean(gap, m).item()}


def add_guard_counts(guards: dict[str, int], scored: ScoredBatch, *, corrupt: int, group) -> None:
    """Make the guard counters global: add this step's bad rewards of every DP rank, and replace
    this rank's corrupt snapshots of the step (`corrupt`, already counted) by every rank's.
    (Skipped updates need no sum: the loss is global, every rank skips together.) ``group``: the
    data-parallel group."""
    counts = torch.tensor([scored.n_bad_rewards, scored.n_reward_errors, scored.n_reward_timeouts, corrupt],
                          dtype=torch.long)
    bad, errors, timeouts, all_corrupt = parallel.dp_sum(counts, group).tolist()
    guards["bad_rewards"] += bad
    guards["reward_errors"] += errors
    guards["reward_timeouts"] += timeouts
    guards["corrupt_snapshots"] += all_corrupt - corrupt


def over_dp(metrics: dict[str, float], group) -> dict[str, float]:
    """One record from every data-parallel rank's (each saw its own part of the batch): maxima by
    max, rates and counts by sum, means by mean (trainer.metrics.aggregate_rank_metrics). ``group``:
    the data-parallel group (None at dp = 1)."""
    if group is None:
        return metrics
    return aggregate_rank_metrics(parallel.dp_gather_objects(metrics, group))


def dump_worst(sb: ScoredBatch, *, step: int, per_kind: int, out_dir: Path) -> None:
    """The step's longest, most repetitive and highest-reward samples (``per_kind`` of each:
    logging.worst_samples) -> out_dir/samples_worst.jsonl (trainer/worst_samples.py; rank 0's rows)."""
    rb = sb.rollout
    lengths = [int(v) for v in response_extent(rb.response_mask).tolist()]
    rep = [repetition_rate(r[:n].tolist()) for r, n in zip(rb.responses, lengths)]
    rewards = sb.raw_scores.tolist()
    honest = None if sb.honest is None else sb.honest.tolist()
    recs = [worst_samples.WorstSample(
        step=step, kind=kind, rank=rank, row=rb.samples[i].row, prompt=rb.samples[i].prompt_text,
        text=rb.texts[i], length=lengths[i], repetition=round(rep[i], 4), reward=rewards[i],
        honest=None if honest is None else honest[i], finished=bool(rb.finished[i]), version=int(rb.versions[i]))
        for kind, rank, i in worst_samples.pick_worst(lengths, rep, rewards, per_kind)]
    worst_samples.append(out_dir / worst_samples.FILE, recs)
