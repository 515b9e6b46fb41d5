"""One actor optimizer step with and without the update's CPU savings, interleaved in one process.

    python -m pfppo_mega.bench.update_ab [--shape smollm2-135m] [--rows 16] [--threads 2] [--steps 5]
                                         [--budget TOKENS] [--out FILE.json]

Copies of the same randomly initialised actor (bench.passes' shapes and ragged batch, the token-budget
path with the head at the response tokens), one per arm:

    megatron        megatron's layers, its dense vocabulary gradients, torch.optim.AdamW as megatron
                    builds it (for-loop)
    vocab+adamw     training.sparse_vocab_grads and gpt.build_optimizer's fused AdamW
    default         those and training.fused_layers (fused RMSNorm / SwiGLU / RoPE, SDPA attention)

The arms take turns, ``--steps`` steps each; the first step of each (moment allocation, allocator
warm-up) is left out of the median. ``--budget``: the micro-batch token budget (default: bench.passes'
4 x the mean row length). Prints and writes JSON (git sha, load average, each arm's times and losses).
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch

from pfppo_mega import parallel
from pfppo_mega.bench.passes import SHAPES, _git_sha, _losses, parser, ragged_batch
from pfppo_mega.config.tree import ModelConfig
from pfppo_mega.kernels import get_backend
from pfppo_mega.models import passes, gpt


ARMS = {"megatron": False, "vocab+adamw": True, "default": True}  # name -> sparse vocab grads and fused AdamW


def _unfuse(optimizer) -> None:
    for o in optimizer.chained_optimizers:
        for group in o.optimizer.param_groups:
            group["fused"], group["foreach"] = False, None


def main(argv=None) -> dict:
    ap = parser(__doc__)
    ap.add_argument("--steps", type=int, default=5, help="steps per arm (the first is left out of the median)")
    ap.add_argument("--budget", type=int, default=None, help="micro-batch token budget (default: 4 x mean row)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    parallel.init_parallel(tp=1, pp=1, seed=args.seed)
    mc = ModelConfig(**SHAPES[args.shape])
    inp = ragged_batch(args.rows, mc.vocab_size, seed=args.seed)
    lengths = inp.attention_mask.sum(1)
    budget = args.budget or max(int(4 * float(lengths.float().mean())), int(lengths.max()))  # bench.passes' default
    batching = passes.Batching(args.rows, max_tokens=budget, response_only=True)
    kernels = get_backend("auto")
    start = gpt.build_actor(mc).state_dict()
    arms = {}
    for name, savings in ARMS.items():
        features = gpt.Features(sparse_vocab_grads=savings, fused_layers=name == "default")
        actor = gpt.build_actor(mc, features=features)
        actor.load_state_dict(start, strict=False)
        ddp = gpt.wrap_ddp(actor, features=features)
        opt = gpt.build_optimizer(ddp, lr=1e-6, weight_decay=0.0, grad_clip=1.0)
        if not savings:
            _unfuse(opt)
        arms[name] = (ddp, opt)
    first = next(iter(arms.values()))[0]
    old, _ = passes.forward_logp_entropy(first, inp, temperature=1.0, micro_batch_size=batching, kernels=kernels)
    adv = torch.randn(old.shape, generator=torch.Generator().manual_seed(args.seed))
    actor_loss, _ = _losses(inp, old * inp.response_mask, old, adv, adv)
    times: dict[str, list[float]] = {name: [] for name in arms}
    losses: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(args.steps):
        for name, (ddp, opt) in arms.items():
            t0 = time.perf_counter()
            res = passes.train_step(ddp, opt, inp, actor_loss, temperature=1.0, micro_batch_size=batching,
                                    kernels=kernels)
            times[name].append(time.perf_counter() - t0)
            losses[name].append(res.loss)
    out = {"git": _git_sha(), "shape": args.shape, "rows": args.rows, "threads": args.threads,
           "budget_tokens": budget, "loadavg": os.getloadavg(), "arms": {}}
    for name, each in times.items():
        med = statistics.median(each[1:] if len(each) > 1 else each)
        out["arms"][name] = {"median_s": med, "each_s": each, "losses": losses[name]}
        print(f"{name}: median {med:.2f} s ({', '.join(f'{t:.2f}' for t in each)})")
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
