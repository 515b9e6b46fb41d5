"""Partial rollouts (algorithm.async_rl.partial_rollouts, docs/async.md): new weights enter a request
in flight between two decode steps of the built-in engine, every token tagged with the version that
drew it, its behaviour log-prob that version's given the whole prefix."""

from __future__ import annotations

import math
import queue
import random
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pfppo_mega.rollout import SamplingParams

torch.set_num_threads(1)

V, PAD = 32, 0
PROMPTS = [[5, 9, 3], [7, 1, 4, 4, 12], [11], [5, 9, 3]]  # the last repeats the first (a shared prefill)


def _hf(seed: int):
    kw = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, head_dim=32, max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**kw)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # O(1) logits: sampling far from uniform, the two versions far apart
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.2 * noise if "norm" in name else noise if "embed" in name
                    else 2.0 * noise / math.sqrt(p.shape[1]))
    return model


@pytest.fixture(scope="module")
def two_versions():
    return {1: _hf(1).state_dict(), 2: _hf(2).state_dict()}


def _engine(**kw):
    from pfppo_mega.registry import ROLLOUT_ENGINES

    return ROLLOUT_ENGINES.get("builtin").from_hf_model(_hf(1), pad_token_id=PAD, **kw)


def _recomputed_logp(weights: dict, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """log pi_v(y_t | x, y_<t) for every t: one full forward of a fresh engine holding ``weights``."""
    eng = _engine()
    eng.load_weights(weights.items(), version=99)
    seq = torch.tensor([prompt + response])
    logits = eng.forward_logits(seq, torch.ones_like(seq))[0, len(prompt) - 1:-1].double()   # [T, V]
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


@pytest.mark.parametrize("max_batch_size", [None, 2])
def test_a_request_spanning_a_switch_carries_both_versions_and_each_versions_logprobs(two_versions,
                                                                                      max_batch_size):
    at, N, temp = 3, 7, 0.9
    eng = _engine(max_batch_size=max_batch_size)
    eng.load_weights(two_versions[1].items(), version=1)
    calls = []

    def switch(t: int) -> bool:  # version 2 arrives before token `at` of the first chunk is drawn
        calls.append(t)
        if t == at and eng.weight_version == 1:
            eng.load_weights(two_versions[2].items(), version=2)
            return True
        return False

    params = SamplingParams(temperature=temp, top_p=1.0, max_new_tokens=N, eos_token_id=None, seed=11)
    out = eng.generate_partial(PROMPTS, params, switch)
    tv, chunk = out.token_versions, max_batch_size or len(PROMPTS)
    assert calls[:N - 1] == list(range(1, N))  # every boundary of the first chunk, in order
    first, rest = slice(0, chunk), slice(chunk, len(PROMPTS))
    assert (tv[first, :at] == 1).all() and (tv[first, at:] == 2).all()  # two versions, at the right index
    assert (tv[rest] == 2).all()  # a later chunk of the request: the new version from its start
    assert out.versions.tolist() == [1] * chunk + [2] * (len(PROMPTS) - chunk) and out.weight_version == 2
    worst = gap_to_each_version(out, two_versions, _recomputed_logp, temp)
    assert worst < 1e-4, f"behaviour log-probs differ from each version's recomputation by {worst:.2e}"
    # and they are not what one version alone would give: the switch really changed the policy
    only1 = _recomputed_logp(two_versions[1], PROMPTS[0], out.responses[0].tolist(), temp)
    assert (out.logprobs[0, at:].double() - only1[at:]).abs().max() > 1e-2


def gap_to_each_version(out, versions: dict, recomputed_logp, temp: float) -> float:
    """max |behaviour log-prob - recomputation with the version that drew the token| over the rows of
    ``out`` (a generate_partial of PROMPTS); ``recomputed_logp(weights, prompt, response, temp)`` -> [T]."""
    worst = 0.0
    for b, prompt in enumerate(PROMPTS):
        resp, tv = out.responses[b].tolist(), out.token_versions[b]
        want = torch.zeros(len(resp), dtype=torch.float64)
        for v in versions:
            sel = tv == v
            if sel.any():
                want[sel] = recomputed_logp(versions[v], prompt, resp, temp)[sel]
        worst = max(worst, (out.logprobs[b].double() - want).abs().max().item())
    return worst


def test_without_a_switch_partial_generation_is_ordinary_generation(two_versions):
    eng = _engine()
    eng.load_weights(two_versions[1].items(), version=1)
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=6, eos_token_id=4, seed=3)
    a = eng.generate(PROMPTS, params)
    b = eng.generate_partial(PROMPTS, params, lambda t: False)
    assert torch.equal(a.responses, b.responses) and torch.equal(a.logprobs, b.logprobs)
    assert ((b.token_versions == 1) == b.response_mask.bool()).all() and (b.token_versions[~b.response_mask.bool()] == -1).all()


# ----------------------------------------------------------------------------- the generator's loop


