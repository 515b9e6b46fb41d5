"""`pfppo plan`: the layout arithmetic, the memory formulas and the 70B configs.

References written here, independently of pfppo_mega.planning: the equations of Korthikanti et
al. (2022) for a GPT layer, the published Llama-3-70B parameter count, a float64 recount of the
per-GPU budget, and two measurements: megatron's own TransformerLayer's saved activations (autograd
saved-tensor hooks, CPU) and megatron's process groups / meta-device models at world size 64
(fake process group, through `--dry-run-rank`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pfppo_mega.config import load_config, validate_main
from pfppo_mega.families import DecoderShape
from pfppo_mega.planning.cli import main as plan_main
from pfppo_mega.planning.memory import (
    GiB, Hardware, Knobs, RunShape, layer_activation_terms, layer_bytes, layer_terms_for, make_plan,
)
from pfppo_mega.planning.shapes import (
    Layout, group_ranks, param_shapes, rank_coords, stage_param_count, total_param_count,
)

REPO = Path(__file__).resolve().parents[1]
H200_CONFIG = REPO / "configs" / "70b_pfppo.yaml"
H100_CONFIG = REPO / "configs" / "70b_pfppo_h100.yaml"
LLAMA3_70B = DecoderShape(num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64,
                          num_query_groups=8, vocab_size=128256, max_position_embeddings=8192, norm_epsilon=1e-5,
                          tie_word_embeddings=False, rope_theta=500000.0)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


# ----------------------------------------------------------------------------- configs


@pytest.mark.parametrize("path", [H200_CONFIG, H100_CONFIG], ids=["h200", "h100"])
def test_70b_configs_validate_and_have_the_llama3_70b_shape(path, capsys):
    assert validate_main([str(path)]) == 0, capsys.readouterr().err
    cfg = load_config(path)
    assert DecoderShape.from_model_config(cfg.model) == LLAMA3_70B
    m = cfg.model
    assert (m.max_position_embeddings, m.rope_theta, m.norm_epsilon, m.params_dtype) == (8192, 500000.0, 1e-5, "bfloat16")
    assert cfg.algorithm.use_pf_ppo and cfg.algorithm.pool.pool_size >= 2
    assert cfg.parallel.tensor_model_parallel_size * cfg.parallel.pipeline_model_parallel_size in (16, 32)


# ----------------------------------------------------------------------------- layout arithmetic


def test_llama3_70b_parameter_count_and_sharding():
    # Hugging Face shapes of Llama-3-70B: q, k, v, o, gate, up, down, 2 norms per layer.
    h, f, kv, V = 8192, 28672, 1024, 128256
    per_layer = h * h + 2 * kv * h + h * h + 3 * f * h + 2 * h
    assert 80 * per_layer + 2 * V * h + h == 70_553_706_496  # the published count
    assert total_param_count(LLAMA3_70B, "lm") == 70_553_706_496
    assert total_param_count(LLAMA3_70B, "value") == 70_553_706_496 - V * h + h
    for tp, pp in [(8, 4), (8, 2), (4, 4), (2, 8)]:
        # Every weight is split over tp except the RMSNorm weights, which every tp rank repeats.
        norms = 2 * 80 * h + h
        summed = sum(stage_param_count(LLAMA3_70B, tp, pp, k) for k in range(pp)) * tp
        assert summed - (tp - 1) * norms == 70_553_706_496, (tp, pp)


def test_rank_coordinates_and_groups_partition_the_world():
    lay = Layout(tp=8, pp=4, dp=2)
    coords = {(c.tp_rank, c.dp_rank, c.pp_rank) for c in (rank_coords(r, lay) for r in range(64))}
    assert len(coords) == 64
    for kind, size in [("tensor", 8), ("data", 2), ("pipeline", 4)]:
        groups = {tuple(group_ranks(r, lay)[kind]) for r in range(64)}
        assert all(len(g) == size for g in groups)
        assert sorted(r for g in groups for r in g) == list(range(64)), kind  # disjoint, covering
    assert group_ranks(13, lay) == {"tensor": list(range(8, 16)), "data": [5, 13],
                                    "pipeline": [13, 29, 45, 61], "embedding": [13, 61]}


def test_tied_head_lives_on_the_last_stage_only_with_a_pipeline():
    tied = DecoderShape(4, 64, 128, 4, 2, 96, max_position_embeddings=64, norm_epsilon=1e-5, tie_word_embeddings=True,
                        rope_theta=1e4)
    assert "output_layer.weight" not in param_shapes(tied, 2, 1, 0)
    assert param_shapes(tied, 2, 2, 1)["output_layer.weight"] == (48, 64)
    assert param_shapes(tied, 2, 2, 1, "value")["output_layer.weight"] == (1, 64)


# ----------------------------------------------------------------------------- activation formulas


@pytest.mark.parametrize("s,b,h,a,t", [(2048, 1, 12288, 96, 8), (4096, 2, 8192, 64, 4), (1024, 4, 4096, 32, 2)])
def test_gpt_layer_reproduces_korthikanti_equations(s, b, h, a, t):
    gpt = layer_activation_terms(s=s, b=b, h=h, a=a, g=a, f=4 * h, attention="unfused",
                                 softmax_fp32=False, mlp="gelu", dropout=True)
    sbh = s * b * h

    def stored(tp, sp, recompute):
        return layer_bytes(gpt, tp=tp, sp=sp, recompute=recompute, s=s, b=b, h=h)[0]

    # Korthikanti et al. 2022, section 4: equations (1) to (4), and full recompute.
    assert stored(1, False, "none") == pytest.approx(sbh * (34 + 5 * a * s / h), rel=1e-12)
    assert stored(t, False, "none") == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)), rel=1e-12)
    assert stored(t, True, "none") == pytest.approx(sbh / t * (34 + 5 * a * s / h), rel=1e-12)
    assert stored(t, True, "selective") == pytest.approx(34 * sbh / t, rel=1e-12)
    assert stored(t, False, "full") == 2 * sbh


_MEASURE = r"""
import sys, traceback, warnings, torch
warnings.simplefilter("ignore")
torch.set_num_threads(1)
from pfppo_mega.parallel import init_parallel
from pfppo_mega.config import load_config_dict
from pfppo_mega.models import gpt
s, b, h, a, g, f = map(int, sys.argv[1:7])
recompute = sys.argv[7]
init_parallel(tp=1, pp=1, backend="gloo", seed=1)
if recompute != "none":
    # Only the forward runs here (saved tensors are counted, no backward): megatron's checkpoint
    # reads the CUDA RNG state in its forward, and check_features refuses recompute off CUDA.
    import megatron.core.tensor_parallel.random as mp_random
    mp_random._get_all_rng_states = lambda: (torch.get_rng_state(), None, None)
    check = gpt.check_features
    gpt.check_features = lambda m, fe, device_type=None, tp=None: check(m, fe, device_type="cuda", tp=tp)
