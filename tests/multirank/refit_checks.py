"""Broadcast refit checks, run inside the shared multi-rank launch (tests/multirank/checks.py calls
``run`` once per layout; tests/test_parallel.py asserts on the RESULT lines; EXPECTED lists them).

Every rank holds a rollout engine at rollout TP 1 (the built-in engine: the bytes that reach it are
what a vLLM engine would receive). Checks, per trainer layout (tp2, pp2, dp2 on 2 ranks; tp2pp2 on 4):
  refit_live_exact[kind]     LiveWeights -> buckets broadcast over the world group -> every engine
                             holds the checkpoint's tensors bit for bit; same stream checksum on all
  pool_switch_exact          a snapshot captured from that stream and kept 1/world per rank; switch
                             away and back: engine weights and seeded generations bit-identical
  pool_corrupt_shard_refused a bit flipped in the last rank's stored shard: every rank refuses the
                             switch naming that rank; the registry then names a rank whose
                             engine reports another version
  assignment_broadcast       rank 0's snapshot table reaches every rank unchanged
  engine_sync_bounded        the trainer's EngineSync, whose refit groups (world, node, trainer TP
                             for the producer's gather) carry actor_rollout.refit_timeout_s: live
                             refit, pool capture and switch back after a foreign update are exact
                             (a lost rank on those groups: tests/test_refit_timeout.py)
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

CHECKS = ("refit_live_exact[llama]", "refit_live_exact[qwen2]", "pool_switch_exact", "pool_corrupt_shard_refused",
          "assignment_broadcast", "engine_sync_bounded")
BUCKET_BYTES = 20_000  # many buckets for the tiny model (whole fused groups each)


def _engine(path: Path):
    from pfppo_mega.models import hf_io
    from pfppo_mega.rollout import BuiltinEngine, DecoderShape

    return BuiltinEngine(DecoderShape.from_hf_config(hf_io.read_hf_config(path)), pad_token_id=0,
                         bucket_bytes=BUCKET_BYTES, log=lambda *_: None)


def _actor(path: Path):
    from pfppo_mega.models import gpt, hf_io

    import common

    cfg, arch = common.model_config(path)
    actor = gpt.build_actor(cfg, arch=arch)
    hf_io.load_actor_from_hf(actor, path)
    return actor, cfg


def _live_source(path: Path, engine, version: int):
    from pfppo_mega.rollout.live import LiveWeights

    actor, cfg = _actor(path)
    source = LiveWeights(actor, cfg, engine.weight_layout(), version)
    return source, source.plan(BUCKET_BYTES)


def _weights_equal(engine, original: dict) -> bool:
    return all(torch.equal(engine._params[n], original[n]) for n, _ in engine.weight_layout().specs)


def run(layout: str, paths: dict, report, all_ranks_ok) -> None:
    from pfppo_mega.models import hf_io
    from pfppo_mega.pool.assignment import VersionMismatchError, broadcast_assignment, check_engine_versions
    from pfppo_mega.pool.sharded import ShardedSnapshotPool
    from pfppo_mega.rollout import SamplingParams
    from pfppo_mega.rollout.source import NamedTensorSource
    from pfppo_mega.rollout.weights import WeightUpdateError

    world, rank = dist.get_world_size(), dist.get_rank()
    for kind, path in paths.items():
        engine = _engine(path)
        source, plan = _live_source(path, engine, version=3)
        engine.update_weights(source.buckets(plan, group=None if world == 1 else dist.group.WORLD), version=3)
        original = hf_io.load_hf_state_dict(path)
        ok = _weights_equal(engine, original) and engine.weight_version == 3
        try:
            check_engine_versions(engine.weight_version, engine.weight_checksum)
        except VersionMismatchError:
            ok = False
        report(layout, f"refit_live_exact[{kind}]", all_ranks_ok(ok), 0.0, 0.0, f"buckets={len(plan)}")

    # ---- the pool, captured from the live stream, 1/world of it per rank
    path = paths["llama"]
    engine = _engine(path)
    source, plan = _live_source(path, engine, version=3)
    pool = ShardedSnapshotPool(2, engine.weight_layout(), rank=rank, node_ranks=list(range(world)),
                               check_memory=False, log=lambda *_: None)
    pool.capture_from(source, plan, dist.group.WORLD)  # kept buckets land straight in their keeper's buffers
    engine.update_weights(pool.source(3).buckets(plan, group=dist.group.WORLD), version=3)
    params = SamplingParams(1.0, 0.9, 12, None, seed=11)
    prompts = [[1, 2, 3], [7, 8], [4, 4, 4, 4, 9]]
    before = engine.generate(prompts, params)
    original = hf_io.load_hf_state_dict(path)
    gen = torch.Generator().manual_seed(5)
    other = {n: t + 0.5 * torch.randn(t.shape, generator=gen) for n, t in original.items()}
    engine.update_weights(NamedTensorSource(other.items(), 4).buckets(plan), version=4)
    moved = not torch.equal(engine.generate(prompts, params).responses, before.responses)
    engine.update_weights(pool.source(3).buckets(plan, group=dist.group.WORLD), version=3)
    after = engine.generate(prompts, params)
    local = torch.tensor([pool.bytes_total()], dtype=torch.int64)
    dist.all_reduce(local)
    share_ok = int(local) == engine.weight_layout().nbytes and pool.bytes_total() < engine.weight_layout().nbytes
    ok = (moved and _weights_equal(engine, original) and torch.equal(after.responses, before.responses)
          and torch.equal(after.logprobs, before.logprobs) and share_ok)
    report(layout, "pool_switch_exact", all_ranks_ok(ok), 0.0, 0.0,
           f"local_bytes={pool.bytes_total()} model_bytes={engine.weight_layout().nbytes}")

    # ---- a corrupt shard on the last rank: every engine refuses the switch and names it
    bad_rank = world - 1
    if rank == bad_rank:
        shard = pool.snapshots[0].tensors[0][1]
        shard.view(torch.int32)[0] ^= 1
    try:
        engine.update_weights(pool.source(3).buckets(plan, group=dist.group.WORLD), version=3)
        ok, note = False, "accepted"
    except WeightUpdateError as e:
        ok, note = f"from rank {bad_rank} failed its checksum" in str(e), str(e)[:60]
    ok = ok and engine.weight_version == -1
    try:  # the registry: the last rank claims another version
        check_engine_versions(9 if rank == bad_rank else 8, "x" * 32)
        ok = False
    except VersionMismatchError as e:
        ok = ok and f"rank {bad_rank} generated with weight version 9" in str(e) and "rank 0 with version 8" in str(e)
    report(layout, "pool_corrupt_shard_refused", all_ranks_ok(ok), 0.0, 0.0)

    table = torch.randint(0, 3, (16,), generator=torch.Generator().manual_seed(100 + rank))
    got = broadcast_assignment(table if rank == 0 else None, 16)
    ref = torch.randint(0, 3, (16,), generator=torch.Generator().manual_seed(100))
    report(layout, "assignment_broadcast", all_ranks_ok(torch.equal(got, ref)), 0.0, 0.0)

    # ---- the trainer's EngineSync over its bounded refit groups
    from megatron.core import parallel_state as ps

    from pfppo_mega.trainer.colocation.engine_sync import EngineSync

    engine = _engine(path)
    actor, cfg = _actor(path)
    sync = EngineSync(engine, actor, cfg, local_world_size=world, refit_timeout_s=60.0, log=lambda *_: None)
    sync.refit_live(7)
    ok = engine.weight_version == 7 and _weights_equal(engine, original)
    pool = sync.new_pool(2)
    sync.capture(pool, 7)
    engine.update_weights(NamedTensorSource(other.items(), 8).buckets(sync.plan), version=8)
    moved = not _weights_equal(engine, original)
    sync.switch(pool, 7)
    ok = ok and moved and engine.weight_version == 7 and _weights_equal(engine, original)
    tp = ps.get_tensor_model_parallel_world_size()
    groups_ok = sync.groups.world is not None and (sync.groups.tp is not None) == (tp > 1)
    report(layout, "engine_sync_bounded", all_ranks_ok(ok and groups_ok), 0.0, 0.0, f"buckets={len(sync.plan)}")
