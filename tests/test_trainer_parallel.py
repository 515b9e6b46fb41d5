"""The whole PPO trainer under TP2, PP2 and DP2 (one torchrun launch, 2 processes on gloo) against
the same run in one process: same rollouts, same losses, same weights -> same metrics."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pfppo_mega.config import load_config_dict
from pfppo_mega.sft import run_sft
from pfppo_mega.trainer.checkpoint import resume
from pfppo_mega.trainer.loop import PPOTrainer

sys.path.insert(0, str(Path(__file__).resolve().parent / "multirank"))
import trainer_layouts  # noqa: E402  (the 2-process script's runs, here in one process)

HERE = Path(__file__).resolve().parent
KEYS = ("policy/pg_loss", "critic/value_loss", "reward/mean", "kl/ref_k1", "policy/grad_norm")
# Relative bound of a metric across layouts: 1e-5, but the gradient norm's 5e-5. It sums the squares
# of every gradient element, and a TP/PP split sums each element's products in another fp32 order;
# measured (this test, 2-process launch, 1 torch thread per process: training.num_threads and the
# launch's OMP_NUM_THREADS=1 / torch.set_num_threads(1)): TP2 vs serial 1.82e-5
# (6.579696602580252 vs 6.579577115759321), PP2 with the engine's log-probs 2.16e-5
# (6.579644593620184 vs 6.579786434916034), the same digits in two launches: a fixed reduction-order
# difference, not nondeterminism (the other metrics stay within 1e-5).
REL = {"policy/grad_norm": 5e-5}


def rel(k: str) -> float:
    return REL.get(k, 1e-5)
CFG = {
    # 2 heads / 2 query groups / 2 layers: splittable by tp = 2 and pp = 2.
    "model": {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 192, "num_attention_heads": 2,
              "num_query_groups": 2, "vocab_size": 16, "max_position_embeddings": 24,
              "rope_theta": 10000.0, "norm_epsilon": 1e-5, "tie_word_embeddings": False},
    "data": {"num_digits": 1, "eval_size": 16, "max_prompt_length": 8},
    "training": {"rollout_batch_size": 32, "batch_size": 16, "lr": 3e-4, "critic_lr": 1e-3,
                 "total_training_steps": 3, "seed": 5, "num_threads": 1},
    "algorithm": {"kl_coeff": 0.01, "kl_estimator": "k1", "vf_coef": 0.5, "max_response_length": 4},
    # moments and quantiles over the global batch (checked at dp2)
    "reward": {"scaling": "running_zscore", "quantile_clip": 0.9},
    "logging": {"eval_interval": 0, "tensorboard": False, "plots": False, "progress": False},
    "checkpoint": {"export_hf": False, "resume": False},
    "sft": {"steps": 80, "batch_size": 32, "lr": 3e-3, "max_seconds": 0},  # stops on steps only
}


RUNS: dict = {}  # the config the 2-process runs used (their output folders are under its output_dir)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer_parallel")
    cfg = json.loads(json.dumps(CFG))
    cfg["sft"]["output_dir"] = str(root / "sft")
    cfg["actor_rollout"] = {"model_path": str(root / "sft")}
    cfg["logging"]["output_dir"] = str(root / "runs")
    run_sft(load_config_dict(cfg), log=lambda *_: None)
    path = root / "cfg.json"
    path.write_text(json.dumps(cfg))
    # The serial reference's first 2 steps and their checkpoint (the 2-process run resumes it at a
    # larger layout), then the 2-process run is launched; the serial step 3 runs here meanwhile.
    # every layout runs in the device-check mode (pfppo_mega.trainer.instruments.devicecheck; the serial run does not)
    serial_cfg = json.loads(json.dumps(cfg))
    serial_cfg["logging"]["output_dir"] = str(root / "serial")
    tr = PPOTrainer(load_config_dict(serial_cfg), log=lambda *_: None)
    responses: list = []
    requests = trainer_layouts.record_requests(tr, responses)  # every step's (prompts, seed) and responses
    serial = [{k: m[k] for k in KEYS} for m in (tr.train_step() for _ in range(2))]
    resume.save(tr.run, tr.run.out_dir / "checkpoints", background=False)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent), "PFPPO_DEVICE_CHECK": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             str(HERE / "multirank" / "trainer_layouts.py"), str(path),
                             str(tr.run.out_dir / "checkpoints")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    serial.append({k: v for k, v in tr.train_step().items() if k in KEYS})
    tr.train_step()  # step 4: the requests a DP2 checkpoint of step 3 resumed at DP1 must make
    RUNS.update(serial_requests=requests[2:3], serial_responses=responses[2:3], serial_all=requests)
    RUNS["serial_engine_logp"] = trainer_layouts.engine_logp_run(serial_cfg, "serial_engine_logp")
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-4000:]
    results = {line.split()[1]: json.loads(line.split(" ", 2)[2]) for line in out.splitlines()
               if line.startswith("RESULT ")}
    RUNS["cfg"] = cfg
    return serial, results


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_model_parallel_trainer_equals_serial(setup, layout):
    serial, results = setup
    worst = 0.0
    for s, p in zip(serial, results[layout]["steps"]):
        for k in KEYS:
            gap = abs(s[k] - p[k])
            worst = max(worst, gap / max(1.0, abs(s[k])))
            assert gap <= rel(k) * max(1.0, abs(s[k])), (layout, k, s[k], p[k])
    print(f"{layout}: max relative metric gap over 3 PPO steps {worst:.2e}")


def test_engine_logp_proximal_at_pp2_equals_serial(setup):
    """recompute_old_logp false at pp2: the update's first-epoch entropy and log-probs are gathered
    on the last stage and broadcast, so the logging rank (stage 0) reports the serial run's."""
    _, results = setup
    for s, p in zip(RUNS["serial_engine_logp"], results["pp2_engine_logp"]["steps"]):
        assert s["policy/entropy_first10"] > 0 and 0 < s["rollout/logp_gap_max"] < 1e-3, s
        for k, v in s.items():
            assert p[k] == pytest.approx(v, rel=rel(k), abs=1e-6), (k, v, p[k])


