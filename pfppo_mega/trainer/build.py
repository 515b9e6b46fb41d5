"""Run assembly: everything a training run is made of, built once from the config.

``build_run(cfg)`` checks every input before any work (engine choice, checkpoint, tokenizer,
lengths, layout, features, batch split), sets up parallel state in one place, then builds, in
this order: prompts and rewards, actor, reference, critic (only when the advantage estimator
needs one), optimizers, kernels backend, offload, rollout engine, EngineSync, the behaviour
policy (current policy or snapshot pool) and the policy loss. The ``Run`` holds them in four
typed parts (``Models``, ``Colocation``, ``Strategies``, ``TrainState``): the loop (trainer/loop.py)
gives each phase the parts it reads; the checkpoint code (trainer/checkpoint/resume.py) takes the
whole ``Run``.
"""

from __future__ import annotations

import functools
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from pfppo_mega import parallel, ppo
from pfppo_mega.config import Config
from pfppo_mega.config.tree import ModelConfig
from pfppo_mega.data import build_prompt_data
from pfppo_mega.families import Architecture
from pfppo_mega.kernels import KernelBackend, get_backend
from pfppo_mega.models import gpt, hf_io, lora
from pfppo_mega.parallel import ParallelInfo, init_parallel
from pfppo_mega.registry import ADV_ESTIMATORS
from pfppo_mega.rewards import build_reward_fn
from pfppo_mega.rollout.base import EngineSetupError, RolloutEngine
from pfppo_mega.rollout.multiturn import ToolSet, TurnRenderError, row_kwargs
from pfppo_mega.rollout.tools.base import ToolSetupError
from pfppo_mega.tokenizer import Tokenizer
from pfppo_mega.trainer.behaviour import BehaviourPolicy, CurrentPolicy, SnapshotPolicy
from pfppo_mega.trainer.collect import Collector, build_collector
from pfppo_mega.trainer.colocation.engine_sync import EngineSync, build_engine, check_engine_config
from pfppo_mega.trainer.colocation.generation import (Generation, MemoryRecorder, Turns, TurnsSetupError,
                                                       build_engine_colocated, build_turns, load_toolset)
from pfppo_mega.trainer.colocation.offload import TrainerOffload, module_tensors, offload_enabled, optimizer_tensors
from pfppo_mega.trainer.colocation.rollout_split import SplitLayout
from pfppo_mega.trainer.estimators import AdvantageEstimator
from pfppo_mega.trainer.filtration import Filtration, choose_filtration
from pfppo_mega.trainer.passes import PassWork
from pfppo_mega.trainer.policy_loss import (PolicyLoss, PolicyLossParams, RolloutCorrection, choose_policy_loss,
                                            get_policy_loss)
from pfppo_mega.trainer.proximal import Proximal, choose_proximal
from pfppo_mega.trainer.seeds import stream_seed
from pfppo_mega.trainer.value_guard import ValueLossGuard
from pfppo_mega.types import PromptSource, RewardFn, Sample


class SetupError(RuntimeError):
    """A problem found before any work starts (paths, checkpoint/config/tokenizer mismatch)."""


GUARDS = ("bad_rewards", "reward_errors", "reward_timeouts", "skipped_updates", "corrupt_snapshots",
          "value_loss_spikes", "engine_failures", "loss_scale_overflows")


@dataclass
class TrainState:
    """What the loop changes step by step besides the weights (all of it checkpoint state): the
    counters and guards, the random streams, the value-loss guard."""

    rng: random.Random                  # this DP rank's prompt and sampling-seed stream
    assign_gen: torch.Generator         # rank 0's snapshot assignment and filtration draws
    value_guard: ValueLossGuard
    step: int = 0
    guards: dict[str, int] = field(default_factory=lambda: dict.fromkeys(GUARDS, 0))
    consecutive_skips: dict[str, int] = field(default_factory=lambda: {"actor": 0, "critic": 0})
    running_reward: ppo.RunningMoments = field(default_factory=ppo.RunningMoments)
    saved_step: Optional[int] = None  # the step last checkpointed (a second save at it writes nothing)
    run_id: str = ""  # the run's identity (resume.py: made at its first start, kept across resumes)


