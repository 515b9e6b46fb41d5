"""What the vLLM engine's partial rollouts refuse (VLLMEngine.generate_partial, docs/async.md), without
building a vLLM engine: an engine whose scheduler runs the next step before the last one is read
(vLLM's async scheduling), and a call while another call's rows are in flight. And the trainer's
build asks vLLM for synchronous scheduling exactly when partial rollouts are on."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pfppo_mega.rollout import SamplingParams
from pfppo_mega.rollout import vllm as rvllm

PARAMS = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=4, eos_token_id=None, seed=1)


def _engine(*, async_scheduling: bool, in_flight: bool) -> rvllm.VLLMEngine:
    """A VLLMEngine shell whose vLLM answers the two questions generate_partial asks first."""
    eng = object.__new__(rvllm.VLLMEngine)
    eng._check_request = lambda prompts, params: None
    core = SimpleNamespace(vllm_config=SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=async_scheduling)),
                           has_unfinished_requests=lambda: in_flight,
                           add_request=lambda *a, **k: pytest.fail("a refused call reached vLLM"))
    eng.llm = SimpleNamespace(llm_engine=core)
    return eng


def test_async_scheduling_is_refused_by_name():
    with pytest.raises(RuntimeError, match=r"async scheduling on: the step after the one read would already run.*"
                                           r"async_scheduling=False"):
        _engine(async_scheduling=True, in_flight=False).generate_partial([[3, 4]], PARAMS, lambda t: False)


def test_a_call_while_other_rows_are_in_flight_is_refused():
    with pytest.raises(RuntimeError, match="requests of another call in flight"):
        _engine(async_scheduling=False, in_flight=True).generate_partial([[3, 4]], PARAMS, lambda t: False)


@pytest.mark.parametrize("enable,partial,want", [(True, True, False), (True, False, None), (False, True, None)])
def test_the_build_turns_async_scheduling_off_for_partial_rollouts(monkeypatch, enable, partial, want):
    built = {}
    monkeypatch.setattr(rvllm, "VLLMEngine", lambda model_dir, **kw: built.update(kw))
    ar = SimpleNamespace(tensor_model_parallel_size=1, max_num_seqs=8, gpu_memory_utilization=0.5,
                         enforce_eager=True, sleep_level=2, dtype="float32")
    cfg = SimpleNamespace(actor_rollout=ar, training=SimpleNamespace(seed=0),
                          algorithm=SimpleNamespace(async_rl=SimpleNamespace(enable=enable, partial_rollouts=partial)))
    monkeypatch.setattr(rvllm, "engine_dtype", lambda cfg: None)
    rvllm._build(cfg, "dir", {}, pad_token_id=0, bucket_bytes=1, max_model_len=8, device=None, log=print)
    assert built["async_scheduling"] is want
