"""Rollout engine tests.

The reference is an independent implementation: a tiny random transformers Llama/Qwen2 model,
cast to float64 and run on each sequence alone (no padding, no cache). Interface-level tests
(`make_engine` fixture) form the conformance suite every RolloutEngine backend must pass: it runs
over every engine in pfppo_mega.registry.ROLLOUT_ENGINES (through its EngineSpec.from_hf_model).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from pfppo_mega.registry import ROLLOUT_ENGINES
from pfppo_mega.rollout import BuiltinEngine, DecoderShape, RolloutEngine, SamplingParams
from pfppo_mega.rollout.builtin import draw_tokens, sample_tokens, top_p_filter
from pfppo_mega.rollout.source import NamedTensorSource
from pfppo_mega.rollout.weights import Bucket, WeightUpdateError, fused_group, plan_buckets

torch.set_num_threads(1)

V = 32
PAD = 0
MAX_POS = 64
PROMPTS = [[5, 9, 3], [7, 1, 4, 4, 12, 30, 2, 8], [11], [3, 3, 20, 21, 6]]


def tiny_hf(*, tied: bool, qwen2: bool = False, seed: int = 0) -> torch.nn.Module:
    """Tiny random HF model, re-initialised with O(1) logits so sampling is not near-uniform."""
    # head_dim 32: vLLM rejects head sizes below 32
    kw = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=1, head_dim=32,
              max_position_embeddings=MAX_POS, tie_word_embeddings=tied, rms_norm_eps=1e-6)
    torch.manual_seed(seed)
    model = (Qwen2ForCausalLM(Qwen2Config(**kw)) if qwen2
             else LlamaForCausalLM(LlamaConfig(**kw))).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.3 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:  # [out, in]
                scale = 2.0 if name == "lm_head.weight" else 1.0
                p.copy_(scale * noise / math.sqrt(p.shape[1]))
    return model


def hf_shape(model) -> DecoderShape:
    return DecoderShape.from_hf_config(model.config.to_dict())


def make_builtin(model, **kw) -> RolloutEngine:
    return ROLLOUT_ENGINES.get("builtin").from_hf_model(model, pad_token_id=PAD, **kw)


@pytest.fixture(params=list(ROLLOUT_ENGINES))  # every registered engine (pfppo_mega.registry)
def make_engine(request):
    spec = ROLLOUT_ENGINES.get(request.param)
    why = spec.unavailable()
    if why:
        pytest.skip(f"{request.param} engine not exercised: {why}")
    return lambda model, **kw: spec.from_hf_model(model, pad_token_id=PAD, **kw)


@pytest.fixture(scope="module")
def hf_untied():
    return tiny_hf(tied=False)


@pytest.fixture(scope="module")
def ref64(hf_untied):
    return copy.deepcopy(hf_untied).double()


@torch.no_grad()
def ref_logits(ref_model, tokens: list[int]) -> torch.Tensor:
    """One unpadded sequence through the float64 HF model -> [S, V] float64."""
    return ref_model(torch.tensor([tokens])).logits[0]


def ref_logprobs(ref_model, prompt, response, temperature, top_p: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) of each response token given everything before it -> [L].
    top_p < 1: under the renormalised nucleus instead (engines with top_p_logprobs == "nucleus")."""
    logits = ref_logits(ref_model, prompt + response)[len(prompt) - 1: len(prompt) + len(response) - 1]
    logp = torch.log_softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        nucleus = top_p_filter(logp.exp(), top_p)
        logp = (nucleus / nucleus.sum(-1, keepdim=True)).log()
    return logp.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def rows(out) -> list[list[int]]:
    return [out.responses[b, : int(out.lengths[b])].tolist() for b in range(len(out.prompts))]


