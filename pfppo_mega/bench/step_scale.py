"""Our measured phase times scaled to the 70B layout (scripts/async_step_model.py --measured;
docs/async.md, "At scale, on paper"): a model, not a measurement.

A synchronous run on this machine records, per step, how far each phase is from what the machine
can do (trainer/instruments/perf.py): the generation's floor over its time inside the engine
(perf/generate_floor_frac), the prepare and update passes' model FLOPs over their time x the
measured matmul rate (perf/prepare_matmul_frac, perf/update_matmul_frac). Assume each phase keeps
that efficiency at scale. Then a 70B phase takes its work at an H100's rates divided by that
efficiency:

    generation  perf.rollout_floor_s of one engine replica's rows (prefill FLOPs, then per decode step
                the larger of weights + KV-cache bytes at HBM bandwidth and the step's FLOPs), every
                rate x the replica's GPUs (actor_rollout.tensor_model_parallel_size), replicas in parallel
    log-probs   actor + reference forwards (+ the critic's values with GAE) over every token
    training    3 x (actor + critic) forward, x ppo_epochs
    refit       the engine's weights (the ledger's parameter count x the engine dtype) through one
                GPU's network link, per engine GPU its 1/rollout_tp share (a pipelined broadcast)

Inputs not measured here are stated in H100 below. The 70B workload (rows, prompt and response
lengths) is the 70B config's, with each response's length drawn evenly over 10..100 % of
max_response_length and every prompt at half max_prompt_length (assumptions: no public length
distribution for that job).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass

from pfppo_mega import ledger
from pfppo_mega.config import load_config
from pfppo_mega.families import DecoderShape
from pfppo_mega.registry import ADV_ESTIMATORS
from pfppo_mega.trainer.instruments import perf

# H100 SXM 80GB. matmul: the bf16 rate measured on an H100 by scripts/gpu_check.sh (docs/scaling.md:
# 750-779 TFLOP/s; our efficiencies are fractions of a *measured* rate, so not the 989 TFLOP/s peak);
# memcpy: the vendor's HBM3 bandwidth, 3.35 TB/s; link: one 400 Gb/s NDR InfiniBand port per GPU (DGX H100).
H100 = {"matmul": 760e12, "memcpy": 3.35e12, "link": 50e9}

KEYS = {"gen_s": "time/rollout_engine_s", "prepare_s": "time/prepare_s", "update_s": "time/update_s",
        "sync_s": "time/sync_s", "gen_frac": "perf/generate_floor_frac", "prepare_frac": "perf/prepare_matmul_frac",
        "update_frac": "perf/update_matmul_frac", "rows": "work/rows", "response_len": "response/length_mean"}
RATES = {"matmul": "perf/matmul_gflops", "memcpy": "perf/memcpy_gbps"}  # logged at the rate probes only


@dataclass(frozen=True)
class Measured:
    """Medians over a run's steps (after ``skip``) of KEYS; rates in GFLOP/s and GB/s."""

    path: str
    steps: int
    gen_s: float
    prepare_s: float
    update_s: float
    sync_s: float
    gen_frac: float
    prepare_frac: float
    update_frac: float
    matmul: float
    memcpy: float
    rows: float
    response_len: float


def measured(path: str, *, skip: int = 1) -> Measured:
    recs = [json.loads(line) for line in open(path) if line.strip()]
    steps = [r for r in recs if all(k in r for k in KEYS.values()) and r.get("step", 0) > skip]
    probes = [r for r in recs if all(k in r for k in RATES.values())]
    if not steps or not probes:
        seen = set().union(*recs) if recs else set()
        missing = sorted((set(KEYS.values()) | set(RATES.values())) - seen)
        raise ValueError(f"{path}: no step after step {skip} records all of {sorted(KEYS.values())}, or no record "
                         f"has {sorted(RATES.values())} (never logged: {missing}); measure a synchronous run with "
                         f"its perf/ metrics on")
    return Measured(path, len(steps), **{f: statistics.median(r[k] for r in steps) for f, k in KEYS.items()},
                    **{f: statistics.median(r[k] for r in probes) for f, k in RATES.items()})


@dataclass(frozen=True)
class Scaled:
    """The 70B layout's phases in seconds on ``gpus`` H100 (each phase on all of them)."""

    gpus: int
    rows: int
    replicas: int
    gen_floor_s: float
    gen_s: float
    prepare_tflop: float
    prepare_s: float
    update_tflop: float
    update_s: float
    weight_gb: float
    refit_s: float


