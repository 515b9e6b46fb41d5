"""Chat templates: the checkpoint's own Jinja template (chat_template.jinja or tokenizer_config.json),
rendered the way `transformers.apply_chat_template` renders it (sandboxed Jinja, trim_blocks and
lstrip_blocks, `raise_exception`, the special tokens as variables, `add_generation_prompt`).
tests/test_data.py checks the output against transformers on the example tokenizer.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import threading
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """A template that cannot be compiled, or that refused a conversation."""


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


MAX_TEMPLATE_CHARS = 1 << 20   # a real template is a few KB; 20 MB ones were seen in hostile tests
MAX_RENDER_S = 5.0             # one prompt's render (a template can loop for minutes)
MAX_RENDER_CHARS = 1 << 22     # one rendered prompt


@contextlib.contextmanager
def _time_limit(seconds: float, what: str):
    """SIGALRM after ``seconds`` (main thread only: elsewhere no limit can be set from Python)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(*_):
        raise ChatTemplateError(f"{what}: rendering took longer than {seconds:g} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


RESERVED = ("messages", "add_generation_prompt", "bos_token", "eos_token", "pad_token", "raise_exception")


def template_kwargs(items: list[str], *, key: str = "data.chat_template_kwargs") -> dict[str, Any]:
    """data.chat_template_kwargs ("name=<JSON value>" each, e.g. 'enable_thinking=false',
    'reasoning_effort="medium"') as the variables they give the template, as transformers'
    apply_chat_template(**kwargs) passes them (verl's data.apply_chat_template_kwargs). Named errors."""
    out: dict[str, Any] = {}
    for i, item in enumerate(items):
        name, sep, text = item.partition("=")
        where = f"{key}[{i}] = {item!r}"
        if not sep or not name.isidentifier():
            raise ChatTemplateError(f"{where}: must be name=<JSON value> with a Python identifier as the name, "
                                    f"e.g. enable_thinking=false or reasoning_effort=\"medium\"")
        if name in RESERVED:
            raise ChatTemplateError(f"{where}: {name!r} is set by the renderer itself ({', '.join(RESERVED)})")
        if name in out:
            raise ChatTemplateError(f"{where}: {name!r} is given twice")
        try:
            value = json.loads(text)
        except ValueError:
            raise ChatTemplateError(f"{where}: the value {text!r} is not JSON (quote a string: "
                                    f"{name}=\"{text}\")") from None
        out[name] = value
    return out


class ChatTemplate:
    def __init__(self, source: str, *, special_tokens: dict[str, str | None], where: str,
                 extra: dict[str, Any] | None = None):
        self.where = where
        self.extra = dict(extra or {})  # the template's own arguments (data.chat_template_kwargs)
        self.lines = re.split(r"\r\n|\r|\n", source)  # as Jinja's lexer counts lines
        if len(source) > MAX_TEMPLATE_CHARS:
            raise ChatTemplateError(f"{where}: chat_template is {len(source):,} characters (at most "
                                    f"{MAX_TEMPLATE_CHARS:,}): not a chat template")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = _tojson
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"{where}: chat_template does not compile: {e}") from None
        except (SyntaxError, RecursionError, MemoryError) as e:  # Jinja's parser and Python's compiler
            raise ChatTemplateError(f"{where}: chat_template does not compile: its blocks or expressions are nested "
                                    f"deeper than Jinja's parser / Python's compiler allow ({type(e).__name__}: "
                                    f"{getattr(e, 'msg', None) or e}); a real template nests a few levels: "
                                    f"flatten it") from None
        self.special_tokens = {k: v or "" for k, v in special_tokens.items()}
        self.notes: list[str] = []  # what the probe found worth saying at start (build_prompt_data logs it)
        self._probe()

    def _probe(self) -> None:
        """Refuse at start a template whose output does not carry the conversation (empty, only
        special tokens, or the same whatever the messages say)."""
        marks = ("pfppo-probe-7f3a", "pfppo-probe-9c1e")
        outs = [self.render([{"role": "user", "content": m}]) for m in marks]
        for mark, out in zip(marks, outs):
            if mark not in out:
                raise ChatTemplateError(f"{self.where}: chat_template ignores the messages (a user message "
                                        f"{mark!r} rendered as {out[:120]!r}): prompts would not reach the model")
        eos = self.special_tokens.get("eos_token", "")
        if eos and all(out.rstrip().endswith(eos) for out in outs):
            self.notes.append(f"{self.where}: chat_template ends every prompt with the EOS token {eos!r} (a user "
                              f"message rendered as {outs[0][-120:]!r}): the model is asked to continue after "
                              f"end-of-sequence; a generation prompt usually ends with the assistant's header")

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True) -> str:
        try:
            with _time_limit(MAX_RENDER_S, f"{self.where}: chat_template"):
                out = self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                           **self.special_tokens, **self.extra)
        except ChatTemplateError as e:
            raise ChatTemplateError(f"{self.where}: chat_template refused the prompt: {e}"
                                    f"{self._line_of(e)}") from None
        except Exception as e:  # any template failure (Overflow, Recursion, ZeroDivision, ...) is named
            raise ChatTemplateError(f"{self.where}: chat_template refused the prompt: {type(e).__name__}: "
                                    f"{str(e)[:200]}{self._line_of(e)}") from None
        if len(out) > MAX_RENDER_CHARS:
            raise ChatTemplateError(f"{self.where}: chat_template rendered {len(out):,} characters for one prompt "
                                    f"(at most {MAX_RENDER_CHARS:,})")
        return out

    def _line_of(self, e: BaseException) -> str:
        """' (raised at line N of the template: 'text')' for the line that raised ``e``: Jinja
        rewrites a render's traceback so that template frames carry the template's own line
        numbers; the innermost is the line that raised (a `raise_exception(...)`, a 1 // 0)."""
        line = None
        tb = e.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code.co_filename == "<template>":
                line = tb.tb_lineno
            tb = tb.tb_next
        if line is None or not 1 <= line <= len(self.lines):
            return ""
        return f" (raised at line {line} of the template: {self.lines[line - 1].strip()[:120]!r})"


def _tojson(value: Any, indent: int | None = None) -> str:
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
