"""Multi-turn rollouts: the policy writes a turn, the tools it calls answer (or a simulated user
replies), it writes the next turn, until it answers without a call.

Engine-agnostic: the loop is given ``generate(prompts, params) -> RolloutOutput`` (one engine call;
the trainer passes its split, guarded ``Generation.run_engine``), the chat template and the tokenizer,
and the run's tools and interactions (``rollout/tools/base.py``). What one row becomes::

    prompt | turn 1 (policy, mask 1) | tool answers (mask 0) | turn 2 (mask 1) | user reply (mask 0) | ...

``responses`` [B, T] holds every token after the prompt; ``response_mask`` is 1 on the policy's
tokens only, so tool and user tokens are never trained on; ``logprobs`` are the engine's on the
policy's tokens, 0 elsewhere. ``lengths`` [B] is each row's extent (its tokens, tool tokens included):
a row always ends with a policy token (a tool answer that would not leave room for one more policy
token ends the row instead of being appended, as verl's tool agent loop does), so the extent is the
index of the last mask-1 token + 1.

One loop iteration is one engine call over the rows still generating. Every row's call asks for
the largest remaining budget (``max_response_length`` counts every response token, tool tokens
included, as verl's ``response_length``), capped so that no row's context passes
``max_context``; a row given fewer tokens than its budget continues its turn in the next call. A
turn ends at EOS; then its tool calls (Hermes, read with special tokens kept) run in a thread pool
of ``max_parallel_calls`` (verl runs a turn's first ``max_parallel_calls`` calls; the rest are
counted as dropped), their answers are rendered with the model's chat template and appended. A
row ends when its turn has no tool call and no interaction wants to go on, at
``max_assistant_turns`` / ``max_user_turns``, or when its budget is spent (cut: finished False).

Tool answers are cut, as verl 0.9.1 cuts them, by characters: longer than
``max_tool_response_length`` characters keeps the first (left), the last (right) or both halves
(middle) with a ``...(truncated)`` mark.

Bad calls are the policy's: malformed JSON, an unknown tool name, a tool that raises or answers
with something that is not a ToolResult of text -- each answers the policy with an error message
and is counted (``rollout/tool_call_errors``). Setup faults stop the run with the row named: a
row's ``tools_kwargs`` naming a tool that is not configured, an interaction name that is not
configured, a row without ``interaction_kwargs`` when interactions are configured (verl fails on it
too), a tool whose ``create`` raises. Every row's tool instances are released when the row ends, and
every one left when the loop raises.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence

import torch

from pfppo_mega.rollout.base import RolloutOutput, SamplingParams
from pfppo_mega.rollout.tools.base import Interaction, InteractionTurn, Tool, ToolCall, ToolResult, ToolSetupError
from pfppo_mega.rollout.tools.hermes import parse_hermes

TRUNCATED = "...(truncated)"  # verl's mark where a tool answer was cut


class TurnRenderError(ValueError):
    """The chat template cannot render a tool or user turn after an assistant turn."""


class Renderer(Protocol):
    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True) -> str: ...


@dataclass(frozen=True)
class TurnLimits:
    """actor_rollout.multi_turn's numbers, as plain values."""

    max_assistant_turns: Optional[int] = None
    max_user_turns: Optional[int] = None
    max_parallel_calls: int = 1
    max_tool_response_length: int = 256
    truncate_side: str = "middle"
    sanity_check: str = "strict"
    tool_timeout_s: Optional[float] = 300.0

    @classmethod
    def from_config(cls, mt) -> "TurnLimits":
        return cls(mt.max_assistant_turns, mt.max_user_turns, mt.max_parallel_calls, mt.max_tool_response_length,
                   mt.tool_response_truncate_side, mt.tokenization_sanity_check_mode, mt.tool_timeout_s)


@dataclass
class ToolSet:
    """The run's tools and interactions by name."""

    tools: dict[str, Tool] = field(default_factory=dict)
    interactions: dict[str, Interaction] = field(default_factory=dict)

    @property
    def schemas(self) -> list[dict[str, Any]]:
        return [self.tools[n].schema for n in sorted(self.tools)]


