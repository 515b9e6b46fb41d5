"""`pfppo compare` runs each setting x arm x seed in a process of its own: distinct PIDs, none of them
the command's, and a run that crashes is named in the report (exit code, the traceback's last line,
the file holding it) while the other arms still run and report."""

import json
import os
import signal

from pfppo_mega.config import load_config_dict
from pfppo_mega.experiments import compare
from pfppo_mega.sft import run_sft

from test_trainer import TINY


def test_each_arm_runs_in_its_own_process_and_a_crashing_arm_is_named(tmp_path):
    d = json.loads(json.dumps(TINY))
    d["sft"].update(output_dir=str(tmp_path / "sft"), steps=5)
    d["actor_rollout"] = {"model_path": str(tmp_path / "sft")}
    run_sft(load_config_dict(d), log=lambda *_: None)
    d["training"].update(total_training_steps=1, rollout_batch_size=16, batch_size=16)
    d["data"]["eval_size"] = 8
    d["logging"]["output_dir"] = str(tmp_path / "run")
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(json.dumps(d))  # JSON is YAML
    out = tmp_path / "cmp"
    rc = compare.main([str(cfg), "--seeds", "1", "--arms", "ppo,grpo,pf_short", "--out", str(out), "--kl-probe", "4",
                       "--early", "1", "--arm-set", f"pf_short:actor_rollout.model_path={tmp_path / 'missing'}"])
    assert rc == 1  # a run failed: the command says so after writing the report
    pids = [json.loads((out / arm / "seed1" / compare.CHILD_RESULT).read_text())["pid"] for arm in ("ppo", "grpo")]
    assert len(set(pids)) == 2 and os.getpid() not in pids
    for arm in ("ppo", "grpo"):  # the arms around the crash trained and are in the report
        recs = [json.loads(line) for line in open(out / arm / "seed1" / "metrics.jsonl")]
        assert sum("reward/mean" in r for r in recs) == 1
    report = (out / "report.md").read_text()
    assert "| ppo | 1 |" in report and "| grpo | 1 |" in report and "| pf_short | 1 |" not in report
    failed = [line for line in report.splitlines() if line.startswith("| tiny pf_short seed 1 |")]
    assert len(failed) == 1 and "| 1 |" in failed[0], report[-800:]
    err = out / "pf_short" / "seed1" / compare.CHILD_ERROR
    assert str(err) in failed[0] and "missing" in err.read_text()


def _killed(config_file, overrides, run_dir):
    os.kill(os.getpid(), signal.SIGKILL)


def _exits(config_file, overrides, run_dir):
    os._exit(3)


def test_a_run_that_dies_without_a_traceback_is_named_with_its_exit_code(tmp_path):
    killed = compare.run_in_child("c.yaml", [], tmp_path, label="s a seed 1", target=_killed)
    assert isinstance(killed, compare.RunFailure) and killed.exit_code == -signal.SIGKILL
    assert killed.line() == "s a seed 1: exit code -9: killed by signal 9, no traceback"
    exited = compare.run_in_child("c.yaml", [], tmp_path, label="s b seed 2", target=_exits)
    assert exited.exit_code == 3 and exited.error == "exited without a result or a traceback"
    assert compare.failure_section([killed])[-2] == "| s a seed 1 | -9 | killed by signal 9, no traceback | - |"
    assert compare.failure_section([]) == []
