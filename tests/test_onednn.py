"""oneDNN-prepacked linears (pfppo_mega/compat/onednn.py) and the built-in engine on them.

The packed product against F.linear at the same dtype and against fp64 (its error at most 2x
F.linear's, plus an ulp-scale floor), over the shapes a rollout runs (a decode step's rows, a packed
prefill, a 3-D batch, a strided input, with and without bias); the decoder packed vs unpacked; the
engine repacks after every weight update, so it never generates with a stale pack.
"""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from pfppo_mega.compat import onednn
from pfppo_mega.rollout import BuiltinEngine, DecoderShape, SamplingParams
from pfppo_mega.rollout.source import NamedTensorSource

X86 = platform.machine() in ("x86_64", "AMD64")


def test_pinned_torch_provides_the_operators():
    """On the CPUs this project runs on, the operators exist and pass the probe; if a torch release
    drops or changes them the engine silently falls back to F.linear (half the speed): fail here."""
    if not (X86 and torch.backends.mkldnn.is_available()):
        pytest.skip(f"no oneDNN in this torch build on {platform.machine()}: the engine uses F.linear")
    assert onednn.available(torch.float32)
    assert not onednn.available(torch.float64)  # only fp32 is packed; other dtypes take F.linear


@pytest.mark.skipif(not onednn.available(), reason="this torch has no oneDNN linear operators")
@pytest.mark.parametrize("rows,n,k,bias", [(1, 96, 64, False), (7, 40, 72, True), (16, 3 * 64, 48, False),
                                           (700, 128, 96, True)])
def test_packed_linear_matches_reference(rows, n, k, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(rows, k, generator=g)
    want64 = F.linear(x.double(), w.double(), None if b is None else b.double())
    torch_err = (F.linear(x, w, b).double() - want64).abs().max().item()
    for hint in (1, rows, 64):
        got = onednn.linear(x, w, b, onednn.pack(w, batch_hint=hint))
        err = (got.double() - want64).abs().max().item()
        assert got.shape == (rows, n) and got.dtype == torch.float32
        assert err <= 2 * torch_err + 1e-6, f"hint {hint}: packed error {err:.2e} vs F.linear's {torch_err:.2e}"


@pytest.mark.skipif(not onednn.available(), reason="this torch has no oneDNN linear operators")
def test_packed_linear_takes_batched_and_strided_inputs():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 32, generator=g)
    packed = onednn.pack(w, batch_hint=4)
    x3 = torch.randn(3, 5, 32, generator=g)                  # [B, S, K]
    assert torch.allclose(onednn.linear(x3, w, None, packed), F.linear(x3, w), atol=1e-4)
    strided = torch.randn(32, 6, generator=g).t()             # [6, 32], not contiguous
    assert torch.allclose(onednn.linear(strided, w, None, packed), F.linear(strided, w), atol=1e-4)
    assert torch.equal(onednn.linear(x3, w, None, None), F.linear(x3, w))  # no pack: F.linear itself


def _tiny(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=48, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


PROMPTS = [[5, 9, 3], [7, 1, 4, 4, 12, 30, 2, 8], [11], [3, 3, 20, 21, 6]]
GREEDY = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=10, eos_token_id=None, greedy=True)


def _engine(model, **kw) -> BuiltinEngine:
    engine = BuiltinEngine(DecoderShape.from_hf_config(model.config.to_dict()), pad_token_id=0, **kw)
    engine.load_weights(model.state_dict().items(), version=1)
    return engine


@pytest.mark.skipif(not onednn.available(), reason="this torch has no oneDNN linear operators")
def test_engine_packed_equals_unpacked_and_repacks_after_updates():
    a, b = _tiny(0), _tiny(1)
    packed, plain = _engine(a), _engine(a, pack_weights=False)
    out_packed, out_plain = packed.generate(PROMPTS, GREEDY), plain.generate(PROMPTS, GREEDY)
    assert packed.model.packed and not plain.model.packed  # the packed engine really ran packed
    assert torch.equal(out_packed.responses, out_plain.responses)
    assert (out_packed.logprobs - out_plain.logprobs).abs().max() < 1e-5
    # new weights through both update paths: the old pack must never serve a generate
    packed.load_weights(b.state_dict().items(), version=2)
    assert not packed.model.packed
    fresh_b = _engine(b, pack_weights=False).generate(PROMPTS, GREEDY)
    assert torch.equal(packed.generate(PROMPTS, GREEDY).responses, fresh_b.responses)
    packed.update_weights(_buckets(packed, a, version=3), 3)  # bucket by bucket, back to a
    again = packed.generate(PROMPTS, GREEDY)
    assert packed.model.packed and torch.equal(again.responses, out_plain.responses)
    assert (again.logprobs - out_plain.logprobs).abs().max() < 1e-5


def _buckets(engine, model, *, version):
    source = NamedTensorSource(model.state_dict().items(), version, layout=engine.weight_layout())
    return source.buckets(engine.bucket_plan())


