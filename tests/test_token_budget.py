"""No work on padding (issue 23.3): micro-batches by token budget (training.use_dynamic_bsz,
max_tokens_per_micro_batch) and the LM / value head at the response tokens only
(training.response_only_head) compute the same log-probs, values, losses, gradients and metrics as
the padded path, up to the order of floating-point sums, on fewer positions.

Single rank here; the same comparison at TP2 and PP2 (token-budget micro-batches of varying shape
through megatron's pipeline schedule) runs in the 2-process launch of tests/test_parallel.py
(tests/multirank/checks.py: check_token_budget)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

sys.path.insert(0, str(Path(__file__).resolve().parent / "multirank"))

import common  # noqa: E402

from pfppo_mega.config import ConfigError, load_config_dict  # noqa: E402
from pfppo_mega.config.tree import ModelConfig  # noqa: E402
from pfppo_mega.models import passes, gpt, microbatch  # noqa: E402
from pfppo_mega.types import pack  # noqa: E402

LOSS_RTOL = 1e-6
WEIGHT_ATOL = common.LR / 50
CLIPFRAC_ATOL = 3 / 150  # three of the ~150 response tokens of a tiny trainer step (see the trainer test)  # as tests/test_parallel.py: Adam's first step amplifies round-off of tiny grads


# ----------------------------------------------------------------------------- the plan


def _ragged(n: int, seed: int) -> list[int]:
    """Row lengths like a real rollout's: prompts of 20-60 tokens + responses of 1-64 tokens."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(20, 61, (n,), generator=g) + torch.randint(1, 65, (n,), generator=g)).tolist()


def test_token_budget_plan_covers_every_row_once_within_the_budget():
    lengths = _ragged(97, 1)
    for budget, cap, multiple in ((512, None, 1), (1000, 4, 1), (130, None, 8)):
        plan = microbatch.by_token_budget(lengths, max_tokens=budget, max_rows=cap, multiple=multiple)
        assert sorted(i for mb in plan for i in mb) == list(range(len(lengths)))
        for mb in plan:
            width = -(-max(lengths[i] for i in mb) // multiple) * multiple
            assert len(mb) * width <= budget and (cap is None or len(mb) <= cap), (budget, mb)
        assert plan == microbatch.by_token_budget(lengths, max_tokens=budget, max_rows=cap, multiple=multiple)
    # a row longer than the budget runs alone (verl refuses the batch); the others still share
    assert microbatch.by_token_budget([3, 9, 2, 3], max_tokens=8) == [[1], [0, 3], [2]]


def test_token_budget_cuts_padding_on_a_ragged_distribution():
    """The figure README quotes: 256 rows, by rows of 16 at the batch's longest row vs a budget of
    16 x the mean row length."""
    lengths = _ragged(256, 2)
    rows = microbatch.padding_frac(lengths, microbatch.by_rows(256, 16), width=max(lengths))
    budget = microbatch.by_token_budget(lengths, max_tokens=16 * sum(lengths) // 256)
    sorted_frac = microbatch.padding_frac(lengths, budget)
    print(f"padding: by rows {rows:.3f}, by token budget {sorted_frac:.3f} ({len(budget)} micro-batches)")
    assert rows > 0.3 and sorted_frac < 0.10


# ----------------------------------------------------------------------------- the engine at one rank


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    """A TP1 world for the module, and tests/multirank/common.py's checkpoints by kind."""
    yield from common.tp1_world(tmp_path_factory.mktemp("budget"))


MODEL = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                    vocab_size=97, max_position_embeddings=128, rope_theta=10000.0, norm_epsilon=1e-5,
                    tie_word_embeddings=False)


def _batch(b: int = 24, t: int = 20):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 97, (int(n),), generator=g).tolist() for n in torch.randint(5, 30, (b,), generator=g)]
    lens = torch.randint(1, t + 1, (b,), generator=g)
    lens[5] = 0  # a row without a response token: nothing for the head at all
    mask = (torch.arange(t)[None] < lens[:, None]).float()
    return pack(prompts, torch.randint(1, 97, (b, t), generator=g), mask, pad_id=0)


