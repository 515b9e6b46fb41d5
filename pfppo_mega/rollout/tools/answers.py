"""Tools and an interaction that grade the policy's answer against the row's ground truth, as verl's
demo tools do (verl.tools.gsm8k_tool.Gsm8kTool, verl.tools.geo3k_tool.Geo3kTool,
verl.interactions.gsm8k_interaction.Gsm8kInteraction). Each row's ground truth arrives at ``create``
/ ``start`` (``extra_info.tools_kwargs[<tool>].create_kwargs.ground_truth``, resp.
``extra_info.interaction_kwargs.ground_truth``).

The tools' step reward is verl's: a call whose score does not beat the row's previous call's score
costs -0.05, an improving call 0.0 (so the first correct call is free and repeating it costs). The
score itself is logged as ``tool/<name>/score``. An instance lasts the row here; verl 0.9.1 creates
one per call, so there the previous score is always 0 (docs/multiturn_tools.md).

GSM8K (verl's gsm8k reward with its exact rules, which differ from rewards/rules.py's gsm8k scorer):
    only the text's last 300 characters are read;
    strict (the interaction): the number after the last "#### ", "," and "$" dropped;
    flexible (the tool, which prefixes "#### " to the submitted answer unless it starts so): the
    last number-like run of digits, dots and commas (commas kept, "." alone skipped);
    then 1.0 when that string equals the ground truth's string exactly ("72.0" is not "72"), else 0.0.

geo3k (verl grades with mathruler's grade_answer): here ``grade_math_answer``: equal after
rules.normalize_math, or both sides evaluate to numbers within 1e-9 (relative) through a small
evaluator of numbers, \\frac, \\sqrt (and \\sqrt[n]), \\pi, + - * / ^, \\cdot, \\times and
implicit products ("2\\sqrt{3}"). mathruler decides symbolic equality with sympy and also compares
tuples and intervals element by element; those (and expressions with variables) grade by their
normalised text only here.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from typing import Any

from pfppo_mega.rewards.rules import normalize_math
from pfppo_mega.rollout.tools.base import InteractionTurn, ToolResult

NON_IMPROVING_PENALTY = -0.05
_CLIP_CHARS = 300
_STRICT = re.compile(r"#### (-?[0-9.,]+)")
_FLEXIBLE = re.compile(r"(-?[0-9.,]+)")


# ----------------------------------------------------------------------------- grading


def gsm8k_answer(text: str, method: str) -> str | None:
    """The answer verl's gsm8k reward reads from ``text`` (``method`` strict or flexible)."""
    tail = text[-_CLIP_CHARS:]
    if method == "strict":
        found = _STRICT.findall(tail)
        return found[-1].replace(",", "").replace("$", "") if found else None
    if method != "flexible":
        raise ValueError(f"method {method!r}: strict or flexible")
    for candidate in reversed(_FLEXIBLE.findall(tail)):
        if candidate not in ("", "."):
            return candidate
    return None


def gsm8k_score(text: str, ground_truth: Any, method: str) -> float:
    answer = gsm8k_answer(text, method)
    return 1.0 if answer is not None and answer == str(ground_truth) else 0.0


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.Pow: operator.pow}


def _braced(s: str, i: int) -> tuple[str, int]:
    """The group starting at s[i] ('{...}' with nesting, else one character) and the index after it."""
    if i >= len(s):
        raise ValueError("missing argument")
    if s[i] != "{":
        return s[i], i + 1
    depth = 0
    for j in range(i, len(s)):
        depth += {"{": 1, "}": -1}.get(s[j], 0)
        if depth == 0:
            return s[i + 1:j], j + 1
    raise ValueError("unbalanced braces")


