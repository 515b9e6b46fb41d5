"""megatron-core actor / critic on CPU against transformers' LlamaForCausalLM, HF import / export,
optimizer step against torch AdamW, parallel layout checks.

The reference for every numeric check is an independent implementation: transformers'
LlamaForCausalLM (run in float64 for logits), torch.optim.AdamW for the optimizer step.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

torch.set_num_threads(1)

from safetensors.torch import load_file  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from pfppo_mega import parallel  # noqa: E402
from pfppo_mega.compat import megatron_cpu  # noqa: E402
from pfppo_mega.config.tree import ModelConfig  # noqa: E402
from pfppo_mega.models import gpt, hf_io  # noqa: E402

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 48, 64, 2, 4, 2, 128
ROPE_THETA, EPS, MAX_POS = 5000.0, 1e-5, 64


@pytest.fixture(scope="module", autouse=True)
def parallel_world():
    info = parallel.init_parallel(tp=1, pp=1, seed=1234)
    yield info
    parallel.destroy_parallel()
    megatron_cpu.disable()


def _random_llama(tied: bool, seed: int) -> LlamaForCausalLM:
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, intermediate_size=FFN, max_position_embeddings=MAX_POS,
        rms_norm_eps=EPS, rope_theta=ROPE_THETA, tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    # Larger-than-init weights so logits are O(1) and a layout error cannot hide in small numbers.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    return model.eval()


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def hf_ckpt(request, tmp_path_factory):
    tied = request.param
    model = _random_llama(tied, seed=7 + tied)
    path = tmp_path_factory.mktemp(f"llama_{'tied' if tied else 'untied'}")
    model.save_pretrained(path)
    return path, model, tied


def _model_cfg(path) -> ModelConfig:
    return hf_io.model_config_from_hf(hf_io.read_hf_config(path), ModelConfig())


def _loaded_actor(path):
    cfg = _model_cfg(path)
    actor = gpt.build_actor(cfg)
    hf_io.load_actor_from_hf(actor, path)
    return cfg, actor.eval()


# ----------------------------------------------------------------------------- forward vs transformers


def test_model_config_filled_from_checkpoint(hf_ckpt):
    path, _, tied = hf_ckpt
    cfg = _model_cfg(path)
    assert (cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_attention_heads,
            cfg.num_query_groups, cfg.vocab_size, cfg.max_position_embeddings) == (
        LAYERS, HIDDEN, FFN, HEADS, KV_HEADS, VOCAB, MAX_POS)
    assert cfg.rope_theta == ROPE_THETA and cfg.norm_epsilon == EPS and cfg.tie_word_embeddings is tied


def test_actor_logits_match_transformers(hf_ckpt):
    path, hf_model, tied = hf_ckpt
    _, actor = _loaded_actor(path)
    ids = torch.randint(0, VOCAB, (3, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref64 = hf_model.double()(ids).logits
        hf_model.float()
        ref32 = hf_model(ids).logits.double()
        ours = gpt.actor_logits(actor, ids).double()
    assert ours.shape == (3, 40, VOCAB)
    err = (ours - ref64).abs().max().item()
    hf_err = (ref32 - ref64).abs().max().item()
    print(f"\n[{'tied' if tied else 'untied'}] logits max |megatron fp32 - HF fp64| = {err:.2e} "
          f"(HF fp32 vs fp64: {hf_err:.2e}; logit scale {ref64.abs().max().item():.1f})")
    assert ref64.abs().max() > 1.0  # the check is not on tiny numbers
    assert err < 2e-5
    assert err <= 4 * hf_err + 1e-6


def test_right_padded_rows_match_unpadded(hf_ckpt):
    path, hf_model, _ = hf_ckpt
    _, actor = _loaded_actor(path)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (3, 16), generator=gen)
    lengths = [16, 9, 4]
    mask = torch.zeros(3, 16, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
        ids[row, n:] = 0  # pad token
    with torch.no_grad():
        logits = gpt.actor_logits(actor, ids, mask).double()
        hf64 = hf_model.double()
        for row, n in enumerate(lengths):
            ref = hf64(ids[row:row + 1, :n]).logits[0]
            assert (logits[row, :n] - ref).abs().max().item() < 2e-5, f"row {row} (length {n})"
        hf_model.float()
    left = mask.flip(1)  # left padding: a 1 after a 0
    with pytest.raises(ValueError, match=r"rows \[1, 2\] are not right-padded"):
        gpt.actor_logits(actor, ids, left)


# ----------------------------------------------------------------------------- export


def test_export_round_trip_is_exact(hf_ckpt, tmp_path):
    path, hf_model, tied = hf_ckpt
    cfg, actor = _loaded_actor(path)
    out = tmp_path / "export"
    tokenizer = {"tokenizer.json": b'{"fake": true}'}
    hf_io.export_hf(actor, cfg, out, tokenizer, extra_config={"eos_token_id": 2})
    original, exported = load_file(str(path / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert sorted(exported) == sorted(original)  # tied: lm_head absent on both sides
    assert ("lm_head.weight" in exported) is (not tied)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["eos_token_id"] == 2
    assert config["num_key_value_heads"] == KV_HEADS and config["tie_word_embeddings"] is tied
    assert (out / "tokenizer.json").read_bytes() == tokenizer["tokenizer.json"]
    # transformers reads the export back into the same model.
    reread = LlamaForCausalLM.from_pretrained(out).eval()
    ids = torch.arange(12).reshape(2, 6)
    with torch.no_grad():
        assert torch.equal(reread(ids).logits, hf_model(ids).logits)
    # A second export replaces the first and leaves no temp dirs behind.
    hf_io.export_hf(actor, cfg, out)
    assert not (out / "tokenizer.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_named_params_for_rollout_equal_checkpoint(hf_ckpt):
    path, _, _ = hf_ckpt
    cfg, actor = _loaded_actor(path)
    original = load_file(str(path / "model.safetensors"))
    pairs = list(hf_io.megatron_named_params_to_hf(actor, cfg))
    names = [n for n, _ in pairs]
    assert len(names) == len(set(names)) and sorted(names) == sorted(original)
    for name, tensor in pairs:
        assert not tensor.requires_grad and torch.equal(tensor, original[name]), name


def test_qkv_layout_is_group_interleaved():
    heads, groups, d, hidden = 6, 2, 3, 5
    q = torch.randn(heads * d, hidden)
    k = torch.randn(groups * d, hidden)
    v = torch.randn(groups * d, hidden)
    fused = hf_io.fuse_qkv(q, k, v, heads=heads, groups=groups)
    # Reference written row by row: for each group, its query heads, then its key, then its value.
    rows = []
    per = heads // groups
    for g in range(groups):
        for h in range(g * per, (g + 1) * per):
            rows.append(q[h * d:(h + 1) * d])
        rows.append(k[g * d:(g + 1) * d])
        rows.append(v[g * d:(g + 1) * d])
    assert torch.equal(fused, torch.cat(rows))
    q2, k2, v2 = hf_io.split_qkv(fused, heads=heads, groups=groups)
    assert torch.equal(q2, q) and torch.equal(k2, k) and torch.equal(v2, v)


# ----------------------------------------------------------------------------- critic


def test_critic_values_shape_reference_and_gradients(hf_ckpt):
    path, hf_model, _ = hf_ckpt
    cfg = _model_cfg(path)
    critic = gpt.build_critic(cfg)
    hf_io.load_critic_trunk_from_hf(critic, path)
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 6:] = 0
    assert torch.count_nonzero(gpt.critic_values(critic, ids, mask)) == 0  # zero-initialised head
    with torch.no_grad():
        critic.output_layer.weight.normal_(0.0, 0.5)
    values = gpt.critic_values(critic, ids, mask)
    assert values.shape == (2, 10) and values.dtype == torch.float32
    with torch.no_grad():  # reference: HF final (normed) hidden state times the head vector
        hidden = hf_model.double().model(ids).last_hidden_state
        hf_model.float()
        ref = hidden @ critic.output_layer.weight.double()[0]
    assert (values.double() - ref).abs().max().item() < 2e-5
    (values * mask).sum().backward()
    no_grad = [n for n, p in critic.named_parameters() if p.grad is None or p.grad.abs().sum() == 0]
    assert no_grad == []


# ----------------------------------------------------------------------------- optimizer


def _lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), ids[:, 1:].reshape(-1))


@pytest.mark.parametrize("distributed", [False, True], ids=["adam", "distributed_adam"])
def test_optimizer_step_matches_torch_adamw(tmp_path, distributed):
    hf_model = _random_llama(tied=False, seed=11).float()
    hf_model.save_pretrained(tmp_path)
    cfg, actor = _loaded_actor(tmp_path)
    actor.train()
    lr, wd, clip, eps = 1e-2, 0.1, 0.5, 1e-6
    ddp = gpt.wrap_ddp(actor, use_distributed_optimizer=distributed)
    opt = gpt.build_optimizer(ddp, lr=lr, weight_decay=wd, grad_clip=clip, eps=eps)
    ids = torch.randint(0, VOCAB, (4, 12), generator=torch.Generator().manual_seed(3))

    # Reference: transformers model, clip_grad_norm_, torch AdamW; no decay on 1-D params.
    hf_model.train()
    decay = [p for p in hf_model.parameters() if p.dim() > 1]
    no_decay = [p for p in hf_model.parameters() if p.dim() == 1]
    ref_opt = torch.optim.AdamW([{"params": decay, "weight_decay": wd},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=lr, eps=eps)
    losses = []
    for step in range(3):
        gpt.zero_grads(ddp, opt)
        loss = _lm_loss(gpt.actor_logits(ddp, ids), ids)
        loss.backward()
        stats = gpt.optimizer_step(ddp, opt)
        losses.append(loss.item())

        ref_opt.zero_grad()
        ref_loss = _lm_loss(hf_model(ids).logits, ids)
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(hf_model.parameters(), clip).item()
        ref_opt.step()
        assert stats.update_successful
        assert abs(loss.item() - ref_loss.item()) < 1e-5
        assert abs(stats.grad_norm - ref_norm) < 1e-5 * max(1.0, ref_norm), (stats.grad_norm, ref_norm)

    exported = hf_io.megatron_to_hf(actor.state_dict(), cfg)
    reference = hf_model.state_dict()
    before = load_file(str(tmp_path / "model.safetensors"))
    worst = max((exported[n] - reference[n]).abs().max().item() for n in exported)
    moved = min((exported[n] - before[n]).abs().max().item() for n in exported)
    print(f"\n[{'distributed' if distributed else 'plain'}] 3 AdamW steps: max |megatron - torch AdamW| = "
          f"{worst:.2e}, smallest per-tensor max change {moved:.2e}; loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    assert moved > lr  # every tensor changed
    assert worst < lr / 50  # well below the per-step update size (~lr)
    assert losses[-1] < losses[0]


def test_bf16_training_step_runs_and_lowers_loss(hf_ckpt):
    path, _, _ = hf_ckpt
    cfg = hf_io.model_config_from_hf(hf_io.read_hf_config(path), ModelConfig(params_dtype="bfloat16"))
    actor = gpt.build_actor(cfg)
    hf_io.load_actor_from_hf(actor, path)
    assert actor.embedding.word_embeddings.weight.dtype == torch.bfloat16
    ddp = gpt.wrap_ddp(actor)
    opt = gpt.build_optimizer(ddp, lr=3e-3, weight_decay=0.0, grad_clip=1.0)
    ids = torch.randint(0, VOCAB, (4, 12), generator=torch.Generator().manual_seed(4))
    losses = []
    for _ in range(4):
        gpt.zero_grads(ddp, opt)
        logits = gpt.actor_logits(ddp, ids)
        assert logits.dtype == torch.float32  # Float16Module returns fp32 logits
        loss = _lm_loss(logits, ids)
        loss.backward()
        assert gpt.optimizer_step(ddp, opt).update_successful
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses


def test_build_optimizer_requires_ddp(hf_ckpt):
    path, _, _ = hf_ckpt
    actor = gpt.build_actor(_model_cfg(path))
    with pytest.raises(TypeError, match="wrap_ddp"):
        gpt.build_optimizer(actor, lr=1e-3, weight_decay=0.0, grad_clip=1.0)


# ----------------------------------------------------------------------------- config and checkpoint errors


def test_config_mismatch_lists_every_field(hf_ckpt):
    path, _, _ = hf_ckpt
    hf_cfg = hf_io.read_hf_config(path)
    base = ModelConfig(hidden_size=32, num_layers=LAYERS, rope_theta=10000.0)
    with pytest.raises(ValueError) as e:
        hf_io.model_config_from_hf(hf_cfg, base)
    msg = str(e.value)
    assert "hidden_size: config 32, checkpoint 64" in msg
    assert "rope_theta: config 10000.0, checkpoint 5000.0" in msg
    assert "num_layers" not in msg


def test_unsupported_architecture_is_rejected(hf_ckpt):
    path, _, _ = hf_ckpt
    hf_cfg = hf_io.read_hf_config(path)
    bad = dict(hf_cfg, attention_bias=True,
               rope_parameters={"rope_type": "dynamic", "rope_theta": 5000.0, "factor": 8.0})
    with pytest.raises(hf_io.ModelDirError, match=r"attention_bias = True(.|\n)*rope_type = 'dynamic'"):
        hf_io.model_config_from_hf(bad, ModelConfig())


def test_missing_and_malformed_checkpoints(tmp_path, hf_ckpt):
    path, _, _ = hf_ckpt
    with pytest.raises(FileNotFoundError, match="does not exist"):
        hf_io.read_hf_config(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        hf_io.read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text('{"hidden_size": 64,,}')
    with pytest.raises(ValueError, match="not valid JSON"):
        hf_io.read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        hf_io.read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 64}')
    with pytest.raises(ValueError, match="num_hidden_layers, intermediate_size"):
        hf_io.model_config_from_hf(hf_io.read_hf_config(tmp_path), ModelConfig())
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        hf_io.load_hf_state_dict(tmp_path)
    # A tensor of the wrong shape is named with both shapes.
    sd = load_file(str(path / "model.safetensors"))
    sd["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(16, HIDDEN)
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn.k_proj.weight: expected \(32, 64\), found \(16, 64\)"):
        hf_io.hf_to_megatron(sd, _model_cfg(path))
    del sd["model.norm.weight"]
    with pytest.raises(hf_io.ModelDirError, match="lacks tensor.*model.norm.weight"):
        hf_io.hf_to_megatron(sd, _model_cfg(path))


def test_sharded_checkpoint_loads_like_single_file(tmp_path):
    model = _random_llama(tied=False, seed=5)
    model.save_pretrained(tmp_path / "single")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    shards = sorted(p.name for p in (tmp_path / "sharded").glob("model-*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    single = hf_io.load_hf_state_dict(tmp_path / "single")
    sharded = hf_io.load_hf_state_dict(tmp_path / "sharded")
    assert sorted(single) == sorted(sharded) and all(torch.equal(single[k], sharded[k]) for k in single)
    os.remove(tmp_path / "sharded" / shards[-1])
    with pytest.raises(FileNotFoundError, match=shards[-1]):
        hf_io.load_hf_state_dict(tmp_path / "sharded")


def test_tied_checkpoint_into_untied_actor_is_refused(hf_ckpt):
    path, _, tied = hf_ckpt
    cfg = _model_cfg(path)
    other = gpt.build_actor(dataclasses.replace(cfg, tie_word_embeddings=not tied))
    with pytest.raises((KeyError, ValueError), match="output_layer.weight"):
        hf_io.load_actor_from_hf(other, path)


def test_model_shape_mismatch_names_tensor(hf_ckpt):
    path, _, _ = hf_ckpt
    cfg = _model_cfg(path)
    wider = gpt.build_actor(dataclasses.replace(cfg, ffn_hidden_size=FFN * 2))
    with pytest.raises(ValueError, match=r"decoder.layers.0.mlp.linear_fc1.weight: model expects \(512, 64\), checkpoint gives \(256, 64\)"):
        hf_io.load_actor_from_hf(wider, path)


# ----------------------------------------------------------------------------- parallel layout


def test_layout_validation_names_every_factor():
    assert parallel.data_parallel_size(8, 2, 2) == 2
    with pytest.raises(ValueError, match=r"^tp\(2\) \* pp\(2\) = 4 does not divide WORLD_SIZE\(6\)$"):
        parallel.data_parallel_size(6, 2, 2)
    with pytest.raises(ValueError, match=r"tp\(0\)"):
        parallel.data_parallel_size(4, 0, 1)


def test_init_parallel_is_idempotent_and_refuses_a_new_layout(parallel_world):
    assert parallel.init_parallel(tp=1, pp=1, seed=1234) is parallel_world
    assert (parallel_world.world_size, parallel_world.dp, parallel_world.device.type) == (1, 1, "cpu")
    with pytest.raises(RuntimeError, match=r"tp\(1\) pp\(1\).*destroy_parallel"):
        parallel.init_parallel(tp=2, pp=1, seed=1234)


def test_incomplete_launch_environment_is_named(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(RuntimeError, match="MASTER_PORT"):
        parallel._launched_by_env()
