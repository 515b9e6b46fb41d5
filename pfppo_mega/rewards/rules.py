"""Rule-based scorers: GSM8K answers (`#### 42`), boxed math answers, exact match.

Each scorer is `score(solution_str, ground_truth) -> float` (1.0 right, 0.0 wrong), pure Python,
no torch. The registry maps a `data_source` to its scorer; `reward.default_scorer` covers the
sources it does not know. Extraction and normalisation rules are spelled out next to each
function so a user can predict what scores.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any, Callable

Scorer = Callable[[str, Any], float]

# ----------------------------------------------------------------------------- numbers

_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def _as_fraction(text: str) -> Fraction | None:
    """'1,234' -> 1234, '0.50' -> 1/2, '3/4' -> 3/4, '-2' -> -2; anything else -> None."""
    t = text.strip().replace(",", "")
    if not t:
        return None
    try:
        return Fraction(t)
    except (ValueError, ZeroDivisionError):
        return None


# ----------------------------------------------------------------------------- GSM8K

_GSM8K_RE = re.compile(r"####\s*\$?\s*(-?[\d,]*\.?\d+)")


def extract_gsm8k(text: str) -> str | None:
    """The number after the last `####` (commas and a leading $ allowed), or None."""
    found = _GSM8K_RE.findall(text)
    return found[-1].replace(",", "") if found else None


def gsm8k_score(solution_str: str, ground_truth: Any) -> float:
    """1.0 when the number after the response's last `####` equals the ground truth's (a bare
    number, or a GSM8K solution text ending in `#### n`), compared as exact rationals."""
    got = extract_gsm8k(solution_str)
    gt = str(ground_truth)
    want = extract_gsm8k(gt) if "####" in gt else gt
    if got is None or want is None:
        return 0.0
    a, b = _as_fraction(got), _as_fraction(want)
    return float(a is not None and a == b)


# ----------------------------------------------------------------------------- boxed math


def last_boxed(text: str) -> str | None:
    r"""Content of the last `\boxed{...}` / `\fbox{...}` (nested braces matched), or of a
    trailing `\boxed 5`; None when there is none or its braces never close."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    while i < len(text) and text[i] == " ":
        i += 1
    if i < len(text) and text[i] != "{":  # \boxed 5
        m = re.match(r"[^\s$]+", text[i:])
        return m.group(0) if m else None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1: j]
    return None


_DROP = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\quad", "\\displaystyle", "$", "^\\circ",
         "^{\\circ}", "\\%", "%")


def _fix_fracs(s: str) -> str:
    r"""\frac12 -> \frac{1}{2}, \frac1{b} -> \frac{1}{b} (single-character arguments braced)."""
    out, i = [], 0
    while i < len(s):
        if s.startswith("\\frac", i):
            out.append("\\frac")
            i += 5
            for _ in range(2):
                if i < len(s) and s[i] not in "{\\":
                    out.append("{" + s[i] + "}")
                    i += 1
                else:
                    depth = 0
                    j = i
                    while j < len(s):
                        depth += s[j] == "{"
                        depth -= s[j] == "}"
                        j += 1
                        if depth == 0:
                            break
                    out.append(s[i:j])
                    i = j
        else:
            out.append(s[i])
            i += 1
    return "".join(out)


def normalize_math(answer: str) -> str:
    r"""A canonical string for a math answer: LaTeX spacing and sizing commands, `$`, degrees and
    percent signs, `\text{...}` wrappers and trailing periods dropped; `\dfrac`/`\tfrac` ->
    `\frac` with single-character arguments braced; `a/b` and `\frac{a}{b}` of integers and
    decimals reduced to one rational (`\frac{2}{4}`, `1/2`, `0.5` all read `1/2`); whitespace
    removed."""
    s = answer.strip()
    s = re.sub(r"\\text\{(.*?)\}", r"\1", s)
    s = re.sub(r"\\mbox\{(.*?)\}", r"\1", s)
    for token in _DROP:
        s = s.replace(token, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\s+", "", s).rstrip(".")
    s = _fix_fracs(s)
    if s.startswith("x=") or s.startswith("y="):  # "x = 5" -> "5"
        s = s[2:]
    m = re.fullmatch(r"(-?)\\frac\{([^{}]+)\}\{([^{}]+)\}", s)
    if m:
        s = f"{m.group(1)}{m.group(2)}/{m.group(3)}"
    value = _as_fraction(s)
    if value is not None:
        return str(value)
    return s


def math_score(solution_str: str, ground_truth: Any) -> float:
    r"""1.0 when the response's last `\boxed{}` equals the ground truth after `normalize_math`
    (the ground truth may itself be boxed)."""
    got = last_boxed(solution_str)
    gt = str(ground_truth)
    want = last_boxed(gt) if "\\boxed" in gt or "\\fbox" in gt else gt
    if got is None or want is None:
        return 0.0
    return float(normalize_math(got) == normalize_math(want))


# ----------------------------------------------------------------------------- exact match


def exact_match_score(solution_str: str, ground_truth: Any) -> float:
    """1.0 when the response equals the ground truth, leading/trailing whitespace ignored."""
    return float(solution_str.strip() == str(ground_truth).strip())


# ----------------------------------------------------------------------------- registry

SCORERS: dict[str, Scorer] = {"gsm8k": gsm8k_score, "math": math_score, "exact_match": exact_match_score}

# data_source values (verl's example datasets and their usual spellings) -> scorer name.
DATA_SOURCE_SCORERS: dict[str, str] = {
    "gsm8k": "gsm8k", "openai/gsm8k": "gsm8k",
    "math": "math", "lighteval/MATH": "math", "DigitalLearningGmbH/MATH-lighteval": "math",
    "HuggingFaceH4/MATH-500": "math", "math_dapo": "math", "aime": "math",
    "exact_match": "exact_match",
}


def scorer_name(data_source: str, default: str | None) -> str | None:
    """The scorer for a data_source: the registry's, else `default`, else None."""
    return DATA_SOURCE_SCORERS.get(data_source, default)
