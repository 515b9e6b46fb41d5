"""`pfppo bench kernels`: the fused kernels against torch, as a table and JSON.

    python -m pfppo_mega.bench.kernels [--quick] [--json PATH] [--device cpu|cuda]

For each op (GAE, token log-prob + entropy, PPO loss forward + backward) and dtype it reports
the fused kernel's time, the bytes it must move (inputs read once, outputs written once), the
resulting GB/s and its fraction of this machine's measured copy bandwidth (2-thread memcpy on
CPU, device-to-device copy on GPU), and speed ratios against
  verl     the verl-style reference: GAE as verl's Python loop over reversed time steps
           (the project's own reference loop, pfppo_mega.ppo.compute_gae, is in the JSON as
           reference_loop),
           log-prob as log_softmax + gather (entropy as logsumexp - sum softmax * logits),
           the dual-clip loss in eager torch;
  eager    vectorised eager torch (pfppo_mega.ppo; GAE: a chunked matrix form);
  compile  torch.compile of the eager version (where it compiles).
Every timed fused result is first checked against the eager one. The CPU run uses 2 threads.
--quick uses fewer repetitions and fewer log-prob rows (same columns) and runs in < 1 min.
"""

import argparse
import ctypes
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from pfppo_mega import ppo
from pfppo_mega.kernels import ops
from pfppo_mega.kernels.testing import gae_inputs, labels_for, logits, policy_inputs, ragged_mask

BENCH_THREADS = 2
VOCAB = 152064


# ---------------------------------------------------------------------------------------------
# Measurement.


@dataclass
class Timing:
    min_ms: float
    median_ms: float
    reps: int


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _once_ms(fn: Callable[[], object], device: str) -> float:
    if device == "cuda":
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        return start.elapsed_time(stop)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def time_fn(fn: Callable[[], object], device: str, *, reps: int, warmup: int = 1,
            budget_s: float = 0.0, max_reps: int = 200) -> Timing:
    """Min and median wall time of fn() after warmup calls: `reps` calls, or more while the
    calls fit in budget_s (up to max_reps). The min is the run least disturbed by other
    processes on a shared machine; the tables use it, the JSON has both."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = [_once_ms(fn, device)]
    target = max(reps, min(max_reps, int(budget_s * 1e3 / max(times[0], 1e-3))))
    while len(times) < target:
        times.append(_once_ms(fn, device))
    return Timing(min(times), statistics.median(times), len(times))


def copy_bandwidth(device: str, *, reps: int, budget_s: float = 0.0) -> tuple[float, Timing]:
    """GB/s of dst.copy_(src) on 256 MiB (bytes read + written), 2 threads on CPU."""
    n = 256 << 20
    src = torch.ones(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = time_fn(lambda: dst.copy_(src), device, reps=reps, warmup=2, budget_s=budget_s)
    return 2 * n / (t.min_ms * 1e6), t


def _keep_freed_memory() -> str:
    """Make glibc reuse freed memory (no mmap/munmap per large tensor): every variant,
    fused or not, is then timed without the page faults of fresh allocations."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        ok = libc.mallopt(m_mmap_threshold, 1 << 30)
        ok = ok and libc.mallopt(m_trim_threshold, (1 << 31) - 1)
        return "glibc mallopt: freed memory kept and reused" if ok else "mallopt refused"
    except OSError:
        return "default allocator"


# ---------------------------------------------------------------------------------------------
# Baselines.


def gae_verl_loop(rewards, values, mask, *, gamma, lam):
    """verl-style GAE: a Python loop over reversed time steps in which padding carries the
    running value and advantage through (m blends them). For right-padded masks it equals the
    reference on real tokens; returns are A + V everywhere. [B, T] -> ([B, T], [B, T])."""
    m = mask.to(values.dtype)
    next_value = torch.zeros_like(values[:, 0])  # [B]
    last_adv = torch.zeros_like(values[:, 0])  # [B]
    advs_reversed = []
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * last_adv
        next_value = values[:, t] * m[:, t] + (1 - m[:, t]) * next_value
        last_adv = adv * m[:, t] + (1 - m[:, t]) * last_adv
        advs_reversed.append(last_adv)
    advantages = torch.stack(advs_reversed[::-1], dim=1)
    return advantages, advantages + values


