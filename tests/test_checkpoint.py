"""Atomic, verified checkpoints: a crash mid-write or a corrupted file never loses the latest good one."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from pfppo_mega.trainer.checkpoint import store as ckpt


def _tensors(v: float):
    return {"actor": {"w": torch.full((3, 4), v), "b": torch.arange(5)}, "critic": {"v": torch.ones(2) * v}}


def test_round_trip_and_pruning(tmp_path):
    for step in (1, 2, 3):
        ckpt.save_checkpoint(tmp_path, step, _tensors(step), {"step": step, "x": [step]}, keep_last=2)
    dirs = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert dirs == ["step_000002", "step_000003"]
    got = ckpt.load_latest(tmp_path, log=lambda *_: None)
    assert got.step == 3 and got.state["x"] == [3]
    assert torch.equal(got.tensors["actor"]["w"], torch.full((3, 4), 3.0))
    assert torch.equal(got.tensors["actor"]["b"], torch.arange(5))


def test_corrupt_latest_falls_back_to_previous(tmp_path):
    for step in (1, 2):
        ckpt.save_checkpoint(tmp_path, step, _tensors(step), {"step": step}, keep_last=3)
    f = tmp_path / "step_000002" / "actor.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF  # flip one byte of the payload, same size
    f.write_bytes(bytes(data))
    msgs = []
    got = ckpt.load_latest(tmp_path, log=msgs.append)
    assert got.step == 1
    assert any("sha256 mismatch" in m for m in msgs), msgs


def test_missing_manifest_is_skipped(tmp_path):
    ckpt.save_checkpoint(tmp_path, 1, _tensors(1), {"step": 1}, keep_last=3)
    ckpt.save_checkpoint(tmp_path, 2, _tensors(2), {"step": 2}, keep_last=3)
    os.remove(tmp_path / "step_000002" / ckpt.MANIFEST)
    assert ckpt.load_latest(tmp_path, log=lambda *_: None).step == 1


def test_kill_during_write_keeps_previous(tmp_path):
    """A writer SIGKILLed in the middle of a save leaves step 1 loadable and `latest` on it."""
    ckpt.save_checkpoint(tmp_path, 1, _tensors(1), {"step": 1}, keep_last=3)
    script = textwrap.dedent(f"""
        import os, signal, torch
        from pfppo_mega.trainer.checkpoint import store as ckpt
        real = ckpt._fsync_file
        calls = []
        def dying(path):
            calls.append(path)
            if len(calls) == 2:  # after the first tensor file is on disk
                os.kill(os.getpid(), signal.SIGKILL)
            real(path)
        ckpt._fsync_file = dying
        ckpt.save_checkpoint(__import__('pathlib').Path({str(tmp_path)!r}), 2,
                             {{"actor": {{"w": torch.zeros(1000, 1000)}}}}, {{"step": 2}}, keep_last=3)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True)
    assert proc.returncode == -9, proc.stderr.decode()
    assert (tmp_path / ckpt.LATEST).read_text().strip() == "step_000001"
    assert not (tmp_path / "step_000002").exists()
    got = ckpt.load_latest(tmp_path, log=lambda *_: None)
    assert got.step == 1
    # The next successful save cleans the stale temp dir.
    ckpt.save_checkpoint(tmp_path, 3, _tensors(3), {"step": 3}, keep_last=3)
    assert not list(tmp_path.glob("*.tmp-*"))