@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2"])
def test_every_row_is_generated_once_and_the_split_equals_one_engine(setup, layout):
    """Rollout split across every engine (trainer/colocation/rollout_split.py): generated tokens / needed tokens
    is 1.00 over the job at every step (a replica's TP ranks and stages no longer each regenerate its
    rows), each rank's engine generated a share, and the exchanged rows equal this rank's engine
    generating the replica's batch alone, to the bit."""
    _, results = setup
    r = results[layout]
    assert r["generated_over_needed"] == [1.0, 1.0, 1.0], r["generated_over_needed"]
    for rank, c in enumerate(r["split"]):
        assert c["tokens_equal"] and c["logp_max_gap"] == 0.0, (layout, rank, c)
        assert 0 < c["generated"] < c["needed"] if r["dp"] == 1 else c["generated"] == c["needed"], (layout, rank, c)
    print(f"{layout}: generated/needed {r['generated_over_needed']}; per rank generated/needed "
          f"{[(c['generated'], c['needed']) for c in r['split']]}")


def test_rollout_tp2_generates_every_row_once_with_one_vllm_engine(setup):
    """Rollout TP 2 with the real vLLM (one engine over both ranks, external launcher) under DP2: the
    engine generates both replicas' rows once (generated / needed 1.00; its two ranks return the
    same rows, counted once), PF-PPO's snapshot assignment is rank 0's draw on every rank, and the
    engine's ranks received the refits and switches."""
    from pfppo_mega.rollout.vllm import unavailable_reason

    _, results = setup
    if "vllm_rtp2" not in results:
        assert unavailable_reason(), "the vLLM rollout-TP-2 run printed no result"
        pytest.skip(unavailable_reason())
    r = results["vllm_rtp2"]
    assert (r["engine"], r["rollout_tp"], r["dp"]) == ("VLLMEngine", 2, 2), r
    assert r["generated_over_needed"] == [1.0, 1.0], r["generated_over_needed"]
    assert r["assignment_from_rank0"], r["ranks"]
    a, b = r["ranks"]
    assert a["generated"] == b["generated"] and all(g > 0 for g in a["generated"])  # one engine, both ranks
    assert all(x > 0 for x in a["refit_bytes"]) or all(x > 0 for x in a["switch_bytes"])
    print(f"rollout TP 2 (vLLM), trainer DP 2: generated/needed {r['generated_over_needed']}; per rank tokens "
          f"{a['generated']} / {b['generated']}; refit bytes {a['refit_bytes']}, switch bytes {a['switch_bytes']}, "
          f"host bytes {a['host_bytes']}")


