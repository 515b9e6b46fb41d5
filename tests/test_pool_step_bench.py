"""`pfppo bench pool-step` end to end at toy size (builtin engine): its JSON holds every arm's
counted steps, the ratio to plain PPO, and one snapshot per step for assign=step."""
import json
import subprocess
import sys

import pytest


def test_pool_step_bench_writes_every_arm(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "pfppo_mega.cli", "bench", "pool-step", "--config", "configs/tiny_cpu.yaml",
           "--engine", "builtin", "--arms", "ppo,pf_step", "--steps", "3", "--warmup", "1", "--rounds", "1",
           "--sft-steps", "30", "--work", str(tmp_path / "work"), "--json", str(out),
           "parallel.tensor_model_parallel_size=1", "sft.warmup_steps=0", "training.rollout_batch_size=16",
           "training.batch_size=8"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    arms = {a["arm"]: a for a in res["arms"]}
    assert list(arms) == ["ppo", "pf_step"]
    assert len(arms["ppo"]["step_s"]) == 2 and len(arms["pf_step"]["step_s"]) == 2  # 3 steps - 1 warmup
    assert arms["ppo"]["ratio_to_ppo"] == 1.0 and arms["pf_step"]["median_s"] > 0
    assert arms["pf_step"]["snapshots_used"] == 1.0 and arms["ppo"]["snapshots_used"] is None
    assert "algorithm.pool.assign=step" in arms["pf_step"]["overrides"]


@pytest.mark.parametrize("args, msg", [(["--arms", "pf_step"], "need ppo"),
                                       (["--steps", "2", "--warmup", "2"], "must exceed --warmup")])
def test_pool_step_bench_refuses_bad_arguments(args, msg):
    r = subprocess.run([sys.executable, "-m", "pfppo_mega.cli", "bench", "pool-step", *args],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and msg in r.stderr, r.stderr


def test_warm_start_is_reused_only_when_it_has_the_asked_steps(tmp_path):
    """A warm start left in --work by a run with another --sft-steps is made again, not reused
    (the default changed from 80 to 800 steps; an old work folder must not keep the short one)."""
    import os

    from pfppo_mega.bench.pool_step import _warm_start

    over = ["sft.warmup_steps=0", "parallel.tensor_model_parallel_size=1"]
    info = tmp_path / "sft" / "sft_info.json"
    _warm_start("configs/tiny_cpu.yaml", tmp_path, 3, over)
    assert json.loads(info.read_text())["steps"] == 3
    _warm_start("configs/tiny_cpu.yaml", tmp_path, 4, over)
    assert json.loads(info.read_text())["steps"] == 4
    before = os.stat(info).st_mtime_ns
    _warm_start("configs/tiny_cpu.yaml", tmp_path, 4, over)
    assert os.stat(info).st_mtime_ns == before  # same steps: reused
