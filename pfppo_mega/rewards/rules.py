"""Rule-based scorers: GSM8K answers (`#### 42`), boxed math answers, verl's "Answer: X" rule
(math_dapo), exact match.

Each scorer is `score(solution_str, ground_truth) -> float` (1.0 right, 0.0 wrong; math_dapo,
as in verl, +1.0 right and -1.0 wrong), pure Python,
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


# ----------------------------------------------------------------------------- "Answer: X" (verl's math_dapo)

# The rule verl applies to data_source math_dapo and aime* (verl/utils/reward_score/math_dapo.py,
# itself after the Minerva answer normalisation); reproduced from its description, step by step.
_ANSWER_RE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_DAPO_TAIL_CHARS = 300  # only the response's last 300 characters are read
# step 2: literal rewrites, in this order ("a " and "an " go first: "a 5" -> "5")
_DAPO_REWRITES = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""),
                  ("mbox", "text"), (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
# step 3: words and marks deleted wherever they occur, in this order
_DAPO_DELETED = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots",
                 "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters",
                 "meals", "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}",
                 "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ",
                 "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots")
# step 5: wrappers whose content is kept (the first non-greedy; \boxed{} greedy, to its last brace)
_DAPO_UNWRAP = ((re.compile(r"\\text\{(.*?)\}"), r"\1"), (re.compile(r"\\textbf\{(.*?)\}"), r"\1"),
                (re.compile(r"\\overline\{(.*?)\}"), r"\1"), (re.compile(r"\\boxed\{(.*)\}"), r"\1"))


def normalize_dapo(answer: str) -> str:
    r"""verl's math_dapo normal form of an answer:
    1. keep what follows the last "=";
    2. the rewrites of _DAPO_REWRITES in order (every space goes: "x = 5" reads "5");
    3. delete the units and marks of _DAPO_DELETED in order ("5 cm" -> "5", "90^\circ" -> "90");
    4. a "$...$" span anywhere: keep the first one only ("is $5$ here" -> "$5$");
    5. \text{x}, \textbf{x}, \overline{x} -> x; \boxed{x} -> x;
    6. \fracab -> \frac{a}{b} and \sqrta -> \sqrt{a} (a one-character argument braced);
    7. drop "$"; 8. "1,234" (digits and commas only) -> "1234"; 9. strip."""
    s = answer.split("=")[-1]
    for old, new in _DAPO_REWRITES:
        s = s.replace(old, new)
    for gone in _DAPO_DELETED:
        s = s.replace(gone, "")
    s = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", s)
    for pattern, keep in _DAPO_UNWRAP:
        s = pattern.sub(keep, s)
    s = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", s)
    s = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


def extract_answer(text: str) -> str:
    """What follows the last "Answer:" (any case, to the end of its line) in the response's last
    300 characters; "[INVALID]" when there is none (then it matches no ground truth)."""
    found = _ANSWER_RE.findall(text[-_DAPO_TAIL_CHARS:])
    return found[-1] if found else "[INVALID]"


def math_dapo_score(solution_str: str, ground_truth: Any) -> float:
    """+1.0 when normalize_dapo of the response's answer (extract_answer) equals normalize_dapo
    of the ground truth, else -1.0 (verl's math_dapo reward: a wrong or missing answer costs)."""
    return 1.0 if normalize_dapo(extract_answer(solution_str)) == normalize_dapo(str(ground_truth)) else -1.0


# ----------------------------------------------------------------------------- exact match


def exact_match_score(solution_str: str, ground_truth: Any) -> float:
    """1.0 when the response equals the ground truth, leading/trailing whitespace ignored."""
    return float(solution_str.strip() == str(ground_truth).strip())


# ----------------------------------------------------------------------------- registry

SCORERS: dict[str, Scorer] = {"gsm8k": gsm8k_score, "math": math_score, "exact_match": exact_match_score,
                               "math_dapo": math_dapo_score}

# data_source values (verl's example datasets and their usual spellings) -> scorer name.
DATA_SOURCE_SCORERS: dict[str, str] = {
    "gsm8k": "gsm8k", "openai/gsm8k": "gsm8k",
    "math": "math", "lighteval/MATH": "math", "DigitalLearningGmbH/MATH-lighteval": "math",
    "HuggingFaceH4/MATH-500": "math",
    "math_dapo": "math_dapo", "math_dapo_reasoning": "math_dapo",
    "exact_match": "exact_match",
}
# data_source values verl scores by running the response's code on the row's test cases (its default
# scorer, with reward_model.sandbox_fusion.url): here through reward.sandbox_fusion (rewards/sandbox_fusion.py).
CODE_DATA_SOURCES = ("codecontests", "apps", "codeforces", "taco")
# data_source prefixes -> scorer name: verl scores every aime* source (aime, aime2024, aime_2025, ...)
# with the "Answer:" rule.
DATA_SOURCE_PREFIX_SCORERS: dict[str, str] = {"aime": "math_dapo"}


def scorer_name(data_source: str, default: str | None) -> str | None:
    """The scorer for a data_source: the registry's (exact name, then prefix), else `default`, else None."""
    if data_source in DATA_SOURCE_SCORERS:
        return DATA_SOURCE_SCORERS[data_source]
    for prefix, name in DATA_SOURCE_PREFIX_SCORERS.items():
        if data_source.startswith(prefix):
            return name
    return default