def test_the_generator_loads_a_version_arriving_mid_request_at_the_next_token(two_versions, tmp_path):
    generator_takes_a_version_mid_request(_engine(), two_versions, tmp_path, _recomputed_logp)


def generator_takes_a_version_mid_request(eng, two_versions, tmp_path, recomputed_logp) -> None:
    """worker.serve with partial: version 2's file is announced while token `at` is due; the request
    finishes with it, its result tagged per token, its log-probs each version's (``recomputed_logp``:
    (weights, prompt, response, temperature) -> [T], as each engine's test recomputes them). Shared
    with the vLLM engine's test (tests/test_vllm_partial.py)."""
    from pfppo_mega.rollout.source import NamedTensorSource
    from pfppo_mega.trainer.asynchronous import weightfile
    from pfppo_mega.trainer.asynchronous.worker import Request, serve

    at, N, temp = 2, 5, 1.0
    paths = {}
    for v in (1, 2):
        src = NamedTensorSource(two_versions[v].items(), v, layout=eng.weight_layout())
        weightfile.write(tmp_path / f"v{v}.weights", v, list(src.buckets(eng.bucket_plan())))
        paths[v] = str(tmp_path / f"v{v}.weights")
    messages: queue.Queue = queue.Queue()
    plain = eng.generate_partial

    def generate_partial(prompts, params, switch):  # version 2 is announced just before token `at`
        def at_boundary(t):
            if t == at:
                messages.put(("weights", 2, paths[2]))
            return switch(t)
        return plain(prompts, params, at_boundary)

    eng.generate_partial = generate_partial
    sent = []
    outbox = SimpleNamespace(send=lambda msg: (sent.append(msg), messages.put(("stop",))))
    params = SamplingParams(temperature=temp, top_p=1.0, max_new_tokens=N, eos_token_id=None, seed=5)
    messages.put(("weights", 1, paths[1]))
    messages.put(("request", Request(0, [PROMPTS[0], PROMPTS[1]], 2, params)))
    spec = SimpleNamespace(window=0, rule="newest", temperature=1.0, partial=True)
    try:
        serve(eng, messages, outbox, spec)
    finally:
        del eng.generate_partial  # the engine's own method again
    (kind, r), = sent
    assert kind == "result" and r.version == 1 and r.switches == 1 and eng.weight_version == 2
    assert (r.token_versions[:, :at] == 1).all() and (r.token_versions[:, at:] == 2).all()
    for b, prompt in enumerate([PROMPTS[0]] * 2 + [PROMPTS[1]] * 2):
        resp = r.responses[b].tolist()
        want = torch.cat([recomputed_logp(two_versions[1], prompt, resp, temp)[:at],
                          recomputed_logp(two_versions[2], prompt, resp, temp)[at:]])
        assert (r.logprobs[b].double() - want).abs().max() < 1e-4


# ----------------------------------------------------------------------------- end to end


def test_async_tiny_with_partial_rollouts_trains_within_the_token_bound_and_resumes(tmp_path):
    """configs/async_tiny.yaml with partial_rollouts: every token of every trained row within
    max_staleness, the per-token metrics logged, a checkpoint with requests in flight resumed."""
    import json
    from pathlib import Path

    from pfppo_mega.config import load_config
    from pfppo_mega.sft import run_sft
    from pfppo_mega.trainer.loop import PPOTrainer

    config = Path(__file__).resolve().parents[1] / "configs" / "async_tiny.yaml"
    sft = tmp_path / "sft"
    run_sft(load_config(config, [f"sft.output_dir={sft}", f"actor_rollout.model_path={sft}", "sft.steps=40"]),
            log=lambda *_: None)
    over = [f"actor_rollout.model_path={sft}", f"logging.output_dir={tmp_path / 'run'}",
            "algorithm.async_rl.partial_rollouts=true", "algorithm.async_rl.request_prompts=32",
            "algorithm.max_response_length=6", "training.total_training_steps=4", "checkpoint.save_interval=2"]
    with PPOTrainer(load_config(config, over), log=lambda *_: None) as t:
        res = t.fit()
    with PPOTrainer(load_config(config, over + ["checkpoint.resume=true", "training.total_training_steps=6"]),
                    log=lambda *_: None) as t:
        assert t.step == 4
        res = t.fit()
    recs = [json.loads(line) for line in open(res.metrics_path) if "async/token_staleness_mean" in line]
    assert res.steps == 6 and [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6]
    for r in recs:
        assert r["async/staleness_max"] <= 2  # a row's oldest token
        assert abs(sum(r[f"async/token_staleness_hist/{k}"] for k in range(3)) - 1) < 1e-9
        assert 0 <= r["async/mixed_version_rows"] <= 1 and r["async/partial_switches"] >= 0
        assert r["async/token_staleness_mean"] <= r["async/staleness_max"]
    print("partial switches per step:", [r["async/partial_switches"] for r in recs],
          "rows with mixed versions:", [round(r["async/mixed_version_rows"], 3) for r in recs])
