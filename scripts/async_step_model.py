"""A step-time model of the asynchronous mode on paper (docs/async.md): NOT a measurement.

    python scripts/async_step_model.py [--gen 84 --train 28 --logp 18 --refit 14 --gpus 64 --cv 0.3]

Inputs default to NeMo-RL's published 70B step on 64 H100 (generation 84 s, training 28 s, log-probs
18 s, refit 14 s, colocated and synchronous). Assumptions, all stated: each phase's time scales as
1 / (GPUs doing it) (perfect scaling, optimistic for both sides alike); disaggregated, E GPUs
generate and 64 - E train (log-probs + training); the refit stalls the generator (weights taken
between requests) and not the trainer; ``tail`` = how much of the synchronous generation time is
the long tail that continuous generation recovers (1 = none); each batch's generation time varies
(lognormal, coefficient of variation ``cv``). Batch k (trained at step k) may be generated with
weights no older than k - 1 - s (the staleness bound s), so its generation starts only after the
trainer finished step k - 1 - s (+ the refit). The mean step time is simulated over 2000 steps.
"""

from __future__ import annotations

import argparse
import math
import random


def simulate(gen_s: float, train_s: float, refit_s: float, staleness: int, *, cv: float, steps: int = 2000,
             seed: int = 0) -> float:
    """Mean seconds per step of a generator and a trainer pipelined under the staleness bound."""
    rng = random.Random(seed)
    sigma = math.sqrt(math.log(1 + cv * cv))
    mu = math.log(gen_s) - sigma * sigma / 2  # the lognormal's mean is gen_s
    gen_end, train_end = [0.0], [0.0]  # index k: batch / step k (0: the start)
    for k in range(1, steps + 1):
        ready = train_end[k - 1 - staleness] + refit_s if k - 1 - staleness >= 1 else 0.0
        start = max(gen_end[k - 1], ready)
        gen_end.append(start + rng.lognormvariate(mu, sigma) if cv > 0 else start + gen_s)
        train_end.append(max(train_end[k - 1], gen_end[k]) + train_s)
    return train_end[-1] / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gen", type=float, default=84.0)
    ap.add_argument("--train", type=float, default=28.0)
    ap.add_argument("--logp", type=float, default=18.0)
    ap.add_argument("--refit", type=float, default=14.0)
    ap.add_argument("--gpus", type=int, default=64)
    ap.add_argument("--cv", type=float, default=0.3)
    ap.add_argument("--node", type=int, default=8, help="engine GPUs come in whole nodes")
    a = ap.parse_args()
    sync = a.gen + a.train + a.logp + a.refit
    print(f"synchronous colocated step (published): {a.gen:g} + {a.train:g} + {a.logp:g} + {a.refit:g} = {sync:g} s\n")
    print("| engine GPUs / trainer GPUs | tail recovered | gen s | train s | s=0 | s=1 | s=2 | s=4 | speed-up at s=2 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for tail in (1.0, 1.5):
        for e in range(a.node, a.gpus, a.node):
            g = a.gen * a.gpus / e / tail
            t = (a.train + a.logp) * a.gpus / (a.gpus - e)
            cells = [simulate(g, t, a.refit, s, cv=a.cv) for s in (0, 1, 2, 4)]
            if max(g, t) > 2 * sync:
                continue
            print(f"| {e} / {a.gpus - e} | {tail:g}x | {g:.0f} | {t:.0f} | " + " | ".join(f"{c:.0f}" for c in cells)
                  + f" | {sync / cells[2]:.2f}x |")


if __name__ == "__main__":
    main()