def test_forward_passes_match_the_padded_path(world):
    torch.manual_seed(0)
    actor, critic = gpt.build_actor(MODEL), gpt.build_critic(MODEL)
    with torch.no_grad():
        critic.output_layer.weight.normal_()
    inp = _batch()
    m = inp.response_mask.bool()
    ref = (*passes.forward_logp_entropy(actor, inp, temperature=0.7, micro_batch_size=4),
           passes.forward_values(critic, inp, micro_batch_size=4))
    plain = microbatch.Tally()
    passes.forward_values(critic, inp, micro_batch_size=passes.Batching(4, tally=plain))
    for batching in (passes.Batching(4, response_only=True), passes.Batching(64, max_tokens=160),
                     passes.Batching(5, max_tokens=400, response_only=True, tally=microbatch.Tally())):
        got = (*passes.forward_logp_entropy(actor, inp, temperature=0.7, micro_batch_size=batching),
               passes.forward_values(critic, inp, micro_batch_size=batching))
        for name, a, b in zip(("logp", "entropy", "values"), ref, got):
            # values reach ~10: fp32 sums in another order (attention over rows cut to other lengths) move ~1 ulp
            torch.testing.assert_close(b[m], a[m], rtol=1e-6, atol=2e-6, msg=lambda s: f"{name} {batching}: {s}")
            if batching.response_only:
                assert not b[~m].any(), f"{name}: masked slots must be 0 with response_only"
    tally = batching.tally
    assert tally.passes == 2 and tally.head_computed == tally.head_needed == int(m.sum()) * 2
    assert tally.padding_frac < plain.padding_frac and plain.head_waste_frac > 0.5 and tally.head_waste_frac == 0
    print(f"padding {plain.padding_frac:.3f} -> {tally.padding_frac:.3f}; head waste {plain.head_waste_frac:.3f} -> 0")


@pytest.mark.parametrize("kind", common.CHECKPOINTS)  # llama: untied head; qwen2: tied to the embedding
def test_ppo_update_matches_the_padded_path(world, kind):
    batch = common.ppo_batch()
    ref = common.ppo_update(world[kind], batch, micro_batch_size=common.BATCH, dp_rank=0, dp=1)
    for batching in (passes.Batching(common.BATCH, max_tokens=24, response_only=True),
                     passes.Batching(3, max_tokens=40), passes.Batching(2, response_only=True)):
        got = common.ppo_update(world[kind], batch, micro_batch_size=batching, dp_rank=0, dp=1)
        rs, gs = ref.scalars(), got.scalars()
        assert sorted(rs) == sorted(gs)
        for k in rs:
            assert abs(gs[k] - rs[k]) <= LOSS_RTOL * max(1.0, abs(rs[k])) * (10 if "grad_norm" in k else 1), \
                (batching, k, rs[k], gs[k])
        worst = max((got.weights[n] - ref.weights[n]).abs().max().item() for n in ref.weights)
        print(f"{kind} {batching.max_tokens} {batching.response_only}: weights max |diff| {worst:.1e}")
        assert worst <= WEIGHT_ATOL


# ----------------------------------------------------------------------------- the config keys


def test_config_keys_are_validated():
    base = {"actor_rollout": {"model_path": "x"}}
    for bad in (0, -5, 1.5, "many"):
        with pytest.raises(ConfigError, match=r"training.max_tokens_per_micro_batch = "):
            load_config_dict({**base, "training": {"use_dynamic_bsz": True, "max_tokens_per_micro_batch": bad}})
    with pytest.raises(ConfigError, match=r"training.response_only_head"):
        load_config_dict({**base, "training": {"response_only_head": "yes please"}})
    cfg = load_config_dict({**base, "training": {"use_dynamic_bsz": True, "response_only_head": True}})
    assert cfg.training.max_tokens_per_micro_batch == 16384 and cfg.training.response_only_head  # verl's default


# ----------------------------------------------------------------------------- the trainer


def _count_probes(monkeypatch) -> tuple[list, int]:
    """A list that machine's timings append to, and how many one measurement of every rate takes."""
    from pfppo_mega.compat import onednn
    from pfppo_mega.trainer.instruments import machine

    timed, best = [], machine._best_seconds
    monkeypatch.setattr(machine, "_best_seconds", lambda fn, device, repeats: timed.append(1) or best(fn, device, repeats))
    return timed, 2 + onednn.available(torch.float32)  # torch.mm and memcpy, oneDNN where torch has it


