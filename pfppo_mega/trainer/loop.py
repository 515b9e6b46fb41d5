"""The PPO training loop. One step reads top to bottom in named phases:

    rollout -> score -> prepare -> advantages -> update -> sync -> log

each a method with a typed input and output (see ``batch.py``). Models, engine and optimizers are
built once in ``PPOTrainer.__init__``; parallel state is set up in one place
(``pfppo_mega.parallel``) before any model is built.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import random
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pfppo_mega import ppo
from pfppo_mega.config import Config, config_to_dict, dump_yaml
from pfppo_mega.kernels import get_backend
from pfppo_mega.models import engine as mengine
from pfppo_mega.models import gpt, hf_io
from pfppo_mega import parallel
from pfppo_mega.parallel import init_parallel
from pfppo_mega import pool as pfpool
from pfppo_mega.pool.registry import broadcast_assignment
from pfppo_mega.data import build_prompt_data
from pfppo_mega.rewards import build_reward_fn
from pfppo_mega.rollout import SamplingParams
from pfppo_mega.rollout.weights import WeightUpdateError
from pfppo_mega.tokenizer import Tokenizer
from pfppo_mega.trainer import checkpoint as ckpt
from pfppo_mega.trainer.batch import (ExperienceBatch, PackedInputs, PreparedBatch, RolloutBatch, ScoredBatch,
                                      concat_rollouts, pack)
from pfppo_mega.trainer.metrics import (MetricsLogger, aggregate_rank_metrics, plot_curves, quantiles, read_jsonl,
                                        repetition_rate, truncate_jsonl)
from pfppo_mega.types import PromptSource, RewardFn, Sample
from pfppo_mega.trainer.policy_loss import (PolicyLossInputs, PolicyLossParams, choose_policy_loss,
                                            get_policy_loss)
from pfppo_mega.trainer.engine_sync import EngineSetupError, EngineSync, build_engine, check_engine_config
from pfppo_mega.trainer.seeds import stream_seed
from pfppo_mega.trainer import devicecheck
from pfppo_mega.trainer.offload import TrainerOffload, module_tensors, offload_enabled, optimizer_tensors
from pfppo_mega.trainer.value_guard import ValueLossGuard, pre_update_value_loss
from pfppo_mega.trainer import worst_samples


class SetupError(RuntimeError):
    """A problem found before any work starts (paths, checkpoint/config/tokenizer mismatch)."""


class TrainingHalted(RuntimeError):
    """The run cannot make progress (e.g. every update skipped for too long); the message says why.
    `pfppo train` exits non-zero with it."""


@dataclass
class PhaseTimer:
    seconds: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0


@dataclass
class RunResult:
    out_dir: Path
    metrics_path: Path
    plot_path: Path | None
    export_dir: Path | None
    eval_before: dict[str, float]
    eval_after: dict[str, float]
    steps: int
    wall_s: float


# ============================================================================ setup helpers


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
    for key, value in (("training.rollout_batch_size", t.rollout_batch_size), ("training.batch_size", t.batch_size)):
        if value % dp:
            raise SetupError(f"{key} ({value}) must be divisible by the data-parallel size dp ({dp}) "
                             f"= WORLD_SIZE / (tp * pp)")
    if (samples // dp) % (t.batch_size // dp):
        raise SetupError(f"per-rank samples ({samples // dp}) must be a multiple of the per-rank "
                         f"mini-batch batch_size / dp ({t.batch_size // dp})")


def tensor_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and tensor buffers of the unwrapped model (megatron's _extra_state dropped)."""
    return {k: v for k, v in gpt.unwrap(module).state_dict().items() if isinstance(v, torch.Tensor)}


def load_tensor_state(module: torch.nn.Module, sd: dict[str, torch.Tensor]) -> None:
    own = tensor_state(module)
    if own.keys() != sd.keys():
        raise ValueError(f"checkpoint tensors differ from the model: missing {sorted(own.keys() - sd.keys())}, "
                         f"unexpected {sorted(sd.keys() - own.keys())}")
    with torch.no_grad():
        for k, v in own.items():
            if v.shape != sd[k].shape:
                raise ValueError(f"checkpoint tensor {k}: shape {tuple(sd[k].shape)}, model {tuple(v.shape)}")
            v.copy_(sd[k])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


# ============================================================================ trainer


