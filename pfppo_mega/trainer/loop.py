"""The PPO training loop. One step reads top to bottom in named phases:

    rollout -> score -> filter -> prepare -> advantages -> update -> sync -> log

each a method with a typed input and output (see ``batch.py``). The loop owns no construction
(trainer/build.py builds the ``Run``) and no resume (trainer/checkpoint/resume.py). Strategies chosen
once at build time, never asked which they are: the behaviour policy (plain PPO or the PF-PPO pool,
trainer/behaviour.py), the collector (one round or DAPO's dynamic sampling, trainer/collect.py),
policy filtration (trainer/filtration.py), the proximal log-probs (trainer/proximal.py), the
advantage estimator (trainer/estimators.py, whose declarations the rollout reads), the policy loss
(trainer/policy_loss.py) and the engine. What the loop still reads of the config: the reward
shaping's coefficients (score), where the KL goes, a reward penalty or a loss term (advantages;
the update adds the loss term), and the evaluation, logging and checkpoint intervals (fit).
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pfppo_mega import parallel, ppo
from pfppo_mega.config import Config, dump_yaml
from pfppo_mega.models import hf_io, lora
from pfppo_mega.models import passes as model_passes
from pfppo_mega.trainer import asynchronous, passes, worst_samples
from pfppo_mega.trainer.batch import ExperienceBatch, PreparedBatch, RolloutBatch, ScoredBatch, pack
from pfppo_mega.trainer.build import Run, build_run
from pfppo_mega.trainer.checkpoint import resume
from pfppo_mega.trainer.estimators import AdvantageInputs, EstimatorContext
from pfppo_mega.trainer.evaluation import evaluate, kl_probe
from pfppo_mega.trainer.instruments import devicecheck, perf
from pfppo_mega.trainer.metrics import MetricsLogger, plot_curves, read_jsonl, truncate_jsonl
from pfppo_mega.trainer.step_metrics import add_guard_counts, dump_worst, over_dp, step_metrics
from pfppo_mega.trainer.update import TrainingHalted, update


@dataclass
class PhaseTimer:
    """Seconds per phase. On a GPU the device is synchronized at both ends of a phase, so a phase's
    time holds its own kernels, not the tail of the previous phase's queue (a host sync per phase)."""

    device: torch.device = torch.device("cpu")
    seconds: dict[str, float] = field(default_factory=dict)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def __call__(self, name: str):
        self._sync()
        t0 = time.perf_counter()
        yield
        self._sync()
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


