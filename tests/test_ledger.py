"""The device-memory ledger of the colocated step (pfppo_mega/ledger.py): the trainer enters every phase
as its code runs it and the ledger checks the predicted device bytes against the card; `pfppo plan`
computes its figures from the same ledger. On CPU the card is simulated (generation.SimulatedCard:
the GPU run's holdings, vLLM sleeping, KV = gpu_memory_utilization x card): the trainer's real order
fits a card just large enough for it, and one moved call overflows it."""

from __future__ import annotations

import dataclasses
import json
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from pfppo_mega import ledger
from pfppo_mega.config import load_config
from pfppo_mega.ledger import BUILD_ORDER, STEP_ORDER, Ledger, LedgerOverflow, min_capacity
from pfppo_mega.planning.cli import main as plan_main
from pfppo_mega.planning.memory import Hardware, Knobs, RunShape, make_plan
from pfppo_mega.trainer.colocation import generation
from pfppo_mega.trainer.colocation.generation import Generation, SimulatedCard
from pfppo_mega.trainer.loop import PPOTrainer

from test_trainer import _cfg, sft_dir  # noqa: F401  (the module's SFT checkpoint fixture)

REPO = Path(__file__).resolve().parents[1]
CONFIGS_70B = sorted((REPO / "configs").glob("70b*.yaml"))


def test_refit_constants_are_the_streams():
    from pfppo_mega.rollout import refit, weights

    assert (ledger.REFIT_MAX_AHEAD, ledger.REFIT_AHEAD_BYTES) == (refit.MAX_AHEAD, refit.AHEAD_BYTES)
    assert ledger.REFIT_TRAILER_BYTES == weights.TRAILER_BYTES
    from pfppo_mega.rollout import vllm

    assert ledger.KV_BLOCK == vllm.KV_BLOCK


def test_unknown_phase_is_refused():
    cfg = load_config(CONFIGS_70B[0])
    plan = make_plan(RunShape.from_config(cfg), Hardware.preset("h200", nodes=8, gpus_per_node=8), Knobs.from_config(cfg))
    with pytest.raises(ValueError, match="ledger phase 'nap' must be one of"):
        Ledger(plan.holdings[0], None).enter("nap")


# ----------------------------------------------------------------------------- the plan reads the ledger


