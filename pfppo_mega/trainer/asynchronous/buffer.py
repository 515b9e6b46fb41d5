"""The asynchronous mode's bookkeeping, independent of processes and models (unit-tested alone).

A *group* is one prompt's n responses, all written by one weight version (a request is generated
with one version). The trainer's current version is its step count; a group's staleness is
current - version. The trainer takes groups in the order their prompts were submitted, dropping
(and counting) every group staler than max_staleness: a batch never lags more than that.

The version pool holds exactly the versions a request may still be generated with: the newest and
the ``window`` before it (window = max_staleness - prefetch_steps for uniform / recency, 0 for
newest): a request queued prefetch_steps steps ahead and generated with the oldest of them is still
within max_staleness when trained on.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Generic, Optional, TypeVar

import torch

from pfppo_mega.constants import ASYNC_SAMPLING
from pfppo_mega.pool.sampling import snapshot_weights
from pfppo_mega.rollout.base import oldest_versions
from pfppo_mega.types import Sample

T = TypeVar("T")


@dataclass
class Group:
    """One prompt's n responses from one generator request, tagged with the version that wrote them."""

    key: int                   # submission order over the run (the trainer takes groups in key order)
    sample: Sample
    version: int               # behaviour weight version (the trainer's step when those weights were pushed);
    #                            with partial rollouts its oldest token's (the staleness bound counts that)
    responses: torch.Tensor    # [n, T] long, right-padded
    mask: torch.Tensor         # [n, T] float, 1 on response tokens
    logprobs: torch.Tensor     # [n, T] float, the engine's log-probs (0 on padding)
    finished: torch.Tensor     # [n] bool
    token_versions: Optional[torch.Tensor] = None  # [n, T] each token's version, -1 on padding (partial
    #                                                rollouts); None: every token is ``version``'s

    def row_token_versions(self) -> torch.Tensor:
        """[n, T] each response token's version (-1 on padding)."""
        if self.token_versions is not None:
            return self.token_versions
        return torch.full_like(self.responses, self.version).masked_fill(self.mask == 0, -1)

    def row_versions(self) -> torch.Tensor:
        """[n] each row's oldest token's version (``version`` for a row without tokens)."""
        return oldest_versions(self.row_token_versions(), self.version)


def version_window(sampling: str, max_staleness: int, prefetch_steps: int) -> int:
    """How many versions before the newest a request may be generated with."""
    if sampling not in ASYNC_SAMPLING:
        raise ValueError(f"algorithm.async_rl.sampling = {sampling!r}: must be one of {ASYNC_SAMPLING}")
    if not 1 <= prefetch_steps <= max_staleness:
        raise ValueError(f"algorithm.async_rl.prefetch_steps = {prefetch_steps}: must be in [1, max_staleness "
                         f"= {max_staleness}]")
    return 0 if sampling == "newest" else max_staleness - prefetch_steps


class VersionPool(Generic[T]):
    """Versions that may still be in use, newest last, each with its payload (the weights' buckets).
    Adding version v evicts every version below v - window."""

    def __init__(self, window: int) -> None:
        if window < 0:
            raise ValueError(f"VersionPool: window = {window} must be >= 0")
        self.window = window
        self.held: dict[int, T] = {}

    @property
    def versions(self) -> list[int]:
        return sorted(self.held)

    @property
    def newest(self) -> Optional[int]:
        return max(self.held) if self.held else None

    def add(self, version: int, payload: T) -> list[int]:
        """Hold ``version``; returns the versions evicted. A version older than the newest is refused."""
        if self.held and version < max(self.held):
            raise ValueError(f"VersionPool: version {version} is older than the newest held ({max(self.held)})")
        self.held[version] = payload
        floor = version - self.window
        gone = [v for v in self.held if v < floor]
        for v in gone:
            del self.held[v]
        return gone


def choose_version(versions: list[int], rule: str, rng: random.Random, *, temperature: float = 1.0) -> int:
    """The version one request is generated with: the newest, or drawn uniformly / by recency
    (pfppo_mega.pool.sampling's recency weights, age measured from the newest)."""
    if not versions:
        raise ValueError("choose_version: no version held (weights must be pushed before any request)")
    versions = sorted(versions)
    if rule == "newest" or len(versions) == 1:
        return versions[-1]
    if rule == "uniform":
        return versions[rng.randrange(len(versions))]
    if rule == "recency":
        probs = snapshot_weights(versions, method="recency", temperature=temperature, current_version=versions[-1])
        return versions[_draw(probs.tolist(), rng)]
    raise ValueError(f"choose_version: rule {rule!r} must be one of {ASYNC_SAMPLING}")


