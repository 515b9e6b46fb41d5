"""Partial rollouts with the vLLM engine (VLLMEngine.generate_partial, docs/async.md): vLLM driven one
step at a time, a new version loaded between two steps, the running rows preempted and recomputed
with it, every token tagged with the version that drew it and carrying that version's log-prob.

Every vLLM engine here is built in a child process (one for the engine and generator checks, one
for the trainer): an in-process vLLM engine leaves process groups in vLLM's module state that break
a later engine built in pytest's process (tests/test_vllm.py, tests/test_async.py do the same).
The engine checks share one engine: the child runs each and writes its outcome, one test reads each.
That a request without a switch, or with a switch to the same weights, is generate()'s is checked
for every engine by the conformance suite (tests/test_rollout_engine.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch

from pfppo_mega.rollout import SamplingParams
from pfppo_mega.rollout import vllm as rvllm

from test_async_partial import PAD, PROMPTS, _hf, gap_to_each_version, generator_takes_a_version_mid_request

NEEDS_VLLM = pytest.mark.skipif(bool(rvllm.unavailable_reason()), reason=rvllm.unavailable_reason() or "-")
TESTS = Path(__file__).parent


def _child(call: str, timeout: int = 900) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-c", f"import test_vllm_partial as t; {call}"], cwd=TESTS,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(TESTS.parent)})
    print(done.stdout[-3000:])
    assert done.returncode == 0, done.stderr[-4000:]
    return done


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    """{check name: 'ok' or its traceback}, from one child process and one vLLM engine."""
    out = tmp_path_factory.mktemp("vllm_partial") / "checks.json"
    _child(f"t._run_checks({str(out)!r})")
    return json.loads(out.read_text())


def _passed(checks: dict, name: str) -> None:
    assert name in checks, f"the child never ran {name} (ran: {sorted(checks)})"
    if checks[name] != "ok":
        pytest.fail(f"{name} failed in the child:\n{checks[name]}", pytrace=False)


@NEEDS_VLLM
def test_a_request_spanning_a_switch_carries_both_versions_and_each_versions_logprobs(checks):
    _passed(checks, "two_versions")


@NEEDS_VLLM
def test_the_generator_loads_a_version_arriving_mid_request_into_vllm(checks):
    _passed(checks, "generator")


@NEEDS_VLLM
def test_an_error_at_a_boundary_leaves_vllm_without_the_rows(checks):
    _passed(checks, "error_at_boundary")


@NEEDS_VLLM
def test_async_tiny_trains_with_vllm_and_partial_rollouts(tmp_path):
    _child(f"t._train_run({str(tmp_path)!r})")


# ----------------------------------------------------------------------------- run in the child

AT, N, TEMP = 3, 7, 0.9


def _params(**kw) -> SamplingParams:
    return SamplingParams(**{**dict(temperature=TEMP, top_p=1.0, max_new_tokens=N, eos_token_id=None, seed=11), **kw})


def _recomputed_logp(weights: dict, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """log pi_v(y_t | x, y_<t) for every t: one fp64 forward of the Hugging Face model holding ``weights``."""
    model = _hf(1).double()
    model.load_state_dict(weights)
    seq = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(seq).logits[0, len(prompt) - 1:-1]                                        # [T, V]
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def _kept_cache_logp(old: dict, new: dict, prompt: list[int], response: list[int], at: int,
                     temperature: float) -> torch.Tensor:
    """What tokens at..T would get from ``new`` on top of keys and values kept from ``old`` (the prompt
    and tokens < at - 1 computed by ``old``; token at - 1 fed after the switch) -> [T - at], fp64."""
    m_old, m_new = _hf(1).double(), _hf(1).double()
    m_old.load_state_dict(old)
    m_new.load_state_dict(new)
    with torch.no_grad():
        cache = m_old(torch.tensor([prompt + response[:at - 1]]), use_cache=True).past_key_values
        logits = m_new(torch.tensor([response[at - 1:-1]]), past_key_values=cache).logits[0]     # [T - at, V]
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(response[at:])[:, None])[:, 0]


def _switch_at(eng, at: int, weights: dict, version: int, calls: list):
    def switch(t: int) -> bool:
        calls.append(t)
        if t == at and eng.weight_version != version:
            eng.load_weights(weights.items(), version=version)
            return True
        return False
    return switch


def _check_two_versions(eng, versions: dict) -> None:
    """Version 2 (other weights) before token AT: both versions in every row, each token's log-prob
    that version's given the whole prefix (not version 1's, not a kept cache's mixture)."""
    eng.load_weights(versions[1].items(), version=1)
    calls: list[int] = []
    out = eng.generate_partial(PROMPTS, _params(), _switch_at(eng, AT, versions[2], 2, calls))
    assert calls == list(range(1, N)), calls  # every boundary, in order (the request's rows run together)
    tv = out.token_versions
    assert (tv[:, :AT] == 1).all() and (tv[:, AT:] == 2).all(), tv
    assert out.versions.tolist() == [1] * len(PROMPTS) and out.weight_version == 2
    worst = gap_to_each_version(out, versions, _recomputed_logp, TEMP)
    moved = max((out.logprobs[b, AT:].double() - _recomputed_logp(versions[1], p, out.responses[b].tolist(), TEMP)[AT:])
                .abs().max().item() for b, p in enumerate(PROMPTS))
    kept = max((out.logprobs[b, AT:].double() - _kept_cache_logp(versions[1], versions[2], p, out.responses[b].tolist(),
                                                                AT, TEMP)).abs().max().item()
               for b, p in enumerate(PROMPTS))
    print(f"two versions in one request: max |vLLM - fp64 recomputation per version| {worst:.2e}; after the "
          f"switch version 1 alone would differ by up to {moved:.2f}, version 2 on version 1's kept cache by {kept:.2f}")
    assert worst < 1e-4, worst
    assert moved > 1e-2  # the switch really changed the policy
    assert kept > 1e-2  # and the prefix was recomputed with it


