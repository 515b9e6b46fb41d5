"""Per-GPU and per-node memory of a colocated PPO / PF-PPO run, from the config and the hardware.

What lives where (the colocation this planner assumes, as verl's "hybrid engine" does): every
GPU of the job holds a shard of each of the four models and the run alternates two phases.

- Training phase (reference / critic forwards, actor and critic updates): the actor and critic
  train states (bf16 weights, fp32 grads, fp32 Adam states), the reference policy's bf16 weights
  and a reward model's (``reward.model_path``, scalar head), all in the megatron layout
  tp x pp x dp; the activations of the one update running (the actor's and the critic's updates
  are sequential, so the larger counts). The rollout engine sleeps (``actor_rollout.sleep_level``):
  level 2 frees its KV cache and discards its weights (the next weight sync refills them); level 1
  frees the KV cache and moves its weights to host memory (counted per node in the host budget).
- Rollout phase: the rollout engine, one replica per ``actor_rollout.tensor_model_parallel_size``
  GPUs, claims ``gpu_memory_utilization`` of each GPU for its weights and KV cache in the engine
  dtype (``actor_rollout.dtype``; auto = ``model.params_dtype``), a workspace and the KV cache. The trainer's states are offloaded to host memory (``offload_during_rollout``);
  without offload they stay and the engine must fit beside them.
- Host, per node: the offloaded trainer states of the node's GPUs, the PF-PPO snapshot pool and
  a fixed reserve. Pool placement "node" (default): each node keeps every snapshot whole in the
  engine's layout (each engine replica spans one node, so switching the behaviour policy is a
  host-to-GPU copy with no network); "sharded": each node keeps 1/nodes of each snapshot and a
  switch all-gathers it over the network.

Bytes per parameter (mixed precision with megatron DDP, grad_reduce_in_fp32 as in
``pfppo_mega.models.gpt.wrap_ddp``): weights 2 (bf16), grads 4 (fp32 grad buffer, not sharded),
optimizer 12 (fp32 main copy + Adam exp_avg + exp_avg_sq), divided by dp with the distributed
optimizer. Megatron keeps the local spec's RMSNorm weights in fp32; counted at 2 bytes (they
are 2h per layer: < 0.003% of the weights).

Activations: per decoder layer and micro-batch, following the accounting of Korthikanti et al.,
"Reducing Activation Recomputation in Large Transformer Models" (2022), which gives
s b h (34 + 5 a s / h) bytes for a GPT layer (GeLU MLP 4h wide, dropout), and with tensor
parallelism t: s b h (10 + 24/t + 5 a s / (h t)); with sequence parallelism: s b h (34 + 5 a s / h) / t;
with selective (core attention) recompute: 34 s b h / t; with full recompute: 2 s b h (/ t with SP).
The same accounting for this project's Llama layer (RMSNorm, GQA with g KV heads of size d,
SwiGLU MLP of width f, no dropout), bytes of bf16 values unless marked fp32:

    norm inputs 2 x 2sbh, QKV input 2sbh, fc1 input 2sbh        replicated over TP (split with SP)
    Q 2sbh, out-proj input 2sbh                                 split over TP
    K, V  layer "local": 2 x 2sbh (megatron's unfused attention repeats the g KV heads to a)
          layer "fused": 2 x 2sbgd
    core  layer "local": softmax output in fp32 4as^2b + its bf16 copy 2as^2b   split over TP,
          layer "fused": flash attention, fp32 log-sum-exp 4asb                 dropped by selective
    MLP   layer "local": [gate; up] 4sbf, silu(gate) 2sbf, up + glu_linear_offset 2sbf,
                         fc2 input 2sbf = 10sbf (megatron 0.16.1's unfused glu)
          layer "fused": [gate; up] 4sbf, fc2 input 2sbf = 6sbf (fused SwiGLU keeps its input)

Layer "local" is what ``pfppo_mega.models`` builds (megatron's local spec, attention_softmax_in_fp32,
bias_activation_fusion off); tests/test_plan.py measures megatron's own TransformerLayer on the CPU
with autograd's saved-tensor hooks and finds exactly these terms, except the norms: the CPU build
of torch keeps fp32 intermediates of RMSNorm (8sbh per norm, not 2sbh). On GPUs the norms are
assumed fused (input kept, 2sbh) -- not measured here. ``layer_activation_terms`` also takes the
paper's GPT layer (``mlp="gelu", dropout=True, softmax_fp32=False``: 34 + 5as/h, checked against
the paper's equations). On a pipeline stage with 1F1B scheduling and m micro-batches per step,
stage k keeps min(pp - k, m) micro-batches in flight, each with the stage's L/pp layers. The
actor's last stage also holds the logits [s, b, V/tp]: bf16 logits 2 + fp32 log-softmax 4 + fp32
gradient 4 = 10 s b V / tp bytes.

KV cache of the rollout engine, per GPU: 2 (K and V) x L x max(1, g / rollout_tp) x d x e bytes
per token (e: the engine dtype's bytes, 2 bf16 / 4 fp32); the engine's budget is gpu_memory_utilization x GPU memory - weights - workspace.

Only the standard library is imported here (and ``shapes``, ``pfppo_mega.families``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from math import ceil
from typing import Optional

from pfppo_mega.families import DecoderShape
from pfppo_mega.registry import ADV_ESTIMATORS
from pfppo_mega.planning.shapes import (
    Layout, engine_param_count, layout_problems, rank_coords, stage_layers,
    stage_param_count, total_param_count,
)

GiB = 2 ** 30
MiB = 2 ** 20

RECOMPUTE = ("none", "selective", "full")
POOL_PLACEMENT = ("node", "sharded")

BYTES_WEIGHT = 2       # bf16
BYTES_GRAD = 4         # fp32 grad buffer (grad_reduce_in_fp32)
BYTES_OPTIMIZER = 12   # fp32 main params + Adam exp_avg + exp_avg_sq
DTYPE_BYTES = {"bfloat16": 2, "float32": 4}  # the rollout engine's weights and KV cache


# ----------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class GpuSpec:
    """A GPU model: memory as nvidia-smi reports it (MiB), and the host memory of its usual node."""

    name: str
    memory_mib: int
    host_memory_gib: int


# nvidia-smi "memory.total": H100 SXM5 80GB 81559 MiB, H200 SXM 141GB 143771 MiB (vendor figures,
# not measured here). Host: 2 TiB, as in NVIDIA's DGX H100 / DGX H200 nodes.
GPUS: dict[str, GpuSpec] = {
    "h100": GpuSpec("H100 80GB", 81559, 2048),
    "h200": GpuSpec("H200 141GB", 143771, 2048),
}


@dataclass(frozen=True)
class Hardware:
    gpu: str
    gpu_memory: int       # bytes per GPU
    nodes: int
    gpus_per_node: int
    host_memory: int      # bytes per node

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @classmethod
    def preset(cls, gpu: str, *, nodes: int, gpus_per_node: int, gpu_memory_gib: Optional[float] = None,
               host_memory_gib: Optional[float] = None) -> "Hardware":
        if gpu not in GPUS:
            raise ValueError(f"gpu({gpu!r}) must be one of {', '.join(map(repr, GPUS))}")
        spec = GPUS[gpu]
        mem = int(gpu_memory_gib * GiB) if gpu_memory_gib else spec.memory_mib * MiB
        host = int((host_memory_gib or spec.host_memory_gib) * GiB)
        return cls(spec.name, mem, nodes, gpus_per_node, host)


@dataclass(frozen=True)
class Knobs:
    """The training features (config keys: ``Knobs.from_config``) and the runtime choices the
    config tree does not hold (flags)."""

    micro_batch: Optional[int] = None   # None: the config's training.micro_batch_size
    recompute: str = "selective"
    sequence_parallel: bool = False
    layer: str = "local"                # local: as pfppo_mega.models builds it; fused: flash + fused SwiGLU
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
        model.layer_spec, parallel.use_distributed_optimizer, training.offload_during_rollout);
        ``flags``: the runtime choices (micro_batch, rollout_tp override, reserves, pool placement)."""
        requested = flags.pop("offload_during_rollout", True)  # popped whatever the config says
        offload = offload_from_config(cfg) and requested
        return cls(recompute=cfg.training.recompute, sequence_parallel=cfg.parallel.sequence_parallel,
                   layer="fused" if cfg.model.layer_spec == "transformer_engine" else "local",
                   distributed_optimizer=cfg.parallel.use_distributed_optimizer, offload_during_rollout=offload,
                   **flags)


