"""The trainer's model passes and the built-in rollout against this machine (issue 23.3).

    python -m pfppo_mega.bench.passes [--shape smollm2-135m] [--rows 16] [--threads 2] [--repeats N]
                                      [--rollout-repeats N] [--rollout-only] [--out FILE.json]

Builds a randomly initialised Llama of the given shape (default: SmolLM2-135M's: 30 layers, hidden
576, GQA 9/3, vocabulary 49,152, tied) at tp = pp = 1, and a ragged batch like a chat rollout's
(prompts of 20-60 tokens, responses of 1-64). Then, for the padded path (micro-batches by rows at
the batch's longest row, LM head at every position) and for the token-budget path
(training.use_dynamic_bsz + response_only_head), times

    prepare  old log-probs (actor), reference log-probs, critic values      (forward only)
    update   one actor and one critic optimizer step over the whole batch   (forward + backward)

and reports each as model FLOPs / (time x this machine's matmul rate, measured beside it), the
padding fraction and the LM head's wasted positions (trainer/instruments/perf.py defines them). Last, the
built-in engine generates ``--new-tokens`` tokens for every prompt (no EOS: the weights are
random) and its time is set against its floor (perf.rollout_floor_s). With ``--repeats N`` the two
paths alternate N times (load on a shared machine hits both) and the medians are reported.
Prints and writes JSON (git sha, threads, load average, every figure) so runs can be compared.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch

from pfppo_mega import parallel, ppo
from pfppo_mega.config.tree import ModelConfig
from pfppo_mega.families import DecoderShape
from pfppo_mega.kernels import get_backend
from pfppo_mega.models import passes, gpt, hf_io
from pfppo_mega.models.microbatch import Tally
from pfppo_mega.rollout import SamplingParams
from pfppo_mega.rollout.builtin import BuiltinEngine
from pfppo_mega.trainer.instruments import machine, perf
from pfppo_mega.types import pack

SHAPES = {
    "smollm2-135m": dict(num_layers=30, hidden_size=576, ffn_hidden_size=1536, num_attention_heads=9,
                         num_query_groups=3, vocab_size=49152, max_position_embeddings=2048, rope_theta=100000.0,
                         norm_epsilon=1e-5, tie_word_embeddings=True),
    "tiny": dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                 vocab_size=97, max_position_embeddings=256, rope_theta=10000.0, norm_epsilon=1e-5,
                 tie_word_embeddings=False),  # the smoke test's
    "llama-20m": dict(num_layers=6, hidden_size=384, ffn_hidden_size=1024, num_attention_heads=6,
                      num_query_groups=2, vocab_size=8192, max_position_embeddings=512, rope_theta=10000.0,
                      norm_epsilon=1e-5, tie_word_embeddings=False),
}


def ragged_batch(rows: int, vocab: int, *, seed: int, prompt=(20, 60), response=(1, 64)):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (int(n),), generator=g).tolist()
               for n in torch.randint(prompt[0], prompt[1] + 1, (rows,), generator=g)]
    lengths = torch.randint(response[0], response[1] + 1, (rows,), generator=g)
    t = int(lengths.max())
    mask = (torch.arange(t)[None] < lengths[:, None]).float()
    return pack(prompts, torch.randint(3, vocab, (rows, t), generator=g), mask, pad_id=0)


def _losses(inp, old_logp, old_values, adv, returns):
    def actor_loss(logp, entropy, mb):
        m = mb.inputs.response_mask
        out = ppo.policy_loss(logp, old_logp[mb.rows], adv[mb.rows], m, clip_ratio_low=0.2, clip_ratio_high=0.28)
        return out.loss * passes.share_scale(m, mb.norm, mode="token-mean", like=out.loss), {}

    def critic_loss(values, mb):
        m = mb.inputs.response_mask
        out = ppo.value_loss(values, old_values[mb.rows], returns[mb.rows], m, value_clip=0.2)
        return out.loss * passes.share_scale(m, mb.norm, mode="token-mean", like=out.loss), {}
    return actor_loss, critic_loss


def run_passes(models, inp, batching: dict, *, seed: int, kernels=None) -> dict:
    """One prepare and one update over ``inp`` under ``batching`` (passes.Batching kwargs), with the
    trainer's log-prob kernels ``kernels`` (pfppo_mega.kernels.get_backend)."""
    actor, ref, critic, actor_opt, critic_opt = models
    lm, value, lm_train, value_train = Tally(), Tally(), Tally(), Tally()
    b = inp.labels.shape[0]
    t0 = time.perf_counter()
    old_logp, _ = passes.forward_logp_entropy(actor, inp, temperature=1.0, kernels=kernels,
                                              micro_batch_size=passes.Batching(tally=lm, **batching))
    passes.forward_logp_entropy(ref, inp, temperature=1.0, kernels=kernels,
                                micro_batch_size=passes.Batching(tally=lm, **batching))
    old_values = passes.forward_values(critic, inp, micro_batch_size=passes.Batching(tally=value, **batching))
    prepare_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(seed)
    adv, returns = torch.randn(old_logp.shape, generator=g), torch.randn(old_logp.shape, generator=g)
    actor_loss, critic_loss = _losses(inp, old_logp * inp.response_mask, old_values * inp.response_mask, adv, returns)
    t0 = time.perf_counter()
    a = passes.train_step(actor, actor_opt, inp, actor_loss, temperature=1.0, kernels=kernels,
                          micro_batch_size=passes.Batching(tally=lm_train, **batching))
    c = passes.critic_train_step(critic, critic_opt, inp, critic_loss,
                                 micro_batch_size=passes.Batching(tally=value_train, **batching))
    update_s = time.perf_counter() - t0
    total = Tally()
    for x in (lm, value, lm_train, value_train):
        total.add(x)
    return dict(rows=b, prepare_s=prepare_s, update_s=update_s, actor_loss=a.loss, critic_loss=c.loss,
                tallies=dict(prepare_lm=lm, prepare_value=value, update_lm=lm_train, update_value=value_train),
                padding_frac=total.padding_frac, head_waste_frac=total.head_waste_frac,
                micro_batches=total.micro_batches)