@dataclass(frozen=True)
class DataParallel:
    """The data-parallel ranks: how many, and batch statistics over them as the math takes them
    (None at dp = 1)."""

    size: int
    group: Optional[torch.distributed.ProcessGroup]
    sum: Optional[Callable]
    gather: Optional[Callable]
    max: Optional[Callable]

    @classmethod
    def of(cls, group, size: int) -> "DataParallel":
        if group is None:
            return cls(size, None, None, None, None)
        return cls(size, group, functools.partial(parallel.dp_sum, group=group),
                   functools.partial(parallel.dp_all_gather, group=group),
                   functools.partial(parallel.dp_max, group=group))


@dataclass
class Models:
    """The trainer's models: what they are built from, the trained and frozen ones, their
    optimizers, the kernels their passes run on, and the work of those passes."""

    model_cfg: ModelConfig              # the config's model section, completed from the checkpoint
    arch: Architecture                  # the family's differences (biases, q/k norms, RoPE scaling)
    features: gpt.Features
    actor: torch.nn.Module
    ref: Optional[torch.nn.Module]      # None with model.lora: the actor with its adapters off
    critic: Optional[torch.nn.Module]   # None when the estimator needs no critic
    actor_opt: gpt.MegatronOptimizer
    critic_opt: Optional[gpt.MegatronOptimizer]
    kernels: KernelBackend
    passes: PassWork = field(default_factory=PassWork)  # the model passes' work since the last step (perf/)

    def trained(self) -> dict[str, torch.nn.Module]:
        """The trained models by checkpoint name (the critic only when built)."""
        return {"actor": self.actor, **({"critic": self.critic} if self.critic is not None else {})}

    def optimizers(self) -> dict[str, gpt.MegatronOptimizer]:
        return {"actor_opt": self.actor_opt, **({"critic_opt": self.critic_opt} if self.critic_opt is not None
                                                else {})}


@dataclass
class Colocation:
    """The rollout engine on the trainer's devices (trainer/colocation/): the engine, the weight
    movements into it, the generation frame, the offload of the trainer's states meanwhile."""

    engine: RolloutEngine
    sync: EngineSync
    gen: Generation
    offload: TrainerOffload


@dataclass
class Strategies:
    """The choices made once from the config; the loop calls them and never asks which it has."""

    behaviour: BehaviourPolicy          # trainer/behaviour.py: algorithm.use_pf_ppo (or the asynchronous mode's)
    collector: Collector                # trainer/collect.py: algorithm.filter_groups (or the asynchronous mode's)
    filtration: Filtration              # trainer/filtration.py: algorithm.filtration
    proximal: Proximal                  # trainer/proximal.py: the old log-probs
    estimator: AdvantageEstimator       # trainer/estimators.py: algorithm.adv_estimator
    policy_loss: PolicyLoss             # trainer/policy_loss.py: algorithm.policy_loss, or tis (pool.is_mode)
    policy_loss_params: PolicyLossParams


@dataclass
class Run:
    """A training run in parts: where it runs (config, ranks, device, logging), its prompts and
    rewards, and four typed parts. A phase takes the parts it reads; the checkpoint takes the Run."""

    cfg: Config
    out_dir: Path
    parallel: ParallelInfo
    device: torch.device
    is_logger: bool
    log: Callable[[str], None]
    dp: DataParallel
    tokenizer: Tokenizer
    prompts: PromptSource
    eval_samples: list[Sample]
    reward_fn: RewardFn
    models: Models
    colocation: Colocation
    strategies: Strategies
    state: TrainState


# ============================================================================ checks before any work


def check_model_path(path: str | None) -> Path:
    if path is None:
        raise SetupError("actor_rollout.model_path is not set: PPO starts from a checkpoint "
                         "(make one with `pfppo sft`)")
    p = Path(path)
    if not p.is_dir():
        raise SetupError(f"actor_rollout.model_path = {path!r}: no such directory")
    for name in ("config.json", "tokenizer.json"):
        if not (p / name).is_file():
            raise SetupError(f"actor_rollout.model_path = {path!r}: {name} missing")
    return p