def test_data_parallel_batch_statistics_do_not_depend_on_dp_size(setup):
    """DP2 vs DP1 on the same global batch: the reward z-scores (running moments) and quantile clip,
    the whitened advantages and the moments themselves agree; per-rank statistics would not."""
    _, results = setup
    assert results["dp2"]["dp"] == 2 and len(results["dp2"]["steps"]) == 3
    # the logged reward std / q90 are those of both ranks' rewards together, not a mean of the ranks'
    assert results["dp2"]["reward_stat_gap"] <= 1e-6
    inv = results["dp2_invariance"]
    print(f"dp2 vs dp1: scores {inv['scores_diff']:.2e}, advantages {inv['adv_diff']:.2e} "
          f"(per-rank whitening would be off by {inv['adv_local_diff']:.2e})")
    assert inv["scaling"] == "running_zscore" and inv["rows"] == 32
    assert inv["scores_diff"] <= 1e-5 and inv["adv_diff"] <= 1e-5
    assert inv["adv_local_diff"] > 1e-3  # the check can tell global from per-rank statistics
    # every rank merged the global batch: 3 steps of 32 rows before the probe, then the probe's 32
    assert inv["seen_rows"] == [96, 96] and inv["running_count"] == [32.0, 32.0] and inv["serial_count"] == 32
    assert inv["running_mean_diff"] <= 1e-9


def test_resume_from_sharded_checkpoints(setup):
    _, results = setup
    assert results["tp2_resumed"]["step"] == 4 and results["pp2_resumed"]["step"] == 4


def test_distributed_optimizer_shards_survive_a_dp2_checkpoint(setup):
    """parallel.use_distributed_optimizer at DP2: each rank writes its own optimizer share (no
    gather) and the resume at DP2 installs exactly its own again."""
    _, results = setup
    r = results["dp2_distopt"]
    assert r["dp"] == 2 and r["resumed_step"] == 2 and r["next_loss_finite"]
    a, b = r["ranks"]
    assert a["diff"] == 0.0 and b["diff"] == 0.0, r
    # each rank holds a shard of its own (not the whole state, not the other rank's)
    assert a["n"] > 0 and b["n"] > 0 and a["sum"] != b["sum"], r
    assert a["numel"] + b["numel"] == a["model_numel"], r  # the shards partition the parameters


def test_pf_ppo_pool_shards_survive_a_dp2_checkpoint(setup):
    """PF-PPO at DP2: each rank keeps half of every snapshot; each (a keeper of the first node) saves its half, and the resumed
    trainer holds exactly its own half again (versions and producer checksums), then trains on."""
    _, results = setup
    r = results["dp2_pf_resume"]
    assert r["dp"] == 2 and r["step"] == 3 and r["next_loss_finite"], r
    a, b = r["ranks"]
    assert a["same"] and b["same"], r
    assert a["versions"] == b["versions"] and len(a["versions"]) == 2, r
    assert a["kept"] and b["kept"] and not set(a["kept"]) & set(b["kept"]), r  # two disjoint halves


def test_every_layout_passes_the_device_check(setup):
    """TP2, PP2, DP2 and the DP2 distributed-optimizer run took every train_step inside a device-check
    session: loss inputs, phase boundaries and every collective (p2p and TP all-reduces included)
    on the expected device, nothing made on the host meeting a model. The metrics above equal the
    serial run's, which ran without the mode."""
    _, results = setup
    r = results["device_check"]
    assert r["requested"] and r["sessions"] >= 3 * 3 + 3 + 1
    assert r["checks"] >= 4 * r["sessions"] and r["collectives"] > 0
    print(f"device check over the 2-rank layouts: {r}")


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_a_plain_optimizer_checkpoint_resumes_resharded_at_tp1_pp1(setup, layout):
    """The TP2 / PP2 runs' checkpoints (a plain fp32 optimizer, its state by parameter index and
    name) resumed by one process: weights and Adam moments resharded by name; step 4 equals the
    2-rank resumed run's step 4 within 1e-5 (the gradient norm: REL), and metrics.jsonl is left as it was (a resume at
    another layout used to restart from step 0 and overwrite it)."""
    _, results = setup
    out = Path(RUNS["cfg"]["logging"]["output_dir"]) / layout
    assert any((out / "checkpoints").glob("step_*/tp0-pp0-dp0"))
    metrics = out / "metrics.jsonl"
    before = metrics.read_bytes() if metrics.exists() else None
    tr, msgs = _resume_here(layout)
    assert tr.step == 3 and any("resharded to tp=1 pp=1 dp=1" in m for m in msgs), msgs
    assert (metrics.read_bytes() if metrics.exists() else None) == before
    requests = trainer_layouts.record_requests(tr)
    m = tr.train_step()
    want = results[f"{layout}_resumed"]
    assert requests == want["requests"] and len(requests) == 1  # the same prompts and seed, to the bit
    for k in KEYS:
        assert abs(m[k] - want["metrics"][k]) <= rel(k) * max(1.0, abs(want["metrics"][k])), (layout, k, m[k], want)


