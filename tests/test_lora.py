"""LoRA training of the actor (model.lora, pfppo_mega/models/lora.py): adapters on megatron's linears at TP1
(tensor parallelism: tests/multirank/lora_checks.py through test_lora_tp2_matches_tp1), the reference as the
base with the adapters off, merged weights for engines and exports, PEFT files, and the trainer end to end:
only the adapters change, and a resumed run equals an uninterrupted one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pfppo_mega.config import ConfigError, load_config_dict
from pfppo_mega.config.tree import LoraConfig
from pfppo_mega.models import lora

REPO = Path(__file__).resolve().parents[1]
MULTIRANK = REPO / "tests" / "multirank"
sys.path.insert(0, str(MULTIRANK))
import common  # noqa: E402  (tests/multirank/common.py: tiny checkpoints, one PPO batch)


# ----------------------------------------------------------------------------- config


def test_config_targets_and_refusals():
    assert not LoraConfig().enabled
    assert lora.LoraSpec.of(LoraConfig(rank=8)).targets == ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    assert lora.LoraSpec.of(LoraConfig(rank=8, target_modules=["q_proj", "k_proj", "v_proj", "down_proj"])).targets \
        == ("linear_qkv", "linear_fc2")
    assert lora.LoraSpec.of(LoraConfig(rank=4, alpha=8)).scale == 2.0
    for bad, words in ((dict(target_modules=["q_proj", "v_proj"]), "without k_proj"),
                       (dict(target_modules=["gate_proj"]), "without up_proj"),
                       (dict(target_modules=["lm_head"]), "unknown module name"),
                       (dict(rank=-1), "rank"), (dict(alpha=0.0), "alpha"), (dict(dropout=0.1), "dropout"),
                       (dict(init_a="normal"), "init_a"), (dict(exclude_modules=["("]), "regular expression")):
        with pytest.raises(ConfigError, match=words):
            LoraConfig(**{"rank": 8, **bad})


def test_exclude_modules_refuses_half_a_fused_linear():
    spec = lora.LoraSpec.of(LoraConfig(rank=4, exclude_modules=[r"layers\.1\.mlp"]))
    assert spec.excluded(1, "linear_fc1") and not spec.excluded(0, "linear_fc1")
    half = lora.LoraSpec.of(LoraConfig(rank=4, exclude_modules=[r"\.q_proj$"]))
    with pytest.raises(lora.LoraError, match="part of the fused"):
        half.excluded(0, "linear_qkv")


# ----------------------------------------------------------------------------- the adapters at TP1


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    yield from common.tp1_world(tmp_path_factory.mktemp("lora"))


def _actor(path: Path, rank: int = 4, **lora_keys):
    from pfppo_mega.models import gpt, hf_io

    cfg, arch = common.model_config(path)
    actor = gpt.build_actor(cfg, arch=arch)
    hf_io.load_actor_from_hf(actor, path)
    spec = lora.apply(actor, LoraConfig(rank=rank, alpha=8.0, **lora_keys), seed=3)
    return actor, cfg, spec


def _randomise_b(actor, seed: int = 5) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, m in lora.adapted(actor):
            m.lora_B.copy_(0.2 * torch.randn(m.lora_B.shape, generator=g))


@pytest.mark.parametrize("kind", common.CHECKPOINTS)
def test_step0_is_the_base_and_merged_weights_are_what_the_adapters_compute(world, kind, tmp_path):
    """B = 0: logits equal the base model's bit for bit. With B moved: the adapters-off model is the base
    again, and the merged weights (gather_hf_weights, what engines and exports get) loaded into
    transformers give the adapted model's logits."""
    import transformers

    from pfppo_mega.models import gpt, hf_io

    ids = common.ppo_batch().inputs.input_ids
    base_model, _, _ = _actor(world[kind], rank=0)
    with torch.no_grad():
        base = gpt.actor_logits(base_model, ids, gather_vocab=True).clone()
    actor, cfg, spec = _actor(world[kind])
    assert spec is not None and len(list(lora.adapted(actor))) == 4 * common.LAYERS
    with torch.no_grad():
        assert torch.equal(gpt.actor_logits(actor, ids, gather_vocab=True), base)
        _randomise_b(actor)
        adapted = gpt.actor_logits(actor, ids, gather_vocab=True).clone()
        with lora.adapters_off(actor):
            assert torch.equal(gpt.actor_logits(actor, ids, gather_vocab=True), base)
    assert (adapted - base).abs().max() > 0.1
    hf_io.export_hf(actor, cfg, tmp_path / "merged")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).float().eval()
    with torch.no_grad():
        theirs = hf(ids).logits
    assert (theirs - adapted[..., :theirs.shape[-1]]).abs().max() < 1e-4
    names = {n for n, _ in hf_io.gather_hf_weights(actor, cfg)}
    assert names == {n for n, _ in hf_io.gather_hf_weights(base_model, cfg)}  # no adapter reaches an engine


