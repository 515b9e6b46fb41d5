"""data.chat_template_kwargs: malformed items, reserved or repeated names and non-JSON values are
named, at load and where the template is built."""

import pytest

from pfppo_mega.config import ConfigError, load_config_dict
from pfppo_mega.data.chat import ChatTemplateError, template_kwargs

FILES = {"source": "files", "train_files": ["/d.parquet"]}


@pytest.mark.parametrize("items,rule", [
    (["enable_thinking"], "must be name=<JSON value>"),
    (["1x=true"], "must be name=<JSON value>"),
    (["effort=medium"], "must be name=<JSON value>"),
    (["a=1", "a=2"], "names a variable twice"),
])
def test_config_names_bad_items(items, rule):
    with pytest.raises(ConfigError) as e:
        load_config_dict({"data": {**FILES, "chat_template_kwargs": items}})
    assert "data.chat_template_kwargs" in str(e.value) and rule in str(e.value)


def test_without_a_template_they_are_refused():
    with pytest.raises(ConfigError) as e:
        load_config_dict({"data": {**FILES, "apply_chat_template": False, "chat_template_kwargs": ["a=1"]}})
    assert "read only when a chat template renders the prompts" in str(e.value)


@pytest.mark.parametrize("items,rule", [
    (["messages=[]"], "set by the renderer itself"),
    (["eos_token=\"x\""], "set by the renderer itself"),
    (["effort=medium"], "is not JSON (quote a string"),
    (["a=1", "a=1"], "given twice"),
    (["=1"], "Python identifier"),
])
def test_the_renderer_names_bad_items(items, rule):
    with pytest.raises(ChatTemplateError, match=rule.replace("(", r"\(")):
        template_kwargs(items)
