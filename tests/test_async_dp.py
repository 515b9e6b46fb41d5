"""The asynchronous mode at DP2 (one torchrun launch, 2 trainer processes on gloo, each with its own
generator process): docs/async.md, "Data, tensor and pipeline parallel"."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "multirank"))
from async_launch import sft_and_launch  # noqa: E402  (tests/multirank/async_launch.py)


def test_async_dp2_one_generator_per_rank_trains_checkpoints_and_resumes(tmp_path):
    _, out, (r0, r1) = sft_and_launch("async_dp2.py", tmp_path)
    assert r0["dp"] == 2 and r0["steps"] == r1["steps"] == [3, 4] and r0["resumed_at"] == r1["resumed_at"] == 3
    # one generator process per rank, none left behind
    assert r0["pids"] and r1["pids"] and not set(r0["pids"]) & set(r1["pids"])
    assert r0["pid_after_fit"] is None and r1["pid_after_fit"] is None
    assert r0["pids_alive_after"] == [] and r1["pids_alive_after"] == []
    # the weights: rank 0 writes each version's file once, both generators are told its path, and it
    # holds exactly each rank's own replica (versions 0..3 in the first run, 3..4 after the resume)
    assert [f[:2] for f in r0["files"]] == [f[:2] for f in r1["files"]]
    assert [f[0] for f in r0["files"]] == [0, 1, 2, 3, 3, 4]
    assert all(f[2] for f in r0["files"] + r1["files"])
    # each rank its share of the prompts, its rows seeded apart (row_offset)
    assert r0["prompts"] != r1["prompts"] and r0["row_offsets"] != r1["row_offsets"]
    # a checkpoint with requests in flight: each rank's own record, asked again on resume
    pend = out / "async_pending"
    assert (pend / "step_00000003.json").is_file() and (pend / "step_00000003.rank1.json").is_file()
    assert r0["restored_requests"] > 0 and r1["restored_requests"] > 0
    recs = [m for m in r0["metrics"] if "async/staleness_max" in m]
    assert [m["step"] for m in recs] == [1, 2, 3, 4]
    assert all(m["async/staleness_max"] <= 2 for m in recs)
    first = recs[0]  # version 0's rows on both ranks: engine and trainer log-probs agree (the same weights)
    assert first["async/staleness_max"] == 0 and first["rollout/logp_gap_max"] < 1e-3
