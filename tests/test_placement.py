"""Every model on its device, by construction: the GPU path checked on the CPU with CUDA mapped to
``meta`` (``megatron_cpu.cuda_on_meta``), not to the CPU.

The CPU compatibility layer makes the host the device, so a tensor a GPU run would leave on the
host is invisible there. Under ``cuda_on_meta`` a tensor made for the device is a meta tensor and
one made without a device is a CPU tensor, exactly as on a GPU machine; nothing computes. For every
shipped config (reduced width, its own dtype and training features) and every family, the
trainer's own builder (``trainer.build.build_models``: actor, reference, critic, their wrappers and
optimizers), the reward model and the built-in engine are built there, and every parameter,
buffer and optimizer tensor must be on the device. On main 41a788e a third of the actor's
parameters (every local-spec norm) and the critic's value head stayed on the host; an H200 run died
in megatron's optimizer build ("Wrapped parameters must be ... torch.cuda.*").

On the CPU itself: the reference computes the actor's logits exactly at step 0 in bf16 (its norms
were fp32 beside bf16 linears), and SFT and the trainer's build run inside the device-check session
(pfppo_mega.trainer.instruments.devicecheck), which tags whatever is made on the host.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from pfppo_mega import parallel
from pfppo_mega.compat import megatron_cpu
from pfppo_mega.config import load_config, load_config_dict
from pfppo_mega.models import gpt, hf_io
from pfppo_mega.trainer.colocation.offload import optimizer_tensors

from test_trainer import TINY, _cfg, sft_dir  # noqa: F401  (the shared tiny SFT checkpoint)

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs").glob("*.yaml")) + sorted((REPO / "configs" / "experiments").glob("*.yaml"))
NO_MODEL = {"article_example.yaml"}  # the shape comes from actor_rollout.model_path alone


def _hf_dir(path: Path, family: str, model, *, tie: bool) -> Path:
    """A random-init Hugging Face checkpoint of ``model``'s (reduced) shape and ``family``."""
    import transformers

    kw = dict(vocab_size=model.vocab_size, hidden_size=model.hidden_size, num_hidden_layers=model.num_layers,
              num_attention_heads=model.num_attention_heads, num_key_value_heads=model.num_query_groups,
              intermediate_size=model.ffn_hidden_size, max_position_embeddings=model.max_position_embeddings,
              rms_norm_eps=model.norm_epsilon, tie_word_embeddings=tie)
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[family]
    extra = {"head_dim": model.hidden_size // model.num_attention_heads} if family == "qwen3" else {}
    torch.manual_seed(0)
    cls[1](cls[0](**kw, **extra)).save_pretrained(path)
    return path


def _reduced(model, family: str):
    heads = model.num_attention_heads
    return dataclasses.replace(model, hidden_size=8 * heads, ffn_hidden_size=16 * heads, vocab_size=128,
                               num_layers=2, tie_word_embeddings=model.tie_word_embeddings and family != "qwen2")


def _off_device(**modules) -> list[str]:
    """'what name device' of every parameter / buffer / optimizer tensor not on meta."""
    bad = []
    for what, m in modules.items():
        if m is None:
            continue
        if isinstance(m, torch.nn.Module):
            named = list(m.named_parameters()) + list(m.named_buffers())
        else:
            named = [(f"state[{i}]", t) for i, t in enumerate(optimizer_tensors(m))]
        bad += [f"{what} {n} {t.device}" for n, t in named if t.device.type != "meta"]
    return bad


ON_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU machine's test: on a GPU the real device is "
                            "checked (scripts/gpu_check.sh, its audit step)")


@pytest.fixture
def gpu_on_meta():
    """A one-process gloo world built as on a GPU machine (par.device is cuda:0 = meta here)."""
    if torch.cuda.is_available():
        pytest.skip("a CPU machine's test: on a GPU the real device is checked (scripts/gpu_check.sh, audit)")
    parallel.destroy_parallel()
    megatron_cpu.enable()
    with megatron_cpu.cuda_on_meta():
        par = parallel.init_parallel(tp=1, pp=1, backend="gloo", seed=1)
        assert par.device == torch.device("cuda", 0) and gpt.resolved(par.device).type == "meta"
        yield par
        parallel.destroy_parallel()


def _build(cfg, model, family: str, tmp_path: Path, par):
    from pfppo_mega.trainer.build import build_models

    ckpt = _hf_dir(tmp_path / family, family, model, tie=model.tie_word_embeddings)
    hf_cfg = hf_io.read_hf_config(ckpt)
    model_cfg = hf_io.model_config_from_hf(hf_cfg, dataclasses.replace(model, **{k: None for k in model.SHAPE_FIELDS}))
    model_cfg = dataclasses.replace(model_cfg, params_dtype=model.params_dtype, layer_spec=model.layer_spec)
    features = gpt.features_from_config(cfg)
    return ckpt, build_models(cfg, model_cfg, hf_io.architecture_from_hf(hf_cfg), features, ckpt, critic=True,
                              device=par.device)


