"""The typed batches that flow between the training phases (no dicts of string keys).

Where they live (the device rule, docs/scaling.md): a RolloutBatch leaves the rollout phase on
the model's device (``RolloutBatch.to``; an engine returns its rows wherever it generated them),
and every later batch is made there: ``pack(..., device=)`` builds the rows on the host from
Python lists and moves them in one copy. Only lists (prompt ids, texts, samples) stay host-side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pfppo_mega.pool.correction import ISStats
# The model layer's input type lives below the trainer (pfppo_mega.types); re-exported here.
from pfppo_mega.types import PackedInputs, Sample, pack  # noqa: F401


@dataclass
class GreedyRows:
    """The greedy response to each row's prompt (ReMax's baseline; rows of one prompt share it)."""

    texts: list[str]                   # [B] decoded
    finished: torch.Tensor             # [B] bool, ended with EOS
    lengths: torch.Tensor              # [B] long, response tokens
    versions: torch.Tensor             # [B] long, weight version that generated it (the current one)

    def to(self, device: torch.device) -> "GreedyRows":
        return GreedyRows(self.texts, self.finished.to(device), self.lengths.to(device), self.versions.to(device))

    def select(self, idx: list[int]) -> "GreedyRows":
        t = torch.tensor(idx, dtype=torch.long, device=self.finished.device)
        return GreedyRows([self.texts[i] for i in idx], self.finished[t], self.lengths[t], self.versions[t])

    @staticmethod
    def cat(parts: list["GreedyRows"]) -> "GreedyRows":
        return GreedyRows([x for p in parts for x in p.texts], torch.cat([p.finished for p in parts]),
                          torch.cat([p.lengths for p in parts]), torch.cat([p.versions for p in parts]))


@dataclass
class RolloutBatch:
    """Phase `rollout` output: B = prompts * n_samples_per_prompt samples."""

    samples: list[Sample]              # [B] the prompt of each row (+ its reward metadata)
    prompt_ids: list[list[int]]        # [B] ragged
    responses: torch.Tensor            # [B, T] long, right-padded
    response_mask: torch.Tensor        # [B, T] float, 1 on real response tokens (EOS included)
    behav_logp: torch.Tensor           # [B, T] log-probs reported by the engine that generated
    finished: torch.Tensor             # [B] bool, ended with EOS (vs length limit)
    versions: torch.Tensor             # [B] long, weight version (training step) of the behaviour policy
    texts: list[str]                   # [B] decoded responses
    group_ids: torch.Tensor            # [B] long, the prompt (index in this rank's step) each row answers
    # the greedy response to each row's prompt (same engine and weights; never trained on), when the
    # advantage estimator needs_greedy_baseline (ReMax); None otherwise
    baseline: Optional["GreedyRows"] = None

    def to(self, device: torch.device) -> "RolloutBatch":
        """The same rows with every tensor on ``device`` (one copy each; none when already there)."""
        return RolloutBatch(samples=self.samples, prompt_ids=self.prompt_ids,
                            responses=self.responses.to(device), response_mask=self.response_mask.to(device),
                            behav_logp=self.behav_logp.to(device), finished=self.finished.to(device),
                            versions=self.versions.to(device), texts=self.texts,
                            group_ids=self.group_ids.to(device),
                            baseline=None if self.baseline is None else self.baseline.to(device))

    def select(self, idx: list[int]) -> "RolloutBatch":
        t = torch.tensor(idx, dtype=torch.long, device=self.responses.device)
        return RolloutBatch(samples=[self.samples[i] for i in idx],
                            prompt_ids=[self.prompt_ids[i] for i in idx],
                            responses=self.responses[t], response_mask=self.response_mask[t],
                            behav_logp=self.behav_logp[t], finished=self.finished[t],
                            versions=self.versions[t], texts=[self.texts[i] for i in idx],
                            group_ids=self.group_ids[t],
                            baseline=None if self.baseline is None else self.baseline.select(idx))


def concat_rollouts(parts: list[RolloutBatch], order: list[int], *, pad_id: int) -> RolloutBatch:
    """Concatenate per-snapshot rollouts (T right-padded to the longest) back into request order.

    order[j] is the request index of row j of the concatenation."""
    T = max(p.responses.shape[1] for p in parts)

    def padded(t: torch.Tensor, value) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, T - t.shape[1]), value=value)

    cat = RolloutBatch(
        samples=[x for p in parts for x in p.samples],
        prompt_ids=[x for p in parts for x in p.prompt_ids],
        responses=torch.cat([padded(p.responses, pad_id) for p in parts]),
        response_mask=torch.cat([padded(p.response_mask, 0.0) for p in parts]),
        behav_logp=torch.cat([padded(p.behav_logp, 0.0) for p in parts]),
        finished=torch.cat([p.finished for p in parts]),
        versions=torch.cat([p.versions for p in parts]),
        texts=[x for p in parts for x in p.texts],
        group_ids=torch.cat([p.group_ids for p in parts]),
        baseline=None if any(p.baseline is None for p in parts)
        else GreedyRows.cat([p.baseline for p in parts]))
    inverse = [0] * len(order)
    for j, i in enumerate(order):
        inverse[i] = j
    return cat.select(inverse)


@dataclass
class ScoredBatch:
    """Phase `score` output."""

    rollout: RolloutBatch
    raw_scores: torch.Tensor           # [B] task reward as returned by the verifier (guarded: finite)
    scores: torch.Tensor               # [B] after the reward preprocessing
    n_bad_rewards: int                 # NaN / inf rewards replaced by 0 (guarded, counted)
    n_reward_errors: int = 0           # reward calls that raised / returned None, scored 0 (counted)
    n_reward_timeouts: int = 0         # reward calls past reward.timeout_s, scored 0 (counted)
    honest: torch.Tensor | None = None  # [B] the honest metric when reward.shaping wraps it (else None)
    hacked: torch.Tensor | None = None  # [B] bool, the shaping's exploit paid beyond the honest score
    baselines: torch.Tensor | None = None  # [B] the greedy response's score (rollout.baseline_texts scored)

    def select(self, idx: list[int]) -> "ScoredBatch":
        t = torch.tensor(idx, dtype=torch.long, device=self.scores.device)
        return ScoredBatch(self.rollout.select(idx), self.raw_scores[t], self.scores[t], self.n_bad_rewards,
                           self.n_reward_errors, self.n_reward_timeouts,
                           None if self.honest is None else self.honest[t],
                           None if self.hacked is None else self.hacked[t],
                           None if self.baselines is None else self.baselines[t])


@dataclass
class PreparedBatch:
    """Phase `prepare` output: the trainer models' view of the scored rows (zero on padding)."""

    inputs: PackedInputs
    old_logp: torch.Tensor             # [B, T] proximal policy: recomputed, or the engine's (trainer/proximal.py)
    ref_logp: torch.Tensor             # [B, T] reference policy
    values: torch.Tensor | None        # [B, T] critic (None: the estimator needs no critic)
    entropy: torch.Tensor | None       # [B, T] current policy's entropy (None: not recomputed)
    sum_pi_squared: torch.Tensor | None = None  # [B, T] sum_v pi(v)^2 (estimators that need it, else None)