def test_only_adapters_train_and_reach_the_optimizer(world):
    from pfppo_mega.models import gpt, passes

    actor, _, _ = _actor(world["llama"])
    frozen = {n for n, p in actor.named_parameters() if not p.requires_grad}
    assert frozen == {n for n, _ in actor.named_parameters() if not lora.is_adapter(n)}
    model = gpt.wrap_ddp(actor)
    opt = gpt.build_optimizer(model, lr=1e-2, weight_decay=0.01, grad_clip=1.0)
    stepped = {id(p) for g in opt.param_groups for p in g["params"]}
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == lora.adapter_numel(actor)
    assert all(id(p) not in stepped for n, p in actor.named_parameters() if n in frozen)
    before = {n: p.detach().clone() for n, p in actor.named_parameters()}
    model.train()
    batch = common.ppo_batch()
    res = passes.train_step(model, opt, batch.inputs, common.actor_loss(batch), temperature=1.0, micro_batch_size=3)
    assert res.update_successful and res.grad_norm > 0
    changed = {n for n, p in actor.named_parameters() if not torch.equal(p, before[n])}
    assert {n for n in before if n.endswith(".lora_B")} <= changed  # B = 0 has a gradient; A moves by decay
    assert not changed & frozen


def test_peft_export_and_load_round_trip(world, tmp_path):
    """export_peft writes PEFT's layout (per projection: the shared A, its rows of B); load_peft puts the
    same adapters back into a fresh actor, whose logits then equal the exported one's."""
    from pfppo_mega.models import gpt

    actor, _, spec = _actor(world["qwen2"])
    _randomise_b(actor)
    lora.export_peft(actor, spec, tmp_path / "adapter", base="tiny")
    cfg_file = json.loads((tmp_path / "adapter" / lora.PEFT_CONFIG).read_text())
    assert cfg_file["r"] == 4 and cfg_file["lora_alpha"] == 8.0 and "q_proj" in cfg_file["target_modules"]
    tensors = lora.read_peft_tensors(tmp_path / "adapter")
    key = "base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"
    assert tensors[key].shape == (common.HIDDEN // common.HEADS * common.KV_HEADS, 4)
    assert len(tensors) == common.LAYERS * 7 * 2
    again, _, _ = _actor(world["qwen2"], rank=0, adapter_path=str(tmp_path / "adapter"))   # rank from the file
    ids = common.ppo_batch().inputs.input_ids
    with torch.no_grad():
        assert torch.equal(gpt.actor_logits(again, ids), gpt.actor_logits(actor, ids))


# ----------------------------------------------------------------------------- tensor parallelism


def test_lora_tp2_and_pp2_match_tp1(tmp_path):
    """One 2-process launch (tests/multirank/lora_checks.py): at tp2 the logits and every adapter's
    gradient (gathered) equal TP1's; at pp2 one optimizer step leaves the same adapters and the base
    untouched. The TP1 reference runs in the launch too (its own world before the layouts)."""
    common.hf_model("llama").save_pretrained(tmp_path / "llama")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), str(MULTIRANK)]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(MULTIRANK / "lora_checks.py"), str(tmp_path / "llama")]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    print(out)
    assert proc.returncode == 0, err[-4000:]
    results = [line for line in out.splitlines() if line.startswith("RESULT")]
    expected = {"tp2 logits", "tp2 grads", "pp2 step", "pp2 base_frozen", "tp2 merged_export", "tp2 ledger_count",
                "dp2 distributed_optimizer_step", "tp2 step"}
    assert {" ".join(line.split()[1:3]) for line in results} == expected, results
    assert all(" PASS " in line for line in results), results