def truncate_text(text: str, limit: int, side: str) -> str:
    """A tool answer cut to ``limit`` characters (verl 0.9.1's rule and marks)."""
    if len(text) <= limit:
        return text
    if side == "left":
        return text[:limit] + TRUNCATED
    if side == "right":
        return "(truncated)..." + text[-limit:]
    if side == "middle":
        half = limit // 2
        return text[:half] + "...(truncated)..." + text[len(text) - half:]
    raise ValueError(f"tool_response_truncate_side={side!r}: must be one of 'left', 'middle', 'right'")


class TurnTokens:
    """Token ids of a tool or user turn appended after an assistant turn that ended with EOS: what the
    chat template adds to a conversation for those messages (render(conv + msgs, generation prompt)
    minus render(conv)), plus the template's text after the EOS of an assistant turn (Qwen's newline
    after <|im_end|>), which the policy did not write. Rendered once per turn against a fixed
    two-message conversation, so the row's own history is never re-rendered (its tokens are the
    policy's own)."""

    USER, ASSISTANT = "pfppo-user-4e1b", "pfppo-assistant-8c7d"

    def __init__(self, template: Renderer, tokenizer, tools: Optional[list[dict[str, Any]]] = None) -> None:
        self.template, self.tokenizer = template, tokenizer
        self.base = [{"role": "user", "content": self.USER}, {"role": "assistant", "content": self.ASSISTANT}]
        before = template.render(self.base, add_generation_prompt=False)
        at = before.rfind(self.ASSISTANT)
        if at < 0:
            raise TurnRenderError(f"the chat template dropped an assistant message's content ({before[-120:]!r}): "
                                  f"multi-turn rollouts need it to render assistant turns")
        tail = before[at + len(self.ASSISTANT):]  # the template's end of an assistant turn, e.g. "<|im_end|>\n"
        eos = tokenizer.token(tokenizer.eos_id) or ""
        self.glue = tail[tail.index(eos) + len(eos):] if eos and eos in tail else tail
        self.before = before

    def ids(self, messages: list[dict[str, Any]]) -> list[int]:
        after = self.template.render(self.base + messages, add_generation_prompt=True)
        if not after.startswith(self.before):
            raise TurnRenderError(f"the chat template renders the conversation before a {messages[0]['role']!r} "
                                  f"message differently once it follows ({self.before[-60:]!r} vs "
                                  f"{after[len(self.before) - 60:len(self.before)]!r}): the turn's tokens cannot be "
                                  f"appended to the policy's")
        return self.tokenizer.encode(self.glue + after[len(self.before):], add_bos=False)


def raw_text(tokenizer, ids: list[int]) -> str:
    """Text of ``ids`` with special tokens kept (what re-tokenizing must give back)."""
    if tokenizer.hf.decoder is not None:
        return tokenizer.hf.decode([int(i) for i in ids], skip_special_tokens=False)
    return "".join(tokenizer.hf.id_to_token(int(i)) or "" for i in ids)


@dataclass
class _Row:
    index: int
    context: list[int]                                   # prompt + response so far
    prompt_len: int
    messages: list[dict[str, Any]]
    tool_ids: dict[str, str] = field(default_factory=dict)   # tool name -> instance id
    interaction: Optional[Interaction] = None
    interaction_id: str = ""
    tokens: list[int] = field(default_factory=list)      # the response
    mask: list[float] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turn: list[int] = field(default_factory=list)        # the policy's current turn so far
    texts: list[str] = field(default_factory=list)       # per segment, for the reward's text
    assistant_turns: int = 0
    user_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_reward: float = 0.0
    interaction_scores: list[float] = field(default_factory=list)
    finished: bool = True
    done: bool = False


@dataclass
class MultiTurnResult:
    output: RolloutOutput        # the rows, as one generate() call would return them (lengths: extents)
    texts: list[str]             # each row's whole response, tool and user turns included
    extra: list[dict[str, Any]]  # per row: tool_rewards, interaction_scores, turns, tool_calls
    stats: "TurnStats"


