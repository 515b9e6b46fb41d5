"""`pfppo bench head`: the LM head's log-prob + entropy, fused (no [tokens, V] logits) vs today's.

    pfppo bench head [--json PATH] [--shapes smollm2:4096,8192 qwen2.5:4096] [--reps 2]
                     [--chunk-tokens N] [--threads 2]

For each model shape (SmolLM2: V 49,152, hidden 576; Qwen2.5: V 151,936, hidden 896) and token
count N it runs forward + backward of the head on the same fp32 hidden states [N, H], head weight
[V, H], labels and output gradients (d logp, d entropy: a PPO loss with an entropy term):

  unfused  today's path in the trainer: logits = hidden @ W^T through the LM head of
           training.sparse_vocab_grads (pfppo_mega.models.vocab_grads: d hidden = g @ W, and
           g^T @ hidden added into the weight's fp32 main_grad), then vocab_parallel_logprob_entropy
           through the kernels backend (the trainer's default, `kernels: auto`);
  fused    pfppo_mega.kernels.fused_head.fused_linear_logprob_entropy, same backend, its weight
           gradient into the same main_grad.

main_grad stands for megatron DDP's gradient buffer: made before the head runs (not counted), zeroed
between runs; the gradients compared are d hidden and main_grad.

Reported per shape: peak_bytes_* (the most bytes of tensor storage alive at once among the
tensors the head creates, forward and backward, d hidden included; the inputs and main_grad are not
counted; ops that write into a storage they were given, views and in-place ops, add nothing),
time_*_s (min wall time of forward + backward over --reps interleaved runs, after one untimed
run), time_*_forward_s (forward alone without gradients, as in prepare), grad_max_abs_diff (max
|fused - unfused| over d hidden and d W), logp / entropy differences.

How peak bytes are counted on the CPU (no allocator statistics there): a TorchDispatchMode sees
every aten op's outputs, records each new storage's size with a weak reference, and before each op
drops the storages that died; the peak of the sum is the figure. Temporaries made inside one C++ op
(the fused log-prob kernel's, BLAS's workspace) are not seen: both paths run the same kernels,
so both figures leave out the same kind of bytes. The counting run is the untimed one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from pfppo_mega.bench.kernels import git_sha, machine_info
from pfppo_mega.kernels import get_backend, vocab_parallel_logprob_entropy
from pfppo_mega.kernels.fused_head import DEFAULT_CHUNK_TOKENS, check_chunk_tokens, fused_linear_logprob_entropy
from pfppo_mega.models import vocab_grads

MODELS = {"smollm2": (49152, 576), "qwen2.5": (151936, 896)}  # name -> (V, hidden)
DEFAULT_SHAPES = ("smollm2:4096,8192,16384", "qwen2.5:4096")
MAX_TOKENS = 1 << 20


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storage created under this mode and still alive; ``peak`` the most at once."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.now = 0
        self.peak = 0
        self.largest = 0  # the largest single storage seen

    def _sweep(self) -> None:
        for key, (ref, nbytes) in list(self.live.items()):
            if ref.expired():
                del self.live[key]
                self.now -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._sweep()
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                 if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key, nbytes = storage.data_ptr(), storage.nbytes()
                held = self.live.get(key)
                if nbytes == 0 or key in given or (held is not None and not held[0].expired()):
                    continue  # a view, an in-place or out= result: no new bytes
                if held is not None:
                    self.now -= held[1]
                self.live[key] = (StorageWeakRef(storage), nbytes)
                self.now += nbytes
                self.peak = max(self.peak, self.now)
                self.largest = max(self.largest, nbytes)
        return out


@dataclass
class HeadResult:
    model: str
    vocab: int
    hidden: int
    tokens: int
    chunk_tokens: int
    backend: str
    peak_bytes_fused: int
    peak_bytes_unfused: int
    peak_ratio: float            # unfused / fused
    time_fused_s: float
    time_unfused_s: float
    speedup: float               # unfused / fused time
    time_fused_forward_s: float  # forward only, no gradients (the prepare pass's old / reference log-probs)
    time_unfused_forward_s: float
    grad_max_abs_diff: float     # over d hidden and d W
    grad_max_abs: float          # the largest |gradient| entry (scale of the difference)
    logp_max_abs_diff: float
    entropy_max_abs_diff: float


@dataclass
class _Inputs:
    hidden: torch.Tensor   # [N, H]
    weight: torch.Tensor   # [V, H]
    labels: torch.Tensor   # [N]
    grad_logp: torch.Tensor
    grad_entropy: torch.Tensor
    held: vocab_grads._HeadBuffer  # the unfused head's held rows (vocab_grads), flushed by _run


def _inputs(vocab: int, hidden: int, tokens: int, seed: int = 0) -> _Inputs:
    g = torch.Generator().manual_seed(seed)
    # hidden states of RMS ~1 and a head of std 1/sqrt(H): logits of std ~1, as a trained model's
    weight = (torch.randn(vocab, hidden, generator=g) / hidden ** 0.5).requires_grad_(True)
    weight.main_grad = torch.zeros(vocab, hidden)  # DDP's fp32 gradient buffer
    return _Inputs(torch.randn(tokens, hidden, generator=g), weight, torch.randint(0, vocab, (tokens,), generator=g),
                   torch.randn(tokens, generator=g) / tokens, torch.randn(tokens, generator=g) * 0.01 / tokens,
                   vocab_grads._HeadBuffer(max_rows=hidden))


def _run(inp: _Inputs, head: Callable) -> tuple[torch.Tensor, ...]:
    """Forward + backward of one head; (logp, entropy, d hidden, d W: the weight's main_grad)."""
    x = inp.hidden.detach().requires_grad_(True)
    w = inp.weight  # a leaf that requires grad, with main_grad (see _inputs)
    w.main_grad.zero_()
    logp, ent = head(x, w)
    torch.autograd.backward([logp, ent], [inp.grad_logp, inp.grad_entropy])
    inp.held.flush()  # the step's end (gpt._finalize): held rows of the unfused head into main_grad
    return logp.detach(), ent.detach(), x.grad, w.main_grad  # the next run zeroes main_grad: clone to keep it


def heads(inp: _Inputs, backend, chunk_tokens: int) -> dict[str, Callable]:
    vocab = inp.weight.shape[0]
    buffer = inp.held  # flushes into main_grad once it holds H rows; _run flushes the rest

    def unfused(x, w):
        logits = vocab_grads._DeferredHead.apply(x, w, buffer, False, None) if torch.is_grad_enabled() else x @ w.t()
        return vocab_parallel_logprob_entropy(logits, inp.labels, vocab_start=0, vocab_size=vocab, group=None,
                                              backend=backend)

    def fused(x, w):
        return fused_linear_logprob_entropy(x, w, inp.labels, vocab_size=vocab, backend=backend,
                                            chunk_tokens=chunk_tokens,
                                            grad_weight_into=w.main_grad if torch.is_grad_enabled() else None)

    return {"unfused": unfused, "fused": fused}


def measure(model: str, tokens: int, *, reps: int, chunk_tokens: int, backend) -> HeadResult:
    vocab, hidden = MODELS[model]
    inp = _inputs(vocab, hidden, tokens)
    fns = heads(inp, backend, chunk_tokens)
    peak, outs = {}, {}
    for name, fn in fns.items():  # the untimed run: counts the bytes, keeps the results
        with LiveBytes() as counter:
            out = _run(inp, fn)
        outs[name] = (*out[:3], out[3].clone())
        peak[name] = counter.peak
    times = {name: float("inf") for name in fns}
    forward = {name: float("inf") for name in fns}
    for _ in range(reps):  # interleaved: a burst of load on the shared machine hits both
        for name, fn in fns.items():
            t0 = time.perf_counter()
            _run(inp, fn)
            times[name] = min(times[name], time.perf_counter() - t0)
            with torch.no_grad():
                t0 = time.perf_counter()
                fn(inp.hidden, inp.weight)
                forward[name] = min(forward[name], time.perf_counter() - t0)
    u, f = outs["unfused"], outs["fused"]
    return HeadResult(
        model=model, vocab=vocab, hidden=hidden, tokens=tokens, chunk_tokens=chunk_tokens, backend=backend.name,
        peak_bytes_fused=peak["fused"], peak_bytes_unfused=peak["unfused"],
        peak_ratio=peak["unfused"] / max(peak["fused"], 1), time_fused_s=times["fused"],
        time_unfused_s=times["unfused"], speedup=times["unfused"] / times["fused"],
        time_fused_forward_s=forward["fused"], time_unfused_forward_s=forward["unfused"],
        grad_max_abs_diff=max((f[2] - u[2]).abs().max().item(), (f[3] - u[3]).abs().max().item()),
        grad_max_abs=max(u[2].abs().max().item(), u[3].abs().max().item()),
        logp_max_abs_diff=(f[0] - u[0]).abs().max().item(), entropy_max_abs_diff=(f[1] - u[1]).abs().max().item())


def parse_shapes(specs: list[str]) -> list[tuple[str, int]]:
    """["smollm2:4096,8192", ...] -> [("smollm2", 4096), ("smollm2", 8192), ...]; ValueError naming the bad part."""
    out = []
    for spec in specs:
        model, sep, counts = spec.partition(":")
        if model not in MODELS or not sep:
            raise ValueError(f"--shapes {spec!r}: must be MODEL:TOKENS[,TOKENS...] with MODEL one of {sorted(MODELS)}")
        for part in counts.split(","):
            if not part.strip().isdigit() or not 1 <= int(part) <= MAX_TOKENS:
                raise ValueError(f"--shapes {spec!r}: token count {part!r} must be an integer in [1, {MAX_TOKENS}]")
            out.append((model, int(part)))
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pfppo bench head", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=str, default=None, help="write the results here")
    p.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), help="MODEL:TOKENS[,TOKENS...]")
    p.add_argument("--reps", type=int, default=2, help="timed runs per head and shape (min reported)")
    p.add_argument("--chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS, help="the fused head's chunk rows")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--kernels", default="auto", choices=("auto", "torch", "fused"), help="the kernels backend")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        shapes = parse_shapes(args.shapes)
        check_chunk_tokens("pfppo bench head --chunk-tokens", args.chunk_tokens)
        if not 1 <= args.reps <= 100 or not 1 <= args.threads <= 256:
            raise ValueError(f"--reps {args.reps} must be in [1, 100] and --threads {args.threads} in [1, 256]")
    except ValueError as e:
        print(f"pfppo bench head: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    backend = get_backend(args.kernels, "cpu")
    results = []
    print(f"{'model':<9} {'tokens':>6} {'peak unfused MB':>15} {'peak fused MB':>13} {'ratio':>6} "
          f"{'unfused s':>9} {'fused s':>8} {'speedup':>7} {'fwd unfused s':>13} {'fwd fused s':>11} "
          f"{'grad diff':>9}", flush=True)
    for model, tokens in shapes:
        r = measure(model, tokens, reps=args.reps, chunk_tokens=args.chunk_tokens, backend=backend)
        results.append(r)
        print(f"{r.model:<9} {r.tokens:>6} {r.peak_bytes_unfused / 1e6:>15.0f} {r.peak_bytes_fused / 1e6:>13.0f} "
              f"{r.peak_ratio:>6.1f} {r.time_unfused_s:>9.2f} {r.time_fused_s:>8.2f} {r.speedup:>7.2f} "
              f"{r.time_unfused_forward_s:>13.2f} {r.time_fused_forward_s:>11.2f} {r.grad_max_abs_diff:>9.1e}",
              flush=True)
    if args.json:
        doc = {"git_sha": git_sha(), "machine": machine_info("cpu"), "dtype": "float32", "device": "cpu",
               "kernels": backend.name, "reps": args.reps, "command": "pfppo bench head " + " ".join(
                   sys.argv[1:] if argv is None else argv), "results": [asdict(r) for r in results]}
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
