"""Hostile custom reward functions (issue 24.4): each runs under a stand-in trainer, a child
process in its own session (so nothing a case does can reach pytest), that builds CustomReward
as the trainer does, scores a batch and prints what it got. Before the fix: a forked child
answered for its parent (another row's value, or IndexError in the trainer), a SIGTERM-ignoring
module kept the trainer from exiting, killpg of the worker's group killed the trainer without a
word, and a function could overwrite the run's metrics.jsonl.

Each test asserts the outcome class ``outcome()`` gives (`held`, or the bad one: silent, hang,
traceback, killed, lost_data) and what the trainer saw; `python tests/adversarial/counts.py`
prints the classes over the whole issue-24 suite.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pfppo_mega.rewards.sandbox import landlock_abi

REPO = Path(__file__).resolve().parents[2]
LANDLOCK = landlock_abi()

TRAINER = r'''
import json, os, sys, time
from pfppo_mega.rewards.custom import CustomReward
from pfppo_mega.types import Sample
path, run_dir, texts, workers, landlock, close = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), \
    int(sys.argv[4]), sys.argv[5] == "1", sys.argv[6] == "1"
logs = []
try:
    r = CustomReward(path, "compute_score", num_workers=workers, timeout_s=5.0, run_dir=run_dir, landlock=landlock,
                     log=logs.append)
except TypeError:  # a tree from before issue 24.4 (the "before" counts): no run_dir, no sandbox
    r = CustomReward(path, "compute_score", num_workers=workers, timeout_s=5.0, log=logs.append)
print("PIDS " + json.dumps([p.proc.pid for p in r._procs]), flush=True)
samples = [Sample((1,), "x", "gt", {}, row=f"r:{i}") for i in range(len(texts))]
print("CALLING", flush=True)
try:
    res = r(samples, texts, [True] * len(texts))
    out = {"scores": res.scores.tolist(), "outcomes": res.outcomes}
except Exception as e:
    out = {"error": f"{type(e).__name__}: {e}"}
out["logs"] = logs
out["pids"] = [p.proc.pid for p in r._procs]
print("RESULT " + json.dumps(out), flush=True)
if close:
    r.close()
'''


def trainer(tmp_path: Path, body: str, texts: list[str], *, workers: int = 1, landlock: bool = True,
            close: bool = True, timeout: float = 60.0, signal_after: float | None = None) -> dict:
    """Run the stand-in trainer on a user module; what it printed, its exit status and time."""
    user = tmp_path / "user_reward.py"
    user.write_text(textwrap.dedent(body))
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", TRAINER, str(user), str(run_dir), json.dumps(texts), str(workers),
                             "1" if landlock else "0", "1" if close else "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": os.environ.get("PFPPO_TREE", str(REPO))})
    t0, early = time.monotonic(), ""
    if signal_after is not None:  # SIGTERM from outside while the call runs
        for line in proc.stdout:
            early += line
            if line.startswith("CALLING"):
                break
        time.sleep(signal_after)
        proc.send_signal(signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=timeout)
        out = early + out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return {"rc": None, "stdout": out, "stderr": err, "wall": time.monotonic() - t0, "hang": True}
    res = {"rc": proc.returncode, "stdout": out, "stderr": err, "wall": time.monotonic() - t0, "hang": False}
    for line in out.splitlines():
        if line.startswith("RESULT "):
            res.update(json.loads(line[7:]))
        elif line.startswith("PIDS "):
            res["worker_pids"] = json.loads(line[5:])
    return res


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def outcome(r: dict, *, want_scores: list[float] | None = None, kept: Path | None = None, text: str = "") -> str:
    """The class of what happened: held, hang, killed (the trainer died by a signal), traceback
    (it raised out, or a Python traceback on stderr), lost_data (the file `kept` no longer holds
    `text`), silent (scores other than the honest ones)."""
    if r["hang"]:
        return "hang"
    if r["rc"] is not None and r["rc"] < 0:
        return "killed"
    if "Traceback" in r["stderr"] or "scores" not in r and "error" not in r:
        return "traceback"
    if kept is not None and kept.read_text() != text:
        return "lost_data"
    if want_scores is not None and r.get("scores") != want_scores:
        return "silent"
    return "held"


FORK_RETURNS = """
import os
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if os.fork() == 0:
        return 100.0 + float(solution_str)   # the child comes back into the worker's loop
    return float(solution_str)