# ------------------------------------------------------------------- shape / config
@pytest.mark.parametrize("tied,qwen2", [(True, False), (False, False), (False, True)])
def test_shape_roundtrips_hf_config(tied, qwen2):
    model = tiny_hf(tied=tied, qwen2=qwen2)
    shape = hf_shape(model)
    assert shape.arch.qkv_bias == qwen2 and shape.tie_word_embeddings == tied
    cfg = shape.hf_config()
    rebuilt = (Qwen2Config if qwen2 else LlamaConfig)(**{k: v for k, v in cfg.items()
                                                          if k != "model_type"})
    assert DecoderShape.from_hf_config(rebuilt.to_dict()) == shape
    hf_shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    if tied:
        hf_shapes.pop("lm_head.weight")
    assert hf_shapes == shape.hf_shapes()


@pytest.mark.parametrize("patch,needle", [
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_type"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "o_proj"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"model_type": "gpt2"}, "model_type"),
])
def test_shape_rejects_unsupported_config(patch, needle):
    cfg = {**tiny_hf(tied=True).config.to_dict(), **patch}
    with pytest.raises(ValueError, match=needle):
        DecoderShape.from_hf_config(cfg)


# ---------------------------------------------------------------------- logits
@pytest.mark.parametrize("tied,qwen2", [(True, False), (False, False), (False, True)])
def test_logits_match_hf(tied, qwen2):
    model = tiny_hf(tied=tied, qwen2=qwen2, seed=3)
    engine = make_builtin(model)
    ids = torch.randint(0, V, (3, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hf32 = model(ids).logits
        hf64 = copy.deepcopy(model).double()(ids).logits
    ours = engine.forward_logits(ids, torch.ones_like(ids))
    gap32 = (ours - hf32).abs().max().item()
    gap64 = (ours.double() - hf64).abs().max().item()
    hf_err = (hf32.double() - hf64).abs().max().item()  # fp32 rounding of HF itself
    print(f"tied={tied} qwen2={qwen2}: |ours-hf32|={gap32:.2e} |ours-hf64|={gap64:.2e} "
          f"|hf32-hf64|={hf_err:.2e} (max |logit| {hf64.abs().max().item():.1f})")
    scale = hf64.abs().max().item()
    # Both within twice HF's own fp32 rounding (measured here, not assumed: it was ~4e-7 x the largest
    # logit on one machine and 4.8e-7 on another, where a fixed 4e-7 x scale bound failed).
    assert gap32 <= 2 * hf_err + 1e-7 * scale
    assert gap64 <= 2 * hf_err + 1e-6


def test_padded_forward_matches_unpadded_reference(hf_untied, ref64):
    engine = make_builtin(hf_untied)
    S = max(map(len, PROMPTS))
    for side in ("left", "right"):
        ids = torch.zeros(len(PROMPTS), S, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, p in enumerate(PROMPTS):
            cols = slice(S - len(p), S) if side == "left" else slice(0, len(p))
            ids[b, cols], mask[b, cols] = torch.tensor(p), 1
        logits = engine.forward_logits(ids, mask)
        assert torch.isfinite(logits).all()
        for b, p in enumerate(PROMPTS):
            gap = (logits[b][mask[b].bool()].double() - ref_logits(ref64, p)).abs().max().item()
            assert gap < 1e-5, f"{side}-padded row {b}: gap {gap:.2e}"


# ------------------------------------------------------------- cache / logprobs
def test_cached_decode_logits_equal_full_forward(hf_untied):
    engine = make_builtin(hf_untied)
    params = SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=20, eos_token_id=None,
                            seed=1)
    out, step_logits = engine.generate_with_logits(PROMPTS, params)
    worst = 0.0
    for b, (prompt, resp) in enumerate(zip(PROMPTS, rows(out))):
        seq = torch.tensor([prompt + resp])
        full = engine.forward_logits(seq, torch.ones_like(seq))[0]  # [S, V]
        full = full[len(prompt) - 1: len(prompt) - 1 + len(resp)]
        worst = max(worst, (step_logits[b, : len(resp)] - full).abs().max().item())
    print(f"cached decode vs full forward: max |logit gap| = {worst:.2e}")
    assert worst < 1e-5


@pytest.mark.parametrize("temperature,top_p,greedy", [(0.7, 0.9, False), (1.3, 1.0, False),
                                                       (1.0, 1.0, True)])
def test_logprobs_match_reference(make_engine, hf_untied, ref64, temperature, top_p, greedy):
    engine = make_engine(hf_untied)
    params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=16,
                            eos_token_id=None, greedy=greedy, seed=7)
    out = engine.generate(PROMPTS, params)
    assert out.logprobs.dtype == torch.float32
    T_eff = 1.0 if greedy else temperature
    worst = 0.0
    for b, (prompt, resp) in enumerate(zip(PROMPTS, rows(out))):
        nucleus = engine.top_p_logprobs == "nucleus" and not greedy
        expected = ref_logprobs(ref64, prompt, resp, T_eff, top_p if nucleus else 1.0)
        worst = max(worst, (out.logprobs[b, : len(resp)].double() - expected).abs().max().item())
        if greedy:  # greedy picks the reference argmax at every step
            logits = ref_logits(ref64, prompt + resp)[len(prompt) - 1: -1]
            assert logits.argmax(-1).tolist() == resp
    print(f"T={temperature} top_p={top_p} greedy={greedy}: max |logprob gap| = {worst:.2e}")
    assert worst < 1e-5


def test_ragged_batch_equals_each_prompt_alone(make_engine, hf_untied):
    engine = make_engine(hf_untied)
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=12, eos_token_id=None,
                            greedy=True)
    batch = engine.generate(PROMPTS, params)
    for b, prompt in enumerate(PROMPTS):
        alone = engine.generate([prompt], params)
        assert rows(alone)[0] == rows(batch)[b], f"row {b}"
        gap = (alone.logprobs[0] - batch.logprobs[b]).abs().max().item()
        assert gap < 1e-5, f"row {b} logprob gap {gap:.2e}"


