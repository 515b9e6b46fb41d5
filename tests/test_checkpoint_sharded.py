"""Sharded checkpoints (format 3) through the trainer: a SIGKILL at any point of a background
save leaves `latest` on a complete checkpoint that resumes; a missing or corrupt part, a step
whose commit never happened, a layout that does not fit and an older format are named errors
or a fallback to the previous complete step."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pfppo_mega.trainer.checkpoint import store as ckpt
from pfppo_mega.trainer.checkpoint import resume
from pfppo_mega.trainer.loop import PPOTrainer
from test_trainer import TINY, _cfg
from test_trainer_resume import PART, _LOG, quiet, sft_small  # noqa: F401

REPO = Path(__file__).resolve().parents[1]


def _two_steps(sft: Path, out: Path, **sections) -> None:
    PPOTrainer(_cfg(out, sft, logging=_LOG, training={"total_training_steps": 2},
                    checkpoint={"save_interval": 1, "keep_last": 3}, **sections), log=quiet).fit()


@pytest.fixture(scope="module")
def run_dir(sft_small, tmp_path_factory):
    """A finished 2-step run with checkpoints at steps 1 and 2 (copied per test before editing)."""
    out = tmp_path_factory.mktemp("sharded") / "run"
    _two_steps(sft_small, out)
    return out


def _copy(run_dir: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(run_dir, out)
    return out


def _resume(sft: Path, out: Path, **sections):
    msgs: list[str] = []
    tr = PPOTrainer(_cfg(out, sft, logging=_LOG, training={"total_training_steps": 4}, **sections), log=msgs.append)
    return tr, msgs


def test_layout_of_a_step(run_dir):
    step = run_dir / "checkpoints" / "step_000002"
    m = json.loads((step / ckpt.MANIFEST).read_text())
    assert m["format"] == 3 and m["layout"] == {"tp": 1, "pp": 1, "dp": 1, "local_world": 1}
    assert sorted(p.name for p in step.iterdir()) == [ckpt.MANIFEST, PART]
    assert sorted(p.name for p in (step / PART).iterdir()) == [
        "actor.safetensors", "critic.safetensors", ckpt.MANIFEST, "state.json", "state.safetensors"]
    state = resume.load_part(run_dir / "checkpoints").state
    assert state["reference"]["path"] and len(state["reference"]["sha256"]) == 64  # identity, not weights
    assert m["parts"][PART]["bytes"] == sum(f.stat().st_size for f in (step / PART).iterdir()
                                            if f.name != ckpt.MANIFEST)


# ---------------------------------------------------------------------------- SIGKILL mid-background-save

_KILL = textwrap.dedent("""
    import json, os, signal, sys, threading
    from pathlib import Path
    from pfppo_mega.config import load_config_dict
    from pfppo_mega.trainer.checkpoint import store as ckpt
    from pfppo_mega.trainer.loop import PPOTrainer

    cfg, where = json.loads(Path(sys.argv[1]).read_text()), sys.argv[2]
    def die():
        os.kill(os.getpid(), signal.SIGKILL)
    saves = []
    real_write, real_digest, real_publish = ckpt.write_dir, ckpt.part_digest, ckpt._publish
    real_fsync = ckpt._fsync_file
    def fsync(path):
        # on the background writer, the second file of step 2's part: mid-write
        if where == "mid_part" and "step_000002.tmp" in str(path) and threading.current_thread().name.startswith("ckpt"):
            saves.append(path)
            if len(saves) == 2:
                die()
        real_fsync(path)
    def digest(part):
        if where == "before_commit" and "step_000002" in str(part):
            die()  # every part on disk, the global manifest not yet written
        return real_digest(part)
    def publish(root, step, tmp, **k):
        if where == "before_rename" and step == 2:
            die()  # the global manifest written, the step not yet moved in
        return real_publish(root, step, tmp, **k)
    ckpt._fsync_file, ckpt.part_digest, ckpt._publish = fsync, digest, publish
    PPOTrainer(load_config_dict(cfg), log=lambda *_: None).fit()