"""


def test_a_forked_child_that_returns_into_the_worker_loop_cannot_answer(tmp_path):
    texts = [str(i) for i in range(1, 7)]
    r = trainer(tmp_path, FORK_RETURNS, texts)
    assert outcome(r, want_scores=[float(t) for t in texts]) == "held", r
    assert r["outcomes"] == ["ok"] * 6


FORK_WRITES = """
import gc, json, os
from multiprocessing.connection import Connection
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "2":
        pid = os.fork()
        if pid == 0:   # the child finds the worker's pipe and answers first, as row 999
            conn = next(o for o in gc.get_objects() if isinstance(o, Connection))
            conn.send_bytes(json.dumps([999, os.getpid(), "value", 99.0]).encode())
            os._exit(0)
        os.waitpid(pid, 0)   # its answer is in the pipe before ours, however loaded the machine
    return float(solution_str)
"""


def test_an_answer_that_is_not_the_workers_is_refused_and_counted(tmp_path):
    r = trainer(tmp_path, FORK_WRITES, ["1", "2", "3"])
    assert outcome(r, want_scores=[1.0, 0.0, 3.0]) == "held", r
    assert r["outcomes"] == ["ok", "reward_errors", "ok"]
    assert any("an answer not from the worker" in m and "r:1" in m for m in r["logs"]), r["logs"]


KILLPG_OWN = """
import os, signal
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "2":
        os.killpg(os.getpgid(0), signal.SIGTERM)   # "clean up my process group"
    return float(solution_str)
"""


def test_killpg_of_its_own_group_ends_only_the_worker(tmp_path):
    r = trainer(tmp_path, KILLPG_OWN, ["1", "2", "3"])
    assert outcome(r, want_scores=[1.0, 0.0, 3.0]) == "held", r
    assert r["rc"] == 0 and r["outcomes"] == ["ok", "reward_errors", "ok"]
    assert any("killed by SIGTERM" in m for m in r["logs"]), r["logs"]


@pytest.mark.parametrize("call", ["os.kill(os.getppid(), signal.SIGTERM)",
                                  "os.killpg(os.getpgid(os.getppid()), signal.SIGTERM)",
                                  "os.kill(-1, 0)"])  # signal 0: a probe, harmless if it got through
def test_signalling_the_trainer_through_os_is_refused_by_name(tmp_path, call):
    body = f"""
    import os, signal
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "2":
            {call}
        return float(solution_str)
    """
    r = trainer(tmp_path, body, ["1", "2", "3"])
    assert outcome(r, want_scores=[1.0, 0.0, 3.0]) == "held", r
    assert r["outcomes"] == ["ok", "reward_errors", "ok"]
    assert any("PermissionError: reward worker sandbox" in m for m in r["logs"]), r["logs"]


KILL_PARENT_LIBC = """
import ctypes, os, signal
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "2":   # past the os.kill guard: the C library's kill
        return float(ctypes.CDLL(None, use_errno=True).kill(os.getppid(), signal.SIGTERM))
    return float(solution_str)
"""


def test_a_sigterm_that_reaches_the_trainer_is_refused_or_named(tmp_path):
    r = trainer(tmp_path, KILL_PARENT_LIBC, ["1", "2", "3"])
    if LANDLOCK >= 6:  # the kernel refuses the signal: kill() returned -1, the trainer scored on
        assert outcome(r, want_scores=[1.0, -1.0, 3.0]) == "held", r
    else:
        print(f"landlock ABI {LANDLOCK} < 6 here: signals are not scoped, the SIGTERM reaches the trainer")
        assert r["rc"] == -signal.SIGTERM and "SIGTERM reached the trainer" in r["stderr"], r
        assert "'compute_score'" in r["stderr"]


SLEEPS = """
import time
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(4)
    return 1.0