model = gpt.build_actor(load_config_dict({"model": dict(
    num_layers=1, hidden_size=h, ffn_hidden_size=f, num_attention_heads=a, num_query_groups=g,
    vocab_size=64, max_position_embeddings=s, rope_theta=10000.0, norm_epsilon=1e-5,
    tie_word_embeddings=False, params_dtype="bfloat16")}).model, features=gpt.Features(recompute=recompute))
params = {p.untyped_storage().data_ptr() for p in model.parameters()}
x = torch.randn(s, b, h, dtype=torch.bfloat16, requires_grad=True)
saved, norm = {}, {}
def pack(t):
    key = t.untyped_storage().data_ptr()
    if key not in params and key != x.untyped_storage().data_ptr():
        in_norm = any(fr.name == "rms_norm" for fr in traceback.extract_stack())
        (norm if in_norm else saved)[key] = t.untyped_storage().nbytes()
    return t
with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
    model.decoder.layers[0](x, attention_mask=None, rotary_pos_emb=model.rotary_pos_emb(s))
print(sum(saved.values()), sum(norm.values()))
"""


@pytest.mark.parametrize("recompute,g", [("none", 2), ("selective", 1)])
def test_megatron_layer_saves_what_the_local_formula_counts(recompute, g):
    """Measure megatron's own TransformerLayer (built by pfppo_mega.models, bf16, CPU): the bytes
    autograd saves, parameters and the layer input excluded. The formula for layer "local" must
    match, except the RMSNorm terms: the CPU build keeps fp32 intermediates inside rms_norm (counted
    apart) where the formula assumes a fused norm keeping its 2sbh input. Selective recompute at
    a / g = 8 (Llama-70B's ratio): the core's checkpoint keeps the fused QKV output and the rotated
    q, k, not the K and V repeated to a heads -- counting those would be 2sbd(a - 3g) too many."""
    s, b, h, a, f = 128, 2, 512, 8, 1408
    out = subprocess.run([sys.executable, "-c", _MEASURE, *map(str, (s, b, h, a, g, f)), recompute], env=_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    measured, in_norm = map(int, out.stdout.split()[-2:])
    terms = layer_terms_for("local", s=s, b=b, h=h, a=a, g=g, f=f)
    stored = layer_bytes(terms, tp=1, sp=False, recompute=recompute, s=s, b=b, h=h)[0]
    expected = stored - 2 * 2 * s * b * h  # the two norm inputs: kept as fp32 inside rms_norm on CPU
    small = s * s + 4 * s * (h // a) * 2   # causal mask (bool) + rotary cos/sin, not in the formula
    assert abs(measured - expected) <= small, (measured, expected, small)
    if recompute == "selective":  # the check tells the two accountings apart
        repeated_kv = terms.replicated + terms.split - 2 * 2 * s * b * h
        assert abs(measured - repeated_kv) > small, (measured, repeated_kv, small)
    print(f"megatron layer saves {measured / (s * b * h):.2f} sbh (+ {in_norm / (s * b * h):.1f} sbh in "
          f"CPU rms_norm); formula without norms {expected / (s * b * h):.2f} sbh")


# ----------------------------------------------------------------------------- the memory plan


def _plan(path: Path, gpu: str, overrides: tuple[str, ...] = (), **knobs):
    """The plan `pfppo plan` makes: the features from the config (overrides for them), runtime knobs."""
    cfg = load_config(path, list(overrides))
    return make_plan(RunShape.from_config(cfg), Hardware.preset(gpu, nodes=8, gpus_per_node=8),
                     Knobs.from_config(cfg, **knobs))


def test_h100_training_phase_matches_a_float64_recount():
    plan = _plan(H100_CONFIG, "h100")  # training.recompute: full, sequence parallelism off
    assert plan.fits(), plan.problems
    assert (plan.layout.tp, plan.layout.pp, plan.layout.dp, plan.worst_stage) == (8, 4, 2, 0)
    # Stage 0 of tp 8, pp 4: 20 layers + the embedding, per tp rank; the critic's trunk is identical.
    h, f, kv, V = 8192.0, 28672.0, 1024.0, 128256.0
    n = 20 * ((h * h + 2 * kv * h + h * h + 3 * f * h) / 8 + 2 * h) + V / 8 * h
    states = 2 * (2 * n + 4 * n + 12 * n / 2) + 2 * n  # actor, critic (bf16 w, fp32 g, Adam / dp), reference
    s, sbh, a = 4096.0, 4096.0 * 8192, 64.0
    # no SP: the norm / QKV / fc1 inputs (8 sbh) are whole on each tp rank; the rest is split over tp 8.
    # training.fused_layers (default on): SDPA keeps K, V at the KV heads' width and an fp32 log-sum-exp,
    # no s^2 scores; the fused SwiGLU keeps its input and fc2's (6 sf), not megatron's 10 sf
    layer_fused = 8 * sbh + (2 * sbh + 2 * sbh + 2 * 2 * s * kv + 4 * a * s + 6 * s * f) / 8
    acts = 4 * 20 * 2 * sbh + layer_fused  # 4 micro-batches in flight x 20 layers x input, + one layer
    # the refit stream's ring (2 slots of the largest bucket, the bf16 embedding V x h, larger than
    # refit_bucket_mb and never split, + a 32-byte trailer each) is on the GPU while the engine is
    # awake and freed when it sleeps: in the rollout budget, not in the update's
    slots = 2 * (2 * V * h + 32)
    want = states + acts + 4 * GiB
    assert plan.train.total == pytest.approx(want, rel=1e-9)
    assert {c.name: c.bytes for c in plan.rollout.components}["refit stream slots (to sleep)"] == slots
    names = [c.name for c in plan.train.components]
    assert not any(n.startswith("refit stream slots") for n in names)
    assert names[:7] == ["actor weights (bf16)", "actor grads (fp32)", "actor optimizer (fp32 x3)",
                         "critic weights (bf16)", "critic grads (fp32)", "critic optimizer (fp32 x3)",
                         "reference weights (bf16)"]


def test_kv_cache_and_host_pool():
    plan = _plan(H200_CONFIG, "h200")
    gpu = 143771 * 2 ** 20
    engine_w = 2 * (80 * (2 * 8192 + (8 + 2) * 128 * 8192 + 8192 * 1024 + 3 * 3584 * 8192) + 2 * 16032 * 8192 + 8192)
    per_token = 2 * 80 * 1 * 128 * 2  # K and V, 80 layers, 8 KV heads / tp 8, head dim 128, bf16
    assert plan.kv.bytes_per_token == per_token
    assert plan.kv.tokens == math.floor((0.85 * gpu - engine_w - 2 * GiB) / per_token)
    assert plan.kv.sequences == plan.kv.tokens // 4096
    pool = {c.name: c.bytes for c in plan.host.components}["PF-PPO snapshot pool (node)"]
    assert pool == 4 * 2 * 70_553_706_496
    sharded = _plan(H200_CONFIG, "h200", pool_placement="sharded")
    assert {c.name: c.bytes for c in sharded.host.components}["PF-PPO snapshot pool (sharded)"] == pool / 8


def test_both_shipped_layouts_fit_their_gpu():
    h200 = _plan(H200_CONFIG, "h200")
    h100 = _plan(H100_CONFIG, "h100")
    assert h200.fits() and h100.fits(), (h200.problems, h100.problems)
    assert h200.train.total < 125 * GiB and h100.train.total < 70 * GiB  # sequence parallelism off
    assert h200.kv.waves == h100.kv.waves == 1


def test_refuses_the_h200_layout_on_h100_saying_by_how_much(tmp_path, capsys):
    report = tmp_path / "plan.json"
    rc = plan_main([str(H200_CONFIG), "--gpu", "h100", "--json", str(report)])
    out = capsys.readouterr().out
    assert rc == 2
    plan = json.loads(report.read_text())
    assert not plan["fits"]
    stage0 = plan["gpu_train_phase"][0]
    assert not stage0["fits"] and stage0["over_gib"] > 10
    assert f"over by {stage0['over_gib']:.2f} GiB" in plan["problems"][0]
    for name in ("actor grads (fp32)", "critic optimizer (fp32 x3)", "activations (actor update)"):
        assert name in plan["problems"][0]
    assert "verdict: REFUSED" in out and "OVER BY" in out


@pytest.mark.parametrize("args,message", [
    (["parallel.tensor_model_parallel_size=16"], "num_query_groups(8) must be divisible by tensor_model_parallel_size(16)"),
    (["parallel.pipeline_model_parallel_size=3"], "does not divide the world size"),
    (["--micro-batch", "3"], "training.batch_size(256) must be divisible by dp(4) x micro_batch(3) = 12"),
    (["algorithm.max_response_length=8000"], "> max_position_embeddings(8192)"),
], ids=["tp16", "pp3", "micro-batch", "too-long"])
def test_refuses_bad_layouts(args, message, capsys):
    assert plan_main([str(H200_CONFIG), *args, "--gpu", "h200"]) == 2
    captured = capsys.readouterr()
    assert message in captured.out + captured.err


@pytest.mark.parametrize("util,message", [
    (0.25, "note: rollout: 128 sequences per engine replica, 9 fit in the KV cache"),  # fits, in waves
    (0.2325, "rollout: the KV cache holds 2"),        # ~2.4k tokens: less than one 4096-token sequence
    (0.2, "rollout: the engine's share gpu_memory_utilization(0.2)"),  # not even the weights
])
def test_rollout_engine_share(util, message, capsys):
    rc = plan_main([str(H100_CONFIG), f"actor_rollout.gpu_memory_utilization={util}", "--gpu", "h100"])
    assert rc == (0 if util == 0.25 else 2)
    assert message in capsys.readouterr().out


# ----------------------------------------------------------------------------- dry run at world size 64


@pytest.mark.parametrize("config,gpu,ranks", [
    (H100_CONFIG, "h100", "0,7,13,40,63"),  # pp 4: first stage (tp 0, 7, dp 1), a middle stage, last
    (H200_CONFIG, "h200", "0,63"),          # pp 2: first and last stage
], ids=["h100-pp4", "h200-pp2"])
def test_dry_run_matches_megatron_at_world_size_64(config, gpu, ranks, tmp_path):
    report = tmp_path / "plan.json"
    out = subprocess.run([sys.executable, "-m", "pfppo_mega.planning", str(config), "--gpu", gpu,
                          "training.recompute=full", "--dry-run-rank", ranks, "--json", str(report)],
                         env=_env(), capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    plan = json.loads(report.read_text())
    per_stage = {s["pp_rank"]: s for s in plan["params"]["per_stage"]}
    lay = Layout(**{k: plan["layout"][k] for k in ("tp", "pp", "dp")})
    assert [d["rank"] for d in plan["dry_run"]] == [int(r) for r in ranks.split(",")]
    for d in plan["dry_run"]:
        assert d["ok"], d["mismatches"]
        c = rank_coords(d["rank"], lay)
        assert d["coords"] == {"tp_rank": c.tp_rank, "dp_rank": c.dp_rank, "pp_rank": c.pp_rank}
        assert d["actor_params"] == per_stage[c.pp_rank]["actor"]
        assert d["critic_params"] == per_stage[c.pp_rank]["critic"]
    last = [d for d in plan["dry_run"] if d["coords"]["pp_rank"] == lay.pp - 1]
    assert last and last[0]["critic_params"] < last[0]["actor_params"]  # value head [1, h] vs LM head


def test_without_offload_the_engine_shares_the_gpu_with_the_trainer(capsys):
    # Flags and overrides in any order. Trainer states stay: the engine's 0.85 share no longer fits ...
    assert plan_main([str(H200_CONFIG), "--gpu", "h200", "--no-offload"]) == 2
    out = capsys.readouterr().out
    assert "trainer states (not offloaded)" in out and "GPU, rollout phase: needs" in out
    # ... a 0.3 share does, and the host then holds only the pool and the reserve.
    plan = _plan(H200_CONFIG, "h200", ("actor_rollout.gpu_memory_utilization=0.3",), offload_during_rollout=False)
    assert plan.fits(), plan.problems
    states = sum(c.bytes for c in plan.train.components if c.name.startswith(("actor", "critic", "reference")))
    slots = 2 * (2 * 128256 * 8192 + 32)  # the refit stream's kept ring: 2 x the bf16 embedding bucket
    assert plan.rollout.total == pytest.approx(0.3 * 143771 * 2 ** 20 + states + slots + 4 * GiB, rel=1e-12)
    assert [c.name for c in plan.host.components] == ["PF-PPO snapshot pool (node)", "host reserve"]


def test_micro_batch_comes_from_the_config_unless_the_flag_says_otherwise():
    rows = ("training.use_dynamic_bsz=false",)  # micro-batches by rows, as before the token budget
    assert _plan(H200_CONFIG, "h200", rows + ("training.micro_batch_size=1",)).micro_batch == 1
    two = _plan(H200_CONFIG, "h200", rows + ("training.micro_batch_size=2",))
    assert (two.micro_batch, two.num_microbatches) == (2, 32)
    # without sequence parallelism 2 sequences per micro-batch need full recompute on H200
    assert not two.fits() and _plan(H200_CONFIG, "h200", rows + ("training.micro_batch_size=2",
                                                                  "training.recompute=full")).fits()
    assert _plan(H200_CONFIG, "h200", rows + ("training.micro_batch_size=2",), micro_batch=4).micro_batch == 4
    # null: the whole mini-batch of a DP rank (256 / dp 4 = 64 sequences) in one micro-batch
    whole = _plan(H200_CONFIG, "h200", rows + ("training.micro_batch_size=null",))
    assert (whole.micro_batch, whole.num_microbatches) == (64, 1) and not whole.fits()


def test_a_token_budget_is_planned_as_its_full_length_rows():
    """The 70B configs train by token budget (issue 35: micro_batch_size 1 padded every row to the
    longest): a micro-batch of <= 4096 tokens holds the activations of one 4096-token row, the plan of
    micro_batch_size 1; a budget of two rows plans two, and micro_batch_size still caps the rows."""
    cfg = load_config(H200_CONFIG, [])
    assert cfg.training.use_dynamic_bsz and cfg.training.micro_batch_size is None
    budget = _plan(H200_CONFIG, "h200")
    one_row = _plan(H200_CONFIG, "h200", ("training.use_dynamic_bsz=false", "training.micro_batch_size=1"))
    assert budget.micro_batch == 1 and budget.train.total == one_row.train.total and budget.fits()
    assert _plan(H200_CONFIG, "h200", ("training.max_tokens_per_micro_batch=8192",)).micro_batch == 2
    assert _plan(H200_CONFIG, "h200", ("training.max_tokens_per_micro_batch=8192",
                                       "training.micro_batch_size=1")).micro_batch == 1
    assert _plan(H200_CONFIG, "h200", ("training.max_tokens_per_micro_batch=1000",)).micro_batch == 1  # a row alone


def test_vllm_max_num_seqs_bounds_the_waves(capsys):
    """The 70B plan's KV cache holds 645 sequences per replica and the rollout needs 128: one wave, but
    only if vLLM may schedule 128 at once (max_num_seqs 64, its default, took two waves unplanned)."""
    assert load_config(H200_CONFIG, []).actor_rollout.max_num_seqs == 128
    assert _plan(H200_CONFIG, "h200").kv.waves == 1
    capped = _plan(H200_CONFIG, "h200", ("actor_rollout.max_num_seqs=64",))
    assert capped.kv.waves == 2 and capped.kv.sequences > 128
    assert any("64 at once (actor_rollout.max_num_seqs = 64" in n for n in capped.notes), capped.notes


# ----------------------------------------------------------------------------- Llama-3.3-70B (issue 13)

LLAMA33_H200 = REPO / "configs" / "70b_llama33_pfppo.yaml"
LLAMA33_H100 = REPO / "configs" / "70b_llama33_pfppo_h100.yaml"
# config.json of Llama-3.3-70B-Instruct (the keys that matter here)
LLAMA33_CONFIG_JSON = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "hidden_size": 8192,
    "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
    "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
}


@pytest.mark.parametrize("path,gpu", [(LLAMA33_H200, "h200"), (LLAMA33_H100, "h100")], ids=["h200", "h100"])
def test_llama33_configs_validate_and_plan(path, gpu, capsys):
    assert validate_main([str(path)]) == 0, capsys.readouterr().err
    cfg = load_config(path)
    # RoPE scaling adds no parameters: the shape of Llama-3-70B, but a 16 x longer context
    assert DecoderShape.from_model_config(cfg.model) == dataclasses.replace(LLAMA3_70B, max_position_embeddings=131072)
    assert cfg.model.max_position_embeddings == 131072
    plan = _plan(path, gpu)
    assert plan.fits(), plan.problems
    if gpu == "h100":  # selective recompute does not fit on H100 at 5120 tokens (the file says so)
        assert not _plan(path, gpu, ("training.recompute=selective",)).fits()


def test_llama33_checkpoint_config_matches_and_dry_run_builds_it(tmp_path):
    """The Llama-3.3 config.json (llama3 RoPE) fills and matches the config's model section; the
    planner reads the family from it, and the world-64 dry run builds megatron with it."""
    from pfppo_mega.config.tree import ModelConfig
    from pfppo_mega.families import architecture_from_hf
    from pfppo_mega.models import hf_io

    ckpt = tmp_path / "llama33"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(LLAMA33_CONFIG_JSON))
    cfg = load_config(LLAMA33_H200)
    assert hf_io.model_config_from_hf(LLAMA33_CONFIG_JSON, cfg.model) == cfg.model
    assert hf_io.model_config_from_hf(LLAMA33_CONFIG_JSON, ModelConfig(params_dtype="bfloat16", layer_spec="local")) == cfg.model
    assert architecture_from_hf(LLAMA33_CONFIG_JSON).rope.rope_type == "llama3"
    out = subprocess.run([sys.executable, "-m", "pfppo_mega.planning", str(LLAMA33_H200), f"actor_rollout.model_path={ckpt}",
                          "--gpu", "h200", "--dry-run-rank", "0,63"],
                         env=_env(), capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"family: llama from {ckpt}/config.json" in out.stdout and "rope_type='llama3'" in out.stdout
    assert out.stdout.count(" OK") == 2 and "MISMATCH" not in out.stdout


def test_dry_run_counts_qwen2_qkv_biases(tmp_path):
    """A Qwen2 checkpoint's q/k/v biases are parameters of megatron's linear_qkv: the planner,
    reading the same DecoderShape as the model builder, counts them at tp 2 x pp 2."""
    cfg = load_config(REPO / "configs" / "tiny_cpu.yaml").model
    hf = {"model_type": "qwen2", "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size,
          "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
          "num_key_value_heads": cfg.num_query_groups, "vocab_size": cfg.vocab_size,
          "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.norm_epsilon}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    out = subprocess.run([sys.executable, "-m", "pfppo_mega.planning", str(REPO / "configs" / "tiny_cpu.yaml"),
                          f"actor_rollout.model_path={tmp_path}", "parallel.pipeline_model_parallel_size=2",
                          "--gpu", "h100", "--nodes", "1", "--gpus-per-node", "4", "--rollout-tp", "2",
                          "--dry-run-rank", "0,3"], env=_env(), capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "family: qwen2" in out.stdout and out.stdout.count(" OK") == 2 and "MISMATCH" not in out.stdout


def test_planner_runs_without_torch():
    """The planner reads the model's shape (pfppo_mega.families) without importing torch."""
    code = ("import sys; import pfppo_mega.planning.cli, pfppo_mega.families; "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]")
    out = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=120,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]