@pytest.mark.parametrize("path", CONFIGS_70B, ids=lambda p: p.stem)
def test_plan_agrees_with_the_ledger_to_the_byte(path, tmp_path, capsys):
    """`pfppo plan` on each 70B config: its training / rollout budgets and its per-phase table are the
    ledger's records, byte for byte. The replay uses the same Ledger, so this checks the CLI's wiring
    only; the bytes themselves are checked against a built trainer's tensors in
    test_plan_holdings_equal_the_bytes_of_the_built_trainer."""
    cfg = load_config(path)
    gpu = "h100" if path.stem.endswith("h100") else "h200"
    report = tmp_path / "plan.json"
    assert plan_main([str(path), "--gpu", gpu, "--ledger", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    plan = json.loads(report.read_text())
    hw = Hardware.preset(gpu, nodes=8, gpus_per_node=8)
    knobs = Knobs.from_config(cfg)
    run = RunShape.from_config(cfg)
    lay = ledger.Layout.for_world(hw.world_size, run.tp, run.pp)
    for k, stage in enumerate(plan["ledger"]):
        h = ledger.rank_holdings(run, knobs, lay, k, cfg.actor_rollout.tensor_model_parallel_size,
                                 gpus_per_node=8, nodes=8)
        mine = Ledger(h, hw.gpu_memory).replay(BUILD_ORDER + STEP_ORDER)  # checks: a phase over the card raises
        assert [p["phase"] for p in stage["phases"]] == list(BUILD_ORDER + STEP_ORDER)
        for got, want in zip(stage["phases"], mine):
            assert got["device_bytes"] == int(want.device_bytes) and got["host_bytes"] == int(want.host_bytes)
        train = plan["gpu_train_phase"][k]
        update = next(r for r in mine if r.phase == "update")
        assert sum(c["bytes"] for c in train["components"]) == sum(int(x.bytes) for x in update.device)
    worst = plan["worst_stage"]
    generate = next(p for p in plan["ledger"][worst]["phases"] if p["phase"] == "generate")
    assert sum(c["bytes"] for c in plan["gpu_rollout_phase"]["components"]) == generate["device_bytes"]
    assert "ledger, pipeline stage 0" in out and "wake kv cache" in out


@pytest.mark.parametrize("path", CONFIGS_70B, ids=lambda p: p.stem)
def test_the_refit_slots_leave_the_device_when_the_engine_sleeps(path):
    """The refit stream's ring (2 x the bf16 embedding at 70B) is on the device from the frame's
    refit to its sleep, never beside the trainer's states in prepare and update: those rows hold
    the trainer's states, the phase's activations and the reserve, nothing else."""
    cfg = load_config(path)
    gpu = "h100" if path.stem.endswith("h100") else "h200"
    run = RunShape.from_config(cfg)
    plan = make_plan(run, Hardware.preset(gpu, nodes=8, gpus_per_node=8), Knobs.from_config(cfg))
    for h, recs in zip(plan.holdings, plan.ledger):
        assert h.refit_slots.bytes >= 2 * 2 * run.model.vocab_size * run.model.hidden_size  # 2 x the bf16 embedding
        steps = recs[len(BUILD_ORDER):]
        held = [r.phase for r in steps if h.refit_slots.name in {x.name for x in r.device}]
        assert held == ["refit", "offload actor weights", "wake kv cache", "generate"], held
        trainer = sum(x.bytes for x in h.trainer)
        for r in steps[-2:]:
            assert r.phase in ("prepare", "update")
            extra = h.prepare.bytes if r.phase == "prepare" else h.update.bytes
            assert r.device_bytes == trainer + extra + h.reserve.bytes, (r.phase, r.device_bytes)


# ----------------------------------------------------------------------------- the trainer enters it


def _sections():
    return dict(training={"total_training_steps": 2, "offload_during_rollout": True},
                logging={"kl_probe_size": 8, "eval_interval": 1},
                algorithm={"use_pf_ppo": True, "pool": {"pool_size": 2, "snapshot_interval": 1}})


@contextmanager
def _card(monkeypatch, capacity: int):
    monkeypatch.setattr(generation, "SIMULATED_CARD", SimulatedCard(capacity))
    yield


def _wake_first(self, step: int, *, refit: bool):
    """The colocated frame with the old bug moved in: the engine wakes (weights and KV cache) before
    the trainer's states leave the device."""
    self.engine.wake_up()
    self.record("wake weights")
    self.record("wake kv cache")
    self.offload.offload("early")
    self.record("offload trainer")
    if refit:
        self.ensure_current(step)
    self.offload.offload("late")
    self.record("offload actor weights")
    try:
        yield
    finally:
        self.engine.sleep()
        self.record("sleep")
        self.offload.reload()
        self.record("reload trainer")


def test_the_trainer_fits_its_card_and_a_moved_call_overflows_it(sft_dir, tmp_path, monkeypatch):  # noqa: F811
    # 1. the holdings of this run on a card too large to matter: the smallest card its order needs
    with _card(monkeypatch, 1 << 50):
        probe = PPOTrainer(_cfg(tmp_path / "probe", sft_dir, **_sections()), log=lambda *_: None)
    h = probe.run.colocation.gen.memory.ledger.h
    card = int(min_capacity(h, BUILD_ORDER + STEP_ORDER)) + 1
    trainer = sum(x.bytes for x in h.trainer)
    print(f"ledger card {card} B: trainer states {trainer:.0f} B, update activations {h.update.bytes:.0f} B, engine "
          f"weights {h.engine_weights.bytes:.0f} B, KV = {h.util} x card")
    assert trainer > (1 - h.util) * card  # why waking before the offload cannot fit: stated, not assumed

    # 2. the trainer's real order, on that card: 2 steps, rollouts, the KL probe and evaluations
    with _card(monkeypatch, card):
        tr = PPOTrainer(_cfg(tmp_path / "fits", sft_dir, **_sections()), log=lambda *_: None)
        tr.fit()
    recs = tr.run.colocation.gen.memory.records
    phases = [r.phase for r in recs]
    assert phases[:len(BUILD_ORDER)] == list(BUILD_ORDER)
    for name in STEP_ORDER + ("switch",):
        assert name in phases, name
    assert max(r.device_bytes for r in recs) <= card
    peak = max(recs, key=lambda r: r.device_bytes)
    print(f"real order: {len(recs)} phases, peak {peak.device_bytes:.0f} B at {peak.phase!r} of {card}")

    # 3. one call moved (the engine wakes before the offload): the ledger refuses at that phase
    monkeypatch.setattr(Generation, "colocated", contextmanager(_wake_first))
    with _card(monkeypatch, card):
        moved = PPOTrainer(_cfg(tmp_path / "moved", sft_dir, **_sections()), log=lambda *_: None)
        with pytest.raises(LedgerOverflow, match=r"phase 'wake (weights|kv cache)' needs .* over by") as e:
            moved.fit()
    print(f"moved call: {e.value}")


def test_predicted_trainer_bytes_match_what_the_trainer_holds(sft_dir, tmp_path):  # noqa: F811
    """The ledger's trainer states against TrainerOffload.device_bytes at every phase of a fp32 run
    (CPU, offload on). Before the first update Adam has no moments yet: short by exactly 8 B x the
    trained parameters; after it, equal up to Adam's step counters; nothing of the trainer on the
    device while the KV cache is awake."""
    tr = PPOTrainer(_cfg(tmp_path, sft_dir, **_sections()), log=lambda *_: None)
    tr.fit()
    h = tr.run.colocation.gen.memory.ledger.h
    moments = 8 * (h.actor_params + h.critic_params)
    worst, stepped, checked = 0.0, False, 0
    for r in tr.run.colocation.gen.memory.records[len(BUILD_ORDER):]:
        predicted, measured = r.trainer_bytes(h), r.measured["trainer_bytes"]
        if r.phase in ("wake kv cache", "generate"):
            assert predicted == measured == 0, r.phase
        elif r.phase in ("reload trainer", "prepare", "update") and not stepped:
            assert predicted - measured == moments, (r.phase, predicted, measured, moments)
        elif r.phase in ("reload trainer", "prepare", "update"):
            gap = measured - predicted
            worst = max(worst, gap / predicted)
            assert 0 <= gap <= 0.001 * predicted, (r.phase, predicted, measured)
            checked += 1
        stepped = stepped or r.phase == "update"
    assert checked >= 4
    print(f"trainer bytes on the device, after the first update: measured exceeds predicted by at most "
          f"{worst:.3%} (Adam step counters); before it, short by the {moments} B of Adam moments")


# ----------------------------------------------------------------------------- per-rank work


def test_work_metrics_count_refit_checkpoint_and_host_bytes(sft_dir, tmp_path, monkeypatch):  # noqa: F811
    """work/* per step (one rank): tokens generated = needed, weight bytes received = the full
    plan's bytes x the refits and switches the engine took, checkpoint bytes = what each save
    reported, host bytes held = the offload's host buffers + the pool's shards at the step's end."""
    from pfppo_mega.trainer import loop
    from pfppo_mega.trainer.checkpoint import resume

    reported: list[int] = []
    save = resume.save

    def counted(run, root, **kw):
        out = save(run, root, **kw)
        reported.append(generation.checkpoint_bytes(out))
        return out

    monkeypatch.setattr(loop.resume, "save", counted)
    sections = _sections()
    sections["checkpoint"] = {"save_interval": 1, "resume": False, "export_hf": False}
    tr = PPOTrainer(_cfg(tmp_path, sft_dir, **sections), log=lambda *_: None)
    updates, update_weights = [], tr.run.colocation.engine.update_weights
    monkeypatch.setattr(tr.run.colocation.engine, "update_weights",
                        lambda buckets, version: (updates.append(version), update_weights(buckets, version))[1])
    res = tr.fit()
    recs = [json.loads(line) for line in open(res.metrics_path)]
    steps = [r for r in recs if "work/tokens_generated" in r]
    assert len(steps) == 2
    rest = tr.run.colocation.gen.take_work(tr.run.strategies.behaviour.host_bytes())  # what came after the last record (final eval, save)
    plan_bytes = tr.run.colocation.sync.plan_bytes()
    got = sum(r["work/refit_bytes_received"] + r["work/switch_bytes_received"] for r in steps)
    got += rest.refit_bytes + rest.switch_bytes
    took = len(updates)  # a switch to the snapshot the engine holds already moves nothing
    assert plan_bytes > 0 and got == took * plan_bytes, (got, took, plan_bytes)
    assert all(r["work/tokens_generated"] == r["work/tokens_needed"] > 0 for r in steps)
    written = sum(r["work/checkpoint_bytes_written"] for r in steps) + rest.checkpoint_bytes
    assert len(reported) == 2 and written == sum(reported) > 0, (written, reported)
    # the loop logs a step's record before it saves: step 1's save is in step 2's record, step 2's after
    assert [r["work/checkpoint_bytes_written"] for r in steps] == [0, reported[0]]
    assert rest.checkpoint_bytes == reported[1]
    pool = tr.run.strategies.behaviour.pool
    held_pool = sum(t.numel() * t.element_size() for s in pool.snapshots for _, t in s.tensors)
    held_offload = sum(t.numel() for t in tr.run.colocation.offload._host)
    assert rest.host_bytes == held_pool + held_offload and held_pool > 0 and held_offload > 0
    assert steps[-1]["work/host_bytes_held"] > 0
    print(f"work per step: tokens {[r['work/tokens_generated'] for r in steps]}, weight bytes received "
          f"{[r['work/refit_bytes_received'] + r['work/switch_bytes_received'] for r in steps]} ({took} updates x "
          f"{plan_bytes} B in all), checkpoint bytes {[r['work/checkpoint_bytes_written'] for r in steps]} "
          f"(+ {rest.checkpoint_bytes} after the last record), host bytes held {[r['work/host_bytes_held'] for r in steps]}")


def test_on_cuda_the_recorder_puts_allocated_and_the_phase_peak_next_to_the_prediction(monkeypatch):
    """The CUDA branch of MemoryRecorder.enter, with torch.cuda's counters faked (no GPU here):
    memory_allocated at each transition, max_memory_allocated since the previous one filled into
    that phase's record, the peak counter reset at every transition."""
    import torch

    cfg = load_config(CONFIGS_70B[0])
    plan = make_plan(RunShape.from_config(cfg), Hardware.preset("h200", nodes=8, gpus_per_node=8), Knobs.from_config(cfg))
    state = {"allocated": 0, "peak": 0, "resets": 0}

    def reset(device=None):
        state["resets"] += 1
        state["peak"] = state["allocated"]

    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: state["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: state["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)

    class Offload:
        def device_bytes(self):
            return 123

    rec = generation.MemoryRecorder(Ledger(plan.holdings[0], plan.hardware.gpu_memory), Offload(), torch.device("cuda"))
    for i, phase in enumerate(BUILD_ORDER):
        state["allocated"] = 1000 * i
        rec.enter(phase)
        state["peak"] = 1000 * i + 500  # what the phase reached before the next transition
    got = [(r.measured["cuda_allocated"], r.measured.get("cuda_peak")) for r in rec.records]
    assert got == [(1000 * i, 1000 * i + 500) for i in range(len(BUILD_ORDER) - 1)] + [(1000 * (len(BUILD_ORDER) - 1), None)]
    assert state["resets"] == len(BUILD_ORDER) and all(r.measured["trainer_bytes"] == 123 for r in rec.records)


def test_a_reward_model_stays_on_the_gpu_through_the_offload():
    """TrainerOffload moves the actor, critic and reference; a reward model's weights stay: the
    ledger keeps them on the device while the engine generates, and the plan's rollout budget says so."""
    from pfppo_mega.families import DecoderShape

    rm = DecoderShape(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                      num_query_groups=8, vocab_size=128256, max_position_embeddings=8192, norm_epsilon=1e-5,
                      tie_word_embeddings=False, rope_theta=500000.0)
    cfg = load_config(CONFIGS_70B[0])
    hw = Hardware.preset("h200", nodes=8, gpus_per_node=8)
    plan = make_plan(RunShape.from_config(cfg, None, rm), hw, Knobs.from_config(cfg))
    h = plan.holdings[0]
    assert h.kept == ("reward model weights (bf16)",)
    generate = next(r for r in plan.ledger[0] if r.phase == "generate")
    on_gpu = {x.name: x.bytes for x in generate.device if x.name in {t.name for t in h.trainer}}
    assert list(on_gpu) == ["reward model weights (bf16)"] and on_gpu["reward model weights (bf16)"] > 0
    kept = {c.name: c.bytes for c in plan.rollout.components}["trainer states kept on the GPU"]
    assert kept == on_gpu["reward model weights (bf16)"]


# ----------------------------------------------------------------------------- the plan against the tensors


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _adam_moments(opt) -> list:
    """The optimizer's state tensors (Adam's two moments per parameter), without step counters."""
    inner = getattr(opt, "optimizer", opt)
    return [v for state in inner.state.values() for k, v in state.items() if torch.is_tensor(v) and k != "step"]


def test_plan_holdings_equal_the_bytes_of_the_built_trainer(sft_dir, tmp_path):  # noqa: F811
    """`pfppo plan`'s holdings (make_plan on the run's config, as the CLI computes them) against the
    tensors of the trainer built from that config, counted here from the tensors themselves after one
    update: actor / critic / reference weights, the fp32 gradient buffers (main_grad), Adam's moments.
    The plan is what the ledger enters, so this checks the ledger's bytes against measured ones."""
    cfg = _cfg(tmp_path, sft_dir, **_sections())
    tr = PPOTrainer(cfg, log=lambda *_: None)
    tr.train_step()  # Adam's moments exist after the first update
    run = tr.run
    plan = make_plan(RunShape.from_config(cfg), Hardware.preset("h100", nodes=1, gpus_per_node=1),
                     Knobs.from_config(cfg))
    planned = {h.name: int(h.bytes) for h in plan.holdings[0].trainer}

    def params(model):
        return list(model.parameters())
    measured = {
        "actor weights (fp32)": _tensor_bytes(params(run.models.actor)),
        "actor grads (fp32)": _tensor_bytes(p.main_grad for p in params(run.models.actor)),
        "actor optimizer (fp32 x2)": _tensor_bytes(_adam_moments(run.models.actor_opt)),
        "critic weights (fp32)": _tensor_bytes(params(run.models.critic)),
        "critic grads (fp32)": _tensor_bytes(p.main_grad for p in params(run.models.critic)),
        "critic optimizer (fp32 x2)": _tensor_bytes(_adam_moments(run.models.critic_opt)),
        "reference weights (fp32)": _tensor_bytes(params(run.models.ref)),
    }
    assert all(p.dtype == torch.float32 for m in (run.models.actor, run.models.critic, run.models.ref) for p in m.parameters())
    assert planned == measured, {k: (planned.get(k), measured.get(k)) for k in set(planned) | set(measured)}
    # and the ledger the trainer entered holds the plan's figures
    assert {h.name: int(h.bytes) for h in run.colocation.gen.memory.ledger.h.trainer} == planned
    print("plan == measured bytes: " + ", ".join(f"{k} {v}" for k, v in measured.items()))
