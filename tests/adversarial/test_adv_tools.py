"""Bad tool / interaction config files, bad user classes, bad tool calls and bad code-reward settings:
each refused with a named error (file, entry, key, value, what is allowed), never a crash or a silent
default (rollout/tools/registry.py, rewards/sandbox_fusion.py, reward.sandbox_fusion)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from pfppo_mega.config import ConfigError, load_config_dict
from pfppo_mega.rewards.base import RewardSetupError, RuleReward
from pfppo_mega.rewards.sandbox_fusion import SandboxCodeReward, SandboxFusionClient, parse_test_cases
from pfppo_mega.rollout.tools.base import ToolSetupError
from pfppo_mega.rollout.tools.registry import (load_interactions, load_tools, validate_interaction_config,
                                               validate_tool_config)
from pfppo_mega.types import Sample

GSM8K = """  - class_name: verl.tools.gsm8k_tool.Gsm8kTool
    config: {type: native}
    tool_schema:
      type: function
      function:
        name: calc_gsm8k_reward
        description: grades
        parameters: {type: object, properties: {answer: {type: string}}, required: [answer]}
"""
SEARCH = """  - class_name: verl.tools.search_tool.SearchTool
    config: {type: native, retrieval_service_url: "http://127.0.0.1:8000/retrieve"%s}
    tool_schema:
      type: function
      function: {name: search, description: d, parameters: {type: object, properties: {query_list: {type: array}}, required: [query_list]}}
