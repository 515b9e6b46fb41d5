"""Refit through the trainer's seam in one process (tests/multirank/refit_checks.py runs the same
over 2 and 4 ranks): the megatron actor's weights -> buckets -> engine, bit-exact; the sharded
pool's capture / switch / checkpoint round trip; engine selection errors.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "multirank"))

import common  # noqa: E402

from pfppo_mega import parallel  # noqa: E402
from pfppo_mega.compat import megatron_cpu  # noqa: E402
from pfppo_mega.pool.snapshots import SnapshotPool  # noqa: E402
from pfppo_mega.rollout import SamplingParams  # noqa: E402
from pfppo_mega.rollout.weights import WeightUpdateError  # noqa: E402
from pfppo_mega.rollout.base import EngineSetupError  # noqa: E402
from pfppo_mega.trainer.colocation.engine_sync import EngineSync, build_engine  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from pfppo_mega.models import gpt, hf_io

    root = tmp_path_factory.mktemp("refit")
    model = common.hf_model("qwen2")  # tied + q/k/v biases: the harder layout
    model.save_pretrained(root / "qwen2")
    path = root / "qwen2"
    parallel.init_parallel(tp=1, pp=1, seed=0)
    try:
        cfg, arch = common.model_config(path)
        actor = gpt.build_actor(cfg, arch=arch)
        hf_io.load_actor_from_hf(actor, path)
        yield path, actor, cfg, hf_io.load_hf_state_dict(path), hf_io.read_hf_config(path)
    finally:
        parallel.destroy_parallel()
        megatron_cpu.disable()


def _cfg(engine="builtin", rtp=1, top_p=1.0, bucket_mb=0.02, dtype="auto"):
    ar = SimpleNamespace(engine=engine, tensor_model_parallel_size=rtp, top_p=top_p, refit_bucket_mb=bucket_mb,
                         gpu_memory_utilization=0.5, refit_timeout_s=60.0, dtype=dtype, max_num_seqs=8,
                         enforce_eager=None, sleep_level=2)
    return SimpleNamespace(actor_rollout=ar, training=SimpleNamespace(seed=0), model=SimpleNamespace(params_dtype="float32"),
                           data=SimpleNamespace(max_prompt_length=8), algorithm=SimpleNamespace(max_response_length=8))


def test_live_refit_capture_switch_and_checkpoint(setup):
    path, actor, cfg, original, hf_cfg = setup
    engine = build_engine(_cfg(), path, hf_cfg, pad_token_id=0, world_size=1, log=lambda *_: None)
    sync = EngineSync(engine, actor, cfg, refit_timeout_s=60.0, local_world_size=1, log=lambda *_: None)
    assert len(sync.plan) > 5
    sync.refit_live(2)
    assert engine.weight_version == 2
    assert all(torch.equal(engine._params[n], original[n]) for n, _ in engine.weight_layout().specs)

    pool = sync.new_pool(2)
    sync.capture(pool, 2)
    copied = sync.new_pool(2)  # the copying capture of any stream keeps the same bytes and checksums
    copied.capture(2, sync.live(2).buckets(sync.plan))
    assert copied._producer_checksums == pool._producer_checksums and copied.stream_checksums == pool.stream_checksums
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(copied.snapshots[0].tensors, pool.snapshots[0].tensors))
    params = SamplingParams(1.0, 1.0, 10, None, seed=3)
    before = engine.generate([[1, 2, 3], [4]], params)
    with torch.no_grad():  # the actor moves on
        for p in actor.parameters():
            p.add_(0.05)
    sync.refit_live(3)
    assert not torch.equal(engine.generate([[1, 2, 3], [4]], params).responses, before.responses)
    assert sync.switch(pool, 2) > 0.0
    version_before = engine.weight_checksum
    sync.switch(pool, 2)  # the engine already holds exactly this snapshot: nothing moves
    assert engine.weight_checksum == version_before
    shard = pool.snapshots[0].tensors[0][1].view(torch.int32)
    shard[0] ^= 1  # rot in host memory is refused even when no byte has to move
    with pytest.raises(WeightUpdateError, match=r"snapshot 2: the shard kept by rank\(s\) \[0\] failed"):
        sync.switch(pool, 2)
    shard[0] ^= 1
    back = engine.generate([[1, 2, 3], [4]], params)
    assert back.versions.tolist() == [2, 2]
    assert torch.equal(back.responses, before.responses) and torch.equal(back.logprobs, before.logprobs)

    # checkpoint round trip (SnapshotPool's state), then a corrupt shard is refused by name
    restored = SnapshotPool.from_state(pool.state_meta(), pool.state_tensors(), check_memory=False)
    again = sync.new_pool(2)
    again.adopt(restored, sync.plan)
    sync.switch(again, 2)
    assert torch.equal(engine.generate([[1, 2, 3], [4]], params).responses, before.responses)
    again.snapshots[0].tensors[3][1].view(torch.int32)[5] ^= 4
    with pytest.raises(WeightUpdateError, match="from rank 0 failed its checksum for version 2"):
        sync.switch(again, 2)
    assert engine.weight_version == -1
    with torch.no_grad():
        for p in actor.parameters():
            p.sub_(0.05)


def test_the_engine_runs_in_the_configured_dtype(setup):
    """actor_rollout.dtype: auto follows model.params_dtype; bfloat16 makes the engine, its refit
    buckets and so its pool snapshots bf16 (half the bytes of fp32)."""
    path, actor, cfg, _, hf_cfg = setup
    auto = build_engine(_cfg(), path, hf_cfg, pad_token_id=0, world_size=1, log=lambda *_: None)
    bf16 = build_engine(_cfg(dtype="bfloat16"), path, hf_cfg, pad_token_id=0, world_size=1, log=lambda *_: None)
    assert auto.dtype == torch.float32 and bf16.dtype == torch.bfloat16
    assert bf16.weight_layout().nbytes * 2 == auto.weight_layout().nbytes
    sync = EngineSync(bf16, actor, cfg, refit_timeout_s=60.0, local_world_size=1, log=lambda *_: None)
    sync.refit_live(3)
    assert bf16.weight_version == 3 and {spec.dtype for spec in sync.plan} == {torch.bfloat16}


def test_the_refit_streams_buffers_are_freed_when_the_engine_sleeps(setup, monkeypatch):
    """The stream's ring (refit._SLOTS) outlives one stream -- a frame's later switches reuse it --
    and goes when the engine sleeps (Generation.colocated -> EngineSync.release_buffers) and after a
    pool capture; the next refit makes a new one. The real bucket stream over the one-process gloo
    world; the ledger's records (a 70B rank's holdings) hold the slots at 'refit' and not from
    'sleep' on, and the recorder's measured refit_slot_bytes says what the stream really held."""
    import contextlib
    import random

    import torch.distributed as dist

    from pfppo_mega.config import load_config
    from pfppo_mega.planning.memory import Hardware, Knobs, RunShape, make_plan
    from pfppo_mega.rollout import refit
    from pfppo_mega.rollout.weights import wire_nbytes
    from pfppo_mega.trainer.colocation.generation import Generation, MemoryRecorder
    from pfppo_mega.ledger import Ledger

    path, actor, cfg, _, hf_cfg = setup
    engine = build_engine(_cfg(), path, hf_cfg, pad_token_id=0, world_size=1, log=lambda *_: None)
    sync = EngineSync(engine, actor, cfg, refit_timeout_s=60.0, local_world_size=1, log=lambda *_: None)
    refit.release_slots()
    size = max(wire_nbytes(s.nbytes) for s in sync.plan)
    ring = (max(1, min(refit.MAX_AHEAD, refit.AHEAD_BYTES // size)) + 1) * size  # the stream's own rule

    def streamed(version: int) -> float:  # refit_live, but through the broadcast stream (world of 1)
        engine.update_weights(refit.broadcast_stream(sync.live(version), sync.plan, dist.group.WORLD), version)
        return 0.0

    streamed(1)
    first = refit._SLOTS[torch.device("cpu")]
    assert refit.held_slot_bytes() == ring > 0
    streamed(2)
    assert refit._SLOTS[torch.device("cpu")] is first  # kept between streams: the same ring
    pool = sync.new_pool(2)
    sync.capture(pool, 2)
    assert refit.held_slot_bytes() == 0  # a capture frees them when it ends
    streamed(3)
    assert refit.held_slot_bytes() == ring and refit.release_slots() == ring and refit.held_slot_bytes() == 0

    # the colocated frame, with a recorder over a 70B rank's ledger (phases and names; no card check)
    monkeypatch.setattr(sync, "refit_live", streamed)
    c70 = load_config(Path(__file__).resolve().parents[1] / "configs" / "70b_pfppo.yaml")
    plan = make_plan(RunShape.from_config(c70), Hardware.preset("h200", nodes=8, gpus_per_node=8), Knobs.from_config(c70))
    offload = SimpleNamespace(enabled=False, device_bytes=lambda: 0, on_device=contextlib.nullcontext)
    memory = MemoryRecorder(Ledger(plan.holdings[0], None), offload, torch.device("cpu"))
    gen = Generation(SimpleNamespace(), engine=engine, sync=sync, offload=offload, tokenizer=None,
                     rng=random.Random(0), device=torch.device("cpu"), guards={}, split=None, log=print,
                     memory=memory)
    with gen.colocated(7, refit=True):
        gen.record("generate")
        assert engine.weight_version == 7 and refit.held_slot_bytes() == ring  # held while the engine is awake
    assert refit.held_slot_bytes() == 0
    slots = plan.holdings[0].refit_slots.name
    seen = {r.phase: (slots in {x.name for x in r.device}, r.measured["refit_slot_bytes"]) for r in memory.records}
    assert seen == {"offload trainer": (False, 0), "wake weights": (False, 0), "refit": (True, ring),
                    "offload actor weights": (True, ring), "wake kv cache": (True, ring), "generate": (True, ring),
                    "sleep": (False, 0), "reload trainer": (False, 0)}, seen


@pytest.mark.parametrize("kw,world,needle", [
    (dict(engine="vllm", rtp=3), 4, r"tensor_model_parallel_size = 3 does not divide the world size \(4\)"),
    (dict(rtp=2), 2, r"builtin engine runs one full copy per rank \(allowed: 1\)"),
    (dict(engine="vllm", top_p=0.9), 1, r"actor_rollout.top_p = 0.9 with engine: vllm"),
    (dict(engine="sglang"), 1, r"actor_rollout.engine = 'sglang': must be one of 'builtin', 'vllm'"),
])
def test_engine_selection_errors(setup, kw, world, needle):
    path, _, _, _, hf_cfg = setup
    with pytest.raises(EngineSetupError, match=needle):
        build_engine(_cfg(**kw), path, hf_cfg, pad_token_id=0, world_size=world, log=print)


def test_vllm_missing_is_named(setup, monkeypatch):
    from pfppo_mega.rollout import vllm as rvllm

    monkeypatch.setattr(rvllm.importlib.util, "find_spec", lambda name: None)
    path, _, _, _, hf_cfg = setup
    with pytest.raises(EngineSetupError, match="actor_rollout.engine = 'vllm': vllm is not installed"):
        build_engine(_cfg(engine="vllm"), path, hf_cfg, pad_token_id=0, world_size=1, log=print)


def test_fingerprint_native_equals_torch_and_catches_a_flipped_bit():
    """The refit fingerprint has one definition: the C++ op (pfppo_mega._C) and the torch ops (any
    device, the fallback) agree on every length, and the fused pack copies strided views exactly."""
    from pfppo_mega.rollout import weights as W

    g = torch.Generator().manual_seed(0)
    for n in (0, 1, 7, 128, 129, 1000, 4101):
        t = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        assert torch.equal(W.fingerprint(t), W._fingerprint_torch(t)), n
        x = torch.randn(6, n // 24 + 1, 4, generator=g)[:, :, 1:3].transpose(0, 1)  # strided
        y = torch.randn(n % 97 + 1, generator=g)
        flat = torch.empty(x.numel() + y.numel())
        fp = W.pack_fingerprint(flat, [x, y])
        assert torch.equal(flat, torch.cat([x.reshape(-1), y])) and torch.equal(fp, W._fingerprint_torch(flat)), n
    t = torch.randn(1000, generator=g)
    base = W.fingerprint(t)
    for word in (0, 333, 999):
        for bit in (0, 17, 31):
            bad = t.clone()
            bad.view(torch.int32)[word] ^= 1 << bit
            assert not torch.equal(W.fingerprint(bad), base), (word, bit)
    swapped = t.clone()
    swapped[[0, 32]] = swapped[[32, 0]]  # two words of the same lane, 128 bytes apart
    assert not torch.equal(W.fingerprint(swapped), base)
    print(f"pfppo_mega._C fingerprint ops: {W._native() is not None}")


def test_trainer_recovers_from_a_dying_engine_and_an_interrupted_switch(tmp_path):
    """Bad input / failure list (issue 9), in the trainer with the PF-PPO pool: an engine that raises
    mid-generation once is refilled with the same verified weights and regenerates (counted in
    guard/engine_failures); a switch interrupted half-way (a bucket that fails to apply) leaves no
    version behind, the snapshot is evicted (guard/corrupt_snapshots) and the step generates with the
    live weights; an engine that keeps failing stops the run with the rank and the cause."""
    import json

    from pfppo_mega.config import load_config_dict
    from pfppo_mega.sft import run_sft
    from pfppo_mega.trainer.loop import PPOTrainer

    from test_trainer import TINY

    d = json.loads(json.dumps(TINY))
    d["sft"].update(output_dir=str(tmp_path / "sft"), steps=10)
    d["actor_rollout"] = {"model_path": str(tmp_path / "sft"), "refit_bucket_mb": 0.01}
    run_sft(load_config_dict(d), log=lambda *_: None)
    d["logging"]["output_dir"] = str(tmp_path / "run")
    d["algorithm"].update(use_pf_ppo=True, pool={"pool_size": 2, "snapshot_interval": 1, "sampling": "uniform"})
    lines: list[str] = []
    tr = PPOTrainer(load_config_dict(d), log=lines.append)
    tr.train_step()  # the pool holds versions 0 and 1 now

    generate, calls = tr.run.colocation.engine.generate, []

    def dies_once(prompts, params):
        calls.append(tr.run.colocation.engine.weight_version)
        if len(calls) == 1:
            tr.run.colocation.engine.invalidate()  # what a dead engine leaves: no usable weights
            raise RuntimeError("engine core died")
        return generate(prompts, params)

    tr.run.colocation.engine.generate = dies_once
    m = tr.train_step()
    assert m["guard/engine_failures"] == 1.0 and tr.run.state.guards["engine_failures"] == 1
    assert calls[0] == calls[1] >= 0  # regenerated with the same version, pushed again
    assert any("engine core died" in line and "pushing weight version" in line for line in lines)
    tr.run.colocation.engine.generate = generate

    apply, applied = tr.run.colocation.engine._apply, []

    def interrupted(named):
        applied.append(1)
        if len(applied) == 3:
            raise OSError("link reset")
        apply(named)

    tr.run.colocation.engine._apply = interrupted
    tr.run.colocation.engine.invalidate()  # the next switch must move bytes
    before = tr.run.state.guards["corrupt_snapshots"]
    m = tr.train_step()
    tr.run.colocation.engine._apply = apply
    assert tr.run.state.guards["corrupt_snapshots"] == before + 1 and len(applied) >= 3
    assert any("refused" in line and "link reset" in line for line in lines)
    assert tr.run.colocation.engine.weight_version >= 0  # a complete, verified version generated the step

    tr.run.colocation.engine.generate = lambda prompts, params: (_ for _ in ()).throw(RuntimeError("engine core died"))
    with pytest.raises(RuntimeError, match=r"rollout engine failed on rank\(s\) \[0\] again .*engine core died"):
        tr.train_step()
