"""The fused decoder layers' GPU path without Transformer Engine (pfppo_mega/models/fused_layers.py),
checked on the CPU: the torch-op pieces a GPU runs (SwiGLUFn, RopeFn, F.rms_norm, SDPA) against
megatron's formulas three ways (fp64 truth, the same dtype's reference), the whole model on that
path against megatron's own layers (logits and every gradient), the path built and run forward and
backward for the GPU with CUDA mapped to ``meta`` (placement, and the pieces really called), the
choice of layer path given whether TE is installed (it is not here; it is never imported), and the
memory ledger's layer for each choice."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

sys.path.insert(0, str(Path(__file__).resolve().parent / "multirank"))

import common  # noqa: E402

from pfppo_mega.kernels import layers as kl  # noqa: E402
from pfppo_mega.models import fused_layers as fl  # noqa: E402
from pfppo_mega.models import gpt, hf_io  # noqa: E402
from pfppo_mega import ledger  # noqa: E402

from test_fused_layers import _gen, _grads  # noqa: E402
from test_placement import gpu_on_meta  # noqa: E402,F401  (CUDA mapped to meta, a TP1 gloo world)


def _err(a, b) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def _amax(t) -> float:
    return t.abs().max().item() if t.numel() else 0.0


def _three_way(fn, ref, inputs, grad_out, dtype):
    """fn at ``dtype`` against ref in fp64, bounded by 2x ref's own error at ``dtype`` (+ a floor of
    dtype eps), forward and gradients (flash-attention's rule)."""
    truth, tg = _grads(ref, [x.double() for x in inputs], grad_out.double())
    got, gg = _grads(fn, [x.to(dtype) for x in inputs], grad_out.to(dtype))
    same, sg = _grads(ref, [x.to(dtype) for x in inputs], grad_out.to(dtype))
    eps = torch.finfo(dtype).eps
    pairs = [("out", got, same, truth)] + [(f"grad{i}", g, s, t) for i, (g, s, t) in enumerate(zip(gg, sg, tg))]
    for name, g, s, t in pairs:
        bound = 2 * _err(s, t) + eps * _amax(t)
        assert _err(g, t) <= bound, f"{name} {dtype}: |fn - fp64| {_err(g, t):.3g} > bound {bound:.3g}"


# ----------------------------------------------------------------------------- pieces


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 2, 2 * 96), (3, 2 * 7), (0, 4)])
def test_swiglu_fn_matches_megatrons_formula(shape, dtype):
    g = _gen(2)
    h = 4 * torch.randn(shape, generator=g)
    h.view(-1)[:3] = torch.tensor([-200.0, 200.0, 0.0])[: h.numel()]  # saturated sigmoid at both ends
    gy = torch.randn(shape[:-1] + (shape[-1] // 2,), generator=g)
    _three_way(fl.SwiGLUFn.apply, kl.swiglu_reference, [h], gy, dtype)
    if h.numel():
        _, (gh,) = _grads(fl.SwiGLUFn.apply, [h], gy)
        assert torch.isfinite(gh).all() and gh.abs().sum() > 0


def _megatron_rope(t, freqs):
    from megatron.core.models.common.embeddings import rope_utils

    return rope_utils._apply_rotary_pos_emb_bshd(t, freqs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_fn_matches_megatron(dtype, monkeypatch):
    monkeypatch.setattr(fl, "usable", lambda *t: False)  # RopeFn, not the C++ kernel, in fp32 too
    S, D = 11, 64
    x = torch.randn(S, 3, 4, D, generator=_gen(3))
    freqs = torch.arange(S, dtype=torch.float32)[:, None, None, None] * torch.rand(D // 2, generator=_gen(4)).repeat(2)
    gy = torch.randn(x.shape, generator=_gen(5))
    _three_way(lambda t: fl.rope(t, freqs), lambda t: _megatron_rope(t, freqs), [x], gy, dtype)


def test_rope_angles_made_once_per_freqs():
    fl._ANGLES.__init__()
    freqs = torch.rand(6, 1, 1, 8)
    x = torch.randn(6, 2, 2, 8, dtype=torch.float64)
    fl.rope(x, freqs)
    first = fl._ANGLES.by_dtype[torch.float64][0]
    fl.rope(x, freqs)
    assert fl._ANGLES.by_dtype[torch.float64][0] is first  # the second layer reuses them
    freqs.mul_(2)  # the same tensor changed in place: made again
    torch.testing.assert_close(fl.rope(x, freqs), _megatron_rope(x, freqs))
    assert fl._ANGLES.by_dtype[torch.float64][0] is not first


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,groups", [(4, 2), (4, 4), (6, 1)])
def test_sdpa_matches_megatrons_unfused_attention(world, heads, groups, dtype):
    """fused_layers.sdpa (q [s, b, n, d], k / v [s, b, g, d], causal, no mask tensor) against
    megatron's local DotProductAttention (GQA repeat, fp32 softmax, its causal mask)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    model = dataclasses.replace(common_model(), num_attention_heads=heads, num_query_groups=groups,
                                hidden_size=16 * heads)
    cfg = gpt.transformer_config(model, tp=1, pp=1, device_type="cpu", features=gpt.Features(fused_layers=False))
    core = DotProductAttention(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    s, b, d = 9, 2, 16
    q, k, v = (torch.randn(s, b, n, d, generator=_gen(seed)) for seed, n in enumerate((heads, groups, groups)))
    gy = torch.randn(s, b, heads * d, generator=_gen(9))
    _three_way(lambda q, k, v: fl.sdpa(q, k, v, core.softmax_scale),
               lambda q, k, v: core(q, k, v, None), [q, k, v], gy, dtype)


def common_model():
    from pfppo_mega.config.tree import ModelConfig

    return ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                       vocab_size=51, max_position_embeddings=64, rope_theta=10000.0, norm_epsilon=1e-5,
                       tie_word_embeddings=False)


# ----------------------------------------------------------------------------- the model on the GPU path


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gpu_layers")
    gen = common.tp1_world(root)
    paths = next(gen)
    common.hf_model("qwen3").save_pretrained(root / "qwen3")
    paths["qwen3"] = root / "qwen3"
    yield paths
    next(gen, None)


def _logits_and_grads(path: Path, *, fused: bool, ids=None):
    cfg, arch = common.model_config(path)
    actor = gpt.build_actor(cfg, arch=arch, features=gpt.Features(fused_layers=fused))
    hf_io.load_actor_from_hf(actor, path)
    ids = common.family_ids() if ids is None else ids
    pos = torch.arange(ids.shape[1])[None].expand_as(ids)
    logits = actor(ids, pos, None)  # [B, S, V]
    g = torch.randn(logits.shape, generator=_gen(7), dtype=logits.dtype)
    (logits * g).sum().backward()
    return actor, logits.detach(), {n: p.grad.detach().clone() for n, p in actor.named_parameters()}


@pytest.fixture
def gpu_code_path(monkeypatch):
    """The fused layers with the C++ kernels out of reach: every piece takes the code a GPU runs
    (F.rms_norm, SwiGLUFn, RopeFn, SDPA), counted."""
    calls = {"swiglu": 0, "rope": 0, "sdpa": 0}
    monkeypatch.setattr(fl, "usable", lambda *t: False)
    for name, cls in (("swiglu", fl.SwiGLUFn), ("rope", fl.RopeFn)):
        original = cls.apply

        def counted(*a, _o=original, _n=name):
            calls[_n] += 1
            return _o(*a)

        monkeypatch.setattr(cls, "apply", counted)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counted_sdpa(*a, **k):
        assert k.get("attn_mask") is None and k["is_causal"], k  # no s^2 mask tensor
        calls["sdpa"] += 1
        return sdpa(*a, **k)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted_sdpa)
    return calls


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_gpu_code_path_matches_megatrons_layers(world, kind, gpu_code_path):
    ref_model, ref, ref_g = _logits_and_grads(world[kind], fused=False)
    got_model, got, got_g = _logits_and_grads(world[kind], fused=True)
    layers = common.LAYERS
    assert gpu_code_path == {"swiglu": layers, "rope": 2 * layers, "sdpa": layers}, gpu_code_path
    assert sorted(ref_model.state_dict()) == sorted(got_model.state_dict())
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=2e-5 * ref.abs().max().item())
    for name in ref_g:
        scale = max(ref_g[name].abs().max().item(), 1e-12)
        torch.testing.assert_close(got_g[name], ref_g[name], rtol=1e-4, atol=2e-5 * scale,
                                   msg=lambda m: f"{kind} {name}: {m}")


def test_right_padded_rows_need_no_mask(world, gpu_code_path):
    """The token-budget plan's micro-batches are right-padded rows without a mask: causal SDPA keeps
    each real token's logits those of the row alone."""
    ids = common.family_ids()[:1]                                    # [1, S]
    padded = torch.cat([ids, torch.zeros(1, 5, dtype=ids.dtype)], 1)  # [1, S + 5]
    _, alone, _ = _logits_and_grads(world["llama"], fused=True, ids=ids)
    _, with_pad, _ = _logits_and_grads(world["llama"], fused=True, ids=padded)
    torch.testing.assert_close(with_pad[:, : ids.shape[1]], alone, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- which layers


@pytest.mark.parametrize("spec,fused,device,dtype,te,want", [
    ("auto", True, "cuda", "bfloat16", False, "fused"),     # a GPU without TE: the fused path by default
    ("auto", True, "cuda", "bfloat16", True, "transformer_engine"),
    ("auto", False, "cuda", "bfloat16", False, "local"),
    ("auto", True, "cpu", "float32", True, "fused"),        # TE never on the CPU
    ("auto", True, "cpu", "bfloat16", False, "local"),      # CPU bf16: megatron's layers
    ("local", True, "cuda", "float32", True, "fused"),      # local: never TE
    ("local", False, "cuda", "bfloat16", True, "local"),
    ("transformer_engine", True, "cuda", "bfloat16", True, "transformer_engine"),
])
def test_layer_path_choice(spec, fused, device, dtype, te, want):
    assert fl.choose_layer_path(spec, fused_layers=fused, device_type=device, params_dtype=dtype,
                                te_available=te) == want


def test_te_is_absent_here_and_never_imported(world):
    assert not fl.te_importable()
    cfg, arch = common.model_config(world["llama"])
    cfg = dataclasses.replace(cfg, layer_spec="auto")
    assert gpt.layer_path(cfg, gpt.Features(), "cuda") == "fused"
    actor = gpt.build_actor(cfg, arch=arch)
    assert isinstance(actor.decoder.layers[0].input_layernorm, fl.FusedRMSNorm)
    assert "transformer_engine" not in sys.modules
    with pytest.raises(gpt.FeatureError, match=r"model.layer_spec = 'transformer_engine': transformer_engine is "
                                               r"not installed; use 'auto' or 'local'"):
        gpt.check_features(dataclasses.replace(cfg, layer_spec="transformer_engine"), gpt.Features(),
                           device_type="cuda", tp=1)
    with pytest.raises(gpt.FeatureError, match=r"sequence_parallel = true with model.layer_spec = 'auto' resolved "
                                               r"to the 'fused' layers"):
        gpt.check_features(cfg, gpt.Features(sequence_parallel=True), device_type="cuda", tp=2)


@pytest.fixture
def fake_te(monkeypatch):
    """Stand-ins for megatron's TE wrappers (TE is absent here), where fused_layers imports them."""
    import types

    fake = types.ModuleType("megatron.core.extensions.transformer_engine")
    for name in ("TEColumnParallelLinear", "TEDotProductAttention", "TENorm", "TERowParallelLinear"):
        setattr(fake, name, type(name, (), {}))
    monkeypatch.setitem(sys.modules, "megatron.core.extensions.transformer_engine", fake)
    return fake


def test_te_spec_keeps_the_local_names(fake_te):
    """te_layer_spec swaps modules under the local spec's names (TE's own spec renames the input norm
    into linear_qkv)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    fake = fake_te
    for qk in (False, True):
        local = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=qk)
        spec = fl.te_layer_spec(local)
        sub, attn, mlp = spec.submodules, spec.submodules.self_attention.submodules, spec.submodules.mlp.submodules
        assert sub.input_layernorm is sub.pre_mlp_layernorm is fake.TENorm
        assert (attn.linear_qkv, attn.core_attention, attn.linear_proj) == (
            fake.TEColumnParallelLinear, fake.TEDotProductAttention, fake.TERowParallelLinear)
        assert (mlp.linear_fc1, mlp.linear_fc2) == (fake.TEColumnParallelLinear, fake.TERowParallelLinear)
        assert mlp.activation_func.module is fl.FusedSwiGLU
        assert (attn.q_layernorm is fake.TENorm) == qk
        assert set(vars(sub)) == set(vars(local.submodules))  # the same module names, so the same parameters
    assert "transformer_engine" not in sys.modules


def test_where_te_is_installed_the_gpu_build_takes_it(fake_te, monkeypatch):
    """TE installed (pretended): auto picks it on CUDA and the builder asks for TE's attention backend,
    fused RoPE and the spec of te_layer_spec; on the CPU it never does."""
    from types import SimpleNamespace

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    monkeypatch.setattr(fl, "te_importable", lambda: True)
    model = dataclasses.replace(common_model(), params_dtype="bfloat16", layer_spec="auto")
    assert gpt.layer_path(model, gpt.Features(), "cuda") == "transformer_engine"
    assert gpt.layer_path(dataclasses.replace(model, params_dtype="float32"), gpt.Features(), "cpu") == "fused"
    gpt.check_features(model, gpt.Features(sequence_parallel=True), device_type="cuda", tp=2)  # TE's norms take SP
    with pytest.raises(ValueError, match="apply_rope_fusion is not available"):  # megatron: TE's RoPE, without TE
        gpt.transformer_config(model, tp=1, pp=1, device_type="cuda")
    config = SimpleNamespace(pfppo_layer_path="transformer_engine", use_te_activation_func=True)
    spec = gpt._layer_spec(config, get_gpt_layer_local_spec(normalization="RMSNorm"))
    assert spec.submodules.input_layernorm is fake_te.TENorm
    assert spec.submodules.self_attention.submodules.core_attention is fake_te.TEDotProductAttention


def test_ledger_counts_what_the_path_holds():
    """The fused path keeps no s^2 scores; megatron's local one keeps fp32 softmax + bf16 copy."""
    assert ledger.layer_of("auto", True) == ledger.layer_of("local", True) == "fused"
    assert ledger.layer_of("transformer_engine", False) == "fused"
    assert ledger.layer_of("local", False) == ledger.layer_of("auto", False) == "local"
    s, b, h, a, g, f = 4096, 1, 2048, 32, 8, 8192
    fused = ledger.layer_terms_for("fused", s=s, b=b, h=h, a=a, g=g, f=f)
    local = ledger.layer_terms_for("local", s=s, b=b, h=h, a=a, g=g, f=f)
    assert fused.core == 0 and local.core == 6 * a * s * s * b


@pytest.mark.parametrize("b", [1, 2])
def test_fused_layer_saves_what_the_ledger_counts(world, gpu_code_path, b):
    """One decoder layer on the GPU's code path (fp32 on the CPU), the bytes autograd saves for its
    backward, parameters and the layer input excluded: the ledger's layer "fused" in fp32 (every term
    doubled but the fp32 log-sum-exp). As in tests/test_plan.py, torch's CPU rms_norm keeps fp32
    intermediates (counted apart, with the norm inputs) where the formula assumes a fused norm. No
    [b, heads, s, s] scores, no GQA repeat, and SDPA's output is the out-proj's input (a view)."""
    import traceback

    from pfppo_mega.config.tree import ModelConfig

    s, h, a, g, f = 64, 128, 4, 2, 256
    model = ModelConfig(num_layers=1, hidden_size=h, ffn_hidden_size=f, num_attention_heads=a, num_query_groups=g,
                        vocab_size=64, max_position_embeddings=s, rope_theta=10000.0, norm_epsilon=1e-5,
                        tie_word_embeddings=False)
    actor = gpt.build_actor(model)
    assert isinstance(actor.decoder.layers[0].self_attention.core_attention, fl.sdpa_attention_class())
    params = {p.untyped_storage().data_ptr() for p in actor.parameters()}
    x = torch.randn(s, b, h, requires_grad=True)
    saved, norm = {}, {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in params and key != x.untyped_storage().data_ptr():
            in_norm = any(fr.filename.endswith("normalization.py") for fr in traceback.extract_stack())
            (norm if in_norm else saved)[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        actor.decoder.layers[0](x, attention_mask=None, rotary_pos_emb=actor.rotary_pos_emb(s))
    terms = ledger.layer_terms_for("fused", s=s, b=b, h=h, a=a, g=g, f=f)
    lse = 4 * a * s * b
    bf16 = ledger.layer_bytes(terms, tp=1, sp=False, recompute="none", s=s, b=b, h=h)[0]
    expected = 2 * (bf16 - lse - 2 * 2 * s * b * h) + lse  # fp32; the two norm inputs counted apart
    rope = 2 * s * (h // a) * 4                            # cos / sin (fp32 [s, 1, 1, d]), shared by every layer
    measured = sum(saved.values())
    assert measured == expected + rope, (measured, expected + rope, sorted(saved.values()))
    assert sum(norm.values()) == 3 * 4 * s * b * h + 2 * 4 * s * b  # norm 2 input; x * rstd and rstd of each
    local = ledger.layer_terms_for("local", s=s, b=b, h=h, a=a, g=g, f=f)
    assert local.core == 6 * a * s * s * b and measured < 2 * ledger.layer_bytes(local, tp=1, sp=False,
                                                                               recompute="none", s=s, b=b, h=h)[0]


# ----------------------------------------------------------------------------- on the GPU, CUDA mapped to meta
# (last: the fixture replaces the module's TP1 world)


def test_gpu_build_takes_the_fused_path_on_the_device(gpu_on_meta, gpu_code_path):
    """bf16 for the GPU without TE: the fused layers (not megatron's), every tensor on the device,
    and a forward + backward that runs every piece of the GPU path there."""
    model = dataclasses.replace(common_model(), params_dtype="bfloat16", layer_spec="auto")
    assert gpt.layer_path(model, gpt.Features(), "cuda") == "fused"
    actor = gpt.build_actor(model, device=gpu_on_meta.device)
    layer = actor.decoder.layers[0]
    assert isinstance(layer.input_layernorm, fl.FusedRMSNorm)
    assert isinstance(layer.self_attention.core_attention, fl.sdpa_attention_class())
    assert isinstance(layer.mlp.activation_func, fl.FusedSwiGLU)
    assert {p.device.type for p in actor.parameters()} == {"meta"}
    assert {p.dtype for p in actor.parameters()} == {torch.bfloat16}
    ids = torch.randint(0, 51, (2, 12), device=gpu_on_meta.device)
    pos = torch.arange(12, device=gpu_on_meta.device)[None].expand(2, 12)
    logits = actor(ids, pos, None)
    assert logits.device.type == "meta"
    logits.float().sum().backward()
    layers = model.num_layers
    assert gpu_code_path == {"swiglu": layers, "rope": 2 * layers, "sdpa": layers}, gpu_code_path
    assert all(p.grad is not None and p.grad.device.type == "meta" for p in actor.parameters())
