"""Per-GPU and per-node memory of a colocated PPO / PF-PPO run, from the config and the hardware.

Every figure comes from the device-memory ledger (pfppo_mega.ledger: holdings, activation
formulas, phase order), which the trainer also enters at every phase transition, so the plan and
the run cannot disagree. The plan replays the ledger's BUILD_ORDER and STEP_ORDER for each
pipeline stage on the card's capacity and reads its budgets off the records:

- training phase: the "update" record (actor and critic train states, the reference's and a reward
  model's weights, the larger update's activations, the refit stream's kept slots, the reserve); the
  engine sleeps (``actor_rollout.sleep_level``: 2 frees KV cache and weights, 1 keeps the weights in
  host memory);
- rollout phase: the "generate" record of the worst stage (engine weights, workspace, KV cache,
  what the trainer keeps on the GPU: nothing with ``training.offload_during_rollout``);
- host per node: the "update" record's host side of the node's ranks (offloaded trainer states
  but their gradients, which are freed and come back zeroed; the host copies stay allocated after a
  reload, page-locked exactly their size by pfppo_mega.pinned; the PF-PPO pool, placement "node":
  every node keeps every snapshot whole in the engine's layout, "sharded": 1/nodes of each;
  sleeping engine weights at level 1; the host reserve).

Only the standard library is imported here (and the ledger, ``shapes``, ``pfppo_mega.families``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from math import ceil
from typing import Optional

from pfppo_mega.planning.shapes import layout_problems, rank_coords
from pfppo_mega.ledger import (  # noqa: F401  (re-exported: the planner's public names)
    BUILD_ORDER, DTYPE_BYTES, GiB, LAYERS, MiB, POOL_PLACEMENT, RECOMPUTE, STEP_ORDER, Holding, Knobs,
    LayerActivations, Layout, Ledger, PhaseRecord, RankHoldings, RunShape, in_flight_microbatches, layer_activation_terms,
    layer_bytes, layer_terms_for, micro_batching, offload_from_config, rank_holdings, total_param_count,
)

Component = Holding  # one line of a budget: name, bytes, formula
BYTES_WEIGHT = DTYPE_BYTES["bfloat16"]  # the configs' training dtype


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




# ----------------------------------------------------------------------------- results


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
class KVBudget:
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
    kv: KVBudget
    host: Budget
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    holdings: list[RankHoldings] = field(default_factory=list)  # per pipeline stage
    ledger: list[list[PhaseRecord]] = field(default_factory=list)  # per stage: BUILD_ORDER + STEP_ORDER

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
            "ledger": [{"pp_rank": h.pp_rank, "phases": [record_json(r) for r in recs]}
                       for h, recs in zip(self.holdings, self.ledger)],
        }


# ----------------------------------------------------------------------------- the plan


def _gib(x: float) -> str:
    return f"{x / GiB:.2f} GiB"


def record_json(r: PhaseRecord) -> dict:
    return {"phase": r.phase, "device_bytes": int(r.device_bytes), "host_bytes": int(r.host_bytes),
            "capacity_bytes": None if r.capacity is None else int(r.capacity), "fits": r.fits(),
            "device": {h.name: int(h.bytes) for h in r.device}, "host": {h.name: int(h.bytes) for h in r.host},
            **({"measured": r.measured} if r.measured else {})}


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


def _record(records: list[PhaseRecord], phase: str) -> PhaseRecord:
    return next(r for r in reversed(records) if r.phase == phase)


def _training_budget(h: RankHoldings, rec: PhaseRecord, hw: Hardware, run: RunShape) -> Budget:
    """The "update" record: trainer states, activations, kept refit slots, reserve (no engine)."""
    order = [x.name for x in h.trainer] + [h.update.name, h.refit_slots.name, h.reserve.name]
    held = {x.name: x for x in rec.device}
    comps = [held[n] for n in order if n in held and (held[n].bytes or n == h.reserve.name)]
    asleep = ("rollout engine asleep (KV freed, weights dropped)" if run.sleep_level == 2 else
              "rollout engine asleep (KV freed, weights in host memory)")
    return Budget(f"GPU, training phase, pipeline stage {h.pp_rank} of {run.pp}", hw.gpu_memory, comps, asleep)


def _rollout_budget(h: RankHoldings, rec: PhaseRecord, hw: Hardware, run: RunShape, offload: bool) -> Budget:
    """The "generate" record: engine weights, workspace, KV cache, the trainer's states still on the GPU."""
    held = {x.name: x for x in rec.device}
    kv = held.get(h.engine_kv.name, h.engine_kv)
    comps = [held.get(h.engine_weights.name, h.engine_weights), h.engine_workspace, replace_bytes(kv, max(0.0, kv.bytes))]
    trainer = sum(held[x.name].bytes for x in h.trainer if x.name in held)
    if offload:
        note = "trainer states offloaded to host"
        if trainer:  # what no offload moves (a reward model's weights)
            comps.append(Component("trainer states kept on the GPU", trainer, "the reward model's weights "
                                   "(TrainerOffload moves the actor, critic and reference)"))
    else:
        comps.append(Component("trainer states (not offloaded)", trainer,
                               f"{_trained(run)} train states + reference weights stay on the GPU"))
        note = "trainer states stay on the GPU"
    if h.refit_slots.name in held:
        comps.append(held[h.refit_slots.name])
    comps.append(held[h.reserve.name])
    return Budget("GPU, rollout phase", hw.gpu_memory, comps, note)


