"""The asynchronous mode with a tensor- and a pipeline-parallel trainer (one torchrun launch, 2
trainer processes on gloo: TP2 3 steps + a resume at TP2, then PP2 2 steps; docs/async.md, "Data,
tensor and pipeline parallel"), and the same first batch trained at TP1 in this process: equal
losses; TP2's checkpoint with requests in flight resumed at TP1 trains the TP2 resume's rows to its
losses. A second launch of 4 ranks: TP2 x PP2 and DP2 x TP2 (two replicas), 2 steps each."""

import json
import math
import shutil
import sys
from pathlib import Path

from pfppo_mega.config import load_config
from pfppo_mega.trainer.loop import PPOTrainer

sys.path.insert(0, str(Path(__file__).resolve().parent / "multirank"))
import async_tp  # noqa: E402  (tests/multirank/async_tp.py: the launch's script; its watch for the TP1 run)
from async_launch import CONFIG, sft_and_launch  # noqa: E402  (tests/multirank/async_launch.py)

LOSSES = ("policy/pg_loss", "critic/value_loss", "policy/loss", "reward/mean", "critic/return_mean")


def _tp1_reference(sft: Path, out: Path) -> tuple[dict, list[dict]]:
    over = [f"actor_rollout.model_path={sft}", "algorithm.async_rl.request_prompts=4", f"logging.output_dir={out}",
            "training.total_training_steps=2"]
    record = {"pids": [], "files": [], "digests": []}
    with PPOTrainer(load_config(CONFIG, over), log=lambda *_: None) as tr:
        async_tp.watch(tr, record)
        result = tr.fit()
    return record, [json.loads(line) for line in open(result.metrics_path)]


def _tp1_resume_of_step3(sft: Path, saved: Path, out: Path) -> tuple[dict, list[dict], int]:
    """The TP2 run's step-3 checkpoint (its step-4 checkpoint and record removed from a copy) resumed
    at TP1 for step 4: (its record, its metrics, the requests asked again)."""
    shutil.copytree(saved, out)
    shutil.rmtree(out / "checkpoints" / "step_000004")
    (out / "async_pending" / "step_00000004.json").unlink()
    (out / "checkpoints" / "latest").write_text("step_000003")
    over = [f"actor_rollout.model_path={sft}", "algorithm.async_rl.request_prompts=4", f"logging.output_dir={out}",
            "checkpoint.resume=true", "checkpoint.save_interval=3", "training.total_training_steps=4"]
    record = {"pids": [], "files": [], "digests": []}
    with PPOTrainer(load_config(CONFIG, over), log=lambda *_: None) as tr:
        asked = len(tr.run.strategies.collector.restored or [])
        async_tp.watch(tr, record)
        result = tr.fit()
    return record, [json.loads(line) for line in open(result.metrics_path)], asked


def _close(mine: dict, theirs: dict, what) -> None:
    for key in LOSSES:
        assert math.isclose(mine[key], theirs[key], rel_tol=1e-4, abs_tol=1e-6), (what, key, mine[key], theirs[key])


def _step(metrics: list[dict], step: int) -> dict:
    return next(m for m in metrics if m["step"] == step and "policy/pg_loss" in m)