"""


def test_a_sigterm_during_a_call_is_named_and_takes_the_workers_along(tmp_path):
    r = trainer(tmp_path, SLEEPS, ["1"], signal_after=1.0)
    assert r["rc"] == -signal.SIGTERM, r
    assert "SIGTERM reached the trainer" in r["stderr"] and "user_reward.py" in r["stderr"], r["stderr"]
    time.sleep(0.5)
    assert not any(alive(p) for p in r["worker_pids"]), r["worker_pids"]


IGNORES_SIGTERM = """
import signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0
"""


@pytest.mark.parametrize("close", [True, False], ids=["close", "no-close-atexit"])
def test_a_module_that_ignores_sigterm_does_not_keep_the_trainer_alive(tmp_path, close):
    r = trainer(tmp_path, IGNORES_SIGTERM, ["1", "2"], workers=2, close=close, timeout=30)
    assert outcome(r, want_scores=[1.0, 1.0]) == "held", r
    assert r["rc"] == 0 and r["wall"] < 20, r["wall"]
    assert not any(alive(p) for p in r["worker_pids"]), r["worker_pids"]


def test_close_kills_the_workers_whole_tree(tmp_path):
    pids = tmp_path / "scratch"
    pids.mkdir()
    body = f"""
    import os, signal, time
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if os.fork() == 0:            # a double fork: the grandchild is no descendant of the worker any more
            if os.fork() == 0:
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                open({str(pids / "grandchild")!r}, "w").write(str(os.getpid()))
                time.sleep(600)
            os._exit(0)
        time.sleep(0.5)
        return 1.0
    """
    r = trainer(tmp_path, body, ["1"])
    assert outcome(r, want_scores=[1.0]) == "held", r
    grandchild = int((pids / "grandchild").read_text())
    time.sleep(0.3)
    assert not alive(grandchild), f"grandchild {grandchild} outlived close()"


def _writes(target: Path) -> str:
    return f"""
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        with open({str(target)!r}, "w") as f:
            f.write("overwritten by the reward function")
        return 1.0
    """


@pytest.mark.skipif(LANDLOCK == 0, reason="the kernel has no landlock: only the trainer's check applies here")
def test_the_run_directory_is_not_writable_by_the_workers(tmp_path):
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.parent.mkdir()
    metrics.write_text('{"step": 1}\n')
    r = trainer(tmp_path, _writes(metrics), ["1", "2"])
    assert outcome(r, want_scores=[0.0, 0.0], kept=metrics, text='{"step": 1}\n') == "held", r
    assert metrics.read_text() == '{"step": 1}\n'
    assert r["outcomes"] == ["reward_errors"] * 2 and any("PermissionError" in m for m in r["logs"]), r["logs"]


def test_a_write_to_the_run_directory_stops_the_run_by_name_without_landlock(tmp_path):
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.parent.mkdir()
    metrics.write_text('{"step": 1}\n')
    r = trainer(tmp_path, _writes(metrics), ["1"], landlock=False)
    assert outcome(r) == "held", r  # the file is overwritten, but the run stops by name before it appends
    assert r["error"].startswith("RunDirectoryWritten: reward.custom_function: 'compute_score'"), r
    assert "metrics.jsonl (size 12 -> 34 bytes)" in r["error"], r["error"]


def test_writes_elsewhere_and_reads_of_the_run_directory_still_work(tmp_path):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("x" * 7)
    body = f"""
    import os, tempfile
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        with open({str(scratch / "cache.txt")!r}, "a") as f:
            f.write(solution_str)
        with tempfile.NamedTemporaryFile() as f:
            f.write(b"ok")
        return float(len(open({str(tmp_path / "run" / "metrics.jsonl")!r}).read()))
    """
    r = trainer(tmp_path, body, ["1", "2"])
    assert outcome(r, want_scores=[7.0, 7.0]) == "held", r
    assert sorted((scratch / "cache.txt").read_text()) == ["1", "2"]
    assert any(("landlock ABI" in m) == (LANDLOCK > 0) for m in r["logs"]), r["logs"]


# ----------------------------------------------------------------------------- the trainer's exits

@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """Prompt files and a tiny random Llama (as tests/test_data_e2e.py makes them)."""
    import torch
    import transformers  # pinned in requirements.lock

    from pfppo_mega.data.examples import write_example
    from pfppo_mega.tokenizer import Tokenizer

    root = tmp_path_factory.mktemp("exits")
    paths = write_example(root / "data", n_train=24, n_test=6, seed=0, vocab_size=320)
    tok = Tokenizer.from_dir(paths["tokenizer"])
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                   max_position_embeddings=128, tie_word_embeddings=False,
                                   bos_token_id=tok.bos_id, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    transformers.LlamaForCausalLM(cfg).save_pretrained(root / "ckpt")
    tok.save(root / "ckpt")
    return paths, root / "ckpt"


@pytest.mark.parametrize("ending", ["success", "TrainingHalted", "RuntimeError"])
def test_pfppo_train_closes_the_reward_workers_on_every_exit(tiny_run, tmp_path, monkeypatch, ending):
    from pfppo_mega import cli
    from pfppo_mega.config import load_config_dict
    from pfppo_mega.trainer.loop import PPOTrainer
    from pfppo_mega.trainer.update import TrainingHalted

    paths, ckpt = tiny_run
    user = tmp_path / "user_reward.py"
    user.write_text(textwrap.dedent(IGNORES_SIGTERM))
    cfg = load_config_dict({
        "actor_rollout": {"model_path": str(ckpt)}, "algorithm": {"max_response_length": 4},
        "data": {"source": "files", "train_files": [str(paths["train.parquet"])],
                 "val_files": [str(paths["test.parquet"])], "max_prompt_length": 96, "eval_size": 2},
        "reward": {"custom_function": {"path": str(user)}, "num_workers": 2},
        "training": {"rollout_batch_size": 2, "batch_size": 2, "total_training_steps": 1, "num_threads": 1},
        "logging": {"output_dir": str(tmp_path / "run"), "eval_interval": 0, "tensorboard": False, "plots": False,
                    "progress": False},
        "checkpoint": {"export_hf": False, "save_interval": 0}})
    seen: list[int] = []
    real_fit = PPOTrainer.fit

    def fit(self):
        seen.extend(p.proc.pid for p in self.run.reward_fn._procs)
        if ending == "TrainingHalted":
            raise TrainingHalted("every update skipped (test)")
        if ending == "RuntimeError":
            raise RuntimeError("a bug in the trainer (test)")
        return real_fit(self)

    monkeypatch.setattr(PPOTrainer, "fit", fit)
    if ending == "RuntimeError":
        with pytest.raises(RuntimeError, match="a bug in the trainer"):
            cli._train(cfg)
    else:
        assert cli._train(cfg) == (0 if ending == "success" else 3)
    assert len(seen) == 2 and not any(alive(p) for p in seen), seen


# ----------------------------------------------------------------------------- counts per class

def _counted_cases(root: Path) -> dict[str, str]:
    """case -> outcome class, for the cases issue 24.4 counted (the kill(-1, 0) probe, the external
    SIGTERM and the grandchild are this file's extra checks, not counted)."""
    def at(name: str) -> Path:
        (root / name).mkdir()
        return root / name

    out = {}
    texts = [str(i) for i in range(1, 7)]
    out["fork_returns_into_the_loop"] = outcome(trainer(at("a"), FORK_RETURNS, texts),
                                                want_scores=[float(t) for t in texts])
    out["forked_child_answers"] = outcome(trainer(at("b"), FORK_WRITES, ["1", "2", "3"]), want_scores=[1.0, 0.0, 3.0])
    out["killpg_own_group"] = outcome(trainer(at("c"), KILLPG_OWN, ["1", "2", "3"]), want_scores=[1.0, 0.0, 3.0])
    for k, call in enumerate(["os.kill(os.getppid(), signal.SIGTERM)",
                              "os.killpg(os.getpgid(os.getppid()), signal.SIGTERM)"]):
        body = KILLPG_OWN.replace("os.killpg(os.getpgid(0), signal.SIGTERM)   # \"clean up my process group\"", call)
        out[f"signal_trainer_{'kill' if k == 0 else 'killpg'}"] = outcome(trainer(at(f"d{k}"), body, ["1", "2", "3"]),
                                                                          want_scores=[1.0, 0.0, 3.0])
    out["signal_trainer_libc"] = outcome(trainer(at("e"), KILL_PARENT_LIBC, ["1", "2", "3"]),
                                         want_scores=[1.0, -1.0, 3.0])
    out["ignores_sigterm_no_close"] = outcome(trainer(at("f"), IGNORES_SIGTERM, ["1", "2"], workers=2, close=False,
                                                      timeout=30), want_scores=[1.0, 1.0])
    run = at("g") / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    r = trainer(root / "g", _writes(run / "metrics.jsonl"), ["1"])
    out["overwrites_metrics_jsonl"] = "held" if "RunDirectoryWritten" in r.get("error", "") else \
        outcome(r, kept=run / "metrics.jsonl", text='{"step": 1}\n')
    return out


if __name__ == "__main__":  # PFPPO_TREE=<an older checkout> for the "before" column
    import tempfile
    from collections import Counter

    with tempfile.TemporaryDirectory() as d:
        cases = _counted_cases(Path(d))
    for name, kind in cases.items():
        print(f"{name:30s} {kind}")
    print(json.dumps(dict(Counter(cases.values()))))
