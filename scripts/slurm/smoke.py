"""Distributed smoke job for the Slurm scripts (scripts/slurm/tiny_cpu.sh runs it under torchrun).

What it checks, on gloo, with every rank launched by torchrun from the Slurm allocation:
  1. torch.distributed from the torchrun env: all_reduce(rank + 1) == W (W + 1) / 2;
  2. megatron's parallel state built by ``pfppo_mega.parallel.init_parallel(tp, pp=1)``: the
     tensor-parallel group is the ``tp`` consecutive ranks, dp = W / tp;
  3. a megatron tensor-parallel computation across the nodes: vocab-parallel cross entropy over
     logits split on the vocab dimension equals ``F.cross_entropy`` of the full logits;
  4. the trainer's stop / checkpoint / resume protocol (scripts/slurm/lib.sh): ``--steps`` steps,
     each an all-reduce accumulated into ``acc``; at each step boundary rank 0 tests
     $PFPPO_STOP_FILE and broadcasts the answer; when set, rank 0 writes the checkpoint
     (step, acc) and all ranks exit 0. A restarted job resumes from the checkpoint, so ``acc``
     at the end does not depend on how often the job was interrupted:
     acc = sum_{step < steps} sum_{r < W} (r + 1 + step) = steps W (W + 1) / 2 + W steps (steps - 1) / 2.

Rank 0 prints one result line ``SMOKE OK world=.. tp=.. dp=.. steps=.. resumed_from=.. acc=..``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F


def expected_acc(steps: int, world: int) -> int:
    """sum over steps s < steps and ranks r < world of (r + 1 + s)."""
    return steps * world * (world + 1) // 2 + world * steps * (steps - 1) // 2


def _load_checkpoint(path: Path) -> tuple[int, int]:
    if not path.is_file():
        return 0, 0
    state = json.loads(path.read_text())
    return int(state["step"]), int(state["acc"])


def _save_checkpoint(path: Path, step: int, acc: int) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"step": step, "acc": acc}))
    os.replace(tmp, path)  # atomic: a kill mid-write leaves the previous checkpoint


def _check_tensor_parallel_cross_entropy(tp_rank: int, tp: int) -> float:
    """max |vocab-parallel CE - F.cross_entropy| on fixed logits [S=4, B=2, V=8*tp]."""
    from megatron.core import tensor_parallel

    gen = torch.Generator().manual_seed(0)
    vocab = 8 * tp
    logits = torch.randn(4, 2, vocab, generator=gen, dtype=torch.float64)  # [S, B, V]
    target = torch.randint(0, vocab, (4, 2), generator=gen)                 # [S, B]
    ref = F.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1), reduction="none").view(4, 2)
    shard = logits.chunk(tp, dim=-1)[tp_rank].float().contiguous()          # [S, B, V/tp]
    # vocab_parallel_cross_entropy overwrites its input in place; the shard is a private copy.
    loss = tensor_parallel.vocab_parallel_cross_entropy(shard, target)
    return float((loss.double() - ref).abs().max())


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--step-seconds", type=float, default=0.0, help="sleep per step (so a test can signal)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--checkpoint", default=None, help="checkpoint file (default $JOB_DIR/smoke_checkpoint.json)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    from pfppo_mega.parallel import destroy_parallel, init_parallel
    from megatron.core import parallel_state

    info = init_parallel(tp=args.tp, pp=1, backend="gloo", seed=1)
    rank, world = info.rank, info.world_size
    ckpt = Path(args.checkpoint or Path(os.environ.get("JOB_DIR", ".")) / "smoke_checkpoint.json")
    stop_file = os.environ.get("PFPPO_STOP_FILE")

    # 1. a world all-reduce
    x = torch.tensor([rank + 1], dtype=torch.int64)
    dist.all_reduce(x)
    if int(x) != world * (world + 1) // 2:
        print(f"SMOKE FAIL rank {rank}: all_reduce(rank + 1) = {int(x)} != {world * (world + 1) // 2}", flush=True)
        return 1

    # 2. megatron groups: tp consecutive ranks, data parallel over the rest
    tp_ranks = dist.get_process_group_ranks(parallel_state.get_tensor_model_parallel_group())
    want = list(range(rank - rank % args.tp, rank - rank % args.tp + args.tp))
    if tp_ranks != want or parallel_state.get_data_parallel_world_size() != info.dp:
        print(f"SMOKE FAIL rank {rank}: tp group {tp_ranks} != {want} or dp "
              f"{parallel_state.get_data_parallel_world_size()} != {info.dp}", flush=True)
        return 1

    # 3. a tensor-parallel computation across the nodes
    ce_err = _check_tensor_parallel_cross_entropy(parallel_state.get_tensor_model_parallel_rank(), args.tp)
    if ce_err > 1e-5:
        print(f"SMOKE FAIL rank {rank}: vocab-parallel cross entropy differs by {ce_err:.2e} (> 1e-5)", flush=True)
        return 1

    # 4. steps with the stop / checkpoint / resume protocol
    start, acc = _load_checkpoint(ckpt)
    if rank == 0 and start:
        print(f"[smoke] resumed from step {start} (acc={acc})", flush=True)
    for step in range(start, args.steps):
        y = torch.tensor([rank + 1 + step], dtype=torch.int64)
        dist.all_reduce(y)
        acc += int(y)
        time.sleep(args.step_seconds)
        stop = torch.tensor([int(rank == 0 and bool(stop_file) and os.path.exists(stop_file))])
        dist.broadcast(stop, src=0)  # one decision for all ranks
        if rank == 0:
            print(f"[smoke] step {step + 1}/{args.steps} acc={acc}", flush=True)
        if int(stop) and step + 1 < args.steps:
            if rank == 0:
                _save_checkpoint(ckpt, step + 1, acc)
                print(f"[smoke] stop requested: checkpoint at step {step + 1} written to {ckpt}", flush=True)
            destroy_parallel()
            return 0

    if acc != expected_acc(args.steps, world):
        print(f"SMOKE FAIL rank {rank}: acc {acc} != {expected_acc(args.steps, world)}", flush=True)
        return 1
    if rank == 0:
        _save_checkpoint(ckpt, args.steps, acc)
        print(f"SMOKE OK world={world} tp={args.tp} dp={info.dp} steps={args.steps} "
              f"resumed_from={start} acc={acc} ce_err={ce_err:.1e}", flush=True)
    destroy_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
