"""How long a new weight version takes to reach the generator process (docs/async.md), two ways:

    pipe   as the asynchronous mode did before: each bucket packed from the weights, cloned out of
           the stream's buffer, and the list sent through the process's pipe (multiprocessing
           pickles it; torch moves each tensor's storage to shared memory and passes its handle)
    file   packed straight into a shared mapping of the version's weight file
           (pfppo_mega/trainer/asynchronous/weightfile.py, /dev/shm) and only (version, path) sent;
           the child maps the file

For each: the trainer's blocking time (from the weights to the push call's return), and the time
until the child has verified every bucket (the engine's checksum check) and copied it into its own
weights (the engine's load), measured in the child. Fake weights of a Llama-shaped layout: configs/async_tiny.yaml's model, and
SmolLM2-135M's shape (30 layers, hidden 576, ffn 1536, 9 heads / 3 KV heads, vocab 49152, tied).

    python scripts/async_weight_push.py [--repeats 5] [--dtype float32] [--sizes tiny 135m]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, not an installed one

from pfppo_mega.rollout.weights import Bucket, WeightLayout, plan_buckets
from pfppo_mega.trainer.asynchronous import weightfile

SHAPES = {  # layers, hidden, ffn, heads, kv heads, vocab, tied
    "tiny": (2, 64, 192, 2, 2, 16, False),
    "135m": (30, 576, 1536, 9, 3, 49152, True),
}


def layout(size: str, dtype: torch.dtype) -> WeightLayout:
    layers, h, ffn, heads, kv, vocab, tied = SHAPES[size]
    d = h // heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "self_attn.q_proj.weight": (heads * d, h),
                       p + "self_attn.k_proj.weight": (kv * d, h), p + "self_attn.v_proj.weight": (kv * d, h),
                       p + "self_attn.o_proj.weight": (h, heads * d), p + "post_attention_layernorm.weight": (h,),
                       p + "mlp.gate_proj.weight": (ffn, h), p + "mlp.up_proj.weight": (ffn, h),
                       p + "mlp.down_proj.weight": (h, ffn)})
    shapes["model.norm.weight"] = (h,)
    if not tied:
        shapes["lm_head.weight"] = (vocab, h)
    return WeightLayout.of(shapes, dtype, tied=tied)


def fake_model(lay: WeightLayout, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g).to(lay.dtype) for n, s in lay.specs}


def produce(model: dict[str, torch.Tensor], version: int):
    """A weight source's produce(spec, wire): the bucket packed from the model (into ``wire`` when given)."""
    return lambda spec, wire=None: Bucket.pack(spec, version, [model[n] for n in spec.names], wire=wire)


def push_pipe(conn, plan, model, version: int) -> None:
    """Before: each bucket packed, detached from the stream's buffer, the list sent through the pipe."""
    make = produce(model, version)
    buckets = [make(spec) for spec in plan]
    conn.send(("pipe", version, [Bucket(b.spec, b.version, b.flat.clone(), b.checksum) for b in buckets]))


def push_file(conn, files, plan, model, version: int) -> None:
    """After: packed straight into the version's file, its path sent."""
    conn.send(("file", version, files.pack(version, plan, produce(model, version))))
    files.remove([version - 2])


def child(inbox, outbox) -> None:
    torch.set_num_threads(1)
    dest = None
    while True:
        msg = inbox.recv()
        if msg[0] == "stop":
            return
        t0 = time.perf_counter()
        buckets = msg[2] if msg[0] == "pipe" else weightfile.read(msg[2], msg[1])
        if dest is None:
            dest = [torch.empty_like(b.flat) for b in buckets]
        for b, d in zip(buckets, dest):
            b.verify(msg[1])
            d.copy_(b.flat)
        outbox.send((time.perf_counter() - t0, time.perf_counter()))
        del buckets


def measure(size: str, dtype: torch.dtype, repeats: int, bucket_bytes: int) -> dict[str, list[tuple[float, float]]]:
    lay = layout(size, dtype)
    ctx = mp.get_context("spawn")
    inbox, to_child = ctx.Pipe(duplex=False)
    from_child, outbox = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=child, args=(inbox, outbox), daemon=True)
    proc.start()
    files = weightfile.WeightFiles()
    out: dict[str, list[tuple[float, float]]] = {"pipe": [], "file": []}
    plan = plan_buckets(lay, bucket_bytes)
    try:
        for version in range(repeats):
            model = fake_model(lay, version)
            for how in ("pipe", "file"):  # interleaved
                v = version * 2 + (how == "file")
                t0 = time.perf_counter()
                if how == "pipe":
                    push_pipe(to_child, plan, model, v)
                else:
                    push_file(to_child, files, plan, model, v)
                blocked = time.perf_counter() - t0
                _, t_end = from_child.recv()
                out[how].append((blocked, t_end - t0))
    finally:
        to_child.send(("stop",))
        proc.join(30)
        files.close()
    print(f"{size}: {len(lay.specs)} tensors, {lay.nbytes / 2**20:.1f} MiB in {dtype}, "
          f"{len(plan_buckets(lay, bucket_bytes))} bucket(s)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--sizes", nargs="+", default=["tiny", "135m"], choices=sorted(SHAPES))
    ap.add_argument("--bucket-mb", type=float, default=64.0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    rows = []
    for size in args.sizes:
        res = measure(size, dtype, args.repeats, int(args.bucket_mb * 2**20))
        for how, xs in res.items():
            b, e = [x[0] for x in xs[1:] or xs], [x[1] for x in xs[1:] or xs]  # the first is a warm-up
            rows.append(f"| {size} | {how} | {statistics.median(b):.4f} | {statistics.median(e):.4f} |")
    print("\n".join(["| model | path | trainer blocked (s), median | until loaded in the child (s), median |",
                     "|---|---|---|---|", *rows]))


if __name__ == "__main__":
    main()