def offload_from_config(cfg) -> bool:
    """training.offload_during_rollout as the trainer applies it on GPUs (null: on): the rollout
    phase then keeps none of the trainer's states on the GPU (pfppo_mega.trainer.offload)."""
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
    reference: bool              # a reference policy is kept (kl_coeff > 0)
    reward_model: Optional[DecoderShape] = None  # reward.model_path's shape: forward-only weights on the actor's ranks
    critic: bool = True          # the advantage estimator needs a critic (GAE); else none is built
    rollout_tp: Optional[int] = None  # actor_rollout.tensor_model_parallel_size; None: GPUs per node
    engine_dtype: str = "bfloat16"    # actor_rollout.dtype resolved (auto -> model.params_dtype)
    sleep_level: int = 2              # actor_rollout.sleep_level: 1 keeps engine weights in host memory

    @classmethod
    def from_config(cls, cfg, arch=None, reward_model: Optional[DecoderShape] = None) -> "RunShape":
        """From a ``pfppo_mega.config.Config`` and the checkpoint's ``pfppo_mega.families.Architecture``
        (head_dim, q/k norms; None: Llama shaped by the config alone). ``reward_model``: the shape
        of reward.model_path's checkpoint (None: no reward model, or none to read here)."""
        m = cfg.model
        return cls(
            model=DecoderShape.from_model_config(m, arch),
            tp=cfg.parallel.tensor_model_parallel_size,
            pp=cfg.parallel.pipeline_model_parallel_size,
            seq_len=cfg.data.max_prompt_length + cfg.algorithm.max_response_length,
            max_prompt_length=cfg.data.max_prompt_length,
            max_response_length=cfg.algorithm.max_response_length,
            max_position_embeddings=m.max_position_embeddings,
            rollout_samples=cfg.training.rollout_batch_size * cfg.actor_rollout.n_samples_per_prompt,
            mini_batch=cfg.training.batch_size,
            micro_batch_size=cfg.training.micro_batch_size,
            gpu_memory_utilization=cfg.actor_rollout.gpu_memory_utilization,
            use_pf_ppo=cfg.algorithm.use_pf_ppo,
            pool_size=cfg.algorithm.pool.pool_size,
            reference=cfg.algorithm.kl_coeff > 0,
            reward_model=reward_model,
            critic=ADV_ESTIMATORS.get(cfg.algorithm.adv_estimator).needs_critic,
            rollout_tp=cfg.actor_rollout.tensor_model_parallel_size,
            engine_dtype=m.params_dtype if cfg.actor_rollout.dtype == "auto" else cfg.actor_rollout.dtype,
            sleep_level=cfg.actor_rollout.sleep_level,
        )


