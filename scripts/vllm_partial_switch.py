"""What one switch inside a request costs the vLLM engine (partial rollouts, docs/async.md).

One in-process VLLMEngine on a checkpoint; B rows of P random prompt tokens, N new tokens each, at
temperature 1, seeded. Interleaved, each repeat:

    generate             vLLM's own LLM.generate (no switch possible)
    partial, no switch   generate_partial, vLLM driven one step at a time, switch() always False
    partial, one switch  generate_partial, the checkpoint's weights loaded again as a new version
                         before token K (update_weights: vLLM's reload + the prefix-cache reset that
                         preempts the running rows), then the rows' prompt + K tokens recomputed

Reported (medians over the repeats, seconds): each call's wall time; the switch's load; the step
after the switch (the recompute of B x (P + K) tokens plus one token each) against the median
ordinary decode step of the same call. The same weights are loaded again, so the tokens must equal
the no-switch call's (checked; a switch to other weights costs the same work).

    python scripts/vllm_partial_switch.py --model runs/llm/smollm2 [--rows 16 --prompt 64 --new 64 --at 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, not an installed one

from pfppo_mega.rollout import SamplingParams
from pfppo_mega.rollout.vllm import VLLMEngine


def _timed_steps(engine: VLLMEngine) -> list[float]:
    """Record the wall time of every vLLM engine step from now on (a measurement hook only)."""
    core, times = engine.llm.llm_engine, []
    plain = type(core).step

    def step(self):
        t0 = time.perf_counter()
        out = plain(self)
        times.append(time.perf_counter() - t0)
        return out

    core.step = step.__get__(core)
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="a Hugging Face checkpoint dir (config.json + model.safetensors)")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens per row")
    ap.add_argument("--new", type=int, default=64, help="new tokens per row")
    ap.add_argument("--at", type=int, default=32, help="the switch comes before this token")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    if not 1 <= args.at < args.new:
        ap.error(f"--at = {args.at}: must be in [1, --new = {args.new})")
    from safetensors.torch import load_file

    torch.set_num_threads(args.threads)
    weights = load_file(str(Path(args.model) / "model.safetensors"))
    t0 = time.perf_counter()
    engine = VLLMEngine(args.model, pad_token_id=0, max_num_seqs=args.rows, max_model_len=args.prompt + args.new)
    start_s = time.perf_counter() - t0
    torch.set_num_threads(args.threads)
    version = [1]
    engine.load_weights(weights.items(), version=1)
    g = torch.Generator().manual_seed(0)
    vocab = engine.shape.vocab_size
    prompts = [torch.randint(1, vocab, (args.prompt,), generator=g).tolist() for _ in range(args.rows)]
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=args.new, eos_token_id=None, seed=7)
    steps = _timed_steps(engine)
    loads: list[float] = []

    def switch(t: int) -> bool:
        if t != args.at:
            return False
        version[0] += 1
        s0 = time.perf_counter()
        engine.load_weights(weights.items(), version=version[0])
        loads.append(time.perf_counter() - s0)
        return True

    rows: dict[str, list[float]] = {"generate": [], "partial, no switch": [], "partial, one switch": [],
                                    "switch: load": [], "switch: step after": [], "ordinary decode step": []}
    engine.generate(prompts, params)  # warm-up
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        plain = engine.generate(prompts, params)
        rows["generate"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        engine.generate_partial(prompts, params, lambda t: False)
        rows["partial, no switch"].append(time.perf_counter() - t0)
        steps.clear()
        t0 = time.perf_counter()
        out = engine.generate_partial(prompts, params, switch)
        rows["partial, one switch"].append(time.perf_counter() - t0)
        assert torch.equal(out.responses, plain.responses), "a switch to the same weights changed tokens"
        assert (out.token_versions[:, args.at:] == version[0]).all()
        rows["switch: load"].append(loads[-1])
        rows["switch: step after"].append(steps[args.at])  # step `at` (0-based) runs right after the switch
        rows["ordinary decode step"].append(statistics.median(steps[1:args.at] + steps[args.at + 1:]))
    result = {"model": args.model, "rows": args.rows, "prompt": args.prompt, "new": args.new, "at": args.at,
              "threads": args.threads, "engine_start_s": round(start_s, 2),
              "median_s": {k: round(statistics.median(v), 4) for k, v in rows.items()},
              "each_s": {k: [round(x, 4) for x in v] for k, v in rows.items()}}
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