def test_max_batch_size_chunks_give_same_result(hf_untied):
    whole = make_builtin(hf_untied)
    chunked = make_builtin(hf_untied, max_batch_size=3)  # chunks of 3 and 1
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=10, eos_token_id=None,
                            greedy=True)
    a, b = whole.generate(PROMPTS, params), chunked.generate(PROMPTS, params)
    assert torch.equal(a.responses, b.responses) and torch.equal(a.lengths, b.lengths)
    assert (a.logprobs - b.logprobs).abs().max() < 1e-5
    sampled = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=10, eos_token_id=None,
                             seed=4)
    assert torch.equal(chunked.generate(PROMPTS, sampled).responses,
                       chunked.generate(PROMPTS, sampled).responses)


def test_shared_prompts_are_prefilled_once(hf_untied, monkeypatch):
    """GRPO's groups: a prompt several rows share is prefilled once (its keys, values and logits
    copied to each row); the rows' tokens and log-probs are those of separate prefills."""
    batch = [p for p in PROMPTS for _ in range(3)]
    assert len({tuple(p) for p in PROMPTS}) == len(PROMPTS)
    shared, separate = make_builtin(hf_untied), make_builtin(hf_untied, share_prompts=False)
    prefilled: list[int] = []
    real = type(shared.model).prefill

    def spy(self, prompts, cache, end):
        prefilled.append(len(prompts))
        return real(self, prompts, cache, end)
    monkeypatch.setattr(type(shared.model), "prefill", spy)
    for params in (SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=10, eos_token_id=None, greedy=True),
                   SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=10, eos_token_id=None, seed=4)):
        a, b = shared.generate(batch, params), separate.generate(batch, params)
        assert torch.equal(a.responses, b.responses) and torch.equal(a.lengths, b.lengths)
        assert (a.logprobs - b.logprobs).abs().max() < 1e-5
    assert prefilled == [len(PROMPTS), len(batch)] * 2, prefilled
    assert len({tuple(r) for r in rows(a)}) > len(PROMPTS)  # sampled: a group's rows still draw apart