def _check_generator(eng, versions: dict, tmp: Path) -> None:
    """worker.serve with partial and the vLLM engine: version 2's file is announced while token 2 is
    due; the request finishes with it, one switch, its rows tagged per token, log-probs per version."""
    eng.load_weights(versions[2].items(), version=7)  # the generator loads version 1 from its file first
    generator_takes_a_version_mid_request(eng, versions, tmp, _recomputed_logp)


def _check_error_at_boundary(eng, versions: dict) -> None:
    """A switch that raises (a refused weight file, a stop message) ends generate_partial with the
    rows aborted in vLLM: the next call runs as if nothing had happened."""
    eng.load_weights(versions[1].items(), version=1)

    def refuse(t: int) -> bool:
        raise KeyError("refused at a boundary")

    with pytest.raises(KeyError, match="refused at a boundary"):
        eng.generate_partial(PROMPTS, _params(), refuse)
    assert not eng.llm.llm_engine.has_unfinished_requests()
    again = eng.generate_partial(PROMPTS, _params(), lambda t: False)
    plain = eng.generate(PROMPTS, _params())
    assert torch.equal(again.responses, plain.responses) and torch.equal(again.logprobs, plain.logprobs)
    assert ((again.token_versions == 1) == again.response_mask.bool()).all()


def _run_checks(out_path: str) -> None:
    torch.set_num_threads(1)
    versions = {1: _hf(1).state_dict(), 2: _hf(2).state_dict()}
    eng = rvllm.shared_test_engine(_hf(1), pad_token_id=PAD)
    tmp = Path(out_path).parent
    results = {}
    for name, check in [("two_versions", lambda: _check_two_versions(eng, versions)),
                        ("generator", lambda: _check_generator(eng, versions, tmp)),
                        ("error_at_boundary", lambda: _check_error_at_boundary(eng, versions))]:
        try:
            check()
            results[name] = "ok"
        except BaseException:  # recorded for its own test; the other checks still run
            results[name] = traceback.format_exc()
    Path(out_path).write_text(json.dumps(results))


def _train_run(tmp_path: str) -> None:
    """configs/async_tiny.yaml with engine vllm and partial_rollouts, 2 steps: the generator process
    drives vLLM step by step; every trained row within the bound, the per-token metrics logged."""
    from pfppo_mega.config import load_config
    from pfppo_mega.sft import run_sft
    from pfppo_mega.trainer.loop import PPOTrainer

    tmp = Path(tmp_path)
    config = TESTS.parent / "configs" / "async_tiny.yaml"
    sft = tmp / "sft"
    run_sft(load_config(config, [f"sft.output_dir={sft}", f"actor_rollout.model_path={sft}", "sft.steps=20"]),
            log=lambda *_: None)
    over = [f"actor_rollout.model_path={sft}", f"logging.output_dir={tmp / 'run'}", "actor_rollout.engine=vllm",
            "algorithm.async_rl.partial_rollouts=true", "algorithm.async_rl.request_prompts=8",
            "algorithm.max_response_length=6", "training.total_training_steps=2"]
    with PPOTrainer(load_config(config, over), log=lambda *_: None) as t:
        res = t.fit()
        proc = t.run.strategies.collector.proc
        assert proc.pid is None and proc.files.root is None  # stopped, its weight files removed
    recs = [json.loads(line) for line in open(res.metrics_path) if "async/token_staleness_mean" in line]
    assert res.steps == 2 and [r["step"] for r in recs] == [1, 2], recs
    for r in recs:
        assert r["async/staleness_max"] <= 2 and r["async/restarts"] == 0
        assert abs(sum(r[f"async/token_staleness_hist/{k}"] for k in range(3)) - 1) < 1e-9
        assert 0 <= r["async/mixed_version_rows"] <= 1 and r["async/partial_switches"] >= 0
        assert r["async/token_staleness_mean"] <= r["async/staleness_max"]
        assert 0.5 < r["is/mean"] < 2.0, r
    print("vLLM partial rollouts: switches per step", [r["async/partial_switches"] for r in recs],
          "mixed rows", [round(r["async/mixed_version_rows"], 3) for r in recs])
