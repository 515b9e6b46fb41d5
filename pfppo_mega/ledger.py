"""The device-memory ledger of the colocated step: what one rank holds on its GPU and in host
memory at every phase, in the order the code runs the phases.

One place for the arithmetic. ``pfppo plan`` (pfppo_mega.planning.memory) replays BUILD_ORDER and
STEP_ORDER through a ``Ledger`` for every pipeline stage and prints its budgets from the records
(``pfppo plan CONFIG --ledger`` prints the per-phase table); the trainer enters every phase as the
code executes it (trainer/colocation/generation.py, ``MemoryRecorder``) and the ledger checks the predicted
device bytes against the card's capacity at each one (LedgerOverflow names the phase, the bytes
and what holds them). So the plan and the trainer cannot disagree: same holdings, same order.

What a rank holds (bytes per parameter: megatron DDP with grad_reduce_in_fp32 and a mixed-precision
optimizer, as pfppo_mega.models.gpt builds them):
  trainer    actor / critic weights (params dtype), grads (fp32 grad buffer, not sharded), optimizer
             (Adam exp_avg + exp_avg_sq fp32, + fp32 main weights unless the params are fp32;
             / dp with the distributed optimizer); the reference's and a reward model's weights.
  engine     weights in the engine dtype at rollout TP (engine_param_count); KV cache: vLLM on a GPU
             takes gpu_memory_utilization x capacity for weights + workspace + KV cache, so
             KV = util x capacity - weights - workspace ("utilization"); vLLM on CPU is given
             kv_cache_bytes (max_num_seqs x max_model_len, "bytes"); the built-in engine allocates a
             KV cache per generate call for its rows ("per call": transient) and lives on the CPU.
  refit      the bucket stream's buffers (pfppo_mega.rollout.refit): ring slots of the largest
             bucket on the communicator's device, made by a frame's first refit or switch, kept
             for its later ones and freed when the engine sleeps (EngineSync.release_buffers): none
             beside the trainer's states in prepare and update; plus one bucket gathered by its
             producer (transient). A pool capture after the update makes them and frees them when
             it ends (not a phase here: the update's activations are gone by then).
  reserve    CUDA context, NCCL communicators, allocator slack (a runtime choice; 0 on a CPU).
  transient  activations of the update (Korthikanti et al., below) and of a forward in prepare
             (one layer's working set + the last stage's logits); the engine's workspace while it
             generates.
  host       the offloaded trainer states but their gradients (TrainerOffload keeps its host buffers
             after a reload: counted from the first offload on; the grad buffers are freed without a
             host copy and come back zeroed), the PF-PPO pool's share of this rank, a sleeping
             engine's weights at sleep level 1, a fixed host reserve. The offload's buffers and the
             pool's copies are page-locked exactly their size (pfppo_mega.pinned), so they count at
             their bytes; torch's caching pinned allocator would hold the next power of two of each
             (``pinned.allocator_bytes``).

Phase transitions (``Ledger.enter``), as trainer/build.py and trainer/colocation/generation.py call them:
  build trainer, offload trainer, offload actor weights, build engine, sleep, reload trainer   (once)
  offload trainer, wake weights, refit | switch, offload actor weights, wake kv cache, generate,
  sleep, reload trainer   (every generation: rollout, evaluation, the KL probe)
  prepare, update         (the trainer's forwards and its update)
Offload phases move nothing when offload is off (training.offload_during_rollout false); sleep and
wake move nothing of the engine's on an engine that cannot sleep (CPU); sleep frees the refit
stream's slots on every device.

Activations per decoder layer and micro-batch follow Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models" (2022): s b h (34 + 5 a s / h) bytes for their GPT
layer; with tensor parallelism t: s b h (10 + 24/t + 5 a s / (h t)); with sequence parallelism:
s b h (34 + 5 a s / h) / t; selective recompute: s b h (10 + 24/t), 34 s b h / t with SP; full
recompute: 2 s b h (/ t with SP).
The same accounting for this project's Llama layer (RMSNorm, GQA with g KV heads of size d,
SwiGLU MLP of width f, no dropout), bytes of bf16 values unless marked fp32:

    norm inputs 2 x 2sbh, QKV input 2sbh, fc1 input 2sbh        replicated over TP (split with SP)
    Q 2sbh, out-proj input 2sbh                                 split over TP
    K, V  layer "local": 2 x 2sbh (megatron's unfused attention repeats the g KV heads to a)
          layer "fused": 2 x 2sbgd
          selective, "local": the core's checkpoint keeps its inputs instead: the fused QKV
          output 2sb(a+2g)d (v is a view of it) and the rotated k 2sbgd (q as above), so
          -2sbh + 6sbgd against K, V above (70B, g = 8, d = 128: 1.25 sbh fewer per layer before TP)
    core  layer "local": softmax output in fp32 4as^2b + its bf16 copy 2as^2b   split over TP,
          layer "fused": flash attention, fp32 log-sum-exp 4asb                 dropped by selective
    MLP   layer "local": [gate; up] 4sbf, silu(gate) 2sbf, up + glu_linear_offset 2sbf,
                         fc2 input 2sbf = 10sbf (megatron 0.16.1's unfused glu)
          layer "fused": [gate; up] 4sbf, fc2 input 2sbf = 6sbf (fused SwiGLU keeps its input)

Layer "local" is megatron's local spec as pfppo_mega.models builds it with training.fused_layers
off; layer "fused" is what it builds with training.fused_layers on (scaled_dot_product_attention:
no s^2 scores; SwiGLU saving its input: measured on the CPU, tests/test_gpu_layers.py) and TE's layers
(pfppo_mega.models.fused_layers, Knobs.from_config); tests/test_plan.py measures megatron's own
TransformerLayer on the CPU with autograd's saved-tensor hooks, without recompute and with
selective recompute (forward only: its backward needs CUDA), and finds these terms (the CPU
build of torch keeps fp32 RMSNorm intermediates, 8sbh per norm, not 2sbh; on GPUs the norms are
assumed fused -- not measured here). On a pipeline stage with 1F1B scheduling and m micro-batches
per step, stage k keeps min(pp - k, m) micro-batches in flight, each with the stage's L/pp layers.
The actor's last stage also holds the logits [s, b, V/tp]: bf16 logits 2 + fp32 log-softmax 4 +
fp32 gradient 4 = 10 s b V / tp bytes.

Only the standard library is imported here (and pfppo_mega.families / registry): the planner
runs without torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from math import ceil, prod
from typing import Optional

from pfppo_mega.config.tree import lora_targets
from pfppo_mega.families import DecoderShape, Head
from pfppo_mega.registry import ADV_ESTIMATORS

GiB = 2 ** 30
MiB = 2 ** 20

RECOMPUTE = ("none", "selective", "full")
LAYERS = ("local", "fused")
POOL_PLACEMENT = ("node", "sharded")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
BYTES_GRAD = 4          # fp32 grad buffer (grad_reduce_in_fp32)
BYTES_ADAM = 8          # fp32 exp_avg + exp_avg_sq
BYTES_MAIN = 4          # fp32 main weights (none when the params are fp32 themselves)
GRADS = " grads (fp32)"  # the grad buffers' holdings: "actor grads (fp32)", "critic grads (fp32)"
KV_BLOCK = 32           # vLLM's KV block (tokens), as pfppo_mega.rollout.vllm sets and sizes a CPU cache
# pfppo_mega.rollout.refit's stream ring (tests/test_ledger.py checks these equal its constants)
REFIT_MAX_AHEAD = 3
REFIT_AHEAD_BYTES = 64 << 20
REFIT_TRAILER_BYTES = 32

BUILD_ORDER = ("build trainer", "offload trainer", "offload actor weights", "build engine", "sleep",
               "reload trainer")
STEP_ORDER = ("offload trainer", "wake weights", "refit", "offload actor weights", "wake kv cache", "generate",
              "sleep", "reload trainer", "prepare", "update")
PHASES = frozenset(BUILD_ORDER + STEP_ORDER + ("switch",))
KV_MODES = ("utilization", "bytes", "per call")


# ----------------------------------------------------------------------------- layout and parameter counts


@dataclass(frozen=True)
class Layout:
    """Megatron parallel degrees; world size = tp * pp * dp."""

    tp: int
    pp: int
    dp: int

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @classmethod
    def for_world(cls, world_size: int, tp: int, pp: int) -> "Layout":
        if world_size % (tp * pp):
            raise ValueError(f"tp({tp}) * pp({pp}) = {tp * pp} does not divide the world size ({world_size})")
        return cls(tp, pp, world_size // (tp * pp))


def stage_layers(num_layers: int, pp: int, pp_rank: int) -> range:
    """Global indices of the decoder layers on pipeline stage ``pp_rank`` (even split)."""
    per = num_layers // pp
    return range(pp_rank * per, (pp_rank + 1) * per)


def param_shapes(shape: DecoderShape, tp: int, pp: int, pp_rank: int, head: Head = "lm") -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter a rank at (any tp rank, stage ``pp_rank``) holds.

    ``head`` "lm": the actor (LM head, tied or not); "value": the critic (ValueHead [1, h], never
    tied). Tensor-parallel ranks of one stage hold the same shapes."""
    local = range(len(stage_layers(shape.num_layers, pp, pp_rank)))
    output = "value" if head == "value" else (None if shape.tie_word_embeddings and pp == 1 else "lm")
    return shape.megatron_shapes(local, first=pp_rank == 0, last=pp_rank == pp - 1, head=output, tp=tp)


