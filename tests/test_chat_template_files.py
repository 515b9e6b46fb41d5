"""Chat templates where current checkpoints keep them: transformers 5 saves the template to
chat_template.jinja (not tokenizer_config.json) and named extras to additional_chat_templates/;
older configs hold a string or a list of {"name", "template"}. Read as transformers reads them and
rendered alike."""

import json
import shutil
from pathlib import Path

import pytest

from pfppo_mega.data import chat_template_of
from pfppo_mega.tokenizer import Tokenizer, TokenizerError

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "gsm8k_synth" / "tokenizer"
JINJA = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
OTHER = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "What is 2 + 3?"}]


def _dir(tmp_path: Path, *, config_template=None, jinja=None, extra=None) -> Path:
    d = tmp_path / "ckpt"
    d.mkdir()
    shutil.copy(EXAMPLE / "tokenizer.json", d / "tokenizer.json")
    cfg = json.loads((EXAMPLE / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    if config_template is not None:
        cfg["chat_template"] = config_template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    if jinja is not None:
        (d / "chat_template.jinja").write_text(jinja)
    for name, source in (extra or {}).items():
        (d / "additional_chat_templates").mkdir(exist_ok=True)
        (d / "additional_chat_templates" / f"{name}.jinja").write_text(source)
    return d


def _transformers(d: Path) -> str:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(d)).apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("layout", ["jinja_file", "jinja_beats_config", "config_list", "config_string",
                                    "jinja_with_named_extra"])
def test_the_template_is_the_one_transformers_uses(tmp_path, layout):
    kw = {"jinja_file": dict(jinja=JINJA),
          "jinja_beats_config": dict(jinja=JINJA, config_template=OTHER),
          "config_list": dict(config_template=[{"name": "tool_use", "template": OTHER},
                                               {"name": "default", "template": JINJA}]),
          "config_string": dict(config_template=JINJA),
          "jinja_with_named_extra": dict(jinja=JINJA, extra={"tool_use": OTHER})}[layout]
    d = _dir(tmp_path, **kw)
    tok = Tokenizer.from_dir(d)
    assert tok.chat_template == JINJA
    ours = chat_template_of(tok, d).render(MESSAGES)
    assert ours == _transformers(d), (ours, _transformers(d))
    assert Path(tok.chat_template_file).name == ("tokenizer_config.json" if layout.startswith("config")
                                                 else "chat_template.jinja")
    # an export (pfppo sft / train) carries the template files as they came
    out = tmp_path / "export"
    out.mkdir()
    tok.save(out)
    assert Tokenizer.from_dir(out).chat_template == JINJA


def test_several_templates_without_a_default_are_refused_like_transformers(tmp_path):
    d = _dir(tmp_path, config_template=[{"name": "a", "template": JINJA}, {"name": "b", "template": OTHER}])
    with pytest.raises(TokenizerError, match=r"tokenizer_config.json: several chat templates \(a, b\) and none "
                                             r"named 'default'"):
        Tokenizer.from_dir(d).chat_template


@pytest.mark.parametrize("bad", [42, [{"name": "x"}], [], {"default": JINJA}])
def test_a_malformed_config_template_is_refused_by_file(tmp_path, bad):
    d = _dir(tmp_path, config_template=bad)
    with pytest.raises(TokenizerError, match=r"tokenizer_config.json: chat_template must be a string or a list"):
        Tokenizer.from_dir(d)


def test_an_unreadable_template_file_is_refused_by_name(tmp_path):
    d = _dir(tmp_path)
    (d / "chat_template.jinja").write_bytes(b"\xff\xfe not utf-8 \xc3")
    with pytest.raises(TokenizerError, match=r"chat_template.jinja cannot be read as UTF-8"):
        Tokenizer.from_dir(d)


def test_no_template_anywhere_is_none(tmp_path):
    assert Tokenizer.from_dir(_dir(tmp_path)).chat_template is None


@pytest.mark.parametrize("source,why", [
    ("", "ignores the messages"),
    ("{{ bos_token }}", "ignores the messages"),
    ("<|user|>hello<|assistant|>", "ignores the messages"),
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}{{ eos_token }}", None),
    ("{{ 1 / 0 }}", "refused the prompt: ZeroDivisionError"),
    ("{% for i in range(10**9) %}x{% endfor %}", "rendering took longer than 5 s|OverflowError|characters for one"),
    ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
     "rendering took longer than 5 s"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "refused the prompt: RecursionError"),
    ("x" * (1 << 20 + 1), "characters \\(at most"),
])
def test_a_template_that_would_train_on_nothing_is_refused_at_start(tmp_path, source, why):
    from pfppo_mega.data.chat import ChatTemplate, ChatTemplateError

    if why is None:
        ChatTemplate(source, special_tokens={"eos_token": "</s>"}, where="chat_template.jinja")
        return
    with pytest.raises(ChatTemplateError, match=rf"chat_template.jinja: .*({why})"):
        ChatTemplate(source, special_tokens={"bos_token": "<s>"}, where="chat_template.jinja")
