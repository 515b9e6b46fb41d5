"""Generation with the run's engine, as every behaviour policy and the evaluation use it.

``Generation`` owns no weights: it asks EngineSync to put a version into the engine, generates
n responses per prompt with whatever the engine holds (rows tagged with its version), guards a
failing engine (push the same verified weights again, generate once more) and runs the rollout
colocated (the trainer's states on the host while the engine generates, the engine asleep
before they come back).
"""

from __future__ import annotations

import dataclasses
import random
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from pfppo_mega.parallel import comm_device
from pfppo_mega.rollout import SamplingParams
from pfppo_mega.rollout.base import RolloutOutput
from pfppo_mega.rollout.multiturn import MultiTurnRollout, ToolSet, TurnLimits, TurnStats, TurnTokens
from pfppo_mega.rollout.refit import held_slot_bytes
from pfppo_mega.tokenizer import Tokenizer
from pfppo_mega.trainer.instruments import devicecheck
from pfppo_mega.trainer.batch import GreedyRows, RolloutBatch
from pfppo_mega.trainer.colocation.engine_sync import EngineSync
from pfppo_mega.ledger import (BUILD_ORDER, Knobs, Layout, Ledger, PhaseRecord, RunShape, rank_holdings,
                                      reward_model_shape)
from pfppo_mega.trainer.colocation.offload import TrainerOffload
from pfppo_mega.trainer.colocation.rollout_split import SplitLayout, assemble, plan_share
from pfppo_mega.types import Sample


COLOCATION_EVENTS_KEPT = 256
# One colocated frame: (refit) only when the engine held another version; generate once or more,
# with PF-PPO's snapshot switches and live refits before and between the generations (a live refit
# then brings the actor's weights back for the refit alone, TrainerOffload.on_device).
COLOCATION_ORDER = ("offload trainer", "wake weights", "refit?", "offload actor weights", "wake kv cache",
                    "generate+", "sleep", "reload trainer")


class ColocationOrderError(AssertionError):
    """The engine and the trainer's states met on the device in an order the GPU cannot hold."""


def check_colocation_order(events: list[str]) -> None:
    """Every frame in ``events`` follows COLOCATION_ORDER (refits and switches may sit between the
    generations). Raises ColocationOrderError naming the first call out of place."""
    i = 0
    while i < len(events):
        for want in COLOCATION_ORDER:
            name = want.rstrip("?+")
            if want.endswith("?") and (i >= len(events) or events[i] != name):
                continue
            start = i
            if want.endswith("+"):  # generations, with snapshot switches and live refits between them
                while i < len(events) and events[i] in ("generate", "refit", "switch"):
                    i += 1
                ok = name in events[start:i]
            else:
                ok = i < len(events) and events[i] == name
                i += ok
            if not ok:
                got = events[i] if i < len(events) else "the end"
                raise ColocationOrderError(f"colocation: expected {name!r} at call {i}, got {got!r} "
                                           f"(calls {events[max(0, i - 3):i + 2]})")


