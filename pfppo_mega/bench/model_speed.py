"""The update's speed on one GPU (scripts/gpu_check.sh's speed step): tokens/s and MFU of the actor's
optimizer step at a ~1B Llama shape with 4k-token rows, and the layer paths' times side by side.

    python -m pfppo_mega.bench.gpu_check speed [--json PATH] [--matmul-tflops X] [--rows 4] [--steps 3]
                                               [--compare-layers 4] [--tiny]

Two parts, one process:

    update   the shape of Llama-3.2-1B (16 layers, hidden 2048, SwiGLU 8192, 32 / 8 heads, vocabulary
             128,256, tied; bf16 with fp32 main weights), random init, ``--rows`` rows of ``--seq``
             tokens (a 64-token prompt, the rest response), micro-batches of one row, the head at the
             response tokens; passes.train_step as the trainer runs it (PPO's clipped loss, megatron's
             schedule and DDP, the fused AdamW) with the default features (model.layer_spec auto:
             TE's layers where installed, else training.fused_layers' SDPA path; the LM head the
             defaults give). ``--steps`` timed steps after one warm-up.
    layers   the same shape cut to ``--compare-layers`` layers, built twice: the fused layers and
             megatron's local ones (training.fused_layers false: its DotProductAttention holds the
             [b, heads, s, s] scores); their steps interleaved, each arm's median and peak memory.
    sdpa     which fused SDPA backends (flash, cuDNN, memory-efficient) take the layers' call at this
             shape (GPU only): the layers fall back to the math backend, with its s^2 scores, where none does.

Model FLOPs (``train_flops_per_token``): 3 x trainer.instruments.perf.forward_flops, i.e. 6 x the decoder's
matmul weights per token, 12 x heads x head_dim x layers per causal (query, key) pair, and 6 x
hidden x V per token the head runs at (6N plus attention, N with the head). MFU = model FLOP/s over
the device's bf16 dense peak (PEAK_BF16_TFLOPS, by device name); also read against the measured
matmul rate when given. ``--tiny``: a two-layer fp32 shape on whatever device there is (the CPU
test's run of the same code; no MFU without a known peak).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import time
from pathlib import Path
from typing import Optional

import torch

from pfppo_mega.config.tree import ModelConfig, TrainingConfig
from pfppo_mega.families import DecoderShape
from pfppo_mega.trainer.instruments import perf

LLAMA_1B = dict(num_layers=16, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=32, num_query_groups=8,
                vocab_size=128256, max_position_embeddings=4096, rope_theta=500000.0, norm_epsilon=1e-5,
                tie_word_embeddings=True, params_dtype="bfloat16", layer_spec="auto")
TINY = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
            vocab_size=97, max_position_embeddings=128, rope_theta=10000.0, norm_epsilon=1e-5,
            tie_word_embeddings=False, params_dtype="float32", layer_spec="auto")
PROMPT = 64  # prompt tokens of each row; the rest of --seq is response
# bf16 dense tensor-core peaks (vendor datasheets, SXM unless named); the first match of the device name wins
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.4), ("H200", 989.4), ("GH200", 989.4), ("A100", 312.0),
                    ("B200", 2250.0))


def train_flops_per_token(shape: DecoderShape, *, seq: int, head_tokens: int) -> float:
    """Model FLOPs of a training pass (forward + backward = 3 forwards) over one row of ``seq`` real
    tokens, causal, with the head at ``head_tokens`` of them, per token of the row."""
    if seq < 1 or not 0 <= head_tokens <= seq:
        raise ValueError(f"seq({seq}) must be >= 1 and head_tokens({head_tokens}) within [0, seq]")
    forward = perf.forward_flops(shape, tokens=seq, attn_pairs=seq * (seq + 1) / 2, head_tokens=head_tokens,
                                 head_width=shape.vocab_size)
    return 3.0 * forward / seq


def peak_tflops(device_name: str) -> Optional[float]:
    """The bf16 dense peak of a device by its name (torch.cuda.get_device_name), None when unknown."""
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in device_name:
            return tflops
    return None


def mfu(tokens_per_s: float, flops_per_token: float, peak: Optional[float]) -> Optional[float]:
    """Model FLOP/s over ``peak`` TFLOP/s (None: unknown peak)."""
    if tokens_per_s < 0 or flops_per_token < 0:
        raise ValueError(f"tokens_per_s({tokens_per_s}) and flops_per_token({flops_per_token}) must be >= 0")
    return None if not peak else tokens_per_s * flops_per_token / (peak * 1e12)


def head_keys() -> dict:
    """The training.* keys about the LM head and their defaults (whichever exist in this build)."""
    defaults = TrainingConfig()
    return {f.name: getattr(defaults, f.name) for f in dataclasses.fields(TrainingConfig) if "head" in f.name}


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m pfppo_mega.bench.gpu_check speed", description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    args = ap.parse_args(argv)
    try:
        return check_args(args)
    except ValueError as e:
        ap.error(str(e))


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--matmul-tflops", type=float, default=None, help="the device's measured bf16 matmul rate")
    ap.add_argument("--rows", type=int, default=4, help="rows per optimizer step (one micro-batch each)")
    ap.add_argument("--seq", type=int, default=4096, help="tokens per row")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per arm, after one warm-up step")
    ap.add_argument("--compare-layers", type=int, default=4, help="layers of the fused-vs-local comparison")
    ap.add_argument("--tiny", action="store_true", help="a two-layer fp32 shape (the CPU test's run)")


def check_args(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` when every value is in range, else ValueError naming the first that is not."""
    for name in ("rows", "steps", "compare_layers"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} ({getattr(args, name)}) must be >= 1")
    if args.seq <= PROMPT:
        raise ValueError(f"--seq ({args.seq}) must exceed the {PROMPT}-token prompt")
    return args