def test_a_bf16_plain_optimizer_at_another_layout_is_refused_by_name(setup):
    """bf16 parameters with a plain optimizer keep fp32 main copies by index: refused by name, both
    layouts named (the tp2 checkpoint resumed with model.params_dtype=bfloat16)."""
    from pfppo_mega.trainer.checkpoint.store import CheckpointError

    with pytest.raises(CheckpointError, match=r"written at tp=2 pp=1, this run has tp=1 pp=1: a plain optimizer's "
                                              r"state \(actor_opt, critic_opt\) over bfloat16 parameters"):
        _resume_here("tp2", {"model": {"params_dtype": "bfloat16"}})


def _resume_here(name: str, sections: dict | None = None, **parallel_cfg):
    cfg = json.loads(json.dumps(RUNS["cfg"]))
    for sec, vals in (sections or {}).items():
        cfg.setdefault(sec, {}).update(vals)
    cfg["logging"]["output_dir"] = str(Path(cfg["logging"]["output_dir"]) / name)
    cfg["checkpoint"] = {"resume": True, "export_hf": False}
    cfg["parallel"] = parallel_cfg
    msgs: list[str] = []
    return PPOTrainer(load_config_dict(cfg), log=msgs.append), msgs


@pytest.mark.parametrize("layout", ["tp2_distopt", "pp2_distopt"])
def test_a_distributed_optimizer_checkpoint_resumes_resharded_at_tp1_pp1(setup, layout):
    """A TP2 / PP2 checkpoint with the distributed optimizer, resumed by one process: weights and
    Adam moments resharded (models/reshard.py); its step 3 equals the 2-rank run's uninterrupted
    step 3 as closely as TP2 equals serial (1e-5; the gradient norm: REL)."""
    _, results = setup
    tr, msgs = _resume_here(layout, use_distributed_optimizer=True)
    assert tr.step == 2 and any("resharded to tp=1 pp=1 dp=1" in m for m in msgs), msgs
    m = tr.train_step()
    want = results[layout]["metrics"]
    worst = max(abs(m[k] - want[k]) / max(1.0, abs(want[k])) for k in KEYS)
    print(f"{layout} -> tp1 pp1: step-3 relative metric gap {worst:.2e}; per rank {results[layout]['bytes']} "
          f"bytes, blocked {results[layout]['blocked_s']:.3f} s")
    for k in KEYS:
        assert abs(m[k] - want[k]) <= rel(k) * max(1.0, abs(want[k])), (layout, k, m[k], want[k])