""")


@pytest.mark.parametrize("where", ["mid_part", "before_commit", "before_rename"])
def test_sigkill_during_a_background_save_keeps_latest_loadable(sft_small, tmp_path, where):
    out = tmp_path / "run"
    cfg = json.loads(json.dumps(TINY))
    cfg["actor_rollout"] = {"model_path": str(sft_small)}
    cfg["logging"] = {**cfg.get("logging", {}), **_LOG, "output_dir": str(out)}
    cfg["training"] = {**cfg.get("training", {}), "total_training_steps": 3}
    cfg["checkpoint"] = {"save_interval": 1, "background": True, "export_hf": False}
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", _KILL, str(tmp_path / "cfg.json"), where], capture_output=True,
                          env=env, timeout=300)
    assert proc.returncode == -9, proc.stderr.decode()[-3000:]
    root = out / "checkpoints"
    assert (root / ckpt.LATEST).read_text().strip() == "step_000001"
    assert not (root / "step_000002").exists()
    assert list(root.glob("step_000002.tmp-*"))  # the interrupted save is left as a temp dir, never named
    tr, msgs = _resume(sft_small, out)
    assert tr.step == 1, msgs
    tr.fit()  # and the next commit removes the leftover
    assert not list(root.glob("*.tmp-*")) and (root / ckpt.LATEST).read_text().strip() == "step_000004"


# ---------------------------------------------------------------------------- bad input


def _drop(path: Path) -> None:
    path.unlink()


@pytest.mark.parametrize("case,edit,match", [
    # a part's file missing or corrupted: step 2 is skipped, step 1 resumes
    ("missing_file", lambda s: _drop(s / PART / "actor.safetensors"), r"actor.safetensors listed in the manifest is missing"),
    ("corrupt_file", lambda s: (s / PART / "critic.safetensors").write_bytes(
        (s / PART / "critic.safetensors").read_bytes()[:-1] + b"\0"), r"critic.safetensors: sha256 mismatch"),
    # a part replaced whole (its own manifest consistent): the global manifest pins it
    ("replaced_part", lambda s: (s / PART / ckpt.MANIFEST).write_text(
        (s / PART / ckpt.MANIFEST).read_text() + " "), r"sha256 differs from the global manifest's entry for part"),
    # the commit never happened (a save interrupted on some rank): no global manifest
    ("no_global_manifest", lambda s: _drop(s / ckpt.MANIFEST), r"no manifest.json"),
    ("stray_part", lambda s: (s / "tp0-pp0-dp1").mkdir(), r"'tp0-pp0-dp1' is not listed in manifest.json as a part"),
])
def test_a_bad_step_falls_back_to_the_previous_complete_one(sft_small, run_dir, tmp_path, case, edit, match):
    out = _copy(run_dir, tmp_path)
    edit(out / "checkpoints" / "step_000002")
    tr, msgs = _resume(sft_small, out)
    assert tr.step == 1, msgs
    assert any("skipping step_000002" in m and __import__("re").search(match, m) for m in msgs), msgs


def _edit_global(step: Path, fn) -> None:
    m = json.loads((step / ckpt.MANIFEST).read_text())
    fn(m)
    (step / ckpt.MANIFEST).write_text(json.dumps(m))


@pytest.mark.parametrize("case,edit,match", [
    ("layout_parts", lambda m: m["layout"].update(dp=2), r"parts \['tp0-pp0-dp0'\] must be the 2 ranks of layout"),
    ("layout_type", lambda m: m["layout"].update(tp="1"), r"layout = .* must be \{tp, pp, dp, local_world\}"),
    ("format", lambda m: m.update(format=4), r"format = 4, a sharded checkpoint has format 3"),
    ("bytes", lambda m: m["parts"][PART].update(bytes=-1), r"entry of part 'tp0-pp0-dp0' = .* must be"),
])
def test_a_global_manifest_that_breaks_its_schema_is_named(sft_small, run_dir, tmp_path, case, edit, match):
    out = _copy(run_dir, tmp_path)
    for step in (1, 2):  # every step: nothing to fall back to, the refusal names each
        _edit_global(out / "checkpoints" / f"step_{step:06d}", edit)
    with pytest.raises(ckpt.CheckpointError, match=r"no checkpoint under .* can be used .*" + match):
        _resume(sft_small, out)


def test_a_pf_ppo_pool_of_another_bucket_plan_is_refused_by_name(sft_small, tmp_path):
    """The pool is kept in the rollout layout's buckets: a resume whose bucket plan differs
    (actor_rollout.refit_bucket_mb) cannot re-deal it and says so; with the same plan it resumes
    even when the manifest's node size differs (the buckets re-dealt to this run's keepers)."""
    pf = {"use_pf_ppo": True, "pool": {"pool_size": 2, "snapshot_interval": 1}}
    out = tmp_path / "run"
    _two_steps(sft_small, out, algorithm=pf, actor_rollout={"refit_bucket_mb": 0.01})
    with pytest.raises(ckpt.CheckpointError, match=r"pool snapshots do not have the model's layout"):
        _resume(sft_small, out, algorithm=pf)  # the default bucket size: another plan
    for step in (1, 2):
        _edit_global(out / "checkpoints" / f"step_{step:06d}", lambda m: m["layout"].update(local_world=2))
    tr, msgs = _resume(sft_small, out, algorithm=pf, actor_rollout={"refit_bucket_mb": 0.01})
    assert tr.step == 2 and len(tr.run.strategies.behaviour.pool.versions) == 2, msgs


def test_an_older_format_is_refused_by_name(sft_small, tmp_path):
    out = tmp_path / "run"
    ckpt.save_checkpoint(out / "checkpoints", 1, {"actor": {}}, {"step": 1}, keep_last=2)  # format 2
    with pytest.raises(ckpt.CheckpointError, match=r"holds checkpoints of format 2 \(step_000001\), written before "
                                                   r"sharded checkpoints"):
        _resume(sft_small, out)


# ---------------------------------------------------------------------------- the pool, written in place

_PF = {"use_pf_ppo": True, "pool": {"pool_size": 2, "snapshot_interval": 1, "sampling": "uniform"}}


@pytest.mark.parametrize("hold", [True, False], ids=["held", "control_without_hold"])
def test_the_pool_is_written_in_place_and_not_reused_while_a_save_writes_it(sft_small, tmp_path, monkeypatch, hold):
    """A background save writes the pool's buffers without a host copy; a capture during the write
    must not reuse them (ShardedSnapshotPool.hold_buffers). The writer is slowed so that step 3's
    capture (which evicts a snapshot) runs while step 2's save is writing; step 2 then resumes with
    its pool checksums intact. Without the hold (the control) the same run writes torn bytes and
    the resume refuses step 2 -- so this test can tell."""
    import threading

    from pfppo_mega.pool.sharded import ShardedSnapshotPool

    real, real_capture = ckpt.write_dir, ShardedSnapshotPool.capture_from
    captured, changed = set(), threading.Condition()

    def counted(self, source, *a, **k):
        snap = real_capture(self, source, *a, **k)
        with changed:
            captured.add(source.version)
            changed.notify_all()
        return snap

    def slow(path, step, *a, **k):
        if step == 2:  # write only once the training thread's step-3 capture is done (however loaded the machine)
            with changed:
                changed.wait_for(lambda: 3 in captured, timeout=300)
        return real(path, step, *a, **k)

    monkeypatch.setattr(ShardedSnapshotPool, "capture_from", counted)
    monkeypatch.setattr(ckpt, "write_dir", slow)
    if not hold:
        monkeypatch.setattr(ShardedSnapshotPool, "hold_buffers", lambda self, until: None)
    out = tmp_path / "run"
    PPOTrainer(_cfg(out, sft_small, logging=_LOG, algorithm=_PF, training={"total_training_steps": 3},
                    checkpoint={"save_interval": 1, "keep_last": 3, "max_saves_in_flight": 2}), log=quiet).fit()
    monkeypatch.setattr(ckpt, "write_dir", real)
    shutil.rmtree(out / "checkpoints" / "step_000003")  # resume step 2, the one written during a capture
    (out / "checkpoints" / ckpt.LATEST).write_text("step_000002\n")
    if hold:
        tr, msgs = _resume(sft_small, out, algorithm=_PF)
        assert tr.step == 2, msgs
    else:
        with pytest.raises(ckpt.CheckpointError, match=r"pool"):
            _resume(sft_small, out, algorithm=_PF)


@pytest.mark.parametrize("nodes,local", [(1, 2), (2, 4), (8, 8)])
def test_each_pool_bucket_is_written_once_per_job_and_read_back_by_every_keeper(nodes, local):
    """Every node keeps the same pool bytes (bucket k on node rank k mod L). Saving, bucket k is
    written by exactly one rank (its keeper on node (k // L) mod nodes), so a job writes the pool
    once, spread over all nodes; resuming, every rank finds all the buckets it keeps in the parts
    pool_parts names."""
    world, buckets = nodes * local, 3 * nodes * local + 1
    ranks = [f"r{r}" for r in range(world)]
    names = [f"{slot}/bucket.{k}" for slot in range(2) for k in range(buckets)]
    written: dict[str, list[str]] = {}
    for rank in range(world):
        kept = [n for n in names if int(n.rsplit(".", 1)[1]) % local == rank % local]  # this rank keeps these
        for n in kept:
            if resume.pool_writer(n, local, nodes) == rank // local:
                written.setdefault(n, []).append(ranks[rank])
    assert sorted(written) == sorted(names) and all(len(w) == 1 for w in written.values())  # once each
    per_rank = {r: sum(1 for w in written.values() if w == [r]) for r in ranks}
    assert max(per_rank.values()) - min(per_rank.values()) <= 2 * -(-buckets // (local * nodes))  # spread
    for rank in range(world):
        kept = {n for n in names if int(n.rsplit(".", 1)[1]) % local == rank % local}
        found = {n for n, (w,) in written.items() if w in resume.pool_parts(rank, ranks, local)}
        assert kept <= found, rank


def test_a_save_another_rank_never_finishes_is_not_committed(tmp_path):
    """Rank 0's writer waits for every part's manifest at most checkpoint.commit_timeout_s; a rank
    that died mid-save leaves the step uncommitted with an error naming its part, `latest` unmoved."""
    import torch

    root = tmp_path / "checkpoints"
    tmp = root / "step_000002.tmp-x"
    job = resume._Write(root=root, step=2, tmp=tmp, part=PART, tensors={"optim": {"a/w/param": torch.ones(3)}},
                        state={"step": 2}, commit=True, parts=[PART, "tp0-pp0-dp1"],
                        layout={"tp": 1, "pp": 1, "dp": 2, "local_world": 2}, keep_last=2, threads=1, timeout_s=0.3,
                        log=quiet, inflight=frozenset())
    with pytest.raises(ckpt.CheckpointError, match=r"checkpoint step 2: parts \['tp0-pp0-dp1'\] were not written "
                                                   r"within checkpoint.commit_timeout_s = 0.3 s"):
        job()
    assert not (root / "step_000002").exists() and not (root / ckpt.LATEST).exists()
    assert (tmp / PART / ckpt.MANIFEST).is_file()  # this rank's own part is complete, but not named


@pytest.mark.parametrize("in_flight", [1, 2])
def test_saves_in_flight_are_bounded(sft_small, tmp_path, monkeypatch, in_flight):
    """checkpoint.max_saves_in_flight: with a writer that takes 1.5 s, a second save right after the
    first waits for it at a bound of 1 (the wait counts as blocked time) and does not at 2."""
    import time

    real = ckpt.write_dir
    monkeypatch.setattr(ckpt, "write_dir", lambda *a, **k: (time.sleep(1.5), real(*a, **k))[1])
    tr = PPOTrainer(_cfg(tmp_path, sft_small, logging=_LOG, training={"total_training_steps": 4},
                         checkpoint={"save_interval": 0, "max_saves_in_flight": in_flight}), log=quiet)
    root = tmp_path / "checkpoints"
    tr.train_step()
    first = resume.save(tr.run, root)
    tr.run.state.step += 1  # a later step (no training needed to exercise the bound)
    second = resume.save(tr.run, root)
    waited = second.blocked_s
    resume.wait(root)
    assert first.done.done() and second.done.done()
    assert (waited > 1.0) if in_flight == 1 else (waited < 1.0), waited
    assert (root / ckpt.LATEST).read_text().strip() == f"step_{second.step:06d}"


def test_a_reference_rewritten_in_place_is_refused_by_name(sft_small, run_dir, tmp_path):
    """The checkpoint records the frozen reference's identity, not its weights: the same
    model_path with other weights of the same shapes (rewritten in place) is refused by name,
    not trained against a reference the run never had."""
    from safetensors.torch import load_file, save_file

    model = tmp_path / "sft"
    shutil.copytree(sft_small, model)
    out = _copy(run_dir, tmp_path)
    for step in (1, 2):  # the run was written against sft_small's path: point its config at the copy
        part = out / "checkpoints" / f"step_{step:06d}" / PART
        state = json.loads((part / ckpt.STATE_JSON).read_text())
        state["config"]["actor_rollout"]["model_path"] = str(model)
        state["reference"]["path"] = str(model)
        (part / ckpt.STATE_JSON).write_text(json.dumps(state))
        from test_trainer_resume import resign
        resign(part, ckpt.STATE_JSON)
    tr, _ = _resume(model, out)  # the same files: resumes
    assert tr.step == 2
    sd = load_file(str(model / "model.safetensors"))
    save_file({k: v + 0.01 if v.is_floating_point() else v for k, v in sd.items()}, str(model / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(ckpt.CheckpointError, match=r"the frozen reference \(.*\) is not the one this checkpoint was "
                                                   r"trained against"):
        _resume(model, out)
