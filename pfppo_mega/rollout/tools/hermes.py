"""Tool calls in the Hermes format (Qwen2.5 / Qwen3 chat templates, verl's ``multi_turn.format:
hermes``): each call is a JSON object ``{"name": ..., "arguments": {...}}`` between ``<tool_call>``
and ``</tool_call>`` in the assistant's turn."""

from __future__ import annotations

import json
import re

from pfppo_mega.rollout.tools.base import ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


def parse_hermes(text: str) -> tuple[list[ToolCall], list[str]]:
    """The calls of one assistant turn, in order, and one error string per block that is not a
    valid call (bad JSON, no string ``name``, ``arguments`` not an object; an ``<tool_call>`` left
    open). ``arguments`` given as a JSON string holding an object is accepted (some models write it
    so)."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    for m in _BLOCK.finditer(text):
        body = m.group(1).strip()
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            errors.append(f"tool call is not JSON ({e.msg} at {e.pos}): {body[:80]!r}")
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            errors.append(f"tool call has no string 'name': {body[:80]!r}")
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            errors.append(f"tool call {obj['name']!r}: 'arguments' is not an object: {body[:80]!r}")
            continue
        calls.append(ToolCall(obj["name"], args))
    tail = text[text.rfind(CLOSE) + len(CLOSE):] if CLOSE in text else text
    if OPEN in tail:
        errors.append(f"{OPEN} without {CLOSE}: {tail[tail.find(OPEN):][:80]!r}")
    return calls, errors
