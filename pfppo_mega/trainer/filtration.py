"""Policy filtration (verl's pf_ppo; algorithm.filtration), chosen once per run: after the score
phase the step's rows are resampled with reward-derived weights (PolicyFiltration), or kept as
they are (KeepAll). The loop calls it and never asks which one it has."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from pfppo_mega import ppo
from pfppo_mega.trainer.batch import ScoredBatch


class Filtration(Protocol):
    def __call__(self, sb: ScoredBatch) -> ScoredBatch:
        """The rows the update trains on."""


class KeepAll:
    def __call__(self, sb: ScoredBatch) -> ScoredBatch:
        return sb


@dataclass(frozen=True)
class PolicyFiltration:
    reweight_method: str
    weight_pow: float
    generator: torch.Generator  # rank 0's assignment stream (a CPU generator: a host decision)

    def __call__(self, sb: ScoredBatch) -> ScoredBatch:
        w = ppo.filtration_weights(sb.raw_scores, method=self.reweight_method, weight_pow=self.weight_pow)  # [B]
        # multinomial refuses a CPU generator for CUDA weights: the draw is made on the host
        idx = ppo.resample_indices(w.cpu(), num_samples=len(sb.raw_scores), generator=self.generator)
        return sb.select(idx.tolist())


def choose_filtration(filtration_cfg, generator: torch.Generator) -> KeepAll | PolicyFiltration:
    if not filtration_cfg.enable:
        return KeepAll()
    return PolicyFiltration(filtration_cfg.reweight_method, filtration_cfg.weight_pow, generator)
