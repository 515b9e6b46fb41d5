"""Generalised advantage estimation (Schulman et al. 2016) over right-padded responses."""

import torch

from pfppo_mega.ppo.masked import check_same_shape, zero_padding


def compute_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    *,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token GAE advantages and returns.

        delta_t = r_t + gamma * V_{t+1} * m_{t+1} - V_t
        A_t     = delta_t + gamma * lam * m_{t+1} * A_{t+1}
        R_t     = A_t + V_t

    rewards, values, mask: [B, T] (mask 1 on real tokens, right-padded). m_T = 0, so the value
    after the last real token is 0: the episode ends at EOS or the length limit. Both outputs
    are [B, T] and 0 at masked positions; padding of rewards/values is never read.

    A mask with gaps (a multi-turn response: tool and user tokens, mask 0, between the policy's
    turns) is skipped over as verl 0.9.1's compute_gae_advantage_return skips it: inside a gap the
    next value and the running advantage are carried unchanged, so "t+1" above is the next
    mask-1 token (the tokens the policy did not write are not steps of its episode). Right padding
    is the gap at the end (carries the initial 0), so a prefix mask gives the formula above.

    Reference implementation: vectorised over B, a Python loop over T in reverse. Pass detached
    tensors (the loop is autograd-transparent but nothing upstream should need its gradient).
    """
    check_same_shape("compute_gae", rewards=rewards, values=values, mask=mask)
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"compute_gae: gamma={gamma} must be in [0, 1]")
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"compute_gae: lam={lam} must be in [0, 1]")
    m = mask.to(values.dtype)  # [B, T]
    r = zero_padding(rewards.to(values.dtype), mask)  # [B, T]
    v = zero_padding(values, mask)  # [B, T]
    num_tokens = v.shape[1]
    if num_tokens == 0:  # no tokens: empty outputs (v[:, 0] below needs one)
        return torch.zeros_like(v), torch.zeros_like(v)

    next_value = torch.zeros_like(v[:, 0])  # [B]  V_{t+1} * m_{t+1}
    next_adv = torch.zeros_like(v[:, 0])  # [B]  m_{t+1} * A_{t+1}
    advs_reversed = []
    for t in reversed(range(num_tokens)):
        delta = r[:, t] + gamma * next_value - v[:, t]
        adv = (delta + gamma * lam * next_adv) * m[:, t]
        advs_reversed.append(adv)
        real = m[:, t].bool()  # a gap (m_t = 0) carries the next real token's value and advantage
        next_value = torch.where(real, v[:, t], next_value)
        next_adv = torch.where(real, adv, next_adv)
    advantages = torch.stack(advs_reversed[::-1], dim=1)  # [B, T]
    returns = (advantages + v) * m
    return advantages, returns


def has_gaps(mask: torch.Tensor) -> torch.Tensor:
    """[B, T] -> 0-dim bool: some row has a mask-0 token before a mask-1 token (not a prefix mask)."""
    m = mask.bool()
    return (m[:, 1:] & ~m[:, :-1]).any() if m.shape[1] > 1 else torch.zeros((), dtype=torch.bool)