# ----------------------------------------------------------------------------- the runs


def _batch(rows: int, seq: int, vocab: int, device: torch.device):
    from pfppo_mega.types import pack

    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, vocab, (rows, PROMPT), generator=g).tolist()
    responses = torch.randint(3, vocab, (rows, seq - PROMPT), generator=g)
    return pack(prompts, responses, torch.ones(rows, seq - PROMPT), pad_id=0, device=device)


def _arm(mc: ModelConfig, features, inp, device: torch.device):
    """(train one step, the actor) of a fresh random-init actor with ``features``."""
    from pfppo_mega.bench.passes import _losses
    from pfppo_mega.kernels import get_backend
    from pfppo_mega.models import gpt, passes

    actor = gpt.build_actor(mc, features=features, device=device)
    ddp = gpt.wrap_ddp(actor, features=features)
    opt = gpt.build_optimizer(ddp, lr=1e-6, weight_decay=0.0, grad_clip=1.0)
    kernels = get_backend("auto")
    batching = passes.Batching(1, response_only=True)
    old, _ = passes.forward_logp_entropy(ddp, inp, temperature=1.0, micro_batch_size=batching, kernels=kernels)
    adv = torch.randn(old.shape, generator=torch.Generator().manual_seed(2)).to(old.device)
    actor_loss, _ = _losses(inp, old * inp.response_mask, old, adv, adv)

    def step() -> float:
        return passes.train_step(ddp, opt, inp, actor_loss, temperature=1.0, micro_batch_size=batching,
                                 kernels=kernels).loss
    return step, actor


def _timed(step, device: torch.device) -> tuple[float, float]:
    """(seconds, loss) of one step, the device drained before and after."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    loss = step()
    sync()
    return time.perf_counter() - t0, float(loss)


def sdpa_backends(shape: DecoderShape, seq: int, device: torch.device) -> dict:
    """Which of torch's fused SDPA backends take the layers' call at this shape (causal, GQA through
    enable_gqa, bf16, forward + backward): "ok" or the first line of the refusal. The math backend
    (which would hold the s^2 scores) is left out, so a row of refusals means the layers fall to it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from pfppo_mega.models import fused_layers

    a, g, d = shape.num_attention_heads, shape.num_query_groups, shape.head_dim
    q = torch.randn(seq, 1, a, d, device=device, dtype=torch.bfloat16, requires_grad=True)   # [s, b, n, d]
    kv = torch.randn(seq, 1, g, d, device=device, dtype=torch.bfloat16, requires_grad=True)  # [s, b, g, d]
    out = {}
    for name in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
        try:
            with sdpa_kernel([getattr(SDPBackend, name)]):
                fused_layers.sdpa(q, kv, kv, None).float().sum().backward()
            out[name.lower()] = "ok"
        except (RuntimeError, AttributeError) as e:
            out[name.lower()] = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
    return out


def _peak_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def _peak_gib(device: torch.device) -> Optional[float]:
    return torch.cuda.max_memory_allocated() / 2 ** 30 if device.type == "cuda" else None


