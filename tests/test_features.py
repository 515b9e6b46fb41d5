"""The training features as config keys (parallel.sequence_parallel, parallel.use_distributed_optimizer,
parallel.virtual_pipeline_size, training.recompute, model.layer_spec, model.params_dtype): validation
with the key named, one value read by the planner, the Slurm script and the trainer's model builder,
and the refusal at start of what this machine cannot run. What runs on CPU (distributed optimizer,
bf16 with fp32 main weights) is checked over gloo in tests/multirank/feature_checks.py (the shared
2-process launch of tests/test_parallel.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pfppo_mega.config import ConfigError, load_config
from pfppo_mega.planning.cli import main as plan_main

REPO = Path(__file__).resolve().parents[1]
H200 = REPO / "configs" / "70b_pfppo.yaml"
H100 = REPO / "configs" / "70b_pfppo_h100.yaml"


def _problems(path: Path, *overrides: str) -> dict[str, str]:
    with pytest.raises(ConfigError) as e:
        load_config(path, list(overrides))
    return {p.key: p.rule for p in e.value.problems}


def test_bad_feature_values_are_refused_by_key():
    p = _problems(REPO / "configs" / "tiny_cpu.yaml", "parallel.tp=1", "parallel.sequence_parallel=true",
                  "training.recompute=some", "model.layer_spec=te")
    assert "tensor_model_parallel_size > 1" in p["parallel.sequence_parallel"]
    assert p["training.recompute"] == "must be one of 'none', 'selective', 'full'"
    assert p["model.layer_spec"] == "must be one of 'auto', 'local', 'transformer_engine'"
    p = _problems(REPO / "configs" / "tiny_cpu.yaml", "parallel.virtual_pipeline_size=2")
    assert "pipeline_model_parallel_size >= 2" in p["parallel.virtual_pipeline_size"]
    # 2 layers cannot make pp 2 x vpp 2 = 4 chunks; vpp 1 is not interleaving (null is)
    p = _problems(REPO / "configs" / "tiny_cpu.yaml", "parallel.pp=2", "parallel.tp=1",
                  "parallel.virtual_pipeline_size=2")
    assert "model.num_layers (2) must be divisible" in p["parallel.virtual_pipeline_size"]
    p = _problems(REPO / "configs" / "tiny_cpu.yaml", "parallel.pp=2", "parallel.tp=1",
                  "parallel.virtual_pipeline_size=1")
    assert p["parallel.virtual_pipeline_size"] == "must be >= 2 and <= 4096"


def test_70b_configs_hold_the_features_the_plan_assumes():
    for path, recompute in ((H200, "selective"), (H100, "full")):
        cfg = load_config(path, [])
        assert (cfg.training.recompute, cfg.parallel.sequence_parallel, cfg.parallel.use_distributed_optimizer,
                cfg.model.layer_spec, cfg.model.params_dtype) == (recompute, False, True, "local", "bfloat16"), path


@pytest.mark.parametrize("overrides", [[], ["training.recompute=full", "parallel.sequence_parallel=false",
                                            "parallel.use_distributed_optimizer=false"]], ids=["file", "overridden"])
def test_plan_script_and_trainer_read_one_value(overrides, tmp_path, capsys):
    """The planner's knobs, the model builder's Features and the Slurm script's arguments come
    from the same config + overrides: no flag of their own that could say otherwise."""
    from pfppo_mega.models import gpt

    report = tmp_path / "plan.json"
    assert plan_main([str(H200), *overrides, "--gpu", "h200", "--json", str(report)]) in (0, 2)
    knobs = json.loads(report.read_text())["knobs"]
    cfg = load_config(H200, overrides)
    feats = gpt.features_from_config(cfg)
    assert (knobs["recompute"], knobs["sequence_parallel"], knobs["distributed_optimizer"]) == \
        (feats.recompute, feats.sequence_parallel, feats.use_distributed_optimizer)
    assert knobs["layer"] == ("fused" if cfg.training.fused_layers or cfg.model.layer_spec == "transformer_engine" else "local")
    out = capsys.readouterr().out
    assert f"{feats.recompute} recompute, sequence parallel {'on' if feats.sequence_parallel else 'off'}" in out
    # The Slurm script passes the same config and overrides to both, and no feature flag of its own.
    script = (REPO / "scripts" / "slurm" / "70b_pfppo.sh").read_text()
    assert re.search(r'-m pfppo_mega\.planning "\$CONFIG" "\$\{OVERRIDES\[@\]\}"', script)
    assert re.search(r'-m pfppo_mega train "\$CONFIG" "\$\{OVERRIDES\[@\]\}"', script)
    for flag in ("--recompute", "--no-sequence-parallel", "--layer", "--no-distributed-optimizer"):
        assert flag not in script, flag


def test_former_planner_flags_are_refused_with_the_key_to_use(capsys):
    assert plan_main([str(H200), "--recompute", "full", "--no-distributed-optimizer"]) == 2
    err = capsys.readouterr().err
    assert "training.recompute=none|selective|full" in err and "parallel.use_distributed_optimizer=false" in err


def test_transformer_config_reads_the_features():
    """At tp 1 / pp 1 on the CPU: the defaults build; what the CPU cannot run is refused by key."""
    import dataclasses

    from pfppo_mega import parallel
    from pfppo_mega.models import gpt

    parallel.init_parallel(tp=1, pp=1, seed=1)
    cfg = load_config(REPO / "configs" / "tiny_cpu.yaml", ["parallel.tp=1"]).model
    tc = gpt.transformer_config(cfg, features=gpt.Features(use_distributed_optimizer=True))
    assert tc.sequence_parallel is False and tc.recompute_granularity is None
    bf16 = gpt.transformer_config(dataclasses.replace(cfg, params_dtype="bfloat16"))
    assert bf16.bf16 and str(bf16.params_dtype) == "torch.bfloat16"
    for feats, model, key in ((gpt.Features(sequence_parallel=True), cfg, "parallel.sequence_parallel"),
                              (gpt.Features(recompute="selective"), cfg, "training.recompute"),
                              (gpt.Features(virtual_pipeline_size=2), cfg, "parallel.virtual_pipeline_size"),
                              (gpt.Features(), dataclasses.replace(cfg, layer_spec="transformer_engine"),
                               "model.layer_spec")):
        with pytest.raises(gpt.FeatureError, match=re.escape(key)):
            gpt.transformer_config(model, features=feats)
    # The recompute settings megatron gets on a GPU (shape-checked here: megatron validates them).
    assert gpt._recompute_kwargs("full") == {"recompute_granularity": "full", "recompute_method": "uniform",
                                             "recompute_num_layers": 1}
    assert gpt._recompute_kwargs("selective") == {"recompute_granularity": "selective"}


def test_trainer_runs_bf16_with_fp32_main_weights(tmp_path):
    """model.params_dtype=bfloat16 through the PPO trainer on the CPU: bf16 actor and critic, fp32
    main weights in megatron's optimizer, finite losses, engine log-probs close to the trainer's."""
    import math
    import subprocess
    import sys

    import torch

    from pfppo_mega.trainer.loop import PPOTrainer

    sft = tmp_path / "sft"
    run = subprocess.run([sys.executable, "-m", "pfppo_mega", "sft", "configs/tiny_cpu.yaml", "parallel.tp=1",
                          f"sft.output_dir={sft}", "sft.steps=10"], capture_output=True, text=True, cwd=REPO,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    cfg = load_config(REPO / "configs" / "tiny_cpu.yaml", [
        "parallel.tp=1", f"actor_rollout.model_path={sft}", f"logging.output_dir={tmp_path / 'run'}",
        "model.params_dtype=bfloat16", "training.total_training_steps=2", "checkpoint.resume=false"])
    tr = PPOTrainer(cfg, log=lambda *_: None)
    recs = [tr.train_step() for _ in range(2)]
    for model, opt in ((tr.run.models.actor, tr.run.models.actor_opt), (tr.run.models.critic, tr.run.models.critic_opt)):
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
        inner = [o.optimizer for o in opt.chained_optimizers] if hasattr(opt, "chained_optimizers") else [opt.optimizer]
        assert {p.dtype for o in inner for g in o.param_groups for p in g["params"]} == {torch.float32}
    for m in recs:
        assert all(math.isfinite(m[k]) for k in ("policy/pg_loss", "critic/value_loss", "policy/grad_norm"))
        assert m["rollout/logp_gap_max"] < 0.05, m["rollout/logp_gap_max"]  # bf16 trainer vs engine
