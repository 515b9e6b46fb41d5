"""The asynchronous mode's multi-rank tests' launch (tests/test_async_dp.py, tests/test_async_tp.py):
a 40-step SFT start of configs/async_tiny.yaml, then one torchrun launch of 2 (or 4) gloo ranks running a
script of this folder, whose rank 0 prints one `RESULT <json>` line with every rank's record."""

import json
import os
import subprocess
import sys
from pathlib import Path

from pfppo_mega.config import load_config
from pfppo_mega.sft import run_sft

HERE = Path(__file__).resolve().parent
CONFIG = HERE.parent.parent / "configs" / "async_tiny.yaml"


def sft_and_launch(script: str, tmp_path: Path, nproc: int = 2) -> tuple[Path, Path, list]:
    """(the SFT checkpoint, the runs' output folder, every rank's record in rank order)."""
    sft = tmp_path / "sft"
    run_sft(load_config(CONFIG, [f"sft.output_dir={sft}", f"actor_rollout.model_path={sft}", "sft.steps=40"]),
            log=lambda *_: None)
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent.parent)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                           str(HERE / script), str(CONFIG), str(out), str(sft)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return sft, out, json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