# ----------------------------------------------------------------------------- activations


@dataclass(frozen=True)
class LayerActivations:
    """Bytes one decoder layer keeps for backward, per micro-batch, before any parallel split.

    replicated: split over TP only with sequence parallelism; split: always split over TP;
    core: the attention core's s^2 terms (split over TP; dropped by selective recompute)."""

    replicated: float
    split: float
    core: float


def layer_activation_terms(*, s: int, b: int, h: int, a: int, g: int, f: int,
                           attention: str = "unfused", softmax_fp32: bool = True,
                           mlp: str = "swiglu_unfused", dropout: bool = False,
                           d: Optional[int] = None, qk_norm: bool = False) -> LayerActivations:
    """Korthikanti et al.'s per-layer accounting (see the module docstring), in bytes.

    s sequence, b micro-batch, h hidden, a heads, g KV groups, f MLP width, d head_dim (None:
    h / a; Qwen3 sets it, so Q, K, V and the out-proj input are a d wide, not h), qk_norm: the
    q/k RMSNorm inputs (Qwen3) are kept too.
    attention "unfused": K and V kept for all a heads, softmax output kept (fp32 when
    softmax_fp32, plus its bf16 copy); "flash": K and V for g heads, a log-sum-exp, no s^2 term.
    mlp "gelu" (paper), "swiglu" (fused activation) or "swiglu_unfused" (megatron 0.16.1's glu).
    mlp="gelu", dropout=True, softmax_fp32=False with g = a, f = 4h is the paper's GPT layer:
    s b h (34 + 5 a s / h)."""
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
    if attention == "unfused":
        split += 2 * 2 * sbq                           # K and V, repeated to a heads
        core = (4 + 2 if softmax_fp32 else 2) * a * s * s * b  # softmax output (+ bf16 copy)
        if dropout:
            core += a * s * s * b + 2 * a * s * s * b  # dropout mask, dropout output
    elif attention == "flash":
        split += 2 * 2 * s * b * g * d + 4 * a * s * b  # K and V for g heads, fp32 log-sum-exp
        core = 0
    else:
        raise ValueError(f"attention({attention!r}) must be 'unfused' or 'flash'")
    return LayerActivations(float(replicated), float(split), float(core))


