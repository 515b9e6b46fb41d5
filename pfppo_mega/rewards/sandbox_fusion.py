"""Code execution through a SandboxFusion service (github.com/bytedance/SandboxFusion, its ``run_code``
API), for the code reward (verl's ``reward_model.sandbox_fusion``) and the code-interpreter tool of
multi-turn rollouts. Standard library only (urllib), so a reward worker or a tool loads it at once.

The request, as the service documents it: ``POST <url>`` with a JSON body ``{code, language, stdin,
compile_timeout, run_timeout, memory_limit_MB, files, fetch_files}``; the answer is JSON
``{status: Success | Failed | SandboxError, message, compile_result, run_result}``, each result
``{status: Finished | TimeLimitExceeded | Error, return_code, stdout, stderr, execution_time}``.

What is the service's fault and what is the program's:
    the program ran (Success / Failed)          -> a RunResult: passed or not, the policy's doing
    the service failed (SandboxError, HTTP error, no answer within the limit, not JSON)
                                                -> SandboxFusionError (SandboxTimeout for no answer);
                                                   the reward counts it in guard/reward_errors, the
                                                   tool answers the policy with its text
HTTP 502 / 503 / 504 (a gateway's "try again") are retried ``max_retries`` times in all, waiting
``retry_delay_s`` x the attempt number between tries (verl retries 504 only, 3 tries, 1 s steps).

The code reward (verl's ``sandbox_fusion.compute_score`` with ``continuous=True``, as verl's
default scorer calls it for data_source codecontests / apps / codeforces / taco):
    1. the code: after the last ```` ```python ```` up to the next fence; else the first fenced
       block (a first line of letters only, a language tag, dropped); no fence: score 0;
    2. the row's test cases (its ground truth: a JSON object or string) ``{inputs, outputs}``
       (``fn_name``: call-based, each input is the function's arguments, one JSON value a line;
       ``assert_case``: code appended to the program, which passes when it runs cleanly);
    3. each of the first 10 cases runs as its own request, stdin = the input; a case passes when the
       run finished with exit code 0 and stdout equals the expected output, trailing newlines
       ignored on both;
    4. score = passed / min(cases, 10). (verl runs every case and reads the first 10; a later case
       never changes the first 10's results there, so running only those scores the same.)
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Sequence

# SandboxFusion's languages (its documentation's list; verl refuses a call in any other).
LANGUAGES = ("python", "cpp", "nodejs", "go", "go_test", "java", "php", "csharp", "bash", "typescript", "sql",
             "rust", "cuda", "lua", "R", "perl", "D_ut", "ruby", "scala", "julia", "pytest", "junit",
             "kotlin_script", "jest", "verilog", "python_gpu", "lean", "swift", "racket")
RETRIED_HTTP = (502, 503, 504)
SCORED_CASES = 10  # verl's continuous score reads the first 10 cases


class SandboxFusionError(RuntimeError):
    """The service did not run the program: unreachable, an HTTP error, an answer that is not its
    JSON, or its own SandboxError."""


class SandboxTimeout(SandboxFusionError):
    """No answer within the request's time limit (run + compile limits + slack)."""


@dataclass(frozen=True)
class RunResult:
    """One run as the service reports it."""

    status: str                      # Success | Failed (the program's outcome as the service sums it up)
    run_status: str | None           # Finished | TimeLimitExceeded | Error; None: it never ran (compile failed)
    return_code: int | None
    stdout: str
    stderr: str
    compile_status: str | None = None
    compile_stderr: str = ""

    @property
    def finished(self) -> bool:
        """The program ran to its end (any exit code)."""
        return self.run_status == "Finished"

    @property
    def clean(self) -> bool:
        """It ran to its end with exit code 0 and compiled (if it had to)."""
        return self.status == "Success" and self.finished and self.return_code in (0, None)

    def passes(self, expected: Any) -> bool:
        """A test case's verdict: a clean run whose stdout equals ``expected`` (trailing newlines
        ignored; None expects nothing)."""
        if not self.clean:
            return False
        return expected is None or self.stdout.rstrip("\n") == str(expected).rstrip("\n")