# ------------------------------------------------------------------ stopping
def test_eos_stops_rows(make_engine, hf_untied):
    engine = make_engine(hf_untied)
    N = 12
    free = engine.generate(PROMPTS, SamplingParams(1.0, 1.0, N, eos_token_id=None, greedy=True))
    free_rows = rows(free)
    assert all(len(r) == N for r in free_rows) and not free.finished.any()
    eos = free_rows[0][2]  # row 0 surely stops at step 2 (or earlier)
    out = engine.generate(PROMPTS, SamplingParams(1.0, 1.0, N, eos_token_id=eos, greedy=True))
    assert any(eos not in r for r in free_rows), "pick a model/eos where some row never stops"
    for b, r in enumerate(free_rows):
        stop = r.index(eos) + 1 if eos in r else N
        assert out.lengths[b] == stop, f"row {b}"
        assert bool(out.finished[b]) == (eos in r)
        assert out.responses[b, :stop].tolist() == r[:stop]
        assert (out.responses[b, stop:] == PAD).all()
        assert out.response_mask[b].tolist() == [1.0] * stop + [0.0] * (out.responses.shape[1] - stop)
        assert (out.logprobs[b, stop:] == 0).all() and (out.logprobs[b, :stop] < 0).all()
        if eos in r:
            assert out.responses[b, stop - 1] == eos
    # a batch whose rows all finish early stops there: T is the longest row, not N
    one = engine.generate(PROMPTS[:1], SamplingParams(1.0, 1.0, N, eos_token_id=eos, greedy=True))
    stop0 = free_rows[0].index(eos) + 1
    assert one.responses.shape == (1, stop0) and bool(one.finished[0])


def test_tiny_top_p_equals_greedy(make_engine, hf_untied):
    engine = make_engine(hf_untied)
    greedy = engine.generate(PROMPTS, SamplingParams(1.0, 1.0, 12, None, greedy=True))
    nucleus = engine.generate(PROMPTS, SamplingParams(1.5, 1e-6, 12, None, seed=3))
    assert torch.equal(greedy.responses, nucleus.responses)


def test_seed_reproducibility(make_engine, hf_untied):
    engine = make_engine(hf_untied)

    def run(seed):
        return engine.generate(PROMPTS, SamplingParams(1.0, 1.0, 16, None, seed=seed))

    a, b, c = run(11), run(11), run(12)
    assert torch.equal(a.responses, b.responses) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.responses, c.responses)


def test_partial_generation_is_generate_without_a_switch_and_across_a_switch_to_the_same_weights(make_engine,
                                                                                                  hf_untied):
    """generate_partial (partial rollouts, docs/async.md), on every engine that declares it: with no
    switch it is generate(), every token tagged with the engine's version; with the same weights
    loaded again as a new version before token 4, no token changes (each row's seeded stream runs on
    across the switch; the prefix recomputed with equal weights gives equal log-probs) and the tokens
    from 4 on carry the new version. An engine that does not declare it refuses by name."""
    engine = make_engine(hf_untied)
    params = SamplingParams(0.9, 1.0, 10, None, seed=5)
    if not engine.partial_rollouts:
        with pytest.raises(NotImplementedError, match="cannot take new weights inside a request"):
            engine.generate_partial(PROMPTS, params, lambda t: False)
        return
    plain = engine.generate(PROMPTS, params)
    v = engine.weight_version
    none = engine.generate_partial(PROMPTS, params, lambda t: False)
    assert torch.equal(none.responses, plain.responses) and torch.equal(none.logprobs, plain.logprobs)
    assert torch.equal(none.token_versions, torch.where(none.response_mask.bool(), v, -1))

    def switch(t: int) -> bool:
        if t == 4 and engine.weight_version == v:
            engine.load_weights(hf_untied.state_dict().items(), version=v + 1)
            return True
        return False

    same = engine.generate_partial(PROMPTS, params, switch)
    assert rows(same) == rows(plain)
    assert (same.logprobs - plain.logprobs).abs().max() < 1e-5
    assert (same.token_versions[:, :4] == v).all() and (same.token_versions[:, 4:] == v + 1).all()
    assert same.versions.tolist() == [v] * len(PROMPTS) and engine.weight_version == v + 1