def test_trainer_steps_match_and_report_perf(world, tmp_path, monkeypatch):
    """Two PPO steps of the tiny trainer, padded vs token budget + response-only head: every metric
    but the timings agrees; perf/ reports the padding and the machine fractions."""
    from test_trainer import TINY, _cfg

    from pfppo_mega.sft import run_sft
    from pfppo_mega.trainer.instruments import machine
    from pfppo_mega.trainer.loop import PPOTrainer

    timed, per_probe = _count_probes(monkeypatch)
    sft = tmp_path / "sft"
    d = json.loads(json.dumps(TINY))
    d["sft"].update(output_dir=str(sft), steps=20)
    d["actor_rollout"] = {"model_path": str(sft)}
    run_sft(load_config_dict(d), log=lambda *_: None)
    runs = {}
    for name, training in (("padded", {}), ("budget", {"use_dynamic_bsz": True, "max_tokens_per_micro_batch": 104,
                                                       "response_only_head": True})):
        probe = {"perf_probe_interval": 1} if name == "budget" else {}  # the rates timed again each step
        cfg = _cfg(tmp_path / name, sft, training={"total_training_steps": 2, **training}, checkpoint={"resume": False},
                   logging=probe)
        trainer = PPOTrainer(cfg, log=lambda *_: None)
        timed.clear()
        runs[name] = [trainer.train_step() for _ in range(2)]
        # once per process without the interval (none here when an earlier test took them), each step with it
        assert len(timed) == 2 * per_probe if probe else len(timed) <= per_probe, (name, timed)
    for step, (a, b) in enumerate(zip(runs["padded"], runs["budget"])):
        assert sorted(a) == sorted(b)
        for k in a:
            if k.startswith(("time/", "perf/")):
                continue
            # A clip fraction counts strict comparisons: where the clip is idle, V_clip = old + (V - old)
            # equals V only up to its last bit, so a token or two may flip when V moved by round-off
            # (token-budget micro-batches of another length give the update's forward other sums).
            tol = CLIPFRAC_ATOL if k.endswith("clipfrac") else 1e-5 * max(1.0, abs(a[k]))
            assert abs(a[k] - b[k]) <= tol, (step, k, a[k], b[k])
    a, b = runs["padded"][-1], runs["budget"][-1]
    print({k: (round(a[k], 4), round(b[k], 4)) for k in sorted(a) if k.startswith("perf/")})
    assert b["perf/padding_frac"] < a["perf/padding_frac"] and b["perf/head_waste_frac"] == 0.0 < a["perf/head_waste_frac"]
    for k in ("perf/prepare_matmul_frac", "perf/update_matmul_frac", "perf/rollout_floor_frac"):
        assert 0 < a[k] < 1.5 and 0 < b[k] < 1.5, k  # a fraction of what the machine did beside it
    assert a["perf/matmul_gflops"] > 0 and a["perf/memcpy_gbps"] > 0
    for m in runs["padded"] + runs["budget"]:  # every step refits the engine to the updated actor
        assert 0 < m["time/rollout_weights_s"] < m["time/rollout_s"], m["time/rollout_weights_s"]
        # the engine's generate() calls are part of the phase, beside the refit, never overlapping it
        assert 0 < m["time/rollout_engine_s"] <= m["time/rollout_s"] - m["time/rollout_weights_s"]
        assert m["perf/generate_floor_frac"] == pytest.approx(m["perf/rollout_floor_s"] / m["time/rollout_engine_s"])
    libs = {k: v for k, v in a.items() if k.startswith("perf/matmul_gflops_")}
    assert "perf/matmul_gflops_torch_mm" in libs  # the fractions use the best library's rate
    assert a["perf/matmul_gflops"] == max(libs.values())


def test_machine_remeasure_takes_the_rates_again(monkeypatch):
    """The rates are cached per process, and remeasure() (the trainer's logging.perf_probe_interval)
    makes the next call time the machine again instead of returning the first figure."""
    from pfppo_mega.trainer.instruments import machine

    timed, per_probe = _count_probes(monkeypatch)
    cpu = torch.device("cpu")
    machine.remeasure()
    first = machine.matmul_rate(cpu), machine.memcpy_rate(cpu)
    assert len(timed) == per_probe and min(first) > 0
    assert (machine.matmul_rate(cpu), machine.memcpy_rate(cpu)) == first  # cached: nothing timed
    assert len(timed) == per_probe
    machine.remeasure()
    again = machine.matmul_rate(cpu), machine.memcpy_rate(cpu)
    assert len(timed) == 2 * per_probe and min(again) > 0  # timed again: a new figure


