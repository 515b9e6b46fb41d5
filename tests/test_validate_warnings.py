"""`pfppo validate` warns (stderr, exit status unchanged) when PF-PPO is unlikely to pay: each rule of
pfppo_mega/config/advice.py fires on a config that breaks it and stays quiet on one that does not."""

import pytest
import yaml

from pfppo_mega import cli
from pfppo_mega.config import load_config_dict
from pfppo_mega.config.advice import MIN_GROUPS_PER_SNAPSHOT, MIN_STEPS, pf_ppo_advice

# A PF-PPO config that should pay: long budget, 64 prompt groups for a pool of 3 every 2 steps,
# checkpoints every 50 steps.
GOOD = {"actor_rollout": {"model_path": "sft"},
        "algorithm": {"use_pf_ppo": True, "pool": {"pool_size": 3, "snapshot_interval": 2}},
        "training": {"rollout_batch_size": 64, "batch_size": 64, "total_training_steps": 500},
        "checkpoint": {"save_interval": 50}}


def rules(*overrides: str) -> list[str]:
    return [a.rule for a in pf_ppo_advice(load_config_dict(GOOD, list(overrides)))]


def test_good_pf_ppo_config_has_no_warning():
    assert rules() == []


def test_no_warning_when_the_pool_is_off():
    bad = ["training.total_training_steps=10", "training.rollout_batch_size=2", "training.batch_size=2",
           "algorithm.pool.pool_size=8", "checkpoint.save_interval=1"]
    assert set(rules(*bad)) == {"budget", "diversity", "fill", "checkpoint"}
    assert rules(*bad, "algorithm.use_pf_ppo=false") == []


@pytest.mark.parametrize("steps,warned", [(MIN_STEPS - 1, True), (MIN_STEPS, False)])
def test_budget(steps, warned):
    assert ("budget" in rules(f"training.total_training_steps={steps}")) is warned


@pytest.mark.parametrize("groups,warned", [(MIN_GROUPS_PER_SNAPSHOT * 3 - 1, True), (MIN_GROUPS_PER_SNAPSHOT * 3, False)])
def test_diversity(groups, warned):
    got = rules(f"training.rollout_batch_size={groups}", f"training.batch_size={groups}")
    assert ("diversity" in got) is warned


@pytest.mark.parametrize("size,interval,warned", [(5, 101, True), (6, 100, True), (5, 100, False), (5, 40, False)])
def test_fill(size, interval, warned):
    """500 steps: 5 x 100 = 500 fills the pool exactly as the run ends (no warning); 505 or 600 do not."""
    got = rules(f"algorithm.pool.pool_size={size}", f"algorithm.pool.snapshot_interval={interval}",
                "checkpoint.save_interval=0", "training.rollout_batch_size=64")
    assert ("fill" in got) is warned, (size, interval, got)


@pytest.mark.parametrize("save,interval,warned", [(1, 2, True), (4, 10, True), (0, 10, False),
                                                  (10, 10, False), (50, 10, False)])
def test_checkpoint(save, interval, warned):
    got = rules(f"checkpoint.save_interval={save}", f"algorithm.pool.snapshot_interval={interval}")
    assert ("checkpoint" in got) is warned


def test_warnings_name_values_and_reason():
    advice = pf_ppo_advice(load_config_dict(GOOD, ["training.total_training_steps=40",
                                                   "checkpoint.save_interval=1"]))
    by = {a.rule: str(a) for a in advice}
    assert by["budget"].startswith("training.total_training_steps: 40 steps is under 200")
    assert "warming up" in by["budget"]
    assert "checkpoints every 1 steps, snapshots every 2" in by["checkpoint"]
    assert "pool_size 3 x snapshot_interval 2 = 6" not in by.get("fill", "")  # 6 <= 40: no fill warning


def test_validate_command_warns_on_stderr_and_keeps_exit_status(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(GOOD))
    assert cli.main(["validate", str(path), "training.total_training_steps=100"]) == 0
    out = capsys.readouterr()
    assert "pfppo validate: warning: PF-PPO unlikely to pay: training.total_training_steps: 100 steps" in out.err
    assert "use_pf_ppo: true" in out.out  # the resolved config still goes to stdout
    assert cli.main(["validate", str(path)]) == 0
    assert "warning" not in capsys.readouterr().err
    # an invalid config: exit 2 with the problem, no advice on top
    assert cli.main(["validate", str(path), "training.total_training_steps=100", "algorithm.gamma=2"]) == 2
    err = capsys.readouterr().err
    assert "algorithm.gamma" in err and "warning" not in err


def test_diversity_only_for_group_assignment():
    """With assign: step a step sees one snapshot by design: few groups per snapshot is no reason."""
    few = [f"training.rollout_batch_size={MIN_GROUPS_PER_SNAPSHOT}", f"training.batch_size={MIN_GROUPS_PER_SNAPSHOT}"]
    assert "diversity" in rules(*few)
    assert "diversity" not in rules(*few, "algorithm.pool.assign=step")


@pytest.mark.parametrize("engine,assign,size,warned", [("vllm", "group", 3, True), ("vllm", "step", 3, False),
                                                        ("builtin", "group", 3, False), ("vllm", "group", 1, False)])
def test_cost_of_group_assignment_on_vllm(engine, assign, size, warned):
    got = pf_ppo_advice(load_config_dict(GOOD, [f"actor_rollout.engine={engine}", f"algorithm.pool.assign={assign}",
                                                f"algorithm.pool.pool_size={size}"]))
    cost = [str(a) for a in got if a.rule == "cost"]
    assert bool(cost) is warned, (engine, assign, size, got)
    if warned:
        assert cost[0].startswith("algorithm.pool.assign: group:") and "up to 3 snapshots" in cost[0]
        assert "assign: step" in cost[0] and "docs/refit.md" in cost[0]
