"""The micro-batching of the trainer's model passes (pfppo_mega.models.passes) (training.micro_batch_size,
use_dynamic_bsz, max_tokens_per_micro_batch, response_only_head, fused_head), and the work those passes did
(counted per phase and head for the perf/ metrics, trainer/instruments/perf.py)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional

import torch

from pfppo_mega.models import lora
from pfppo_mega.models import passes as model_passes
from pfppo_mega.models.microbatch import Tally
from pfppo_mega.trainer.batch import PackedInputs


@dataclass
class PassWork:
    """Work of the trainer's passes since the last take(): one Tally per phase and head (the LM
    head's FLOPs differ from the value head's)."""

    prepare_lm: Tally = field(default_factory=Tally)     # old and reference log-probs
    prepare_value: Tally = field(default_factory=Tally)  # the critic's values
    update_lm: Tally = field(default_factory=Tally)      # the actor's update (forward + backward)
    update_value: Tally = field(default_factory=Tally)   # the critic's update

    def take(self) -> "PassWork":
        return PassWork(**{f.name: getattr(self, f.name).take() for f in fields(self)})

    def total(self) -> Tally:
        out = Tally()
        for f in fields(self):
            out.add(getattr(self, f.name))
        return out


def batching(training, rows: int, tally: Optional[Tally] = None, *,
             update_on: Optional[torch.device] = None) -> model_passes.Batching:
    """The engine's plan for a pass over ``rows`` rows under the config's training section.
    ``update_on``: the device of an update's pass (None: a forward-only pass, prepare)."""
    return model_passes.Batching(
        micro_batch_size=training.micro_batch_size or rows,
        max_tokens=training.max_tokens_per_micro_batch if training.use_dynamic_bsz else None,
        response_only=training.response_only_head, tally=tally,
        fused_head=fused_head(training.fused_head, update_on), head_chunk_tokens=training.fused_head_chunk_tokens)


def fused_head(setting: Optional[bool], update_on: Optional[torch.device]) -> bool:
    """training.fused_head: true / false as set; null: fused for forward-only passes everywhere and
    for an update on a GPU (on the CPU the backward's recomputed logits cost more than they save)."""
    if setting is not None:
        return setting
    return update_on is None or update_on.type != "cpu"


def policy_logp(model: torch.nn.Module, inp: PackedInputs, *, temperature: float, training, kernels,
                tally: Optional[Tally] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob and entropy of the response tokens under logits / temperature.  [B, T] each.
    Through megatron's schedule: any TP x PP layout, vocab-parallel at tp > 1; micro-batched as
    ``training`` (the config's training section) says, its work counted into ``tally`` when given;
    ``kernels``: the run's kernels backend."""
    return model_passes.forward_logp_entropy(model, inp, temperature=temperature,
                                             micro_batch_size=batching(training, inp.labels.shape[0], tally),
                                             kernels=kernels)


def reference_logp(actor: torch.nn.Module, ref: Optional[torch.nn.Module], inp: PackedInputs, *, temperature: float,
                   training, kernels, tally: Optional[Tally] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """policy_logp of the reference policy: the frozen copy ``ref``, or with model.lora (``ref`` None)
    the actor with its adapters off, i.e. the base weights (verl's way: no second copy of the model)."""
    kw = dict(temperature=temperature, training=training, kernels=kernels, tally=tally)
    if ref is not None:
        return policy_logp(ref, inp, **kw)
    with lora.adapters_off(actor):
        return policy_logp(actor, inp, **kw)