class PPOTrainer:
    def __init__(self, cfg: Config, *, log=print):
        self.cfg = cfg
        torch.set_num_threads(cfg.training.num_threads)
        seed_everything(cfg.training.seed)
        self.out_dir = Path(cfg.logging.output_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)

        # --- checkpoint, tokenizer, shapes: every check before any work
        try:  # the engine choice (rollout TP, vLLM installed, top_p), before any work
            check_engine_config(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")))
        except EngineSetupError as e:
            raise SetupError(str(e)) from e
        model_dir = check_model_path(cfg.actor_rollout.model_path)
        self.tokenizer = Tokenizer.from_dir(model_dir)
        hf_cfg = hf_io.read_hf_config(model_dir)
        self.model_cfg = hf_io.model_config_from_hf(hf_cfg, cfg.model)
        self.arch = hf_io.architecture_from_hf(hf_cfg)  # family: biases, q/k norms, head_dim, RoPE scaling
        check_lengths(cfg, self.model_cfg, self.tokenizer)
        tp, pp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
        gpt.check_layout(self.model_cfg, tp=tp, pp=pp)
        # Training features (distributed optimizer, bf16, recompute, sequence parallelism, layer
        # spec) come from the config alone, so the plan, the Slurm script and the trainer agree.
        self.features = gpt.features_from_config(cfg)

        # --- parallel state (one place), then models and optimizers
        self.parallel = init_parallel(tp=tp, pp=pp, backend=cfg.parallel.backend, seed=cfg.training.seed)
        # The device rule (docs/scaling.md): everything that meets a model lives on the models' device;
        # collectives run on their group's device (pfppo_mega.parallel). PFPPO_DEVICE_CHECK=1 checks it.
        self.device = self.parallel.device
        self.device_check = devicecheck.requested()
        self.is_logger = self.parallel.rank == 0
        gpt.check_features(self.model_cfg, self.features, device_type=self.parallel.device.type, tp=tp)
        self.log = log if self.is_logger else (lambda *_: None)
        check_batch_split(cfg, self.parallel.dp)
        # Batch statistics (advantage whitening, reward z-scores and running moments) are taken over
        # the global batch: the math gets this sum over the data-parallel ranks (None at dp = 1).
        self.dp_group = parallel.data_parallel_group()
        self.dp_sum = None if self.dp_group is None else functools.partial(parallel.dp_sum, group=self.dp_group)
        self.dp_gather = (None if self.dp_group is None
                          else functools.partial(parallel.dp_all_gather, group=self.dp_group))
        self.dp_max = None if self.dp_group is None else functools.partial(parallel.dp_max, group=self.dp_group)
        # Each data-parallel rank draws its own prompts and samples; the ranks of one model
        # replica (same dp_rank) draw the same ones.
        self.rng = random.Random(stream_seed("prompts", cfg.training.seed, dp_rank=self.parallel.dp_rank))
        # --- prompts and rewards: the implementations the config names (data.source, reward.*);
        # bad files / rows / data sources / reward functions are refused here, before any model
        data = build_prompt_data(cfg, self.tokenizer, model_dir=model_dir, rng=self.rng,
                                 dp_rank=self.parallel.dp_rank, dp_size=self.parallel.dp, log=self.log)
        self.prompts: PromptSource = data.train
        self.eval_samples: list[Sample] = data.val
        self.reward_fn: RewardFn = build_reward_fn(cfg, log=self.log)
        self.reward_fn.check(data.train_rows + data.val, "data")
        actor = gpt.build_actor(self.model_cfg, arch=self.arch, features=self.features)
        hf_io.load_actor_from_hf(actor, model_dir)
        self.actor = gpt.wrap_ddp(actor, features=self.features)
        # frozen copy of the initial policy
        self.ref = gpt.build_actor(self.model_cfg, arch=self.arch, features=self.features)
        hf_io.load_actor_from_hf(self.ref, model_dir)
        self.ref.eval().requires_grad_(False)
        # SFT trunk + zero-initialised value head
        critic = gpt.build_critic(self.model_cfg, arch=self.arch, features=self.features)
        hf_io.load_critic_trunk_from_hf(critic, model_dir)
        self.critic = gpt.wrap_ddp(critic, features=self.features)
        t = cfg.training
        self.actor_opt = gpt.build_optimizer(self.actor, lr=t.lr, weight_decay=t.weight_decay,
                                             grad_clip=t.grad_clip)
        self.critic_opt = gpt.build_optimizer(self.critic, lr=t.critic_lr, weight_decay=t.weight_decay,
                                              grad_clip=t.critic_grad_clip)
        self.kernels = get_backend(cfg.kernels)
        # Colocation (trainer/offload.py): the trainer's states wait in host memory while the engine
        # generates; the engine sleeps from the end of generation until the next weight sync.
        self.offload = TrainerOffload(
            lambda: (t for src in (module_tensors(self.actor), module_tensors(self.critic), module_tensors(self.ref),
                                   optimizer_tensors(self.actor_opt), optimizer_tensors(self.critic_opt))
                     for t in src),
            device=self.device, enabled=offload_enabled(t.offload_during_rollout, self.device), log=self.log)
        self.rollout_trainer_bytes = -1  # trainer bytes on the device during the last generation
        self.running_reward = ppo.RunningMoments()

        # --- rollout engine (the one the config names), fed by EngineSync: bucketed refit from the
        # actor's shards, pool snapshots kept 1/L per node rank, one version registry (docs/refit.md)
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", self.parallel.world_size))  # an in-process vLLM resets it
        try:
            self.engine = build_engine(cfg, model_dir, hf_cfg, pad_token_id=self.tokenizer.pad_id,
                                       world_size=self.parallel.world_size, log=self.log)
        except EngineSetupError as e:
            raise SetupError(str(e)) from e
        self.sync = EngineSync(self.engine, self.actor, self.model_cfg, local_world_size=local_world, log=self.log)
        self.assign_gen = torch.Generator().manual_seed(stream_seed("assignment", cfg.training.seed))
        self.step = 0
        self.guards = {"bad_rewards": 0, "reward_errors": 0, "reward_timeouts": 0, "skipped_updates": 0,
                       "corrupt_snapshots": 0, "value_loss_spikes": 0, "engine_failures": 0}
        self.value_guard = ValueLossGuard(cfg.training.value_loss_spike_factor)
        self.consecutive_skips = {"actor": 0, "critic": 0}  # optimizer updates skipped in a row, per model
        a = cfg.algorithm
        self.policy_loss_name = choose_policy_loss(use_pool=a.use_pf_ppo, is_mode=a.pool.is_mode)
        self.policy_loss = get_policy_loss(self.policy_loss_name)
        self.policy_loss_params = PolicyLossParams(
            kernel_policy_loss=self.kernels.policy_loss, clip_ratio_low=a.clip_ratio_low,
            clip_ratio_high=a.clip_ratio_high, dual_clip_c=a.dual_clip_c, loss_agg_mode=a.loss_agg_mode,
            is_clip=a.pool.is_clip)

        # --- PF-PPO: the behaviour-policy pool starts with the current (initial SFT) policy
        self.pool: pfpool.SnapshotPool | None = None
        if cfg.algorithm.use_pf_ppo:
            self.pool = self.sync.new_pool(cfg.algorithm.pool.pool_size)
            self.sync.capture(self.pool, self.step)
            self.log(f"[pfppo] PF-PPO pool: {cfg.algorithm.pool.pool_size} x "
                     f"{self.pool.bytes_per_snapshot / 1e6:.2f} MB snapshot shards per rank in host memory "
                     f"({self.pool.layout.nbytes / 1e6:.2f} MB per snapshot per node), "
                     f"sampling={cfg.algorithm.pool.sampling}, every {cfg.algorithm.pool.snapshot_interval} steps")
        self._resume()  # after the pool is built: a checkpoint's pool replaces it
        self.sync_weights(self.step)

    # ------------------------------------------------------------------ phase: rollout

    def rollout(self, samples: list[Sample]) -> tuple[RolloutBatch, dict[str, float]]:
        """Generate n samples per prompt. Plain PPO: with the current weights. PF-PPO: each
        prompt group (algorithm.pool.assign: group) or the whole step (step) samples a behaviour
        snapshot; groups are generated per snapshot so the engine switches weights at most once
        per snapshot used (from host memory, never disk)."""
        n = self.cfg.actor_rollout.n_samples_per_prompt
        if self.pool is None:
            return self._generate(samples, n), {}
        cands = self.pool.candidates(self.step, self.cfg.algorithm.pool.include_current)
        pc = self.cfg.algorithm.pool
        probs = pfpool.snapshot_weights([c.version for c in cands], method=pc.sampling,
                                        temperature=pc.sampling_temperature, current_version=self.step,
                                        kl=[c.kl_to_current for c in cands],
                                        mean_reward=[c.mean_reward for c in cands])
        assign = pfpool.assign_snapshots(len(samples), probs, self.assign_gen, per=pc.assign)  # [groups]
        assign = broadcast_assignment(assign, len(assign), group=self.sync.world)  # rank 0 decides
        parts, order, switch_s = [], [], 0.0
        used = pfpool.group_by_snapshot(assign)
        held = [k for k in used if cands[k].version == self.engine.weight_version]  # first: no reload for it
        for k in held + [k for k in used if k not in held]:
            groups = used[k]
            t0 = time.perf_counter()
            self._load_behaviour(cands[k])
            switch_s += time.perf_counter() - t0
            parts.append(self._generate([samples[g] for g in groups], n))
            order += [g * n + j for g in groups for j in range(n)]
        stats = {"pool/switch_s": switch_s, "pool/snapshots_used": float(len(parts)),
                 "pool/size": float(len(self.pool))}
        for k, c in enumerate(cands):
            stats[f"pool/slot{k}/prob"] = float(probs[k])
        return concat_rollouts(parts, order, pad_id=self.tokenizer.pad_id), stats

    def _colocated_rollout(self, samples: list[Sample]) -> tuple[RolloutBatch, dict[str, float]]:
        """The rollout phase with the trainer's states on the host (training.offload_during_rollout)
        and the engine put to sleep once it has generated, before those states come back."""
        self.engine.wake_up()
        with self.offload.offloaded():
            self.rollout_trainer_bytes = self.offload.device_bytes()
            try:
                rb, stats = self.rollout(samples)
            finally:
                self.engine.sleep()
        if self.offload.enabled:
            stats = {**stats, "time/offload_s": self.offload.last_offload_s, "time/reload_s": self.offload.last_reload_s}
        return rb, stats

    def _load_behaviour(self, cand: "pfpool.Candidate") -> None:
        """Put a candidate behaviour policy into the engine (its rows then carry its version). A
        snapshot that fails its checksum is evicted (counted) and the current weights are used."""
        if cand.snapshot is not None:
            try:
                with devicecheck.paused():  # the engine seam: host wire buffers by design
                    self.sync.switch(self.pool, cand.version)
                return
            except WeightUpdateError as e:  # every rank's engine refuses the same bytes: all evict alike
                self.pool.evict(cand.version)
                self.pool.n_corrupt += 1
                self.guards["corrupt_snapshots"] += int(self.parallel.dp_rank == 0)  # summed over DP below
                self.log(f"[pfppo] snapshot {cand.version} refused ({e}); evicted, generating with the current "
                         f"weights instead")
                if len(self.pool) == 0:  # never leave the pool empty: re-seed it with the current policy
                    with self.offload.on_device():  # the live weights, also while offloaded
                        self.sync.capture(self.pool, self.step)
        if self.engine.weight_version != self.step:  # version == step: the engine holds the current weights
            self.sync_weights(self.step)

    def _generate(self, samples: list[Sample], n: int) -> RolloutBatch:
        """n responses per prompt with whatever weights the engine holds (rows carry its version)."""
        cfg = self.cfg
        samples = [s for s in samples for _ in range(n)]
        prompt_ids = [list(s.prompt_ids) for s in samples]
        self._check_prompts(prompt_ids)
        params = SamplingParams(temperature=cfg.actor_rollout.temperature, top_p=cfg.actor_rollout.top_p,
                                max_new_tokens=cfg.algorithm.max_response_length,
                                eos_token_id=self.tokenizer.eos_id, seed=self.rng.randrange(1 << 31))
        with devicecheck.paused():  # the engine's own device world; its rows are host until moved
            out = self._guarded_generate(prompt_ids, params)
        devicecheck.mark_host(out.responses, out.response_mask, out.logprobs, out.finished)
        self.sync.check_versions(f"rollout at step {self.step}")  # every engine, same version and checksum
        texts = [self.tokenizer.decode(r[: int(l)].tolist()) for r, l in zip(out.responses, out.lengths)]
        return RolloutBatch(samples=samples, prompt_ids=prompt_ids, responses=out.responses,
                            response_mask=out.response_mask, behav_logp=out.logprobs, finished=out.finished,
                            versions=torch.full((len(samples),), out.weight_version), texts=texts).to(self.device)

    def _guarded_generate(self, prompt_ids: list[list[int]], params: SamplingParams):
        """engine.generate, agreed on by every rank. When it fails anywhere (an engine that died or
        raised mid-generation), every rank pushes the same verified weights again (the snapshot or
        the live weights it was generating with) and generates once more, counted in
        guard/engine_failures; a second failure stops the run with the ranks and the cause."""
        version = self.engine.weight_version
        for attempt in (1, 2):
            out, error = None, None
            try:
                out = self.engine.generate(prompt_ids, params)
            except Exception as e:  # any engine failure: agreed on below, so no rank is left waiting
                error = e
            bad = self.sync.failing_ranks(error is None)
            if not bad:
                return out
            cause = f"{type(error).__name__}: {error}" if error is not None else f"see rank {bad[0]}'s log"
            if attempt == 2:
                raise RuntimeError(
                    f"rollout at step {self.step}: the rollout engine failed on rank(s) {bad} again after its weights "
                    f"(version {version}) were pushed again; stopping ({cause})") from error
            self.guards["engine_failures"] += 1  # every rank agrees: no DP sum needed
            self.log(f"[pfppo] step {self.step}: the rollout engine failed on rank(s) {bad} ({cause}); pushing "
                     f"weight version {version} again and regenerating")
            with self.offload.on_device():  # the live weights, also while offloaded
                self.sync.reload(self.pool, version, self.step)
        raise AssertionError("unreachable")

    def _check_prompts(self, prompt_ids: list[list[int]]) -> None:
        limit = self.cfg.data.max_prompt_length
        for i, p in enumerate(prompt_ids):
            if len(p) > limit:
                raise ValueError(f"prompt {i} has {len(p)} tokens > data.max_prompt_length ({limit})")

    # ------------------------------------------------------------------ phase: score

    def score(self, rb: RolloutBatch) -> ScoredBatch:
        """Task rewards through the guard (a raising / None / NaN reward scores 0 and is counted),
        then the reward preprocessing. z-scores and quantiles use the global batch (every DP rank's
        rows)."""
        cfg = self.cfg.reward
        with devicecheck.paused():  # reward functions run on the host (texts in, scores out)
            guarded = self.reward_fn(rb.samples, rb.texts, rb.finished.tolist())
        devicecheck.mark_host(guarded.scores, guarded.honest, guarded.hacked)
        raw = guarded.scores.to(self.device)                                          # [B] finite
        lengths = rb.response_mask.sum(1)
        scores = raw
        if cfg.length_penalty:
            scores = ppo.length_penalty(scores, lengths, coef=cfg.length_penalty,
                                        max_length=self.cfg.algorithm.max_response_length)
        # The running moments are updated inside scale_rewards (once per batch, global batch).
        scores = ppo.scale_rewards(scores, method=cfg.scaling, running=self.running_reward,
                                   reduce_sum=self.dp_sum)
        scores = ppo.quantile_clip(scores, quantile=cfg.quantile_clip, gather=self.dp_gather)
        scores = ppo.clip_rewards(scores, clip_range=cfg.clip_range)
        return ScoredBatch(rollout=rb, raw_scores=raw, scores=scores, n_bad_rewards=guarded.nonfinite,
                           n_reward_errors=guarded.errors, n_reward_timeouts=guarded.timeouts,
                           honest=None if guarded.honest is None else guarded.honest.to(self.device),
                           hacked=None if guarded.hacked is None else guarded.hacked.to(self.device))

    def filter(self, sb: ScoredBatch) -> ScoredBatch:
        """Policy filtration (verl's pf_ppo): resample the batch with reward-derived weights."""
        f = self.cfg.algorithm.filtration
        if not f.enable:
            return sb
        w = ppo.filtration_weights(sb.raw_scores, method=f.reweight_method, weight_pow=f.weight_pow)
        # a host decision: assign_gen is a CPU generator (multinomial refuses it for CUDA weights)
        idx = ppo.resample_indices(w.cpu(), num_samples=len(sb.raw_scores), generator=self.assign_gen)
        return sb.select(idx.tolist())

    # ------------------------------------------------------------------ phase: prepare

    def _mbs(self, rows: int) -> int:
        return self.cfg.training.micro_batch_size or rows

    def _policy_logp(self, model, inp: PackedInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-prob and entropy of the response tokens under logits / temperature.  [B, T] each.
        Through megatron's schedule: any TP x PP layout, vocab-parallel at tp > 1."""
        return mengine.forward_logp_entropy(model, inp, temperature=self.cfg.actor_rollout.temperature,
                                            micro_batch_size=self._mbs(inp.labels.shape[0]),
                                            kernels=self.kernels)

    def _values(self, inp: PackedInputs) -> torch.Tensor:
        return mengine.forward_values(self.critic, inp, micro_batch_size=self._mbs(inp.labels.shape[0]))  # [B, T]

    @torch.no_grad()
    def prepare(self, sb: ScoredBatch) -> PreparedBatch:
        rb = sb.rollout
        inp = pack(rb.prompt_ids, rb.responses, rb.response_mask, pad_id=self.tokenizer.pad_id, device=self.device)
        old_logp, entropy = self._policy_logp(self.actor, inp)
        ref_logp, _ = self._policy_logp(self.ref, inp)
        values = self._values(inp)
        m = inp.response_mask
        devicecheck.expect("prepare: model inputs and results", self.device, inputs=inp, old_logp=old_logp,
                           ref_logp=ref_logp, values=values, scores=sb.scores)
        return PreparedBatch(inputs=inp, old_logp=old_logp * m, ref_logp=ref_logp * m, values=values * m,
                             entropy=entropy * m)

    # ------------------------------------------------------------------ phase: advantages

    def advantages(self, sb: ScoredBatch, prep: PreparedBatch) -> ExperienceBatch:
        a = self.cfg.algorithm
        inp, old_logp, ref_logp, values, entropy = (prep.inputs, prep.old_logp, prep.ref_logp, prep.values,
                                                    prep.entropy)
        m = inp.response_mask
        token_rewards = ppo.scores_to_token_rewards(sb.scores, m)                   # [B, T]
        if not a.use_kl_loss and a.kl_coeff > 0:
            token_rewards, kl_ref = ppo.apply_kl_penalty(token_rewards, old_logp, ref_logp, m,
                                                         kl_coeff=a.kl_coeff, estimator=a.kl_estimator)
        else:
            kl_ref = ppo.kl_estimate(old_logp, ref_logp, estimator=a.kl_estimator) * m
        adv, returns = self.kernels.gae(token_rewards, values, m, gamma=a.gamma, lam=a.lmbda)
        if a.whiten_advantages:  # over the global batch's tokens (every DP rank's)
            adv = ppo.masked_whiten(adv, m, reduce_sum=self.dp_sum)
        behav_logp = sb.rollout.behav_logp * m
        # Rows generated by the current weights: behaviour == proximal policy, IS weight exactly 1.
        on_policy = sb.rollout.versions == self.step                                   # [B]
        is_weights, pg_mask, is_stats = None, m, None
        if self.pool is not None:
            is_weights, pg_mask, is_stats = pfpool.behaviour_is_weights(
                old_logp, behav_logp, m, mode=a.pool.is_mode, is_clip=a.pool.is_clip, on_policy=on_policy,
                reduce_sum=self.dp_sum, reduce_max=self.dp_max)  # is/* stats of the global batch
        eb = ExperienceBatch(inputs=inp, old_logp=old_logp, behav_logp=behav_logp,
                             ref_logp=ref_logp, old_values=values, token_rewards=token_rewards,
                             advantages=adv, returns=returns, kl_ref=kl_ref, entropy=entropy,
                             pg_mask=pg_mask, is_weights=is_weights, on_policy=on_policy, is_stats=is_stats)
        devicecheck.expect("advantages: experience batch", self.device, experience=eb)
        return eb

    # ------------------------------------------------------------------ phase: update

    def update(self, eb: ExperienceBatch) -> dict[str, float]:
        """ppo_epochs passes of shuffled mini-batches (batch_size / dp rows on this rank); each
        mini-batch is one critic and one actor optimizer step, micro-batched by the engine."""
        a, t = self.cfg.algorithm, self.cfg.training
        B = eb.advantages.shape[0]
        stats: dict[str, list[float]] = {}
        train_actor = self.step >= t.critic_warmup_steps
        # value-loss spike guard (trainer/value_guard.py): judged on the loss before any update
        vl_pre = pre_update_value_loss(eb.old_values, eb.returns, eb.inputs.response_mask, reduce_sum=self.dp_sum)
        train_critic = not self.value_guard.is_spike(vl_pre)
        if not train_critic:
            self.guards["value_loss_spikes"] += 1
        stats["critic/value_loss_pre"] = [vl_pre]
        g = torch.Generator().manual_seed(stream_seed("minibatches", t.seed, step=self.step))
        for _ in range(a.ppo_epochs):
            for idx in torch.randperm(B, generator=g).split(t.batch_size // self.parallel.dp):
                mb = eb.select(idx)
                for k, v in (self._critic_step(mb) if train_critic else {}).items():
                    stats.setdefault(k, []).append(v)
                if train_actor:
                    for k, v in self._actor_step(mb).items():
                        stats.setdefault(k, []).append(v)
        return {k: sum(v) / len(v) for k, v in stats.items()}

    def _actor_step(self, eb: ExperienceBatch) -> dict[str, float]:
        """Policy loss (+ KL loss, - entropy bonus). The loss function returns each micro-batch's
        share of the mini-batch aggregate (see pfppo_mega.models.engine)."""
        a = self.cfg.algorithm
        mode = a.loss_agg_mode
        # The chosen variant's loss aggregates over pg_mask (ppo_clip) or the response mask (tis).
        pg_norm = mengine.global_normalizers(eb.pg_mask if self.policy_loss_name == "ppo_clip"
                                             else eb.inputs.response_mask)

        def loss_fn(logp, entropy, micro: mengine.MicroBatch):
            r = micro.rows
            m = micro.inputs.response_mask
            pl_in = PolicyLossInputs(
                logp=logp, old_logp=eb.old_logp[r], behav_logp=eb.behav_logp[r], advantages=eb.advantages[r],
                mask=m, pg_mask=eb.pg_mask[r], is_weights=None if eb.is_weights is None else eb.is_weights[r],
                on_policy=eb.on_policy[r])
            devicecheck.expect("policy loss", self.device, inputs=pl_in, entropy=entropy, ref_logp=eb.ref_logp[r])
            pl = self.policy_loss(pl_in, self.policy_loss_params)
            share = pl.loss * mengine.share_scale(pl.mask, pg_norm, mode=mode)
            resp_share = mengine.share_scale(m, micro.norm, mode=mode)
            kl_loss = logp.new_zeros(())
            if a.use_kl_loss and a.kl_coeff > 0:
                kl_loss = ppo.agg_loss(ppo.kl_estimate(logp, eb.ref_logp[r], estimator=a.kl_estimator), m, mode=mode)
                share = share + a.kl_coeff * kl_loss * resp_share
            ent = ppo.agg_loss(entropy, m, mode=mode)
            if a.entropy_coeff > 0:
                share = share - a.entropy_coeff * ent * resp_share
            return share, {**pl.stats, "policy/kl_loss": kl_loss.detach(), "policy/entropy": ent.detach()}

        self.actor.train()
        res = mengine.train_step(self.actor, self.actor_opt, eb.inputs, loss_fn,
                                 temperature=self.cfg.actor_rollout.temperature,
                                 micro_batch_size=self._mbs(eb.advantages.shape[0]),
                                 kernels=self.kernels)
        self._count_skip("actor", res)
        return {**res.stats, "policy/loss": res.loss, "policy/grad_norm": res.grad_norm}

    def _critic_step(self, eb: ExperienceBatch) -> dict[str, float]:
        a = self.cfg.algorithm

        def loss_fn(values, micro: mengine.MicroBatch):
            r = micro.rows
            m = micro.inputs.response_mask
            devicecheck.expect("value loss", self.device, values=values, old_values=eb.old_values[r],
                               returns=eb.returns[r], mask=m)
            out = ppo.value_loss(values, eb.old_values[r], eb.returns[r], m, value_clip=a.value_clip,
                                 loss_agg_mode=a.loss_agg_mode)
            share = a.vf_coef * out.loss * mengine.share_scale(m, micro.norm, mode=a.loss_agg_mode)
            return share, {"critic/value_loss": out.loss.detach(), "critic/vf_clipfrac": out.vf_clipfrac}

        self.critic.train()
        res = mengine.critic_train_step(self.critic, self.critic_opt, eb.inputs, loss_fn,
                                        micro_batch_size=self._mbs(eb.advantages.shape[0]))
        self._count_skip("critic", res)
        return {**res.stats, "critic/grad_norm": res.grad_norm}

    def _count_skip(self, model: str, res: "mengine.StepResult") -> None:
        """A NaN/inf loss or a refused step is skipped and counted (the loss is global, so every
        rank skips together); training.max_consecutive_skipped_updates in a row of one model halt
        the run: it is not learning."""
        if res.update_successful:
            self.consecutive_skips[model] = 0
            return
        self.guards["skipped_updates"] += 1
        self.consecutive_skips[model] += 1
        limit = self.cfg.training.max_consecutive_skipped_updates
        if limit and self.consecutive_skips[model] >= limit:
            raise TrainingHalted(
                f"step {self.step + 1}: {self.consecutive_skips[model]} consecutive {model} updates were skipped "
                f"(last loss {res.loss}, non-finite or refused by the optimizer) >= "
                f"training.max_consecutive_skipped_updates ({limit}); stopping: the run is not learning. "
                f"Check lr, kl_coeff, rewards and the model weights (0 disables this check).")

    # ------------------------------------------------------------------ phase: sync

    def sync_phase(self) -> None:
        """Plain PPO: push the updated weights to the engine. PF-PPO: snapshot them into the pool
        every snapshot_interval steps (the rollout phase loads whichever snapshot it samples)."""
        if self.pool is None:
            self.sync_weights(self.step)
        elif pfpool.snapshot_due(self.step, self.cfg.algorithm.pool.snapshot_interval):
            with devicecheck.paused():  # snapshots live in host memory by design
                self.sync.capture(self.pool, self.step)

    def sync_weights(self, version: int) -> None:
        self.engine.wake_up()  # a sleeping engine takes no weights
        # on_device: a live refit inside the rollout phase (PF-PPO's current policy) while offloaded;
        # paused: the engine seam keeps host wire buffers by design
        with self.offload.on_device(), devicecheck.paused():
            self.sync.refit_live(version)

    # ------------------------------------------------------------------ evaluation

    def evaluate(self) -> dict[str, float]:
        """Held-out accuracy of the current weights: sampled at the rollout temperature (the
        policy's own success rate, seeded) and greedy."""
        self.engine.wake_up()
        if self.engine.weight_version != self.step:  # the engine may hold a behaviour snapshot
            self.sync_weights(self.step)
        prompts = [list(s.prompt_ids) for s in self.eval_samples]
        sources = sorted({s.data_source for s in self.eval_samples})
        ar = self.cfg.actor_rollout
        out = {}
        for key, greedy in (("eval/accuracy", False), ("eval/accuracy_greedy", True)):
            params = SamplingParams(temperature=ar.temperature, top_p=ar.top_p, greedy=greedy,
                                    max_new_tokens=self.cfg.algorithm.max_response_length,
                                    eos_token_id=self.tokenizer.eos_id,
                                    seed=stream_seed("eval", self.cfg.training.seed))
            gen = self.engine.generate(prompts, params)
            # Same guard as training: a bad reward scores 0 and is counted (every rank evaluates the
            # same prompts, so the counts are already global).
            texts = [self.tokenizer.decode(r[: int(l)].tolist()) for r, l in zip(gen.responses, gen.lengths)]
            guarded = self.reward_fn(self.eval_samples, texts, gen.finished.tolist())
            self.guards["bad_rewards"] += guarded.nonfinite
            self.guards["reward_errors"] += guarded.errors
            self.guards["reward_timeouts"] += guarded.timeouts
            out[key] = float(guarded.scores.double().sum()) / len(self.eval_samples)
            suffix = key.split("/", 1)[1].removeprefix("accuracy")  # "" or "_greedy"
            if guarded.honest is not None:  # reward.shaping: the honest metric apart from the trained-on
                out[f"eval/honest_accuracy{suffix}"] = float(guarded.honest.double().sum()) / len(self.eval_samples)
            out[f"eval/length_mean{suffix}"] = float(gen.lengths.double().mean())
            for ds in sources:  # per data_source: eval/<data_source>/accuracy[_greedy]
                rows = [i for i, s in enumerate(self.eval_samples) if s.data_source == ds]
                out[f"eval/{ds}/{key.split('/', 1)[1]}"] = float(guarded.scores[rows].double().mean())
        return out

    @torch.no_grad()
    def kl_probe(self) -> float:
        """KL(current || reference) per token on fresh samples of the current policy (held-out
        prompts, fixed seed): the same estimator whichever behaviour policies trained it."""
        self.engine.wake_up()
        if self.engine.weight_version != self.step:
            self.sync_weights(self.step)
        ar = self.cfg.actor_rollout
        prompts = [list(s.prompt_ids) for s in self.eval_samples[: self.cfg.logging.kl_probe_size]]
        with devicecheck.paused():
            out = self.engine.generate(prompts, SamplingParams(
                temperature=ar.temperature, top_p=ar.top_p, max_new_tokens=self.cfg.algorithm.max_response_length,
                eos_token_id=self.tokenizer.eos_id, seed=stream_seed("kl_probe", self.cfg.training.seed,
                                                                     step=self.step)))
        devicecheck.mark_host(out.responses, out.response_mask)
        inp = pack(prompts, out.responses, out.response_mask, pad_id=self.tokenizer.pad_id, device=self.device)
        logp, _ = self._policy_logp(self.actor, inp)
        ref, _ = self._policy_logp(self.ref, inp)
        return ppo.masked_mean(logp - ref, inp.response_mask).item()

    # ------------------------------------------------------------------ one step, and the run

    def train_step(self) -> dict[str, float]:
        """One step; with PFPPO_DEVICE_CHECK=1 inside a device-check session (trainer/devicecheck.py)."""
        if not self.device_check:
            return self._train_step()
        with devicecheck.session(self.device):
            return self._train_step()

    def _train_step(self) -> dict[str, float]:
        timer = PhaseTimer()
        t0 = time.perf_counter()
        samples = self.prompts.next_batch(self.cfg.training.rollout_batch_size // self.parallel.dp)
        corrupt_before = self.guards["corrupt_snapshots"]
        with timer("rollout"):
            rb, pool_stats = self._colocated_rollout(samples)
        with timer("score"):
            scored = self.score(rb)      # every generated row: rewards, responses and pool statistics
            sb = self.filter(scored)     # the rows the update trains on (policy filtration resamples)
        self._add_guard_counts(scored, corrupt=self.guards["corrupt_snapshots"] - corrupt_before)
        with timer("prepare"):
            prep = self.prepare(sb)
        with timer("advantages"):
            eb = self.advantages(sb, prep)
        with timer("update"):
            upd = self.update(eb)
        self.step += 1
        with timer("sync"):
            self.sync_phase()
        step_s = time.perf_counter() - t0
        probe = {"kl/probe_k1": self.kl_probe()} if self.cfg.logging.kl_probe_size else {}
        metrics = self._step_metrics(scored, eb, upd, timer, step_s)
        metrics.update(pool_stats)
        metrics.update(probe)
        if self.pool is not None:
            metrics.update(self._pool_metrics(scored, sb, eb))
        if self.is_logger and self.cfg.logging.worst_samples:
            self._dump_worst(scored)
        return self._aggregate_over_dp(metrics)

    def _dump_worst(self, sb: ScoredBatch) -> None:
        """The step's longest, most repetitive and highest-reward samples -> samples_worst.jsonl
        (trainer/worst_samples.py; rank 0's rows)."""
        rb = sb.rollout
        lengths = [int(v) for v in rb.response_mask.sum(1).tolist()]
        rep = [repetition_rate(r[:n].tolist()) for r, n in zip(rb.responses, lengths)]
        rewards = sb.raw_scores.tolist()
        honest = None if sb.honest is None else sb.honest.tolist()
        recs = [worst_samples.WorstSample(
            step=self.step, kind=kind, rank=rank, row=rb.samples[i].row, prompt=rb.samples[i].prompt_text,
            text=rb.texts[i], length=lengths[i], repetition=round(rep[i], 4), reward=rewards[i],
            honest=None if honest is None else honest[i], finished=bool(rb.finished[i]),
            version=int(rb.versions[i]))
            for kind, rank, i in worst_samples.pick_worst(lengths, rep, rewards, self.cfg.logging.worst_samples)]
        worst_samples.append(self.out_dir / worst_samples.FILE, recs)

    def _add_guard_counts(self, scored: ScoredBatch, *, corrupt: int) -> None:
        """Make the guard counters global: add this step's bad rewards of every DP rank, and replace
        this rank's corrupt snapshots of the step (`corrupt`, already counted) by every rank's.
        (Skipped updates need no sum: the loss is global, every rank skips together.)"""
        counts = torch.tensor([scored.n_bad_rewards, scored.n_reward_errors, scored.n_reward_timeouts, corrupt],
                              dtype=torch.long)
        bad, errors, timeouts, all_corrupt = parallel.dp_sum(counts, self.dp_group).tolist()
        self.guards["bad_rewards"] += bad
        self.guards["reward_errors"] += errors
        self.guards["reward_timeouts"] += timeouts
        self.guards["corrupt_snapshots"] += all_corrupt - corrupt

    def _aggregate_over_dp(self, metrics: dict[str, float]) -> dict[str, float]:
        """One record from every data-parallel rank's (each saw its own part of the batch): maxima by
        max, rates and counts by sum, means by mean (trainer.metrics.aggregate_rank_metrics)."""
        if self.dp_group is None:
            return metrics
        return aggregate_rank_metrics(parallel.dp_gather_objects(metrics, self.dp_group))

    def _pool_metrics(self, scored: ScoredBatch, sb: ScoredBatch, eb: ExperienceBatch) -> dict[str, float]:
        """Per-snapshot sample count, reward, KL to current, IS weights; feeds the pool's stats.
        Counts and rewards (which `sampling: reward` reads) come from every generated row (`scored`),
        the IS and KL statistics from the rows the update trained on (`sb`, `eb`)."""
        a = self.cfg.algorithm
        m = eb.inputs.response_mask
        per = pfpool.per_snapshot_stats(sb.rollout.versions, sb.raw_scores, eb.is_weights, m, eb.behav_logp,
                                        eb.old_logp, is_clip=a.pool.is_clip, on_policy=eb.on_policy)
        out: dict[str, float] = {"pool/bytes": float(self.pool.bytes_total()),
                                 "guard/corrupt_snapshots": float(self.guards["corrupt_snapshots"])}
        agg = eb.is_stats
        out.update({"is/mean": agg.mean, "is/max": agg.max, "is/frac_truncated": agg.frac_truncated,
                    "is/ess": agg.ess})
        current = self.step - 1  # the version the rollout treated as current
        versions = scored.rollout.versions
        # Keyed by recency rank (snap0 = newest behaviour policy used this step), not by version,
        # so the curves stay comparable over a run.
        for rank, version in enumerate(sorted(set(versions.tolist()), reverse=True)):
            rows = versions == version
            st = per.get(version)  # None when filtration resampled none of its rows
            signal = (scored.honest if a.pool.reward_signal == "honest" and scored.honest is not None
                      else scored.raw_scores)
            self.pool.record_samples(version, signal[rows],
                                     kl_to_current=None if st is None else st.kl_to_current,
                                     current_version=current)
            out[f"pool/snap{rank}/age"] = float(current - version)
            stats = {} if st is None else dataclasses.asdict(st)
            stats.update(count=int(rows.sum()), reward_mean=float(scored.raw_scores[rows].double().mean()))
            for k, v in stats.items():
                if v is not None:
                    out[f"pool/snap{rank}/{k}"] = float(v)
        return out

    def _step_metrics(self, sb: ScoredBatch, eb: ExperienceBatch, upd: dict[str, float],
                      timer: PhaseTimer, step_s: float) -> dict[str, float]:
        """reward/* and response/* describe every generated row (`sb`, before policy filtration);
        the KL, entropy, critic and update metrics the rows trained on (`eb`)."""
        rb, m = sb.rollout, eb.inputs.response_mask
        lengths = rb.response_mask.sum(1)                                               # [B] generated
        # std and quantiles of the global batch (every DP rank's rewards), not a mean of the ranks'
        raw = sb.raw_scores if self.dp_gather is None else self.dp_gather(sb.raw_scores)  # [B * dp]
        first10 = m.clone()
        first10[:, 10:] = 0
        gen_tokens = float(lengths.sum())
        k1 = ppo.masked_mean(eb.old_logp - eb.ref_logp, m).item()
        # KL(current || ref) per token on the current policy's own distribution: under PF-PPO the
        # samples come from older snapshots, so weight each sequence by pi_cur(y)/pi_behav(y)
        # (self-normalised). Plain PPO: weights ~1 and this equals kl/ref_k1.
        seq_w = torch.softmax(((eb.old_logp - eb.behav_logp) * m).sum(1).double(), dim=0)   # [B]
        kl_cur = float((seq_w * ((eb.old_logp - eb.ref_logp) * m).sum(1)).sum() / (seq_w * m.sum(1)).sum())
        metrics = {
            "reward/mean": raw.mean().item(), "reward/std": raw.std().item() if len(raw) > 1 else 0.0,
            **{f"reward/{k}": v for k, v in quantiles(raw).items()},
            "reward/scaled_mean": sb.scores.mean().item(),
            **self._honest_metrics(sb),
            "kl/ref_mean": ppo.masked_mean(eb.kl_ref, m).item(), "kl/ref_k1": k1, "kl/ref_k1_current": kl_cur,
            "response/length_mean": lengths.mean().item(), "response/length_max": lengths.max().item(),
            "response/finished_frac": rb.finished.float().mean().item(),
            "response/repetition_rate": sum(repetition_rate(r[: int(l)].tolist())
                                            for r, l in zip(rb.responses, lengths)) / len(lengths),
            "policy/entropy_first10": ppo.masked_mean(eb.entropy, first10).item(),
            **self._logp_gap(eb),
            "critic/value_mean": ppo.masked_mean(eb.old_values, m).item(),
            "critic/return_mean": ppo.masked_mean(eb.returns, m).item(),
            "guard/bad_rewards": float(self.guards["bad_rewards"]),
            "guard/reward_errors": float(self.guards["reward_errors"]),
            "guard/reward_timeouts": float(self.guards["reward_timeouts"]),
            "guard/skipped_updates": float(self.guards["skipped_updates"]),
            "guard/engine_failures": float(self.guards["engine_failures"]),
            "guard/value_loss_spikes": float(self.guards["value_loss_spikes"]),
            "perf/step_s": step_s, "perf/tokens_per_s": gen_tokens / step_s,
            **{f"time/{k}_s": v for k, v in timer.seconds.items()},
            **upd,
        }
        return metrics

    @staticmethod
    def _honest_metrics(sb: ScoredBatch) -> dict[str, float]:
        """reward/honest (the honest metric, apart from the trained-on reward/mean) and
        reward/hacked_frac, when the reward function reports them (rewards/shaping.py)."""
        out = {}
        if sb.honest is not None:
            out["reward/honest"] = sb.honest.double().mean().item()
        if sb.hacked is not None:
            out["reward/hacked_frac"] = sb.hacked.double().mean().item()
        return out

    @staticmethod
    def _logp_gap(eb: ExperienceBatch) -> dict[str, float]:
        """|engine log-prob - trainer log-prob| per token over the on-policy rows only (the same
        weights on both sides, so it measures engine/trainer numerics; under PF-PPO the other rows
        come from older snapshots and differ by design). No on-policy rows: no record."""
        m = eb.inputs.response_mask * eb.on_policy[:, None]                            # [B, T]
        if not bool(m.any()):
            return {}
        gap = (eb.behav_logp - eb.old_logp).abs()
        return {"rollout/logp_gap_max": float(torch.where(m.bool(), gap, 0.0).max()),
                "rollout/logp_gap_mean": ppo.masked_mean(gap, m).item()}

    def fit(self) -> RunResult:
        cfg = self.cfg
        t_start = time.monotonic()
        total = cfg.training.total_training_steps
        if self.is_logger:
            (self.out_dir / "config.yaml").write_text(dump_yaml(cfg))
            # like metrics.jsonl: records after the step this run starts at are dropped
            truncate_jsonl(self.out_dir / worst_samples.FILE, keep_through_step=self.step if self.step > 0 else -1)
        logger = MetricsLogger(self.out_dir, tensorboard=cfg.logging.tensorboard and self.is_logger,
                               progress=cfg.logging.progress and self.is_logger, total_steps=total,
                               enabled=self.is_logger, start_step=self.step)
        ckpt_root = self.out_dir / "checkpoints"
        eval_before = self.evaluate()
        self.log(f"[pfppo] held-out accuracy at step {self.step} ({len(self.eval_samples)} prompts): "
                 f"sampled {eval_before['eval/accuracy']:.3f}, greedy {eval_before['eval/accuracy_greedy']:.3f}")
        if self.step == 0:
            logger.log(0, eval_before)
        eval_acc = eval_before
        while self.step < total:
            metrics = self.train_step()
            ev = cfg.logging.eval_interval
            if (ev and self.step % ev == 0) or self.step == total:
                eval_acc = self.evaluate()
                metrics.update(eval_acc)
            if self.step % cfg.logging.log_interval == 0 or "eval/accuracy" in metrics:
                logger.log(self.step, metrics)
            si = cfg.checkpoint.save_interval
            stop = self._stop_requested()  # Slurm asked for a checkpoint before preemption / time limit
            if (si and self.step % si == 0) or self.step == total or stop:
                self.save(ckpt_root)  # once per step, whichever reasons coincide
            if stop:
                self.log(f"[pfppo] stop requested ($PFPPO_STOP_FILE): checkpointed step {self.step}, exiting")
                break
        logger.close()
        plot = None
        if cfg.logging.plots and self.is_logger:
            plot = plot_curves(read_jsonl(logger.jsonl_path), self.out_dir / "curves.png",
                               title=f"PPO on {cfg.data.task if cfg.data.source == 'task' else 'data.train_files'} "
                                     f"({self.model_cfg.num_layers} layers)")
        export = None
        if cfg.checkpoint.export_hf:
            export = self.out_dir / "hf_export"
            hf_io.export_hf(self.actor, self.model_cfg, export, tokenizer_files=self.tokenizer.files())
        result = RunResult(out_dir=self.out_dir, metrics_path=logger.jsonl_path, plot_path=plot,
                           export_dir=export, eval_before=eval_before, eval_after=eval_acc,
                           steps=self.step, wall_s=time.monotonic() - t_start)
        if self.is_logger:
            (self.out_dir / "summary.json").write_text(json.dumps(
            {"eval_before": eval_before, "eval_after": eval_acc, "steps": self.step,
             "wall_s": result.wall_s, "guards": self.guards}, indent=2))
        return result

    # ------------------------------------------------------------------ checkpoints

    def _ckpt_dir(self, root: Path) -> Path:
        """One checkpoint series per model-parallel rank (its TP/PP shards); dp_rank 0 writes it."""
        p = self.parallel
        return root if p.tp * p.pp == 1 else root / f"mp-tp{p.tp_rank}-pp{p.pp_rank}"

    def _pool_shard_dir(self, ckpt_dir: Path) -> Path:
        """Where dp_rank > 0 keeps its own shards of the sharded PF-PPO pool (dp_rank 0's are in the
        checkpoint itself): a checkpoint series of its own inside the model-parallel rank's dir."""
        return ckpt_dir / f"pool-dp{self.parallel.dp_rank}"

    def save(self, root: Path) -> Path | None:
        """Checkpoint this step (once: a second call at the same step writes nothing)."""
        if self._saved_step == self.step:
            return None
        self._saved_step = self.step
        # the distributed optimizer's state is gathered to dp_rank 0: every DP rank takes part
        opt_states = {name: ckpt.optimizer_state(opt) for name, opt in (("actor_opt", self.actor_opt),
                                                                         ("critic_opt", self.critic_opt))}
        if self.parallel.dp_rank != 0:
            if self.pool is not None:  # the node's pool is split across its ranks: each saves its own shards
                ckpt.save_checkpoint(self._pool_shard_dir(self._ckpt_dir(root)), self.step,
                                     {"pool": self.pool.state_tensors()},
                                     {"step": self.step, "pool": self.pool.state_meta()},
                                     keep_last=self.cfg.checkpoint.keep_last)
            return None
        state = {"step": self.step, "rng": self.rng.getstate(), "torch_rng": torch.get_rng_state(),
                 "assign_rng": self.assign_gen.get_state(),
                 "running_reward": self.running_reward.state_dict(), "guards": dict(self.guards),
                 "consecutive_skips": dict(self.consecutive_skips), "data": self.prompts.state_dict(),
                 **opt_states,
                 "config": config_to_dict(self.cfg),
                 "pool": None if self.pool is None else self.pool.state_meta()}
        tensors = {"actor": tensor_state(self.actor), "critic": tensor_state(self.critic)}
        if self.pool is not None:
            tensors["pool"] = self.pool.state_tensors()
        return ckpt.save_checkpoint(self._ckpt_dir(root), self.step, tensors, state,
                                    keep_last=self.cfg.checkpoint.keep_last)

    def _resume(self) -> None:
        """Every rank resumes from the newest step that verifies on all model-parallel ranks. A
        checkpoint dir whose step dirs all fail verification, or a state that contradicts this
        run, is refused on every rank (CheckpointError), never silently replaced by a fresh start."""
        self._saved_step: int | None = None
        if not self.cfg.checkpoint.resume:
            return
        root = self._ckpt_dir(self.out_dir / "checkpoints")
        refused: list[str] = []
        step = ckpt.latest_valid_step(root, log=lambda msg: (refused.append(msg), self.log(msg)))
        if step is not None and self.pool is not None and self.parallel.dp_rank != 0:  # and its pool shards
            shards = self._pool_shard_dir(root)
            shard_step = ckpt.latest_valid_step(shards, log=lambda msg: (refused.append(msg), self.log(msg)))
            if shard_step is None:
                refused.append(f"dp_rank {self.parallel.dp_rank} finds no PF-PPO pool shards under {shards}")
            step = None if shard_step is None else min(step, shard_step)
        if step is None and ckpt.step_dirs(root):
            step = -2  # there are checkpoints, none can be trusted
        step = self._min_over_world(-1 if step is None else step)
        if step == -2:
            raise ckpt.CheckpointError(
                f"checkpoint.resume: no checkpoint under {root} can be used ({'; '.join(refused) or 'another rank'}); "
                f"repair or move them, or set checkpoint.resume=false")
        if step < 0:
            return
        error, pending = None, []
        try:
            pending = self._load_checkpoint(ckpt.load_step(root, step))
        except ckpt.CheckpointError as e:
            error = e
        if self._min_over_world(-1 if error is not None else 0) < 0:
            raise error or ckpt.CheckpointError(f"checkpoint step {step}: refused on another rank (see its log)")
        ckpt.scatter_parameter_state(pending)  # collective: only once every rank accepted the checkpoint
        self._saved_step = self.step
        self.log(f"[pfppo] resumed from {root / f'step_{step:06d}'} (step {self.step})")

    _STATE_KEYS = frozenset({"step", "rng", "torch_rng", "assign_rng", "running_reward", "guards", "data",
                             "consecutive_skips", "actor_opt", "critic_opt", "config", "pool"})

    def _load_checkpoint(self, found: "ckpt.Checkpoint") -> list:
        """Check a loaded checkpoint against this run, then install it (no collectives).
        CheckpointError names the file, the value and the rule it breaks. Returns the distributed
        optimizer's parameter state, for ckpt.scatter_parameter_state once every rank accepted."""
        where, s, t = found.path, found.state, self.cfg.training

        def need(ok: bool, what: str) -> None:
            if not ok:
                raise ckpt.CheckpointError(f"{where}: {what}")

        need(set(s) == self._STATE_KEYS, f"state keys {sorted(s)} must be {sorted(self._STATE_KEYS)}")
        need(type(s["step"]) is int and s["step"] == found.step,
             f"state step = {s['step']!r} must equal the checkpoint's step {found.step}")
        need(found.step <= t.total_training_steps,
             f"step {found.step} > training.total_training_steps ({t.total_training_steps}): this checkpoint is "
             f"from a longer run; raise total_training_steps, or use another logging.output_dir or "
             f"checkpoint.resume=false")
        has_pool = s["pool"] is not None
        need(has_pool == (self.pool is not None),
             f"the checkpoint {'holds' if has_pool else 'has no'} PF-PPO pool but this run has "
             f"algorithm.use_pf_ppo={self.pool is not None}: resume with the setting it was written with")
        groups = {"actor", "critic"} | ({"pool"} if has_pool else set())
        need(set(found.tensors) == groups, f"tensor files {sorted(found.tensors)} must be {sorted(groups)}")
        for group, model in (("actor", self.actor), ("critic", self.critic)):
            bad = [k for k, v in found.tensors[group].items() if v.is_floating_point() and not bool(v.isfinite().all())]
            need(not bad, f"{group}.safetensors: tensors {bad[:3]} hold NaN/inf")
            try:
                load_tensor_state(model, found.tensors[group])
            except ValueError as e:
                need(False, f"{group}.safetensors does not fit the configured model: {e}")
        for name, opt in (("actor_opt", self.actor_opt), ("critic_opt", self.critic_opt)):
            ckpt.check_optimizer_state(opt, s[name], f"{where}: state {name}")
        pending = [p for name, opt in (("actor_opt", self.actor_opt), ("critic_opt", self.critic_opt))
                   for p in ckpt.load_optimizer_state(opt, s[name])]
        need(isinstance(s["guards"], dict) and set(s["guards"]) <= set(self.guards)
             and all(type(v) is int and v >= 0 for v in s["guards"].values()),
             f"guards = {str(s['guards'])[:200]}: keys must be among {sorted(self.guards)}, values ints >= 0")
        need(isinstance(s["consecutive_skips"], dict) and set(s["consecutive_skips"]) == set(self.consecutive_skips)
             and all(type(v) is int and v >= 0 for v in s["consecutive_skips"].values()),
             f"consecutive_skips = {str(s['consecutive_skips'])[:200]}: keys must be {sorted(self.consecutive_skips)}, "
             f"values ints >= 0")
        try:
            if self.parallel.dp == 1:
                self.rng.setstate(s["rng"])
            else:  # only dp_rank 0's stream is saved: the others restart theirs deterministically
                self.rng.seed(stream_seed("prompts", t.seed, dp_rank=self.parallel.dp_rank, step=s["step"]))
            for name in ("torch_rng", "assign_rng"):
                need(isinstance(s[name], torch.Tensor) and s[name].dtype == torch.uint8 and s[name].dim() == 1,
                     f"state {name} must be a 1-D uint8 tensor")
            torch.set_rng_state(s["torch_rng"])
            self.assign_gen.set_state(s["assign_rng"])
            self.running_reward.load_state_dict(s["running_reward"])
        except (TypeError, ValueError, RuntimeError, AttributeError) as e:
            need(False, f"RNG or running-reward state refused ({type(e).__name__}: {str(e)[:200]})")
        try:  # the data position (prompt files: epoch and offset; the built-in task: in `rng`)
            self.prompts.load_state_dict(s["data"])
        except (ValueError, KeyError, TypeError) as e:
            need(False, f"state data (the data position) refused: {e}")
        if has_pool:
            meta, tensors = s["pool"], found.tensors["pool"]
            if self.parallel.dp_rank != 0:  # this rank's own shards of the pool (save())
                shards = ckpt.load_step(self._pool_shard_dir(found.path.parent), found.step)
                need(set(shards.state) == {"step", "pool"} and shards.state["step"] == found.step
                     and set(shards.tensors) == {"pool"},
                     f"pool shards {shards.path}: state keys {sorted(shards.state)} must be ['pool', 'step'] of "
                     f"step {found.step}, tensor files {sorted(shards.tensors)} must be ['pool']")
                meta, tensors = shards.state["pool"], shards.tensors["pool"]
            self._load_pool(meta, tensors, found.step, need)
        self.guards.update(s["guards"])
        self.consecutive_skips.update(s["consecutive_skips"])
        self.step = s["step"]
        return pending

    def _load_pool(self, meta, tensors: dict[str, torch.Tensor], step: int, need) -> None:
        """Rebuild the PF-PPO pool exactly (versions, stats, snapshots, checksums)."""
        size = self.cfg.algorithm.pool.pool_size
        need(isinstance(meta, dict) and meta.get("pool_size") == size,
             f"pool pool_size = {meta.get('pool_size') if isinstance(meta, dict) else meta!r} must equal "
             f"algorithm.pool.pool_size ({size})")
        try:
            pool = pfpool.SnapshotPool.from_state(meta, tensors, log=self.log)
        except ValueError as e:
            need(False, f"pool.safetensors / state pool: {e}")
        need(all(v <= step for v in pool.versions), f"pool versions {pool.versions} must be <= step {step}")
        # the layout of the pool __init__ built from the live weights (no collective here: a rank
        # that refused earlier must not leave the others waiting in one)
        current = [(n, t.dtype, tuple(t.shape)) for n, t in self.pool.snapshots[0].tensors]
        held = [(n, t.dtype, tuple(t.shape)) for n, t in pool.snapshots[0].tensors]
        need(held == current, "pool snapshots do not have the model's layout (names, dtypes, shapes)")
        sharded = self.sync.new_pool(size)
        try:
            sharded.adopt(pool, self.sync.plan)
        except ValueError as e:
            need(False, str(e))
        self.pool = sharded

    def _stop_requested(self) -> bool:
        """Rank 0 tests $PFPPO_STOP_FILE (created by scripts/slurm/lib.sh on SIGUSR1) and every
        rank gets its answer, so all of them checkpoint and leave at the same step boundary."""
        path = os.environ.get("PFPPO_STOP_FILE")
        if not path:
            return False
        flag = 1 if self.parallel.rank == 0 and os.path.exists(path) else 0
        return self._min_over_world(-flag) < 0

    def _min_over_world(self, value: int) -> int:
        return parallel.world_min(value)