@dataclass
class Work:
    """Work of this rank since the last take(): tokens its engine generated, tokens its rows needed,
    rows it asked for (rollout, evaluation and the KL probe alike); weight bytes its engine received
    (live refits, pool switches); checkpoint bytes it wrote; and, at take(), the host bytes it holds
    (offload buffers + its pool shards). The loop logs a step's record before it saves: a save's
    bytes land in the next step's record (work/checkpoint_bytes_written), the last save's in none."""

    generated: int = 0
    needed: int = 0
    rows: int = 0
    owned: int = 0  # needed tokens this rank answers for in the job's total (a replica's leader)
    counted: int = 0  # generated tokens this rank answers for (its engine's first rank: a rollout-TP
    #                   engine's ranks all return the rows it generated once)
    refit_bytes: int = 0
    switch_bytes: int = 0
    checkpoint_bytes: int = 0
    host_bytes: int = 0

    def add(self, *, generated: int, needed: int, rows: int, owner: bool, engine_leader: bool = True) -> None:
        self.generated += generated
        self.needed += needed
        self.rows += rows
        self.owned += needed if owner else 0
        self.counted += generated if engine_leader else 0

    def saved(self, result) -> int:
        """Count a checkpoint save's bytes from what resume.save returned: its ``bytes`` when it says
        them, else the files of the directory it returned (this rank's series); 0 for None."""
        n = checkpoint_bytes(result)
        self.checkpoint_bytes += n
        return n

    def take(self, host_bytes: int = -1) -> "Work":
        out = dataclasses.replace(self, host_bytes=host_bytes)
        for f in dataclasses.fields(self):
            setattr(self, f.name, 0)
        return out

    def metrics(self, group: Optional[dist.ProcessGroup] = None) -> dict[str, float]:
        """This rank's figures (work/*), and the job's generated / needed tokens (1.0: every row
        generated once; a world all-reduce when distributed)."""
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            total = torch.tensor([self.counted, self.owned], dtype=torch.float64, device=comm_device(group))
            dist.all_reduce(total, group=group)
        else:
            total = torch.tensor([self.counted, self.owned], dtype=torch.float64)
        generated, needed = total.tolist()
        out = {"work/tokens_generated": float(self.generated), "work/tokens_needed": float(self.needed),
               "work/rows": float(self.rows), "work/refit_bytes_received": float(self.refit_bytes),
               "work/switch_bytes_received": float(self.switch_bytes),
               "work/checkpoint_bytes_written": float(self.checkpoint_bytes),
               "rollout/generated_over_needed": generated / needed if needed else 0.0}
        if self.host_bytes >= 0:
            out["work/host_bytes_held"] = float(self.host_bytes)
        return out


def checkpoint_bytes(result) -> int:
    """Bytes of one save: ``result.bytes`` (a save that reports them), else the sizes of the files
    under the directory ``result`` (or ``result.path``) names, else 0."""
    if result is None:
        return 0
    n = getattr(result, "bytes", None)
    if isinstance(n, int):
        return n
    from pathlib import Path

    path = Path(getattr(result, "path", result))
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


# ----------------------------------------------------------------------------- the memory ledger


@dataclass(frozen=True)
class SimulatedCard:
    """The ledger of a GPU run, entered by a CPU run's real calls: the holdings as on a CUDA machine
    with the vLLM engine (which sleeps there and sizes its KV cache as gpu_memory_utilization x the
    card), no CUDA reserve or workspace, against a card of ``capacity`` bytes. For tests (set
    SIMULATED_CARD): a call moved out of the colocated order overflows the card."""

    capacity: int


SIMULATED_CARD: Optional[SimulatedCard] = None


