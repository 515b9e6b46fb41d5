"""A refit interrupted half-way by a lost rank ends in a clear error within actor_rollout.refit_timeout_s,
never a hang (docs/refit.md, "Failure handling").

Two gloo processes (torch.multiprocessing spawn, one launch for both cases), each with a built-in
engine and its half of a sharded pool (bucket b kept by rank b mod 2, as on a node of two ranks);
the switch to a snapshot goes through the trainer's path (engine_sync.update_everywhere over
RefitGroups, the groups with the bounded wait):
  stalled: rank 1 stops for longer than the timeout after applying 2 buckets; rank 0 must raise
           RefitTimeoutError (refit, version, bucket, key named) after about the timeout, not later;
  died:    rank 1 exits (os._exit) after applying 2 buckets of the next switch; rank 0 must raise
           the same clear error, at once (its peer's connection is gone) and within the timeout.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

TIMEOUT_S = 3.0
STALL_S = TIMEOUT_S + 2.0
BUCKET_BYTES = 4_000  # many buckets for the tiny model
HF = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=32, hidden_size=32,
          intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
          max_position_embeddings=32, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)


def _interrupt(engine, after: int, action) -> None:
    """Run ``action`` (once) when this rank's engine is about to apply its bucket number ``after``."""
    apply, seen = engine._apply, [0]

    def hooked(named):
        seen[0] += 1
        if seen[0] == after + 1:
            action()
        apply(named)

    engine._apply = hooked


def _switch(engine, pool, plan, version, groups):
    from pfppo_mega.trainer.colocation.engine_sync import RefitTimeoutError, update_everywhere

    t0 = time.perf_counter()
    try:
        update_everywhere(engine, pool.source(version), plan, version, stream_group=groups.node, groups=groups,
                          what=f"switch to snapshot {version}")
        return {"error": None, "elapsed": time.perf_counter() - t0, "version": engine.weight_version}
    except RefitTimeoutError as e:
        return {"error": str(e), "elapsed": time.perf_counter() - t0, "version": engine.weight_version}


def _worker(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    from pfppo_mega.pool.sharded import ShardedSnapshotPool
    from pfppo_mega.rollout import BuiltinEngine, DecoderShape
    from pfppo_mega.rollout.source import NamedTensorSource
    from pfppo_mega.trainer.colocation.engine_sync import RefitGroups

    engine = BuiltinEngine(DecoderShape.from_hf_config(HF), pad_token_id=0, bucket_bytes=BUCKET_BYTES,
                           log=lambda *_: None)
    layout, plan = engine.weight_layout(), engine.bucket_plan()
    gen = torch.Generator().manual_seed(0)
    pool = ShardedSnapshotPool(2, layout, rank=rank, node_ranks=[0, 1], check_memory=False, log=lambda *_: None)
    for version in (5, 6):  # every rank holds the same weights here and keeps its half of each snapshot
        weights = [(name, torch.randn(shape, generator=gen)) for name, shape in layout.specs]
        pool.capture(version, NamedTensorSource(weights, version).buckets(plan))
    result: dict = {"buckets": len(plan)}

    groups = RefitGroups(TIMEOUT_S, local_world_size=2)
    result["healthy"] = _switch(engine, pool, plan, 5, groups)
    if rank == 1:
        _interrupt(engine, 2, lambda: time.sleep(STALL_S))
    result["stalled"] = _switch(engine, pool, plan, 6, groups)

    groups = RefitGroups(TIMEOUT_S, local_world_size=2)  # the stalled one is broken: fresh groups
    engine.__dict__.pop("_apply", None)  # rank 1: its own apply again
    if rank == 1:
        Path(out, "rank1.json").write_text(json.dumps(result))
        _interrupt(engine, 2, lambda: os._exit(0))
    result["died"] = _switch(engine, pool, plan, 5, groups)
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # a peer is gone: skip the process group's teardown


def test_refit_timeout_key_is_validated():
    import pytest

    from pfppo_mega.config import ConfigError
    from pfppo_mega.config.tree import ActorRolloutConfig
    from pfppo_mega.trainer.colocation.engine_sync import RefitGroups

    assert ActorRolloutConfig().refit_timeout_s == 300.0
    for bad in (0.0, -1.0, 1e9):
        with pytest.raises(ConfigError, match=rf"refit_timeout_s = {bad}: must be > 0 and <= 86400.0"):
            ActorRolloutConfig(refit_timeout_s=bad)
    with pytest.raises(ValueError, match=r"actor_rollout.refit_timeout_s = 0: must be > 0"):
        RefitGroups(0, local_world_size=1)
    assert RefitGroups(12.5, local_world_size=1).timeout_s == 12.5  # the trainer's: tests/test_strategies.py


def test_a_lost_rank_mid_refit_is_a_clear_error_within_the_timeout():
    import torch.multiprocessing as mp

    out = tempfile.mkdtemp(prefix="pfppo-refit-timeout-")
    t0 = time.perf_counter()
    mp.spawn(_worker, args=(os.path.join(out, "store"), out), nprocs=2, join=True)
    total = time.perf_counter() - t0
    r0 = json.loads(Path(out, "rank0.json").read_text())
    r1 = json.loads(Path(out, "rank1.json").read_text())
    print(f"refit timeout {TIMEOUT_S} s, {r0['buckets']} buckets: stalled peer -> error after "
          f"{r0['stalled']['elapsed']:.2f} s; dead peer -> error after {r0['died']['elapsed']:.2f} s; "
          f"launch total {total:.1f} s\n  {r0['died']['error']}")
    for r in (r0, r1):
        assert r["healthy"]["error"] is None and r["healthy"]["version"] == 5
    for case, version in (("stalled", 6), ("died", 5)):
        err = r0[case]["error"]
        assert err is not None, f"{case}: rank 0 completed a switch its peer never finished"
        for needle in (f"switch to snapshot {version}", f"weight version {version}", "stopped at bucket ",
                       "actor_rollout.refit_timeout_s = 3 s"):
            assert needle in err, (case, needle, err)
        assert r0[case]["version"] == -1  # no engine keeps a half-applied update
    # the stalled peer: the backend's bounded wait fired, after about the timeout and not much later
    assert 0.8 * TIMEOUT_S <= r0["stalled"]["elapsed"] <= TIMEOUT_S + 3.0, r0["stalled"]
    # the dead peer: its connection is gone, so the error comes at once, within the timeout
    assert r0["died"]["elapsed"] <= TIMEOUT_S + 1.0, r0["died"]
    # the stalled rank itself, once it moves again, finds the refit abandoned: the same clear error
    assert r1["stalled"]["error"] is not None and "switch to snapshot 6" in r1["stalled"]["error"]


if __name__ == "__main__":
    sys.exit(os.system(f"{sys.executable} -m pytest -q -s {__file__}"))