def _draw(probs: list[float], rng: random.Random) -> int:
    u, acc = rng.random(), 0.0
    for i, p in enumerate(probs):
        acc += p
        if u < acc:
            return i
    return len(probs) - 1


@dataclass
class Taken:
    groups: list[Group]
    dropped: list[Group]       # staler than max_staleness: not trained on (their prompts are asked again)


@dataclass
class StalenessBuffer:
    """Finished groups waiting for the trainer, taken in submission order within the staleness bound."""

    max_staleness: int
    ready: dict[int, Group] = field(default_factory=dict)
    dropped_total: int = 0     # groups dropped as stale over the run

    def __post_init__(self) -> None:
        if not (isinstance(self.max_staleness, int) and self.max_staleness >= 0):
            raise ValueError(f"StalenessBuffer: max_staleness = {self.max_staleness!r} must be an int >= 0")

    def add(self, group: Group) -> None:
        if group.key in self.ready:
            raise ValueError(f"StalenessBuffer: group {group.key} arrived twice")
        self.ready[group.key] = group

    def __len__(self) -> int:
        return len(self.ready)

    def take(self, need: int, current: int) -> Taken:
        """Up to ``need`` groups, lowest keys first, none staler than max_staleness at version
        ``current``; every stale group held is dropped (and counted), whether or not it was needed."""
        stale = [k for k, g in self.ready.items() if current - g.version > self.max_staleness]
        dropped = [self.ready.pop(k) for k in sorted(stale)]
        self.dropped_total += len(dropped)
        keys = sorted(self.ready)[:need]
        return Taken([self.ready.pop(k) for k in keys], dropped)


def staleness_metrics(versions: torch.Tensor, current: int, max_staleness: int) -> dict[str, float]:
    """Per-row staleness of a trained batch: mean, max, a histogram over 0..max_staleness (row
    shares) and the share of each version, keyed by its age (so curves stay comparable)."""
    if versions.numel() == 0:
        return {}
    age = (current - versions.long()).cpu()                                                  # [B]
    if int(age.min()) < 0:
        raise ValueError(f"staleness_metrics: a row's version is newer than the current one ({current})")
    out = {"async/staleness_mean": float(age.double().mean()), "async/staleness_max": float(age.max())}
    counts = torch.bincount(age, minlength=max_staleness + 1).double() / age.numel()
    for k in range(max_staleness + 1):
        out[f"async/staleness_hist/{k}"] = float(counts[k])
    out["async/versions_in_batch"] = float(len(torch.unique(age)))
    return out


def token_staleness_metrics(token_versions: torch.Tensor, current: int, max_staleness: int) -> dict[str, float]:
    """Per-token staleness of a trained batch (partial rollouts): token_versions [B, T] (-1 on padding)
    -> the share of tokens by age over 0..max_staleness, the mean token age, and the share of rows
    whose tokens come from more than one version."""
    real = token_versions >= 0                                                               # [B, T]
    if not bool(real.any()):
        return {}
    age = (current - token_versions[real].long()).cpu()                                      # [tokens]
    if int(age.min()) < 0:
        raise ValueError(f"token_staleness_metrics: a token's version is newer than the current one ({current})")
    counts = torch.bincount(age, minlength=max_staleness + 1).double() / age.numel()
    out = {f"async/token_staleness_hist/{k}": float(counts[k]) for k in range(max_staleness + 1)}
    out["async/token_staleness_mean"] = float(age.double().mean())
    big = torch.iinfo(torch.long).max
    hi = token_versions.masked_fill(~real, -1).max(dim=1).values                              # [B]
    lo = token_versions.masked_fill(~real, big).min(dim=1).values                             # [B]
    has = real.any(dim=1)
    out["async/mixed_version_rows"] = float(((hi != lo) & has).double().sum() / token_versions.shape[0])
    return out


def busy_fraction(busy_s: float, wall_s: float) -> float:
    return float(min(1.0, busy_s / wall_s)) if wall_s > 0 and math.isfinite(busy_s) else 0.0