# ----------------------------------------------------------------------------- the trainer end to end

_LORA = {"lora": {"rank": 4, "alpha": 16.0}}
_GRPO = {"adv_estimator": "grpo"}
_LOG = {"eval_interval": 2, "log_interval": 1, "tensorboard": False, "plots": False, "progress": False}


@pytest.fixture(scope="module")
def sft_small(tmp_path_factory):
    from pfppo_mega.sft import run_sft
    from test_trainer import TINY

    out = tmp_path_factory.mktemp("sft_small")
    d = json.loads(json.dumps(TINY))
    d["sft"].update(output_dir=str(out), steps=20, max_seconds=0)
    d["actor_rollout"] = {"model_path": str(out)}
    run_sft(load_config_dict(d), log=lambda *_: None)
    return out


def test_grpo_with_lora_trains_only_the_adapters_and_resumes_exactly(sft_small, tmp_path):
    """A GRPO run with LoRA: no reference copy and no critic are built, the optimizer holds the adapters
    alone, after 4 steps every base weight is bit-identical to the checkpoint's while the adapters (and the
    KL to the reference, the base: exactly 0 at step 1) moved; 2 steps + a resumed 2 equal 4 straight
    (metrics and weights)."""
    from test_trainer import _cfg
    from test_trainer_resume import resume_comparison

    from pfppo_mega.trainer.loop import PPOTrainer

    def records_and_weights(tr, res):  # no critic here
        recs = [json.loads(line) for line in open(res.metrics_path)]
        return recs, {k: v.clone() for k, v in tr.run.models.actor.state_dict().items() if isinstance(v, torch.Tensor)}

    def trainer(sub: str, steps: int):
        return PPOTrainer(_cfg(tmp_path / sub, sft_small, model=_LORA, algorithm=_GRPO, logging=_LOG,
                               actor_rollout={"n_samples_per_prompt": 4},
                               training={"total_training_steps": steps, "rollout_batch_size": 8, "batch_size": 32},
                               checkpoint={"save_interval": 0, "export_hf": True}),
                          log=lambda *_: None)

    tr = trainer("a", 4)
    assert tr.run.models.ref is None and tr.run.models.critic is None
    actor = tr.run.models.actor
    before = {n: p.detach().clone() for n, p in actor.named_parameters()}
    stepped = sum(p.numel() for g in tr.run.models.actor_opt.param_groups for p in g["params"])
    assert stepped == lora.adapter_numel(actor) > 0
    res = tr.fit()
    straight = records_and_weights(tr, res)
    # the export: merged weights as a HF checkpoint, the adapters beside it in PEFT's layout
    assert (res.export_dir / "model.safetensors").is_file()
    assert (tmp_path / "a" / "lora_adapter" / lora.PEFT_CONFIG).is_file()
    assert max(r["rollout/logp_gap_max"] for r in straight[0] if "rollout/logp_gap_max" in r) < 1e-3  # merged refit
    after = dict(actor.named_parameters())
    base_same = [n for n in before if not lora.is_adapter(n) and torch.equal(before[n], after[n])]
    assert len(base_same) == len([n for n in before if not lora.is_adapter(n)])
    assert any(not torch.equal(before[n], after[n]) for n in before if n.endswith(".lora_B"))
    kl = [r["kl/ref_k1"] for r in straight[0] if "kl/ref_k1" in r]
    print("KL to the reference (the base) per step:", kl)
    # B = 0 at step 1: the policy is the base exactly; once an update moved B (a step whose groups all
    # agree moves nothing), the policy leaves the reference
    assert len(kl) == 4 and kl[0] == 0.0 and any(k != 0.0 for k in kl[1:]), kl

    from pfppo_mega.trainer.checkpoint import resume
    saved = resume.tensor_state(actor)  # what a checkpoint holds of the actor: the adapters (the base is model_path's)
    assert saved and all(lora.is_adapter(k) for k in saved) and sum(v.numel() for v in saved.values()) == stepped

    trainer("b", 2).fit()
    resumed = trainer("b", 4)
    assert resumed.step == 2
    differ, n, max_diff = resume_comparison(straight, records_and_weights(resumed, resumed.fit()))
    assert not differ, differ[:10]
    assert max_diff == 0.0


