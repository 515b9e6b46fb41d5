"""Chat templates: the checkpoint's own Jinja template (tokenizer_config.json `chat_template`),
rendered the way `transformers.apply_chat_template` renders it (sandboxed Jinja, trim_blocks and
lstrip_blocks, `raise_exception`, the special tokens as variables, `add_generation_prompt`).
tests/test_data.py checks the output against transformers on the example tokenizer.
"""

from __future__ import annotations

from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """A template that cannot be compiled, or that refused a conversation."""


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


class ChatTemplate:
    def __init__(self, source: str, *, special_tokens: dict[str, str | None], where: str):
        self.where = where
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = _tojson
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"{where}: chat_template does not compile: {e}") from None
        self.special_tokens = {k: v or "" for k, v in special_tokens.items()}

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True) -> str:
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        **self.special_tokens)
        except (jinja2.TemplateError, ChatTemplateError, TypeError) as e:
            raise ChatTemplateError(f"{self.where}: chat_template refused the prompt: {e}") from None


def _tojson(value: Any, indent: int | None = None) -> str:
    import json
    return json.dumps(value, ensure_ascii=False, indent=indent)


def check_messages(prompt: Any) -> list[dict[str, str]] | None:
    """The prompt as a list of {role, content} string messages, or None if it is not one."""
    if not isinstance(prompt, (list, tuple)) or not prompt:
        return None
    out = []
    for m in prompt:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return None
        out.append({"role": m["role"], "content": m["content"]})
    return out