def row_kwargs(extra_info: dict[str, Any], toolset: ToolSet, where: str) -> tuple[dict[str, dict], Optional[tuple[str, dict]]]:
    """(create kwargs per configured tool, (interaction name, its kwargs) or None) from a row's
    extra_info (verl's tools_kwargs[name].create_kwargs and interaction_kwargs). Named errors."""
    tk = extra_info.get("tools_kwargs") or {}
    if not isinstance(tk, dict):
        raise ToolSetupError(f"{where}: extra_info.tools_kwargs must be a mapping of tool name -> "
                             f"{{create_kwargs: ...}}, got {type(tk).__name__}")
    unknown = sorted(set(tk) - set(toolset.tools))
    if unknown:
        raise ToolSetupError(f"{where}: extra_info.tools_kwargs names tool(s) {unknown} that the tool config does "
                             f"not define (configured: {sorted(toolset.tools) or 'none'}; "
                             f"actor_rollout.multi_turn.tool_config_path)")
    create: dict[str, dict] = {}
    for name in toolset.tools:
        entry = tk.get(name) or {}
        kw = entry.get("create_kwargs", {}) if isinstance(entry, dict) else None
        if not isinstance(kw, dict):
            raise ToolSetupError(f"{where}: extra_info.tools_kwargs[{name!r}].create_kwargs must be a mapping, "
                                 f"got {kw!r}")
        create[name] = kw
    ik = extra_info.get("interaction_kwargs")
    if not toolset.interactions:
        return create, None  # verl reads interaction_kwargs only with an interaction config
    if ik is None:  # verl's agent loop fails on such a row too (it reads kwargs["interaction_kwargs"])
        raise ToolSetupError(f"{where}: extra_info.interaction_kwargs is missing: with interactions configured "
                             f"({sorted(toolset.interactions)}; actor_rollout.multi_turn.interaction_config_path) "
                             f"every row names its interaction ({{name: ..., <its kwargs>}})")
    if not isinstance(ik, dict) or not isinstance(ik.get("name"), str):
        raise ToolSetupError(f"{where}: extra_info.interaction_kwargs must be a mapping with a string 'name' "
                             f"(configured interactions: {sorted(toolset.interactions)}), got {str(ik)[:120]}")
    if ik["name"] not in toolset.interactions:
        raise ToolSetupError(f"{where}: extra_info.interaction_kwargs.name = {ik['name']!r} is not configured "
                             f"(actor_rollout.multi_turn.interaction_config_path defines "
                             f"{sorted(toolset.interactions)})")
    return create, (ik["name"], {k: v for k, v in ik.items() if k != "name"})