# ----------------------------------------------------------------------------- the ledger and the planner


def test_ledger_counts_the_adapters_this_build_makes(world):
    """ledger.lora_param_count equals the adapter parameters the builder makes (TP1 here; tp2 in the
    multi-rank launch), and its arithmetic for every target subset."""
    from pfppo_mega import ledger
    from pfppo_mega.families import DecoderShape

    for targets in (["all-linear"], ["q_proj", "k_proj", "v_proj"], ["o_proj", "down_proj"]):
        actor, cfg, spec = _actor(world["llama"], rank=4, target_modules=targets)
        shape = DecoderShape.from_model_config(cfg, actor.architecture)
        assert ledger.lora_param_count(shape, 1, 1, 4, spec.targets) == lora.adapter_numel(actor), targets


def test_the_plan_shows_what_lora_saves():
    """The 70B plan with model.lora.rank 16: no reference copy, no grads or Adam states of the base, the
    adapters' own states, and so much less trainer memory per GPU."""
    from pfppo_mega import ledger
    from pfppo_mega.config import load_config
    from pfppo_mega.planning.memory import Hardware, Knobs, RunShape, make_plan

    def plan(*overrides):
        cfg = load_config(REPO / "configs" / "70b_pfppo_h100.yaml", list(overrides))
        return make_plan(RunShape.from_config(cfg), Hardware.preset("h100", nodes=8, gpus_per_node=8),
                         Knobs.from_config(cfg))

    full, lo = plan(), plan("model.lora.rank=16")
    names = {h.name: h.bytes for h in lo.holdings[0].trainer}
    full_names = {h.name: h.bytes for h in full.holdings[0].trainer}
    assert not any(n.startswith("reference") for n in names) and any(n.startswith("reference") for n in full_names)
    assert "actor grads (fp32)" not in names and "actor grads (fp32)" in full_names
    lay, run = lo.layout, lo.run
    n = ledger.lora_param_count(run.model, lay.tp, lay.pp, 16, run.lora_targets)
    assert names["actor LoRA adapters grads (fp32)"] == 4 * n
    saved = sum(full_names.values()) - sum(names.values())
    print(f"70B on 8x8 H100, stage 0: trainer holdings {sum(full_names.values()) / 2**30:.1f} GiB full, "
          f"{sum(names.values()) / 2**30:.1f} GiB with LoRA rank 16 ({n / 1e6:.1f} M adapter params per rank)")
    base_state = sum(b for k, b in full_names.items() if k.startswith(("actor grads", "actor optimizer", "reference")))
    assert 0.99 * base_state < saved < base_state  # the base's grads, Adam states and reference copy, less the adapters'
    assert lo.fits() and full.fits()


