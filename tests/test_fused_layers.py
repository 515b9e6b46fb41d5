"""The fused decoder layers (training.fused_layers, pfppo_mega/models/fused_layers.py, csrc/cpu/layers.cpp):
each kernel against its pure-torch reference (values and gradients, odd sizes, empty inputs), bad
inputs refused by name, and the whole model against megatron's own layers: logits and every
parameter's gradient for each family (Llama untied, Qwen2 tied with q/k/v biases, Qwen3 q/k RMSNorm,
Llama-3 RoPE scaling), one PPO update ending at the same weights, and where the fused spec is not
used (bf16, off). TP2 / PP2 / DP2 / TP2xPP2 run the fused layers in tests/test_parallel.py's layouts
against transformers' logits (the default is on)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

sys.path.insert(0, str(Path(__file__).resolve().parent / "multirank"))

import common  # noqa: E402

from pfppo_mega.config import ConfigError, load_config_dict  # noqa: E402
from pfppo_mega.kernels import layers as kl  # noqa: E402
from pfppo_mega.kernels import ops as kops  # noqa: E402
from pfppo_mega.models import fused_layers as fl  # noqa: E402
from pfppo_mega.models import gpt, hf_io  # noqa: E402

built = pytest.mark.skipif(not kops.is_built(), reason="pfppo_mega._C is not built (pip install -e .)")


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _grads(fn, inputs, grad_out):
    """fn(*inputs) and the gradients of <fn(*inputs), grad_out> w.r.t. every input."""
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = fn(*leaves)
    out.backward(grad_out)
    return out.detach(), [x.grad for x in leaves]


# ----------------------------------------------------------------------------- kernels


@built
@pytest.mark.parametrize("shape", [(7, 3, 64), (1, 13), (33, 576), (0, 8)])
def test_rms_norm_matches_reference(shape):
    g = _gen(1)
    x = 3 * torch.randn(shape, generator=g)
    w = 1 + 0.5 * torch.randn(shape[-1], generator=g)
    gy = torch.randn(shape, generator=g)
    got, (gx, gw) = _grads(lambda a, b: kl.RMSNormFn.apply(a, b, 1e-5), (x, w), gy)
    ref, (rx, rw) = _grads(lambda a, b: kl.rms_norm_reference(a, b, 1e-5), (x, w), gy)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx, rx, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gw, rw, rtol=1e-4, atol=1e-4)
    if x.numel():
        assert gw.abs().sum() > 0


@built
@pytest.mark.parametrize("shape", [(5, 2, 2 * 96), (3, 2 * 7), (64, 2 * 1536), (0, 4)])
def test_swiglu_matches_reference(shape):
    g = _gen(2)
    h = 4 * torch.randn(shape, generator=g)
    h.view(-1)[:3] = torch.tensor([-200.0, 200.0, 0.0])[: h.numel()]  # saturated sigmoid at both ends
    gy = torch.randn(shape[:-1] + (shape[-1] // 2,), generator=g)
    got, (gh,) = _grads(kl.SwiGLUFn.apply, (h,), gy)
    ref, (rh,) = _grads(kl.swiglu_reference, (h,), gy)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gh, rh, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(gh).all()


@built
@pytest.mark.parametrize("shape", [(11, 3, 4, 64), (5, 2, 2), (9, 1, 3, 24)])
def test_rope_matches_reference(shape):
    g = _gen(3)
    S, D = shape[0], shape[-1]
    x = torch.randn(shape, generator=g)
    angles = torch.arange(S, dtype=torch.float32)[:, None] * torch.rand(D // 2, generator=g).repeat(2)  # [S, D]
    angles[:, -1] += 0.3  # the two halves need not share angles: the kernel reads all D
    gy = torch.randn(shape, generator=g)
    c, s = angles.cos(), angles.sin()
    got, (gx, _, _) = _grads(kl.RopeFn.apply, (x, c, s), gy)
    ref, (rx, _, _) = _grads(kl.rope_reference, (x, c, s), gy)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx, rx, rtol=1e-5, atol=1e-5)


@built
def test_megatron_rope_hook_matches_megatron():
    """The hook's fused path against megatron's own apply_rotary_pos_emb on [S, B, H, D]."""
    from megatron.core.models.common.embeddings import rope_utils

    cfg = gpt.transformer_config(_tiny_model_config(), tp=1, pp=1, device_type="cpu")
    fl.install_rope()
    from megatron.core.transformer import attention

    S, D = 9, cfg.kv_channels
    x = torch.randn(S, 2, 4, D, generator=_gen(4))
    freqs = torch.randn(S, 1, 1, D, generator=_gen(5))
    assert cfg.pfppo_fused_layers
    got = attention.apply_rotary_pos_emb(x, freqs, config=cfg, cp_group=_OneRank())
    ref = rope_utils._apply_rotary_pos_emb_bshd(x, freqs)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


class _OneRank:
    def size(self):
        return 1


def _tiny_model_config():
    from pfppo_mega.config.tree import ModelConfig

    return ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                       vocab_size=51, max_position_embeddings=64, rope_theta=10000.0, norm_epsilon=1e-5,
                       tie_word_embeddings=False)


@built
def test_bad_inputs_are_refused_by_name():
    x = torch.randn(4, 8)
    with pytest.raises(TypeError, match=r"pfppo::rms_norm: x \[\.\.\., E\] must be float32"):
        torch.ops.pfppo.rms_norm(x.double(), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match=r"weight \[E\] must have last dimension 8"):
        torch.ops.pfppo.rms_norm(x, torch.ones(7), 1e-5)
    with pytest.raises(ValueError, match=r"eps must be finite and > 0"):
        torch.ops.pfppo.rms_norm(x, torch.ones(8), 0.0)
    with pytest.raises(ValueError, match=r"x \[\.\.\., E\] must be contiguous"):
        torch.ops.pfppo.rms_norm(torch.randn(8, 4).t(), torch.ones(4), 1e-5)
    with pytest.raises(ValueError, match=r"pfppo::swiglu: h \[\.\.\., 2F\] must have an even last dimension"):
        torch.ops.pfppo.swiglu(torch.randn(3, 5))
    with pytest.raises(ValueError, match=r"grad_y \[\.\.\., F\] must have last dimension 4"):
        torch.ops.pfppo.swiglu_backward(torch.randn(3, 3), torch.randn(3, 8))
    with pytest.raises(ValueError, match=r"pfppo::rope: cos must be \[S, D\] = \[5, 4\]"):
        torch.ops.pfppo.rope(torch.randn(5, 2, 4), torch.randn(4, 4), torch.randn(4, 4), False)
    with pytest.raises(ValueError, match=r"sin must have the shape of cos"):
        torch.ops.pfppo.rope(torch.randn(5, 2, 4), torch.randn(5, 4), torch.randn(4, 4), False)


def test_fallbacks_are_the_references():
    """Tensors the kernels do not take (fp64 here) go through the references, with gradients."""
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    w = torch.ones(8, dtype=torch.float64)
    assert not kl.usable(x)
    torch.testing.assert_close(kl.rms_norm(x, w, 1e-6), kl.rms_norm_reference(x, w, 1e-6))
    h = torch.randn(2, 6, dtype=torch.float64)
    torch.testing.assert_close(kl.swiglu(h), kl.swiglu_reference(h))
    kl.rms_norm(x, w, 1e-6).sum().backward()
    assert x.grad is not None


# ----------------------------------------------------------------------------- the model


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fused")
    gen = common.tp1_world(root)
    paths = next(gen)
    for kind in ("qwen3", "llama3"):
        common.hf_model(kind).save_pretrained(root / kind)
        paths[kind] = root / kind
    yield paths
    next(gen, None)


def _logits_and_grads(path: Path, *, fused: bool, dtype: str = "float32"):
    cfg, arch = common.model_config(path)
    cfg = dataclasses.replace(cfg, params_dtype=dtype)
    actor = gpt.build_actor(cfg, arch=arch, features=gpt.Features(fused_layers=fused))
    hf_io.load_actor_from_hf(actor, path)
    ids = common.family_ids()
    pos = torch.arange(ids.shape[1])[None].expand_as(ids)
    logits = actor(ids, pos, None)  # [B, S, V]
    g = torch.randn(logits.shape, generator=_gen(7), dtype=logits.dtype)
    (logits * g).sum().backward()
    return actor, logits.detach().float(), {n: p.grad.detach().float().clone() for n, p in actor.named_parameters()}


@built
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "llama3"])
def test_model_matches_megatrons_layers(world, kind):
    ref_model, ref, ref_g = _logits_and_grads(world[kind], fused=False)
    got_model, got, got_g = _logits_and_grads(world[kind], fused=True)
    layer = got_model.decoder.layers[0]
    assert isinstance(layer.input_layernorm, fl.FusedRMSNorm)
    assert isinstance(layer.self_attention.core_attention, fl.sdpa_attention_class())
    assert isinstance(layer.mlp.activation_func, fl.FusedSwiGLU)
    if kind == "qwen3":
        assert isinstance(layer.self_attention.q_layernorm, fl.FusedRMSNorm)
    assert not isinstance(ref_model.decoder.layers[0].input_layernorm, fl.FusedRMSNorm)
    assert sorted(ref_model.state_dict()) == sorted(got_model.state_dict())
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=2e-5 * ref.abs().max().item())
    assert sorted(ref_g) == sorted(got_g)
    for name in ref_g:
        scale = max(ref_g[name].abs().max().item(), 1e-12)
        torch.testing.assert_close(got_g[name], ref_g[name], rtol=1e-4, atol=2e-5 * scale,
                                   msg=lambda m: f"{kind} {name}: {m}")
    assert all(g.abs().sum() > 0 for n, g in ref_g.items() if "layernorm" in n)


@built
def test_fused_kernels_run_in_the_model(world, monkeypatch):
    """Each fused piece is called in a forward + backward (not silently the fallback)."""
    calls = {"sdpa": 0}
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counted_sdpa(*a, **k):
        calls["sdpa"] += 1
        return sdpa(*a, **k)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted_sdpa)
    with torch.profiler.profile() as prof:
        _logits_and_grads(world["llama"], fused=True)
    names = {e.key for e in prof.key_averages()}
    for op in ("pfppo::rms_norm", "pfppo::rms_norm_backward", "pfppo::swiglu", "pfppo::swiglu_backward",
               "pfppo::rope"):
        assert op in names, op
    assert calls["sdpa"] == common.LAYERS


def test_not_used_for_bf16_or_when_off(world):
    """CPU bf16 and off: megatron's layers (on GPUs the fused path runs in any dtype:
    tests/test_gpu_layers.py)."""
    cfg, arch = common.model_config(world["llama"])
    assert gpt.fused_layers_active(cfg, gpt.Features(), "cpu")
    assert gpt.fused_layers_active(dataclasses.replace(cfg, params_dtype="bfloat16"), gpt.Features(), "cuda")
    assert not gpt.fused_layers_active(dataclasses.replace(cfg, params_dtype="bfloat16"), gpt.Features(), "cpu")
    assert not gpt.fused_layers_active(cfg, gpt.Features(fused_layers=False), "cpu")
    bf16 = gpt.build_actor(dataclasses.replace(cfg, params_dtype="bfloat16"), arch=arch)
    assert not isinstance(bf16.decoder.layers[0].input_layernorm, fl.FusedRMSNorm)
    assert not bf16.config.use_te_activation_func


@built
def test_ppo_update_ends_at_the_same_weights(world):
    batch = common.ppo_batch()
    for kind in common.CHECKPOINTS:
        results = [common.ppo_update(world[kind], batch, micro_batch_size=3, dp_rank=0, dp=1,
                                     features=gpt.Features(fused_layers=fused)) for fused in (False, True)]
        worst = max((results[1].weights[n] - results[0].weights[n]).abs().max().item() for n in results[0].weights)
        assert worst <= common.LR / 50, (kind, worst)
        assert results[1].actor_loss == pytest.approx(results[0].actor_loss, rel=1e-5, abs=1e-7)
        assert results[1].critic_grad_norm == pytest.approx(results[0].critic_grad_norm, rel=1e-4)


def test_config_key():
    base = {"actor_rollout": {"model_path": "x"}}
    assert load_config_dict(base).training.fused_layers is True
    with pytest.raises(ConfigError, match=r"training.fused_layers"):
        load_config_dict({**base, "training": {"fused_layers": "yes please"}})
    cfg = load_config_dict({**base, "training": {"fused_layers": False}})
    assert gpt.features_from_config(cfg).fused_layers is False