def run(args: argparse.Namespace) -> dict:
    from pfppo_mega import parallel
    from pfppo_mega.bench.passes import _git_sha
    from pfppo_mega.models import gpt

    parallel.init_parallel(tp=1, pp=1, seed=1)
    device = gpt.model_device()
    mc = ModelConfig(**(TINY if args.tiny else LLAMA_1B))
    seq = min(args.seq, 96) if args.tiny else args.seq
    mc = dataclasses.replace(mc, max_position_embeddings=max(mc.max_position_embeddings, seq))
    shape = DecoderShape.from_model_config(mc)
    inp = _batch(args.rows, seq, mc.vocab_size, device)
    per_token = train_flops_per_token(shape, seq=seq, head_tokens=seq - PROMPT)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    peak = peak_tflops(name)
    out = {"git": _git_sha(), "device": name, "shape": {k: v for k, v in dataclasses.asdict(mc).items() if v is not None},
           "rows": args.rows, "seq": seq, "tokens_per_step": args.rows * seq, "flops_per_token": per_token,
           "peak_bf16_tflops": peak, "matmul_tflops": args.matmul_tflops, "head_keys": head_keys()}

    if device.type == "cuda":
        out["sdpa_backends"] = sdpa_backends(shape, seq, device)
    features = gpt.Features()
    out["layer_path"] = gpt.layer_path(mc, features, device.type)
    _peak_reset(device)
    step = _arm(mc, features, inp, device)[0]
    _timed(step, device)  # warm-up: optimizer states, allocator, kernel selection
    times = [_timed(step, device)[0] for _ in range(args.steps)]
    out["update"] = _rates(times, args.rows * seq, per_token, peak, args.matmul_tflops)
    out["update"]["peak_gib"] = _peak_gib(device)
    del step  # the 1B actor, its DDP and optimizer: freed before the comparison's models
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    out["layers"] = _compare(args, mc, inp, device)
    return out


def _rates(times: list[float], tokens: int, per_token: float, peak, matmul) -> dict:
    med = statistics.median(times)
    tps = tokens / med
    tflops = tps * per_token / 1e12
    return {"median_s": med, "each_s": times, "tokens_per_s": tps, "model_tflops": tflops,
            "mfu": mfu(tps, per_token, peak), "frac_of_measured_matmul": tflops / matmul if matmul else None}


def _compare(args: argparse.Namespace, mc: ModelConfig, inp, device: torch.device) -> dict:
    """Both layer paths at --compare-layers layers, steps interleaved (one warm-up each)."""
    from pfppo_mega.models import gpt

    small = dataclasses.replace(mc, num_layers=min(args.compare_layers, mc.num_layers), layer_spec="local")
    arms, out = {}, {"num_layers": small.num_layers}
    for label, fused in (("fused", True), ("local", False)):
        features = gpt.Features(fused_layers=fused)
        _peak_reset(device)
        try:
            step = _arm(small, features, inp, device)[0]
            _timed(step, device)
        except torch.cuda.OutOfMemoryError as e:  # megatron's local attention at long rows
            out[label] = {"error": f"out of memory: {str(e).splitlines()[0]}"}
            continue
        out[label] = {"layer_path": gpt.layer_path(small, features, device.type), "peak_gib": _peak_gib(device),
                      "each_s": []}
        arms[label] = step
    for _ in range(args.steps):
        for label, step in arms.items():
            out[label]["each_s"].append(_timed(step, device)[0])
    for label in arms:
        out[label]["median_s"] = statistics.median(out[label]["each_s"])
    if len(arms) == 2:
        out["local_over_fused"] = out["local"]["median_s"] / out["fused"]["median_s"]
    return out


def summary(result: dict) -> str:
    u, c = result["update"], result["layers"]

    def pct(x):
        return "n/a" if x is None else f"{100 * x:.1f}%"
    lines = [f"SDPA backends at this shape: {result['sdpa_backends']}"] if "sdpa_backends" in result else []
    lines += [f"update ({result['layer_path']} layers, {result['rows']} x {result['seq']} tokens): "
             f"{u['tokens_per_s']:,.0f} tokens/s, {u['model_tflops']:.1f} TFLOP/s, MFU {pct(u['mfu'])} of "
             f"{result['peak_bf16_tflops']} TFLOP/s, {pct(u['frac_of_measured_matmul'])} of the measured matmul"]
    for label in ("fused", "local"):
        arm = c.get(label, {})
        lines.append(f"  {c['num_layers']} layers, {label}: " + (arm["error"] if "error" in arm else
                     f"{arm['median_s']:.3f} s a step, peak {arm['peak_gib']} GiB"))
    if "local_over_fused" in c:
        lines.append(f"  local / fused step time: {c['local_over_fused']:.2f}x")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    result = run(args)
    print(summary(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0