# ----------------------------------------------------------------- sampling math
def test_top_p_filter_matches_bruteforce():
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(2 * torch.randn(50, V, generator=g, dtype=torch.float64), -1)
    for top_p in (0.05, 0.3, 0.7, 0.95, 1.0):
        got = top_p_filter(probs, top_p)
        for b in range(probs.shape[0]):
            keep, mass = set(), 0.0
            for i in sorted(range(V), key=lambda i: -probs[b, i].item()):
                if mass >= top_p:
                    break
                keep.add(i)
                mass += probs[b, i].item()
            kept = {i for i in range(V) if got[b, i] > 0}
            assert kept == keep, f"top_p={top_p} row {b}"
            assert torch.equal(got[b, sorted(kept)], probs[b, sorted(kept)])


def test_sampling_distribution_matches_nucleus():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(V, generator=g) * 2
    T, top_p, n = 0.8, 0.8, 40000
    params = SamplingParams(temperature=T, top_p=top_p, max_new_tokens=1, eos_token_id=None)
    tokens, logprobs = sample_tokens(logits.expand(n, V).contiguous(), params, g)
    p = torch.softmax(logits.double() / T, -1)
    nucleus = top_p_filter(p[None], top_p)[0]
    nucleus = nucleus / nucleus.sum()
    freq = torch.bincount(tokens, minlength=V).double() / n
    assert (freq[nucleus == 0] == 0).all()
    sigma = (nucleus * (1 - nucleus) / n).sqrt()
    assert ((freq - nucleus).abs() <= 5 * sigma + 1e-12).all(), (freq - nucleus).abs().max()
    assert torch.allclose(logprobs.double(), p.log()[tokens], atol=1e-6)


def test_inverse_cdf_draw_edges_and_row_streams():
    """draw_tokens: mass on the first or last token only, zeros between positive masses (never
    drawn), an unnormalised row; with per-row generators a row's draw depends on its seed alone."""
    probs = torch.zeros(4, 9)
    probs[0, 0] = 1.0                        # all mass first
    probs[1, 8] = 0.25                       # all mass last, unnormalised
    probs[2, [1, 4, 7]] = torch.tensor([2.0, 3.0, 5.0])  # zeros between and at both ends
    probs[3] = torch.arange(9.0)             # token 0 has mass 0
    g = torch.Generator().manual_seed(3)
    n = 20000
    draws = torch.stack([draw_tokens(probs, g) for _ in range(n)])  # [n, 4]
    assert (draws[:, 0] == 0).all() and (draws[:, 1] == 8).all()
    for row in (2, 3):
        want = probs[row].double() / probs[row].sum()
        freq = torch.bincount(draws[:, row], minlength=9).double() / n
        assert (freq[want == 0] == 0).all(), f"row {row} drew a token of mass 0: {freq}"
        sigma = (want * (1 - want) / n).sqrt()
        assert ((freq - want).abs() <= 5 * sigma + 1e-12).all(), f"row {row}: {freq} vs {want}"
    gens = [torch.Generator().manual_seed(s) for s in (11, 12)]
    both = draw_tokens(probs[2:4], gens)
    alone = draw_tokens(probs[3:4], [torch.Generator().manual_seed(12)])
    assert both[1] == alone[0]


def test_sampling_params_validation():
    for kw, needle in [(dict(temperature=0.0), "temperature=0.0"),
                       (dict(top_p=0.0), "top_p=0.0"), (dict(top_p=1.5), "top_p=1.5"),
                       (dict(max_new_tokens=0), "max_new_tokens=0")]:
        args = dict(temperature=1.0, top_p=1.0, max_new_tokens=4, eos_token_id=None) | kw
        with pytest.raises(ValueError, match=needle):
            SamplingParams(**args)
    SamplingParams(temperature=0.0, top_p=1.0, max_new_tokens=1, eos_token_id=None, greedy=True)