def test_a_dp2_distributed_optimizer_checkpoint_resumes_at_dp1_exactly(setup):
    """The DP2 distributed-optimizer checkpoint (bf16 params) resumed by one process: every element
    of the fp32 main params and moments equals the saved shares to the bit (re-sliced by parameter
    name and element range; this used to die in megatron's scatter), and the run trains on."""
    import math

    from safetensors.torch import load_file

    from pfppo_mega.trainer.checkpoint import store as ckpt
    from pfppo_mega.trainer.checkpoint import resume

    tr, msgs = _resume_here("dp2_distopt", use_distributed_optimizer=True)
    assert tr.step == 2 and any("resharded to tp=1 pp=1 dp=1" in m for m in msgs), msgs
    step = Path(RUNS["cfg"]["logging"]["output_dir"]) / "dp2_distopt" / "checkpoints" / "step_000002"
    saved: dict[str, dict] = {}  # name/key -> {start: slice}
    split = 0
    for part in ("tp0-pp0-dp0", "tp0-pp0-dp1"):
        state = resume.load_part(step.parent, part, step=2).state
        flat = load_file(str(step / part / "optim.safetensors"))
        for opt in ("actor_opt", "critic_opt"):
            for name, shape, a, b in state[opt]["distributed_optimizer"][0]["slices"]:
                split += (b - a) < math.prod(shape)
                for k in ("param", "exp_avg", "exp_avg_sq"):
                    saved.setdefault(f"{opt}/{name}/{k}", {})[a] = flat[f"{opt}/{name}/{k}"]
    assert split > 0  # some parameter was shared by both ranks: the re-slice joined two ranges
    compared = 0
    for opt_name, model in (("actor_opt", tr.run.models.actor), ("critic_opt", tr.run.models.critic)):
        o = getattr(tr.run.models, opt_name)
        o = (getattr(o, "chained_optimizers", None) or [o])[0]
        names = resume.param_names(tr.run, model)
        for p, a, b in ckpt._owned(o):
            for k, v in ckpt._main_and_state(o, p).items():
                parts = saved[f"{opt_name}/{names[p]}/{k}"]
                whole = torch.cat([parts[s] for s in sorted(parts)])
                assert (a, b) == (0, whole.numel()) and torch.equal(v.detach(), whole), (names[p], k)
                compared += 1
    assert compared > 0
    assert math.isfinite(tr.train_step()["policy/pg_loss"])


def test_a_dp2_pf_ppo_checkpoint_resumes_at_dp1_with_the_whole_pool(setup):
    """The DP2 PF-PPO checkpoint (each rank kept half of every snapshot) resumed by one process:
    its single rank keeps every bucket now, re-dealt from both ranks' parts -- the same versions and
    producer checksums as the two halves together -- and switches to them in the next step."""
    import math

    _, results = setup
    r = results["dp2_pf_resume"]
    pf = {"algorithm": {"use_pf_ppo": True, "pool": {"pool_size": 2, "snapshot_interval": 1, "sampling": "uniform"}},
          "actor_rollout": {"refit_bucket_mb": 0.01}}
    tr, msgs = _resume_here("dp2_pf", pf)
    assert tr.step == 2 and any("resharded to tp=1 pp=1 dp=1" in m for m in msgs), msgs
    pool = tr.run.strategies.behaviour.pool
    a, b = r["ranks"]
    assert pool.versions == a["versions"]
    assert sorted(i for c in pool._producer_checksums.values() for i in c) == sorted(a["kept"] + b["kept"])
    assert math.isfinite(tr.train_step()["policy/pg_loss"])


def _ok(results: dict, name: str) -> dict:
    r = results[name]
    assert "error" not in r, f"{name}: {r['error']}\n{r.get('trace', '')}"
    return r


def _close(m: dict, want: dict, what: str) -> float:
    worst = 0.0
    for k in KEYS:
        gap = abs(m[k] - want[k])
        worst = max(worst, gap / max(1.0, abs(want[k])))
        assert gap <= rel(k) * max(1.0, abs(want[k])), (what, k, m[k], want[k])
    return worst


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_a_one_process_checkpoint_resumes_at_a_larger_tp_or_pp_with_the_same_data_and_seeds(setup, layout):
    """Upward (issue 40): the serial run's step-2 checkpoint resumed by 2 processes at TP2 / PP2. Both
    ranks of the one replica take its saved prompt stream (the second rank has no part of its own in
    the checkpoint: it used to draw a fresh stream, and the split refused the replica's disagreeing
    ranks at the first step). Step 3 asks for the serial step 3's prompts and seed, to the bit, and
    its metrics equal the serial step 3's as closely as TP2 equals serial (1e-5; the gradient norm: REL)."""
    serial, results = setup
    r = _ok(results, f"tp1_to_{layout}")
    assert (r["resumed_step"], r["step"]) == (2, 3) and any("resharded to" in m for m in r["msgs"]), r["msgs"]
    assert r["replicas"] == {"0": RUNS["serial_requests"]} and len(RUNS["serial_requests"]) == 1
    worst = _close(r["metrics"], serial[2], f"tp1 -> {layout}")
    print(f"tp1 -> {layout}: step 3 request equal to the serial run's; relative metric gap {worst:.2e}")