def test_pf_ppo_pool_snapshots_hold_the_merged_weights(sft_small, tmp_path):
    """PF-PPO with LoRA: the pool captures the actor in the rollout layout, i.e. merged (W + s B A), so a
    switch to a behaviour snapshot needs nothing from the engines; the newest snapshot equals the merged
    weights the export gathers, and differs from the base where the adapters moved."""
    from test_trainer import _cfg

    from pfppo_mega.models import hf_io
    from pfppo_mega.trainer.loop import PPOTrainer

    cfg = _cfg(tmp_path, sft_small, model=_LORA, logging=_LOG, actor_rollout={"n_samples_per_prompt": 4},
               algorithm={**_GRPO, "use_pf_ppo": True, "pool": {"pool_size": 2, "snapshot_interval": 1}},
               training={"total_training_steps": 2, "rollout_batch_size": 8, "batch_size": 32},
               checkpoint={"save_interval": 0})
    tr = PPOTrainer(cfg, log=lambda *_: None)
    tr.fit()
    pool = tr.run.strategies.behaviour.pool
    newest = len(pool.state_meta()["snapshots"]) - 1
    from pfppo_mega.rollout.weights import wire_flat

    wires = {k.split("/", 1)[1]: v for k, v in pool.state_tensors().items() if k.startswith(f"{newest}/")}
    snap = {n: t for i, spec in enumerate(tr.run.colocation.sync.plan)
            for n, t in spec.split(wire_flat(wires[f"bucket.{i}"], spec))}  # one rank: it holds every bucket
    merged = dict(hf_io.gather_hf_weights(tr.run.models.actor, tr.run.models.model_cfg))
    with lora.adapters_off(tr.run.models.actor):
        base = {k: v.clone() for k, v in hf_io.gather_hf_weights(tr.run.models.actor, tr.run.models.model_cfg)}
    assert snap.keys() == merged.keys()
    assert all(torch.equal(snap[k].to(merged[k].dtype), merged[k]) for k in snap)
    moved = [n for n, p in tr.run.models.actor.named_parameters() if n.endswith(".lora_B") and bool(p.detach().any())]
    assert moved, "no adapter moved in 2 steps: nothing to tell merged from base"
    assert any(not torch.equal(snap[k].to(base[k].dtype), base[k]) for k in snap)


# ----------------------------------------------------------------------------- verl's keys


def test_verl_lora_keys_map_with_each_spellings_defaults():
    """verl's two spellings (FSDP: lora_rank, megatron: lora.rank) take their own defaults of alpha (and
    init), written out here and checked against verl's composed defaults; rank 0 maps nothing."""
    from pfppo_mega.config.verl import lora as vl
    from pfppo_mega.config.verl.translate import translate

    defaults = json.loads((REPO / "tests" / "data" / "verl_megatron_defaults.json").read_text())["defaults"]
    m = "actor_rollout_ref.model"
    assert (vl.FSDP_ALPHA, vl.MEGATRON_ALPHA, vl.MEGATRON_INIT) == (16, 32, "xavier")
    assert (defaults[f"{m}.lora_alpha"], defaults[f"{m}.lora.alpha"], defaults[f"{m}.lora.lora_A_init_method"]) \
        == (16, 32, "xavier")

    def lora_keys(*items):
        t = translate([(k, v, "override") for k, v in items])
        return {k: v for k, v in t.values.items() if k.startswith("model.lora")}, [str(p) for p in t.problems]

    assert lora_keys((f"{m}.lora_rank", 64)) == ({"model.lora.rank": 64, "model.lora.alpha": 16.0}, [])
    assert lora_keys((f"{m}.lora.rank", 32)) == (
        {"model.lora.rank": 32, "model.lora.alpha": 32.0, "model.lora.init_a": "xavier"}, [])
    assert lora_keys((f"{m}.lora.rank", 256), (f"{m}.lora.alpha", 512), (f"{m}.lora.lora_A_init_method", "kaiming")) \
        == ({"model.lora.rank": 256, "model.lora.alpha": 512.0, "model.lora.init_a": "kaiming"}, [])
    assert lora_keys((f"{m}.lora_rank", 8), (f"{m}.target_modules", "all-linear"), (f"{m}.exclude_modules", ".*visual.*")) \
        == ({"model.lora.rank": 8, "model.lora.alpha": 16.0, "model.lora.target_modules": ["all-linear"],
             "model.lora.exclude_modules": [".*visual.*"]}, [])
    assert lora_keys((f"{m}.lora_rank", 0), (f"{m}.lora_alpha", 32), (f"{m}.target_modules", ["q_proj"])) == ({}, [])
    assert lora_keys((f"{m}.lora_adapter_path", "/ckpt/adapter")) == ({"model.lora.adapter_path": "/ckpt/adapter"}, [])
    _, problems = lora_keys((f"{m}.lora.rank", 8), (f"{m}.lora.lora_A_init_method", "normal"))
    assert problems and "normal" in problems[0]


