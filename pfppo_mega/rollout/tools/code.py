"""A code interpreter (verl's verl.tools.sandbox_fusion_tools.SandboxFusionTool, the ReTool setup): the
policy calls it with ``{"code": "..."}`` (optionally ``timeout``, ``language``) and reads what the program
printed. The program runs on a SandboxFusion service through rewards/sandbox_fusion.py's client (its
request, retries and errors are described there).

What the policy reads: the program's stdout followed by its stderr when it ran to its end (any exit
code, so a traceback is shown, as in verl); when it did not (time limit, or it never compiled) a line
naming what stopped it (verl shows "no stdout here" then). The service failing (unreachable, HTTP
error, its SandboxError, no answer in time) raises SandboxFusionError: the rollout loop shows its text
and counts the failure. No step reward (verl's is None). Metrics: ``time_limit`` (1 when the run hit
its limit), ``exit_nonzero``.
"""

from __future__ import annotations

from typing import Any

from pfppo_mega.rewards.sandbox_fusion import LANGUAGES, SandboxFusionClient
from pfppo_mega.rollout.tools.base import ToolResult
from pfppo_mega.rollout.tools.options import Opt, PerRowNothing, with_defaults


class SandboxFusionTool(PerRowNothing):
    CONFIG = {
        "sandbox_fusion_url": Opt(str, None, url=True, doc="the service's run_code endpoint (required)"),
        "num_workers": Opt(int, 10, ge=1, le=4096, doc="requests in flight without the rate limit"),
        "rate_limit": Opt(int, 10, ge=1, le=4096, doc="requests in flight (with enable_global_rate_limit)"),
        "enable_global_rate_limit": Opt(bool, True),
        "default_timeout": Opt(float, 30, ge=0.001, le=3600, doc="run (and compile) limit of a call, seconds"),
        "default_language": Opt(str, "python", choices=LANGUAGES),
        "memory_limit_mb": Opt(int, 1024, ge=1, le=1 << 20),
        "max_retries": Opt(int, 3, ge=1, le=100, doc="tries in all on HTTP 502/503/504 (ours; verl: 3, 504 only)"),
        "retry_delay_s": Opt(float, 1.0, ge=0, le=600, doc="the wait after try k is k x this (ours; verl: 1)"),
    }

    def __init__(self, config: dict, tool_schema: dict):
        super().__init__()
        c = with_defaults(self.CONFIG, config)
        self.schema, self.name = tool_schema, tool_schema["function"]["name"]
        self.default_timeout, self.default_language = float(c["default_timeout"]), c["default_language"]
        bound = min(c["num_workers"], c["rate_limit"]) if c["enable_global_rate_limit"] else c["num_workers"]
        self.client = SandboxFusionClient(c["sandbox_fusion_url"], memory_limit_mb=c["memory_limit_mb"],
                                          max_concurrent=bound, max_retries=c["max_retries"],
                                          retry_delay_s=float(c["retry_delay_s"]))

    def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        self._check_row(instance_id)
        code = arguments.get("code", "")
        code = code if isinstance(code, str) else str(code)
        timeout = arguments.get("timeout", self.default_timeout)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 3600:
            raise ValueError(f"'timeout' must be a number of seconds in (0, 3600]; got {timeout!r}")
        language = arguments.get("language", self.default_language)
        if language not in LANGUAGES:
            raise ValueError(f"'language' {language!r} is not one of {list(LANGUAGES)}")
        run = self.client.run(code, language=language, timeout_s=float(timeout))
        metrics = {"time_limit": float(run.run_status == "TimeLimitExceeded"),
                   "exit_nonzero": float(run.finished and run.return_code not in (0, None))}
        if run.finished:
            return ToolResult(run.stdout + run.stderr, metrics=metrics)
        if run.run_status == "TimeLimitExceeded":
            return ToolResult(f"(no output: the program ran past its {timeout:g} s limit)", metrics=metrics)
        if run.run_status is None and run.compile_status is not None:
            return ToolResult(f"(no output: compilation ended with {run.compile_status})\n{run.compile_stderr}".rstrip(),
                              metrics=metrics)
        return ToolResult(f"(no output: the run ended with status {run.run_status or run.status})", metrics=metrics)
