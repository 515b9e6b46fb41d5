"""The two things a multi-turn rollout asks for text the policy did not write.

A **tool** answers the calls the policy makes in its turn. One tool object serves every row of a
run; each row that may call it gets an instance (``create`` with the row's own keyword arguments,
verl's ``extra_info.tools_kwargs[name].create_kwargs``, e.g. the row's ground truth), every call of
that row goes to its instance (``execute``), and the instance is released when the row ends.

An **interaction** plays the user: after a policy turn without tool calls it reads the
conversation so far and replies (or ends the conversation). Same lifecycle: ``start`` per row with
``extra_info.interaction_kwargs``, ``respond`` per user turn, ``finish`` at the end.

Both are synchronous here (the rollout loop runs a turn's calls itself, in a thread pool when
``max_parallel_calls`` > 1). Errors: a tool that raises during ``execute`` answers the policy with
the error's text (the row goes on, the failure is counted); one that raises in ``create`` or
``release`` ends the run with the row and the tool named (a setup fault, not the policy's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


class ToolSetupError(ValueError):
    """A tool or interaction configuration that cannot be used; the message names the file, the
    entry, the value and what is allowed."""


@dataclass(frozen=True)
class ToolCall:
    """One call the policy wrote: the tool's name and its JSON arguments (an object)."""

    name: str
    arguments: dict[str, Any]


@dataclass
class ToolResult:
    """A tool's answer to one call: the text the policy reads next (rendered as a ``tool`` message),
    an optional step reward (verl's tool reward; summed per row into ``extra_info['tool_rewards']``
    for the reward function) and numbers to log (``tool/<name>/<key>`` means)."""

    text: str
    reward: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class Tool(Protocol):
    name: str
    schema: dict[str, Any]   # OpenAI function schema: {"type": "function", "function": {"name", "description", "parameters"}}

    def create(self, instance_id: str, **create_kwargs: Any) -> None: ...

    def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult: ...

    def release(self, instance_id: str) -> None: ...


@dataclass
class InteractionTurn:
    """A simulated user's reply: ``terminate`` ends the conversation (``text`` is then not shown),
    ``score`` is the turn's reward (kept per row in ``extra_info['interaction_scores']``)."""

    terminate: bool
    text: str = ""
    score: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class Interaction(Protocol):
    name: str

    def start(self, instance_id: str, **kwargs: Any) -> None: ...

    def respond(self, instance_id: str, messages: list[dict[str, Any]]) -> InteractionTurn: ...

    def finish(self, instance_id: str) -> None: ...
