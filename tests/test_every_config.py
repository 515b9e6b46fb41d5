"""Every shipped config (configs/*.yaml, configs/experiments/*.yaml) builds its models as the GPU
path would, on the CPU, before a GPU ever sees it.

For each config: load it (a combination refused by key at load is reported as such); shrink the
model's width (hidden = 8 per head, ffn = 2 x hidden, vocab 128, one layer per pipeline chunk) but
keep what megatron checks at construction: heads and query groups (their divisibility by TP), the
config's own TP and PP, and its real training features (layer spec, sequence parallelism,
distributed optimizer, recompute, params dtype). Then one rank of every pipeline stage is built at
the config's full layout (tp x pp x dp 2) with megatron's own groups on a fake process group and
meta-device models (``pfppo_mega.planning.dryrun``, checked as on a GPU): a megatron assertion at
construction (the local spec's WrappedTorchNorm under sequence parallelism, a recompute setting it
rejects) fails here, and the parameter shapes are compared with the planner's.

Then ONE torchrun launch of 4 gloo processes (tests/multirank/config_steps.py) builds every
config's actor and critic at the reduced width, with its layout clipped to 4 ranks (tp, pp at most
2) and its features as megatron runs them on CPU, and trains the actor one step (forward, backward,
finalize, optimizer step). What cannot run here at all is named per config with the reason, and
the tests assert that exactly the expected configs are refused, skipped or substituted.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pfppo_mega.config import ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs").glob("*.yaml")) + sorted((REPO / "configs" / "experiments").glob("*.yaml"))
# Configs that cannot be built here, and why (asserted: no more, no fewer).
SKIPPED = {"article_example.yaml": "no model section: the shape comes from actor_rollout.model_path's config.json"}
REFUSED_AT_LOAD: dict[str, str] = {}  # config name -> the key its load refuses
# What the gloo step replaces on CPU (config name -> feature): megatron's recompute needs CUDA.
_70B = ("70b_pfppo.yaml", "70b_pfppo_h100.yaml", "70b_llama33_pfppo.yaml", "70b_llama33_pfppo_h100.yaml")
SUBSTITUTED = {name: {"recompute"} for name in _70B + ("gpu_check_300m.yaml",)}
LAUNCH_TIMEOUT_S = 600  # the configs' steps and the TP2 x PP2 trainer's two


def _reduced(model):
    """The config's model at reduced width, keeping heads, query groups and their divisibility."""
    a = model.num_attention_heads
    h = 8 * a
    return dataclasses.replace(model, hidden_size=h, ffn_hidden_size=2 * h, vocab_size=128)


def build_every_stage(cfg, features=None) -> list[str]:
    """Build one rank of each pipeline stage of cfg at its layout with its features (meta device);
    returns the mismatches with the planner (an exception is megatron refusing the build)."""
    from pfppo_mega.models.gpt import features_from_config
    from pfppo_mega.planning.dryrun import dry_run_rank

    from pfppo_mega import parallel

    parallel.destroy_parallel()  # a trainer test before may have left its world; the dry run fakes its own
    tp, pp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
    chunks = pp * (cfg.parallel.virtual_pipeline_size or 1)
    model = dataclasses.replace(_reduced(cfg.model), num_layers=chunks)
    dp = 2
    out = []
    for stage in range(pp):
        res = dry_run_rank(model, tp=tp, pp=pp, world_size=tp * pp * dp, rank=stage * tp * dp,
                           features=features or features_from_config(cfg))
        out += [f"stage {stage}: {m}" for m in res.mismatches]
    return out


def test_the_harness_sees_every_shipped_config():
    names = {p.name for p in CONFIGS}
    assert {"70b_pfppo.yaml", "70b_pfppo_h100.yaml", "70b_llama33_pfppo.yaml", "70b_llama33_pfppo_h100.yaml",
            "tiny_cpu.yaml", "gpu_check_1b.yaml", "scaled.yaml"} <= names, names
    assert set(SKIPPED) | set(REFUSED_AT_LOAD) <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.relative_to(REPO / "configs").as_posix())