def test_state_round_trips_as_data(tmp_path):
    """Tuples, int-keyed dicts, non-finite floats and tensors of any dtype come back exactly;
    what is not data (an arbitrary object) is refused at save time."""
    state = {"step": 1, "rng": (3, tuple(range(625)), None), "opt": {"state": {0: {"m": torch.randn(2, 3)}},
             "param_groups": [{"params": [0], "betas": (0.9, 0.999), "lr": float("inf")}]},
             "u8": torch.arange(7, dtype=torch.uint8), "bf": torch.ones(2, dtype=torch.bfloat16), "nan": float("nan")}
    ckpt.save_checkpoint(tmp_path, 1, _tensors(1), state, keep_last=2)
    got = ckpt.load_latest(tmp_path, log=lambda *_: None).state
    assert got["rng"] == state["rng"] and isinstance(got["rng"][1], tuple)
    assert torch.equal(got["opt"]["state"][0]["m"], state["opt"]["state"][0]["m"])
    assert got["opt"]["param_groups"] == [{"params": [0], "betas": (0.9, 0.999), "lr": float("inf")}]
    assert got["u8"].dtype == torch.uint8 and torch.equal(got["u8"], state["u8"])
    assert got["bf"].dtype == torch.bfloat16 and got["nan"] != got["nan"]
    assert sorted(p.name for p in (tmp_path / "step_000001").iterdir()) == [
        "actor.safetensors", "critic.safetensors", "manifest.json", "state.json", "state.safetensors"]
    with pytest.raises(ckpt.CheckpointError, match=r"state /obj: a object cannot be stored as data"):
        ckpt.save_checkpoint(tmp_path, 2, _tensors(2), {"obj": object()}, keep_last=2)


_KILL_ON_MOVE_IN = """
import os, signal, sys, torch
from pathlib import Path
from pfppo_mega.trainer.checkpoint import store as ckpt
real_replace = os.replace
def dying(src, dst, *a, **k):
    if ".tmp-" in str(src) and Path(src).is_dir():  # the new step dir is about to move into place
        os.kill(os.getpid(), signal.SIGKILL)
    return real_replace(src, dst, *a, **k)
os.replace = dying
ckpt.save_checkpoint(Path(sys.argv[1]), 2, {"actor": {"w": torch.full((3, 4), 99.0)}}, {"step": 2}, keep_last=3)
"""