# ----------------------------------------------------------------- prompts
def test_prompt_validation(make_engine, hf_untied):
    engine = make_engine(hf_untied)
    params = SamplingParams(1.0, 1.0, 8, None, greedy=True)
    limit = MAX_POS - 8
    engine.generate([[1] * limit], params)  # exactly at the limit is fine
    with pytest.raises(ValueError, match=rf"prompt 1 has length {limit + 1} > {limit}"):
        engine.generate([[1, 2], [1] * (limit + 1)], params)
    with pytest.raises(ValueError, match="prompt 2 is empty"):
        engine.generate([[1], [2], []], params)
    with pytest.raises(ValueError, match="empty batch"):
        engine.generate([], params)
    with pytest.raises(ValueError, match=rf"prompt 0 has token ids \[{V}\]"):
        engine.generate([[1, V]], params)


def test_generate_before_weights_raises(hf_untied):
    engine = BuiltinEngine(hf_shape(hf_untied), pad_token_id=PAD)
    assert engine.weight_version == -1
    with pytest.raises(RuntimeError, match="before any load_weights"):
        engine.generate([[1]], SamplingParams(1.0, 1.0, 2, None))


# ----------------------------------------------------------------- weights
def test_load_weights_errors_are_strict_and_atomic(make_engine, hf_untied):
    engine = make_engine(hf_untied)
    sd = dict(hf_untied.state_dict())
    params = SamplingParams(1.0, 1.0, 8, None, seed=0)
    before = engine.generate(PROMPTS, params)

    missing = {k: v for k, v in sd.items() if k != "model.norm.weight"}
    missing["model.layers.0.mlp.up_proj.weight"] = torch.zeros(96, 64)  # would change outputs
    with pytest.raises(ValueError, match=r"missing: model\.norm\.weight \(64,\)"):
        engine.load_weights(missing.items(), version=2)
    with pytest.raises(ValueError, match=r"unexpected: model\.extra\.weight"):
        engine.load_weights(list(sd.items()) + [("model.extra.weight", torch.zeros(3))], version=2)
    bad = dict(sd, **{"model.layers.1.self_attn.k_proj.weight": torch.zeros(64, 64)})
    with pytest.raises(ValueError, match=r"k_proj\.weight: got \(64, 64\), expected \(32, 64\)"):
        engine.load_weights(bad.items(), version=2)
    with pytest.raises(ValueError, match="more than once"):
        engine.load_weights(list(sd.items()) + [("model.norm.weight", sd["model.norm.weight"])], 2)
    with pytest.raises(ValueError, match="version"):
        engine.load_weights(sd.items(), version=-3)

    after = engine.generate(PROMPTS, params)
    assert engine.weight_version == 1 and after.weight_version == 1
    assert torch.equal(before.responses, after.responses)
    assert torch.equal(before.logprobs, after.logprobs)


def test_tied_lm_head_accepted_only_if_equal(make_engine):
    model = tiny_hf(tied=True)
    engine = make_engine(model)  # HF state_dict lists the tied tensor as lm_head.weight too
    sd = dict(model.state_dict())
    engine.load_weights([(k, v) for k, v in sd.items() if k != "lm_head.weight"], version=2)
    assert engine.weight_version == 2
    sd["lm_head.weight"] = sd["lm_head.weight"] + 1.0
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        engine.load_weights(sd.items(), version=3)