LAYERS = ("local", "fused")


def layer_terms_for(layer: str, *, s: int, b: int, h: int, a: int, g: int, f: int,
                    d: Optional[int] = None, qk_norm: bool = False) -> LayerActivations:
    """The Llama layer as built by pfppo_mega.models ("local") or with fused kernels ("fused")."""
    if layer == "local":
        return layer_activation_terms(s=s, b=b, h=h, a=a, g=g, f=f, attention="unfused",
                                      softmax_fp32=True, mlp="swiglu_unfused", d=d, qk_norm=qk_norm)
    if layer == "fused":
        return layer_activation_terms(s=s, b=b, h=h, a=a, g=g, f=f, attention="flash", mlp="swiglu",
                                      d=d, qk_norm=qk_norm)
    raise ValueError(f"layer({layer!r}) must be one of {LAYERS}")


def layer_bytes(t: LayerActivations, *, tp: int, sp: bool, recompute: str, s: int, b: int, h: int) -> tuple[float, float]:
    """(bytes stored per layer per micro-batch, transient bytes while one layer is recomputed).

    none: everything; selective: all but the core (recomputed in backward, one layer at a time);
    full: the layer input 2sbh only (the whole layer is recomputed, one at a time)."""
    rep_div = tp if sp else 1
    everything = t.replicated / rep_div + t.split / tp + t.core / tp
    if recompute == "none":
        return everything, 0.0
    if recompute == "selective":
        return t.replicated / rep_div + t.split / tp, t.core / tp
    if recompute == "full":
        return 2 * s * b * h / rep_div, everything
    raise ValueError(f"recompute({recompute!r}) must be one of {RECOMPUTE}")


def in_flight_microbatches(pp: int, pp_rank: int, num_microbatches: int) -> int:
    """Micro-batches whose activations stage ``pp_rank`` holds at the peak of a 1F1B schedule."""
    return min(pp - pp_rank, num_microbatches)


# ----------------------------------------------------------------------------- results


@dataclass(frozen=True)
class Component:
    name: str
    bytes: float
    formula: str


@dataclass
class Budget:
    """Memory of one place (a GPU in one phase, or a node's host RAM) against its capacity."""

    title: str
    capacity: float
    components: list[Component]
    note: str = ""

    @property
    def total(self) -> float:
        return sum(c.bytes for c in self.components)

    @property
    def over(self) -> float:
        """Bytes beyond the capacity (<= 0 when it fits)."""
        return self.total - self.capacity

    def fits(self) -> bool:
        return self.over <= 0