class MultiTurnRollout:
    """One batch of multi-turn rows (see the module docstring)."""

    def __init__(self, *, generate: Callable[[list[list[int]], SamplingParams], RolloutOutput],
                 tokenizer, turn_tokens: TurnTokens, toolset: ToolSet, limits: TurnLimits,
                 max_response_length: int, max_context: int,
                 agree: Callable[[int, int, int], tuple[int, int, int]] = lambda *mine: mine,
                 share: Optional[Callable[[Any], Any]] = None, runs_tools: bool = True,
                 log: Callable[[str], None] = print) -> None:
        self.generate, self.tokenizer, self.turn_tokens = generate, tokenizer, turn_tokens
        self.toolset, self.limits, self.log = toolset, limits, log
        self.budget, self.max_context = max_response_length, max_context
        # agree(rows generating, most budget left, least context room) -> the job's (max, max, min): with a
        # rollout split an engine call is a job-wide collective and an engine generates other ranks' rows
        # with its own params, so every rank makes the same calls (an empty one too) with one max_new_tokens
        self.agree = agree
        # share(payload) -> the replica leader's payload, on every rank (a collective every rank calls); with
        # it only the leader (runs_tools) creates, calls and releases the tools, and the other ranks of its
        # replica take the rows' state from it after each turn (a tool runs once per row, as in verl)
        self.share, self.runs_tools = share, runs_tools
        self.counts: Counter = Counter()
        self.logged: set[str] = set()

    # ------------------------------------------------------------------ the rows' lifecycle

    def _start(self, rows: list[_Row], samples: Sequence[Any]) -> None:
        for row, s in zip(rows, samples):
            where = f"multi-turn row {row.index} ({getattr(s, 'row', '') or 'prompt ' + repr(s.prompt_text[:40])})"
            create, inter = row_kwargs(s.extra_info or {}, self.toolset, where)
            for name, kw in create.items():
                iid = f"r{row.index}-{name}"
                try:
                    self.toolset.tools[name].create(iid, **kw)
                except Exception as e:
                    raise ToolSetupError(f"{where}: tool {name!r}.create(**{str(kw)[:80]}) raised "
                                         f"{type(e).__name__}: {e}") from e
                row.tool_ids[name] = iid
            if inter is not None:
                name, kw = inter
                row.interaction, row.interaction_id = self.toolset.interactions[name], f"r{row.index}-{name}"
                try:
                    row.interaction.start(row.interaction_id, **kw)
                except Exception as e:
                    row.interaction = None
                    raise ToolSetupError(f"{where}: interaction {name!r}.start raised {type(e).__name__}: {e}") from e

    def _release(self, rows: list[_Row]) -> None:
        errors = []
        for row in rows:
            for name, iid in row.tool_ids.items():
                try:
                    self.toolset.tools[name].release(iid)
                except Exception as e:
                    errors.append(f"row {row.index} tool {name!r}.release: {type(e).__name__}: {e}")
            row.tool_ids.clear()
            if row.interaction is not None:
                try:
                    row.interaction.finish(row.interaction_id)
                except Exception as e:
                    errors.append(f"row {row.index} interaction finish: {type(e).__name__}: {e}")
                row.interaction = None
        if errors:
            raise ToolSetupError("multi-turn: releasing the rows' tools failed: " + "; ".join(errors[:5]))

    # ------------------------------------------------------------------ the loop

    def run(self, samples: Sequence[Any], params: SamplingParams) -> MultiTurnResult:
        rows = [_Row(i, list(s.prompt_ids), len(s.prompt_ids), list(getattr(s, "messages", ()) or
                     [{"role": "user", "content": s.prompt_text}])) for i, s in enumerate(samples)]
        version = -1
        try:
            self._shared(lambda: self._start(rows, samples) if self.runs_tools else None, None)
            call = 0
            while True:
                active = [r for r in rows if not r.done]
                remaining = max((self.budget - len(r.tokens) for r in active), default=0)
                room = min((self.max_context - len(r.context) for r in active), default=self.max_context)
                n_active, remaining, room = self.agree(len(active), remaining, room)
                if not n_active:
                    break
                want = max(1, min(remaining, room))  # the job's call: >= 1 (every row has room for its budget)
                version = self._turn(active, params, call, version, want)
                call += 1
        except BaseException:
            try:  # the tools are released; the first error is the one raised
                self._release(rows)
            except Exception as e:
                self.log(f"[pfppo] multi-turn: after an error, {e}")
            raise
        self._release(rows)
        return self._result(rows, version)

    def _turn(self, active: list[_Row], params: SamplingParams, call: int, version: int, want: int) -> int:
        """One engine call over ``active`` (possibly none: the other ranks' call) asking ``want`` tokens,
        then each row's turn."""
        remaining = [self.budget - len(r.tokens) for r in active]
        seed = None if params.seed is None else (params.seed * 7919 + call) % (2 ** 31)
        out = self.generate([r.context for r in active], dataclasses.replace(params, max_new_tokens=want, seed=seed))
        if active:
            version = out.weight_version
        self._shared(lambda: self._rows_turn(active, remaining, out) if self.runs_tools else None, active)
        return version

    def _shared(self, work: Callable[[], None], active: Optional[list[_Row]]) -> None:
        """``work`` on this rank (the leader's part), then, with ``share``, the leader's outcome on every
        rank of its replica: the other ranks take the ``active`` rows' state and the counts from it, and
        raise with it when it failed; ``share`` also reports another replica's failure, so every rank of
        the job stops together (no rank is left waiting in the next collective)."""
        error: Optional[BaseException] = None
        try:
            work()
        except Exception as e:
            error = e
        if self.share is not None:
            mine = {"error": None if error is None else f"{type(error).__name__}: {error}"}
            if self.runs_tools and active is not None:
                mine["rows"] = [{k: v for k, v in vars(r).items() if k not in ("interaction", "tool_ids")}
                                for r in active]
                mine["counts"] = dict(self.counts)
            got = self.share(mine)
            if not self.runs_tools and got["error"] is None and active is not None:
                for row, state in zip(active, got["rows"]):
                    vars(row).update(state)
                self.counts = Counter(got["counts"])
            if got["error"] is not None and error is None:
                raise ToolSetupError(f"multi-turn: a rank that runs the tools stopped (this replica's leader, or "
                                     f"the replica named): {got['error']}")
        if error is not None:
            raise error

    def _rows_turn(self, active: list[_Row], remaining: list[int], out: RolloutOutput) -> None:
        """Each row's new tokens, then its turn's end: its tools, its simulated user, or its end."""
        eos = self.tokenizer.eos_id
        for b, (row, rem) in enumerate(zip(active, remaining)):
            n = int(out.lengths[b])
            if n < 1:  # asked for >= 1 token with budget left: asking again would loop for ever
                raise RuntimeError(f"multi-turn row {row.index}: the engine returned no token for it with {rem} of "
                                   f"its {self.budget}-token budget left (context {len(row.context)} tokens); an "
                                   f"engine must generate at least one token per call")
            new = out.responses[b, :n].tolist()[:rem]
            lp = out.logprobs[b, :n].tolist()[:rem]
            row.tokens += new
            row.mask += [1.0] * len(new)
            row.logprobs += lp
            row.context += new
            row.turn += new
            ended = bool(new) and new[-1] == eos
            if ended:
                self._after_turn(row)
            elif len(row.tokens) >= self.budget:
                self._end(row, finished=False)
            # else: the call's cap (another row's context) stopped this turn early: it goes on next call

    def _end(self, row: _Row, *, finished: bool) -> None:
        if row.turn:  # a turn the budget cut still counts (verl counts every generation)
            row.texts.append(self.tokenizer.decode(row.turn))
            row.turn = []
            row.assistant_turns += 1
        row.finished, row.done = finished, True
        self._release([row])  # its tools and user go as soon as it ends (the rest: at the end of the batch)

    def _after_turn(self, row: _Row) -> None:
        text = self.tokenizer.decode(row.turn)  # stops at EOS, drops special tokens
        # the calls are read with special tokens kept (as verl's parser decodes): a tokenizer that makes
        # <tool_call> a special token would otherwise hide every call
        written = row.turn[: row.turn.index(self.tokenizer.eos_id)] if self.tokenizer.eos_id in row.turn else row.turn
        calls_text = raw_text(self.tokenizer, written)
        row.texts.append(text)
        row.turn = []
        row.assistant_turns += 1
        row.messages.append({"role": "assistant", "content": text})
        lim = self.limits
        if len(row.tokens) >= self.budget:
            return self._end(row, finished=True)
        if lim.max_assistant_turns and row.assistant_turns >= lim.max_assistant_turns:
            return self._end(row, finished=True)
        if lim.max_user_turns and row.user_turns >= lim.max_user_turns:
            return self._end(row, finished=True)
        calls, errors = parse_hermes(calls_text)
        if calls or errors:
            messages = self._run_tools(row, calls, errors)
        elif row.interaction is not None:
            reply = self._interact(row)
            if reply is None:
                return self._end(row, finished=True)
            messages = [{"role": "user", "content": reply}]
        else:
            return self._end(row, finished=True)
        ids = self.turn_tokens.ids(messages)
        if len(row.tokens) + len(ids) >= self.budget:  # no room for the answer and one more policy token
            self.counts["cut_before_answer"] += 1
            return self._end(row, finished=False)
        row.tokens += ids
        row.mask += [0.0] * len(ids)
        row.logprobs += [0.0] * len(ids)
        row.context += ids
        row.texts.append(self.tokenizer.decode([t for t in ids if t != self.tokenizer.eos_id]))  # specials dropped
        row.messages += messages
        row.user_turns += 1

    def _interact(self, row: _Row) -> Optional[str]:
        try:
            turn = row.interaction.respond(row.interaction_id, [dict(m) for m in row.messages])
        except Exception as e:
            raise ToolSetupError(f"multi-turn row {row.index}: interaction {row.interaction.name!r}.respond raised "
                                 f"{type(e).__name__}: {e}") from e
        if not isinstance(turn, InteractionTurn) or not isinstance(turn.text, str):
            raise ToolSetupError(f"multi-turn row {row.index}: interaction {row.interaction.name!r}.respond must "
                                 f"return an InteractionTurn with text a str, got {str(turn)[:120]}")
        row.interaction_scores.append(float(turn.score))
        self.counts["interaction_turns"] += 1
        return None if turn.terminate else turn.text

    # ------------------------------------------------------------------ tools

    def _run_tools(self, row: _Row, calls: list[ToolCall], errors: list[str]) -> list[dict[str, Any]]:
        keep = calls[: self.limits.max_parallel_calls]
        self.counts["tool_calls_dropped"] += len(calls) - len(keep)
        outcomes = self._calls_in_threads(row, keep)
        answers = [self._account(row, name, text, res, bad) for name, text, res, bad in outcomes]  # this thread
        row.tool_calls += len(keep) + len(errors)
        row.tool_errors += len(errors)
        self.counts["tool_calls"] += len(keep) + len(errors)
        self.counts["tool_call_errors"] += len(errors)
        texts = [f"Error: {e}" for e in errors] + answers
        limit, side = self.limits.max_tool_response_length, self.limits.truncate_side
        return [{"role": "tool", "content": truncate_text(t, limit, side)} for t in texts]

    def _calls_in_threads(self, row: _Row, calls: list[ToolCall]) -> list[tuple[str, str, Optional[ToolResult], str]]:
        """A turn's calls at once, one daemon thread each (a tool that never returns neither holds up
        the rollout past tool_timeout_s nor the process's exit); a call still running at the deadline
        is answered with a timeout error."""
        outcomes: list = [None] * len(calls)

        def run(i: int, call: ToolCall) -> None:
            outcomes[i] = self._call(row, call)

        threads = [threading.Thread(target=run, args=(i, c), daemon=True, name=f"pfppo-tool-{c.name}")
                   for i, c in enumerate(calls)]
        for th in threads:
            th.start()
        timeout = self.limits.tool_timeout_s
        deadline = None if timeout is None else time.monotonic() + timeout
        for i, (th, call) in enumerate(zip(threads, calls)):
            th.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if outcomes[i] is None:  # still running (a thread's outcome is set before it ends)
                outcomes[i] = (call.name, f"Error: tool {call.name!r} did not answer within {timeout:g} s",
                               None, "timeout")
        return outcomes

    def _call(self, row: _Row, call: ToolCall) -> tuple[str, str, Optional[ToolResult], str]:
        """One call, in a worker thread: (tool name, answer text, its ToolResult or None, why it is the
        policy's error or ""). Touches no shared state: the counts and the row's sums are added by
        _account in the loop's thread (a turn's calls run in parallel)."""
        tool = self.toolset.tools.get(call.name)
        if tool is None:
            return call.name, f"Error: tool {call.name!r} does not exist (available: " \
                              f"{', '.join(sorted(self.toolset.tools)) or 'none'})", None, "unknown"
        try:
            res = tool.execute(row.tool_ids[call.name], call.arguments)
        except Exception as e:  # the tool failed on the policy's arguments: the policy reads why
            return call.name, f"Error: tool {call.name!r} failed: {type(e).__name__}: {e}", None, "raised"
        if not isinstance(res, ToolResult) or not isinstance(res.text, str):
            return call.name, f"Error: tool {call.name!r} returned no text", None, f"returned {str(res)[:120]}"
        return call.name, res.text, res, ""

    def _account(self, row: _Row, name: str, text: str, res: Optional[ToolResult], bad: str) -> str:
        """One call's outcome into the counts and the row's sums; its answer text."""
        if bad:
            if bad == "timeout":
                self.counts[f"tool/{name}/timeouts"] += 1
                self._log_once(f"timeout-{name}", f"[pfppo] multi-turn: tool {name!r} did not answer within "
                               f"actor_rollout.multi_turn.tool_timeout_s = {self.limits.tool_timeout_s:g} s; the "
                               f"policy reads a timeout error, counted in tool/{name}/timeouts (logged once)")
            if bad.startswith("returned"):
                self._log_once(f"bad-result-{name}", f"[pfppo] multi-turn: tool {name!r}.execute {bad} (must be a "
                               f"ToolResult with text a str); the policy reads an error message, counted in "
                               f"rollout/tool_call_errors")
            row.tool_errors += 1
            self.counts["tool_call_errors"] += 1
            self.counts[f"tool/{name}/errors"] += 1
            return text
        self.counts[f"tool/{name}/calls"] += 1
        if res.reward is not None:
            row.tool_reward += float(res.reward)
        for k, v in res.metrics.items():
            self.counts[f"tool/{name}/{k}"] += float(v)
        return text

    def _log_once(self, key: str, line: str) -> None:
        if key not in self.logged:
            self.logged.add(key)
            self.log(line)

    # ------------------------------------------------------------------ the result

    def _result(self, rows: list[_Row], version: int) -> MultiTurnResult:
        B = len(rows)
        T = max((len(r.tokens) for r in rows), default=0)
        pad = self.tokenizer.pad_id
        responses = torch.full((B, T), pad, dtype=torch.long)                          # [B, T]
        mask = torch.zeros(B, T, dtype=torch.float32)                                  # [B, T]
        logprobs = torch.zeros(B, T, dtype=torch.float32)                              # [B, T]
        for i, r in enumerate(rows):
            n = len(r.tokens)
            responses[i, :n] = torch.tensor(r.tokens, dtype=torch.long)
            mask[i, :n] = torch.tensor(r.mask)
            logprobs[i, :n] = torch.tensor(r.logprobs)
        out = RolloutOutput(prompts=[r.context[:r.prompt_len] for r in rows], responses=responses,
                            response_mask=mask, logprobs=logprobs,
                            lengths=torch.tensor([len(r.tokens) for r in rows], dtype=torch.long),
                            finished=torch.tensor([r.finished for r in rows], dtype=torch.bool),
                            weight_version=version)
        mismatches = sum(not self._sane(r) for r in rows) if self.limits.sanity_check != "disable" else 0
        stats = TurnStats(rows=B, turns=sum(r.assistant_turns for r in rows),
                          turns_max=max((r.assistant_turns for r in rows), default=0),
                          tokens=sum(len(r.tokens) for r in rows), policy_tokens=int(mask.sum()),
                          mismatches=mismatches, counts=Counter(self.counts))
        extra = [{"tool_rewards": r.tool_reward, "interaction_scores": list(r.interaction_scores),
                  "turns": r.assistant_turns, "tool_calls": r.tool_calls} for r in rows]
        return MultiTurnResult(out, ["".join(r.texts) for r in rows], extra, stats)

    def _sane(self, row: _Row) -> bool:
        """Re-tokenizing the response's text gives the ids built turn by turn (verl's sanity check)."""
        text = raw_text(self.tokenizer, row.tokens)
        again = self.tokenizer.encode(text, add_bos=False)
        ok = again == row.tokens
        if not ok and self.limits.sanity_check == "ignore_strippable":
            ok = raw_text(self.tokenizer, again).strip() == text.strip() and \
                [t for t in again if raw_text(self.tokenizer, [t]).strip()] == \
                [t for t in row.tokens if raw_text(self.tokenizer, [t]).strip()]
        if not ok:
            self._log_once("sanity", f"[pfppo] multi-turn: row {row.index}'s response tokenizes differently as one "
                           f"text than turn by turn ({len(again)} vs {len(row.tokens)} tokens; "
                           f"multi_turn.tokenization_sanity_check_mode={self.limits.sanity_check}); counted in "
                           f"rollout/tokenization_mismatches")
        return ok


