"""Hostile inputs to multi-turn rollouts (pfppo_mega/rollout/multiturn.py, actor_rollout.multi_turn):
the policy's bad calls (malformed JSON, an unknown tool, a tool that raises or answers with no text)
reach it as error messages and are counted, never stopping the run; setup faults (a row naming a tool
or an interaction that is not configured, a tool whose create raises) stop it naming the row, with
every tool instance released; bad config values are refused at load by key."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from pfppo_mega.config import ConfigError, load_config, resolve_config_dict
from pfppo_mega.rollout.multiturn import TurnLimits
from pfppo_mega.rollout.tools.base import ToolResult, ToolSetupError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_multiturn import CALL, Calc, Teacher, _run, _sample, template, tok  # noqa: E402,F401 (fixtures)

REPO = Path(__file__).resolve().parents[2]


def _error_turn(tok, template, text, tools):
    s = _sample(tok, template, "What is 2+3?")
    res, _ = _run(tok, template, [s], [[text, "The answer is 5."]], tools=tools, budget=300, context=400)
    return res


@pytest.mark.parametrize("text, fragment", [
    ('<tool_call>{"name": "calc", "arguments": {"expr": </tool_call>', "tool call is not JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', "has no string 'name'"),
    ('<tool_call>{"name": "calc", "arguments": [1, 2]}</tool_call>', "'arguments' is not an object"),
    ('<tool_call>{"name": "calc", "arguments": {}}', "<tool_call> without </tool_call>"),
    ('<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>', "tool 'search' does not exist"),
    ('<tool_call>{"name": "calc", "arguments": {"expr": "two+3"}}</tool_call>', "tool 'calc' failed: ValueError"),
])
def test_a_bad_call_answers_the_policy_and_is_counted(tok, template, text, fragment):
    res = _error_turn(tok, template, text, {"calc": Calc()})
    assert fragment in res.texts[0], res.texts[0]
    m = res.stats.metrics()
    assert m["rollout/tool_call_errors"] == 1 and res.extra[0]["turns"] == 2  # the row went on
    assert res.output.finished.tolist() == [True]


def test_a_tool_answering_without_text_is_an_error_message_and_logged(tok, template):
    class NoText(Calc):
        def execute(self, instance_id, arguments):
            return ToolResult(5)  # not a str

    class Nothing(Calc):
        def execute(self, instance_id, arguments):
            return {"text": "5"}  # not a ToolResult

    for tool in (NoText(), Nothing()):
        logs = []
        s = _sample(tok, template, "What is 2+3?")
        res, _ = _run(tok, template, [s], [[CALL, "ok"]], tools={"calc": tool}, budget=300, context=400,
                      log=logs.append)
        assert "tool 'calc' returned no text" in res.texts[0]
        assert res.stats.metrics()["rollout/tool_call_errors"] == 1
        assert len(logs) == 1 and "must be a ToolResult with text a str" in logs[0]


def test_a_tool_that_never_answers_times_out_and_the_rollout_goes_on(tok, template):
    """A call still running at tool_timeout_s answers the policy with a timeout error (counted, logged
    once); the turn's other call answers normally and the row goes on to its next turn."""
    import threading
    import time

    release = threading.Event()

    class Hung(Calc):
        def execute(self, instance_id, arguments):
            if arguments.get("expr") == "hang":
                release.wait(60)  # a service that never answers (freed at the test's end)
            return super().execute(instance_id, arguments)

    hang = CALL.replace("2+3", "hang")
    logs = []
    s = _sample(tok, template, "What is 2+3?")
    t0 = time.monotonic()
    try:
        res, _ = _run(tok, template, [s], [[hang + CALL, "The answer is 5."]], tools={"calc": Hung()}, budget=400,
                      context=600, limits=TurnLimits(max_parallel_calls=2, tool_timeout_s=0.5), log=logs.append)
    finally:
        release.set()
    assert time.monotonic() - t0 < 30
    m = res.stats.metrics()
    assert m["tool/calc/timeouts"] == 1 and m["rollout/tool_call_errors"] == 1 and m["tool/calc/calls"] == 1
    assert "tool 'calc' did not answer within 0.5 s" in res.texts[0] and res.texts[0].endswith("The answer is 5.")
    assert len(logs) == 1 and "tool_timeout_s = 0.5 s" in logs[0]