def test_config_builds_as_on_a_gpu(path, capsys):
    try:
        cfg = load_config(path, [])
    except ConfigError as e:
        keys = sorted({p.key for p in e.problems})
        print(f"{path.name}: refused at load: {e}")
        assert REFUSED_AT_LOAD.get(path.name) in keys, f"{path.name} refused at load, unexpectedly: {e}"
        return
    assert path.name not in REFUSED_AT_LOAD, f"{path.name} was expected to be refused at load"
    if not cfg.model.is_complete():
        print(f"{path.name}: skipped: {SKIPPED.get(path.name, 'incomplete model section')}")
        assert path.name in SKIPPED, f"{path.name} has no model shape and is not among the expected skips"
        return
    assert path.name not in SKIPPED, f"{path.name} was expected to be skipped"
    mismatches = build_every_stage(cfg)
    assert not mismatches, "\n".join(mismatches)


def test_sequence_parallel_with_the_local_spec_is_refused_at_load_and_at_build():
    """The combination every 70B config held before: refused by key at load, and by check_features
    (on any device) if a caller builds the models without loading a config."""
    from pfppo_mega.models import gpt

    cfg = REPO / "configs" / "70b_pfppo.yaml"
    with pytest.raises(ConfigError) as e:
        load_config(cfg, ["parallel.sequence_parallel=true"])
    assert {p.key for p in e.value.problems} == {"parallel.sequence_parallel"}
    assert "WrappedTorchNorm" in str(e.value)
    model = load_config(cfg, []).model
    for device in ("cpu", "cuda"):
        with pytest.raises(gpt.FeatureError, match=r"parallel\.sequence_parallel.*'local'"):
            gpt.check_features(model, gpt.Features(sequence_parallel=True), device_type=device, tp=8)
    # with the transformer_engine spec, sequence parallelism is not what is refused: the spec is
    # (TE is not importable on this machine; on a GPU with TE, hf_io's names are not converted yet)
    te = dataclasses.replace(model, layer_spec="transformer_engine")
    with pytest.raises(gpt.FeatureError) as e:
        gpt.check_features(te, gpt.Features(sequence_parallel=True), device_type="cuda", tp=8)
    assert "model.layer_spec" in str(e.value) and "parallel.sequence_parallel" not in str(e.value)
    loaded = load_config(cfg, ["parallel.sequence_parallel=true", "model.layer_spec=transformer_engine"])
    assert loaded.parallel.sequence_parallel and loaded.model.layer_spec == "transformer_engine"


def test_the_build_catches_what_megatron_asserts(monkeypatch):
    """Without check_features' refusal, megatron's own assertion stops the build: the harness sees
    it (the state of every 70B config before they were fixed: sequence parallel with the local spec)."""
    from pfppo_mega.models import gpt

    cfg = load_config(REPO / "configs" / "70b_pfppo.yaml", [])
    sp = dataclasses.replace(gpt.features_from_config(cfg), sequence_parallel=True)
    with pytest.raises(gpt.FeatureError, match=r"parallel\.sequence_parallel"):
        build_every_stage(cfg, sp)
    monkeypatch.setattr(gpt, "check_features", lambda *a, **k: None)
    # the local spec's norm (ours, Placed- or FusedRMSNorm, made on the device as megatron's WrappedTorchNorm is not)
    # refuses it as WrappedTorchNorm's assertion did
    with pytest.raises(ValueError, match="(Placed|Fused)RMSNorm: needs normalization RMSNorm without sequence parallelism"):
        build_every_stage(cfg, sp)


def _trainer_config(root: Path) -> Path:
    """tests/test_trainer_parallel.py's tiny config with its SFT checkpoint, for the TP2 x PP2 trainer
    run that shares this launch (4 ranks are slow to start on 2 cores)."""
    import json

    from pfppo_mega.config import load_config_dict
    from pfppo_mega.sft import run_sft
    from test_trainer_parallel import CFG

    cfg = json.loads(json.dumps(CFG))
    cfg["sft"]["output_dir"] = str(root / "sft")
    cfg["actor_rollout"] = {"model_path": str(root / "sft")}
    cfg["logging"]["output_dir"] = str(root / "runs")
    run_sft(load_config_dict(cfg), log=lambda *_: None)
    path = root / "trainer.json"
    path.write_text(json.dumps(cfg))
    return path