def gae_reference_loop(rewards, values, mask, *, gamma, lam):
    """The project's reference (pfppo_mega.ppo.compute_gae): also a loop over reversed T."""
    return ppo.compute_gae(rewards, values, mask, gamma=gamma, lam=lam)


def gae_chunked(rewards, values, mask, *, gamma, lam, chunk: int = 64):
    """Vectorised eager GAE. A_t = c_t A_{t+1} + b_t (c_t = gamma lam m_t, b_t = m_t delta_t) is
    solved `chunk` steps at a time, last chunk first:
        A_t = sum_{k >= t} [no padding in [t, k)] (gamma lam)^(k - t) b_k
              + prod_{j >= t} c_j * A(start of the next chunk)
    with a [B, chunk, chunk] weight tensor per chunk. [B, T] -> ([B, T], [B, T]). Right-padded masks
    (a gap inside a row cuts the recursion there; compute_gae skips it)."""
    keep = mask.bool()
    m = mask.to(values.dtype)
    v = torch.where(keep, values, torch.zeros_like(values))
    r = torch.where(keep, rewards.to(values.dtype), torch.zeros_like(values))
    next_v = torch.cat([v[:, 1:], torch.zeros_like(v[:, :1])], dim=1)
    b = (r + gamma * next_v - v) * m  # [B, T]
    c = m * (gamma * lam)  # [B, T]
    rows, cols = b.shape
    idx = torch.arange(chunk, device=b.device)
    k_minus_t = idx[None, :] - idx[:, None]  # [t, k]
    decay = torch.where(k_minus_t >= 0, (gamma * lam) ** k_minus_t.clamp(min=0).to(b.dtype),
                        torch.zeros((), dtype=b.dtype, device=b.device))  # [chunk, chunk]
    adv = torch.empty_like(b)
    carry = torch.zeros(rows, dtype=b.dtype, device=b.device)
    for start in reversed(range(0, cols, chunk)):
        bc, cc = b[:, start:start + chunk], c[:, start:start + chunk]  # [B, n]
        n = bc.shape[1]
        zero = (cc == 0).to(torch.int32)
        zeros_before = torch.cumsum(zero, dim=1) - zero  # padding tokens before t in the chunk
        same_run = zeros_before[:, :, None] == zeros_before[:, None, :]  # [B, t, k]
        weights = decay[:n, :n] * same_run
        tail = torch.flip(torch.cumprod(torch.flip(cc, dims=[1]), dim=1), dims=[1])  # prod_{j>=t}
        a = torch.einsum("btk,bk->bt", weights, bc) + tail * carry[:, None]
        adv[:, start:start + chunk] = a
        carry = a[:, 0]
    return adv, (adv + v) * m


def logprob_entropy_verl(x, labels):
    """verl-style: log_softmax + gather; entropy = logsumexp - sum softmax * logits."""
    logp = F.log_softmax(x, dim=-1).gather(-1, labels[:, None]).squeeze(-1)
    pd = F.softmax(x, dim=-1)
    entropy = torch.logsumexp(x, dim=-1) - (pd * x).sum(dim=-1)
    return logp, entropy


def logprob_entropy_eager(x, labels):
    return ppo.logprobs_from_logits(x, labels), ppo.entropy_from_logits(x)