def test_create_kwargs_for_a_tool_not_configured_is_refused_naming_the_row(tok, template):
    calc = Calc()
    good = _sample(tok, template, "What is 2+3?")
    bad = _sample(tok, template, "What is 2+3? ", {"tools_kwargs": {"search": {"create_kwargs": {}}}}, i=7)
    with pytest.raises(ToolSetupError, match=r"row 1 \(test:7\).*tools_kwargs names tool\(s\) \['search'\].*"
                                             r"configured: \['calc'\]"):
        _run(tok, template, [good, bad], [["x"], ["x"]], tools={"calc": calc})
    assert calc.released == ["r0-calc"]  # the instance made before the fault is released


@pytest.mark.parametrize("extra, fragment", [
    ({"tools_kwargs": ["calc"]}, "must be a mapping of tool name"),
    ({"tools_kwargs": {"calc": {"create_kwargs": 5}}}, "create_kwargs must be a mapping"),
    ({"interaction_kwargs": {"name": "judge"}}, "interaction_kwargs.name = 'judge' is not configured"),
    ({"interaction_kwargs": "teacher"}, "must be a mapping with a string 'name'"),
    ({}, r"multi-turn row 0 .*: extra_info.interaction_kwargs is missing: with interactions configured "
         r"\(\['teacher'\]"),
])
def test_bad_row_kwargs_are_named(tok, template, extra, fragment):
    s = _sample(tok, template, "What is 2+3?", extra)
    with pytest.raises(ToolSetupError, match=fragment):
        _run(tok, template, [s], [["x"]], tools={"calc": Calc()}, interactions={"teacher": Teacher()})


def test_a_tool_whose_create_raises_stops_the_run_and_releases_the_others(tok, template):
    class Broken(Calc):
        name = "broken"

        def create(self, instance_id, **kw):
            raise RuntimeError("no sandbox")

    calc = Calc()
    s = _sample(tok, template, "What is 2+3?")
    with pytest.raises(ToolSetupError, match=r"tool 'broken'.create.*RuntimeError: no sandbox"):
        _run(tok, template, [s], [["x"]], tools={"calc": calc, "broken": Broken()})
    assert calc.released == ["r0-calc"]


def test_an_engine_failure_mid_conversation_releases_every_tool(tok, template):
    calc = Calc()
    samples = [_sample(tok, template, "What is 2+3?", i=i) for i in range(2)]
    calls = []

    def failing(prompts, params):
        calls.append(len(prompts))
        if len(calls) == 2:
            raise RuntimeError("engine died")
        from test_multiturn import Scripted
        return Scripted(tok, [s.prompt_ids for s in samples], [[CALL], [CALL]])(prompts, params)

    from pfppo_mega.rollout.multiturn import MultiTurnRollout, ToolSet, TurnTokens
    loop = MultiTurnRollout(generate=failing, tokenizer=tok, turn_tokens=TurnTokens(template, tok),
                            toolset=ToolSet({"calc": calc}), limits=TurnLimits(), max_response_length=300,
                            max_context=400, log=lambda *_: None)
    from test_multiturn import PARAMS
    with pytest.raises(RuntimeError, match="engine died"):
        loop.run(samples, PARAMS)
    assert sorted(calc.released) == ["r0-calc", "r1-calc"]


def test_the_budget_running_out_in_a_tool_answer_ends_the_row_cut(tok, template):
    class Long(Calc):
        def execute(self, instance_id, arguments):
            return ToolResult("7" * 200)

    s = _sample(tok, template, "What is 2+3?")
    n_call = len(tok.encode(CALL, add_bos=False)) + 1
    res, _ = _run(tok, template, [s], [[CALL, "ok"]], tools={"calc": Long()}, budget=n_call + 20,
                  limits=TurnLimits(max_tool_response_length=10_000))
    assert int(res.output.lengths[0]) == n_call and not bool(res.output.finished[0])
    assert res.output.response_mask[0, :n_call].all()


# ----------------------------------------------------------------------------- config

