"""Multi-turn tools, the gsm8k interaction, the tool / interaction config files, and the code reward
(rollout/tools/, rewards/sandbox_fusion.py). The HTTP clients talk to real local services
(tests/tool_servers.py): a SandboxFusion stand-in that runs the code in a subprocess, a retrieval
service over a small corpus, and services that hang, fail or answer garbage.

Expected values are written out from verl's rules (verl.tools.gsm8k_tool, verl.interactions.
gsm8k_interaction, verl.utils.reward_score.sandbox_fusion), not recomputed by our code."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tool_servers as S  # noqa: E402

from pfppo_mega.rewards.base import RuleReward  # noqa: E402
from pfppo_mega.rewards.sandbox_fusion import (SandboxCodeReward, SandboxFusionClient, SandboxFusionError,  # noqa: E402
                                               SandboxTimeout, extract_code)
from pfppo_mega.rollout.tools.answers import grade_math_answer, gsm8k_answer  # noqa: E402
from pfppo_mega.rollout.tools.base import Interaction, InteractionTurn, Tool, ToolResult  # noqa: E402
from pfppo_mega.rollout.tools.registry import (load_interactions, load_tools, validate_interaction_config,  # noqa: E402
                                               validate_tool_config)
from pfppo_mega.rollout.tools.search import SearchError, SearchTimeout  # noqa: E402
from pfppo_mega.types import Sample  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "tools"


def _with_url(name: str, key: str, url: str, tmp_path: Path, **extra) -> Path:
    """A copy of tests/data/tools/<name> whose service URL is `url` (and `extra` config keys)."""
    import yaml
    doc = yaml.safe_load((DATA / name).read_text())
    doc["tools"][0]["config"].update({key: url, **extra})
    out = tmp_path / name
    out.write_text(yaml.safe_dump(doc))
    return out


# ----------------------------------------------------------------------------- gsm8k / geo3k / interaction


def test_gsm8k_tool_follows_verl_scores_and_penalty():
    tool = load_tools(DATA / "gsm8k_tool_config.yaml")["calc_gsm8k_reward"]
    assert isinstance(tool, Tool) and tool.schema["function"]["parameters"]["required"] == ["answer"]
    tool.create("row", ground_truth="72")
    # (answer, text, step reward, score): the step costs -0.05 unless the score beats the previous call's
    expected = [
        ("70", "Current parsed answer='70' reward=0.0", -0.05, 0.0),
        ("It is 72 apples", "Current parsed answer='It is 72 apples' reward=1.0", 0.0, 1.0),  # last number read
        ("72", "Current parsed answer='72' reward=1.0", -0.05, 1.0),  # right again: no improvement
        ("72.0", "Current parsed answer='72.0' reward=0.0", -0.05, 0.0),  # string equality, as verl
        ("#### 72", "Current parsed answer='#### 72' reward=1.0", 0.0, 1.0),  # "#### " not doubled
    ]
    for answer, text, step, score in expected:
        assert tool.execute("row", {"answer": answer}) == ToolResult(text, step, {"score": score}), answer
    assert tool.execute("row", {"answer": 72}).metrics == {"score": 1.0}  # a number is read as its string
    tool.create("other", ground_truth="1234")
    assert tool.execute("other", {"answer": "1,234"}).metrics == {"score": 0.0}  # flexible keeps the comma
    tool.release("row")
    with pytest.raises(KeyError, match="no instance 'row'"):
        tool.execute("row", {"answer": "72"})


def test_gsm8k_answer_rules():
    assert gsm8k_answer("so #### 1,234 dollars", "strict") == "1234"
    assert gsm8k_answer("#### $5", "strict") is None  # verl's strict pattern wants the digits right after "#### "
    assert gsm8k_answer("no marker 5", "strict") is None
    assert gsm8k_answer("first 3 then 4.", "flexible") == "4."
    assert gsm8k_answer("x" * 400 + " 9", "flexible") == "9"
    assert gsm8k_answer("7 " + "x" * 400, "flexible") is None  # only the last 300 characters are read


@pytest.mark.parametrize("given,truth,same", [
    ("2\\sqrt{3}", "2\\sqrt{3}", True), ("\\sqrt{12}", "2\\sqrt{3}", True), ("3.4641016151377544", "2\\sqrt{3}", True),
    ("\\frac{40}{3}", "13.333333333333334", True), ("40/3", "\\frac{40}{3}", True), ("60^\\circ", "60", True),
    ("8\\pi", "8 \\pi", True), ("\\sqrt[3]{27}", "3", True), ("3.46", "2\\sqrt{3}", False), ("4", "5", False),
    ("", "0", False), ("x+1", "1+x", False),  # no symbolic algebra (mathruler's sympy would say equal)
])
def test_geo3k_grading(given, truth, same):
    assert grade_math_answer(given, truth) is same


def test_geo3k_tool():
    tool = load_tools(DATA / "geo3k_tool_config.yaml")["calc_geo3k_reward"]
    tool.create("r", ground_truth="\\frac{16}{3}")
    assert tool.execute("r", {"answer": "5.33"}) == ToolResult("Current parsed answer='5.33' reward=0.0", -0.05,
                                                               {"score": 0.0})
    assert tool.execute("r", {"answer": "16/3"}) == ToolResult("Current parsed answer='16/3' reward=1.0", 0.0,
                                                               {"score": 1.0})


def test_gsm8k_interaction():
    (name,) = validate_interaction_config(DATA / "gsm8k_interaction_config.yaml")
    inter = load_interactions(DATA / "gsm8k_interaction_config.yaml")[name]
    assert name == "gsm8k" and isinstance(inter, Interaction) and inter.name == "gsm8k"
    inter.start("r", ground_truth="1234")
    wrong = inter.respond("r", [{"role": "user", "content": "q"}, {"role": "assistant", "content": "1234"}])
    assert (wrong.terminate, wrong.score) == (False, 0.0) and wrong.text  # strict: no "#### " -> wrong
    right = inter.respond("r", [{"role": "assistant", "content": "#### 1,234"},  # an older turn
                                {"role": "user", "content": "again"},
                                {"role": "assistant", "content": "so #### 1,234"}])
    assert (right.terminate, right.score) == (True, 1.0)
    last_wrong = inter.respond("r", [{"role": "assistant", "content": "#### 1234"},
                                     {"role": "assistant", "content": "#### 12"}])  # the last assistant turn counts
    assert last_wrong == InteractionTurn(False, wrong.text, 0.0)
    inter.finish("r")
    with pytest.raises(KeyError):
        inter.respond("r", [])


# ----------------------------------------------------------------------------- sandbox fusion client + code reward


def test_sandbox_client_round_trips():
    app = S.sandbox_fusion()
    with S.serve(app) as url:
        c = SandboxFusionClient(url, memory_limit_mb=256)
        r = c.run("import sys; print(sys.stdin.read().upper(), end='')", stdin="abc")
        assert (r.status, r.run_status, r.return_code, r.stdout) == ("Success", "Finished", 0, "ABC")
        assert r.passes("ABC\n") and not r.passes("abc")
        bad = c.run("raise SystemExit(3)")
        assert (bad.status, bad.finished, bad.return_code, bad.clean) == ("Failed", True, 3, False)
        t0 = time.monotonic()
        slow = c.run("import time; time.sleep(30)", timeout_s=0.5)
        assert slow.run_status == "TimeLimitExceeded" and time.monotonic() - t0 < 10
    req = app.requests[0]
    assert (req["code"], req["stdin"], req["language"], req["memory_limit_MB"], req["run_timeout"]) == (
        "import sys; print(sys.stdin.read().upper(), end='')", "abc", "python", 256, 10.0)


def test_sandbox_client_service_failures_are_named():
    with S.serve(S.hanging()) as url:
        t0 = time.monotonic()
        with pytest.raises(SandboxTimeout, match="no answer within 1.2 s"):
            SandboxFusionClient(url, slack_s=0.2).run("print(1)", timeout_s=0.5)
        assert time.monotonic() - t0 < 5
    app = S.failing(500)
    with S.serve(app) as url, pytest.raises(SandboxFusionError, match="HTTP 500"):
        SandboxFusionClient(url).run("print(1)")
    assert len(app.requests) == 1  # not a gateway error: no retry
    app = S.failing(504)
    with S.serve(app) as url, pytest.raises(SandboxFusionError, match="HTTP 504.*attempt 3 of 3"):
        SandboxFusionClient(url, retry_delay_s=0.01).run("print(1)")
    assert len(app.requests) == 3
    with S.serve(S.garbage()) as url, pytest.raises(SandboxFusionError, match="not JSON"):
        SandboxFusionClient(url).run("print(1)")
    with S.serve(S.App(lambda req: (200, b'{"status": "SandboxError", "message": "pod died"}'))) as url:
        with pytest.raises(SandboxFusionError, match="pod died"):
            SandboxFusionClient(url).run("print(1)")
    with pytest.raises(SandboxFusionError, match="unreachable"):
        SandboxFusionClient("http://127.0.0.1:9/run_code").run("print(1)")


@pytest.mark.parametrize("text,code", [
    ("x\n```python\nprint(1)\n```\nthen\n```python\nprint(2)\n```", "\nprint(2)\n"),  # the last python block
    ("```\nprint(3)\n```", "\nprint(3)\n"),  # an empty first line is no language tag
    ("```py3\nprint(4)\n```", "py3\nprint(4)\n"),  # "py3" is not letters only: kept, as verl keeps it
    ("```cpp\nint main(){}\n```", "int main(){}\n"),
    ("print(5)", None),
])
def test_extract_code(text, code):
    assert extract_code(text) == code


SUM = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"


def test_code_reward_scores_pass_fraction_of_first_ten_cases():
    twelve = {"inputs": [f"{i} 1\n" for i in range(12)],
              "outputs": [f"{i + 1}\n" if i % 2 == 0 else "0\n" for i in range(12)]}  # the even cases are right
    sf = S.sandbox_fusion()
    with S.serve(sf) as url:
        reward = SandboxCodeReward(SandboxFusionClient(url, max_concurrent=4), case_timeout_s=5)
        got = reward([SUM, "no code here", SUM, "```python\nwhile True: pass\n```",
                      "```python\ndef add(a, b):\n    return a + b\n```", "```python\nprint(oops)\n```"],
                     [json.dumps(twelve), json.dumps(twelve),
                      json.dumps({"inputs": ["2 3", "1 1"], "outputs": ["5", "3"]}),
                      {"inputs": ["1 1"], "outputs": ["2"]},
                      {"fn_name": "add", "inputs": [[1, 2], "3\n4"], "outputs": [3, "7"]},
                      {"assert_case": ["assert 1 == 1"]}])
    # 5 of the first 10 even cases right; no code: 0; 1 of 2; a hang fails its case; call-based 2 of 2;
    # an assert case whose program raises NameError fails
    assert got == [("value", 0.5), ("value", 0.0), ("value", 0.5), ("value", 0.0), ("value", 1.0), ("value", 0.0)]
    assert len([r for r in sf.requests if r["code"].lstrip().startswith("a, b")]) == 10 + 2  # cases past 10 are not run


def test_code_reward_service_down_is_an_error_not_a_zero():
    with S.serve(S.hanging()) as url:
        reward = SandboxCodeReward(SandboxFusionClient(url, slack_s=0.1), case_timeout_s=0.2)
        ((kind, why),) = reward([SUM], [{"inputs": ["1 1"], "outputs": ["2"]}])
    assert kind == "raised" and "test case 0" in why and "no answer within" in why


def test_rule_reward_runs_code_rows_through_the_sandbox():
    rows = [Sample((1,), "codecontests", json.dumps({"inputs": ["1 2"], "outputs": ["3"]}), row="f:0"),
            Sample((1,), "openai/gsm8k", "72", row="f:1"),
            Sample((1,), "apps", {"inputs": ["1 2"], "outputs": ["4"]}, row="f:2")]
    logs = []
    with S.serve(S.sandbox_fusion()) as url:
        reward = RuleReward(code=SandboxCodeReward(SandboxFusionClient(url)), log=logs.append)
        reward.check(rows, "data")
        res = reward(rows, [SUM, "#### 72", SUM], [True] * 3)
    assert res.scores.tolist() == [1.0, 1.0, 0.0] and res.outcomes == ["ok"] * 3
    with S.serve(S.failing(500)) as url:
        res = RuleReward(code=SandboxCodeReward(SandboxFusionClient(url)), log=logs.append)(rows, [SUM, "#### 72", SUM],
                                                                                             [True] * 3)
    assert res.outcomes == ["reward_errors", "ok", "reward_errors"] and res.scores.tolist() == [0.0, 1.0, 0.0]
    assert "HTTP 500" in logs[-1] and "test case 0" in logs[-1]


def test_reward_config_builds_the_code_reward():
    from pfppo_mega.config import load_config_dict
    from pfppo_mega.rewards import build_reward_fn
    cfg = load_config_dict({"actor_rollout": {"model_path": "/m"}, "data": {"source": "files", "train_files": ["t.jsonl"]},
                            "reward": {"sandbox_fusion": {"url": "http://127.0.0.1:1/run_code", "max_concurrent": 3,
                                                          "memory_limit_mb": 300, "case_timeout_s": 2.5}}})
    fn = build_reward_fn(cfg, log=lambda s: None)
    assert isinstance(fn, RuleReward) and fn.code.case_timeout_s == 2.5
    assert (fn.code.client.url, fn.code.client.max_concurrent, fn.code.client.memory_limit_mb) == (
        "http://127.0.0.1:1/run_code", 3, 300)
    plain = build_reward_fn(load_config_dict({"actor_rollout": {"model_path": "/m"}, "data": {"source": "files", "train_files": ["t.jsonl"]}}),
                            log=lambda s: None)
    assert plain.code is None


# ----------------------------------------------------------------------------- the code interpreter tool


def test_sandbox_fusion_tool(tmp_path):
    with S.serve(S.sandbox_fusion()) as url:
        tools = load_tools(_with_url("sandbox_fusion_tool_config.yaml", "sandbox_fusion_url", url, tmp_path))
        tool = tools["code_interpreter"]
        tool.create("r")
        assert tool.execute("r", {"code": "print(6 * 7)"}) == ToolResult("42\n", None, {"time_limit": 0.0,
                                                                                       "exit_nonzero": 0.0})
        err = tool.execute("r", {"code": "print('before')\n1 / 0"})
        assert err.text.startswith("before\nTraceback") and "ZeroDivisionError" in err.text
        assert err.metrics == {"time_limit": 0.0, "exit_nonzero": 1.0}
        slow = tool.execute("r", {"code": "import time; time.sleep(20)", "timeout": 0.5})
        assert slow == ToolResult("(no output: the program ran past its 0.5 s limit)", None,
                                  {"time_limit": 1.0, "exit_nonzero": 0.0})
        with pytest.raises(ValueError, match="'language' 'cobol'"):
            tool.execute("r", {"code": "x", "language": "cobol"})
        tool.release("r")
    with S.serve(S.failing(500)) as url:
        tool = load_tools(_with_url("sandbox_fusion_tool_config.yaml", "sandbox_fusion_url", url, tmp_path))[
            "code_interpreter"]
        tool.create("r")
        with pytest.raises(SandboxFusionError, match="HTTP 500"):
            tool.execute("r", {"code": "print(1)"})


# ----------------------------------------------------------------------------- search


def test_search_tool_round_trip(tmp_path):
    app = S.retrieval()
    with S.serve(app, "/retrieve") as url:
        tool = load_tools(_with_url("search_tool_config.yaml", "retrieval_service_url", url, tmp_path, topk=2))["search"]
        tool.create("r")
        out = tool.execute("r", {"query_list": ["capital of France", "highest mountain"]})
    assert app.requests == [{"queries": ["capital of France", "highest mountain"], "topk": 2, "return_scores": True}]
    assert json.loads(out.text) == {"result": (
        "Doc 1 (Title: Paris)\nParis is the capital and largest city of France.\n\n"
        "Doc 2 (Title: Berlin)\nBerlin is the capital of Germany.\n---\n"
        "Doc 1 (Title: Mount Everest)\nMount Everest is Earth's highest mountain above sea level.\n\n"
        "Doc 2 (Title: Paris)\nParis is the capital and largest city of France.")}
    assert out.reward is None and out.metrics == {"query_count": 2.0, "total_results": 4.0}
    with S.serve(S.App(lambda req: (200, b'{"result": []}')), "/retrieve") as url:
        tool = load_tools(_with_url("search_tool_config.yaml", "retrieval_service_url", url, tmp_path))["search"]
        tool.create("r")
        assert json.loads(tool.execute("r", {"query_list": ["q"]}).text) == {"result": "No search results found."}
    with S.serve(S.App(lambda req: (200, b'{"result": [[]]}')), "/retrieve") as url:
        tool = load_tools(_with_url("search_tool_config.yaml", "retrieval_service_url", url, tmp_path))["search"]
        tool.create("r")
        with pytest.raises(SearchError, match="one list of documents per query, 2 queries"):
            tool.execute("r", {"query_list": ["q1", "q2"]})  # one list for two queries
    with S.serve(S.App(lambda req: (200, b'{"result": [[{"document": {"title": "no contents"}}]]}')), "/retrieve") as url:
        tool = load_tools(_with_url("search_tool_config.yaml", "retrieval_service_url", url, tmp_path))["search"]
        tool.create("r")
        with pytest.raises(SearchError, match="each document"):
            tool.execute("r", {"query_list": ["q"]})
    with pytest.raises(ValueError, match="'query_list' must be a non-empty list"):
        tool.execute("r", {"query_list": "capital"})


def test_search_tool_failures_are_named_and_bounded(tmp_path):
    fast = {"timeout": 0.3, "max_retries": 2, "retry_delay_s": 0.01}
    # (service, error, message, requests it saw): 500 is retried (verl retries 500-504), 404 is not
    cases = [(S.hanging(), SearchTimeout, "no answer within 0.3 s \\(after 2 tries\\)", 2),
             (S.failing(500), SearchError, "HTTP 500.*after 2 tries", 2),
             (S.failing(404), SearchError, "HTTP 404", 1),
             (S.garbage(), SearchError, "not JSON", 1)]
    for app, error, message, requests in cases:
        with S.serve(app, "/retrieve") as url:
            tool = load_tools(_with_url("search_tool_config.yaml", "retrieval_service_url", url, tmp_path, **fast))["search"]
            tool.create("r")
            t0 = time.monotonic()
            with pytest.raises(error, match=message):
                tool.execute("r", {"query_list": ["q"]})
            assert time.monotonic() - t0 < 5
        assert len(app.requests) == requests, message


# ----------------------------------------------------------------------------- registry and user classes


def test_verl_layout_files_validate_without_network():
    assert [validate_tool_config(DATA / f"{n}_tool_config.yaml") for n in ("gsm8k", "geo3k", "search", "sandbox_fusion")] \
        == [["calc_gsm8k_reward"], ["calc_geo3k_reward"], ["search"], ["code_interpreter"]]


USER_MODULE = '''
import asyncio
from pfppo_mega.rollout.tools.base import ToolResult


class Counter:
    """Sync, our protocol."""
    def __init__(self, config, tool_schema):
        self.step = config["step"]
        self.n = {}
    def create(self, instance_id, **kw):
        self.n[instance_id] = kw.get("start", 0)
    def execute(self, instance_id, arguments):
        self.n[instance_id] += self.step
        return ToolResult(str(self.n[instance_id]), reward=0.5)
    def release(self, instance_id):
        del self.n[instance_id]


class Response:
    def __init__(self, text):
        self.text, self.image, self.video = text, None, None


class VerlStyle:
    """verl's shape without verl: async methods, (response, reward, metrics) results."""
    def __init__(self, config, tool_schema):
        self.seen = []
    async def create(self, instance_id=None, **kw):
        await asyncio.sleep(0)
        return instance_id, Response("")
    async def execute(self, instance_id, parameters, **kw):
        await asyncio.sleep(0)
        self.seen.append(parameters["x"])
        return Response(f"got {parameters['x']}"), None, {"calls": len(self.seen), "status": "success"}
    async def release(self, instance_id, **kw):
        pass