@dataclass
class TurnStats:
    """Sums over the batches of a step (PF-PPO generates once per snapshot used) -> the step's metrics."""

    rows: int = 0
    turns: int = 0
    turns_max: int = 0
    tokens: int = 0
    policy_tokens: int = 0
    mismatches: int = 0
    counts: Counter = field(default_factory=Counter)  # tool_calls, tool_call_errors, tool/<name>/calls, ...

    def add(self, other: "TurnStats") -> None:
        self.rows += other.rows
        self.turns += other.turns
        self.turns_max = max(self.turns_max, other.turns_max)
        self.tokens += other.tokens
        self.policy_tokens += other.policy_tokens
        self.mismatches += other.mismatches
        self.counts.update(other.counts)

    def metrics(self) -> dict[str, float]:
        """rollout/turns_mean, turns_max, tool_calls_mean, tool_call_errors, tool_tokens_frac,
        tokenization_mismatches, tool_calls_dropped, cut_before_answer, interaction_turns; per tool
        tool/<name>/calls and errors, and tool/<name>/<key> the mean per call of its ToolResult.metrics."""
        c, rows = self.counts, max(self.rows, 1)
        out = {"rollout/turns_mean": self.turns / rows, "rollout/turns_max": float(self.turns_max),
               "rollout/tool_calls_mean": c["tool_calls"] / rows,
               "rollout/tool_call_errors": float(c["tool_call_errors"]),
               "rollout/tool_tokens_frac": (self.tokens - self.policy_tokens) / self.tokens if self.tokens else 0.0,
               "rollout/tokenization_mismatches": float(self.mismatches)}
        for k in ("tool_calls_dropped", "cut_before_answer", "interaction_turns"):
            out[f"rollout/{k}"] = float(c[k])
        for k, v in c.items():
            if k.startswith("tool/"):
                _, name, key = k.split("/", 2)
                out[k] = float(v) if key in ("calls", "errors") else float(v) / max(c[f"tool/{name}/calls"], 1)
        return out