@pytest.mark.parametrize("overrides, key, fragment", [
    (["actor_rollout.multi_turn.format=json"], "actor_rollout.multi_turn.format", "must be one of 'hermes'"),
    (["actor_rollout.multi_turn.tool_response_truncate_side=top"], "actor_rollout.multi_turn.tool_response_truncate_side",
     "must be one of 'left', 'middle', 'right'"),
    (["actor_rollout.multi_turn.tokenization_sanity_check_mode=loose"],
     "actor_rollout.multi_turn.tokenization_sanity_check_mode", "must be one of"),
    (["actor_rollout.multi_turn.max_parallel_calls=0"], "actor_rollout.multi_turn.max_parallel_calls", ">= 1"),
    (["actor_rollout.multi_turn.max_tool_response_length=0"], "actor_rollout.multi_turn.max_tool_response_length",
     ">= 1"),
    (["actor_rollout.multi_turn.max_assistant_turns=0"], "actor_rollout.multi_turn.max_assistant_turns", ">= 1"),
    (["actor_rollout.multi_turn.tool_timeout_s=0"], "actor_rollout.multi_turn.tool_timeout_s", "> 0"),
    (["actor_rollout.multi_turn.tool_config_path=' '"], "actor_rollout.multi_turn.tool_config_path",
     "must name a file"),
    (["actor_rollout.multi_turn.enable=true"], "data.source", "needs prompt files rendered with the checkpoint's"),
    (["actor_rollout.multi_turn.enable=true", "data.source=files", "data.train_files=[a.jsonl]",
      "algorithm.use_pf_ppo=false", "algorithm.async_rl.enable=true"], "algorithm.async_rl.enable",
     "must be false with actor_rollout.multi_turn.enable"),
    (["actor_rollout.multi_turn.enable=true", "data.source=files", "data.train_files=[a.jsonl]",
      "data.apply_chat_template=false"], "data.apply_chat_template", "needs prompt files rendered"),
])
def test_bad_multi_turn_config_is_refused_by_key(overrides, key, fragment):
    with pytest.raises(ConfigError) as e:
        load_config(REPO / "configs" / "tiny_cpu.yaml", overrides)
    hits = [p for p in e.value.problems if str(p).startswith(key)]
    assert hits and fragment in str(hits[0]), str(e.value)


@pytest.mark.parametrize("override, fragment", [
    ("actor_rollout_ref.rollout.multi_turn.format=gpt-oss", "tool-call format 'gpt-oss'"),
    ("actor_rollout_ref.rollout.multi_turn.use_inference_chat_template=True", "re-rendering each turn"),
    ("data.tool_config_path=other.yaml", "differs from actor_rollout_ref.rollout.multi_turn.tool_config_path"),
])
def test_verl_multi_turn_values_that_cannot_be_honoured_are_refused(override, fragment):
    base = ["actor_rollout_ref.rollout.multi_turn.enable=True", "data.train_files=[a.parquet]",
            "actor_rollout_ref.rollout.multi_turn.tool_config_path=tools.yaml", "actor_rollout_ref.model.path=/m"]
    resolve_config_dict({}, base)  # loads without the override
    with pytest.raises(ConfigError) as e:
        resolve_config_dict({}, base + [override])
    assert len(e.value.problems) == 1 and fragment in str(e.value), str(e.value)


def test_another_replicas_tool_failure_stops_this_replica_too(tok, template, monkeypatch):
    """With the rollout split the engine calls are world collectives: when replica 1's leader stops (its
    interaction raised), replica 0's ranks must stop at the same share, not go on to the next call and
    wait there for ranks that left. Replica 0's rows' tools are released."""
    from types import SimpleNamespace

    from pfppo_mega.rollout.multiturn import MultiTurnRollout, ToolSet, TurnTokens
    from pfppo_mega.trainer.colocation import generation
    from pfppo_mega.trainer.colocation.rollout_split import SplitLayout
    from test_multiturn import PARAMS, Scripted

    calls = []

    def gather(out, mine, group=None):  # this rank (replica 0's leader) and replica 1's leader
        calls.append(mine)
        other = {"error": "ToolSetupError: interaction 'teacher'.respond raised" if len(calls) == 2 else None,
                 "rows": [], "counts": {}}
        out[0], out[1] = mine, (1, True, other)

    monkeypatch.setattr(generation.dist, "all_gather_object", gather)
    monkeypatch.setattr(generation.dist, "get_world_size", lambda group=None: 2)
    gen = SimpleNamespace(split=SplitLayout(world=2, rank=0, rollout_tp=1, dp_rank=0, replica_leader=True),
                          sync=SimpleNamespace(world=None))
    gen._runs_tools = lambda replicated: generation.Generation._runs_tools(gen, replicated)
    share = generation.Generation._share_of(gen, False)
    calc = Calc()
    samples = [_sample(tok, template, "What is 2+3?", i=0)]
    loop = MultiTurnRollout(generate=Scripted(tok, [s.prompt_ids for s in samples], [[CALL, "done"]]),
                            tokenizer=tok, turn_tokens=TurnTokens(template, tok), toolset=ToolSet({"calc": calc}),
                            limits=TurnLimits(), max_response_length=300, max_context=400, share=share,
                            log=lambda *_: None)
    with pytest.raises(ToolSetupError, match="replica 1: ToolSetupError: interaction 'teacher'"):
        loop.run(samples, PARAMS)
    assert len(calls) == 2 and calc.released == ["r0-calc"]