def test_async_tp2_and_pp2_train_checkpoint_resume_and_match_tp1(tmp_path):
    sft, out, everyone = sft_and_launch("async_tp.py", tmp_path)
    r0, r1 = (r["runs"] for r in everyone)
    assert r0["tp2"]["steps"] == 3 and r0["tp2_resumed"]["steps"] == 4 and r0["pp2"]["steps"] == 2
    for name in ("tp2", "tp2_resumed", "pp2"):
        a, b = r0[name], r1[name]
        # one generator, on the replica's leader (rank 0); none on the other rank, none left behind
        assert a["pids"] and all(a["pids"]) and b["pids"] == [None] * len(b["pids"]), name
        assert a["pid_after_fit"] is None and a["pids_alive_after"] == [], name
        # rank 0 writes each version's file once; both ranks see it hold exactly the full weights the
        # synchronous refit gathers from the shards
        assert [f[:2] for f in a["files"]] == [f[:2] for f in b["files"]], name
        assert all(f[2] for f in a["files"] + b["files"]), name
        # every rank of the replica trains the leader's rows
        assert a["digests"] == b["digests"] and len(a["digests"]) == (1 if name == "tp2_resumed" else a["steps"]), name
        recs = [m for m in a["metrics"] if "async/staleness_max" in m]
        assert all(m["async/staleness_max"] <= 2 for m in recs), name
        first = recs[0]  # version 0's rows: the engine (weights from the file) and the TP / PP trainer agree
        assert first["async/staleness_max"] == 0 and first["rollout/logp_gap_max"] < 1e-3, name
    assert [f[0] for f in r0["tp2"]["files"]] == [0, 1, 2, 3] and [f[0] for f in r0["tp2_resumed"]["files"]] == [3, 4]
    assert [f[0] for f in r0["pp2"]["files"]] == [0, 1, 2]
    # the checkpoint with requests in flight: the leader's record (DP1: one file), read by both ranks
    pend = out / "tp2" / "async_pending"
    assert (pend / "step_00000003.json").is_file() and not (pend / "step_00000003.rank1.json").exists()
    assert r0["tp2_resumed"]["resumed_at"] == r1["tp2_resumed"]["resumed_at"] == 3
    assert r0["tp2_resumed"]["restored_requests"] == r1["tp2_resumed"]["restored_requests"] > 0
    assert [m["step"] for m in r0["tp2_resumed"]["metrics"] if "async/staleness_max" in m] == [1, 2, 3, 4]

    # a producer failing on either rank: a named error on both ranks at once, no file left, and the
    # next version is written (PP2: rank 1 owns stage 1's buckets, rank 0 stage 0's and the file)
    f0, f1 = r0["pp2"]["failures"], r1["pp2"]["failures"]
    assert "rank 1 owns bucket" in f0["fail_on_1"] and "produced none" in f0["fail_on_1"], f0
    assert "rank 1 failed" in f1["fail_on_1"] and "sabotaged producer on rank 1" in f1["fail_on_1"], f1
    assert "rank 0" in f0["fail_on_0"] and "sabotaged producer on rank 0" in f0["fail_on_0"], f0
    assert "was not written: rank 0" in f1["fail_on_0"] and "sabotaged producer on rank 0" in f1["fail_on_0"], f1
    assert f0["after"] == f1["after"] == "v99.weights" and f0["left"] == ["v99.weights"]
    # the leader's generator failing for good fails the whole replica at once (no rank left in the broadcast)
    assert f0["generator_failed"] == "injected: died more than max_restarts times"
    assert "replica (on rank 0) failed: injected" in f1["generator_failed"], f1

    # the same first batch at TP1: the same rows, the same losses
    ref, ref_metrics = _tp1_reference(sft, tmp_path / "tp1")
    for name in ("tp2", "pp2"):
        assert r0[name]["digests"][0] == ref["digests"][0], name
        compared = [1] + [s for s in (2,) if r0[name]["digests"][s - 1] == ref["digests"][s - 1]]
        for step in compared:
            _close(_step(r0[name]["metrics"], step), _step(ref_metrics, step), (name, step))

    # exact resume across layouts: the TP2 checkpoint at step 3 (requests in flight) resumed at TP1
    # asks the same requests again and trains the same step-4 rows as the TP2 resume, to the same losses
    res, res_metrics, asked = _tp1_resume_of_step3(sft, out / "tp2", tmp_path / "tp1_resumed")
    assert asked == r0["tp2_resumed"]["restored_requests"] and [f[0] for f in res["files"]] == [3, 4]
    assert all(f[2] for f in res["files"]) and res["digests"] == r0["tp2_resumed"]["digests"]
    _close(_step(res_metrics, 4), _step(r0["tp2_resumed"]["metrics"], 4), "tp1 resume of tp2's step 3")


def test_async_tp2pp2_and_dp2tp2_one_generator_per_replica(tmp_path):
    _, _, everyone = sft_and_launch("async_tp.py", tmp_path, nproc=4)
    runs = [r["runs"] for r in everyone]
    for name, leaders in (("tp2pp2", [0]), ("dp2tp2", [0, 2])):
        recs = [r[name] for r in runs]
        assert all(r["steps"] == 2 and r["pids_alive_after"] == [] for r in recs), name
        # a generator on each replica's leader only, each its own process
        assert [i for i, r in enumerate(recs) if any(r["pids"])] == leaders, name
        assert len({r["pids"][0] for r in recs if r["pids"][0]}) == len(leaders), name
        # one file per version, told to every rank, equal to what the refit stream gathers (every rank checks)
        assert all([f[:2] for f in r["files"]] == [f[:2] for f in recs[0]["files"]] for r in recs), name
        assert [f[0] for f in recs[0]["files"]] == [0, 1, 2] and all(f[2] for r in recs for f in r["files"]), name
        # the ranks of a replica (tp-dp-pp order: replica of rank k is (k // 2) % dp) train the same rows
        dp = len(leaders)
        for k, r in enumerate(recs):
            assert r["digests"] == recs[leaders[(k // 2) % dp]]["digests"], (name, k)
        first = next(m for m in recs[0]["metrics"] if "async/staleness_max" in m)
        assert first["async/staleness_max"] == 0 and first["rollout/logp_gap_max"] < 1e-3, name
    # two replicas: their own prompts, their own rows
    assert runs[0]["dp2tp2"]["digests"][0] != runs[2]["dp2tp2"]["digests"][0]