"""


def _schema_entry(schema: str, cls: str = "verl.tools.gsm8k_tool.Gsm8kTool", config: str = "{type: native}") -> str:
    return f"tools:\n  - class_name: {cls}\n    config: {config}\n    tool_schema: {schema}\n"


FN = "{type: function, function: %s}"
PARAMS = "{name: t, description: d, parameters: %s}"

# (name, file text, phrases the message must hold)
BAD_TOOL_FILES = [
    ("not YAML", "tools: [\n  - {a: 1", ["not YAML"]),
    ("top level is a list", "- 1\n- 2", ["needs a top-level 'tools:' list", "list"]),
    ("no tools key", "tool: []\n", ["needs a top-level 'tools:' list", "['tool']"]),
    ("tools not a list", "tools: {a: 1}\n", ["tools = {'a': 1}", "must be a list of entries"]),
    ("extra top-level key", "tools: []\nextra: 1\n", ["extra = 1", "unknown top-level key; allowed: tools"]),
    ("entry not a mapping", "tools:\n  - just a string\n", ["tools[0]", "entry = 'just a string'", "must be a mapping"]),
    ("unknown entry key", "tools:\n" + GSM8K + "    schema: {}\n", ["tools[0]", "schema = {}", "unknown key; allowed:",
                                                                      "'tool_schema'"]),
    ("class_name missing", "tools:\n  - config: {type: native}\n", ["class_name = None", "module.Class",
                                                                   "verl.tools.gsm8k_tool.Gsm8kTool"]),
    ("class_name not dotted", _schema_entry("{}", cls="Gsm8kTool"), ["class_name = 'Gsm8kTool'", "module.Class"]),
    ("unknown verl class", _schema_entry("{}", cls="verl.tools.my_tool.MyTool"),
     ["class_name = 'verl.tools.my_tool.MyTool'", "not a verl class provided here", "verl.tools.search_tool.SearchTool"]),
    ("MCP tool", (Path(__file__).parents[1] / "data" / "tools" / "mcp_tool_config.yaml").read_text(),
     ["verl.tools.mcp_search_tool.MCPSearchTool", "refused", "MCP tool"]),
    ("MCP type on a native class", _schema_entry("{}", config="{type: mcp}"), ["config.type = 'mcp'", "refused",
                                                                               "MCP"]),
    ("image tool", _schema_entry("{}", cls="verl.tools.image_zoom_in_tool.ImageZoomInTool"),
     ["ImageZoomInTool", "refused", "image", "text only"]),
    ("verl's base class", _schema_entry("{}", cls="verl.tools.base_tool.BaseTool"), ["BaseTool", "refused",
                                                                                    "fixed text"]),
    ("type missing", _schema_entry("{}", config="{}"), ["config.type = None", "allowed: native"]),
    ("type unknown", _schema_entry("{}", config="{type: remote}"), ["config.type = 'remote'", "allowed: native"]),
    ("config not a mapping", _schema_entry("{}", config="[native]"), ["config = ['native']", "must be a mapping"]),
    ("unknown config key", _schema_entry("{}", config="{type: native, ground_truth: 5}"),
     ["config.ground_truth = 5", "unknown key of Gsm8kTool", "allowed: ['type']"]),
    ("config wrong type", "tools:\n" + SEARCH % ", topk: '3'", ["tools[0]", "config.topk = '3'", "is a str",
                                                                 "allowed: an integer >= 1 and <= 1000"]),
    ("config out of range", "tools:\n" + SEARCH % ", topk: 0", ["config.topk = 0", "out of range", ">= 1"]),
    ("config bool for a number", "tools:\n" + SEARCH % ", timeout: true", ["config.timeout = True", "is a bool"]),
    ("config bad url", "tools:\n" + SEARCH.replace("http://127.0.0.1:8000/retrieve", "127.0.0.1:8000") % "",
     ["config.retrieval_service_url = '127.0.0.1:8000'", "not an http(s) URL"]),
    ("config required key missing", "tools:\n" + SEARCH.replace(', retrieval_service_url: "http://127.0.0.1:8000/retrieve"', "") % "",
     ["config.retrieval_service_url = None", "required by SearchTool", "URL"]),
    ("code tool language", _schema_entry(FN % (PARAMS % "{type: object, properties: {}, required: []}"),
                                         cls="verl.tools.sandbox_fusion_tools.SandboxFusionTool",
                                         config="{type: native, sandbox_fusion_url: 'http://x/run_code', default_language: cobol}"),
     ["config.default_language = 'cobol'", "is not a choice", "'python'"]),
    ("schema missing", "tools:\n  - class_name: verl.tools.gsm8k_tool.Gsm8kTool\n    config: {type: native}\n",
     ["tool_schema = None", "required"]),
    ("schema not a mapping", _schema_entry("calc"), ["tool_schema = 'calc'", "must be a mapping"]),
    ("schema type", _schema_entry("{type: tool, function: {}}"), ["tool_schema.type = 'tool'", "allowed: function"]),
    ("function missing", _schema_entry("{type: function}"), ["tool_schema.function = None", "name, description"]),
    ("name missing", _schema_entry(FN % "{description: d}"), ["tool_schema.function.name = None", "1-64 letters"]),
    ("name with spaces", _schema_entry(FN % "{name: my tool, description: d}"),
     ["tool_schema.function.name = 'my tool'", "1-64 letters"]),
    ("description missing", _schema_entry(FN % "{name: t}"), ["tool_schema.function.description = None", "string"]),
    ("parameters not a mapping", _schema_entry(FN % (PARAMS % "[answer]")),
     ["tool_schema.function.parameters = ['answer']", "must be a mapping"]),
    ("properties missing", _schema_entry(FN % (PARAMS % "{type: object, required: []}")),
     ["tool_schema.function.parameters.properties = None", "mapping"]),
    ("property without type", _schema_entry(FN % (PARAMS % "{type: object, properties: {a: {description: x}}, required: []}")),
     ["tool_schema.function.parameters.properties.a", "string 'type'"]),
    ("required missing", _schema_entry(FN % (PARAMS % "{type: object, properties: {}}")),
     ["tool_schema.function.parameters.required = None", "list of parameter names"]),
    ("required names an unknown parameter", _schema_entry(FN % (PARAMS % "{type: object, properties: {a: {type: string}}, required: [b]}")),
     ["parameters.required = ['b']", "not among the properties ['a']"]),
    ("duplicate tool name", "tools:\n" + GSM8K + GSM8K, ["tools[1] (calc_gsm8k_reward)", "duplicate",
                                                        "tools[0] (calc_gsm8k_reward) has it too"]),
    ("user module missing", _schema_entry("{}", cls="no_such_module_xyz.Tool"),
     ["class_name = 'no_such_module_xyz.Tool'", "cannot be imported", "PYTHONPATH"]),
]


@pytest.mark.parametrize("name,text,phrases", BAD_TOOL_FILES, ids=[c[0] for c in BAD_TOOL_FILES])
def test_bad_tool_file_is_refused_by_name(tmp_path, name, text, phrases):
    f = tmp_path / "tools.yaml"
    f.write_text(text)
    for check in (validate_tool_config, load_tools):
        with pytest.raises(ToolSetupError) as e:
            check(f)
        msg = str(e.value)
        assert msg.startswith(str(f)), msg
        for phrase in phrases:
            assert phrase in msg, (phrase, msg)


def test_missing_file(tmp_path):
    with pytest.raises(ToolSetupError, match="no such file"):
        validate_tool_config(tmp_path / "nope.yaml")
    with pytest.raises(ToolSetupError, match="no such file"):
        load_interactions(tmp_path / "nope.yaml")


BAD_USER = '''
import verl.tools.base_tool  # a subclass of verl's BaseTool


class Mine:
    pass
'''
PARTIAL = '''
class NoRelease:
    def __init__(self, config, tool_schema):
        pass
    def create(self, instance_id, **kw):
        pass
    def execute(self, instance_id, arguments):
        return "x"


class Refuses:
    def __init__(self, config, tool_schema):
        raise ValueError("needs an api_key")


class Wrong:
    def __init__(self, config, tool_schema):
        pass
    def create(self, instance_id, **kw):
        pass
    def execute(self, instance_id, arguments):
        return 42
    def release(self, instance_id):
        pass


NOT_A_CLASS = 3
'''
BOOM = "raise RuntimeError('broken at import')\n"


@pytest.fixture
def user_modules(tmp_path, monkeypatch):
    for name, text in (("adv_verl_user", BAD_USER), ("adv_partial", PARTIAL), ("adv_boom", BOOM)):
        (tmp_path / f"{name}.py").write_text(text)
        sys.modules.pop(name, None)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("cls,phrases", [
    ("adv_verl_user.Mine", ["imports verl", "not installed", "without verl"]),
    ("adv_boom.Tool", ["importing 'adv_boom' raised RuntimeError: broken at import"]),
    ("adv_partial.Missing", ["module 'adv_partial' has no class 'Missing'"]),
    ("adv_partial.NOT_A_CLASS", ["has no class 'NOT_A_CLASS'"]),
])
def test_bad_user_class_refused_at_validation(user_modules, cls, phrases):
    f = user_modules / "t.yaml"
    f.write_text(_schema_entry(FN % (PARAMS % "{type: object, properties: {}, required: []}"), cls=cls))
    with pytest.raises(ToolSetupError) as e:
        validate_tool_config(f)
    for phrase in phrases:
        assert phrase in str(e.value), (phrase, str(e.value))


@pytest.mark.parametrize("cls,phrases", [
    ("adv_partial.NoRelease", ["has no method ['release']", "create", "execute"]),
    ("adv_partial.Refuses", ["building adv_partial.Refuses(config=...) raised ValueError: needs an api_key"]),
])
def test_bad_user_class_refused_at_load(user_modules, cls, phrases):
    f = user_modules / "t.yaml"
    f.write_text(_schema_entry(FN % (PARAMS % "{type: object, properties: {}, required: []}"), cls=cls))
    assert validate_tool_config(f) == ["t"]  # builds nothing
    with pytest.raises(ToolSetupError) as e:
        load_tools(f)
    for phrase in phrases:
        assert phrase in str(e.value), (phrase, str(e.value))


def test_user_tool_wrong_return_type_is_named(user_modules):
    f = user_modules / "t.yaml"
    f.write_text(_schema_entry(FN % (PARAMS % "{type: object, properties: {}, required: []}"), cls="adv_partial.Wrong"))
    tool = load_tools(f)["t"]
    tool.create("r")
    with pytest.raises(TypeError, match="execute returned int; expected a ToolResult"):
        tool.execute("r", {})


BAD_INTERACTION_FILES = [
    ("no interaction key", "interactions: []\n", ["needs a top-level 'interaction:' list"]),
    ("unknown verl interaction", "interaction:\n  - class_name: verl.interactions.my.MyInteraction\n",
     ["not a verl class provided here", "verl.interactions.gsm8k_interaction.Gsm8kInteraction"]),
    ("base interaction", "interaction:\n  - class_name: verl.interactions.base.BaseInteraction\n",
     ["refused", "score 0.8"]),
    ("empty name", "interaction:\n  - name: ''\n    class_name: verl.interactions.gsm8k_interaction.Gsm8kInteraction\n",
     ["name = ''", "non-empty string"]),
    ("duplicate name", "interaction:\n  - class_name: verl.interactions.gsm8k_interaction.Gsm8kInteraction\n"
                       "  - name: gsm8k\n    class_name: verl.interactions.gsm8k_interaction.Gsm8kInteraction\n",
     ["interaction[1] (gsm8k)", "duplicate"]),
    ("unknown config key", "interaction:\n  - class_name: verl.interactions.gsm8k_interaction.Gsm8kInteraction\n"
                           "    config: {max_turns: 3}\n", ["config.max_turns = 3", "unknown key of Gsm8kInteraction"]),
    ("unknown entry key", "interaction:\n  - class_name: verl.interactions.gsm8k_interaction.Gsm8kInteraction\n"
                          "    tool_schema: {}\n", ["tool_schema = {}", "unknown key"]),
]


@pytest.mark.parametrize("name,text,phrases", BAD_INTERACTION_FILES, ids=[c[0] for c in BAD_INTERACTION_FILES])
def test_bad_interaction_file_is_refused_by_name(tmp_path, name, text, phrases):
    f = tmp_path / "inter.yaml"
    f.write_text(text)
    for check in (validate_interaction_config, load_interactions):
        with pytest.raises(ToolSetupError) as e:
            check(f)
        for phrase in phrases:
            assert phrase in str(e.value), (phrase, str(e.value))


def test_bad_rows_for_the_answer_tools(tmp_path):
    f = tmp_path / "t.yaml"
    f.write_text("tools:\n" + GSM8K)
    tool = load_tools(f)["calc_gsm8k_reward"]
    for gt in (None, True, ["72"]):
        with pytest.raises(ValueError, match="create needs ground_truth"):
            tool.create("r", ground_truth=gt)
    with pytest.raises(KeyError, match="no instance 'never'"):
        tool.release("never")
    g = tmp_path / "i.yaml"
    g.write_text("interaction:\n  - class_name: verl.interactions.gsm8k_interaction.Gsm8kInteraction\n")
    inter = load_interactions(g)["gsm8k"]
    with pytest.raises(ValueError, match="start needs ground_truth"):
        inter.start("r")


# ----------------------------------------------------------------------------- the code reward's inputs


@pytest.mark.parametrize("gt,phrase", [
    ("not json", "is not JSON"), ("[1, 2]", "is a list"), ({"inputs": ["1"]}, "needs 'inputs' and 'outputs' lists"),
    ({"inputs": ["1", "2"], "outputs": ["1"]}, "2 inputs, 1 outputs"), ({"inputs": [], "outputs": []}, "at least one"),
    ({"assert_case": []}, "'assert_case' must be a non-empty list"), (None, "is a NoneType"),
    ({"inputs": ["1"], "outputs": ["1"], "fn_name": "my fn"}, "'fn_name' 'my fn' is not a Python identifier"),
])
def test_bad_test_cases_refused_at_start(gt, phrase):
    with pytest.raises(ValueError, match=phrase):
        parse_test_cases(gt)
    reward = RuleReward(code=SandboxCodeReward(SandboxFusionClient("http://127.0.0.1:1/run_code")))
    with pytest.raises(RewardSetupError) as e:
        reward.check([Sample((1,), "taco", gt, row="train.jsonl:7")], "data")
    assert "row train.jsonl:7" in str(e.value) and "'taco'" in str(e.value) and phrase.split("'")[0] in str(e.value)


def test_code_row_without_sandbox_names_the_key():
    with pytest.raises(RewardSetupError, match="reward.sandbox_fusion.url"):
        RuleReward().check([Sample((1,), "codeforces", json.dumps({"inputs": ["1"], "outputs": ["1"]}), row="f:0")],
                           "data")


def test_client_refuses_bad_url_and_language():
    with pytest.raises(ValueError, match="http:// or https://"):
        SandboxFusionClient("127.0.0.1:8080/run_code")
    with pytest.raises(ValueError, match="language 'cobol'"):
        SandboxFusionClient("http://127.0.0.1:1/run_code").run("x", language="cobol")


BASE = {"actor_rollout": {"model_path": "/m"}, "data": {"source": "files", "train_files": ["t.jsonl"]}}


@pytest.mark.parametrize("sf,key,phrase", [
    ({"url": "ftp://x/run_code"}, "reward.sandbox_fusion.url", "http:// or https://"),
    ({"url": ""}, "reward.sandbox_fusion.url", "http:// or https://"),
    ({"url": "http://x/run_code", "max_concurrent": 0}, "reward.sandbox_fusion.max_concurrent", ">= 1"),
    ({"url": "http://x/run_code", "memory_limit_mb": 0}, "reward.sandbox_fusion.memory_limit_mb", ">= 1"),
    ({"url": "http://x/run_code", "case_timeout_s": 0}, "reward.sandbox_fusion.case_timeout_s", "> 0"),
    ({"url": "http://x/run_code", "max_concurrent": "many"}, "reward.sandbox_fusion.max_concurrent", ""),
    ({"uri": "http://x/run_code"}, "reward.sandbox_fusion.uri", ""),
])
def test_bad_sandbox_fusion_config(sf, key, phrase):
    with pytest.raises(ConfigError) as e:
        load_config_dict({**BASE, "reward": {"sandbox_fusion": sf}})
    assert any(p.key == key and phrase in p.rule for p in e.value.problems), e.value.problems


def test_sandbox_with_custom_function_is_refused():
    with pytest.raises(ConfigError) as e:
        load_config_dict({**BASE, "reward": {"sandbox_fusion": {"url": "http://x/run_code"},
                                             "custom_function": {"path": "r.py"}}})
    assert any(p.key == "reward.sandbox_fusion.url" and "custom_function.path" in p.rule for p in e.value.problems)
