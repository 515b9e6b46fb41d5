"""The learning rate of one optimizer step: linear warm-up, then constant or cosine, as verl 0.9.1
writes them (verl/utils/torch_functional.py: get_constant_schedule_with_warmup and
get_cosine_schedule_with_warmup, a LambdaLR stepped once per training step, so the k-th update,
k = 0, 1, ..., runs at lr * lambda(k)). Plain Python: no torch, no config object.

    warmup      lambda(k) = k / max(1, W)                                  for k < W
    constant    lambda(k) = 1                                              for k >= W
    cosine      progress  = (k - W) / max(1, N - W)
                lambda(k) = max(r, r + (1 - r) * 0.5 * (1 + cos(2 pi * 0.5 * progress)))   for k >= W

with W warm-up steps (verl: lr_warmup_steps, or when that is negative int(lr_warmup_steps_ratio * N)),
N = total_training_steps and r = min_lr_ratio.
"""

from __future__ import annotations

import math


def warmup_steps(*, steps: int | None, ratio: float, total_steps: int) -> int:
    """W: the given steps, or int(ratio * total_steps) when steps is None (verl's -1)."""
    return steps if steps is not None else int(ratio * total_steps)


def lr_factor(k: int, *, warmup: int, total_steps: int, schedule: str, min_lr_ratio: float = 0.0) -> float:
    """lambda(k) of the module docstring for the k-th optimizer update (k >= 0)."""
    if k < warmup:
        return k / max(1, warmup)
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        progress = (k - warmup) / max(1, total_steps - warmup)
        cos = 0.5 * (1.0 + math.cos(math.pi * 2.0 * 0.5 * progress))
        return max(min_lr_ratio, min_lr_ratio + (1.0 - min_lr_ratio) * cos)
    raise ValueError(f"schedule={schedule!r}: must be one of 'constant', 'cosine'")