def _to_python(s: str) -> str:
    r"""LaTeX arithmetic -> a Python expression over numbers, sqrt() and pi (ValueError otherwise)."""
    out, i = [], 0
    while i < len(s):
        if s.startswith(("\\frac", "\\dfrac", "\\tfrac"), i):
            i = s.index("frac", i) + 4
            num, i = _braced(s, i)
            den, i = _braced(s, i)
            out.append(f"(({_to_python(num)})/({_to_python(den)}))")
        elif s.startswith("\\sqrt", i):
            i += 5
            if i < len(s) and s[i] == "[":
                j = s.index("]", i)
                root, i = s[i + 1:j], j + 1
                arg, i = _braced(s, i)
                out.append(f"(({_to_python(arg)})**(1/({_to_python(root)})))")
            else:
                arg, i = _braced(s, i)
                out.append(f"sqrt({_to_python(arg)})")
        elif s.startswith("\\pi", i):
            out.append("pi")
            i += 3
        elif s.startswith(("\\cdot", "\\times"), i):
            out.append("*")
            i += 5 if s.startswith("\\cdot", i) else 6
        elif s[i] in "{(":
            out.append("(")
            i += 1
        elif s[i] in "})":
            out.append(")")
            i += 1
        elif s[i] == "^":
            out.append("**")
            i += 1
        elif s[i].isdigit() or s[i] in ".+-*/":
            out.append(s[i])
            i += 1
        else:
            raise ValueError(f"cannot evaluate {s[i:]!r}")
    expr = "".join(out)
    # implicit products: 2sqrt(3), 2pi, )(, 2(
    return re.sub(r"(?<=[\d.)i])\s*(?=sqrt|pi|\()", "*", expr)


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return float(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _eval(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.Name) and node.id == "pi":
        return math.pi
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "sqrt" and len(node.args) == 1:
        return math.sqrt(_eval(node.args[0]))
    raise ValueError("not arithmetic")


def math_value(answer: str) -> float | None:
    """The number a LaTeX arithmetic answer denotes, or None when it is not one."""
    s = re.sub(r"\s+|\$|\\left|\\right|\\!|\\,|\^\\circ|\^\{\\circ\}|\\%", "", answer).rstrip(".")
    if not s or len(s) > 200:
        return None
    try:
        v = _eval(ast.parse(_to_python(s), mode="eval"))
    except (ValueError, SyntaxError, ZeroDivisionError, OverflowError, TypeError, RecursionError):
        return None
    return v if isinstance(v, float) and math.isfinite(v) else None


def grade_math_answer(given: str, truth: Any) -> bool:
    """True when ``given`` and ``truth`` are the same answer (module docstring, geo3k)."""
    given, truth = str(given), str(truth)
    if not given.strip():
        return False
    if normalize_math(given) == normalize_math(truth):
        return True
    a, b = math_value(given), math_value(truth)
    return a is not None and b is not None and abs(a - b) <= 1e-9 * max(1.0, abs(b))


# ----------------------------------------------------------------------------- the tools


def _schema_name(tool_schema: dict) -> str:
    return tool_schema["function"]["name"]


class _AnswerTool:
    """One submitted answer per call, graded against the row's ground truth; verl's step reward."""

    CONFIG: dict[str, Any] = {}  # no keys besides ``type``

    def __init__(self, config: dict, tool_schema: dict):
        self.schema, self.name = tool_schema, _schema_name(tool_schema)
        self._rows: dict[str, dict[str, Any]] = {}

    def check_create(self, **create_kwargs: Any) -> None:
        """What ``create`` would refuse in a row's create_kwargs (checked for every row at start)."""
        gt = create_kwargs.get("ground_truth")
        if gt is None or isinstance(gt, bool) or not isinstance(gt, (str, int, float)):
            raise ValueError(f"tool {self.name!r}: create needs ground_truth (a string or a number: the row's "
                             f"extra_info.tools_kwargs.{self.name}.create_kwargs.ground_truth); got {gt!r}")

    def create(self, instance_id: str, **create_kwargs: Any) -> None:
        self.check_create(**create_kwargs)
        self._rows[instance_id] = {"ground_truth": create_kwargs["ground_truth"], "score": 0.0}

    def _row(self, instance_id: str) -> dict[str, Any]:
        if instance_id not in self._rows:
            raise KeyError(f"tool {self.name!r}: no instance {instance_id!r} (created: {len(self._rows)})")
        return self._rows[instance_id]

    def _score(self, answer: str, ground_truth: Any) -> float:
        raise NotImplementedError

    def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        row = self._row(instance_id)
        answer = arguments.get("answer", "")
        answer = answer if isinstance(answer, str) else str(answer)
        score = self._score(answer, row["ground_truth"])
        step = 0.0 if score > row["score"] else NON_IMPROVING_PENALTY
        row["score"] = score
        return ToolResult(f"Current parsed answer={answer!r} reward={score}", reward=step, metrics={"score": score})

    def score(self, instance_id: str) -> float:
        """The score of the row's last answer (verl's calc_reward)."""
        return self._row(instance_id)["score"]

    def release(self, instance_id: str) -> None:
        self._row(instance_id)
        del self._rows[instance_id]


class Gsm8kTool(_AnswerTool):
    """verl's calc_gsm8k_reward: flexible GSM8K grading of the submitted answer, prefixed "#### "."""

    def _score(self, answer: str, ground_truth: Any) -> float:
        return gsm8k_score(answer if answer.startswith("#### ") else "#### " + answer, ground_truth, "flexible")


class Geo3kTool(_AnswerTool):
    """verl's calc_geo3k_reward: the submitted answer graded as a math answer (grade_math_answer)."""

    def _score(self, answer: str, ground_truth: Any) -> float:
        return 1.0 if grade_math_answer(answer, ground_truth) else 0.0


# ----------------------------------------------------------------------------- the interaction

CORRECT = "Correct."  # not shown: the conversation ends
INCORRECT = "Your answer is not correct yet. Check your reasoning and answer again, ending with #### <number>."


class Gsm8kInteraction:
    """verl's Gsm8kInteraction: after each policy turn, strict GSM8K grading of the last assistant
    message; correct ends the conversation with score 1.0, else the user asks again (score 0.0)."""

    CONFIG: dict[str, Any] = {}

    def __init__(self, config: dict):
        self.name = config["name"]
        self._rows: dict[str, Any] = {}

    def check_start(self, **kwargs: Any) -> None:
        """What ``start`` would refuse in a row's interaction_kwargs (checked for every row at start)."""
        gt = kwargs.get("ground_truth")
        if gt is None or isinstance(gt, bool) or not isinstance(gt, (str, int, float)):
            raise ValueError(f"interaction {self.name!r}: start needs ground_truth (a string or a number: the row's "
                             f"extra_info.interaction_kwargs.ground_truth); got {gt!r}")

    def start(self, instance_id: str, **kwargs: Any) -> None:
        self.check_start(**kwargs)
        self._rows[instance_id] = kwargs["ground_truth"]

    def respond(self, instance_id: str, messages: list[dict[str, Any]]) -> InteractionTurn:
        if instance_id not in self._rows:
            raise KeyError(f"interaction {self.name!r}: no instance {instance_id!r}")
        last = next((m.get("content") or "" for m in reversed(messages) if m.get("role") == "assistant"), "")
        score = gsm8k_score(str(last), self._rows[instance_id], "strict")
        if score == 1.0:
            return InteractionTurn(terminate=True, text=CORRECT, score=1.0)
        return InteractionTurn(terminate=False, text=INCORRECT, score=0.0)

    def finish(self, instance_id: str) -> None:
        if instance_id not in self._rows:
            raise KeyError(f"interaction {self.name!r}: no instance {instance_id!r}")
        del self._rows[instance_id]