def test_resave_of_the_latest_step_never_loses_it(tmp_path):
    """Re-saving the step `latest` names and being killed just before the new copy moves into
    place: the old copy is still the one loaded (it used to be deleted first, so the run fell back
    to an older step or to none)."""
    ckpt.save_checkpoint(tmp_path, 1, _tensors(1), {"step": 1}, keep_last=3)
    ckpt.save_checkpoint(tmp_path, 2, _tensors(2), {"step": 2}, keep_last=3)
    proc = subprocess.run([sys.executable, "-c", _KILL_ON_MOVE_IN, str(tmp_path)], capture_output=True)
    assert proc.returncode == -9, proc.stderr.decode()
    assert (tmp_path / ckpt.LATEST).read_text().strip() == "step_000002"
    msgs = []
    got = ckpt.load_latest(tmp_path, log=msgs.append)
    assert got.step == 2 and torch.equal(got.tensors["actor"]["w"], torch.full((3, 4), 2.0)), msgs
    # A completed re-save replaces it, and the next save leaves no temp or aside dirs behind.
    ckpt.save_checkpoint(tmp_path, 2, _tensors(7), {"step": 2}, keep_last=3)
    assert torch.equal(ckpt.load_latest(tmp_path, log=msgs.append).tensors["actor"]["w"], torch.full((3, 4), 7.0))
    assert not [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_save_cleans_pointer_temp_files_and_superseded_steps(tmp_path):
    """`.latest.tmp-*` files left by a killed writer are removed by the next save, and so are
    step dirs newer than the saved step (a superseded timeline `latest` can no longer name)."""
    for step in (1, 2, 3):
        ckpt.save_checkpoint(tmp_path, step, _tensors(step), {"step": step}, keep_last=5)
    (tmp_path / ".latest.tmp-424242").write_text("step_000003\n")
    ckpt.save_checkpoint(tmp_path, 2, _tensors(2), {"step": 2}, keep_last=5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000001", "step_000002"]


def test_manifest_must_list_every_file_and_only_data_files(tmp_path):
    ckpt.save_checkpoint(tmp_path, 1, _tensors(1), {"step": 1}, keep_last=3)
    p = tmp_path / "step_000001"
    (p / "notes.txt").write_text("hi")
    with pytest.raises(ckpt.CheckpointError, match=r"'notes.txt' is not listed in manifest.json"):
        ckpt.verify(p)
    os.remove(p / "notes.txt")
    m = json.loads((p / ckpt.MANIFEST).read_text())
    m["files"]["x.pt"] = {"sha256": "0" * 64, "bytes": 0}
    (p / ckpt.MANIFEST).write_text(json.dumps(m))
    with pytest.raises(ckpt.CheckpointError, match=r"file name 'x.pt' is not allowed"):
        ckpt.verify(p)


def test_older_pickled_format_is_refused_by_name(tmp_path):
    p = tmp_path / "step_000001"
    p.mkdir()
    (p / "state.pt").write_bytes(b"\x80\x04junk")
    (p / ckpt.MANIFEST).write_text(json.dumps({"step": 1, "files": {"state.pt": {"sha256": "0" * 64, "bytes": 6}}}))
    with pytest.raises(ckpt.CheckpointError, match=r"format 1 \(a pickled state.pt\) is never loaded"):
        ckpt.load_step(tmp_path, 1)


def test_pool_state_round_trip_and_tampering():
    from pfppo_mega.pool.snapshots import SnapshotPool

    pool = SnapshotPool(2, check_memory=False, log=lambda *_: None)
    for v in (0, 1, 2):
        pool.add(v, [("a", torch.full((2, 3), float(v))), ("b", torch.arange(4) + v)])
    pool.record_samples(2, torch.tensor([1.0, 0.0]), kl_to_current=0.25, current_version=2)
    meta, tensors = pool.state_meta(), pool.state_tensors()
    again = SnapshotPool.from_state(json.loads(json.dumps(meta)), tensors, check_memory=False)
    assert again.state_meta() == meta and again.versions == [1, 2]
    assert again.snapshots[1].stats.reward_mean == 0.5
    bad = dict(tensors)
    bad["0/a"] = bad["0/a"] + 1
    with pytest.raises(ValueError, match=r"snapshot 0 \(version 1\): checksum .* does not match its tensors"):
        SnapshotPool.from_state(meta, bad, check_memory=False)
    with pytest.raises(ValueError, match=r"belong to no snapshot"):
        SnapshotPool.from_state(meta, {**tensors, "9/z": torch.zeros(1)}, check_memory=False)
    with pytest.raises(ValueError, match=r"snapshots must be a list of 1..pool_size\(2\) entries, got 3"):
        SnapshotPool.from_state({**meta, "snapshots": meta["snapshots"] + meta["snapshots"][:1]}, tensors,
                                check_memory=False)


def test_truncate_jsonl_keeps_steps_up_to_the_resumed_one(tmp_path):
    from pfppo_mega.trainer.metrics import truncate_jsonl

    f = tmp_path / "metrics.jsonl"
    f.write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in (0, 1, 2, 3)) + '{"step": 4, "x"')
    assert truncate_jsonl(f, keep_through_step=2) == 2
    assert [json.loads(line)["step"] for line in f.read_text().splitlines()] == [0, 1, 2]
    assert truncate_jsonl(f, keep_through_step=-1) == 3 and f.read_text() == ""


def test_save_copies_only_what_safetensors_cannot_take():
    """Views into one buffer (megatron's parameters), transposes and shared tensors are copied;
    tensors that own their storage (pool snapshots, optimizer moments) are written as they are,
    so a save does not double the host memory of the pool."""
    buffer = torch.arange(12.0)
    own = torch.ones(4)
    out = ckpt._private({"v0": buffer[:6], "v1": buffer[6:], "t": torch.ones(3, 4).t(), "own": own, "again": own})
    assert out["own"].data_ptr() == own.data_ptr()
    assert out["again"].data_ptr() != own.data_ptr() and torch.equal(out["again"], own)
    assert out["v0"].data_ptr() != buffer.data_ptr() and torch.equal(out["v1"], buffer[6:])
    assert out["t"].is_contiguous() and torch.equal(out["t"], torch.ones(4, 3))