@dataclass
class ExperienceBatch:
    """Phase `prepare` + `advantages` output: everything the PPO update consumes."""

    inputs: PackedInputs
    old_logp: torch.Tensor             # [B, T] proximal policy (recomputed, or the engine's)
    behav_logp: torch.Tensor           # [B, T] engine log-probs
    ref_logp: torch.Tensor             # [B, T]
    old_values: torch.Tensor | None    # [B, T] critic before the update (None: no critic)
    token_rewards: torch.Tensor        # [B, T] score on the last token (- KL penalty when in reward)
    advantages: torch.Tensor           # [B, T]
    returns: torch.Tensor              # [B, T]
    kl_ref: torch.Tensor               # [B, T] configured KL estimate to the reference
    entropy: torch.Tensor | None       # [B, T] policy entropy (None: not recomputed, see update.Observed)
    pg_mask: torch.Tensor              # [B, T] tokens the policy loss trains on (IS mask mode drops some)
    is_weights: torch.Tensor | None    # [B, T] behaviour IS weights pi_prox/pi_behav (None: plain PPO)
    on_policy: torch.Tensor            # [B] bool, generated by the current weights
    is_stats: ISStats | None = None    # IS weight stats of the whole batch (not carried by select)

    def select(self, idx: torch.Tensor) -> "ExperienceBatch":
        idx = idx.to(self.advantages.device)

        def take(t):
            return t[idx]
        inp = self.inputs
        return ExperienceBatch(
            inputs=PackedInputs(take(inp.input_ids), take(inp.attention_mask), take(inp.resp_pos),
                                take(inp.labels), take(inp.response_mask)),
            old_logp=take(self.old_logp), behav_logp=take(self.behav_logp),
            ref_logp=take(self.ref_logp),
            old_values=None if self.old_values is None else take(self.old_values),
            token_rewards=take(self.token_rewards), advantages=take(self.advantages),
            returns=take(self.returns), kl_ref=take(self.kl_ref),
            entropy=None if self.entropy is None else take(self.entropy),
            pg_mask=take(self.pg_mask), is_weights=None if self.is_weights is None else take(self.is_weights),
            on_policy=take(self.on_policy))


def concat_scored(parts: list[ScoredBatch], *, pad_id: int) -> ScoredBatch:
    """Scored batches of one step's generation rounds as one batch, in order; their groups numbered
    0, 1, ... in order of first appearance (the rounds numbered theirs from 0 each)."""
    rollout = concat_rollouts([p.rollout for p in parts], list(range(sum(len(p.scores) for p in parts))),
                              pad_id=pad_id)
    keys = [(k, int(g)) for k, p in enumerate(parts) for g in p.rollout.group_ids.tolist()]
    number = {key: i for i, key in enumerate(dict.fromkeys(keys))}
    rollout.group_ids = torch.tensor([number[key] for key in keys], dtype=torch.long, device=rollout.group_ids.device)

    def cat(name: str):
        values = [getattr(p, name) for p in parts]
        return None if any(v is None for v in values) else torch.cat(values)

    return ScoredBatch(rollout=rollout, raw_scores=cat("raw_scores"), scores=cat("scores"),
                       n_bad_rewards=sum(p.n_bad_rewards for p in parts),
                       n_reward_errors=sum(p.n_reward_errors for p in parts),
                       n_reward_timeouts=sum(p.n_reward_timeouts for p in parts),
                       honest=cat("honest"), hacked=cat("hacked"), baselines=cat("baselines"))