def policy_loss_verl(
    logp, old_logp, advantages, mask, *, clip_ratio_low, clip_ratio_high, dual_clip_c
):
    """verl-style dual-clip PPO loss in eager torch (token-mean), with clipfrac and KL."""
    mask = mask.to(logp.dtype)
    negative_approx_kl = torch.clamp(logp - old_logp, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = (-negative_approx_kl * mask).sum() / mask.sum()
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = (torch.gt(pg_losses2, pg_losses1).float() * mask).sum() / mask.sum()
    pg_losses3 = -advantages * dual_clip_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    lower = torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float()
    pg_clipfrac_lower = (lower * mask).sum() / mask.sum()
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    loss = (pg_losses * mask).sum() / mask.sum()
    return loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower


# ---------------------------------------------------------------------------------------------
# Cases: one op at one dtype and shape, with its fused call and baselines.


@dataclass
class Case:
    op: str
    dtype: str
    shape: list[int]
    bytes: int  # bytes the fused op must move: inputs read once + outputs written once
    fused: Callable[[], object]
    baselines: dict[str, Callable[[], object] | None]  # name -> call, None = not applicable
    check: Callable[[], None]  # fused vs eager, raises on a mismatch
    extra_bytes: int = 0  # memory the fused op allocates besides its inputs (analytic)
    notes: list[str] = field(default_factory=list)


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


_COMPILE = True  # main() turns it off for --no-compile


def _compiled(fn, note_list: list[str], label: str):
    """torch.compile(fn), or None (with a note) when compiling fails or is switched off."""
    if not _COMPILE:
        note_list.append(f"{label}: torch.compile not run (--no-compile)")
        return None
    try:
        return torch.compile(fn)
    except Exception as err:  # compile is a baseline: report, do not abort the benchmark
        note_list.append(f"{label}: torch.compile failed: {type(err).__name__}")
        return None


def gae_case(device: str, rows: int, cols: int, *, op: str = "gae", loops: bool = True) -> Case:
    """GAE of [rows, cols] fp32 with a bool mask: 17 bytes per token must move (r, V read, mask
    read, A and R written; csrc/cuda/gae.cu argues the layout). op names the case (a short
    batch runs the chunked scan on a GPU); loops: time the Python-loop baselines too."""
    dtype = torch.float32
    inp = gae_inputs(rows, cols, seed=1, dtype=dtype, device=device)  # made where they are used
    r, v = inp["rewards"], inp["values"]
    mask = ragged_mask(rows, cols, seed=1, empty_rows=False).to(device)
    kw = dict(gamma=0.99, lam=0.95)
    # torch.compile of gae_chunked unrolls its loop over chunks: measured here 129 s to compile
    # [512, 4096] and 0.68 s per call, slower than eager; the Python loop does not compile in
    # reasonable time either. Not run.
    notes = ["compile: not run (129 s to compile the chunked loop, slower than eager)"]

    def check():
        got, want = ops.gae(r, v, mask, **kw), gae_chunked(r, v, mask, **kw)
        for g_, w_ in zip(got, want):
            torch.testing.assert_close(g_, w_, rtol=1e-4, atol=1e-4)

    return Case(
        op=op, dtype="float32", shape=[rows, cols],
        bytes=_nbytes(r, v, mask) + 2 * _nbytes(v),
        fused=lambda: ops.gae(r, v, mask, **kw),
        baselines={"verl": (lambda: gae_verl_loop(r, v, mask, **kw)) if loops else None,
                   "eager": lambda: gae_chunked(r, v, mask, **kw),
                   "compile": None,
                   "reference_loop": (lambda: gae_reference_loop(r, v, mask, **kw)) if loops else None},
        check=check, extra_bytes=2 * _nbytes(v),
        notes=notes + ["mask bool, right-padded ragged rows"],
    )


def logprob_case(device: str, rows: int, dtype: torch.dtype, backward: bool) -> Case:
    x = logits(rows, VOCAB, seed=2, dtype=dtype, device=device)  # made where it is used
    labels = labels_for(x, seed=2)
    notes: list[str] = []

    def with_backward(fn):
        if not backward:
            return lambda: fn(x, labels)

        def run():
            xg = x.detach().requires_grad_()
            logp, ent = fn(xg, labels)
            torch.autograd.backward([logp, ent], [torch.ones_like(logp), torch.ones_like(ent)])
            return xg.grad

        return run

    compiled_fn = _compiled(logprob_entropy_eager, notes, "logprob")

    def check():
        got, want = ops.logprob_entropy(x, labels), logprob_entropy_eager(x, labels)
        for g_, w_ in zip(got, want):
            torch.testing.assert_close(g_, w_, rtol=1e-4, atol=1e-4)

    name = "logprob_entropy fwd+bwd" if backward else "logprob_entropy fwd"
    x_bytes = _nbytes(x)
    return Case(
        op=name, dtype=str(dtype).removeprefix("torch."), shape=[rows, VOCAB],
        bytes=(3 if backward else 1) * x_bytes + _nbytes(labels) + 2 * 4 * rows,
        fused=with_backward(ops.logprob_entropy),
        baselines={"verl": with_backward(logprob_entropy_verl),
                   "eager": with_backward(logprob_entropy_eager),
                   "compile": with_backward(compiled_fn) if compiled_fn else None},
        check=check, extra_bytes=4 * 4 * rows + (x_bytes if backward else 0), notes=notes,
    )


def loss_case(device: str, rows: int, cols: int) -> Case:
    dtype = torch.float32
    inp = {k: v.to(device) for k, v in policy_inputs(rows, cols, seed=3, dtype=dtype).items()}
    mask = ragged_mask(rows, cols, seed=3, empty_rows=False).to(device)
    opts = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, dual_clip_c=3.0)
    notes: list[str] = []

    def fwd_bwd(loss_of):
        def run():
            logp = inp["logp"].detach().requires_grad_()
            loss_of(logp).backward()
            return logp.grad

        return run

    def eager_loss(logp):
        return ppo.policy_loss(logp, inp["old_logp"], inp["advantages"], mask, **opts).loss

    compiled = _compiled(eager_loss, notes, "loss")

    def check():
        g_fused, g_eager = fwd_bwd(lambda lp: ops.policy_loss(
            lp, inp["old_logp"], inp["advantages"], mask, **opts).loss)(), fwd_bwd(eager_loss)()
        torch.testing.assert_close(g_fused, g_eager, rtol=1e-4, atol=1e-9)

    return Case(
        # logp, old_logp, advantages read; the mask read twice (row counts, then the tokens);
        # d loss / d logp written once (backward at grad 1 reuses it): 18 B/token in fp32
        op="policy_loss fwd+bwd", dtype="float32", shape=[rows, cols],
        bytes=_nbytes(inp["logp"], inp["old_logp"], inp["advantages"], mask, mask, inp["logp"]),
        fused=fwd_bwd(lambda lp: ops.policy_loss(
            lp, inp["old_logp"], inp["advantages"], mask, **opts).loss),
        baselines={"verl": fwd_bwd(lambda lp: policy_loss_verl(
                       lp, inp["old_logp"], inp["advantages"], mask, **opts)[0]),
                   "eager": fwd_bwd(eager_loss),
                   "compile": fwd_bwd(compiled) if compiled else None},
        check=check, extra_bytes=_nbytes(inp["logp"]) + 5 * 4,
        notes=notes + ["token-mean, dual clip c=3, metrics computed too"],
    )


