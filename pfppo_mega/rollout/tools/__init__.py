"""Tools and interactions of multi-turn rollouts (verl's ``rollout.multi_turn``).

A multi-turn rollout alternates the policy's turns with text the policy did not write: a tool's
answer to the calls the policy made in its turn, or a simulated user's reply (an interaction).
This package holds what those texts come from; the loop that interleaves them with generation is
``pfppo_mega.rollout.multiturn``.

    base.py          ToolCall, ToolResult, Tool, Interaction, InteractionTurn, ToolSetupError
    hermes.py        parse_hermes(text): the <tool_call>{json}</tool_call> blocks of a turn
"""

from pfppo_mega.rollout.tools.base import (Interaction, InteractionTurn, Tool, ToolCall, ToolResult,
                                           ToolSetupError)
from pfppo_mega.rollout.tools.hermes import parse_hermes

__all__ = ["Interaction", "InteractionTurn", "Tool", "ToolCall", "ToolResult", "ToolSetupError", "parse_hermes"]