def count(shapes: dict[str, tuple[int, ...]]) -> int:
    return sum(prod(v) for v in shapes.values())


def stage_param_count(shape: DecoderShape, tp: int, pp: int, pp_rank: int, head: Head = "lm") -> int:
    """Parameters held by one rank of stage ``pp_rank``."""
    return count(param_shapes(shape, tp, pp, pp_rank, head))


def lora_param_count(shape: DecoderShape, tp: int, pp: int, rank: int, targets: tuple[str, ...]) -> int:
    """Adapter parameters one rank holds (models/lora.py): per decoder layer of its stage and targeted
    linear, A [r, in] and B [out, r], the factor on the split side cut by tp (column-parallel linear_qkv,
    linear_fc1: B's rows; row-parallel linear_proj, linear_fc2: A's columns)."""
    h, f, d = shape.hidden_size, shape.ffn_hidden_size, shape.head_dim
    a, g = shape.num_attention_heads, shape.num_query_groups
    per = {"linear_qkv": rank * h + (a + 2 * g) * d * rank // tp, "linear_proj": rank * a * d // tp + h * rank,
           "linear_fc1": rank * h + 2 * f * rank // tp, "linear_fc2": rank * f // tp + h * rank}
    return len(stage_layers(shape.num_layers, pp, 0)) * sum(per[t] for t in targets)


def total_param_count(shape: DecoderShape, head: Head = "lm") -> int:
    """Parameters of the whole model (tp = pp = 1)."""
    return stage_param_count(shape, 1, 1, 0, head)


def engine_param_count(shape: DecoderShape, rollout_tp: int) -> int:
    """Parameters per GPU of a rollout engine with tensor parallelism ``rollout_tp`` and no pipeline.

    As megatron's tp = rollout_tp, pp = 1 layout, except that a vLLM-style engine replicates KV
    heads when rollout_tp > num_query_groups (each GPU keeps ``shape.kv_heads(rollout_tp)`` of them)."""
    head = None if shape.tie_word_embeddings else "lm"
    return count(shape.megatron_shapes(range(shape.num_layers), first=True, last=True, head=head, tp=rollout_tp))


def largest_refit_group(shape: DecoderShape) -> int:
    """Elements of the largest tensor group a refit bucket must carry whole (q/k/v of a layer =
    megatron's linear_qkv with its bias, gate/up = linear_fc1, the embedding, the LM head)."""
    groups: dict[str, int] = {}
    shapes = shape.megatron_shapes(range(1), first=True, last=True,
                                   head=None if shape.tie_word_embeddings else "lm", tp=1)
    for name, s in shapes.items():
        key = name.rsplit(".", 1)[0]
        groups[key] = groups.get(key, 0) + prod(s)
    return max(groups.values())


# ----------------------------------------------------------------------------- activations


@dataclass(frozen=True)
class LayerActivations:
    """Bytes one decoder layer keeps for backward, per micro-batch, before any parallel split.

    replicated: split over TP only with sequence parallelism; split: always split over TP;
    core: the attention core's s^2 terms (split over TP; dropped by selective recompute);
    selective_split: the split terms when the core attention is recomputed (None: ``split``):
    megatron's checkpoint of the core keeps its inputs q, k, v instead of what the core saves."""

    replicated: float
    split: float
    core: float
    selective_split: Optional[float] = None


def layer_activation_terms(*, s: int, b: int, h: int, a: int, g: int, f: int,
                           attention: str = "unfused", softmax_fp32: bool = True,
                           mlp: str = "swiglu_unfused", dropout: bool = False,
                           d: Optional[int] = None, qk_norm: bool = False, rope: bool = False) -> LayerActivations:
    """Korthikanti et al.'s per-layer accounting (see the module docstring), in bytes.

    s sequence, b micro-batch, h hidden, a heads, g KV groups, f MLP width, d head_dim (None:
    h / a; Qwen3 sets it, so Q, K, V and the out-proj input are a d wide, not h), qk_norm: the
    q/k RMSNorm inputs (Qwen3) are kept too.
    attention "unfused": K and V kept for all a heads, softmax output kept (fp32 when
    softmax_fp32, plus its bf16 copy); "flash": K and V for g heads, a log-sum-exp, no s^2 term.
    mlp "gelu" (paper), "swiglu" (fused activation) or "swiglu_unfused" (megatron 0.16.1's glu).
    mlp="gelu", dropout=True, softmax_fp32=False with g = a, f = 4h is the paper's GPT layer:
    s b h (34 + 5 a s / h).
    Selective recompute (attention "unfused"): megatron checkpoints the core with inputs q, k, v
    (tensor_parallel.checkpoint saves them); v is a view of the fused QKV output, so that whole
    output 2 s b (a + 2g) d stays, and q, k besides it when ``rope`` rotated them into new
    tensors (Llama: 2 s b a d + 2 s b g d); the K and V repeated to a heads are made inside the
    recomputed core. Without rope, q and k are views of it too (the paper's GPT layer: 6sbh)."""
    d = h // a if d is None else d
    sbh = s * b * h
    sbq = s * b * a * d                                # the width of Q and of the out-proj input
    replicated = 4 * sbh + 2 * sbh + 2 * sbh          # two norm inputs, QKV input, fc1 input
    if dropout:
        replicated += 2 * sbh                          # attention-out and MLP-out dropout masks (1 B)
    split = 2 * sbq + 2 * sbq                          # Q, out-proj input
    if qk_norm:
        split += 2 * s * b * (a + g) * d               # q / k RMSNorm inputs
    mlp_terms = {"gelu": 2 + 2, "swiglu": 4 + 2, "swiglu_unfused": 4 + 2 + 2 + 2}
    if mlp not in mlp_terms:
        raise ValueError(f"mlp({mlp!r}) must be one of {tuple(mlp_terms)}")
    split += mlp_terms[mlp] * s * b * f
    selective = None
    if attention == "unfused":
        # the core's checkpoint keeps the fused QKV output (v's base) + the rotated q and k, not Q and K, V
        qkv = 2 * s * b * (a + 2 * g) * d + (2 * sbq + 2 * s * b * g * d if rope else 0)
        selective = split - 2 * sbq + qkv
        split += 2 * 2 * sbq                           # K and V, repeated to a heads
        core = (4 + 2 if softmax_fp32 else 2) * a * s * s * b  # softmax output (+ bf16 copy)
        if dropout:
            core += a * s * s * b + 2 * a * s * s * b  # dropout mask, dropout output
    elif attention == "flash":
        split += 2 * 2 * s * b * g * d + 4 * a * s * b  # K and V for g heads, fp32 log-sum-exp
        core = 0
    else:
        raise ValueError(f"attention({attention!r}) must be 'unfused' or 'flash'")
    return LayerActivations(float(replicated), float(split), float(core),
                            None if selective is None else float(selective))


def layer_terms_for(layer: str, *, s: int, b: int, h: int, a: int, g: int, f: int,
                    d: Optional[int] = None, qk_norm: bool = False) -> LayerActivations:
    """The Llama layer as built by pfppo_mega.models ("local") or with fused kernels ("fused")."""
    if layer == "local":
        return layer_activation_terms(s=s, b=b, h=h, a=a, g=g, f=f, attention="unfused",
                                      softmax_fp32=True, mlp="swiglu_unfused", d=d, qk_norm=qk_norm, rope=True)
    if layer == "fused":
        return layer_activation_terms(s=s, b=b, h=h, a=a, g=g, f=f, attention="flash", mlp="swiglu",
                                      d=d, qk_norm=qk_norm)
    raise ValueError(f"layer({layer!r}) must be one of {LAYERS}")


def layer_bytes(t: LayerActivations, *, tp: int, sp: bool, recompute: str, s: int, b: int, h: int) -> tuple[float, float]:
    """(bytes stored per layer per micro-batch, transient bytes while one layer is recomputed).

    none: everything; selective: all but the core (recomputed in backward, one layer at a time),
    with the core's checkpointed inputs in place of what it saves (``selective_split``);
    full: the layer input 2sbh only (the whole layer is recomputed, one at a time)."""
    rep_div = tp if sp else 1
    everything = t.replicated / rep_div + t.split / tp + t.core / tp
    if recompute == "none":
        return everything, 0.0
    if recompute == "selective":
        kept = t.split if t.selective_split is None else t.selective_split
        return t.replicated / rep_div + kept / tp, t.core / tp
    if recompute == "full":
        return 2 * s * b * h / rep_div, everything
    raise ValueError(f"recompute({recompute!r}) must be one of {RECOMPUTE}")


def in_flight_microbatches(pp: int, pp_rank: int, num_microbatches: int) -> int:
    """Micro-batches whose activations stage ``pp_rank`` holds at the peak of a 1F1B schedule."""
    return min(pp - pp_rank, num_microbatches)


# ----------------------------------------------------------------------------- what the config says


@dataclass(frozen=True)
class Knobs:
    """The training features (config keys: ``Knobs.from_config``) and the runtime choices the
    config tree does not hold (flags)."""

    micro_batch: Optional[int] = None   # None: the config's training.micro_batch_size
    recompute: str = "selective"
    sequence_parallel: bool = False
    layer: str = "local"                # local: megatron's local layers; fused: SDPA / flash + fused SwiGLU
    distributed_optimizer: bool = True
    offload_during_rollout: bool = True  # training.offload_during_rollout (offload_from_config)
    rollout_tp: Optional[int] = None    # an explicit --rollout-tp override; None: the config's (RunShape)
    reserve_gib: float = 4.0            # per GPU: CUDA context, NCCL buffers, allocator slack
    rollout_workspace_gib: float = 2.0  # per GPU: engine activations / sampler (vLLM profiles it)
    host_reserve_gib: float = 64.0      # per node: OS, Python processes, data, pinned buffers
    pool_placement: str = "node"

    @classmethod
    def from_config(cls, cfg, **flags) -> "Knobs":
        """The features as the trainer reads them (training.recompute, parallel.sequence_parallel,
        model.layer_spec with training.fused_layers, parallel.use_distributed_optimizer,
        training.offload_during_rollout); the layer is "fused" (no s^2 attention buffer) for TE's layers
        and for the fused local layers, "local" only with fused_layers off and TE not asked for (auto:
        TE's where installed, counted as local, the larger);
        ``flags``: the runtime choices (micro_batch, rollout_tp override, reserves, pool placement)."""
        requested = flags.pop("offload_during_rollout", True)  # popped whatever the config says
        offload = offload_from_config(cfg) and requested
        return cls(recompute=cfg.training.recompute, sequence_parallel=cfg.parallel.sequence_parallel,
                   layer=layer_of(cfg.model.layer_spec, cfg.training.fused_layers),
                   distributed_optimizer=cfg.parallel.use_distributed_optimizer, offload_during_rollout=offload,
                   **flags)


def layer_of(layer_spec: str, fused_layers: bool) -> str:
    """The ledger's layer ("local" / "fused") of model.layer_spec and training.fused_layers on a GPU."""
    return "fused" if fused_layers or layer_spec == "transformer_engine" else "local"


def offload_from_config(cfg) -> bool:
    """training.offload_during_rollout as the trainer applies it on GPUs (null: on): the rollout
    phase then keeps none of the trainer's states on the GPU (pfppo_mega.trainer.colocation.offload)."""
    return cfg.training.offload_during_rollout is not False


@dataclass(frozen=True)
class RunShape:
    """What the config says about the run (model, layout, batch, sequence, pool, engine)."""

    model: DecoderShape
    tp: int
    pp: int
    seq_len: int                 # max_prompt_length + max_response_length
    max_prompt_length: int
    max_response_length: int
    max_position_embeddings: int
    rollout_samples: int         # rollout_batch_size * n_samples_per_prompt
    mini_batch: int              # training.batch_size (samples per optimizer step)
    micro_batch_size: Optional[int]  # training.micro_batch_size; None = the whole mini-batch per DP rank
    gpu_memory_utilization: float
    use_pf_ppo: bool
    pool_size: int
    reference: bool = True       # the trainer always builds the reference (trainer/build.py)
    reward_model: Optional[DecoderShape] = None  # reward.model_path's shape: forward-only weights on the actor's ranks
    critic: bool = True          # the advantage estimator needs a critic (GAE); else none is built
    rollout_tp: Optional[int] = None  # actor_rollout.tensor_model_parallel_size; None: GPUs per node
    engine_dtype: str = "bfloat16"    # actor_rollout.dtype resolved (auto -> model.params_dtype)
    sleep_level: int = 2              # actor_rollout.sleep_level: 1 keeps engine weights in host memory
    params_dtype: str = "bfloat16"    # model.params_dtype: the trainer's weights
    engine: str = "vllm"              # actor_rollout.engine
    max_num_seqs: int = 64            # actor_rollout.max_num_seqs (a CPU vLLM's KV cache holds that many)
    refit_bucket_bytes: int = 64 * MiB  # actor_rollout.refit_bucket_mb
    max_tokens_per_micro_batch: Optional[int] = None  # training.use_dynamic_bsz's budget; None: off
    lora_rank: int = 0                # model.lora.rank (0: every actor weight trains)
    lora_targets: tuple[str, ...] = ()  # the megatron linears that take an adapter

    @classmethod
    def from_config(cls, cfg, arch=None, reward_model: Optional[DecoderShape] = None, *, model=None) -> "RunShape":
        """From a ``pfppo_mega.config.Config`` and the checkpoint's ``pfppo_mega.families.Architecture``
        (head_dim, q/k norms; None: Llama shaped by the config alone). ``reward_model``: the shape
        of reward.model_path's checkpoint (None: no reward model, or none to read here). ``model``:
        the model section completed from the checkpoint (the trainer's; default cfg.model)."""
        m = cfg.model if model is None else model
        ar = cfg.actor_rollout
        return cls(
            model=DecoderShape.from_model_config(m, arch),
            tp=cfg.parallel.tensor_model_parallel_size,
            pp=cfg.parallel.pipeline_model_parallel_size,
            seq_len=cfg.data.max_prompt_length + cfg.algorithm.max_response_length,
            max_prompt_length=cfg.data.max_prompt_length,
            max_response_length=cfg.algorithm.max_response_length,
            max_position_embeddings=m.max_position_embeddings,
            rollout_samples=cfg.training.rollout_batch_size * ar.n_samples_per_prompt,
            mini_batch=cfg.training.batch_size,
            micro_batch_size=cfg.training.micro_batch_size,
            max_tokens_per_micro_batch=cfg.training.max_tokens_per_micro_batch if cfg.training.use_dynamic_bsz
            else None,
            gpu_memory_utilization=ar.gpu_memory_utilization,
            use_pf_ppo=cfg.algorithm.use_pf_ppo,
            pool_size=cfg.algorithm.pool.pool_size,
            reward_model=reward_model,
            critic=ADV_ESTIMATORS.get(cfg.algorithm.adv_estimator).needs_critic,
            rollout_tp=ar.tensor_model_parallel_size,
            engine_dtype=m.params_dtype if ar.dtype == "auto" else ar.dtype,
            sleep_level=ar.sleep_level,
            params_dtype=m.params_dtype,
            engine=ar.engine,
            max_num_seqs=ar.max_num_seqs,
            refit_bucket_bytes=max(1, int(ar.refit_bucket_mb * MiB)),
            # LoRA: the reference is the actor's base (no copy); the rank of an adapter_path-only run is
            # read from its file at start, so the planner counts rank 0 (full training) for it
            reference=not m.lora.rank,
            lora_rank=m.lora.rank,
            lora_targets=lora_targets(list(m.lora.target_modules)) if m.lora.rank else (),
        )


def reward_model_shape(path):
    """The DecoderShape of reward.model_path's config.json (None: no reward model, or none here);
    read with the models' HF reader, imported here only when there is one (the planner imports no torch)."""
    from pathlib import Path

    if path is None or not (Path(path) / "config.json").is_file():
        return None
    from pfppo_mega.config.tree import ModelConfig
    from pfppo_mega.families import ModelDirError, DecoderShape, architecture_from_hf
    from pfppo_mega.models.hf_io import model_config_from_hf, read_hf_config

    try:  # its keys' problems are the reward model's, not the policy's: say whose file it is
        hf = read_hf_config(path)
        return DecoderShape.from_model_config(model_config_from_hf(hf, ModelConfig()), architecture_from_hf(hf))
    except ModelDirError as e:
        raise ModelDirError(f"reward.model_path {str(path)!r}: {e}") from None


def micro_batching(run: RunShape, knobs: Knobs, dp: int) -> tuple[int, int]:
    """(micro-batch b, micro-batches per mini-batch per DP rank m): the flag, else
    training.micro_batch_size, else the whole mini-batch per DP rank. With a token budget
    (training.use_dynamic_bsz) a micro-batch holds at most max_tokens_per_micro_batch tokens (rows x
    its longest row; a longer row runs alone): its activations are those of max(1, budget // seq_len)
    rows at full length, the worst case (capped by training.micro_batch_size when set)."""
    per_rank = max(1, run.mini_batch // dp)
    if knobs.micro_batch is None and run.max_tokens_per_micro_batch is not None:
        b = min(max(1, run.max_tokens_per_micro_batch // run.seq_len), run.micro_batch_size or per_rank, per_rank)
    else:
        b = knobs.micro_batch or run.micro_batch_size or per_rank
    return b, max(1, run.mini_batch // (dp * b))


# ----------------------------------------------------------------------------- one rank's holdings


@dataclass(frozen=True)
class Holding:
    name: str
    bytes: float
    formula: str


@dataclass(frozen=True)
class RankHoldings:
    """Every byte figure of one rank (pipeline stage ``pp_rank``) that the ledger moves around."""

    pp_rank: int
    actor_params: int
    critic_params: int
    trainer: tuple[Holding, ...]        # actor / critic states, reference and reward-model weights
    late: str                           # the trainer holding offloaded last (the weights a refit reads)
    engine_weights: Holding
    engine_kv: Holding                  # kv_mode "utilization": its bytes depend on the capacity (kv_for)
    kv_mode: str
    engine_workspace: Holding
    engine_on_device: bool              # False: the built-in engine on a GPU machine runs on the CPU
    engine_sleeps: bool                 # vLLM on a GPU; a CPU engine keeps everything
    sleep_level: int
    refit_slots: Holding                # on the communicator's device from a frame's first refit to sleep
    refit_gather: Holding               # one bucket made by its producer (transient)
    reserve: Holding
    prepare: Holding                    # forward working set (transient)
    update: Holding                     # the larger update's activations (transient)
    update_model: str                   # "actor" | "critic"
    pool: Optional[Holding]             # this rank's share of the PF-PPO pool (host)
    host_reserve: Holding               # this rank's share of the node's host reserve
    offload: bool
    kv_per_token: float = 0.0
    util: float = 0.0
    kept: tuple[str, ...] = ()          # trainer holdings no offload moves (a reward model stays on the device)
    discarded: tuple[str, ...] = ()     # trainer holdings the offload frees without a host copy (the grads)

    def kv_for(self, capacity: Optional[float]) -> Holding:
        """The KV cache at this capacity: utilization x capacity - weights - workspace (vLLM on a GPU)."""
        if self.kv_mode != "utilization":
            return self.engine_kv
        if capacity is None:
            raise ValueError("a KV cache sized by gpu_memory_utilization needs the card's capacity")
        kv = self.util * capacity - self.engine_weights.bytes - self.engine_workspace.bytes
        return replace(self.engine_kv, bytes=kv)


def _train_state(prefix: str, n: int, dp: int, distributed: bool, dtype: str) -> list[Holding]:
    shard = dp if distributed else 1
    how = f"/ dp({dp}), distributed optimizer" if distributed else "(not sharded)"
    w = DTYPE_BYTES[dtype]
    opt = BYTES_ADAM + (0 if dtype == "float32" else BYTES_MAIN)
    what = "Adam moments" if dtype == "float32" else "main weights + Adam moments"
    return [
        Holding(f"{prefix} weights ({SHORT[dtype]})", w * n, f"{w} B x {n / 1e9:.3f} B params on this rank"),
        Holding(f"{prefix}{GRADS}", BYTES_GRAD * n, "4 B x params (fp32 grad buffer)"),
        Holding(f"{prefix} optimizer (fp32 x{opt // 4})", opt * n / shard, f"{opt} B x params ({what}) {how}"),
    ]


def _activations(run: RunShape, knobs: Knobs, layout: Layout, pp_rank: int, b: int, m: int, *,
                 logits: bool) -> tuple[float, str]:
    """Activation bytes of one model's update on stage ``pp_rank``: micro-batch b, m per step."""
    s, sh = run.seq_len, run.model
    sp = knobs.sequence_parallel and layout.tp > 1
    terms = layer_terms_for(knobs.layer, s=s, b=b, h=sh.hidden_size, a=sh.num_attention_heads,
                            g=sh.num_query_groups, f=sh.ffn_hidden_size, d=sh.head_dim, qk_norm=sh.arch.qk_norm)
    stored, transient = layer_bytes(terms, tp=layout.tp, sp=sp, recompute=knobs.recompute,
                                    s=s, b=b, h=sh.hidden_size)
    layers = len(stage_layers(sh.num_layers, layout.pp, pp_rank))
    k = in_flight_microbatches(layout.pp, pp_rank, m)
    total = k * layers * stored + transient
    formula = (f"{k} micro-batch(es) in flight x {layers} layers x {stored / MiB:.1f} MiB"
               f" + {transient / MiB:.0f} MiB recompute working set")
    if logits and pp_rank == layout.pp - 1:
        lg = 10 * s * b * sh.vocab_size / layout.tp
        total += lg
        formula += f" + logits 10 s b V/tp = {lg / MiB:.0f} MiB"
    return total, formula


def _forward(run: RunShape, knobs: Knobs, layout: Layout, pp_rank: int, b: int) -> tuple[float, str]:
    """A forward without grad (prepare's log-probs and values): one layer's working set at a time,
    and the last stage's logits with their fp32 log-softmax (6 s b V / tp)."""
    s, sh = run.seq_len, run.model
    sp = knobs.sequence_parallel and layout.tp > 1
    terms = layer_terms_for(knobs.layer, s=s, b=b, h=sh.hidden_size, a=sh.num_attention_heads,
                            g=sh.num_query_groups, f=sh.ffn_hidden_size, d=sh.head_dim, qk_norm=sh.arch.qk_norm)
    layer = layer_bytes(terms, tp=layout.tp, sp=sp, recompute="none", s=s, b=b, h=sh.hidden_size)[0]
    lg = 6 * s * b * sh.vocab_size / layout.tp if pp_rank == layout.pp - 1 else 0.0
    return layer + lg, f"one layer {layer / MiB:.1f} MiB + logits 6 s b V/tp {lg / MiB:.1f} MiB (no grad)"


def refit_buffers(run: RunShape, *, world: int) -> tuple[Holding, Holding]:
    """(the stream's ring slots, held until the engine sleeps; one produced bucket, transient) of a
    refit / switch / capture."""
    e = DTYPE_BYTES[run.engine_dtype]
    whole = e * total_param_count(run.model, "lm")  # no bucket holds more than the model
    biggest = max(min(run.refit_bucket_bytes, whole), largest_refit_group(run.model) * e)  # a group never splits
    size = -(-biggest // 8) * 8 + REFIT_TRAILER_BYTES
    slots = 0 if world == 1 else max(1, min(REFIT_MAX_AHEAD, REFIT_AHEAD_BYTES // size)) + 1
    return (Holding("refit stream slots (to sleep)", slots * size,
                    f"{slots} slots x {size / MiB:.1f} MiB (largest bucket: refit_bucket_mb or the largest "
                    f"fused group)" if slots else "one process: no broadcast"),
            Holding("refit bucket (transient)", biggest, "one bucket gathered by its producer"))


def _lora_state(base: int, adapters: int, dp: int, distributed: bool, dtype: str) -> list[Holding]:
    """The actor under LoRA: base and adapter weights, grads and optimizer states of the adapters only."""
    w = DTYPE_BYTES[dtype]
    frozen = Holding(f"actor weights ({SHORT[dtype]})", w * base,
                     f"{w} B x {base / 1e9:.3f} B params on this rank (frozen base: no grads, no optimizer state)")
    state = _train_state("actor LoRA adapters", adapters, dp, distributed, dtype)
    return [frozen, *state]


def rank_holdings(run: RunShape, knobs: Knobs, layout: Layout, pp_rank: int, rollout_tp: int, *,
                  gpus_per_node: int, nodes: int = 1, device: str = "cuda") -> RankHoldings:
    """Every holding of a rank on pipeline stage ``pp_rank`` (``device``: the trainer's device type;
    "cpu": the host is the device, no CUDA reserve, engines cannot sleep)."""
    sh = run.model
    b, m = micro_batching(run, knobs, layout.dp)
    na = stage_param_count(sh, layout.tp, layout.pp, pp_rank, "lm")
    nc = stage_param_count(sh, layout.tp, layout.pp, pp_rank, "value") if run.critic else 0
    dist_opt = knobs.distributed_optimizer
    if run.lora_rank:  # frozen base weights; adapters with grads and optimizer states (models/lora.py)
        nl = lora_param_count(sh, layout.tp, layout.pp, run.lora_rank, run.lora_targets)
        trainer = _lora_state(na, nl, layout.dp, dist_opt, run.params_dtype)
    else:
        trainer = _train_state("actor", na, layout.dp, dist_opt, run.params_dtype)
    if run.critic:
        trainer += _train_state("critic", nc, layout.dp, dist_opt, run.params_dtype)
    w = DTYPE_BYTES[run.params_dtype]
    if run.reference:
        trainer.append(Holding(f"reference weights ({SHORT[run.params_dtype]})", w * na,
                               f"{w} B x actor params on this rank (forward only)"))
    kept: tuple[str, ...] = ()
    if run.reward_model is not None:  # scalar head, same layout as the actor (rewards/model.py)
        nr = stage_param_count(run.reward_model, layout.tp, layout.pp, pp_rank, "value")
        trainer.append(Holding(f"reward model weights ({SHORT[run.params_dtype]})", w * nr,
                               f"{w} B x reward-model params on this rank (forward only)"))
        kept = (trainer[-1].name,)  # TrainerOffload moves the actor, critic and reference only
    act_a, f_a = _activations(run, knobs, layout, pp_rank, b, m, logits=True)
    act_c, f_c = _activations(run, knobs, layout, pp_rank, b, m, logits=False)
    which, act, formula = ("actor", act_a, f_a) if act_a >= act_c or not run.critic else ("critic", act_c, f_c)
    fwd, f_fwd = _forward(run, knobs, layout, pp_rank, b)

    e = DTYPE_BYTES[run.engine_dtype]
    ne = engine_param_count(sh, rollout_tp)
    kv_heads = sh.kv_heads(rollout_tp)
    per_token = 2 * sh.num_layers * kv_heads * sh.head_dim * e
    on_cuda = device == "cuda"
    vllm = run.engine == "vllm"
    workspace = knobs.rollout_workspace_gib * GiB if on_cuda else 0.0
    kv_how = f"2 x {sh.num_layers} layers x {kv_heads} KV heads x {sh.head_dim} x {e} B = {per_token / 1024:.0f} KiB per token"
    if vllm and on_cuda:
        kv_mode, kv = "utilization", Holding("engine KV cache", 0.0,
                                             f"gpu_memory_utilization({run.gpu_memory_utilization}) x GPU - weights - "
                                             f"workspace; {kv_how}")
    elif vllm:
        blocks = run.max_num_seqs * -(-run.seq_len // KV_BLOCK) + 1
        kv_mode, kv = "bytes", Holding("engine KV cache", blocks * KV_BLOCK * per_token,
                                       f"max_num_seqs({run.max_num_seqs}) x ceil({run.seq_len} / {KV_BLOCK}) + 1 blocks "
                                       f"of {KV_BLOCK} tokens; {kv_how}")
    else:  # built-in: a cache per generate call for the rows of this engine's share
        rows = ceil(run.rollout_samples / (layout.world_size // rollout_tp))
        kv_mode, kv = "per call", Holding("engine KV cache (per call)", rows * run.seq_len * per_token,
                                          f"{rows} rows x {run.seq_len} tokens; {kv_how}")
    engine_w = Holding(f"engine weights ({run.engine_dtype}, tp {rollout_tp})", e * ne,
                       f"{e} B x {ne / 1e9:.3f} B params per GPU")
    slots, gather = refit_buffers(run, world=layout.world_size)
    reserve = Holding("runtime reserve", knobs.reserve_gib * GiB if on_cuda else 0.0,
                      "CUDA context, NCCL communicators, allocator fragmentation (--reserve-gib)"
                      if on_cuda else "none on a CPU")
    pool = None
    if run.use_pf_ppo:
        full = e * total_param_count(sh, "lm")  # snapshots in the engine dtype
        if knobs.pool_placement == "node":
            share = min(1.0, gpus_per_node / rollout_tp)  # < 1 only when one engine replica spans nodes
            node_pool = run.pool_size * full * share
        else:
            node_pool = run.pool_size * full / nodes
        pool = Holding(f"PF-PPO pool share ({knobs.pool_placement})", node_pool / gpus_per_node,
                       f"pool_size({run.pool_size}) x full {run.engine_dtype} actor {full / GiB:.2f} GiB per node "
                       f"({knobs.pool_placement}) / {gpus_per_node} ranks")
    host_reserve = Holding("host reserve share", knobs.host_reserve_gib * GiB / gpus_per_node,
                           f"{knobs.host_reserve_gib:g} GiB per node / {gpus_per_node} ranks")
    return RankHoldings(
        pp_rank=pp_rank, actor_params=na, critic_params=nc, trainer=tuple(trainer), late=trainer[0].name, kept=kept,
        engine_weights=engine_w, engine_kv=kv, kv_mode=kv_mode,
        engine_workspace=Holding("engine workspace", workspace, "activations and sampler (--rollout-workspace-gib)"),
        engine_on_device=vllm or not on_cuda, engine_sleeps=vllm and on_cuda, sleep_level=run.sleep_level,
        refit_slots=slots, refit_gather=gather, reserve=reserve,
        prepare=Holding("activations (prepare forward)", fwd, f_fwd),
        update=Holding(f"activations ({which} update)", act, formula), update_model=which,
        pool=pool, host_reserve=host_reserve, offload=knobs.offload_during_rollout,
        kv_per_token=per_token, util=run.gpu_memory_utilization,
        discarded=tuple(x.name for x in trainer if x.name.endswith(GRADS)))


# ----------------------------------------------------------------------------- the ledger


@dataclass(frozen=True)
class PhaseRecord:
    """One phase as the ledger predicts it: what is on the device (resident + the phase's
    transient), what is in host memory, against the capacity; ``measured``: what the trainer saw
    there (trainer_bytes, cuda_allocated, cuda_peak), when it recorded any."""

    phase: str
    device: tuple[Holding, ...]
    host: tuple[Holding, ...]
    capacity: Optional[float]
    measured: dict = field(default_factory=dict)

    @property
    def device_bytes(self) -> float:
        return sum(h.bytes for h in self.device)

    @property
    def host_bytes(self) -> float:
        return sum(h.bytes for h in self.host)

    @property
    def over(self) -> float:
        return 0.0 if self.capacity is None else self.device_bytes - self.capacity

    def fits(self) -> bool:
        return self.over <= 0

    def trainer_bytes(self, holdings: RankHoldings) -> float:
        names = {h.name for h in holdings.trainer}
        return sum(h.bytes for h in self.device if h.name in names)


class LedgerOverflow(RuntimeError):
    """The ledger predicts more device bytes than the card holds at a phase."""


class Ledger:
    """The colocated step's memory, phase by phase, for one rank. ``enter(phase)`` applies the
    phase's moves and records it; with ``check`` and a capacity, a phase that does not fit raises
    LedgerOverflow (the planner replays without checking and reports instead)."""

    def __init__(self, holdings: RankHoldings, capacity: Optional[float], *, check: bool = True) -> None:
        self.h, self.capacity, self.check = holdings, capacity, check
        self.kv = holdings.kv_for(capacity) if holdings.kv_mode != "utilization" or capacity else holdings.engine_kv
        self.device: dict[str, Holding] = {holdings.reserve.name: holdings.reserve}
        self.host: dict[str, Holding] = {holdings.host_reserve.name: holdings.host_reserve}
        if holdings.pool is not None:
            self.host[holdings.pool.name] = holdings.pool
        self.offloaded: list[str] = []
        self.records: list[PhaseRecord] = []

    # what the engine's memory is where
    def _engine_place(self) -> dict[str, Holding]:
        return self.device if self.h.engine_on_device else self.host

    def _move_out(self, names: list[str]) -> None:
        for name in names:
            if name in self.device:
                held = self.device.pop(name)
                self.offloaded.append(name)
                if name in self.h.discarded:  # freed, no host copy: zeroed on reload
                    continue
                # TrainerOffload keeps its host buffers after a reload: counted from the first offload on
                self.host.setdefault("offloaded " + name, Holding("offloaded " + name, held.bytes, held.formula))

    def enter(self, phase: str, **measured) -> PhaseRecord:
        if phase not in PHASES:
            raise ValueError(f"ledger phase {phase!r} must be one of {sorted(PHASES)}")
        h, transient = self.h, []
        engine = self._engine_place()
        if phase == "build trainer":
            self.device.update((x.name, x) for x in h.trainer)
        elif phase == "offload trainer" and h.offload:
            self._move_out([x.name for x in h.trainer if x.name != h.late and x.name not in h.kept])
        elif phase == "offload actor weights" and h.offload:
            self._move_out([h.late])
        elif phase == "build engine":  # the engine starts awake; vLLM profiles its workspace there
            engine[h.engine_weights.name] = h.engine_weights
            if h.kv_mode != "per call":
                engine[self.kv.name] = self.kv
            if h.engine_on_device:
                transient.append(h.engine_workspace)
        elif phase == "wake weights":
            self.host.pop("sleeping " + h.engine_weights.name, None)  # vLLM frees its CPU backup at wake
            engine[h.engine_weights.name] = h.engine_weights
        elif phase in ("refit", "switch"):
            if h.refit_slots.bytes:
                self.device[h.refit_slots.name] = h.refit_slots  # kept for the frame's next stream
            transient.append(h.refit_gather)
        elif phase == "wake kv cache":
            if h.kv_mode != "per call":
                engine[self.kv.name] = self.kv
        elif phase == "generate" and h.engine_on_device:  # (a CPU engine's working memory is the host's)
            transient.append(h.engine_workspace)
            if h.kv_mode == "per call":
                transient.append(self.kv)
        elif phase == "sleep":
            self.device.pop(h.refit_slots.name, None)  # freed on every device (EngineSync.release_buffers)
            weights = None
            if h.engine_sleeps:
                engine.pop(self.kv.name, None)
                weights = engine.pop(h.engine_weights.name, None)
            if weights is not None and h.sleep_level == 1:
                self.host["sleeping " + weights.name] = Holding("sleeping " + weights.name, weights.bytes, weights.formula)
        elif phase == "reload trainer":
            for name in self.offloaded:
                self.device[name] = next(x for x in h.trainer if x.name == name)
            self.offloaded = []
        elif phase == "prepare":
            transient.append(h.prepare)
        elif phase == "update":
            transient.append(h.update)
        rec = PhaseRecord(phase, tuple(self.device.values()) + tuple(x for x in transient if x.bytes),
                          tuple(self.host.values()), self.capacity, dict(measured))
        self.records.append(rec)
        if self.check and not rec.fits():
            raise LedgerOverflow(overflow_message(rec))
        return rec

    def replay(self, phases) -> list[PhaseRecord]:
        return [self.enter(p) for p in phases]


# what to change when a phase does not fit (config keys)
REMEDY = {
    "update": "training.micro_batch_size, training.recompute, parallel.use_distributed_optimizer or a longer pipeline",
    "prepare": "training.micro_batch_size",
    "generate": "actor_rollout.gpu_memory_utilization, training.offload_during_rollout",
    "wake kv cache": "actor_rollout.gpu_memory_utilization, training.offload_during_rollout",
    "build engine": "actor_rollout.gpu_memory_utilization, training.offload_during_rollout",
    "refit": "actor_rollout.refit_bucket_mb, actor_rollout.tensor_model_parallel_size",
    "switch": "actor_rollout.refit_bucket_mb, actor_rollout.tensor_model_parallel_size",
}


def overflow_message(rec: PhaseRecord) -> str:
    parts = ", ".join(f"{x.name} {x.bytes / GiB:.3f}" for x in sorted(rec.device, key=lambda x: -x.bytes))
    fix = REMEDY.get(rec.phase, "the order of the calls (this phase should not hold this much)")
    return (f"device memory ledger: phase {rec.phase!r} needs {rec.device_bytes / GiB:.3f} GiB "
            f"({int(rec.device_bytes)} B) of the card's {rec.capacity / GiB:.3f} GiB ({int(rec.capacity)} B), over by "
            f"{rec.over / GiB:.3f} GiB; on the device (GiB): {parts}. Keys that change it: {fix}")


def min_capacity(holdings: RankHoldings, phases) -> float:
    """The smallest card on which ``phases`` fit: each phase needs its device bytes; with a
    utilization-sized KV cache awake they grow as util x capacity, so such a phase needs
    (bytes at capacity 1 - util) / (1 - util)."""
    util = holdings.util if holdings.kv_mode == "utilization" else 0.0
    probe = Ledger(holdings, 1.0 if util else None, check=False)
    need = 0.0
    for rec in probe.replay(phases):
        awake = util and any(x.name == holdings.engine_kv.name for x in rec.device)
        need = max(need, (rec.device_bytes - util) / (1 - util) if awake else rec.device_bytes)
    return need