# ---------------------------------------------------------------------------------------------
# Running, reporting.


@dataclass
class Result:
    op: str
    dtype: str
    shape: list[int]
    bytes: int
    fused_ms: float  # min over the repetitions
    fused_ms_median: float
    fused_reps: int
    gbps: float
    frac_copy: float
    baseline_ms: dict[str, float | None]
    speedup: dict[str, float | None]
    extra_bytes_analytic: int  # what the fused op allocates: its outputs (+ saved stats)
    peak_extra_bytes: dict[str, int | None]  # measured peak allocation per variant (GPU only)
    notes: list[str]


def peak_extra_bytes(fn: Callable[[], object], device: str) -> int | None:
    """Peak bytes allocated while fn runs, above what was allocated before (CUDA only)."""
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def run_case(case: Case, device: str, copy_gbps: float, *, reps: int, loop_reps: int,
             budget_s: float = 0.0) -> Result:
    case.check()
    peaks = {"fused": peak_extra_bytes(case.fused, device)}
    fused = time_fn(case.fused, device, reps=reps, warmup=2, budget_s=budget_s)
    baseline_ms: dict[str, float | None] = {}
    for name, fn in case.baselines.items():
        if fn is None:
            baseline_ms[name] = None
            continue
        try:
            n = loop_reps if case.op == "gae" and name in ("verl", "reference_loop") else reps
            baseline_ms[name] = time_fn(fn, device, reps=n, warmup=1, budget_s=budget_s).min_ms
            peaks[name] = peak_extra_bytes(fn, device)
        except Exception as err:  # a baseline that fails (e.g. compile) is reported, not fatal
            baseline_ms[name] = None
            case.notes.append(f"{name} failed: {type(err).__name__}: {str(err)[:120]}")
    gbps = case.bytes / (fused.min_ms * 1e6)
    return Result(
        op=case.op, dtype=case.dtype, shape=case.shape, bytes=case.bytes,
        fused_ms=fused.min_ms, fused_ms_median=fused.median_ms, fused_reps=fused.reps,
        gbps=gbps, frac_copy=gbps / copy_gbps,
        baseline_ms=baseline_ms,
        speedup={k: (v / fused.min_ms if v is not None else None) for k, v in baseline_ms.items()},
        extra_bytes_analytic=case.extra_bytes, peak_extra_bytes=peaks, notes=case.notes,
    )