def test_a_one_process_checkpoint_resumes_at_dp2_with_the_same_rows_and_seeds(setup):
    """Upward in DP (1 -> 2): both replicas continue the job's saved prompt stream (replica 1 has no
    part of its own: it takes replica 0's), each keeps its half of the global batch, and the rows are
    seeded by their place in the job: replica 0's prompts then replica 1's are the serial step 3's,
    with its seed, and the sampled responses are the serial step 3's to the token (a new replica used
    to draw a stream of its own: other prompts, other seeds)."""
    _, results = setup
    r = _ok(results, "tp1_to_dp2")
    assert (r["resumed_step"], r["step"]) == (2, 3)
    (serial_prompts, serial_seed), = RUNS["serial_requests"]
    (zero_prompts, zero_seed), = r["replicas"]["0"]
    (one_prompts, one_seed), = r["replicas"]["1"]
    assert len(zero_prompts) == len(one_prompts) == len(serial_prompts) // 2
    assert zero_prompts + one_prompts == serial_prompts and zero_seed == one_seed == serial_seed
    serial_responses, = RUNS["serial_responses"]
    assert r["responses"]["0"][0] + r["responses"]["1"][0] == serial_responses
    assert all(abs(v) < float("inf") for v in r["metrics"].values())


def test_a_dp2_run_asks_for_the_one_process_runs_rows_and_seeds(setup):
    """The same run at DP2 from the start: at each of the 3 steps replica 0's request and replica 1's
    together are the serial run's (prompts in order, one seed), so its rows are the DP1 run's."""
    _, results = setup
    zero, one = results["dp2"]["replica_requests"]
    serial = RUNS["serial_all"][:3]
    assert len(zero) == len(one) == len(serial) == 3
    for step, ((p0, s0), (p1, s1), (p, s)) in enumerate(zip(zero, one, serial), 1):
        assert p0 + p1 == p and s0 == s1 == s, step


def test_a_dp2_checkpoint_resumes_at_dp1_with_the_same_rows_and_seeds(setup):
    """Downward in DP (2 -> 1): the DP2 run's step-3 checkpoint resumed by one process asks at step 4
    for the serial run's step-4 prompts and seed (the job's stream, whichever replica's part holds it)."""
    tr, msgs = _resume_here("dp2")
    assert tr.step == 3 and any("resharded to tp=1 pp=1 dp=1" in m for m in msgs), msgs
    requests = trainer_layouts.record_requests(tr)
    tr.train_step()
    assert requests == RUNS["serial_all"][3:4] and len(requests) == 1


@pytest.mark.parametrize("source,target", [("tp2", "pp2"), ("pp2", "tp2")])
def test_a_checkpoint_resumes_crossing_tp_and_pp_with_the_same_data_and_seeds(setup, source, target):
    """TP2 -> PP2 and PP2 -> TP2 (no rank keeps its coordinate's part): step 4 asks for what the
    same-layout resume's step 4 asked, to the bit, with its metrics within 1e-5 (the gradient norm: REL)."""
    _, results = setup
    r = _ok(results, f"{source}_to_{target}")
    want = results[f"{source}_resumed"]
    assert (r["resumed_step"], r["step"]) == (3, 4) and any("resharded to" in m for m in r["msgs"]), r["msgs"]
    assert r["replicas"] == {"0": want["requests"]} and len(want["requests"]) == 1
    worst = _close(r["metrics"], want["metrics"], f"{source} -> {target}")
    print(f"{source} -> {target}: step 4 request equal to the {source} resume's; relative metric gap {worst:.2e}")


def test_a_part_copied_from_another_run_is_refused_on_every_rank(setup):
    """Issue 40: the TP2 step with its tp1 part taken from another run (re-signed in the global
    manifest, so every part verifies) is refused by name on both ranks -- also on rank 0, which does
    not read that part -- before anything is loaded."""
    _, results = setup
    errors = _ok(results, "tp2_foreign")["errors"]
    assert len(errors) == 2, errors
    for e in errors:
        assert e is not None and e.startswith("PartBindingError: rank 1: "), errors
        assert "tp1-pp0-dp0: this part was written by run " in e and "at step 2, but step_000003's global " in e, e
    print(f"tp2 with a foreign part: {errors[0][:300]}")