def replace_bytes(c: Holding, value: float) -> Holding:
    return Holding(c.name, value, c.formula)


def _host_budget(run: RunShape, hw: Hardware, knobs: Knobs, layout: Layout, rt: int,
                 holdings: list[RankHoldings], records: list[list[PhaseRecord]]) -> Budget:
    """Per node, the largest node: the "update" record's host side summed over the node's ranks."""
    def host_of(k: int, prefix: str) -> float:
        return sum(x.bytes for x in _record(records[k], "update").host if x.name.startswith(prefix))

    def per_node(prefix: str) -> float:
        return max(sum(host_of(rank_coords(r, layout).pp_rank, prefix)
                       for r in range(node * hw.gpus_per_node, (node + 1) * hw.gpus_per_node))
                   for node in range(hw.nodes))

    comps: list[Component] = []
    if knobs.offload_during_rollout:
        comps.append(Component("trainer states offloaded during rollout", per_node("offloaded "),
                               f"{hw.gpus_per_node} GPUs x ({_trained(run)} weights + optimizer states, reference "
                               f"weights; grads freed, not copied)"))
    h0 = holdings[0]
    if h0.pool is not None:
        full = DTYPE_BYTES[run.engine_dtype] * total_param_count(run.model, "lm")
        share = min(1.0, hw.gpus_per_node / rt)
        how = (f"pool_size({run.pool_size}) x full {run.engine_dtype} actor {_gib(full)}"
               + ("" if knobs.pool_placement == "sharded" or share == 1 else f" x {share:g} (engine spans nodes)")
               + (f" / nodes({hw.nodes})" if knobs.pool_placement == "sharded" else ", every node"))
        comps.append(Component(f"PF-PPO snapshot pool ({knobs.pool_placement})", per_node(h0.pool.name), how))
    if run.sleep_level == 1:  # vLLM's level 1 keeps the sleeping engine's weights in host memory
        ew = h0.engine_weights.bytes
        comps.append(Component(f"sleeping engine weights (sleep level 1, {run.engine_dtype})", per_node("sleeping "),
                               f"{hw.gpus_per_node} GPUs x {_gib(ew)} engine weights (tp {rt})"))
    comps.append(Component("host reserve", per_node(h0.host_reserve.name),
                           "OS, Python processes, data, pinned buffers (--host-reserve-gib)"))
    return Budget("host memory per node", hw.host_memory, comps)