def device_capacity(device: torch.device) -> Optional[int]:
    """The card's bytes (torch's total_memory) on CUDA; None on a CPU (no card: nothing to check
    against, the ledger only records). Tests put a card of their own here."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.get_device_properties(device).total_memory)


class MemoryRecorder:
    """The trainer's side of the device-memory ledger (pfppo_mega/ledger.py): every phase transition
    enters the ledger as the code runs it (which checks the predicted device bytes against the card:
    LedgerOverflow), with what the trainer saw there: its states' bytes on the device
    (TrainerOffload.device_bytes), the refit stream's buffers held (refit.held_slot_bytes) and, on
    CUDA, torch.cuda.memory_allocated at the transition and the peak since the previous one (filled
    into that phase's record)."""

    KEPT = 256  # records kept after the build's

    def __init__(self, ledger: Ledger, offload: TrainerOffload, device: torch.device) -> None:
        self.ledger, self.offload, self.device = ledger, offload, torch.device(device)
        self.cuda = self.device.type == "cuda"

    @classmethod
    def for_run(cls, cfg, *, model_cfg, arch, tp: int, pp: int, dp: int, pp_rank: int, local_world: int,
                offload: TrainerOffload, device: torch.device) -> "MemoryRecorder":
        """The ledger of this rank as the plan computes it (same RunShape, Knobs and holdings), with
        the offload as the trainer applies it and the card's capacity (device_capacity)."""
        device = torch.device(device)
        run = RunShape.from_config(cfg, arch, reward_model_shape(cfg.reward.model_path), model=model_cfg)
        knobs = dataclasses.replace(Knobs.from_config(cfg), offload_during_rollout=offload.enabled)
        kind, capacity = device.type, device_capacity(device)
        card = SIMULATED_CARD if device.type == "cpu" else None
        if card is not None:
            run = dataclasses.replace(run, engine="vllm")
            knobs = dataclasses.replace(knobs, reserve_gib=0.0, rollout_workspace_gib=0.0)
            kind, capacity = "cuda", card.capacity
        world = tp * pp * dp
        holdings = rank_holdings(run, knobs, Layout(tp, pp, dp), pp_rank, cfg.actor_rollout.tensor_model_parallel_size,
                                 gpus_per_node=local_world, nodes=max(1, world // local_world), device=kind)
        return cls(Ledger(holdings, capacity), offload, device)

    @property
    def records(self) -> list[PhaseRecord]:
        return self.ledger.records

    def enter(self, phase: str) -> PhaseRecord:
        measured: dict[str, int] = {"trainer_bytes": self.offload.device_bytes(),
                                    "refit_slot_bytes": held_slot_bytes()}  # the stream's ring held now
        if self.cuda:
            if self.ledger.records:
                self.ledger.records[-1].measured["cuda_peak"] = int(torch.cuda.max_memory_allocated(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)
            measured["cuda_allocated"] = int(torch.cuda.memory_allocated(self.device))
        build = len(BUILD_ORDER)
        if len(self.ledger.records) > build + 2 * self.KEPT:
            del self.ledger.records[build:len(self.ledger.records) - self.KEPT]
        return self.ledger.enter(phase, **measured)

    def host_bytes(self, held: int = 0) -> int:
        """Host bytes this rank holds now: TrainerOffload's buffers and ``held`` (the behaviour
        policy's: the PF-PPO pool's shards)."""
        return sum(int(t.numel()) for t in self.offload._host) + held  # uint8 buffers


def sleep_engine(engine) -> None:
    """engine.sleep(); an engine whose sleep discards its weights then holds no version (whether or not
    its own sleep said so), so the next frame's ensure_current / switch / pool check pushes them again."""
    engine.sleep()
    if engine.sleep_discards_weights:
        engine.invalidate()


def build_engine_colocated(build: Callable[[], Any], *, offload: TrainerOffload, memory: MemoryRecorder):
    """The engine built with the trainer's states off the device (vLLM claims gpu_memory_utilization
    of the card when it starts), then asleep before they come back -- the ledger's BUILD_ORDER after
    "build trainer". (training.offload_during_rollout off: the offloads are no-ops.)"""
    off = offload.enabled
    if off:
        offload.offload("early")
    memory.enter("offload trainer")
    try:
        if off:
            offload.offload("late")
        memory.enter("offload actor weights")
        engine = build()
        memory.enter("build engine")
        sleep_engine(engine)
        memory.enter("sleep")
    finally:
        if off:
            offload.reload()
    memory.enter("reload trainer")
    return engine


class TurnsSetupError(ValueError):
    """actor_rollout.multi_turn cannot run with this checkpoint or these files; the message names the key."""


@dataclass
class Turns:
    """What a multi-turn rollout needs besides the engine (actor_rollout.multi_turn.enable)."""

    toolset: ToolSet
    tokens: TurnTokens
    limits: TurnLimits


def load_toolset(mt) -> ToolSet:
    """The tools and interactions the config's files define (verl's tool_config / interaction_config
    YAML, read by pfppo_mega.rollout.tools.registry)."""
    if mt.tool_config_path is None and mt.interaction_config_path is None:
        return ToolSet()
    from pfppo_mega.rollout.tools.registry import load_interactions, load_tools
    tools = load_tools(mt.tool_config_path) if mt.tool_config_path is not None else {}
    inter = load_interactions(mt.interaction_config_path) if mt.interaction_config_path is not None else {}
    return ToolSet(dict(tools), dict(inter))


def build_turns(cfg, tokenizer: Tokenizer, template, toolset: ToolSet) -> Optional[Turns]:
    """The run's Turns (None: multi-turn off). ``template``: the checkpoint's chat template (tool and user
    turns are rendered with it; required)."""
    mt = cfg.actor_rollout.multi_turn
    if not mt.enable:
        return None
    if template is None:
        raise TurnsSetupError("actor_rollout.multi_turn.enable = true: tool and user turns are rendered with the "
                              "checkpoint's chat template, and there is none (data.source files with "
                              "data.apply_chat_template true and a checkpoint with chat_template)")
    return Turns(toolset, TurnTokens(template, tokenizer), TurnLimits.from_config(mt))


def shared_payload(everyone: list[tuple[int, bool, dict[str, Any]]], key: int) -> dict[str, Any]:
    """The payload of replica ``key``'s leader among every rank's (replica, leads, payload), with its
    ``error`` set to another replica's when only that one failed: the next engine call and agreement are
    world collectives, so when any replica's leader stops every rank must stop with it (else the ranks
    of the other replicas wait in the next collective for ranks that left)."""
    found = [p for k, lead, p in everyone if lead and k == key]
    if len(found) != 1:
        raise RuntimeError(f"multi-turn: {len(found)} ranks run the tools of replica {key} (expected 1)")
    mine = found[0]
    if mine["error"] is None:
        failed = [(k, p["error"]) for k, lead, p in everyone if lead and k != key and p["error"] is not None]
        if failed:
            mine = {**mine, "error": f"replica {failed[0][0]}: {failed[0][1]}"}
    return mine


class Generation:
    def __init__(self, cfg, *, engine, sync: EngineSync, offload: TrainerOffload, tokenizer: Tokenizer,
                 rng: random.Random, device: torch.device, guards: dict[str, int],
                 split: Optional[SplitLayout], log: Callable[[str], None],
                 memory: Optional[MemoryRecorder] = None, turns: Optional[Turns] = None) -> None:
        self.cfg, self.engine, self.sync, self.offload = cfg, engine, sync, offload
        self.turns = turns  # multi-turn rollouts (None: one generation per row)
        self.turn_stats = TurnStats()  # since the last take_turn_metrics()
        self.memory = memory  # the device-memory ledger (None: not recorded)
        self.tokenizer, self.rng, self.device, self.guards, self.log = tokenizer, rng, device, guards, log
        self.split = split  # None: one rank, nothing to split
        self.rollout_trainer_bytes = -1  # trainer bytes on the device during the last generation
        self.work = Work()
        self.engine_s = 0.0  # seconds inside the engine's generate() calls so far (the step reads its share)
        # the colocation calls in the order they ran, with the trainer's bytes on the device then
        self.events: list[tuple[str, int]] = []
        # How the weights an engine failed with are pushed again (version, step): the live weights;
        # a behaviour policy with weights of its own installs its way (SnapshotPolicy: its pool's).
        self.push_again: Callable[[int, int], None] = lambda version, step: sync.reload(None, version, step)

    # ------------------------------------------------------------------ weights

    def sync_weights(self, version: int) -> None:
        """The actor's current weights into the engine as ``version``."""
        self.engine.wake_up(("weights",))  # a sleeping engine takes no weights; its KV cache waits
        # on_device: the actor's weights back for a live refit when they were offloaded already;
        # paused: the engine seam keeps host wire buffers by design
        with self.offload.on_device(), devicecheck.paused():
            self.sync.refit_live(version)
        self.record("refit")

    def record(self, name: str) -> None:
        self.events.append((name, self.offload.device_bytes() if self.offload.enabled else -1))
        del self.events[:-COLOCATION_EVENTS_KEPT]
        self.phase(name)

    def phase(self, name: str) -> None:
        """The ledger's phase transition (checked against the card: LedgerOverflow)."""
        if self.memory is not None:
            self.memory.enter(name)

    def take_work(self, held: int = 0) -> Work:
        """This rank's work since the last take, with the weight bytes its engine received and the
        host bytes it holds now (``held``: the behaviour policy's, BehaviourPolicy.host_bytes)."""
        got = self.sync.take_received()
        self.work.refit_bytes += got["refit"]
        self.work.switch_bytes += got["switch"]
        return self.work.take(self.memory.host_bytes(held) if self.memory is not None else -1)

    def ensure_current(self, step: int) -> None:
        """The engine holds the current weights (version == step) afterwards."""
        if self.engine.weight_version != step:  # it may hold a behaviour snapshot
            self.sync_weights(step)

    # ------------------------------------------------------------------ generation

    @contextmanager
    def colocated(self, step: int, *, refit: bool) -> Iterator[None]:
        """The frame of every generation (rollout, evaluation, the KL probe), in this order:
        offload the trainer's states but the actor's weights -> wake the engine's weights -> refit
        to ``step`` (``refit``: when the engine holds another version) -> offload the actor's weights
        -> wake the KV cache -> the body generates -> engine sleeps (and the refit stream's buffers
        are freed) -> the trainer's states reload. (training.offload_during_rollout off: the offloads
        are no-ops.) ``events`` records it."""
        off = self.offload.enabled
        if off:
            self.offload.offload("early")
        self.record("offload trainer")
        try:
            self.engine.wake_up(("weights",))
            self.record("wake weights")
            if refit:
                self.ensure_current(step)
            if off:
                self.offload.offload("late")
            self.record("offload actor weights")
            self.rollout_trainer_bytes = self.offload.device_bytes()
            self.engine.wake_up(("kv_cache",))
            self.record("wake kv cache")
            try:
                yield
            finally:
                sleep_engine(self.engine)
                self.sync.release_buffers()  # the refit stream's ring goes with the engine's memory
                self.record("sleep")
        finally:
            if off:
                self.offload.reload()
            self.record("reload trainer")

    def offload_stats(self) -> dict[str, float]:
        if not self.offload.enabled:
            return {}
        return {"time/offload_s": self.offload.last_offload_s, "time/reload_s": self.offload.last_reload_s}

    def generate(self, samples: list[Sample], n: int, *, step: int, groups: Optional[list[int]] = None) -> RolloutBatch:
        """n responses per prompt with whatever weights the engine holds (rows carry its version).
        ``groups``: each prompt's index in the step (default 0..len-1; rows carry it as group_ids)."""
        cfg = self.cfg
        groups = list(range(len(samples))) if groups is None else groups
        group_ids = torch.tensor([g for g in groups for _ in range(n)], dtype=torch.long)       # [B]
        samples = [s for s in samples for _ in range(n)]
        prompt_ids = [list(s.prompt_ids) for s in samples]
        self._check_prompts(prompt_ids)
        params = SamplingParams(temperature=cfg.actor_rollout.temperature, top_p=cfg.actor_rollout.top_p,
                                max_new_tokens=cfg.algorithm.max_response_length,
                                eos_token_id=self.tokenizer.eos_id, seed=self.rng.randrange(1 << 31))
        with devicecheck.paused():  # the engine's own device world; its rows are host until moved
            if self.turns is None:
                out = self.run_engine(prompt_ids, params, step=step, what=f"rollout at step {step}")
                texts = [self.tokenizer.decode(r[: int(l)].tolist()) for r, l in zip(out.responses, out.lengths)]
            else:
                out, texts, samples = self.conversations(samples, params, step=step, what=f"rollout at step {step}")
        devicecheck.mark_host(out.responses, out.response_mask, out.logprobs, out.finished)
        self.sync.check_versions(f"rollout at step {step}")  # every engine, same version and checksum
        return RolloutBatch(samples=samples, prompt_ids=prompt_ids, responses=out.responses,
                            response_mask=out.response_mask, behav_logp=out.logprobs, finished=out.finished,
                            versions=torch.full((len(samples),), out.weight_version), texts=texts,
                            group_ids=group_ids).to(self.device)

    def conversations(self, samples: list[Sample], params: SamplingParams, *, step: int, what: str,
                      replicated: bool = False, record: bool = True) -> tuple[RolloutOutput, list[str], list[Sample]]:
        """The rows as multi-turn conversations (rollout/multiturn.py), one run_engine call per turn
        (``replicated``: every rank asks for the same rows, the evaluation); every rank makes the same
        calls (see _agree). The samples come back with their extra_info copied and extended
        (tool_rewards, interaction_scores, turns, tool_calls) for the reward function. ``record``: count
        the rows in the step's multi-turn metrics (take_turn_metrics)."""
        cfg, turns = self.cfg, self.turns
        loop = MultiTurnRollout(
            generate=lambda p, prm: self.run_engine(p, prm, step=step, what=f"{what} (multi-turn)",
                                                    replicated=replicated),
            tokenizer=self.tokenizer, turn_tokens=turns.tokens, toolset=turns.toolset, limits=turns.limits,
            max_response_length=cfg.algorithm.max_response_length,
            max_context=cfg.data.max_prompt_length + cfg.algorithm.max_response_length,
            agree=self._agree, share=self._share_of(replicated), runs_tools=self._runs_tools(replicated),
            log=self.log)
        result = loop.run(samples, params)
        if record:
            self.turn_stats.add(result.stats)
        rows = [dataclasses.replace(s, extra_info={**(s.extra_info or {}), **extra})
                for s, extra in zip(samples, result.extra)]
        return result.output, result.texts, rows

    def _agree(self, active: int, remaining: int, room: int) -> tuple[int, int, int]:
        """The job's (rows still generating, most budget left, least context room) over every rank. With a
        rollout split an engine call is collective (the rows are exchanged between the engines, and an
        engine generates other ranks' rows with its own params), so every rank makes the same number of
        calls with the same max_new_tokens: a rank whose rows are done calls with none while the others
        finish theirs."""
        if self.split is None:
            return active, remaining, room
        group = self.sync.world
        flag = torch.tensor([active, remaining, -room], dtype=torch.int64, device=comm_device(group))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        n, most, least = flag.tolist()
        return int(n), int(most), -int(least)

    def _runs_tools(self, replicated: bool) -> bool:
        """Whether this rank runs its rows' tools: the replica's leader (``replicated``: every rank has the
        same rows, rank 0 runs them for all)."""
        if self.split is None:
            return True
        return self.split.rank == 0 if replicated else self.split.replica_leader

    def _share_of(self, replicated: bool) -> Optional[Callable[[Any], Any]]:
        """share(payload) -> the payload of the rank that runs this rank's tools (every rank calls it, a
        world all-gather): the other ranks of a replica (its TP / PP ranks) take its rows' state, so a
        tool runs once per row, not once per rank."""
        if self.split is None:
            return None
        key = 0 if replicated else self.split.dp_rank
        leader = self._runs_tools(replicated)

        def share(payload: Any) -> Any:
            everyone: list = [None] * dist.get_world_size(self.sync.world)
            dist.all_gather_object(everyone, (key, leader, payload), group=self.sync.world)
            return shared_payload(everyone, key)
        return share

    def take_turn_metrics(self) -> dict[str, float]:
        """The multi-turn metrics of the rollouts since the last take (this rank's rows); {} when off."""
        if self.turns is None:
            return {}
        out = self.turn_stats.metrics()
        self.turn_stats = TurnStats()
        return out

    def greedy_baseline(self, rb: RolloutBatch, samples: list[Sample], *, step: int) -> RolloutBatch:
        """``rb`` with the greedy response to each of ``samples`` (rb.group_ids index them), one per
        prompt, generated through the same engine call with the current weights (version == step: the
        engine may hold a behaviour snapshot). Its rows are only scored (ReMax's baseline), never
        trained on. Called inside the rollout's colocated frame."""
        cfg = self.cfg
        self.ensure_current(step)
        prompt_ids = [list(s.prompt_ids) for s in samples]
        self._check_prompts(prompt_ids)
        params = SamplingParams(temperature=cfg.actor_rollout.temperature, top_p=cfg.actor_rollout.top_p, greedy=True,
                                max_new_tokens=cfg.algorithm.max_response_length,
                                eos_token_id=self.tokenizer.eos_id, seed=0)  # greedy: the seed is unused
        with devicecheck.paused():  # the engine's own device world; its rows are host until moved
            out = self.run_engine(prompt_ids, params, step=step, what=f"greedy baseline at step {step}")
        devicecheck.mark_host(out.responses, out.response_mask, out.logprobs, out.finished)
        self.sync.check_versions(f"greedy baseline at step {step}")
        if out.weight_version != step:
            raise RuntimeError(f"greedy baseline at step {step}: the engine generated with weight version "
                               f"{out.weight_version}, not the current weights ({step})")
        texts = [self.tokenizer.decode(r[: int(l)].tolist()) for r, l in zip(out.responses, out.lengths)]
        g = rb.group_ids.tolist()                                                               # [B] -> prompt
        rows = GreedyRows(texts, out.finished, out.lengths.long(),
                          torch.full((len(texts),), out.weight_version)).select(g)          # [prompts] -> [B]
        return dataclasses.replace(rb, baseline=rows.to(rb.group_ids.device))

    def run_engine(self, prompt_ids: list[list[int]], params: SamplingParams, *, step: int,
                   what: str, replicated: bool = False) -> RolloutOutput:
        """This rank's rows generated once in the job: with more than one rank, the job's rows are
        split across every engine and exchanged (trainer/colocation/rollout_split.py). ``replicated``: every
        rank asks for the same rows (evaluation, the KL probe), not one request per replica."""
        self.record("generate")
        if self.split is None:
            out = self._guarded(lambda: self._timed(self.engine.generate, prompt_ids, params), step=step)
            self.work.add(generated=int(out.lengths.sum()), needed=int(out.lengths.sum()), rows=len(prompt_ids),
                          owner=True)
            return out
        layout = self.split if not replicated else dataclasses.replace(
            self.split, dp_rank=0, replica_leader=self.split.rank == 0)
        share = plan_share(layout, prompt_ids, params, what=what)
        outs = self._guarded(lambda: [self._timed(self.engine.generate, p, prm) for _, _, p, prm in share.calls],
                             step=step)
        out = assemble(layout, share, outs, prompt_ids, pad_token_id=self.tokenizer.pad_id, what=what)
        self.work.add(generated=sum(int(o.lengths.sum()) for o in outs), needed=int(out.lengths.sum()),
                      rows=len(prompt_ids), owner=layout.replica_leader,
                      engine_leader=layout.rank % layout.rollout_tp == 0)
        return out

    def _timed(self, fn, *args):
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.engine_s += time.perf_counter() - t0

    def _guarded(self, attempt: Callable[[], Any], *, step: int):
        """``attempt()`` (this rank's engine calls), agreed on by every rank. When it fails anywhere (an
        engine that died or raised mid-generation), every rank pushes the same verified weights again
        (the snapshot or the live weights it was generating with) and tries once more, counted in
        guard/engine_failures; a second failure stops the run with the ranks and the cause."""
        version = self.engine.weight_version
        for n_try in (1, 2):
            out, error = None, None
            try:
                out = attempt()
            except Exception as e:  # any engine failure: agreed on below, so no rank is left waiting
                error = e
            bad = self.sync.failing_ranks(error is None)
            if not bad:
                return out
            cause = f"{type(error).__name__}: {error}" if error is not None else f"see rank {bad[0]}'s log"
            if n_try == 2:
                raise RuntimeError(
                    f"rollout at step {step}: the rollout engine failed on rank(s) {bad} again after its weights "
                    f"(version {version}) were pushed again; stopping ({cause})") from error
            self.guards["engine_failures"] += 1  # every rank agrees: no DP sum needed
            self.log(f"[pfppo] step {step}: the rollout engine failed on rank(s) {bad} ({cause}); pushing "
                     f"weight version {version} again and regenerating")
            with self.offload.on_device():  # the live weights, also while offloaded
                self.push_again(version, step)
        raise AssertionError("unreachable")

    def _check_prompts(self, prompt_ids: list[list[int]]) -> None:
        limit = self.cfg.data.max_prompt_length
        for i, p in enumerate(prompt_ids):
            if len(p) > limit:
                raise ValueError(f"prompt {i} has {len(p)} tokens > data.max_prompt_length ({limit})")