@dataclass
class KVCache:
    bytes_per_token: float          # per GPU
    budget: float                   # bytes per GPU for the KV cache
    tokens: int                     # per engine replica (each GPU holds its heads of every token)
    seq_len: int
    sequences: int                  # concurrent full-length sequences per replica
    replicas: int
    rollout_sequences_per_replica: int
    waves: int                      # rounds of generation the rollout batch needs per replica


@dataclass
class StageMemory:
    pp_rank: int
    actor_params: int
    critic_params: int
    train: Budget


@dataclass
class Plan:
    run: RunShape
    hardware: Hardware
    knobs: Knobs
    layout: Layout
    rollout_tp: int
    actor_params_total: int
    critic_params_total: int
    micro_batch: int
    num_microbatches: int
    bubble: float
    stages: list[StageMemory]
    worst_stage: int
    rollout: Budget
    kv: KVCache
    host: Budget
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def train(self) -> Budget:
        return self.stages[self.worst_stage].train

    def fits(self) -> bool:
        return not self.problems

    def to_json(self) -> dict:
        def budget(b: Budget) -> dict:
            return {"title": b.title, "capacity_gib": b.capacity / GiB, "total_gib": b.total / GiB,
                    "over_gib": b.over / GiB, "fits": b.fits(), "note": b.note,
                    "components": [{"name": c.name, "gib": c.bytes / GiB, "bytes": int(c.bytes),
                                    "formula": c.formula} for c in b.components]}
        return {
            "fits": self.fits(),
            "problems": self.problems,
            "notes": self.notes,
            "hardware": asdict(self.hardware) | {"gpu_memory_gib": self.hardware.gpu_memory / GiB,
                                                 "host_memory_gib": self.hardware.host_memory / GiB},
            "knobs": asdict(self.knobs) | {"rollout_tp": self.rollout_tp},
            "layout": asdict(self.layout) | {"world_size": self.layout.world_size},
            "run": asdict(self.run),
            "params": {"actor_total": self.actor_params_total, "critic_total": self.critic_params_total,
                       "per_stage": [{"pp_rank": st.pp_rank, "actor": st.actor_params,
                                      "critic": st.critic_params} for st in self.stages]},
            "micro_batch": self.micro_batch,
            "num_microbatches": self.num_microbatches,
            "pipeline_bubble": self.bubble,
            "worst_stage": self.worst_stage,
            "gpu_train_phase": [budget(st.train) | {"pp_rank": st.pp_rank} for st in self.stages],
            "gpu_rollout_phase": budget(self.rollout),
            "kv_cache": asdict(self.kv),
            "host_per_node": budget(self.host),
        }


# ----------------------------------------------------------------------------- the plan


def _gib(x: float) -> str:
    return f"{x / GiB:.2f} GiB"


