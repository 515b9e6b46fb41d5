"""perf/ metrics: each phase's work against what this machine can do (rates measured in the run,
trainer/instruments/machine.py).

Model FLOPs of a forward pass (the work the result needs, not what was computed: padding and
prompt-position logits are waste, so they lower the fractions): per real token 2 x the decoder's
matmul parameters (q, k, v, o, gate, up, down of every layer), plus 4 x heads x head_dim x layers
per causal (query, key) pair, plus 2 x hidden x V (LM head) or 2 x hidden (value head) per
response token. A training pass is 3 x its forward (backward: twice the forward).

    perf/prepare_matmul_frac  prepare phase's model FLOPs / (its time x matmul rate)
    perf/update_matmul_frac   update phase's (actor + critic, forward + backward) likewise
    perf/prepare_tflops, perf/update_tflops  those phases' model FLOP/s (the same FLOP count), in TFLOP/s
    perf/update_tokens_per_s  real tokens through the update's passes (actor + critic) per second
    perf/padding_frac         share of the decoder positions the prepare and update passes ran on padding
    perf/head_waste_frac      share of the head's positions whose output is never read (prompt, padding)
    perf/rollout_floor_s      the rollout's floor: prefill FLOPs at the matmul rate, then per decode
                              step the larger of (weight + KV-cache bytes at the memcpy rate) and
                              (its FLOPs at the matmul rate), steps = the longest response
    perf/rollout_floor_frac   floor / the rollout phase's time (1.0: at the floor)
    perf/generate_floor_frac  floor / the seconds inside the engine's generate() calls
                              (time/rollout_engine_s): the engine's generation alone; the rest of the
                              phase is its weight updates (time/rollout_weights_s: refits, pool switches)
                              and the trainer's frame around them (colocation, decoding, moving rows)
    perf/rollout_floor_shared_s, perf/rollout_floor_shared_frac  the same floor with each distinct
                              prompt prefilled once (GRPO's n rows of a prompt share its prefill, as
                              the built-in engine does); logged when rows share prompts
    perf/matmul_gflops, perf/memcpy_gbps  the measured rates; the matmul rate is the best library's
                              (measured at the first step, again every logging.perf_probe_interval steps)
    perf/matmul_gflops_<lib>  each library's rate (torch_mm: MKL on a CPU, what the trainer's layers
                              use; onednn: prepacked, what the built-in engine uses)

The floor is computed from this rank's rows as one batch in one engine call (PF-PPO's snapshot
groups, DAPO's extra rounds and a split rollout run more calls): a lower bound, exact in kind
for one rank and one call. Rates are measured in the models' parameter dtype.
"""

from __future__ import annotations

import torch

from pfppo_mega.families import DecoderShape
from pfppo_mega.models.microbatch import Tally
from pfppo_mega.trainer.batch import ScoredBatch
from pfppo_mega.trainer.build import Models
from pfppo_mega.trainer.instruments import machine

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def layer_matmul_params(shape: DecoderShape) -> int:
    """Matmul weights of one decoder layer (norms and biases are not matmuls)."""
    h, d = shape.hidden_size, shape.head_dim
    attn = h * shape.num_attention_heads * d + 2 * h * shape.num_query_groups * d + shape.num_attention_heads * d * h
    return attn + 3 * h * shape.ffn_hidden_size


def forward_flops(shape: DecoderShape, *, tokens: float, attn_pairs: float, head_tokens: float,
                  head_width: int) -> float:
    """Model FLOPs of a forward over ``tokens`` real tokens with ``attn_pairs`` causal pairs and the
    head (``head_width`` outputs: V or 1) at ``head_tokens`` positions."""
    trunk = 2.0 * shape.num_layers * layer_matmul_params(shape) * tokens
    attn = 4.0 * shape.num_attention_heads * shape.head_dim * shape.num_layers * attn_pairs
    return trunk + attn + 2.0 * shape.hidden_size * head_width * head_tokens


def tally_flops(shape: DecoderShape, tally: Tally, *, head_width: int) -> float:
    return forward_flops(shape, tokens=tally.real, attn_pairs=tally.attn_pairs, head_tokens=tally.head_needed,
                         head_width=head_width)