def test_every_config_trains_one_step_on_gloo(tmp_path):
    """One launch of 4 ranks: every config's actor trains a step and its critic runs a forward; then
    the whole trainer at TP2 x PP2 generates every row once (generated / needed 1.00 over the job,
    the rollout split across the 4 engines) with PF-PPO's assignment drawn by rank 0."""
    import json

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
           str(REPO / "tests" / "multirank" / "config_steps.py"), *map(str, CONFIGS),
           f"--trainer={_trainer_config(tmp_path)}"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"torchrun ran past {LAUNCH_TIMEOUT_S} s:\n{out[-3000:]}\n{err[-3000:]}")
    assert proc.returncode == 0, out[-3000:] + err[-6000:]
    results, skipped, substituted = {}, {}, {}
    for line in out.splitlines():
        if m := re.match(r"^RESULT (\S+) step (PASS|FAIL) (.*)$", line):
            results[m.group(1)] = (m.group(2) == "PASS", line)
        elif m := re.match(r"^SKIP (\S+) (.*)$", line):
            skipped[m.group(1)] = m.group(2)
        elif m := re.match(r"^SUBST (\S+) (\S+) ", line):
            substituted.setdefault(m.group(1), set()).add(m.group(2))
        if line.startswith(("RESULT", "SKIP", "SUBST")):
            print(line)
    assert set(skipped) == set(SKIPPED) | set(REFUSED_AT_LOAD), skipped
    assert substituted == SUBSTITUTED, substituted
    assert set(results) == {p.name for p in CONFIGS} - set(skipped)
    failed = [line for ok, line in results.values() if not ok]
    assert not failed, "\n".join(failed) + "\n" + err[-6000:]
    trainer = [json.loads(line.split(" ", 2)[2]) for line in out.splitlines() if line.startswith("TRAINER tp2pp2 ")]
    assert trainer, "the TP2 x PP2 trainer run printed no result\n" + err[-6000:]
    r = trainer[0]
    assert (r["tp"], r["pp"], r["dp"], r["rollout_tp"]) == (2, 2, 1, 1), r
    assert r["generated_over_needed"] == [1.0, 1.0], r["generated_over_needed"]
    assert r["assignment_from_rank0"], r["ranks"]
    shares = [e["generated"] for e in r["ranks"]]
    assert all(all(g > 0 for g in x) for x in shares), shares  # each of the 4 engines generated a share
    for rank, c in enumerate(r["split"]):  # the exchanged rows = one engine generating the batch alone
        assert c["tokens_equal"] and c["logp_max_gap"] == 0.0 and 0 < c["generated"] < c["needed"], (rank, c)
    print(f"trainer tp2 x pp2, rollout TP 1 (4 engines): generated/needed {r['generated_over_needed']}; "
          f"tokens per rank per step {shares}; split check per rank (generated, needed) "
          f"{[(c['generated'], c['needed']) for c in r['split']]}, rows equal to one engine's")


def test_bf16_on_a_gpu_without_bf16_is_refused_by_key(monkeypatch):
    """A dtype the hardware cannot provide: refused at start by key (the GPU lookups faked)."""
    from pfppo_mega.models import gpt

    model = load_config(REPO / "configs" / "70b_pfppo.yaml", []).model
    monkeypatch.setattr(gpt.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpt.torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(gpt.torch.cuda, "get_device_name", lambda *a: "Tesla V100-SXM2-32GB")
    with pytest.raises(gpt.FeatureError, match=r"model\.params_dtype = 'bfloat16': this GPU \(Tesla V100"):
        gpt.check_features(model, gpt.Features(), device_type="cuda", tp=8)
    gpt.check_features(dataclasses.replace(model, params_dtype="float32"), gpt.Features(), device_type="cuda", tp=8)
    monkeypatch.setattr(gpt.torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    gpt.check_features(model, gpt.Features(), device_type="cuda", tp=8)
