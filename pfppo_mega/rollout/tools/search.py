"""A search tool over a retrieval service (verl's verl.tools.search_tool.SearchTool, the Search-R1
setup): the policy calls it with ``{"query_list": [...]}`` and reads the top documents of each query.

The service's API (Search-R1's retrieval server, as verl calls it): ``POST <retrieval_service_url>``
with JSON ``{"queries": [...], "topk": k, "return_scores": true}``; the answer is JSON
``{"result": [[{"document": {"contents": "<title>\\n<text>", ...}, "score": s}, ...], ...]}``, one list
per query, in order. The policy reads, as verl renders it, a JSON object ``{"result": text}`` where
text lists each query's documents as "Doc i (Title: <first line>)\\n<rest>" separated by blank lines,
and the queries' blocks are separated by "\\n---\\n" ("No search results found." when there are none).

Failures (standard library only, urllib): HTTP 500 / 502 / 503 / 504, a refused connection and no
answer within ``timeout`` s are retried, ``max_retries`` tries in all, waiting 1 s, 2 s, ... x
``retry_delay_s`` between them (verl: 10 tries, 1 s steps); then, or at once for another HTTP error or
an answer that is not the API's JSON, the call raises SearchError (SearchTimeout when the last try
timed out), which the rollout loop shows the policy as the call's answer and counts. At most
``rate_limit`` requests are in flight per tool (``num_workers`` when ``enable_global_rate_limit`` is
false).
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from pfppo_mega.rollout.tools.base import ToolResult
from pfppo_mega.rollout.tools.options import Opt, PerRowNothing, with_defaults

RETRIED_HTTP = (500, 502, 503, 504)


class SearchError(RuntimeError):
    """The retrieval service gave no usable answer."""


class SearchTimeout(SearchError):
    """The retrieval service did not answer in time (after every retry)."""


class RetrievalClient:
    """POSTs query batches to one retrieval service; thread-safe, at most ``max_concurrent`` requests
    in flight."""

    def __init__(self, url: str, *, timeout_s: float = 30.0, max_retries: int = 10, retry_delay_s: float = 1.0,
                 max_concurrent: int = 120):
        self.url, self.timeout_s, self.max_retries, self.retry_delay_s = url, timeout_s, max_retries, retry_delay_s
        self._slots = threading.BoundedSemaphore(max_concurrent)

    def search(self, queries: list[str], topk: int) -> list[list[dict[str, Any]]]:
        """Per query, its documents (each a dict with a string document.contents)."""
        body = json.dumps({"queries": queries, "topk": topk, "return_scores": True}).encode()
        with self._slots:
            answer = self._post(body)
        return self._documents(answer, len(queries))

    def _post(self, body: bytes) -> Any:
        last, timed_out = "", False
        for attempt in range(1, self.max_retries + 1):
            if attempt > 1:
                time.sleep(self.retry_delay_s * (attempt - 1))
            req = urllib.request.Request(self.url, data=body, method="POST",
                                         headers={"Content-Type": "application/json", "Accept": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    raw = resp.read()
            except urllib.error.HTTPError as e:
                last, timed_out = f"HTTP {e.code} {e.reason}", False
                if e.code in RETRIED_HTTP:
                    continue
                raise SearchError(f"retrieval service at {self.url} answered {last}") from None
            except (socket.timeout, TimeoutError):
                last, timed_out = f"no answer within {self.timeout_s:g} s", True
                continue
            except urllib.error.URLError as e:
                timed_out = isinstance(e.reason, (socket.timeout, TimeoutError))
                last = f"no answer within {self.timeout_s:g} s" if timed_out else f"unreachable ({e.reason})"
                continue
            except (OSError, http.client.HTTPException) as e:
                last, timed_out = f"connection failed ({e})", False
                continue
            try:
                return json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise SearchError(f"retrieval service at {self.url} answered something that is not JSON ({e}): "
                                  f"{raw[:120]!r}") from None
        error = SearchTimeout if timed_out else SearchError
        raise error(f"retrieval service at {self.url}: {last} (after {self.max_retries} tries)")

    def _documents(self, answer: Any, n: int) -> list[list[dict[str, Any]]]:
        result = answer.get("result") if isinstance(answer, dict) else None
        bad = f"retrieval service at {self.url} answered without the API's shape"
        if not isinstance(result, list) or (result and len(result) != n):
            raise SearchError(f"{bad} ('result': one list of documents per query, {n} queries): {str(answer)[:200]!r}")
        for docs in result:
            if not isinstance(docs, list) or not all(
                    isinstance(d, dict) and isinstance(d.get("document"), dict)
                    and isinstance(d["document"].get("contents"), str) for d in docs):
                raise SearchError(f"{bad} (each document {{'document': {{'contents': str}}}}): {str(docs)[:200]!r}")
        return result


def render(results: list[list[dict[str, Any]]]) -> str:
    """The text the policy reads (module docstring)."""
    blocks = []
    for docs in results:
        lines = []
        for i, d in enumerate(docs, 1):
            title, _, text = d["document"]["contents"].partition("\n")
            lines.append(f"Doc {i} (Title: {title})\n{text}")
        blocks.append("\n\n".join(lines).strip())
    text = "\n---\n".join(blocks) if results else "No search results found."
    return json.dumps({"result": text}, ensure_ascii=False)


class SearchTool(PerRowNothing):
    """verl's SearchTool: ``query_list`` (a non-empty list of strings) -> the top ``topk`` documents of
    each query. No step reward."""

    CONFIG = {
        "retrieval_service_url": Opt(str, None, url=True, doc="the retrieval service's endpoint (required)"),
        "topk": Opt(int, 3, ge=1, le=1000, doc="documents per query"),
        "timeout": Opt(float, 30, ge=0.001, le=3600, doc="seconds one request may take"),
        "num_workers": Opt(int, 120, ge=1, le=4096, doc="requests in flight without the rate limit"),
        "rate_limit": Opt(int, 120, ge=1, le=4096, doc="requests in flight (with enable_global_rate_limit)"),
        "enable_global_rate_limit": Opt(bool, True),
        "max_retries": Opt(int, 10, ge=1, le=100, doc="tries in all (ours; verl: 10)"),
        "retry_delay_s": Opt(float, 1.0, ge=0, le=600, doc="the wait before try k is (k-1) x this (ours; verl: 1)"),
    }

    def __init__(self, config: dict, tool_schema: dict):
        super().__init__()
        c = with_defaults(self.CONFIG, config)
        self.schema, self.name, self.topk = tool_schema, tool_schema["function"]["name"], c["topk"]
        bound = c["rate_limit"] if c["enable_global_rate_limit"] else c["num_workers"]
        self.client = RetrievalClient(c["retrieval_service_url"], timeout_s=float(c["timeout"]),
                                      max_retries=c["max_retries"], retry_delay_s=float(c["retry_delay_s"]),
                                      max_concurrent=bound)

    def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        self._check_row(instance_id)
        queries = arguments.get("query_list")
        if not isinstance(queries, list) or not queries or not all(isinstance(q, str) and q.strip() for q in queries):
            raise ValueError(f"'query_list' must be a non-empty list of non-empty strings; got {str(queries)[:80]!r}")
        results = self.client.search(queries, self.topk)
        return ToolResult(render(results), metrics={"query_count": float(len(queries)),
                                                    "total_results": float(sum(map(len, results)))})