def _text(x: Any) -> str:
    return x if isinstance(x, str) else ("" if x is None else str(x))


class SandboxFusionClient:
    """Runs programs on one service. Thread-safe; at most ``max_concurrent`` requests in flight at
    once from this client (a semaphore: verl's ``sandbox_fusion.max_concurrent``)."""

    def __init__(self, url: str, *, memory_limit_mb: int = 1024, max_concurrent: int = 64,
                 max_retries: int = 3, retry_delay_s: float = 1.0, slack_s: float = 10.0):
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"sandbox fusion url {url!r}: must be an http:// or https:// URL of the run_code API")
        self.url, self.memory_limit_mb = url, memory_limit_mb
        self.max_retries, self.retry_delay_s, self.slack_s = max_retries, retry_delay_s, slack_s
        self.max_concurrent = max_concurrent
        self._slots = threading.BoundedSemaphore(max_concurrent)

    def run(self, code: str, *, stdin: str | None = None, language: str = "python",
            timeout_s: float = 10.0) -> RunResult:
        """Run ``code`` once (compile and run limits ``timeout_s`` each). Raises SandboxFusionError
        / SandboxTimeout when the service did not run it."""
        if language not in LANGUAGES:
            raise ValueError(f"language {language!r}: not one of SandboxFusion's {list(LANGUAGES)}")
        body = json.dumps({"code": code, "language": language, "stdin": stdin, "compile_timeout": timeout_s,
                           "run_timeout": timeout_s, "memory_limit_MB": self.memory_limit_mb, "files": {},
                           "fetch_files": []}).encode()
        limit = 2 * timeout_s + self.slack_s
        with self._slots:
            answer = self._post(body, limit)
        return self._result(answer)

    def _post(self, body: bytes, limit: float) -> Any:
        last = ""
        for attempt in range(1, self.max_retries + 1):
            req = urllib.request.Request(self.url, data=body, method="POST",
                                         headers={"Content-Type": "application/json", "Accept": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=limit) as resp:
                    raw = resp.read()
            except urllib.error.HTTPError as e:
                detail = e.read()[:200].decode("utf-8", "replace") if e.fp else ""
                last = f"HTTP {e.code} {e.reason}" + (f": {detail}" if detail else "")
                if e.code in RETRIED_HTTP and attempt < self.max_retries:
                    time.sleep(self.retry_delay_s * attempt)
                    continue
                raise SandboxFusionError(f"sandbox fusion at {self.url} answered {last} "
                                         f"(attempt {attempt} of {self.max_retries})") from None
            except (socket.timeout, TimeoutError) as e:
                raise SandboxTimeout(f"sandbox fusion at {self.url}: no answer within {limit:g} s (the run "
                                     f"and compile limits + {self.slack_s:g} s): {e}") from None
            except urllib.error.URLError as e:
                if isinstance(e.reason, (socket.timeout, TimeoutError)):
                    raise SandboxTimeout(f"sandbox fusion at {self.url}: no answer within {limit:g} s") from None
                raise SandboxFusionError(f"sandbox fusion at {self.url} unreachable: {e.reason}") from None
            except (OSError, http.client.HTTPException) as e:  # reset / closed mid-answer
                raise SandboxFusionError(f"sandbox fusion at {self.url}: connection failed: {e}") from None
            try:
                return json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise SandboxFusionError(f"sandbox fusion at {self.url} answered something that is not JSON "
                                         f"({e}): {raw[:120]!r}") from None
        raise SandboxFusionError(f"sandbox fusion at {self.url}: {last} after {self.max_retries} attempts")

    def _result(self, answer: Any) -> RunResult:
        if not isinstance(answer, dict) or answer.get("status") not in ("Success", "Failed", "SandboxError"):
            raise SandboxFusionError(f"sandbox fusion at {self.url} answered without a status of Success / Failed / "
                                     f"SandboxError: {str(answer)[:200]!r}")
        if answer["status"] == "SandboxError":
            raise SandboxFusionError(f"sandbox fusion at {self.url} failed to run the program (SandboxError): "
                                     f"{_text(answer.get('message'))[:200]!r}")
        run = answer.get("run_result") if isinstance(answer.get("run_result"), dict) else {}
        comp = answer.get("compile_result") if isinstance(answer.get("compile_result"), dict) else {}
        code = run.get("return_code")
        return RunResult(status=answer["status"], run_status=run.get("status"),
                         return_code=code if isinstance(code, int) else None,
                         stdout=_text(run.get("stdout")), stderr=_text(run.get("stderr")),
                         compile_status=comp.get("status"), compile_stderr=_text(comp.get("stderr")))


# ----------------------------------------------------------------------------- the code reward


def extract_code(text: str) -> str | None:
    """The program in a response (rule 1 of the module docstring); None when it has no fence."""
    tag = "```python"
    if tag in text:
        return text.rsplit(tag, 1)[1].split("```", 1)[0]
    if "```" not in text:
        return None
    block = text.split("```")[1]
    first, nl, rest = block.partition("\n")
    return rest if nl and first.strip().isalpha() else block


@dataclass(frozen=True)
class TestCases:
    inputs: list[Any]
    outputs: list[Any]                # None: the case passes on a clean run (assert cases)
    fn_name: str | None = None
    assert_cases: list[str] = field(default_factory=list)


def parse_test_cases(ground_truth: Any) -> TestCases:
    """A row's test cases from its ground truth (a dict, or a JSON string of one); ValueError
    saying what is wrong otherwise."""
    gt = ground_truth
    if isinstance(gt, (str, bytes)):
        try:
            gt = json.loads(gt)
        except json.JSONDecodeError as e:
            raise ValueError(f"is not JSON ({e.msg} at {e.pos}): {str(ground_truth)[:80]!r}") from None
    if not isinstance(gt, dict):
        raise ValueError(f"is a {type(gt).__name__}, not an object with 'inputs' and 'outputs' lists")
    asserts = gt.get("assert_case")
    if isinstance(asserts, list):
        if not asserts or not all(isinstance(a, str) for a in asserts):
            raise ValueError("'assert_case' must be a non-empty list of strings (code run after the program)")
        inputs = gt.get("inputs") or [""] * len(asserts)
        outputs = gt.get("outputs") or [None] * len(asserts)
    else:
        inputs, outputs = gt.get("inputs"), gt.get("outputs")
        asserts = []
    if not isinstance(inputs, list) or not isinstance(outputs, list):
        raise ValueError(f"needs 'inputs' and 'outputs' lists (or 'assert_case'); got keys {sorted(gt)}")
    if not inputs or len(inputs) != len(outputs) or (asserts and len(asserts) != len(inputs)):
        raise ValueError(f"has {len(inputs)} inputs, {len(outputs)} outputs"
                         + (f", {len(asserts)} assert cases" if asserts else "") + ": need as many, at least one")
    fn = gt.get("fn_name")
    if fn is not None and (not isinstance(fn, str) or not fn.isidentifier()):
        raise ValueError(f"'fn_name' {fn!r} is not a Python identifier")
    return TestCases(inputs, outputs, fn, asserts)


# Names a call-based (LeetCode-style) solution may use without importing them.
_PRELUDE = ("from typing import *\nfrom collections import *\nfrom math import *\nfrom heapq import *\n"
            "from bisect import *\nfrom itertools import *\nfrom functools import *\n"
            "import collections, heapq, math, itertools, functools, bisect, re, string, sys, json\n")
_CALL = """

def _pfppo_call_case():
    import json as _json, sys as _sys
    _args = [_json.loads(_line) for _line in _sys.stdin.read().splitlines() if _line.strip()]
    _fn = globals().get({fn!r})
    if _fn is None and isinstance(globals().get("Solution"), type):
        _fn = getattr(globals()["Solution"](), {fn!r}, None)
    if _fn is None:
        raise SystemExit("no function or Solution method named " + {fn!r})
    _out = _fn(*_args)
    print(_json.dumps(_out) if _out is None or isinstance(_out, (bool, dict, list, tuple)) else _out)


_pfppo_call_case()
"""


def case_program(code: str, cases: TestCases, i: int) -> tuple[str, str | None]:
    """(program, stdin) of case i: the code, its assert case appended, or wrapped to call fn_name
    with the case's arguments (one JSON value a line on stdin)."""
    inp = cases.inputs[i]
    if cases.fn_name:
        program = _PRELUDE + code + _CALL.format(fn=cases.fn_name)
        stdin = inp if isinstance(inp, str) else "\n".join(json.dumps(a) for a in (inp if isinstance(inp, list) else [inp]))
    else:
        program = code + ("\n\n" + cases.assert_cases[i] if cases.assert_cases else "")
        stdin = None if inp is None else (inp if isinstance(inp, str) else json.dumps(inp))
    return program, stdin


def continuous_score(passed: Sequence[bool]) -> float:
    """verl's continuous score: the passed fraction of the first SCORED_CASES cases."""
    head = list(passed)[:SCORED_CASES]
    return sum(head) / len(head) if head else 0.0


class SandboxCodeReward:
    """Scores responses by running their code on the rows' test cases (module docstring). One pool
    of ``client.max_concurrent`` threads serves a batch's cases; each call's result is one of
    ("value", score) or ("raised", what the service did wrong), as the reward guard reads them."""

    def __init__(self, client: SandboxFusionClient, *, case_timeout_s: float = 10.0, language: str = "python"):
        self.client, self.case_timeout_s, self.language = client, case_timeout_s, language

    def __call__(self, texts: Sequence[str], ground_truths: Sequence[Any]) -> list[tuple[str, Any]]:
        jobs: list[tuple[int, int, str, str | None, Any]] = []  # (row, case, program, stdin, expected)
        out: list[tuple[str, Any] | None] = [None] * len(texts)
        counts = [0] * len(texts)
        for r, (text, gt) in enumerate(zip(texts, ground_truths)):
            code = extract_code(text)
            try:
                cases = parse_test_cases(gt)
            except ValueError as e:
                out[r] = ("raised", f"ground truth {e}")
                continue
            if code is None:
                out[r] = ("value", 0.0)  # no fenced code block: nothing to run
                continue
            counts[r] = min(len(cases.inputs), SCORED_CASES)
            for i in range(counts[r]):
                program, stdin = case_program(code, cases, i)
                jobs.append((r, i, program, stdin, cases.outputs[i]))
        verdicts: dict[int, list[bool]] = {r: [False] * counts[r] for r in range(len(texts)) if out[r] is None}
        failures: dict[int, str] = {}
        if jobs:
            with ThreadPoolExecutor(max_workers=min(self.client.max_concurrent, len(jobs))) as pool:
                results = pool.map(self._case, jobs)
                for (r, i, *_), (ok, error) in zip(jobs, results):
                    verdicts[r][i] = ok
                    if error and r not in failures:
                        failures[r] = f"test case {i}: {error}"
        for r, passed in verdicts.items():
            out[r] = ("raised", failures[r]) if r in failures else ("value", continuous_score(passed))
        return out  # type: ignore[return-value]

    def _case(self, job: tuple[int, int, str, str | None, Any]) -> tuple[bool, str]:
        _, _, program, stdin, expected = job
        try:
            result = self.client.run(program, stdin=stdin, language=self.language, timeout_s=self.case_timeout_s)
        except SandboxFusionError as e:
            return False, str(e)
        return result.passes(expected), ""