def _train_state(prefix: str, n: int, dp: int, distributed: bool) -> list[Component]:
    shard = dp if distributed else 1
    how = f"/ dp({dp}), distributed optimizer" if distributed else "(not sharded)"
    return [
        Component(f"{prefix} weights (bf16)", BYTES_WEIGHT * n, f"2 B x {n / 1e9:.3f} B params on this rank"),
        Component(f"{prefix} grads (fp32)", BYTES_GRAD * n, "4 B x params (fp32 grad buffer)"),
        Component(f"{prefix} optimizer (fp32 x3)", BYTES_OPTIMIZER * n / shard,
                  f"12 B x params {how}"),
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


def _check_inputs(run: RunShape, hw: Hardware, knobs: Knobs) -> tuple[Layout, int]:
    """(megatron layout, rollout engine TP); raises ValueError on a layout that cannot be built."""
    sh = run.model
    if hw.world_size % (run.tp * run.pp):
        raise ValueError(f"tp({run.tp}) * pp({run.pp}) = {run.tp * run.pp} does not divide the world size "
                         f"nodes({hw.nodes}) x gpus_per_node({hw.gpus_per_node}) = {hw.world_size}")
    layout = Layout.for_world(hw.world_size, run.tp, run.pp)
    shape_errors = layout_problems(sh, layout)
    if shape_errors:
        raise ValueError("layout does not divide the model: " + "; ".join(shape_errors))
    rm_errors = [] if run.reward_model is None else layout_problems(run.reward_model, layout)
    if rm_errors:  # it is built on the actor's ranks with the actor's layout
        raise ValueError("layout does not divide the reward model (reward.model_path): " + "; ".join(rm_errors))
    if knobs.micro_batch is not None and knobs.micro_batch < 1:
        raise ValueError(f"micro_batch({knobs.micro_batch}) must be >= 1")
    for key, value, allowed in (("recompute", knobs.recompute, RECOMPUTE), ("layer", knobs.layer, LAYERS),
                                ("pool_placement", knobs.pool_placement, POOL_PLACEMENT)):
        if value not in allowed:
            raise ValueError(f"{key}({value!r}) must be one of {allowed}")
    rt = knobs.rollout_tp or run.rollout_tp or hw.gpus_per_node  # an explicit flag, else the config
    if run.engine_dtype not in DTYPE_BYTES:
        raise ValueError(f"engine dtype({run.engine_dtype!r}) must be one of {tuple(DTYPE_BYTES)}")
    if hw.world_size % rt or sh.num_attention_heads % rt:
        raise ValueError(f"rollout_tp({rt}) must divide the world size ({hw.world_size}) and "
                         f"num_attention_heads({sh.num_attention_heads})")
    return layout, rt


def _trained(run: RunShape) -> str:
    return "actor + critic" if run.critic else "actor"


def _is_trainer_state(c: Component) -> bool:
    return c.name.startswith(("actor", "critic", "reference", "reward model"))


def _training_phase(run: RunShape, hw: Hardware, knobs: Knobs, layout: Layout, b: int, m: int,
                    reserve: Component) -> list[StageMemory]:
    """One GPU budget per pipeline stage: train states, reference, the larger update's activations."""
    sh, stages = run.model, []
    for k in range(layout.pp):
        na = stage_param_count(sh, layout.tp, layout.pp, k, "lm")
        nc = stage_param_count(sh, layout.tp, layout.pp, k, "value") if run.critic else 0
        comps = _train_state("actor", na, layout.dp, knobs.distributed_optimizer)
        if run.critic:
            comps += _train_state("critic", nc, layout.dp, knobs.distributed_optimizer)
        if run.reference:
            comps.append(Component("reference weights (bf16)", BYTES_WEIGHT * na,
                                   "2 B x actor params on this rank (forward only)"))
        if run.reward_model is not None:  # scalar head, same layout as the actor (rewards/model.py)
            nr = stage_param_count(run.reward_model, layout.tp, layout.pp, k, "value")
            comps.append(Component("reward model weights (bf16)", BYTES_WEIGHT * nr,
                                   "2 B x reward-model params on this rank (forward only)"))
        act_a, f_a = _activations(run, knobs, layout, k, b, m, logits=True)
        act_c, f_c = _activations(run, knobs, layout, k, b, m, logits=False)
        which, act, formula = ("actor", act_a, f_a) if act_a >= act_c or not run.critic else ("critic", act_c, f_c)
        comps += [Component(f"activations ({which} update)", act, formula), reserve]
        title = f"GPU, training phase, pipeline stage {k} of {layout.pp}"
        asleep = ("rollout engine asleep (KV freed, weights dropped)" if run.sleep_level == 2 else
                  "rollout engine asleep (KV freed, weights in host memory)")
        budget = Budget(title, hw.gpu_memory, comps, asleep)
        stages.append(StageMemory(k, na, nc, budget))
    return stages


def _rollout_phase(run: RunShape, hw: Hardware, knobs: Knobs, rt: int, trainer_states: float,
                   reserve: Component) -> tuple[Budget, KVCache]:
    """The engine's weights, workspace and KV cache (+ the trainer's states without offload)."""
    sh, util = run.model, run.gpu_memory_utilization
    ne = engine_param_count(sh, rt)
    e = DTYPE_BYTES[run.engine_dtype]
    engine_w = e * ne
    kv_heads = sh.kv_heads(rt)
    per_token = 2 * sh.num_layers * kv_heads * sh.head_dim * e
    workspace = knobs.rollout_workspace_gib * GiB
    kv_budget = util * hw.gpu_memory - engine_w - workspace
    tokens = max(0, int(kv_budget // per_token))
    replicas = hw.world_size // rt
    per_replica = ceil(run.rollout_samples / replicas)
    concurrent = tokens // run.seq_len
    waves = ceil(per_replica / concurrent) if concurrent else 0
    kv = KVCache(per_token, kv_budget, tokens, run.seq_len, concurrent, replicas, per_replica, waves)
    comps = [
        Component(f"engine weights ({run.engine_dtype}, tp {rt})", engine_w, f"{e} B x {ne / 1e9:.3f} B params per GPU"),
        Component("engine workspace", workspace, "activations and sampler (--rollout-workspace-gib)"),
        Component("engine KV cache", max(0.0, kv_budget),
                  f"gpu_memory_utilization({util}) x GPU - weights - workspace; 2 x {sh.num_layers} layers "
                  f"x {kv_heads} KV heads x {sh.head_dim} x {e} B = {per_token / 1024:.0f} KiB per token"),
    ]
    if knobs.offload_during_rollout:
        note = "trainer states offloaded to host"
    else:
        comps.append(Component("trainer states (not offloaded)", trainer_states,
                               f"{_trained(run)} train states + reference weights stay on the GPU"))
        note = "trainer states stay on the GPU"
    comps.append(reserve)
    return Budget("GPU, rollout phase", hw.gpu_memory, comps, note), kv


def _host_memory(run: RunShape, hw: Hardware, knobs: Knobs, layout: Layout, rt: int,
                 stages: list[StageMemory]) -> Budget:
    """Per node: offloaded trainer states of the node's GPUs (largest node), the pool, a reserve."""
    comps: list[Component] = []
    if knobs.offload_during_rollout:
        per_stage = [sum(c.bytes for c in st.train.components if _is_trainer_state(c)) for st in stages]
        per_node = max(sum(per_stage[rank_coords(r, layout).pp_rank]
                           for r in range(node * hw.gpus_per_node, (node + 1) * hw.gpus_per_node))
                       for node in range(hw.nodes))
        comps.append(Component("trainer states offloaded during rollout", per_node,
                               f"{hw.gpus_per_node} GPUs x ({_trained(run)} train states + reference weights)"))
    if run.use_pf_ppo:
        full = DTYPE_BYTES[run.engine_dtype] * total_param_count(run.model, "lm")  # snapshots: engine dtype
        if knobs.pool_placement == "node":
            share = min(1.0, hw.gpus_per_node / rt)  # < 1 only when one engine replica spans nodes
            pool = run.pool_size * full * share
            how = (f"pool_size({run.pool_size}) x full {run.engine_dtype} actor {_gib(full)}"
                   + ("" if share == 1 else f" x {share:g} (engine spans nodes)") + ", every node")
        else:
            pool = run.pool_size * full / hw.nodes
            how = f"pool_size({run.pool_size}) x full {run.engine_dtype} actor {_gib(full)} / nodes({hw.nodes})"
        comps.append(Component(f"PF-PPO snapshot pool ({knobs.pool_placement})", pool, how))
    if run.sleep_level == 1:  # vLLM's level 1 keeps the sleeping engine's weights in host memory
        ew = DTYPE_BYTES[run.engine_dtype] * engine_param_count(run.model, rt)
        comps.append(Component(f"sleeping engine weights (sleep level 1, {run.engine_dtype})", hw.gpus_per_node * ew,
                               f"{hw.gpus_per_node} GPUs x {_gib(ew)} engine weights (tp {rt})"))
    comps.append(Component("host reserve", knobs.host_reserve_gib * GiB,
                           "OS, Python processes, data, pinned buffers (--host-reserve-gib)"))
    return Budget("host memory per node", hw.host_memory, comps)


def make_plan(run: RunShape, hw: Hardware, knobs: Knobs) -> Plan:
    """Compute every budget and collect the problems that make the layout refuse.

    Raises ValueError for a layout megatron cannot build (divisibility); everything that can be
    built but does not fit, or breaks a batch / sequence rule, is a problem in ``Plan.problems``."""
    layout, rt = _check_inputs(run, hw, knobs)
    problems: list[str] = []
    notes: list[str] = []
    if run.seq_len > run.max_position_embeddings:
        problems.append(f"sequence: max_prompt_length({run.max_prompt_length}) + max_response_length"
                        f"({run.max_response_length}) = {run.seq_len} > max_position_embeddings"
                        f"({run.max_position_embeddings})")
    # micro-batch: the flag, else training.micro_batch_size, else the whole mini-batch per DP rank
    b = knobs.micro_batch or run.micro_batch_size or max(1, run.mini_batch // layout.dp)
    per_dp = layout.dp * b
    if run.mini_batch % per_dp:
        problems.append(f"batch: training.batch_size({run.mini_batch}) must be divisible by dp({layout.dp}) x "
                        f"micro_batch({b}) = {per_dp}")
    m = max(1, run.mini_batch // per_dp)  # micro-batches per mini-batch per DP rank
    bubble = (layout.pp - 1) / (m + layout.pp - 1)
    if m < layout.pp:
        notes.append(f"only {m} micro-batches per mini-batch for pp({layout.pp}) stages: the pipeline "
                     f"idles {bubble:.0%} of each step")
    if layout.tp > hw.gpus_per_node:
        notes.append(f"tp({layout.tp}) > gpus_per_node({hw.gpus_per_node}): tensor-parallel traffic crosses nodes")
    if knobs.layer == "local" and knobs.recompute == "none":
        notes.append("unfused attention without recompute keeps the 6 a s^2 b softmax bytes of every layer")

    reserve = Component("runtime reserve", knobs.reserve_gib * GiB,
                        "CUDA context, NCCL buffers, allocator fragmentation (--reserve-gib)")
    stages = _training_phase(run, hw, knobs, layout, b, m, reserve)
    worst = max(range(layout.pp), key=lambda k: stages[k].train.total)
    trainer_states = sum(c.bytes for c in stages[worst].train.components if _is_trainer_state(c))
    rollout, kv = _rollout_phase(run, hw, knobs, rt, trainer_states, reserve)
    host = _host_memory(run, hw, knobs, layout, rt, stages)

    util = run.gpu_memory_utilization
    if kv.budget <= 0:
        need = rollout.components[0].bytes + rollout.components[1].bytes
        problems.append(f"rollout: the engine's share gpu_memory_utilization({util}) x {_gib(hw.gpu_memory)} = "
                        f"{_gib(util * hw.gpu_memory)} does not hold its weights and workspace "
                        f"{_gib(need)}: {_gib(-kv.budget)} short")
    elif kv.tokens < run.seq_len:
        problems.append(f"rollout: the KV cache holds {kv.tokens} tokens per replica, less than one sequence of "
                        f"{run.seq_len} tokens ({_gib(run.seq_len * kv.bytes_per_token - kv.budget)} short per GPU)")
    elif kv.waves > 1:
        notes.append(f"rollout: {kv.rollout_sequences_per_replica} sequences per engine replica, {kv.sequences} "
                     f"fit in the KV cache at full length: generation runs in {kv.waves} waves")
    for budget in (stages[worst].train, rollout, host):
        if not budget.fits():
            parts = ", ".join(f"{c.name} {c.bytes / GiB:.1f}"
                              for c in sorted(budget.components, key=lambda c: -c.bytes))
            problems.append(f"{budget.title}: needs {_gib(budget.total)} of {_gib(budget.capacity)}, over by "
                            f"{_gib(budget.over)}; components (GiB): {parts}")

    return Plan(run, hw, knobs, layout, rt, total_param_count(run.model, "lm"),
                total_param_count(run.model, "value") if run.critic else 0, b, m, bubble, stages, worst, rollout, kv, host,
                problems, notes)
