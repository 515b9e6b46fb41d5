"""data.chat_template_kwargs (verl's data.apply_chat_template_kwargs, issue 36): the template's own
variables (enable_thinking, reasoning_effort) reach it as transformers' apply_chat_template(**kwargs)
passes them; verl's spelling maps; bad values are named."""

import json

import pytest

from pfppo_mega.config import load_config_dict, resolve_config_dict
from pfppo_mega.data import chat_template_of
from pfppo_mega.data.chat import template_kwargs
from pfppo_mega.tokenizer import Tokenizer
from test_data import example  # noqa: F401
from test_verl_layout import overrides_of

THINKING = ("{%- for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{%- endfor %}"
            "{%- if add_generation_prompt %}<|assistant|>"
            "{%- if enable_thinking is defined and enable_thinking is false %}<think></think>{%- endif %}"
            "{%- if reasoning_effort is defined %}[effort: {{ reasoning_effort }}]{%- endif %}{%- endif %}")


@pytest.fixture
def thinking_dir(tmp_path, example):  # noqa: F811
    paths, _ = example
    d = tmp_path / "thinking"
    d.mkdir()
    (d / "tokenizer.json").write_text((paths["tokenizer"] / "tokenizer.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "chat_template": THINKING,
                                                         "tokenizer_class": "PreTrainedTokenizerFast"}))
    return d


@pytest.mark.parametrize("kwargs", [[], ["enable_thinking=false"], ['reasoning_effort="medium"'],
                                    ["enable_thinking=true", 'reasoning_effort="high"']])
def test_the_variables_reach_the_template_as_in_transformers(thinking_dir, kwargs):
    import transformers

    template = chat_template_of(Tokenizer.from_dir(thinking_dir), thinking_dir, kwargs)
    hf = transformers.AutoTokenizer.from_pretrained(str(thinking_dir))
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    want = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **template_kwargs(kwargs))
    assert template.render(msgs) == want
    assert ("<think></think>" in want) == ("enable_thinking=false" in kwargs)
    assert ("[effort:" in want) == any(k.startswith("reasoning_effort") for k in kwargs)


def test_prompts_are_rendered_with_them(example, thinking_dir):  # noqa: F811
    import random

    from pfppo_mega.data import build_prompt_data
    from test_data import _cfg

    paths, _ = example
    tok = Tokenizer.from_dir(thinking_dir)

    def first(**data):
        cfg = _cfg(paths, **data)
        return build_prompt_data(cfg, tok, model_dir=thinking_dir, rng=random.Random(0), log=lambda *_: None).val[0]

    plain, hinted = first(), first(chat_template_kwargs=["enable_thinking=false"])
    assert tok.decode(hinted.prompt_ids).endswith("<think></think>")
    assert not tok.decode(plain.prompt_ids).endswith("<think></think>")


def test_verls_gpt_oss_script_passes_reasoning_effort():
    c = resolve_config_dict({}, overrides_of("examples/grpo_trainer/run_gptoss_20b.sh")[0]).config
    assert c.data.chat_template_kwargs == ['reasoning_effort="medium"']
    c = load_config_dict({}, ["+data.apply_chat_template_kwargs.enable_thinking=False",
                              "+data.apply_chat_template_kwargs.reasoning_effort=low",
                              "actor_rollout_ref.model.path=/m", "data.train_files=/d.parquet"])
    assert c.data.chat_template_kwargs == ["enable_thinking=false", 'reasoning_effort="low"']
