"""Critic-free advantage estimators on outcome rewards (one score per response), as verl defines them.

Every function takes the per-token rewards [B, T] (the score on the last response token, minus the
KL penalty when it is in the reward), the response mask [B, T] and, for the group estimators, the
group ids [B] (rows answering the same prompt share one), and returns (advantages, returns), both
[B, T] and zero on padding. A row's score is ``token_rewards.sum(-1)``.

Group statistics follow verl (verl/trainer/ppo/core_algos.py): a group of one has mean 0 and std 1
(its advantage is its own score, scaled by 1 / (1 + epsilon) under GRPO); the std is the unbiased
one (torch.std), and a group of equal scores has std 0, so it is divided by epsilon only (its
centred scores are exactly 0). Groups are local to the batch given: the trainer keeps every row of
a prompt on one data-parallel rank, so no group statistic needs a collective. The batch-wide
statistics (REINFORCE++ whitening, GPG's alpha) take ``reduce_sum`` to cover the global batch.

Imports only torch.
"""

from __future__ import annotations

import torch

from pfppo_mega.ppo.masked import ReduceSum, check_same_shape, masked_whiten, zero_padding

GRPO_EPSILON = 1e-6  # verl's epsilon in the GRPO / GPG / pass@k denominators


def _scores(token_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return zero_padding(token_rewards, mask).sum(-1)                      # [B]


def _broadcast(per_row: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return zero_padding(per_row[:, None].expand(mask.shape), mask)       # [B] -> [B, T]


def group_mean_std(scores: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row (mean, unbiased std, size) of its group; a group of one: mean 0, std 1 (verl).

    scores, group_ids: [B] -> three [B] tensors."""
    _, inv = torch.unique(group_ids, return_inverse=True)                 # [B] dense group index
    G = int(inv.max()) + 1 if inv.numel() else 0
    n = torch.zeros(G, dtype=scores.dtype, device=scores.device).index_add_(0, inv, torch.ones_like(scores))
    total = torch.zeros_like(n).index_add_(0, inv, scores)
    mean = total / n                                                       # [G]
    sq = torch.zeros_like(n).index_add_(0, inv, (scores - mean[inv]) ** 2)
    std = (sq / (n - 1).clamp(min=1)).sqrt()                               # unbiased (torch.std)
    single = n == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return mean[inv], std[inv], n[inv]


def grpo_advantages(token_rewards, mask, group_ids, *, norm_adv_by_std_in_grpo: bool = True,
                    epsilon: float = GRPO_EPSILON):
    """GRPO (Shao et al. 2024): A_i = (r_i - mean_g) / (std_g + epsilon); Dr.GRPO (Liu et al. 2025)
    drops the std: A_i = r_i - mean_g (norm_adv_by_std_in_grpo=False)."""
    s = _scores(token_rewards, mask)
    mean, std, _ = group_mean_std(s, group_ids)
    a = (s - mean) / (std + epsilon) if norm_adv_by_std_in_grpo else s - mean
    adv = _broadcast(a, mask)
    return adv, adv


def rloo_advantages(token_rewards, mask, group_ids):
    """RLOO (Ahmadian et al. 2024): A_i = r_i - mean of the other n - 1 scores of its group
    = (n r_i - n mean_g) / (n - 1). A group of one keeps its score (verl's ``rloo``)."""
    s = _scores(token_rewards, mask)
    mean, _, n = group_mean_std(s, group_ids)
    a = torch.where(n > 1, (s * n - mean * n) / (n - 1).clamp(min=1), s)
    adv = _broadcast(a, mask)
    return adv, adv


def opo_advantages(token_rewards, mask, group_ids):
    """OPO (Hao et al. 2025): the length-weighted group baseline b_g = sum_i |y_i| r_i / sum_i |y_i|;
    A_i = r_i - b_g (b = 0 for a group of one)."""
    s = _scores(token_rewards, mask)
    length = mask.to(s.dtype).sum(-1)                                      # [B]
    _, inv = torch.unique(group_ids, return_inverse=True)
    G = int(inv.max()) + 1 if inv.numel() else 0
    zeros = torch.zeros(G, dtype=s.dtype, device=s.device)
    n = zeros.clone().index_add_(0, inv, torch.ones_like(s))
    wsum = zeros.clone().index_add_(0, inv, length * s)
    lsum = zeros.clone().index_add_(0, inv, length)
    b = torch.where(n > 1, wsum / lsum, zeros)                             # [G]
    adv = _broadcast(s - b[inv], mask)
    return adv, adv


def gpg_advantages(token_rewards, mask, group_ids, *, f_norm: float = 1.0,
                   reduce_sum: ReduceSum | None = None):
    """GPG (Chu et al. 2025): A_i = alpha (r_i - mean_g) / f_norm with alpha = B / #{i: r_i != 0}
    over the batch (at least 1 in the denominator); mean 0 for a group of one, no std."""
    s = _scores(token_rewards, mask)
    counts = torch.stack([torch.tensor(float(s.numel()), dtype=s.dtype, device=s.device),
                          (s != 0).sum().to(s.dtype)])
    if reduce_sum is not None:  # B and the non-zero count of the global batch (every rank's rows)
        counts = reduce_sum(counts)
    alpha = counts[0] / counts[1].clamp(min=1)
    mean, _, _ = group_mean_std(s, group_ids)
    adv = _broadcast(alpha * (s - mean) / f_norm, mask)
    return adv, adv


def grpo_passk_advantages(token_rewards, mask, group_ids, *, norm_adv_by_std_in_grpo: bool = True,
                          epsilon: float = GRPO_EPSILON):
    """Pass@k (Chen et al. 2025, arXiv 2503.19595): only the best row of a group gets a non-zero
    advantage, r_max - r_second_max (divided by std_g + epsilon when normalising). Needs groups of
    at least two; a tie for the best gives 0."""
    s = _scores(token_rewards, mask)
    _, inv = torch.unique(group_ids, return_inverse=True)
    a = torch.zeros_like(s)
    for g in range(int(inv.max()) + 1 if inv.numel() else 0):              # one small group at a time
        rows = torch.nonzero(inv == g).flatten()
        r = s[rows]
        if r.numel() < 2:
            raise ValueError(f"grpo_passk: group {int(group_ids[rows[0]])} has {r.numel()} sample; "
                             f"pass@k needs at least 2 samples per prompt")
        top, idx = torch.topk(r, 2)
        gap = top[0] - top[1]
        if norm_adv_by_std_in_grpo:
            gap = gap / (torch.std(r) + epsilon)
        a[rows[idx[0]]] = gap
    adv = _broadcast(a, mask)
    return adv, adv


def discounted_returns(token_rewards, mask, *, gamma: float):
    """G_t = r_t + gamma G_{t+1} within each response (0 after its last token). [B, T] -> [B, T].

    A mask with gaps (a multi-turn response: tool and user tokens, mask 0, between the policy's turns)
    is skipped as GAE skips it (ppo/advantages.py): "t+1" is the next mask-1 token, so the outcome
    reward on the last policy token reaches every turn. (verl 0.9.1 resets the return at every mask-0
    token, so there the turns before a tool answer get none of it.) Right padding carries the initial 0.
    """
    r = zero_padding(token_rewards, mask)
    real = mask.bool()
    returns = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0])
    for t in reversed(range(r.shape[1])):
        running = torch.where(real[:, t], r[:, t] + gamma * running, running)  # a gap carries it unchanged
        returns[:, t] = running
    return zero_padding(returns, mask)


def reinforce_plus_plus_advantages(token_rewards, mask, *, gamma: float, reduce_sum: ReduceSum | None = None):
    """REINFORCE++ (Hu 2025): the discounted return, whitened over the batch's response tokens."""
    returns = discounted_returns(token_rewards, mask, gamma=gamma)
    return masked_whiten(returns, mask, reduce_sum=reduce_sum), returns


def reinforce_plus_plus_baseline_advantages(token_rewards, mask, group_ids, *, reduce_sum: ReduceSum | None = None):
    """REINFORCE++-baseline: r_i - mean_g (0 for a group of one) on every token, whitened over the
    batch's response tokens."""
    s = _scores(token_rewards, mask)
    mean, _, _ = group_mean_std(s, group_ids)
    adv = masked_whiten(_broadcast(s - mean, mask), mask, reduce_sum=reduce_sum)
    return adv, adv


def remax_advantages(token_rewards, mask, baselines):
    """ReMax (Li et al. 2023, arXiv 2310.10505), as verl's compute_remax_outcome_advantage: the
    baseline b_i is the reward of the greedy response to row i's prompt (same weights, scored by the
    same reward function), so no critic and no group are needed.

        returns_t = sum_{t' >= t} r_t'          (the reversed cumulative sum within the response)
        A_t       = returns_t - b               on every response token

    With an outcome reward alone (on the last token) A_t = score - b on every token; a per-token KL
    penalty in the reward makes the returns vary along the response. token_rewards, mask: [B, T];
    baselines: [B] -> (advantages, returns), both [B, T], zero on padding. No whitening (verl)."""
    r = zero_padding(token_rewards, mask)                                  # [B, T]
    returns = r.flip(-1).cumsum(-1).flip(-1)                               # [B, T], 0 past the response
    adv = zero_padding(returns - baselines.to(r.dtype)[:, None], mask)
    return adv, zero_padding(returns, mask)


OTB_EPSILON = 1e-8  # verl's epsilon in the optimal-token-baseline denominator


def optimal_token_baseline_advantages(token_rewards, mask, group_ids, old_logp, sum_pi_squared, *,
                                      handle_zero_tail: bool = True):
    """Optimal Token Baseline, as verl 0.9.1's compute_optimal_token_baseline_advantage (no rollout IS
    weights): a baseline per prompt group and response position, weighted by each row's path-variance
    proxy.

        G_t = sum_{t' >= t} r_t'                          returns (reward to go)
        w_t = 1 - 2 pi_t + sum_v pi(v)^2                  pi_t = exp(old_logp_t), at the sampled token
        W_t = sum_{j <= t} w_j                            (over the row's response tokens)
        B_t = sum_{i in group} G_t W_t m_t / (sum_{i in group} W_t m_t + 1e-8)
        A_t = G_t - B_t

    A group of one has no baseline (A = G). handle_zero_tail: when one row of a group is strictly
    the longest, its baseline past the second-longest row's length is 0 (there only it contributes,
    which would make its advantage ~0). token_rewards, mask, old_logp, sum_pi_squared: [B, T];
    group_ids: [B] -> (advantages, returns), both [B, T], zero on padding."""
    check_same_shape("optimal_token_baseline_advantages", token_rewards=token_rewards, mask=mask, old_logp=old_logp,
                     sum_pi_squared=sum_pi_squared)
    if group_ids.shape != token_rewards.shape[:1]:
        raise ValueError(f"optimal_token_baseline_advantages: group_ids must be [B] = [{token_rewards.shape[0]}], "
                         f"got {list(group_ids.shape)}")
    m = mask.to(token_rewards.dtype)
    returns = (token_rewards * m).flip(-1).cumsum(-1).flip(-1)             # [B, T]
    w = 1 - 2 * torch.exp(old_logp.to(returns.dtype)) + sum_pi_squared.to(returns.dtype)
    W = (w * m).cumsum(-1)                                                 # [B, T]
    _, inv = torch.unique(group_ids, return_inverse=True)                 # [B]
    G = int(inv.max()) + 1 if inv.numel() else 0
    zeros = returns.new_zeros(G, returns.shape[1])                        # [G, T]
    num = zeros.clone().index_add_(0, inv, returns * W * m)
    den = zeros.clone().index_add_(0, inv, W * m) + OTB_EPSILON
    size = torch.zeros(G, device=returns.device).index_add_(0, inv, torch.ones_like(inv, dtype=torch.float))
    baseline = (num / den)[inv] * (size[inv] > 1).to(returns.dtype)[:, None]  # [B, T]
    if handle_zero_tail:
        baseline = baseline * _not_lone_tail(m.sum(-1), inv, m.shape[1])
    return (returns - baseline) * m, returns * m


def _not_lone_tail(lengths: torch.Tensor, inv: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width] 0 at the positions of a group's strictly-longest row from its group's second-longest
    length on, 1 elsewhere. lengths, inv: [B]."""
    B = lengths.shape[0]
    peers = (inv[:, None] == inv[None, :]) & ~torch.eye(B, dtype=torch.bool, device=inv.device)  # [B, B]
    other_max = torch.where(peers, lengths[None, :], torch.full_like(lengths[None, :], -1.0)).amax(-1)  # [B]
    lone = (other_max >= 0) & (other_max < lengths)                       # strictly longest of 2+ rows
    t = torch.arange(width, device=lengths.device)[None, :]                # [1, width]
    return (~(lone[:, None] & (t >= other_max[:, None]))).to(lengths.dtype)