def plan_ledger(run: RunShape, hw: Hardware, knobs: Knobs, layout: Layout, rt: int
                ) -> tuple[list[RankHoldings], list[list[PhaseRecord]]]:
    """Each stage's holdings and its ledger replayed through the build and one step, on the card
    (not checked: the plan reports what does not fit)."""
    holdings = [rank_holdings(run, knobs, layout, k, rt, gpus_per_node=hw.gpus_per_node, nodes=hw.nodes)
                for k in range(layout.pp)]
    return holdings, [Ledger(h, hw.gpu_memory, check=False).replay(BUILD_ORDER + STEP_ORDER) for h in holdings]


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
    b, m = micro_batching(run, knobs, layout.dp)
    per_dp = layout.dp * b
    by_rows = run.max_tokens_per_micro_batch is None or knobs.micro_batch is not None  # a token budget cuts any batch
    if run.mini_batch % per_dp and by_rows:
        problems.append(f"batch: training.batch_size({run.mini_batch}) must be divisible by dp({layout.dp}) x "
                        f"micro_batch({b}) = {per_dp}")
    bubble = (layout.pp - 1) / (m + layout.pp - 1)
    if m < layout.pp:
        notes.append(f"only {m} micro-batches per mini-batch for pp({layout.pp}) stages: the pipeline "
                     f"idles {bubble:.0%} of each step")
    if layout.tp > hw.gpus_per_node:
        notes.append(f"tp({layout.tp}) > gpus_per_node({hw.gpus_per_node}): tensor-parallel traffic crosses nodes")
    if knobs.layer == "local" and knobs.recompute == "none":
        notes.append("unfused attention without recompute keeps the 6 a s^2 b softmax bytes of every layer")

    holdings, records = plan_ledger(run, hw, knobs, layout, rt)
    stages = [StageMemory(h.pp_rank, h.actor_params, h.critic_params,
                          _training_budget(h, _record(recs, "update"), hw, run))
              for h, recs in zip(holdings, records)]
    worst = max(range(layout.pp), key=lambda k: stages[k].train.total)
    rollout = _rollout_budget(holdings[worst], _record(records[worst], "generate"), hw, run,
                              knobs.offload_during_rollout)
    h = holdings[worst]
    kv_budget = h.kv_for(hw.gpu_memory).bytes
    tokens = max(0, int(kv_budget // h.kv_per_token))
    replicas = hw.world_size // rt
    per_replica = ceil(run.rollout_samples / replicas)
    concurrent = tokens // run.seq_len
    # vLLM schedules at most max_num_seqs sequences at once, whatever its cache holds
    scheduled = min(concurrent, run.max_num_seqs) if run.engine == "vllm" else concurrent
    waves = ceil(per_replica / scheduled) if scheduled else 0
    kv = KVBudget(h.kv_per_token, kv_budget, tokens, run.seq_len, concurrent, replicas, per_replica, waves)
    host = _host_budget(run, hw, knobs, layout, rt, holdings, records)

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
        bound = (f"{scheduled} at once (actor_rollout.max_num_seqs = {run.max_num_seqs}; the KV cache holds "
                 f"{kv.sequences})" if scheduled < concurrent else f"{kv.sequences} fit in the KV cache at full length")
        notes.append(f"rollout: {kv.rollout_sequences_per_replica} sequences per engine replica, {bound}: "
                     f"generation runs in {kv.waves} waves")
    for budget in (stages[worst].train, rollout, host):
        if not budget.fits():
            parts = ", ".join(f"{c.name} {c.bytes / GiB:.1f}"
                              for c in sorted(budget.components, key=lambda c: -c.bytes))
            problems.append(f"{budget.title}: needs {_gib(budget.total)} of {_gib(budget.capacity)}, over by "
                            f"{_gib(budget.over)}; components (GiB): {parts}")
    for k, recs in enumerate(records):  # every phase of the ledger, not only the two budgets above
        for r in recs:
            if not r.fits() and r.phase not in ("update", "generate"):
                problems.append(f"ledger, stage {k}, phase {r.phase!r}: needs {_gib(r.device_bytes)} of "
                                f"{_gib(r.capacity)}, over by {_gib(r.over)}")

    return Plan(run, hw, knobs, layout, rt, total_param_count(run.model, "lm"),
                total_param_count(run.model, "value") if run.critic else 0, b, m, bubble, stages, worst, rollout, kv, host,
                problems, notes, holdings, records)