def parser(doc: str) -> argparse.ArgumentParser:
    """The arguments every bench of the trainer's passes takes: --shape, --rows, --threads, --seed,
    --out (the description: ``doc``'s first paragraph)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    return ap


def main(argv=None) -> dict:
    ap = parser(__doc__)
    ap.add_argument("--max-prompt", type=int, default=60)
    ap.add_argument("--max-response", type=int, default=64)
    ap.add_argument("--micro-batch-size", type=int, default=4, help="rows per micro-batch of the padded path")
    ap.add_argument("--max-tokens", type=int, default=0, help="token budget (0: micro-batch-size x mean row length)")
    ap.add_argument("--new-tokens", type=int, default=16, help="tokens the rollout generates per prompt")
    ap.add_argument("--rollout-repeats", type=int, default=3, help="timed rollouts (the median is reported)")
    ap.add_argument("--rollout-only", action="store_true", help="skip the prepare and update passes")
    ap.add_argument("--kernels", choices=("auto", "torch", "fused"), default="auto",
                    help="log-prob kernels, as the trainer's kernels key (auto: fused when built)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="interleaved repeats of both paths (a shared machine's load hits both); medians reported")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    parallel.init_parallel(tp=1, pp=1, seed=args.seed)
    mc = ModelConfig(**SHAPES[args.shape])
    shape = DecoderShape.from_model_config(mc)
    actor, critic = gpt.build_actor(mc), gpt.build_critic(mc)
    ref = gpt.build_actor(mc)
    ref.load_state_dict(actor.state_dict())
    ref.requires_grad_(False)  # as the trainer's reference (trainer/build.py)
    with torch.no_grad():
        critic.output_layer.weight.normal_(std=0.02)
    actor, critic = gpt.wrap_ddp(actor), gpt.wrap_ddp(critic)
    start = [{k: v.detach().clone() for k, v in gpt.unwrap(m).state_dict().items() if isinstance(v, torch.Tensor)}
             for m in (actor, critic)]

    opts = [gpt.build_optimizer(m, lr=1e-6, weight_decay=0.0, grad_clip=1.0) for m in (actor, critic)]

    def fresh():  # both paths start from the same weights and optimizer state: same losses expected
        for m, sd in zip((actor, critic), start):
            gpt.unwrap(m).load_state_dict(sd, strict=False)
        for opt in opts:  # as new, without re-allocating the moments (a run allocates them once)
            _reset_state(opt)
        return (actor, ref.eval(), critic, *opts)
    kernels = get_backend(args.kernels)
    inp = ragged_batch(args.rows, shape.vocab_size, seed=args.seed, prompt=(20, args.max_prompt),
                       response=(1, args.max_response))
    lengths = inp.attention_mask.sum(1)
    budget = args.max_tokens or int(args.micro_batch_size * float(lengths.float().mean()))
    budget = max(budget, int(lengths.max()))
    rates = machine.matmul_rates(torch.device("cpu"))
    matmul, memcpy = max(rates.values()), machine.memcpy_rate(torch.device("cpu"))
    out = {"git": _git_sha(), "shape": args.shape, "params": sum(p.numel() for p in gpt.unwrap(actor).parameters()),
           "threads": args.threads, "kernels": type(kernels).__name__, "loadavg_before": os.getloadavg(), "rows": args.rows,
           "tokens": int(lengths.sum()), "response_tokens": int(inp.response_mask.sum()),
           "matmul_gflops": matmul / 1e9, "matmul_gflops_by_library": {k: v / 1e9 for k, v in rates.items()},
           "memcpy_gbps": memcpy / 1e9, "budget_tokens": budget, "paths": {}}
    paths = (("padded", dict(micro_batch_size=args.micro_batch_size)),
             ("token_budget", dict(micro_batch_size=args.rows, max_tokens=budget, response_only=True)))
    for repeat in range(0 if args.rollout_only else args.repeats):
        for name, batching in paths:
            r = run_passes(fresh(), inp, batching, seed=args.seed, kernels=kernels)
            t = r.pop("tallies")
            prep = (perf.tally_flops(shape, t["prepare_lm"], head_width=shape.vocab_size)
                    + perf.tally_flops(shape, t["prepare_value"], head_width=1))
            upd = 3 * (perf.tally_flops(shape, t["update_lm"], head_width=shape.vocab_size)
                       + perf.tally_flops(shape, t["update_value"], head_width=1))
            r.update(prepare_matmul_frac=prep / (r["prepare_s"] * matmul),
                     update_matmul_frac=upd / (r["update_s"] * matmul), loadavg=os.getloadavg()[0])
            out["paths"].setdefault(name, []).append(r)
            print(f"[{name} {repeat + 1}/{args.repeats}] prepare {r['prepare_s']:.2f} s ({r['prepare_matmul_frac']:.1%} "
                  f"of the matmul rate), update {r['update_s']:.2f} s ({r['update_matmul_frac']:.1%}), padding "
                  f"{r['padding_frac']:.1%}, head waste {r['head_waste_frac']:.1%}, {r['micro_batches']} "
                  f"micro-batches, load {r['loadavg']:.1f}", flush=True)
    out["paths"] = {name: _median(runs) for name, runs in out["paths"].items()}
    out["rollout"] = rollout(actor, mc, shape, inp, args, matmul=matmul, memcpy=memcpy)
    out["loadavg_after"] = os.getloadavg()
    print(f"[rollout] built-in engine {out['rollout']['seconds']:.2f} s (median of "
          f"{', '.join(f'{t:.2f}' for t in out['rollout']['seconds_each'])}), floor {out['rollout']['floor_s']:.2f} s "
          f"({out['rollout']['floor_frac']:.1%} of the floor's speed); matmul {matmul / 1e9:.0f} GFLOP/s ("
          f"{', '.join(f'{k} {v / 1e9:.0f}' for k, v in rates.items())}), memcpy "
          f"{memcpy / 1e9:.1f} GB/s, load {out['loadavg_before'][0]:.1f} -> {out['loadavg_after'][0]:.1f}")
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))
    return out


def _reset_state(optimizer) -> None:
    """megatron optimizer ``optimizer``'s torch optimizers back to their first step (moments and
    step counts zeroed in place)."""
    for o in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in o.optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    value.zero_()
                elif isinstance(value, (int, float)):
                    raise TypeError(f"cannot reset a non-tensor optimizer state value {value!r}")


def _median(runs: list[dict]) -> dict:
    """Each figure's median over the repeats (the first repeat's for non-numbers), and the repeats."""
    out = {k: (statistics.median(r[k] for r in runs) if isinstance(v, (int, float)) else v)
           for k, v in runs[0].items()}
    return {**out, "repeats": runs}


def rollout(actor, mc, shape, inp, args, *, matmul: float, memcpy: float) -> dict:
    eng = BuiltinEngine(shape, pad_token_id=0)
    eng.load_weights(hf_io.gather_hf_weights(actor, mc), version=1)
    prompts = [row[: int(n)].tolist() for row, n in zip(inp.input_ids, inp.attention_mask.sum(1) -
                                                        inp.response_mask.sum(1))]
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=args.new_tokens, eos_token_id=None,
                            seed=args.seed)
    eng.generate(prompts[:2], SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=2, eos_token_id=None))
    times = []
    for _ in range(args.rollout_repeats):
        t0 = time.perf_counter()
        res = eng.generate(prompts, params)
        times.append(time.perf_counter() - t0)
    secs = statistics.median(times)
    floor = perf.rollout_floor_s(shape, [len(p) for p in prompts], [int(n) for n in res.lengths.tolist()],
                                 matmul=matmul, memcpy=memcpy, dtype_bytes=4)
    return {"seconds": secs, "seconds_each": times, "floor_s": floor, "floor_frac": floor / secs,
            "floor_frac_best": floor / min(times), "new_tokens": int(res.lengths.sum())}


def _git_sha() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip()
    except OSError:
        return "unknown"


if __name__ == "__main__":
    main()