@dataclass
class Target:
    name: str
    value: float | None
    threshold: float
    passed: bool | None  # None: not measured (e.g. --no-compile)


# The issue's targets: (name, op, dtype, measured quantity, threshold), per device.
_LP, _LOSS = "logprob_entropy fwd", "policy_loss fwd+bwd"
CPU_TARGETS = [
    ("gae x verl loop", "gae", "float32", "speedup:verl", 100.0),
    ("gae fraction of 2-thread memcpy", "gae", "float32", "frac_copy", 0.60),
    ("logprob+entropy fp32 x verl", _LP, "float32", "speedup:verl", 1.5),
    ("logprob+entropy fp32 x eager", _LP, "float32", "speedup:eager", 1.5),
    ("logprob+entropy bf16 x verl", _LP, "bfloat16", "speedup:verl", 4.0),
    ("logprob+entropy bf16 x eager", _LP, "bfloat16", "speedup:eager", 4.0),
    ("loss fwd+bwd x verl eager", _LOSS, "float32", "speedup:verl", 10.0),
    ("loss fwd+bwd x eager", _LOSS, "float32", "speedup:eager", 10.0),
    ("loss fwd+bwd x torch.compile", _LOSS, "float32", "speedup:compile", 1.0),
]
_LPB, _GAE_SHORT = "logprob_entropy fwd+bwd", "gae short batch"
# Every kernel's goal on a GPU: >= 75% of the device-to-device copy rate (issue 38).
GPU_TARGETS = [
    ("gae x verl loop", "gae", "float32", "speedup:verl", 1000.0),
    ("gae fraction of D2D copy", "gae", "float32", "frac_copy", 0.75),
    ("gae short batch (chunked scan) fraction of D2D copy", _GAE_SHORT, "float32", "frac_copy", 0.75),
    ("logprob+entropy fp32 fraction of D2D copy", _LP, "float32", "frac_copy", 0.75),
    ("logprob+entropy bf16 fraction of D2D copy", _LP, "bfloat16", "frac_copy", 0.75),
    ("logprob+entropy fwd+bwd bf16 fraction of D2D copy", _LPB, "bfloat16", "frac_copy", 0.75),
    ("loss fwd+bwd fraction of D2D copy", _LOSS, "float32", "frac_copy", 0.75),
]