@ON_GPU
def test_cuda_on_meta_maps_the_device_and_not_the_host():
    megatron_cpu.enable()
    with megatron_cpu.cuda_on_meta():
        assert torch.cuda.is_available()
        assert torch.zeros(2, device=torch.cuda.current_device()).device.type == "meta"
        assert torch.zeros(2, device="cuda").device.type == "meta"
        assert torch.zeros(2).cuda().device.type == "meta"
        assert torch.zeros(2).device.type == "cpu"  # no device: the host, as on a GPU machine
        assert torch.zeros(2, dtype=torch.bfloat16, device="cuda").type() == "torch.cuda.BFloat16Tensor"
        assert torch.zeros(2, dtype=torch.bfloat16).type() == "torch.BFloat16Tensor"  # megatron refuses it
    assert not torch.cuda.is_available()


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.relative_to(REPO / "configs").as_posix())
def test_every_config_builds_every_model_on_the_device(path, tmp_path, gpu_on_meta):
    if path.name in NO_MODEL:
        path = REPO / "configs" / "tiny_cpu.yaml"  # its own shape comes from the checkpoint: same builder
    cfg = load_config(path, [])
    features = gpt.features_from_config(cfg)
    cfg = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, fused_layers=features.fused_layers))
    model = _reduced(cfg.model, "llama")
    _, (actor, ref, critic, actor_opt, critic_opt) = _build(cfg, model, "llama", tmp_path, gpu_on_meta)
    bad = _off_device(actor=actor, ref=ref, critic=critic, actor_opt=actor_opt, critic_opt=critic_opt)
    assert not bad, f"{path.name}: on the host on a GPU: {bad[:8]}"
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[model.params_dtype]
    for name, m in (("actor", actor), ("ref", ref), ("critic", critic)):
        assert {p.dtype for p in m.parameters()} == {dtype}, (name, {p.dtype for p in m.parameters()})


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_every_family_builds_on_the_device(family, tmp_path, gpu_on_meta):
    """Qwen2's q/k/v biases, Qwen3's per-head q/k norms (built by megatron's spec without a device)."""
    cfg = load_config(REPO / "configs" / "gpu_check_1b.yaml", [])
    model = _reduced(cfg.model, family)
    _, models = _build(cfg, model, family, tmp_path, gpu_on_meta)
    actor = gpt.unwrap(models[0])
    if family == "qwen3":
        assert any("q_layernorm" in n for n, _ in actor.named_parameters())
    bad = _off_device(actor=models[0], ref=models[1], critic=models[2], actor_opt=models[3], critic_opt=models[4])
    assert not bad, bad[:8]


def test_megatrons_own_norms_are_caught(tmp_path, gpu_on_meta, monkeypatch):
    """What main 41a788e built: the local spec's WrappedTorchNorm and the block's default final norm,
    made with no device. The builder refuses it by name (on a GPU megatron's optimizer died later)."""
    from pfppo_mega.models import fused_layers

    monkeypatch.setattr(fused_layers, "placed_norms", lambda spec: spec)
    monkeypatch.setattr(gpt, "_block", lambda spec, config: spec)
    cfg = load_config(REPO / "configs" / "gpu_check_1b.yaml", [])
    with pytest.raises(gpt.PlacementError, match=r"(?s)build_actor: \d+ tensor\(s\) not on meta.*layernorm.*on cpu"):
        gpt.build_actor(_reduced(cfg.model, "llama"), device=gpu_on_meta.device)


def test_the_value_head_is_made_on_the_device(gpu_on_meta, monkeypatch):
    cfg = load_config(REPO / "configs" / "gpu_check_1b.yaml", [])
    critic = gpt.build_critic(_reduced(cfg.model, "llama"), device=gpu_on_meta.device)
    assert gpt.unwrap(critic).output_layer.weight.device.type == "meta"
    made_on_host = gpt.ValueHead.__init__

    def on_host(self, hidden_size, dtype, device):  # the fault of 41a788e: torch.zeros without a device
        made_on_host(self, hidden_size, dtype, torch.device("cpu"))

    monkeypatch.setattr(gpt.ValueHead, "__init__", on_host)
    with pytest.raises(gpt.PlacementError, match=r"output_layer\.weight .* on cpu"):
        gpt.build_critic(_reduced(cfg.model, "llama"), device=gpu_on_meta.device)