def test_weight_push_changes_and_restores_outputs(make_engine, hf_untied):
    engine = make_engine(hf_untied)
    originals = {k: v.clone() for k, v in hf_untied.state_dict().items()}
    params = SamplingParams(1.0, 0.9, 16, None, seed=5)
    base = engine.generate(PROMPTS, params)
    assert base.weight_version == engine.weight_version == 1

    g = torch.Generator().manual_seed(1)
    perturbed = {k: v + 0.3 * torch.randn(v.shape, generator=g) for k, v in originals.items()}
    engine.load_weights(perturbed.items(), version=2)
    changed = engine.generate(PROMPTS, params)
    assert changed.weight_version == engine.weight_version == 2
    assert not torch.equal(changed.responses, base.responses)

    engine.load_weights(((k, v) for k, v in originals.items()), version=3)  # a generator works
    restored = engine.generate(PROMPTS, params)
    assert restored.weight_version == 3
    assert torch.equal(restored.responses, base.responses)
    assert torch.equal(restored.logprobs, base.logprobs)  # bit-identical


def test_bf16_engine_close_to_reference(hf_untied, ref64):
    engine = make_builtin(hf_untied, dtype=torch.bfloat16)
    assert engine.model.model.embed_tokens.weight.dtype == torch.bfloat16
    out = engine.generate(PROMPTS, SamplingParams(1.0, 1.0, 8, None, seed=0))
    assert out.logprobs.dtype == torch.float32
    worst = max((out.logprobs[b, : len(r)].double() - ref_logprobs(ref64, p, r, 1.0)).abs().max().item()
                for b, (p, r) in enumerate(zip(PROMPTS, rows(out))))
    print(f"bf16 engine: max |logprob gap| vs fp64 = {worst:.3f}")
    assert worst < 0.2


def test_cuda_engine_matches_cpu(hf_untied):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine: BuiltinEngine(device='cuda') not exercised")
    cpu = make_builtin(hf_untied)
    gpu = BuiltinEngine(hf_shape(hf_untied), pad_token_id=PAD, device="cuda")
    gpu.load_weights(hf_untied.state_dict().items(), version=1)
    params = SamplingParams(1.0, 1.0, 12, eos_token_id=None, greedy=True)
    a, b = cpu.generate(PROMPTS, params), gpu.generate(PROMPTS, params)
    assert torch.equal(a.responses, b.responses.cpu())
    assert (a.logprobs - b.logprobs.cpu()).abs().max() < 1e-4
    sampled = SamplingParams(1.0, 0.9, 12, eos_token_id=None, seed=2)
    assert torch.equal(gpu.generate(PROMPTS, sampled).responses,
                       gpu.generate(PROMPTS, sampled).responses)


# ---------------------------------------------------------- buckets / update_weights
def test_bucket_plan_keeps_fused_groups_whole(hf_untied):
    layout = make_builtin(hf_untied).weight_layout()
    for budget in (1, 5000, 30000, 10 ** 9):
        plan = plan_buckets(layout, budget)
        names = [n for b in plan for n in b.names]
        assert names == [n for n, _ in layout.specs]  # every tensor once, in order
        owner = {}
        for b in plan:
            for n in b.names:
                owner.setdefault(fused_group(n), set()).add(b.index)
            # a bucket exceeds the budget only when it is a single fused group
            assert b.nbytes <= budget or len({fused_group(n) for n in b.names}) == 1, (budget, b.names)
        assert all(len(v) == 1 for v in owner.values()), "a fused group was split"
    assert fused_group("model.layers.3.self_attn.k_proj.bias") == "model.layers.3.qkv"
    assert fused_group("model.layers.3.mlp.up_proj.weight") == "model.layers.3.gate_up"
    assert fused_group("model.layers.3.mlp.down_proj.weight") == "model.layers.3.mlp.down_proj.weight"


def _perturbed(sd, seed=1, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in sd.items()}


