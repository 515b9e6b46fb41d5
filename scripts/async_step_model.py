"""A step-time model of the asynchronous mode on paper (docs/async.md): NOT a measurement.

    python scripts/async_step_model.py [--gen 84 --train 28 --logp 18 --refit 14 --gpus 64 --cv 0.3]
    python scripts/async_step_model.py --measured RUN/metrics.jsonl [--layout configs/70b_pfppo_h100.yaml]

With ``--measured`` the phase times are ours: the efficiencies a synchronous run on this machine
measured (perf/generate_floor_frac, perf/prepare_matmul_frac, perf/update_matmul_frac: each phase's
work over its time x this machine's measured rates) applied to the 70B layout's work (the 70B
config's model, batch and lengths; FLOPs by trainer/instruments/perf.py's counts, bytes by the
ledger's parameter count, the generation floor by perf.rollout_floor_s) at an H100's rates
(pfppo_mega/scaling.py's inputs: see ``h100_rates``). Printed beside NeMo-RL's published step.

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
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, not an installed one


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


def table(gen_s: float, train_s: float, refit_s: float, *, gpus: int, node: int, cv: float, sync: float,
          tails=(1.0, 1.5)) -> None:
    """The split x staleness table: ``gen_s`` / ``train_s`` are the phases' seconds on all ``gpus``."""
    print("| engine GPUs / trainer GPUs | tail recovered | gen s | train s | s=0 | s=1 | s=2 | s=4 | speed-up at s=2 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for tail in tails:
        for e in range(node, gpus, node):
            g = gen_s * gpus / e / tail
            t = train_s * gpus / (gpus - e)
            if max(g, t) > 2 * sync:
                continue
            cells = [simulate(g, t, refit_s, s, cv=cv) for s in (0, 1, 2, 4)]
            print(f"| {e} / {gpus - e} | {tail:g}x | {g:.0f} | {t:.0f} | " + " | ".join(f"{c:.0f}" for c in cells)
                  + f" | {sync / cells[2]:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gen", type=float, default=84.0)
    ap.add_argument("--train", type=float, default=28.0)
    ap.add_argument("--logp", type=float, default=18.0)
    ap.add_argument("--refit", type=float, default=14.0)
    ap.add_argument("--gpus", type=int, default=64)
    ap.add_argument("--cv", type=float, default=0.3)
    ap.add_argument("--node", type=int, default=8, help="engine GPUs come in whole nodes")
    ap.add_argument("--measured", help="metrics.jsonl of a synchronous run on this machine: scale its phases")
    ap.add_argument("--layout", default="configs/70b_pfppo_h100.yaml", help="the 70B config whose work is scaled to")
    ap.add_argument("--skip", type=int, default=1, help="steps of --measured left out (warm-up)")
    a = ap.parse_args()
    sync = a.gen + a.train + a.logp + a.refit
    print(f"synchronous colocated step (published): {a.gen:g} + {a.train:g} + {a.logp:g} + {a.refit:g} = {sync:g} s\n")
    table(a.gen, a.train + a.logp, a.refit, gpus=a.gpus, node=a.node, cv=a.cv, sync=sync)
    if a.measured:
        from pfppo_mega.bench import step_scale

        print()
        m = step_scale.measured(a.measured, skip=a.skip)
        s = step_scale.scaled(m, a.layout, gpus=a.gpus)
        print(step_scale.report(m, s, published=dict(gen=a.gen, logp=a.logp, train=a.train, refit=a.refit)))
        ours = s.gen_s + s.prepare_s + s.update_s + s.refit_s
        print(f"\nthe split x staleness table on our scaled phases (synchronous colocated: {ours:.0f} s):\n")
        table(s.gen_s, s.prepare_s + s.update_s, s.refit_s, gpus=a.gpus, node=a.node, cv=a.cv, sync=ours)
        mixed = a.gen + s.prepare_s + s.update_s + a.refit
        print(f"\nour scaled trainer with NeMo-RL's published generation and refit ({a.gen:g} s, {a.refit:g} s; "
              f"synchronous colocated: {mixed:.0f} s):\n")
        table(a.gen, s.prepare_s + s.update_s, a.refit, gpus=a.gpus, node=a.node, cv=a.cv, sync=mixed)


if __name__ == "__main__":
    main()