class PPOTrainer:
    def __init__(self, cfg: Config, *, log=print):
        self.run: Run = build_run(cfg, log=log)
        try:
            resume.resume(self.run)  # after the behaviour policy is built: a checkpoint's pool replaces it
            asynchronous.check_resume(self.run)  # an asynchronous run asks its requests in flight again
        except BaseException:
            self.close()
            raise
        self.device_check = devicecheck.requested()

    def close(self) -> None:
        """End what the run started outside this process (a custom reward's workers). Idempotent;
        `with PPOTrainer(cfg) as t:` and pfppo train call it on every exit, success or failure."""
        self.run.reward_fn.close()
        getattr(self.run.collector, "close", lambda: None)()  # the asynchronous mode's generator process

    def __enter__(self) -> "PPOTrainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def step(self) -> int:
        return self.run.state.step

    # ------------------------------------------------------------------ one step

    def train_step(self) -> dict[str, float]:
        """One step; with PFPPO_DEVICE_CHECK=1 inside a device-check session (trainer/instruments/devicecheck.py)."""
        if not self.device_check:
            return self._train_step()
        with devicecheck.session(self.run.device):
            return self._train_step()

    def _train_step(self) -> dict[str, float]:
        run, st, timer = self.run, self.run.state, PhaseTimer(self.run.device)
        t0 = time.perf_counter()
        samples = run.prompts.next_batch(run.cfg.training.rollout_batch_size // run.parallel.dp)
        corrupt_before = st.guards["corrupt_snapshots"]
        # rollout + score (DAPO's dynamic sampling repeats them until the batch is full)
        weights_before, engine_before = run.gen.sync.weights_s, run.gen.engine_s
        scored, rollout_stats = run.collector.collect(samples, rollout=self.rollout, score=self.score, timer=timer)
        timer.seconds["rollout_weights"] = run.gen.sync.weights_s - weights_before  # of which refits, switches
        timer.seconds["rollout_engine"] = run.gen.engine_s - engine_before      # and the engine's generate()
        with timer("score"):
            sb = self.filter(scored)     # the rows the update trains on (policy filtration resamples)
        add_guard_counts(run, scored, corrupt=st.guards["corrupt_snapshots"] - corrupt_before)
        with timer("prepare"):
            run.gen.phase("prepare")  # the memory ledger's phases (pfppo_mega/ledger.py)
            prep = self.prepare(sb)
        with timer("advantages"):
            eb = self.advantages(sb, prep)
        with timer("update"):
            run.gen.phase("update")
            upd, seen = update(run, eb, observe=run.proximal.observes_in_update)
        st.step += 1
        with timer("sync"):
            run.behaviour.after_update(st.step)
        step_s = time.perf_counter() - t0
        # log
        probe = {"kl/probe_k1": kl_probe(run)} if run.cfg.logging.kl_probe_size else {}
        metrics = step_metrics(run, scored, eb, upd, timer.seconds, step_s, seen=seen)
        metrics.update(rollout_stats)
        if scored.baselines is not None:  # ReMax: the greedy responses' mean score (every row's prompt)
            metrics["remax/baseline_mean"] = float(scored.baselines.double().mean())
        metrics.update(probe)
        metrics.update(run.behaviour.metrics(scored, sb, eb, st.step))
        metrics.update(run.gen.take_work(run.behaviour.host_bytes()).metrics())  # since the last record
        metrics.update(perf.step_perf(run, scored, timer.seconds))  # perf/: against the machine's rates
        if run.is_logger and run.cfg.logging.worst_samples:
            dump_worst(run, scored)
        # a clock, not a duration: consecutive records differ by the wall time between step ends,
        # everything included (logging, checkpoints, evaluations): how `pfppo bench trl` times us
        metrics["perf/step_end_s"] = time.monotonic()
        return over_dp(run, metrics)

    # ------------------------------------------------------------------ phases

    def rollout(self, samples) -> tuple[RolloutBatch, dict[str, float]]:
        """The behaviour policy's rollout, colocated (the trainer's states on the host meanwhile)."""
        run = self.run
        with run.gen.colocated(run.state.step, refit=run.behaviour.refits_current):
            rb, stats = run.behaviour.rollout(samples, run.state.step)
            if run.estimator.needs_greedy_baseline:  # ReMax: one greedy response per prompt, current weights
                rb = run.gen.greedy_baseline(rb, samples, step=run.state.step)
        return rb, {**stats, **run.gen.offload_stats()}

    def score(self, rb: RolloutBatch) -> ScoredBatch:
        """Task rewards through the guard (a raising / None / NaN reward scores 0 and is counted),
        then the reward preprocessing. z-scores and quantiles use the global batch (every DP rank's
        rows)."""
        run, cfg = self.run, self.run.cfg.reward
        with devicecheck.paused():  # reward functions run on the host (texts in, scores out)
            guarded = run.reward_fn(rb.samples, rb.texts, rb.finished.tolist())
        self.halt_if_no_reward(rows=len(rb.samples), errors=guarded.errors)
        devicecheck.mark_host(guarded.scores, guarded.honest, guarded.hacked)
        raw = guarded.scores.to(run.device)                                           # [B] finite
        lengths = rb.response_mask.sum(1)
        scores = raw
        if cfg.length_penalty:
            scores = ppo.length_penalty(scores, lengths, coef=cfg.length_penalty,
                                        max_length=run.cfg.algorithm.max_response_length)
        if cfg.overlong_buffer.enable:  # DAPO: the reward falls over the last overlong_buffer.len tokens
            ob = cfg.overlong_buffer
            scores = ppo.overlong_penalty(scores, lengths, max_length=run.cfg.algorithm.max_response_length,
                                          buffer_len=ob.len, penalty_factor=ob.penalty_factor)
        # The running moments are updated inside scale_rewards (once per batch, global batch).
        scores = ppo.scale_rewards(scores, method=cfg.scaling, running=run.state.running_reward,
                                   reduce_sum=run.dp.sum)
        scores = ppo.quantile_clip(scores, quantile=cfg.quantile_clip, gather=run.dp.gather)
        scores = ppo.clip_rewards(scores, clip_range=cfg.clip_range)
        baselines, (bad, errors, timeouts) = self.score_baselines(rb)
        return ScoredBatch(rollout=rb, raw_scores=raw, scores=scores, n_bad_rewards=guarded.nonfinite + bad,
                           n_reward_errors=guarded.errors + errors, n_reward_timeouts=guarded.timeouts + timeouts,
                           honest=None if guarded.honest is None else guarded.honest.to(run.device),
                           hacked=None if guarded.hacked is None else guarded.hacked.to(run.device),
                           baselines=baselines)

    def halt_if_no_reward(self, *, rows: int, errors: int) -> None:
        """Collective (every rank, every scored round): TrainingHalted on every rank when each reward
        call of the round, on every data-parallel rank, failed (raised, returned no number -- a list, a
        tuple, None --, or killed its worker). Each failure scores 0 and is counted, but when all fail
        no row carries a reward and the run would train on zeros, saying so once."""
        total_rows, total_errors = parallel.dp_sum(torch.tensor([rows, errors], dtype=torch.long),
                                                   self.run.dp.group).tolist()
        if total_rows and total_errors == total_rows:
            raise TrainingHalted(
                f"reward: every one of the {total_rows} reward calls of step {self.run.state.step} failed (raised, "
                f"returned no number, or killed its worker; the first failure of each kind is logged above): no "
                f"row carries a reward, the update would learn from zeros. Fix the reward function "
                f"(reward.custom_function, or the scorer of the rows' data_source): it must return a float or a "
                f"dict with a numeric 'score' for every sample")

    def score_baselines(self, rb: RolloutBatch) -> tuple[torch.Tensor | None, tuple[int, int, int]]:
        """[B] the greedy responses' scores (rb.baseline; None without one): the same guarded
        reward function, once per prompt, and the same per-row shaping as the sampled scores (the
        batch-statistic transforms are refused with a greedy baseline, trainer/build.py); and the
        guard's (non-finite, errors, timeouts) counts of those calls."""
        if rb.baseline is None:
            return None, (0, 0, 0)
        run, cfg, greedy = self.run, self.run.cfg.reward, rb.baseline
        g = rb.group_ids.tolist()
        first: dict[int, int] = {}                                                      # prompt -> its first row
        for i, gid in enumerate(g):
            first.setdefault(gid, i)
        rows = list(first.values())
        with devicecheck.paused():  # reward functions run on the host
            guarded = run.reward_fn([rb.samples[i] for i in rows], [greedy.texts[i] for i in rows],
                                    greedy.finished[rows].tolist())
        per_prompt = guarded.scores.to(run.device)                                      # [prompts]
        lengths = greedy.lengths[rows].to(run.device)                                   # [prompts]
        if cfg.length_penalty:
            per_prompt = ppo.length_penalty(per_prompt, lengths, coef=cfg.length_penalty,
                                            max_length=run.cfg.algorithm.max_response_length)
        if cfg.overlong_buffer.enable:
            ob = cfg.overlong_buffer
            per_prompt = ppo.overlong_penalty(per_prompt, lengths, max_length=run.cfg.algorithm.max_response_length,
                                              buffer_len=ob.len, penalty_factor=ob.penalty_factor)
        per_prompt = ppo.clip_rewards(per_prompt, clip_range=cfg.clip_range)
        slot = {gid: k for k, gid in enumerate(first)}
        baselines = per_prompt[torch.tensor([slot[x] for x in g], dtype=torch.long, device=run.device)]  # [B]
        return baselines, (guarded.nonfinite, guarded.errors, guarded.timeouts)

    def filter(self, sb: ScoredBatch) -> ScoredBatch:
        """Policy filtration (trainer/filtration.py): the rows the update trains on."""
        return self.run.filtration(sb)

    @torch.no_grad()
    def prepare(self, sb: ScoredBatch) -> PreparedBatch:
        """The trainer's models on the rows: proximal log-probs (recomputed, or the engine's:
        trainer/proximal.py), reference log-probs, and the critic's values when the run has one."""
        run, rb = self.run, sb.rollout
        inp = pack(rb.prompt_ids, rb.responses, rb.response_mask, pad_id=run.tokenizer.pad_id, device=run.device)
        old_logp, entropy = run.proximal.old_logp(run, inp, rb)                     # entropy None: not recomputed
        ref_logp, _ = passes.reference_logp(run, inp, run.passes.prepare_lm)
        m = inp.response_mask
        values = None if run.critic is None else model_passes.forward_values(
            run.critic, inp, micro_batch_size=passes.batching(run.cfg.training, m.shape[0],
                                                              run.passes.prepare_value))   # [B, T]
        spp = None if not run.estimator.needs_sum_pi_squared else model_passes.forward_sum_pi_squared(
            run.actor, inp, temperature=run.cfg.actor_rollout.temperature,
            micro_batch_size=passes.batching(run.cfg.training, m.shape[0], run.passes.prepare_lm))  # [B, T]
        devicecheck.expect("prepare: model inputs and results", run.device, inputs=inp, old_logp=old_logp,
                           ref_logp=ref_logp, values=values, scores=sb.scores, sum_pi_squared=spp)
        return PreparedBatch(inputs=inp, old_logp=old_logp * m, ref_logp=ref_logp * m,
                             values=None if values is None else values * m,
                             entropy=None if entropy is None else entropy * m,
                             sum_pi_squared=None if spp is None else spp * m)

    def advantages(self, sb: ScoredBatch, prep: PreparedBatch) -> ExperienceBatch:
        run, a = self.run, self.run.cfg.algorithm
        inp, old_logp, ref_logp = prep.inputs, prep.old_logp, prep.ref_logp
        m = inp.response_mask
        token_rewards = ppo.scores_to_token_rewards(sb.scores, m)                   # [B, T]
        if not a.use_kl_loss and a.kl_coeff > 0:
            token_rewards, kl_ref = ppo.apply_kl_penalty(token_rewards, old_logp, ref_logp, m,
                                                         kl_coeff=a.kl_coeff, estimator=a.kl_estimator)
        else:
            kl_ref = ppo.kl_estimate(old_logp, ref_logp, estimator=a.kl_estimator) * m
        rows = AdvantageInputs(token_rewards=token_rewards, mask=m, values=prep.values, group_ids=sb.rollout.group_ids,
                               baselines=sb.baselines, old_logp=old_logp, sum_pi_squared=prep.sum_pi_squared)
        ctx = EstimatorContext(algorithm=a, gae=run.kernels.gae, reduce_sum=run.dp.sum)
        adv, returns = run.estimator.compute(rows, ctx)                                # [B, T] each
        behav_logp = sb.rollout.behav_logp * m
        # Rows generated by the current weights: behaviour == proximal policy, IS weight exactly 1.
        on_policy = sb.rollout.versions == run.state.step                              # [B]
        is_weights, pg_mask, is_stats = run.behaviour.correction(old_logp, behav_logp, m, on_policy,
                                                                 reduce_sum=run.dp.sum, reduce_max=run.dp.max)
        eb = ExperienceBatch(inputs=inp, old_logp=old_logp, behav_logp=behav_logp,
                             ref_logp=ref_logp, old_values=prep.values, token_rewards=token_rewards,
                             advantages=adv, returns=returns, kl_ref=kl_ref, entropy=prep.entropy,
                             pg_mask=pg_mask, is_weights=is_weights, on_policy=on_policy, is_stats=is_stats)
        devicecheck.expect("advantages: experience batch", run.device, experience=eb)
        return eb

    # ------------------------------------------------------------------ the run

    def fit(self) -> RunResult:
        run, cfg, st = self.run, self.run.cfg, self.run.state
        t_start = time.monotonic()
        total = cfg.training.total_training_steps
        if run.is_logger:
            (run.out_dir / "config.yaml").write_text(dump_yaml(cfg))
            # like metrics.jsonl: records after the step this run starts at are dropped
            truncate_jsonl(run.out_dir / worst_samples.FILE, keep_through_step=st.step if st.step > 0 else -1)
        logger = MetricsLogger(run.out_dir, tensorboard=cfg.logging.tensorboard and run.is_logger,
                               progress=cfg.logging.progress and run.is_logger, total_steps=total,
                               enabled=run.is_logger, start_step=st.step)
        ckpt_root = run.out_dir / "checkpoints"
        eval_before = evaluate(run)
        run.log(f"[pfppo] held-out accuracy at step {st.step} ({len(run.eval_samples)} prompts): "
                f"sampled {eval_before['eval/accuracy']:.3f}, greedy {eval_before['eval/accuracy_greedy']:.3f}")
        if st.step == 0:
            logger.log(0, eval_before)
        eval_acc = eval_before
        while st.step < total:
            metrics = self.train_step()
            ev = cfg.logging.eval_interval
            if (ev and st.step % ev == 0) or st.step == total:
                eval_acc = evaluate(run)
                metrics.update(eval_acc)
            if st.step % cfg.logging.log_interval == 0 or "eval/accuracy" in metrics:
                logger.log(st.step, metrics)
            si = cfg.checkpoint.save_interval
            stop = self._stop_requested()  # Slurm asked for a checkpoint before preemption / time limit
            if (si and st.step % si == 0) or st.step == total or stop:
                run.gen.work.saved(resume.save(run, ckpt_root))  # once per step, whichever reasons coincide
                asynchronous.save_pending(run)  # the asynchronous mode's requests in flight, beside it
            if stop:
                run.log(f"[pfppo] stop requested ($PFPPO_STOP_FILE): checkpointed step {st.step}, exiting")
                break
        getattr(run.collector, "close", lambda: None)()  # no generator process outlives the training steps
        resume.wait(ckpt_root)  # the background writes of the last saves, committed on every rank
        logger.close()
        plot = None
        if cfg.logging.plots and run.is_logger:
            plot = plot_curves(read_jsonl(logger.jsonl_path), run.out_dir / "curves.png",
                               title=f"PPO on {cfg.data.task if cfg.data.source == 'task' else 'data.train_files'} "
                                     f"({run.model_cfg.num_layers} layers)")
        export = None
        if cfg.checkpoint.export_hf:
            export = run.out_dir / "hf_export"
            hf_io.export_hf(run.actor, run.model_cfg, export, tokenizer_files=run.tokenizer.files())  # merged
            spec = lora.spec_of(run.actor)
            if spec is not None:  # the adapters alone as well, in PEFT's layout (beside it: not inside, where
                # transformers would read the directory as an adapter)
                lora.export_peft(run.actor, spec, run.out_dir / "lora_adapter", base=cfg.actor_rollout.model_path)
        result = RunResult(out_dir=run.out_dir, metrics_path=logger.jsonl_path, plot_path=plot,
                           export_dir=export, eval_before=eval_before, eval_after=eval_acc,
                           steps=st.step, wall_s=time.monotonic() - t_start)
        if run.is_logger:
            (run.out_dir / "summary.json").write_text(json.dumps(
                {"eval_before": eval_before, "eval_after": eval_acc, "steps": st.step,
                 "wall_s": result.wall_s, "guards": st.guards}, indent=2))
        return result

    def _stop_requested(self) -> bool:
        """Rank 0 tests $PFPPO_STOP_FILE (created by scripts/slurm/lib.sh on SIGUSR1) and every
        rank gets its answer, so all of them checkpoint and leave at the same step boundary."""
        path = os.environ.get("PFPPO_STOP_FILE")
        if not path:
            return False
        flag = 1 if self.run.parallel.rank == 0 and os.path.exists(path) else 0
        return parallel.world_min(-flag) < 0