def test_update_weights_streams_buckets(make_engine, hf_untied):
    engine = make_engine(hf_untied)
    params = SamplingParams(1.0, 0.9, 16, None, seed=5)
    base = engine.generate(PROMPTS, params)
    sd = {k: v.clone() for k, v in hf_untied.state_dict().items()}
    plan = engine.bucket_plan()
    engine.update_weights(NamedTensorSource(_perturbed(sd).items(), 7).buckets(plan), version=7)
    changed = engine.generate(PROMPTS, params)
    assert engine.weight_version == 7 and changed.versions.tolist() == [7] * len(PROMPTS)
    assert not torch.equal(changed.responses, base.responses)
    checksum7 = engine.weight_checksum
    assert changed.weight_checksum == checksum7 != ""
    # small buckets: many calls, same result (the engine sees whole fused groups only)
    engine.bucket_bytes = 2000
    small = plan_buckets(engine.weight_layout(), 2000)
    assert len(small) > len(plan)
    engine.update_weights(NamedTensorSource(sd.items(), 8).buckets(small), version=8)
    back = engine.generate(PROMPTS, params)
    assert torch.equal(back.responses, base.responses) and torch.equal(back.logprobs, base.logprobs)
    assert back.versions.tolist() == [8] * len(PROMPTS)


def test_update_weights_refuses_stale_corrupt_and_partial(make_engine, hf_untied):
    engine = make_engine(hf_untied)
    params = SamplingParams(1.0, 1.0, 8, None, seed=0)
    before = engine.generate(PROMPTS, params)
    sd = dict(hf_untied.state_dict())
    plan = engine.bucket_plan()

    stale = list(NamedTensorSource(sd.items(), 3).buckets(plan))
    with pytest.raises(WeightUpdateError, match="version 3, the update is to version 4: stale"):
        engine.update_weights(stale, version=4)
    assert engine.weight_version == -1  # refused part-way: no valid weights until a full update
    with pytest.raises(RuntimeError, match="failed one"):
        engine.generate(PROMPTS, params)

    corrupt = list(NamedTensorSource(sd.items(), 4).buckets(plan))
    last = corrupt[-1]
    flipped = last.flat.clone()
    flipped.view(torch.int32)[0] ^= 1  # one flipped bit
    corrupt[-1] = Bucket(last.spec, last.version, flipped, last.checksum, source_rank=3)
    with pytest.raises(WeightUpdateError, match=rf"bucket {last.spec.index} .* from rank 3 failed its checksum"):
        engine.update_weights(corrupt, version=4)
    assert engine.weight_version == -1

    # a bucket refused mid-stream, with earlier buckets (other weights) already applied: the engine
    # (vLLM: one reload call for the whole update) ends with no valid version, and the full update
    # below must bring every weight back
    engine.bucket_bytes, default_bytes = 2000, engine.bucket_bytes
    try:
        small = plan_buckets(engine.weight_layout(), 2000)
        mid = list(NamedTensorSource(_perturbed(sd).items(), 4).buckets(small))
        k = len(mid) // 2
        flipped = mid[k].flat.clone()
        flipped.view(torch.int32)[0] ^= 1
        mid[k] = Bucket(mid[k].spec, mid[k].version, flipped, mid[k].checksum, source_rank=1)
        with pytest.raises(WeightUpdateError, match=rf"bucket {mid[k].spec.index} .* from rank 1 failed its checksum"):
            engine.update_weights(mid, version=4)
    finally:
        engine.bucket_bytes = default_bytes
    assert k > 0 and engine.weight_version == -1

    partial = list(NamedTensorSource(sd.items(), 4).buckets(plan))[:-1]
    if partial:
        with pytest.raises(WeightUpdateError, match=rf"ended after {len(partial)} bucket\(s\)"):
            engine.update_weights(partial, version=4)

    engine.update_weights(NamedTensorSource(sd.items(), 4).buckets(plan), version=4)  # recovery
    after = engine.generate(PROMPTS, params)
    assert engine.weight_version == 4
    assert torch.equal(after.responses, before.responses) and torch.equal(after.logprobs, before.logprobs)


def test_sleep_and_wake_keep_outputs(make_engine, hf_untied):
    engine = make_engine(hf_untied)
    params = SamplingParams(1.0, 1.0, 8, None, seed=2)
    a = engine.generate(PROMPTS, params)
    engine.sleep()
    engine.wake_up()
    b = engine.generate(PROMPTS, params)
    assert torch.equal(a.responses, b.responses) and torch.equal(a.logprobs, b.logprobs)
