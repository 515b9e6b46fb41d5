"""Which snapshot generates each prompt group: sampling probabilities and assignment.

Pure torch. K candidates (snapshots), each with a version, a KL-to-current estimate and a mean
reward (either may be unknown, None). Probabilities are float64 [K], finite, summing to 1.
"""

import math

import torch

from pfppo_mega.constants import POOL_ASSIGN
from pfppo_mega.constants import POOL_SAMPLING as SAMPLING_METHODS


def _fill_unknown(values: list[float | None], name: str, fill: str) -> torch.Tensor:
    """[K] float64 with None replaced by min / max of the known values (0.0 when none known)."""
    for i, v in enumerate(values):
        if v is not None and not math.isfinite(v):
            raise ValueError(
                f"snapshot_weights: {name}[{i}]={v} must be finite (or None when unknown)"
            )
    known = [v for v in values if v is not None]
    default = (min(known) if fill == "min" else max(known)) if known else 0.0
    return torch.tensor([default if v is None else v for v in values], dtype=torch.float64)


def _softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / temperature), shifted by the max before dividing: never inf - inf."""
    shifted = logits - logits.max()  # <= 0, exactly 0 at the max
    return torch.softmax(shifted / temperature, dim=0)


def recency_scale(versions: list[int]) -> float:
    """Mean spacing between candidate versions, (max - min) / (K - 1), at least 1.

    With snapshots every snapshot_interval steps this equals snapshot_interval, so recency
    measures age in snapshot intervals.
    """
    if len(versions) < 2:
        return 1.0
    return max(1.0, (max(versions) - min(versions)) / (len(versions) - 1))


def snapshot_weights(
    versions: list[int],
    *,
    method: str,
    temperature: float,
    current_version: int,
    kl: list[float | None] | None = None,
    mean_reward: list[float | None] | None = None,
) -> torch.Tensor:
    """Sampling probabilities [K] float64 over K candidate snapshots.

        uniform:  p_k = 1 / K
        recency:  p = softmax(-(current_version - v_k) / (temperature * s)), s = recency_scale(v)
        kl:       p = softmax(-kl_k / temperature)           (closer to the current policy first)
        reward:   p = softmax(mean_reward_k / temperature)   (better rollouts first)

    Unknown values (None) are filled optimistically, so a snapshot never sampled yet is tried:
    kl None -> min of the known kl (0.0 when none is known); mean_reward None -> max of the
    known mean rewards (0.0 when none is known). Smaller temperature sharpens toward the best
    candidate; ties share equally. Temperature must be > 0 (checked for every method).
    """
    k = len(versions)
    if k == 0:
        raise ValueError(
            "snapshot_weights: no candidate snapshots (the pool must hold at least one)"
        )
    if method not in SAMPLING_METHODS:
        raise ValueError(f"snapshot_weights: method={method!r} must be one of {SAMPLING_METHODS}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"snapshot_weights: temperature={temperature} must be finite and > 0")
    kl = [None] * k if kl is None else kl
    mean_reward = [None] * k if mean_reward is None else mean_reward
    if len(kl) != k or len(mean_reward) != k:
        raise ValueError(
            f"snapshot_weights: len(kl)={len(kl)} and len(mean_reward)={len(mean_reward)} "
            f"must equal len(versions)={k}"
        )
    if method == "uniform":
        return torch.full((k,), 1.0 / k, dtype=torch.float64)
    if method == "recency":
        age = current_version - torch.tensor(versions, dtype=torch.float64)  # [K]
        return _softmax(-age / recency_scale(versions), temperature)
    if method == "kl":
        return _softmax(-_fill_unknown(kl, "kl", "min"), temperature)
    return _softmax(_fill_unknown(mean_reward, "mean_reward", "max"), temperature)


def assign_snapshots(
    num_groups: int, probs: torch.Tensor, generator: torch.Generator, *, per: str = "group"
) -> torch.Tensor:
    """Index of the snapshot for each prompt group: [num_groups] int64 ~ Categorical(probs).

    per="group": one i.i.d. draw per group (a step mixes several snapshots);
    per="step":  one draw for the whole batch, every group gets it (one engine switch per step;
                 the mixture over snapshots then happens across steps).
    probs: [K] non-negative, finite, positive sum (need not be normalised).
    """
    if per not in POOL_ASSIGN:
        raise ValueError(f"assign_snapshots: per={per!r} must be one of {POOL_ASSIGN}")
    if num_groups < 0:
        raise ValueError(f"assign_snapshots: num_groups={num_groups} must be >= 0")
    if probs.dim() != 1 or probs.numel() == 0:
        raise ValueError(
            f"assign_snapshots: probs.shape={tuple(probs.shape)} must be [K] with K >= 1"
        )
    if not bool(torch.isfinite(probs).all()) or bool((probs < 0).any()) or float(probs.sum()) <= 0:
        raise ValueError(
            f"assign_snapshots: probs={probs.tolist()} must be finite, >= 0, with a positive sum"
        )
    if num_groups == 0:
        return torch.empty(0, dtype=torch.int64)
    draws = num_groups if per == "group" else 1
    drawn = torch.multinomial(probs.double(), draws, replacement=True, generator=generator)  # [draws]
    return drawn if per == "group" else drawn.expand(num_groups).clone()


def group_by_snapshot(assign: torch.Tensor) -> dict[int, list[int]]:
    """{snapshot index: ascending group indices} for the snapshots used (keys ascending).

    The trainer loads each key's weights into the engine once and generates for its groups.
    """
    out: dict[int, list[int]] = {}
    for group, k in enumerate(assign.tolist()):
        out.setdefault(k, []).append(group)
    return dict(sorted(out.items()))