class Echo:
    """verl's interaction method names, async."""
    def __init__(self, config):
        self.name = config["name"]
    async def start_interaction(self, instance_id=None, **kw):
        return instance_id
    async def generate_response(self, instance_id, messages, **kw):
        return len(messages) > 2, "say more", 0.25, {"turns": len(messages)}
    async def finalize_interaction(self):
        pass
'''


def _user_module(tmp_path, monkeypatch, name="user_tools_mod"):
    (tmp_path / f"{name}.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop(name, None)


def _schema(name):
    return {"type": "function", "function": {"name": name, "description": "d", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": []}}}


def test_user_tool_classes_sync_and_async(tmp_path, monkeypatch):
    import yaml
    _user_module(tmp_path, monkeypatch)
    f = tmp_path / "tools.yaml"
    f.write_text(yaml.safe_dump({"tools": [
        {"class_name": "user_tools_mod.Counter", "config": {"type": "native", "step": 2}, "tool_schema": _schema("count")},
        {"class_name": "user_tools_mod.VerlStyle", "config": {"type": "native"}, "tool_schema": _schema("verly")}]}))
    tools = load_tools(f)
    assert sorted(tools) == ["count", "verly"] and all(isinstance(t, Tool) for t in tools.values())
    count, verly = tools["count"], tools["verly"]
    assert count.schema == _schema("count")
    count.create("a", start=10)
    assert [count.execute("a", {}) for _ in range(2)] == [ToolResult("12", 0.5), ToolResult("14", 0.5)]
    verly.create("b")
    assert verly.execute("b", {"x": 3}) == ToolResult("got 3", None, {"calls": 1.0})  # "status" is not a number
    verly.release("b")
    g = tmp_path / "inter.yaml"
    g.write_text(yaml.safe_dump({"interaction": [{"class_name": "user_tools_mod.Echo", "config": {}}]}))
    (name,) = validate_interaction_config(g)
    inter = load_interactions(g)[name]
    assert name == "echo"  # verl's default name: the class name less "Interaction", lower case
    inter.start("i")
    assert inter.respond("i", [{}, {}]) == InteractionTurn(False, "say more", 0.25, {"turns": 2.0})
    assert inter.respond("i", [{}, {}, {}]).terminate is True
    inter.finish("i")


def test_search_and_code_configs_have_verl_defaults(tmp_path):
    tools = load_tools(DATA / "sandbox_fusion_tool_config.yaml")
    t = tools["code_interpreter"]
    assert (t.default_timeout, t.default_language, t.client.memory_limit_mb, t.client.max_concurrent) == (5.0, "python",
                                                                                                         512, 4)
    s = load_tools(DATA / "search_tool_config.yaml")["search"]
    assert (s.topk, s.client.timeout_s, s.client.max_retries) == (3, 30.0, 10)  # verl: topk 3, 10 tries


# ----------------------------------------------------------------------------- concurrency bounds and verl keys


def _slow_counting(answer: bytes):
    """A service that holds each request 0.15 s and records the most requests it held at once."""
    state = {"now": 0, "most": 0}
    lock = __import__("threading").Lock()

    def handle(req):
        with lock:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
        time.sleep(0.15)
        with lock:
            state["now"] -= 1
        return 200, answer
    return S.App(handle), state


def test_concurrency_is_bounded(tmp_path):
    ok = json.dumps({"status": "Success", "run_result": {"status": "Finished", "return_code": 0, "stdout": "2\n",
                                                          "stderr": ""}}).encode()
    app, state = _slow_counting(ok)
    with S.serve(app) as url:
        reward = SandboxCodeReward(SandboxFusionClient(url, max_concurrent=2))
        got = reward([SUM] * 4, [{"inputs": ["1 1"] * 2, "outputs": ["2"] * 2}] * 4)
    assert got == [("value", 1.0)] * 4 and len(app.requests) == 8 and state["most"] == 2
    app, state = _slow_counting(b'{"result": [[]]}')
    with S.serve(app, "/retrieve") as url:
        tool = load_tools(_with_url("search_tool_config.yaml", "retrieval_service_url", url, tmp_path, rate_limit=3))[
            "search"]
        from concurrent.futures import ThreadPoolExecutor
        for i in range(9):
            tool.create(str(i))
        with ThreadPoolExecutor(9) as pool:
            list(pool.map(lambda i: tool.execute(str(i), {"query_list": ["q"]}), range(9)))
    assert len(app.requests) == 9 and state["most"] == 3


def test_verl_sandbox_fusion_keys_map_onto_ours():
    from pfppo_mega.config import resolve_config_dict
    base = ["actor_rollout_ref.model.path=/m", "data.train_files=t.parquet"]
    url = "reward_model.sandbox_fusion.url=http://sf:8080/run_code"
    res = resolve_config_dict({}, base + [url, "reward_model.sandbox_fusion.max_concurrent=128",
                                          "reward_model.sandbox_fusion.memory_limit_mb=2048"])
    assert res.config.reward.sandbox_fusion.url == "http://sf:8080/run_code"
    assert (res.config.reward.sandbox_fusion.max_concurrent, res.config.reward.sandbox_fusion.memory_limit_mb) == (128, 2048)
    outcomes = {u.key: u.outcome for u in res.verl.uses if "sandbox" in u.key}
    assert outcomes == {"reward_model.sandbox_fusion.url": "mapped", "reward_model.sandbox_fusion.max_concurrent": "mapped",
                        "reward_model.sandbox_fusion.memory_limit_mb": "mapped"}
    # verl's default scorer alone reads them: no url, or a custom reward function -> ignored, ours unset
    for extra in ([], [url, "custom_reward_function.path=r.py"]):
        res = resolve_config_dict({}, base + extra + ["reward_model.sandbox_fusion.max_concurrent=128"])
        assert res.config.reward.sandbox_fusion.url is None and res.config.reward.sandbox_fusion.max_concurrent == 64
        assert {u.outcome for u in res.verl.uses if u.key.startswith("reward_model.sandbox_fusion")} == {"ignored"}