def test_activation_terms_follow_an_explicit_head_dim():
    """Qwen3-32B-like: hidden 5120, 64 heads of 128 (a d = 8192 != h): Q, K, V and the out-proj
    input are a d wide; the q/k RMSNorm inputs add 2 s b (a + g) d. d = h / a changes nothing."""
    s, b, h, a, g, f = 4096, 1, 5120, 64, 8, 25600
    base = layer_activation_terms(s=s, b=b, h=h, a=a, g=g, f=f)
    assert layer_activation_terms(s=s, b=b, h=h, a=a, g=g, f=f, d=h // a) == base
    wide = layer_activation_terms(s=s, b=b, h=h, a=a, g=g, f=f, d=128)
    assert wide.split - base.split == (2 + 2 + 4) * s * b * (a * 128 - h)
    assert (wide.replicated, wide.core) == (base.replicated, base.core)
    normed = layer_activation_terms(s=s, b=b, h=h, a=a, g=g, f=f, d=128, qk_norm=True)
    assert normed.split - wide.split == 2 * s * b * (a + g) * 128
    flash = layer_activation_terms(s=s, b=b, h=h, a=a, g=g, f=f, d=128, attention="flash", mlp="swiglu")
    flash_default = layer_activation_terms(s=s, b=b, h=h, a=a, g=g, f=f, attention="flash", mlp="swiglu")
    assert flash.split - flash_default.split == (2 + 2) * s * b * (a * 128 - h) + 2 * 2 * s * b * g * (128 - h // a)


# ----------------------------------------------------------------------------- the engine keys (issue 20)


@pytest.mark.parametrize("path", [H200_CONFIG, H100_CONFIG, REPO / "configs" / "70b_llama33_pfppo.yaml",
                                  REPO / "configs" / "70b_llama33_pfppo_h100.yaml"], ids=lambda p: p.stem)
def test_70b_configs_plan_with_their_own_engine_keys(path, tmp_path, capsys):
    """Each 70B config names rollout TP 8, a bf16 engine and sleep level 2, and `pfppo plan`, which
    reads them (no flag), still fits on the GPU the file is for."""
    cfg = load_config(path)
    ar = cfg.actor_rollout
    assert (ar.tensor_model_parallel_size, ar.dtype, ar.sleep_level) == (8, "bfloat16", 2)
    report = tmp_path / "plan.json"
    gpu = "h100" if path.stem.endswith("h100") else "h200"
    assert plan_main([str(path), "--gpu", gpu, "--json", str(report)]) == 0, capsys.readouterr().out[-3000:]
    plan = json.loads(report.read_text())
    assert plan["knobs"]["rollout_tp"] == 8 and plan["run"]["engine_dtype"] == "bfloat16"
    assert "rollout engine tp=8 (8 replicas), bfloat16, sleep level 2" in capsys.readouterr().out


def test_plan_follows_the_config_rollout_tp_and_a_flag_overrides_it_with_a_note(tmp_path, capsys):
    # the config's value, not GPUs per node: a 70B engine on one GPU per replica cannot fit
    one = _plan(H200_CONFIG, "h200", ("actor_rollout.tensor_model_parallel_size=1",))
    assert one.rollout_tp == 1 and not one.fits()
    assert "engine's share" in " ".join(one.problems)
    four = _plan(H200_CONFIG, "h200", ("actor_rollout.tensor_model_parallel_size=4",))
    eight = _plan(H200_CONFIG, "h200")
    w = {p.rollout_tp: p.rollout.components[0].bytes for p in (four, eight)}
    assert four.kv.replicas == 16 and eight.kv.replicas == 8
    assert w[4] > 1.9 * w[8]  # each GPU holds twice the engine's weights (norms and KV heads aside)
    # the flag overrides explicitly, with a note saying the run would differ
    report = tmp_path / "plan.json"
    assert plan_main([str(H200_CONFIG), "--gpu", "h200", "--rollout-tp", "4", "--json", str(report)]) == 0
    out = capsys.readouterr()
    assert "--rollout-tp 4 overrides the config's actor_rollout.tensor_model_parallel_size (8)" in out.err
    assert json.loads(report.read_text())["knobs"]["rollout_tp"] == 4
    # the same value as the config: no note
    assert plan_main([str(H200_CONFIG), "--gpu", "h200", "--rollout-tp", "8"]) == 0
    assert "overrides" not in capsys.readouterr().err


def test_engine_weights_kv_cache_and_pool_use_the_engine_dtype():
    bf16 = _plan(H200_CONFIG, "h200")
    fp32 = _plan(H200_CONFIG, "h200", ("actor_rollout.dtype=float32",))
    auto = _plan(H200_CONFIG, "h200", ("actor_rollout.dtype=auto",))  # auto: model.params_dtype (bf16)
    assert auto.rollout.components[0].bytes == bf16.rollout.components[0].bytes
    assert fp32.rollout.components[0].bytes == 2 * bf16.rollout.components[0].bytes
    assert fp32.rollout.components[0].name == "engine weights (float32, tp 8)"
    assert fp32.kv.bytes_per_token == 2 * bf16.kv.bytes_per_token
    pool = lambda p: {c.name: c.bytes for c in p.host.components}["PF-PPO snapshot pool (node)"]  # noqa: E731
    assert pool(fp32) == 2 * pool(bf16)


def test_sleep_level_1_keeps_the_engine_weights_in_host_memory():
    two = _plan(H200_CONFIG, "h200")
    one = _plan(H200_CONFIG, "h200", ("actor_rollout.sleep_level=1",))
    host = {c.name: c.bytes for c in one.host.components}
    engine_w = one.rollout.components[0].bytes  # per GPU
    assert host["sleeping engine weights (sleep level 1, bfloat16)"] == 8 * engine_w
    assert one.host.total == pytest.approx(two.host.total + 8 * engine_w)
    assert "weights in host memory" in one.train.note and "weights dropped" in two.train.note
    assert one.train.total == two.train.total  # nothing of the engine on the GPU while training
