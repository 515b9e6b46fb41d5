"""Atomic, verified checkpoints: a crash mid-write or a corrupted file never loses the latest good one."""

import os
import subprocess
import sys
import textwrap

import torch

from pfppo_mega.trainer import checkpoint as ckpt


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
        from pfppo_mega.trainer import checkpoint as ckpt
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