def _quantity(r: Result, what: str) -> float | None:
    if what.startswith("speedup:"):
        return r.speedup.get(what.split(":", 1)[1])
    return getattr(r, what)


def check_targets(results: list[Result], device: str) -> list[Target]:
    """The issue's targets for this device, evaluated on these results."""
    by_op = {(r.op, r.dtype): r for r in results}
    targets = []
    for name, op, dtype, what, threshold in CPU_TARGETS if device == "cpu" else GPU_TARGETS:
        r = by_op.get((op, dtype))
        value = _quantity(r, what) if r is not None else None
        passed = None if value is None else value >= threshold
        targets.append(Target(name, value, threshold, passed))
    return targets


def machine_info(device: str) -> dict:
    cpu_model = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {
        "cpu_model": cpu_model,
        "logical_cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "cpu_isa": getattr(ops._C, "cpu_isa", None),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def git_sha() -> str:
    root = Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=10)
        if sha.returncode != 0:
            return "unknown (no commit)"
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True,
                               text=True, timeout=10).stdout.strip()
        return sha.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def format_table(results: list[Result], copy_gbps: float, device: str) -> str:
    copy_name = "2-thread memcpy" if device == "cpu" else "device-to-device copy"
    head = (f"{'op':<24} {'dtype':<9} {'shape':<14} {'fused ms':>9} {'MB moved':>9} {'GB/s':>7} "
            f"{'% copy':>7} {'verl ms':>9} {'x verl':>8} {'eager ms':>9} {'x eager':>8} "
            f"{'compile ms':>10} {'x compile':>9}")
    lines = [f"copy bandwidth ({copy_name}): {copy_gbps:.1f} GB/s", head, "-" * len(head)]
    for r in results:
        shape = "x".join(str(s) for s in r.shape)
        lines.append(
            f"{r.op:<24} {r.dtype:<9} {shape:<14} {r.fused_ms:>9.3f} {r.bytes / 1e6:>9.1f} "
            f"{r.gbps:>7.1f} {100 * r.frac_copy:>6.0f}% "
            f"{_fmt(r.baseline_ms['verl'], '9.2f'):>9} {_fmt(r.speedup['verl'], '8.1f'):>8} "
            f"{_fmt(r.baseline_ms['eager'], '9.2f'):>9} {_fmt(r.speedup['eager'], '8.1f'):>8} "
            f"{_fmt(r.baseline_ms['compile'], '10.2f'):>10} {_fmt(r.speedup['compile'], '9.2f'):>9}"
        )
    return "\n".join(lines)


def format_targets(targets: list[Target]) -> str:
    lines = ["targets:"]
    for t in targets:
        mark = "n/a " if t.passed is None else ("PASS" if t.passed else "FAIL")
        lines.append(f"  {mark}  {t.name}: {_fmt(t.value, '.2f')} (>= {t.threshold:g})")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pfppo bench kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="fewer repetitions and rows (< 1 min on CPU)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH",
                   help="also write the results here")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--no-compile", action="store_true",
                   help="skip the torch.compile baselines (their column stays, empty)")
    return p.parse_args(argv)


@dataclass
class BenchPlan:
    """What one benchmark run measures."""

    device: str
    quick: bool
    reps: int  # at least this many timed calls per variant
    budget_s: float  # more calls while they fit in this many seconds per variant
    loop_reps: int  # calls of the (slow) GAE Python loops
    gae_shape: tuple[int, int]
    logprob_rows: int
    loss_shape: tuple[int, int]