def test_machine_rate_is_the_best_library():
    """machine.matmul_rate = the best of matmul_rates (torch.mm, and oneDNN prepacked on a CPU in
    fp32 where torch has it): a floor against the slower library would flatter the phases."""
    from pfppo_mega.compat import onednn
    from pfppo_mega.trainer.instruments import machine

    rates = machine.matmul_rates(torch.device("cpu"), torch.float32)
    assert set(rates) == ({"torch_mm", "onednn"} if onednn.available() else {"torch_mm"})
    assert all(r > 1e8 for r in rates.values()), rates  # > 0.1 GFLOP/s: a real measurement
    assert machine.matmul_rate(torch.device("cpu")) == max(rates.values())
    assert set(machine.matmul_rates(torch.device("cpu"), torch.float64)) == {"torch_mm"}


def test_bench_passes_reports_every_figure(world, tmp_path):
    """python -m pfppo_mega.bench.passes at the tiny shape: both paths and the rollout measured."""
    from pfppo_mega.bench import passes

    out = passes.main(["--shape", "tiny", "--rows", "6", "--max-response", "12", "--new-tokens", "4",
                       "--threads", "1", "--out", str(tmp_path / "passes.json")])
    assert json.loads((tmp_path / "passes.json").read_text())["paths"].keys() == {"padded", "token_budget"}
    padded, budget = out["paths"]["padded"], out["paths"]["token_budget"]
    assert budget["padding_frac"] < padded["padding_frac"] and budget["head_waste_frac"] == 0 < padded["head_waste_frac"]
    for loss in ("actor_loss", "critic_loss"):  # both paths start from the same weights
        assert abs(budget[loss] - padded[loss]) <= 1e-6 * max(1.0, abs(padded[loss])), loss
    for r in (padded, budget):
        assert 0 < r["prepare_matmul_frac"] < 1.5 and 0 < r["update_matmul_frac"] < 1.5
    assert 0 < out["rollout"]["floor_frac"] < 1.5 and out["rollout"]["new_tokens"] == 6 * 4
    assert len(out["rollout"]["seconds_each"]) == 3 and out["rollout"]["seconds"] == sorted(out["rollout"]["seconds_each"])[1]
    only = passes.main(["--shape", "tiny", "--rows", "4", "--new-tokens", "3", "--threads", "1", "--rollout-only",
                        "--rollout-repeats", "2"])
    assert only["paths"] == {} and len(only["rollout"]["seconds_each"]) == 2 and only["rollout"]["new_tokens"] == 12


def test_perf_formulas_count_what_the_model_does():
    """Model FLOPs per token and the rollout floor by hand, on SmolLM2-135M's shape."""
    from pfppo_mega.bench.passes import SHAPES
    from pfppo_mega.families import DecoderShape
    from pfppo_mega.trainer.instruments import perf

    s = DecoderShape.from_model_config(ModelConfig(**SHAPES["smollm2-135m"]))
    layer = perf.layer_matmul_params(s)
    norms = (2 * s.num_layers + 1) * s.hidden_size
    assert s.num_layers * layer + s.vocab_size * s.hidden_size + norms == 134_515_008  # SmolLM2-135M, tied
    fwd = perf.forward_flops(s, tokens=10, attn_pairs=55, head_tokens=4, head_width=s.vocab_size)
    assert fwd == 2 * 30 * layer * 10 + 4 * 9 * 64 * 30 * 55 + 2 * 576 * 49152 * 4
    mm, bw, p = 1e11, 1e10, 7
    prefill = (2 * 30 * layer * p + 4 * 9 * 64 * 30 * p * (p + 1) / 2 + 2 * 576 * 49152) / mm
    assert perf.rollout_floor_s(s, [p], [1], matmul=mm, memcpy=bw, dtype_bytes=4) == pytest.approx(prefill)
    weights = (30 * layer + 576 * 49152) * 4
    step = max((weights + 2 * 30 * 3 * 64 * 4 * (p + 1)) / bw,
               (2 * (30 * layer + 576 * 49152) + 4 * 9 * 64 * 30 * (p + 1)) / mm)
    assert perf.rollout_floor_s(s, [p], [2], matmul=mm, memcpy=bw, dtype_bytes=4) == pytest.approx(prefill + step)
    # GRPO's rows sharing a prompt: the shared floor prefills it once, the per-row floor once per row
    assert perf.rollout_floor_s(s, [p, p], [1, 1], matmul=mm, memcpy=bw, dtype_bytes=4) == pytest.approx(2 * prefill)
    assert perf.rollout_floor_s(s, [p, p], [1, 1], matmul=mm, memcpy=bw, dtype_bytes=4,
                                prefill_lengths=[p]) == pytest.approx(prefill)