def rollout_floor_s(shape: DecoderShape, prompt_lengths: list[int], response_lengths: list[int], *,
                    matmul: float, memcpy: float, dtype_bytes: int,
                    prefill_lengths: list[int] | None = None) -> float:
    """Seconds the rollout of these rows cannot beat on this machine (see the module docstring).
    ``prefill_lengths``: the prompts prefilled (default every row's; the distinct ones when the
    rows sharing a prompt share its prefill)."""
    if not prompt_lengths:
        return 0.0
    layer = layer_matmul_params(shape)
    heads, d, L = shape.num_attention_heads, shape.head_dim, shape.num_layers
    head = shape.hidden_size * shape.vocab_size
    per_token = 2.0 * (L * layer + head)                                 # decoder + LM head, per token
    filled = prompt_lengths if prefill_lengths is None else prefill_lengths
    pairs = sum(p * (p + 1) / 2 for p in filled)
    prefill = (2.0 * L * layer * sum(filled) + 4.0 * heads * d * L * pairs
               + 2.0 * head * len(filled)) / matmul                       # logits at the last prompt token only
    weight_bytes = (L * layer + head) * dtype_bytes
    kv_per_pos = 2 * L * shape.num_query_groups * d * dtype_bytes        # K and V of one position, every layer
    p = torch.tensor(prompt_lengths, dtype=torch.float64)                # [B]
    r = torch.tensor(response_lengths, dtype=torch.float64)              # [B]
    k = torch.arange(1, max(int(r.max()), 1), dtype=torch.float64)[:, None]  # [K, 1] decode steps (the first
    alive = (r[None, :] > k).double()                                    # token comes from the prefill) [K, B]
    n = alive.sum(1)                                                     # [K] rows still generating
    ctx = (alive * (p[None, :] + k)).sum(1)                              # [K] positions they attend to
    bytes_ = weight_bytes + kv_per_pos * ctx
    flops = n * per_token + 4.0 * heads * d * L * ctx
    decode = torch.maximum(bytes_ / memcpy, flops / matmul).sum().item()
    return prefill + decode


def step_perf(models: Models, scored: ScoredBatch, times: dict[str, float], *, step: int, probe_interval: int,
              device: torch.device) -> dict[str, float]:
    """This step's perf/ record (takes the passes' tallies of ``models``: the next step starts from
    zero). ``probe_interval``: logging.perf_probe_interval, the steps between measurements of the machine."""
    work = models.passes.take()
    if probe_interval and step % probe_interval == 0:
        machine.remeasure()  # this machine's speed drifts (1.8x within hours seen on a shared CPU)
    shape = DecoderShape.from_model_config(models.model_cfg, models.arch)
    dtype = getattr(torch, models.model_cfg.params_dtype)
    rates = machine.matmul_rates(device, dtype)
    matmul, memcpy = max(rates.values()), machine.memcpy_rate(device)
    vocab = shape.vocab_size
    prepare = tally_flops(shape, work.prepare_lm, head_width=vocab) + tally_flops(shape, work.prepare_value,
                                                                                   head_width=1)
    update = 3.0 * (tally_flops(shape, work.update_lm, head_width=vocab)
                    + tally_flops(shape, work.update_value, head_width=1))
    total = work.total()
    rb = scored.rollout
    prompts, responses = [len(p) for p in rb.prompt_ids], [int(n) for n in rb.response_mask.sum(1).tolist()]
    rates_kw = dict(matmul=matmul, memcpy=memcpy, dtype_bytes=_BYTES[models.model_cfg.params_dtype])
    floor = rollout_floor_s(shape, prompts, responses, **rates_kw)
    distinct = [len(p) for p in dict.fromkeys(tuple(p) for p in rb.prompt_ids)]
    out = {"perf/matmul_gflops": matmul / 1e9, "perf/memcpy_gbps": memcpy / 1e9,
           "perf/padding_frac": total.padding_frac, "perf/head_waste_frac": total.head_waste_frac,
           "perf/rollout_floor_s": floor, **{f"perf/matmul_gflops_{lib}": r / 1e9 for lib, r in rates.items()}}
    for name, flops in (("prepare", prepare), ("update", update)):
        if times.get(name, 0.0) > 0 and flops > 0:
            out[f"perf/{name}_matmul_frac"] = flops / (times[name] * matmul)
            out[f"perf/{name}_tflops"] = flops / times[name] / 1e12
    if times.get("update", 0.0) > 0:  # real tokens the update's passes ran on (actor + critic), per second
        out["perf/update_tokens_per_s"] = (work.update_lm.real + work.update_value.real) / times["update"]
    if len(distinct) < len(prompts):
        out["perf/rollout_floor_shared_s"] = rollout_floor_s(shape, prompts, responses, prefill_lengths=distinct,
                                                             **rates_kw)
    if times.get("rollout", 0.0) > 0:
        out["perf/rollout_floor_frac"] = floor / times["rollout"]
        if "perf/rollout_floor_shared_s" in out:
            out["perf/rollout_floor_shared_frac"] = out["perf/rollout_floor_shared_s"] / times["rollout"]
        if times.get("rollout_engine", 0.0) > 0:
            out["perf/generate_floor_frac"] = floor / times["rollout_engine"]
    return out