def test_reward_model_and_builtin_engine_on_the_device(tmp_path, gpu_on_meta):
    from pfppo_mega.rewards.model import RewardModel
    from pfppo_mega.trainer.colocation.engine_sync import build_engine

    cfg = load_config(REPO / "configs" / "gpu_check_1b.yaml", [])
    model = _reduced(cfg.model, "llama")
    ckpt = _hf_dir(tmp_path / "rm", "llama", model, tie=False)
    import transformers  # a score model: the trunk and score.weight [1, H]

    hf = transformers.AutoConfig.from_pretrained(ckpt)
    hf.num_labels, hf.pad_token_id = 1, 0
    transformers.LlamaForSequenceClassification(hf).save_pretrained(ckpt)
    rm = RewardModel(ckpt, params_dtype="bfloat16", micro_batch_size=4, eos_id=None, encode=None,
                     log=lambda *_: None)
    assert not _off_device(reward_model=rm.model)
    assert {p.dtype for p in rm.model.parameters()} == {torch.bfloat16}
    hf_cfg = hf_io.read_hf_config(ckpt)
    run_cfg = load_config(REPO / "configs" / "tiny_cpu.yaml", [])
    run_cfg = dataclasses.replace(run_cfg, data=dataclasses.replace(run_cfg.data, max_prompt_length=8),
                                  algorithm=dataclasses.replace(run_cfg.algorithm, max_response_length=8))
    engine = build_engine(run_cfg, ckpt, hf_cfg, pad_token_id=0, world_size=1, device=gpu_on_meta.device,
                          log=lambda *_: None)
    assert not _off_device(engine=engine.model)


def test_reference_logits_equal_the_actors_at_step_0_in_bf16(sft_dir, tmp_path):  # noqa: F811
    """bf16: the reference is built and wrapped as the actor is (Float16Module), every parameter bf16,
    so KL(actor || ref) is exactly 0 before the first update. Main 41a788e left the reference's norms
    fp32 beside bf16 linears: on a GPU torch refuses its fused RMSNorm for mixed dtypes ("Cannot
    dispatch to fused implementation") and the two models round differently."""
    from pfppo_mega.trainer.build import build_models

    parallel.destroy_parallel()
    cfg = _cfg(tmp_path, sft_dir, model={"params_dtype": "bfloat16"}, training={"fused_layers": False})
    par = parallel.init_parallel(tp=1, pp=1, backend="gloo", seed=1)
    hf_cfg = hf_io.read_hf_config(sft_dir)
    model_cfg = hf_io.model_config_from_hf(hf_cfg, cfg.model)
    actor, ref, *_ = build_models(cfg, model_cfg, hf_io.architecture_from_hf(hf_cfg), gpt.features_from_config(cfg),
                                  sft_dir, critic=False, device=par.device)
    ids = torch.randint(1, 16, (4, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = gpt.actor_logits(actor, ids, gather_vocab=True)
        r = gpt.actor_logits(ref, ids, gather_vocab=True)
        assert a.dtype == r.dtype == torch.float32 and torch.equal(a, r)
    for name, m in (("actor", actor), ("reference", ref)):
        assert {p.dtype for p in m.parameters()} == {torch.bfloat16}, (name, {p.dtype for p in m.parameters()})


def test_sft_runs_inside_the_device_check_session(tmp_path):
    """SFT's batches, evaluation prompts and sampling generator on the model's device: the session tags
    what is made on the host, and the first op mixing it with the model raises (41a788e: ids/targets/mask
    and the held-out prompts on the host)."""
    from pfppo_mega.sft import run_sft
    from pfppo_mega.trainer.instruments import devicecheck

    d = json.loads(json.dumps(TINY))
    d["sft"].update(steps=2, output_dir=str(tmp_path / "sft"), min_accuracy=0)
    d["data"]["eval_size"] = 8
    parallel.destroy_parallel()
    with devicecheck.session(torch.device("cpu")) as s:
        out = run_sft(load_config_dict(d), log=lambda *_: None)
    assert (out / "model.safetensors").is_file() and s.collectives >= 0


def test_build_run_inside_the_device_check_session(sft_dir, tmp_path):  # noqa: F811
    """The trainer built inside the session (models, engine, pool, kernels) and a step after it: nothing
    that meets a model was made on the host."""
    from pfppo_mega.trainer.instruments import devicecheck
    from pfppo_mega.trainer.loop import PPOTrainer

    cfg = _cfg(tmp_path, sft_dir, algorithm={"use_pf_ppo": True}, training={"total_training_steps": 1})
    with devicecheck.session(torch.device("cpu")) as s:
        trainer = PPOTrainer(cfg, log=lambda *_: None)
        for name, m in trainer.run.models.trained().items():
            host = [n for n, p in m.named_parameters() if devicecheck.is_host(p)]
            assert not host, (name, host[:5])
        assert not [n for n, p in gpt.unwrap(trainer.run.models.ref).named_parameters() if devicecheck.is_host(p)]
        trainer.train_step()
    assert s.checks > 0