def _lengths(cfg) -> tuple[list[int], list[int]]:
    rows = cfg.training.rollout_batch_size * cfg.actor_rollout.n_samples_per_prompt
    top = cfg.algorithm.max_response_length
    resp = [max(1, round(top * (0.1 + 0.9 * i / max(1, rows - 1)))) for i in range(rows)]
    return [cfg.data.max_prompt_length // 2] * rows, resp


def scaled(m: Measured, layout: str, *, gpus: int, rates: dict = H100) -> Scaled:
    cfg = load_config(layout)
    shape = DecoderShape.from_model_config(cfg.model)
    prompts, resp = _lengths(cfg)
    rows, r_tp = len(prompts), cfg.actor_rollout.tensor_model_parallel_size
    replicas = max(1, gpus // r_tp)
    # one replica's rows, every replicas-th (each replica a mix of short and long responses; they run in parallel)
    mine = slice(0, rows, replicas)
    dbytes = 2 if cfg.actor_rollout.dtype in ("bfloat16", "auto") else 4
    floor = perf.rollout_floor_s(shape, prompts[mine], resp[mine], matmul=rates["matmul"] * r_tp,
                                 memcpy=rates["memcpy"] * r_tp, dtype_bytes=dbytes)
    tokens = sum(p + r for p, r in zip(prompts, resp))
    pairs = sum((p + r) * (p + r + 1) / 2 for p, r in zip(prompts, resp))
    lm = perf.forward_flops(shape, tokens=tokens, attn_pairs=pairs, head_tokens=sum(resp),
                            head_width=shape.vocab_size)
    value = perf.forward_flops(shape, tokens=tokens, attn_pairs=pairs, head_tokens=sum(resp), head_width=1)
    critic = ADV_ESTIMATORS.get(cfg.algorithm.adv_estimator).needs_critic
    prepare = 2 * lm + (value if critic else 0.0)                       # proximal + reference (+ values)
    update = 3 * (lm + (value if critic else 0.0)) * cfg.algorithm.ppo_epochs
    weight_bytes = ledger.total_param_count(shape) * dbytes
    return Scaled(gpus=gpus, rows=rows, replicas=replicas, gen_floor_s=floor, gen_s=floor / m.gen_frac,
                  prepare_tflop=prepare / 1e12, prepare_s=prepare / (gpus * rates["matmul"] * m.prepare_frac),
                  update_tflop=update / 1e12, update_s=update / (gpus * rates["matmul"] * m.update_frac),
                  weight_gb=weight_bytes / 1e9, refit_s=weight_bytes / r_tp / rates["link"])


def report(m: Measured, s: Scaled, *, published: dict) -> str:
    lines = [f"measured: {m.path}, median of {m.steps} steps; this machine {m.matmul:.0f} GFLOP/s matmul, "
             f"{m.memcpy:.1f} GB/s memcpy; {m.rows:.0f} rows, mean response {m.response_len:.1f} tokens",
             f"70B layout: {s.rows} rows, {s.replicas} engine replicas on {s.gpus} H100; weights {s.weight_gb:.0f} GB",
             "",
             "| phase | ours on this CPU, s | our efficiency | 70B work | 70B at our efficiency, s | NeMo-RL 70B (published), s |",
             "|---|---|---|---|---|---|",
             f"| generation | {m.gen_s:.3f} | {m.gen_frac:.2f} of the floor | floor {s.gen_floor_s:.1f} s | "
             f"{s.gen_s:.1f} | {published['gen']:g} |",
             f"| log-probs (prepare) | {m.prepare_s:.3f} | {m.prepare_frac:.2f} of matmul | {s.prepare_tflop:,.0f} TFLOP | "
             f"{s.prepare_s:.1f} | {published['logp']:g} |",
             f"| training (update) | {m.update_s:.3f} | {m.update_frac:.2f} of matmul | {s.update_tflop:,.0f} TFLOP | "
             f"{s.update_s:.1f} | {published['train']:g} |",
             f"| refit | {m.sync_s:.3f} | (link rate assumed) | {s.weight_gb:.0f} GB | {s.refit_s:.1f} | "
             f"{published['refit']:g} |",
             "",
             f"NeMo-RL's published generation is {s.gen_floor_s / published['gen']:.2f} of this layout's generation floor "
             f"(ours on this CPU: {m.gen_frac:.2f}); its training + log-probs at this layout's work would be "
             f"{(s.prepare_tflop + s.update_tflop) * 1e12 / (s.gpus * H100['matmul'] * (published['train'] + published['logp'])):.2f} "
             f"of the matmul rate (ours: {m.prepare_frac:.2f} / {m.update_frac:.2f}): different jobs (batch, lengths, "
             f"critic), so read the ratio, not the seconds"]
    return "\n".join(lines)