def test_a_bad_adapter_path_stops_the_trainer_before_any_step(sft_small, tmp_path):
    """The trainer turns a LoraError into its SetupError (``pfppo train`` prints it and exits 2)."""
    from test_trainer import _cfg

    from pfppo_mega.trainer.build import SetupError
    from pfppo_mega.trainer.loop import PPOTrainer

    cfg = _cfg(tmp_path, sft_small, model={"lora": {"adapter_path": str(tmp_path / "nowhere")}}, logging=_LOG)
    with pytest.raises(SetupError, match="model.lora.adapter_path .*nowhere.*: no such directory"):
        PPOTrainer(cfg, log=lambda *_: None)


def test_an_exported_adapter_with_exclusions_loads_back_by_itself(world, tmp_path):
    """exclude_modules travels in adapter_config.json (PEFT's key), so loading the adapter needs no config."""
    from pfppo_mega.models import gpt

    actor, _, spec = _actor(world["llama"], exclude_modules=[r"layers\.1\.", r"mlp\.linear_fc2"])
    assert len(list(lora.adapted(actor))) == 3 * (common.LAYERS - 1)
    _randomise_b(actor)
    lora.export_peft(actor, spec, tmp_path / "adapter")
    again, _, spec2 = _actor(world["llama"], rank=0, adapter_path=str(tmp_path / "adapter"))
    assert len(list(lora.adapted(again))) == 3 * (common.LAYERS - 1)
    ids = common.ppo_batch().inputs.input_ids
    with torch.no_grad():
        assert torch.equal(gpt.actor_logits(again, ids), gpt.actor_logits(actor, ids))


def test_bf16_adapters_train_with_fp32_main_weights(world):
    """model.params_dtype bfloat16: the adapters are bf16 like the base, megatron's optimizer keeps fp32
    main weights of the adapters alone, and a step moves the adapters only."""
    import dataclasses

    from pfppo_mega.models import gpt, hf_io, passes

    cfg, arch = common.model_config(world["llama"])
    cfg = dataclasses.replace(cfg, params_dtype="bfloat16")
    actor = gpt.build_actor(cfg, arch=arch)
    hf_io.load_actor_from_hf(actor, world["llama"])
    lora.apply(actor, LoraConfig(rank=4, alpha=8.0), seed=3)
    assert all(p.dtype == torch.bfloat16 for p in actor.parameters())
    model = gpt.wrap_ddp(actor)
    opt = gpt.build_optimizer(model, lr=1e-2, weight_decay=0.0, grad_clip=1.0)
    inner = [o.optimizer for o in getattr(opt, "chained_optimizers", [opt])]
    mains = [p for o in inner for g in o.param_groups for p in g["params"]]
    assert all(p.dtype == torch.float32 for p in mains) and sum(p.numel() for p in mains) == lora.adapter_numel(actor)
    before = {n: p.detach().clone() for n, p in actor.named_parameters()}
    model.train()
    batch = common.ppo_batch()
    res = passes.train_step(model, opt, batch.inputs, common.actor_loss(batch), temperature=1.0, micro_batch_size=4)
    assert res.update_successful
    changed = {n for n, p in actor.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(lora.is_adapter(n) for n in changed)
