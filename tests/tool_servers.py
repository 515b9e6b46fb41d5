"""Local HTTP services for the tool and code-reward tests (standard library only), each in a thread:

    sandbox_fusion   SandboxFusion's run_code API: POST {code, language, stdin, run_timeout, ...} ->
                     {status, run_result: {status, return_code, stdout, stderr}}; the code really
                     runs (python only) in a subprocess with the request's run_timeout
    retrieval        Search-R1's retrieval API: POST {queries, topk, return_scores} -> {result: [[{
                     document: {contents}, score}]]} over an in-memory corpus (word-overlap ranking)
    hanging          answers nothing until the test ends
    failing(code)    answers HTTP `code`
    garbage          answers 200 with a body that is not JSON

`serve(app)` yields the URL; every request is recorded in `app.requests` (the parsed JSON bodies).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Iterator


class App:
    def __init__(self, answer: Callable[[Any], tuple[int, bytes]]):
        self.answer = answer
        self.requests: list[Any] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()


@contextlib.contextmanager
def serve(app: App, path: str = "/run_code") -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            try:
                req = json.loads(body)
            except json.JSONDecodeError:
                req = body
            with app.lock:
                app.requests.append(req)
            status, out = app.answer(req) if not app.stop.is_set() else (503, b"")
            if status == 0:  # hang until the test ends
                app.stop.wait(60)
                return
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}{path}"
    finally:
        app.stop.set()
        server.shutdown()
        server.server_close()


def _run_python(req: dict) -> dict:
    if req.get("language") != "python":
        return {"status": "SandboxError", "message": f"language {req.get('language')} not in this test service",
                "compile_result": None, "run_result": None}
    try:
        p = subprocess.run([sys.executable, "-c", req["code"]], input=req.get("stdin") or "", capture_output=True,
                           text=True, timeout=float(req["run_timeout"]))
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return {"status": "Failed", "message": "", "compile_result": None,
                "run_result": {"status": "TimeLimitExceeded", "execution_time": float(req["run_timeout"]),
                               "return_code": None, "stdout": out, "stderr": ""}}
    return {"status": "Success" if p.returncode == 0 else "Failed", "message": "", "compile_result": None,
            "run_result": {"status": "Finished", "execution_time": 0.0, "return_code": p.returncode,
                           "stdout": p.stdout, "stderr": p.stderr}}


def sandbox_fusion() -> App:
    return App(lambda req: (200, json.dumps(_run_python(req)).encode()))


CORPUS = [
    "Paris\nParis is the capital and largest city of France.",
    "Berlin\nBerlin is the capital of Germany.",
    "Mount Everest\nMount Everest is Earth's highest mountain above sea level.",
    "Python (programming language)\nPython is a high-level programming language.",
]


def _words(text: str) -> set[str]:
    return {w.strip(".,'?").lower() for w in text.split()} - {"the", "of", "is", "a", "and"}


def retrieval(corpus: list[str] = CORPUS) -> App:
    def answer(req: Any) -> tuple[int, bytes]:
        result = []
        for q in req["queries"]:
            ranked = sorted(corpus, key=lambda d: -len(_words(q) & _words(d)))[: req["topk"]]
            result.append([{"document": {"id": str(corpus.index(d)), "contents": d},
                            "score": float(len(_words(q) & _words(d)))} for d in ranked])
        return 200, json.dumps({"result": result}).encode()
    return App(answer)


def hanging() -> App:
    return App(lambda req: (0, b""))


def failing(code: int) -> App:
    return App(lambda req: (code, b'{"detail": "broken"}'))


def garbage() -> App:
    return App(lambda req: (200, b"<html>not json</html>"))