def test_an_engine_that_returns_no_token_for_a_row_is_an_error_not_a_loop(tok, template):
    """A row given no token (no EOS, budget left) would be asked again forever: stopped, the row named."""
    from pfppo_mega.rollout.base import RolloutOutput
    from pfppo_mega.rollout.multiturn import MultiTurnRollout, ToolSet, TurnTokens
    from test_multiturn import PARAMS
    import torch

    calls = []

    def empty(prompts, params):
        calls.append(len(prompts))
        if len(calls) > 20:
            raise AssertionError("the loop asked for the same row again and again")
        B = len(prompts)
        return RolloutOutput(prompts=prompts, responses=torch.zeros(B, 0, dtype=torch.long),
                             response_mask=torch.zeros(B, 0), logprobs=torch.zeros(B, 0),
                             lengths=torch.zeros(B, dtype=torch.long), finished=torch.zeros(B, dtype=torch.bool),
                             weight_version=1)

    calc = Calc()
    loop = MultiTurnRollout(generate=empty, tokenizer=tok, turn_tokens=TurnTokens(template, tok),
                            toolset=ToolSet({"calc": calc}), limits=TurnLimits(), max_response_length=30,
                            max_context=400, log=lambda *_: None)
    with pytest.raises(RuntimeError, match="row 0: the engine returned no token"):
        loop.run([_sample(tok, template, "What is 2+3?")], PARAMS)
    assert len(calls) == 1 and calc.released == ["r0-calc"]


@pytest.mark.parametrize("extra, fragment", [
    ({"interaction_kwargs": {"name": "gsm8k", "ground_truth": "72"}},
     "data row test:0: tool 'calc_gsm8k_reward' cannot start with it: tool 'calc_gsm8k_reward': create needs "
     "ground_truth"),
    ({"tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": ["72"]}}},
      "interaction_kwargs": {"name": "gsm8k", "ground_truth": "72"}}, "got ['72']"),
    ({"tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}},
      "interaction_kwargs": {"name": "gsm8k"}}, "interaction 'gsm8k' cannot start with it: interaction 'gsm8k': "
                                                 "start needs ground_truth"),
])
def test_a_row_the_built_in_tools_cannot_start_with_is_refused_at_start(tok, template, extra, fragment):
    """verl's gsm8k tool / interaction need the row's ground truth in its kwargs: a row without it is named
    when the run starts, not at the step that draws it (where its create would stop the run)."""
    from types import SimpleNamespace

    from pfppo_mega.rollout.multiturn import ToolSet
    from pfppo_mega.rollout.tools.answers import Gsm8kInteraction, Gsm8kTool
    from pfppo_mega.trainer.build import check_turn_rows

    schema = {"type": "function", "function": {"name": "calc_gsm8k_reward", "description": "grade",
                                               "parameters": {"type": "object", "properties": {}, "required": []}}}
    turns = SimpleNamespace(toolset=ToolSet({"calc_gsm8k_reward": Gsm8kTool(config={}, tool_schema=schema)},
                                            {"gsm8k": Gsm8kInteraction(config={"name": "gsm8k"})}))
    good = _sample(tok, template, "What is 2+3?", {
        "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}},
        "interaction_kwargs": {"name": "gsm8k", "ground_truth": "72"}}, i=1)
    check_turn_rows(turns, [good], log=lambda *_: None)
    with pytest.raises(ToolSetupError, match=re.escape(fragment)):
        check_turn_rows(turns, [_sample(tok, template, "What is 2+3?", extra), good], log=lambda *_: None)