def check_lengths(cfg: Config, model_cfg, tokenizer: Tokenizer) -> None:
    if tokenizer.vocab_size > model_cfg.vocab_size:
        raise SetupError(f"tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size = "
                         f"{model_cfg.vocab_size}: the checkpoint and tokenizer do not belong together")
    need = cfg.data.max_prompt_length + cfg.algorithm.max_response_length
    if need > model_cfg.max_position_embeddings:
        raise SetupError(
            f"data.max_prompt_length ({cfg.data.max_prompt_length}) + algorithm.max_response_length "
            f"({cfg.algorithm.max_response_length}) = {need} > model.max_position_embeddings "
            f"({model_cfg.max_position_embeddings})")


def check_batch_split(cfg: Config, dp: int) -> None:
    t = cfg.training
    samples = t.rollout_batch_size * cfg.actor_rollout.n_samples_per_prompt
    gen = cfg.algorithm.filter_groups.gen_batch_size
    for key, value in (("training.rollout_batch_size", t.rollout_batch_size), ("training.batch_size", t.batch_size),
                       *((("algorithm.filter_groups.gen_batch_size", gen),) if gen is not None else ())):
        if value % dp:
            raise SetupError(f"{key} ({value}) must be divisible by the data-parallel size dp ({dp}) "
                             f"= WORLD_SIZE / (tp * pp)")
    if (samples // dp) % (t.batch_size // dp):
        raise SetupError(f"per-rank samples ({samples // dp}) must be a multiple of the per-rank "
                         f"mini-batch batch_size / dp ({t.batch_size // dp})")


def check_groups(cfg: Config, estimator: AdvantageEstimator) -> None:
    """A group baseline needs >= 2 samples per prompt (each a singleton group otherwise). Groups
    never split across data-parallel ranks: each rank generates all n samples of its prompts."""
    n = cfg.actor_rollout.n_samples_per_prompt
    if estimator.needs_groups and n < 2:
        raise SetupError(f"algorithm.adv_estimator = {estimator.name!r} takes its baseline over each prompt's "
                         f"samples, but actor_rollout.n_samples_per_prompt = {n}: every group would be a single "
                         f"row (set it to >= 2, or use gae / reinforce_plus_plus)")
    r = cfg.reward
    if estimator.needs_greedy_baseline and (r.scaling != "none" or r.quantile_clip is not None):
        # the sampled scores' batch statistics would put the sample and its baseline on other scales
        raise SetupError(f"algorithm.adv_estimator = {estimator.name!r} compares each score with its prompt's "
                         f"greedy response's score, but reward.scaling = {r.scaling!r} / reward.quantile_clip = "
                         f"{r.quantile_clip!r} rescale the sampled scores by their batch statistics only; set "
                         f"reward.scaling none and reward.quantile_clip null")


def check_critic_warmup(cfg: Config, estimator: AdvantageEstimator) -> None:
    """A critic warm-up updates only the critic; an estimator without one would update nothing in
    those steps (rollouts and scores spent, the policy unchanged), so the pair is refused."""
    warm = cfg.training.critic_warmup_steps
    if warm and not estimator.needs_critic:
        raise SetupError(f"training.critic_warmup_steps (verl: trainer.critic_warmup) = {warm}, but "
                         f"algorithm.adv_estimator = {estimator.name!r} trains no critic: its first {warm} step(s) "
                         f"would update nothing (only the critic trains during a warm-up); set it to 0, or use "
                         f"gae")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


# ============================================================================ the builder


def build_models(cfg: Config, model_cfg, arch, features: gpt.Features, model_dir: Path, *, critic: bool,
                 device: torch.device):
    """(actor, reference, critic | None, actor optimizer, critic optimizer | None), in this order
    (the initialisation consumes the seeded RNG), every one on ``device`` in the config's dtype
    (the builders and wrappers check it: gpt.PlacementError). The reference is wrapped as the actor
    is, minus DDP, so that it computes the actor's logits exactly at step 0; with model.lora there is
    none (None): the reference is the actor's frozen base, its adapters off."""
    actor = gpt.build_actor(model_cfg, arch=arch, features=features, device=device)
    hf_io.load_actor_from_hf(actor, model_dir)
    try:  # model.lora: adapters on, the base frozen (only the adapters reach DDP's buffers and the optimizer)
        spec = lora.apply(actor, cfg.model.lora, seed=cfg.training.seed)
    except lora.LoraError as e:
        raise SetupError(str(e)) from None
    actor = gpt.wrap_ddp(actor, features=features)
    ref = None  # with LoRA the reference is the actor with its adapters off (trainer/passes.reference_logp)
    if spec is None:
        ref = gpt.build_actor(model_cfg, arch=arch, features=features, device=device)  # frozen initial policy
        hf_io.load_actor_from_hf(ref, model_dir)
        ref = gpt.wrap_frozen(ref)
    value = None
    if critic:  # SFT trunk + zero-initialised value head
        value = gpt.build_critic(model_cfg, arch=arch, features=features, device=device)
        hf_io.load_critic_trunk_from_hf(value, model_dir)
        value = gpt.wrap_ddp(value, features=features)
    t, m = cfg.training, cfg.model
    scaling = gpt.LossScaling(static=m.loss_scale, initial=m.initial_loss_scale, min=m.min_loss_scale,
                              window=m.loss_scale_window, hysteresis=m.loss_scale_hysteresis)
    actor_opt = gpt.build_optimizer(actor, lr=t.lr, weight_decay=t.weight_decay, grad_clip=t.grad_clip,
                                    loss_scaling=scaling)
    critic_opt = None if value is None else gpt.build_optimizer(
        value, lr=t.critic_lr, weight_decay=t.weight_decay, grad_clip=t.critic_grad_clip, loss_scaling=scaling)
    return actor, ref, value, actor_opt, critic_opt


def build_offload(cfg: Config, models: list[Optional[torch.nn.Module]], optimizers: list, *, device: torch.device,
                  log: Callable[[str], None]) -> TrainerOffload:
    """Colocation (trainer/colocation/offload.py): the trainer's states wait in host memory while the
    engine generates; the engine sleeps from the end of generation until the next weight sync.
    ``models``: actor first (its weights, which a refit reads, leave last), then critic and reference
    (None: not built)."""
    trained = [m for m in models if m is not None]
    opts = [o for o in optimizers if o is not None]
    return TrainerOffload(
        lambda: (x for src in [*(module_tensors(m) for m in trained), *(optimizer_tensors(o) for o in opts)]
                 for x in src),
        device=device, enabled=offload_enabled(cfg.training.offload_during_rollout, device),
        late=lambda: list(models[0].parameters()), log=log)


def policy_loss_params(cfg: Config, kernels: KernelBackend) -> PolicyLossParams:
    """The run's keyword scalars of every policy-loss variant (and the backend's fused loss)."""
    a = cfg.algorithm
    return PolicyLossParams(kernel_policy_loss=kernels.policy_loss, clip_ratio_low=a.clip_ratio_low,
                            clip_ratio_high=a.clip_ratio_high, dual_clip_c=a.dual_clip_c,
                            loss_agg_mode=a.loss_agg_mode, is_clip=a.pool.is_clip,
                            loss_scale_factor=a.loss_scale_factor or a.max_response_length,
                            clip_cov_ratio=a.clip_cov_ratio, clip_cov_lb=a.clip_cov_lb, clip_cov_ub=a.clip_cov_ub,
                            kl_cov_ratio=a.kl_cov_ratio, ppo_kl_coef=a.ppo_kl_coef, tau_pos=a.tau_pos,
                            tau_neg=a.tau_neg,
                            generator=torch.Generator().manual_seed(stream_seed("clip_cov", cfg.training.seed)),
                            correction=rollout_correction(a.rollout_correction))


def rollout_correction(c) -> Optional[RolloutCorrection]:
    """algorithm.rollout_correction as the loss's plain values (None when off)."""
    if not c.enabled:
        return None
    return RolloutCorrection(is_level=c.rollout_is, is_upper=c.rollout_is_threshold,
                             is_lower=c.rollout_is_threshold_lower, is_normalize=c.rollout_is_batch_normalize,
                             criteria=tuple(c.criteria()), loss_type=c.loss_type)


def check_async_nodes(*, tp: int, dp: int, local_world_size: int) -> None:
    """The asynchronous mode's generators must share global rank 0's node: each version's weight
    file is written once, in rank 0's node-local /dev/shm, and every replica leader's generator maps
    it. Replica d's leader is global rank tp * d (megatron's tp-dp-pp order); one replica may span
    nodes (its other ranks only learn the path). SetupError naming the replicas otherwise."""
    far = [d for d in range(dp) if tp * d >= local_world_size]
    if far:
        raise SetupError(
            f"algorithm.async_rl.enable: the generators of data-parallel replicas {far} would run on another node "
            f"than rank 0 (their leaders are global ranks {[tp * d for d in far]}, {local_world_size} ranks a node): "
            f"each version's weight file is written once, in rank 0's node-local /dev/shm, which they cannot map. "
            f"Not built yet (a writer per node); run the replicas' leaders on one node (fewer data-parallel "
            f"replicas: one replica may span nodes)")


def build_strategies(cfg: Config, *, gen: Generation, state: TrainState, par: ParallelInfo, dp: DataParallel,
                     estimator: AdvantageEstimator, kernels: KernelBackend, prompts: PromptSource, tokenizer: Tokenizer,
                     model_dir: Path, hf_cfg: dict, log: Callable[[str], None]) -> Strategies:
    """The behaviour policy (current policy, the PF-PPO pool, or the asynchronous mode's generator
    process), the collector, filtration, proximal log-probs, and the policy loss with its parameters."""
    a = cfg.algorithm
    n = cfg.actor_rollout.n_samples_per_prompt
    # --- PF-PPO: the behaviour-policy pool starts with the current (initial SFT) policy
    behaviour: BehaviourPolicy = (
        SnapshotPolicy(gen, a.pool, n=n, step=state.step, assign_gen=state.assign_gen, guards=state.guards,
                       dp_rank=par.dp_rank, log=log) if a.use_pf_ppo else CurrentPolicy(gen, n=n))
    collector: Collector = build_collector(cfg, prompts=prompts, log=log, pad_id=tokenizer.pad_id, dp=par.dp)
    if a.async_rl.enable:  # a generator process overlapped with training (trainer/asynchronous/)
        check_async_nodes(tp=par.tp, dp=par.dp, local_world_size=len(gen.sync.node_ranks))
        from pfppo_mega.trainer.asynchronous import build_async
        behaviour, collector = build_async(cfg, sync=gen.sync, model_dir=model_dir, hf_cfg=hf_cfg,
                                           next_batch=prompts.next_batch, state=state, rng=state.rng,
                                           tokenizer=tokenizer, device=par.device, log=log, dp_rank=par.dp_rank,
                                           replica_group=parallel.model_parallel_group(), rank=par.rank,
                                           first_rank_of_replica=par.tp_rank == 0 and par.pp_rank == 0,
                                           kernels=kernels)
    loss_name = choose_policy_loss(use_pool=a.use_pf_ppo or a.async_rl.enable, is_mode=a.pool.is_mode,
                                   name=a.policy_loss, rollout_correction=a.rollout_correction.enabled)
    return Strategies(behaviour=behaviour, collector=collector, filtration=choose_filtration(a.filtration,
                                                                                             state.assign_gen),
                      proximal=choose_proximal(a), estimator=estimator, policy_loss=get_policy_loss(loss_name),
                      policy_loss_params=policy_loss_params(cfg, kernels))


def check_turn_rows(turns: Turns, rows: list, *, log: Callable[[str], None]) -> None:
    """Every row's extra_info.tools_kwargs / interaction_kwargs against the configured tools, and against
    what the built-in tools' ``create`` / the interaction's ``start`` would refuse (``check_create`` /
    ``check_start``, e.g. a missing ground_truth): named errors at start, not at the step that draws the
    row."""
    for i, s in enumerate(rows):
        where = f"data row {s.row or i}"
        create, inter = row_kwargs(s.extra_info or {}, turns.toolset, where)
        checks = [(f"tool {name!r}", getattr(turns.toolset.tools[name], "check_create", None), kw)
                  for name, kw in create.items()]
        if inter is not None:
            checks.append((f"interaction {inter[0]!r}",
                           getattr(turns.toolset.interactions[inter[0]], "check_start", None), inter[1]))
        for what, check, kw in checks:
            if check is None:
                continue
            try:
                check(**kw)
            except (ValueError, TypeError) as e:
                raise ToolSetupError(f"{where}: {what} cannot start with it: {e}") from e
    log(f"[pfppo] multi-turn rollouts: tools {sorted(turns.toolset.tools) or 'none'}, interactions "
        f"{sorted(turns.toolset.interactions) or 'none'}"
        + ("" if turns.toolset.tools or turns.toolset.interactions else
           " (neither actor_rollout.multi_turn.tool_config_path nor interaction_config_path is set: every row is "
           "one turn, as in verl)"))


def build_run(cfg: Config, *, log: Callable[[str], None] = print) -> Run:
    torch.set_num_threads(cfg.training.num_threads)
    seed_everything(cfg.training.seed)
    out_dir = Path(cfg.logging.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    estimator: AdvantageEstimator = ADV_ESTIMATORS.get(cfg.algorithm.adv_estimator)
    check_groups(cfg, estimator)
    check_critic_warmup(cfg, estimator)

    # --- checkpoint, tokenizer, shapes: every check before any work
    try:  # the engine choice (rollout TP, vLLM installed, top_p), before any work
        check_engine_config(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    except EngineSetupError as e:
        raise SetupError(str(e)) from e
    model_dir = check_model_path(cfg.actor_rollout.model_path)
    tokenizer = Tokenizer.from_dir(model_dir)
    hf_cfg = hf_io.read_hf_config(model_dir)
    model_cfg = hf_io.model_config_from_hf(hf_cfg, cfg.model)
    arch = hf_io.architecture_from_hf(hf_cfg)  # family: biases, q/k norms, head_dim, RoPE scaling
    check_lengths(cfg, model_cfg, tokenizer)
    tp, pp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
    gpt.check_layout(model_cfg, tp=tp, pp=pp)
    # Training features (distributed optimizer, bf16, recompute, sequence parallelism, layer
    # spec) come from the config alone, so the plan, the Slurm script and the trainer agree.
    features = gpt.features_from_config(cfg)

    # --- parallel state (one place), then models and optimizers
    par = init_parallel(tp=tp, pp=pp, backend=cfg.parallel.backend, seed=cfg.training.seed,
                        timeout_s=cfg.parallel.collective_timeout_s, watchdog_s=cfg.parallel.watchdog_s)
    # The device rule (docs/scaling.md): everything that meets a model lives on the models' device;
    # collectives run on their group's device (pfppo_mega.parallel). PFPPO_DEVICE_CHECK=1 checks it.
    device = par.device
    is_logger = par.rank == 0
    gpt.check_features(model_cfg, features, device_type=device.type, tp=tp)
    log = log if is_logger else (lambda *_: None)
    check_batch_split(cfg, par.dp)
    # Batch statistics (advantage whitening, reward z-scores and running moments) are taken over
    # the global batch: the math gets this sum over the data-parallel ranks (None at dp = 1).
    dp = DataParallel.of(parallel.data_parallel_group(), par.dp)
    # One prompt stream for the job, the same on every rank: each replica draws the global batch
    # from it and keeps its slice, so the rows and their sampling seeds do not depend on the DP size.
    rng = random.Random(stream_seed("prompts", cfg.training.seed))
    # --- prompts and rewards: the implementations the config names (data.source, reward.*);
    # bad files / rows / data sources / reward functions are refused here, before any model
    try:  # multi-turn: the tools' schemas go into the prompts; every row's tool / interaction kwargs checked
        toolset = load_toolset(cfg.actor_rollout.multi_turn) if cfg.actor_rollout.multi_turn.enable else ToolSet()
        data = build_prompt_data(cfg, tokenizer, model_dir=model_dir, rng=rng, dp_rank=par.dp_rank, dp_size=par.dp,
                                 log=log, tools=toolset.schemas or None)
        turns = build_turns(cfg, tokenizer, data.template, toolset)
        if turns is not None:
            check_turn_rows(turns, data.train_rows + data.val, log=log)
    except (TurnsSetupError, ToolSetupError, TurnRenderError) as e:
        raise SetupError(str(e)) from e
    reward_fn: RewardFn = build_reward_fn(cfg, log=log)
    reward_fn.check(data.train_rows + data.val, "data")

    actor, ref, critic, actor_opt, critic_opt = build_models(cfg, model_cfg, arch, features, model_dir,
                                                             critic=estimator.needs_critic, device=device)
    kernels = get_backend(cfg.kernels, device, log=log)  # the models' device: auto = verified kernels only
    offload = build_offload(cfg, [actor, critic, ref], [actor_opt, critic_opt], device=device, log=log)

    # --- rollout engine (the one the config names), fed by EngineSync: bucketed refit from the
    # actor's shards, pool snapshots kept 1/L per node rank, one version assignment (docs/refit.md)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", par.world_size))  # an in-process vLLM resets it
    # the device-memory ledger of this rank (pfppo_mega/ledger.py, the plan's arithmetic): every phase is
    # entered as it runs and checked against the card; the engine is built with the trainer offloaded
    memory = MemoryRecorder.for_run(cfg, model_cfg=model_cfg, arch=arch, tp=tp, pp=pp, dp=par.dp, pp_rank=par.pp_rank,
                                    local_world=local_world, offload=offload, device=device)
    memory.enter("build trainer")
    try:
        engine = build_engine_colocated(lambda: build_engine(cfg, model_dir, hf_cfg, pad_token_id=tokenizer.pad_id,
                                                             world_size=par.world_size, device=device, log=log),
                                        offload=offload, memory=memory)
    except EngineSetupError as e:
        raise SetupError(str(e)) from e
    sync = EngineSync(engine, actor, model_cfg, refit_timeout_s=cfg.actor_rollout.refit_timeout_s,
                      local_world_size=local_world, log=log)
    assign_gen = torch.Generator().manual_seed(stream_seed("assignment", cfg.training.seed))
    state = TrainState(rng=rng, assign_gen=assign_gen,
                       value_guard=ValueLossGuard(cfg.training.value_loss_spike_factor))
    split = None if par.world_size == 1 else SplitLayout(  # rollout split across every engine
        world=par.world_size, rank=par.rank, rollout_tp=cfg.actor_rollout.tensor_model_parallel_size,
        dp_rank=par.dp_rank, replica_leader=par.tp_rank == 0 and par.pp_rank == 0)
    gen = Generation(cfg, engine=engine, sync=sync, offload=offload, tokenizer=tokenizer, rng=rng, device=device,
                     guards=state.guards, split=split, log=log, memory=memory, turns=turns)
    models = Models(model_cfg=model_cfg, arch=arch, features=features, actor=actor, ref=ref, critic=critic,
                    actor_opt=actor_opt, critic_opt=critic_opt, kernels=kernels)
    strategies = build_strategies(cfg, gen=gen, state=state, par=par, dp=dp, estimator=estimator, kernels=kernels,
                                  prompts=data.train, tokenizer=tokenizer, model_dir=model_dir, hf_cfg=hf_cfg, log=log)
    return Run(cfg=cfg, out_dir=out_dir, parallel=par, device=device, is_logger=is_logger, log=log, dp=dp,
               tokenizer=tokenizer, prompts=data.train, eval_samples=data.val, reward_fn=reward_fn, models=models,
               colocation=Colocation(engine=engine, sync=sync, gen=gen, offload=offload), strategies=strategies,
               state=state)