def make_plan(device: str, quick: bool) -> BenchPlan:
    if device == "cpu":
        return BenchPlan(device, quick, reps=3 if quick else 7, budget_s=0.3 if quick else 1.0,
                    loop_reps=2 if quick else 3, gae_shape=(512, 4096),
                    logprob_rows=64 if quick else 512, loss_shape=(512, 4096))
    # GPU: shapes large enough that launch latency does not hide the bandwidth.
    return BenchPlan(device, quick, reps=10 if quick else 30, budget_s=0.3 if quick else 1.0,
                loop_reps=2 if quick else 3, gae_shape=(1024, 8192),
                logprob_rows=2048 if quick else 4096,
                loss_shape=(4096, 8192) if quick else (8192, 8192))


def cases_of(plan: BenchPlan) -> list[Callable[[], Case]]:
    d = plan.device
    return [
        lambda: gae_case(d, *plan.gae_shape),
        # a short batch: on a GPU too few rows to fill the SMs, so the scan is chunked along T
        lambda: gae_case(d, 16, plan.gae_shape[1], op=_GAE_SHORT, loops=False),
        lambda: logprob_case(d, plan.logprob_rows, torch.float32, backward=False),
        lambda: logprob_case(d, plan.logprob_rows, torch.bfloat16, backward=False),
        lambda: logprob_case(d, plan.logprob_rows, torch.float32, backward=True),
        lambda: logprob_case(d, plan.logprob_rows, torch.bfloat16, backward=True),
        lambda: loss_case(d, *plan.loss_shape),
    ]


@dataclass
class Report:
    """The JSON written by --json (after every case, so a timeout keeps what was measured)."""

    complete: bool
    git_sha: str
    mode: str
    device: str
    machine: dict
    allocator: str
    copy_bandwidth_gbps: float
    copy_ms: Timing
    results: list[Result]
    targets: list[Target]
    elapsed_s: float
    bytes_rule: str = "inputs read once + outputs written once by the fused op"
    time_rule: str = ("min over the repetitions (the least disturbed run on a shared machine); "
                      "fused_ms_median alongside; baselines: min")


def write_report(path: Path | None, report: Report) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(report), indent=2))


def main(argv: list[str]) -> int:
    global _COMPILE
    args = parse_args(argv)
    _COMPILE = not args.no_compile
    ops.require_built()
    if args.device == "cuda":
        ops.require_device(torch.empty(0, device="cuda"), "--device cuda")
    allocator = _keep_freed_memory() if args.device == "cpu" else "torch CUDA caching allocator"
    torch.set_num_threads(BENCH_THREADS)
    torch.manual_seed(0)
    started = time.perf_counter()
    plan = make_plan(args.device, args.quick)
    copy_gbps, copy_t = copy_bandwidth(plan.device, reps=plan.reps, budget_s=plan.budget_s)
    report = Report(
        complete=False, git_sha=git_sha(), mode="quick" if plan.quick else "full",
        device=plan.device, machine=machine_info(plan.device), allocator=allocator,
        copy_bandwidth_gbps=copy_gbps, copy_ms=copy_t, results=[], targets=[], elapsed_s=0.0,
    )
    for make in cases_of(plan):
        case = make()
        report.results.append(run_case(case, plan.device, copy_gbps, reps=plan.reps,
                                       loop_reps=plan.loop_reps, budget_s=plan.budget_s))
        report.elapsed_s = time.perf_counter() - started
        print(f"  done {case.op} {case.dtype} {case.shape} ({report.elapsed_s:.0f} s)",
              file=sys.stderr)
        write_report(args.json, report)
        del case
    report.targets = check_targets(report.results, plan.device)
    report.complete = True
    write_report(args.json, report)

    print(format_table(report.results, copy_gbps, plan.device))
    print(format_targets(report.targets))
    print(f"total {report.elapsed_s:.0f} s ({report.mode}, {plan.device}, "
          f"{torch.get_num_threads()} threads, git {report.git_sha})")
    if args.json is not None:
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