# ------------------------------------------------------------------ megatron's linears (routed_matmul)
@pytest.mark.skipif(not onednn.available(), reason="this torch has no oneDNN linear operators")
def test_routed_matmul_only_inside_the_context_and_only_for_parameters():
    g = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(24, 16, generator=g))
    x, grad = torch.randn(5, 16, generator=g), torch.randn(5, 24, generator=g)
    assert onednn.routed_matmul((x, w.t()), None) is None  # no context: torch.matmul runs
    with onednn.packed_weights(), torch.no_grad():
        fwd = onednn.routed_matmul((x, w.t()), None)       # a linear's output: x @ W.t()
        dgrad = onednn.routed_matmul((grad, w), None)      # its input gradient: grad @ W
        assert torch.allclose(fwd, x @ w.detach().t(), atol=1e-5) and torch.allclose(dgrad, grad @ w.detach(), atol=1e-5)
        assert onednn.routed_matmul((x, torch.randn(16, 24)), None) is None   # an activation: not routed
        assert onednn.routed_matmul((x, w.t()), {"out": torch.empty(5, 24)}) is None
        assert onednn.routed_matmul((x.double(), w.double().t()), None) is None
        w.mul_(2.0)  # a weight written inside the context anyway: its version moved, so it is repacked
        assert torch.allclose(onednn.routed_matmul((x, w.t()), None), x @ w.detach().t(), atol=1e-5)
    with onednn.packed_weights():  # autograd recording: oneDNN's op has no derivative, so torch.matmul runs
        assert onednn.routed_matmul((x.requires_grad_(), w.t()), None) is None
    assert onednn._state.packs is None  # the packs are dropped at the exit


def _tiny_megatron():
    """A TP1 megatron world (one thread) and the bench's tiny shape with a small ragged batch."""
    from pfppo_mega import parallel
    from pfppo_mega.bench.passes import SHAPES, ragged_batch
    from pfppo_mega.config.tree import ModelConfig

    torch.set_num_threads(1)
    parallel.init_parallel(tp=1, pp=1, seed=3)
    mc = ModelConfig(**SHAPES["tiny"])
    return mc, ragged_batch(6, mc.vocab_size, seed=2, prompt=(4, 9), response=(1, 7))


@pytest.mark.skipif(not onednn.available(), reason="this torch has no oneDNN linear operators")
def test_megatron_passes_through_onednn_match_torch_mm(monkeypatch):
    """A megatron actor's forward-only log-probs with the schedule's matmuls routed through oneDNN vs
    with the routing off (torch.mm): equal within float round-off, the route really taken; a training
    schedule routes nothing (packs do not repay their reorder there), and the update that follows the
    routed forward matches too."""
    from pfppo_mega.models import passes, gpt

    mc, inp = _tiny_megatron()
    calls = []
    real = onednn.routed_matmul

    def counting(args, kwargs):
        out = real(args, kwargs)
        calls.append(out is not None)
        return out

    results = {}
    actor = gpt.wrap_ddp(gpt.build_actor(mc))
    start = {k: v.detach().clone() for k, v in gpt.unwrap(actor).state_dict().items() if isinstance(v, torch.Tensor)}
    for routed in (True, False):
        gpt.unwrap(actor).load_state_dict(start, strict=False)  # both runs from the same weights
        opt = gpt.build_optimizer(actor, lr=1e-3, weight_decay=0.0, grad_clip=1.0)
        monkeypatch.setattr(onednn, "routed_matmul", counting if routed else (lambda args, kwargs: None))
        calls.clear()
        logp, _ = passes.forward_logp_entropy(actor, inp, temperature=1.0, micro_batch_size=3)
        routed_forward = sum(calls)
        calls.clear()
        step = passes.train_step(actor, opt, inp, lambda lp, ent, mb: ((lp * mb.inputs.response_mask).sum() * 0.01, {}),
                                 temperature=1.0, micro_batch_size=3)
        results[routed] = (logp, step.loss, [p.detach().clone() for p in actor.parameters()])
        if routed:
            assert routed_forward > 0, "no forward-only matmul went through oneDNN"
            assert sum(calls) == 0, "a training schedule's matmul went through oneDNN"
    (lp_a, loss_a, w_a), (lp_b, loss_b, w_b) = results[True], results[False]
    assert (lp_a - lp_b).abs().max() < 1e-5
    assert abs(loss_a - loss_b) <= 1e-5 * max(1.0, abs(loss_b))
    assert max((a - b).abs().max().item() for a, b in zip(w_a, w_b)) < 1e-5


@pytest.mark.skipif(not onednn.available(), reason="this torch has no oneDNN linear operators")
def test_a_frozen_model_keeps_its_packs_between_passes(monkeypatch):
    """The reference policy (every parameter frozen) reorders its weights once, not per pass; an
    in-place change still repacks; a trained model keeps nothing between passes."""
    from pfppo_mega.models import passes, gpt

    mc, inp = _tiny_megatron()
    reorders = []
    real = onednn.pack
    monkeypatch.setattr(onednn, "pack", lambda w, batch_hint: reorders.append(w.shape) or real(w, batch_hint=batch_hint))
    ref = gpt.build_actor(mc)
    ref.eval().requires_grad_(False)
    first, _ = passes.forward_logp_entropy(ref, inp, temperature=1.0, micro_batch_size=3)
    made = len(reorders)
    assert made > 0 and onednn.frozen_packs(ref)
    again, _ = passes.forward_logp_entropy(ref, inp, temperature=1.0, micro_batch_size=3)
    assert len(reorders) == made and torch.equal(first, again)  # no reorder the second time, same result
    with torch.no_grad():
        ref.decoder.layers[0].mlp.linear_fc1.weight.mul_(1.5)  # in place: its version moves, only it is repacked
    changed, _ = passes.forward_logp_entropy(ref, inp, temperature=1.0, micro_batch_size=3)
    assert len(reorders) == made + 1 and not torch.equal(changed, first)
    actor = gpt.build_actor(mc)  # trainable: packs made per pass, none kept
    passes.forward_logp_entropy(actor, inp, temperature=1.0, micro_batch_size=3)
    assert onednn.frozen_packs(actor) is None and "_onednn_packs" not in actor.__dict__
