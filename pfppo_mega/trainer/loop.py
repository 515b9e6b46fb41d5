"""The PPO training loop. One step reads top to bottom in named phases:

    rollout -> score -> filter -> prepare -> advantages -> update -> sync -> log

each a function of the parts of the run it reads (trainer/build.py: models, colocation, strategies,
training state; trainer/phases.py, update.py, evaluation.py) with a typed input and output (see
``batch.py``), bound to this run's parts by a method of the trainer. The loop owns no construction
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
from typing import Optional

import torch

from pfppo_mega import parallel
from pfppo_mega.config import Config, dump_yaml
from pfppo_mega.models import hf_io, lora
from pfppo_mega.trainer import asynchronous, phases, worst_samples
from pfppo_mega.trainer.batch import ExperienceBatch, PreparedBatch, RolloutBatch, ScoredBatch
from pfppo_mega.trainer.build import Run, build_run
from pfppo_mega.trainer.checkpoint import resume
from pfppo_mega.trainer.evaluation import evaluate, kl_probe
from pfppo_mega.trainer.instruments import devicecheck, perf
from pfppo_mega.trainer.metrics import MetricsLogger, plot_curves, read_jsonl, truncate_jsonl
from pfppo_mega.trainer.step_metrics import add_guard_counts, dump_worst, over_dp, step_metrics
from pfppo_mega.trainer.update import Observed, update
from pfppo_mega.types import Sample


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
        self.run.strategies.collector.close()  # the asynchronous mode's generator process

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
        colo, strat, models = run.colocation, run.strategies, run.models
        t0 = time.perf_counter()
        samples = run.prompts.next_batch(run.cfg.training.rollout_batch_size // run.dp.size)
        corrupt_before = st.guards["corrupt_snapshots"]
        # rollout + score (DAPO's dynamic sampling repeats them until the batch is full)
        weights_before, engine_before = colo.gen.sync.weights_s, colo.gen.engine_s
        scored, rollout_stats = strat.collector.collect(samples, rollout=self.rollout, score=self.score, timer=timer)
        timer.seconds["rollout_weights"] = colo.gen.sync.weights_s - weights_before  # of which refits, switches
        timer.seconds["rollout_engine"] = colo.gen.engine_s - engine_before      # and the engine's generate()
        with timer("score"):
            sb = self.filter(scored)  # the rows the update trains on (policy filtration resamples)
        add_guard_counts(st.guards, scored, corrupt=st.guards["corrupt_snapshots"] - corrupt_before,
                         group=run.dp.group)
        with timer("prepare"):
            colo.gen.phase("prepare")  # the memory ledger's phases (pfppo_mega/ledger.py)
            prep = self.prepare(sb)
        with timer("advantages"):
            eb = self.advantages(sb, prep)
        with timer("update"):
            colo.gen.phase("update")
            upd, seen = self.update(eb, observe=strat.proximal.observes_in_update)
        st.step += 1
        with timer("sync"):
            strat.behaviour.after_update(st.step)
        step_s = time.perf_counter() - t0
        # log (a curriculum sampler learns from the step first)
        phases.feed_back(scored, prompts=run.prompts, dp=run.dp, step=st.step)
        probe = {"kl/probe_k1": self.kl_probe()} if run.cfg.logging.kl_probe_size else {}
        metrics = step_metrics(scored, eb, upd, timer.seconds, step_s, guards=st.guards, dp=run.dp,
                               observes_in_update=strat.proximal.observes_in_update, seen=seen)
        metrics.update(rollout_stats)
        if scored.baselines is not None:  # ReMax: the greedy responses' mean score (every row's prompt)
            metrics["remax/baseline_mean"] = float(scored.baselines.double().mean())
        metrics.update(probe)
        metrics.update(strat.behaviour.metrics(scored, sb, eb, st.step))
        metrics.update(colo.gen.take_work(strat.behaviour.host_bytes()).metrics())  # since the last record
        metrics.update(perf.step_perf(models, scored, timer.seconds, step=st.step,  # perf/: against the machine's rates
                                      probe_interval=run.cfg.logging.perf_probe_interval, device=run.device))
        if run.is_logger and run.cfg.logging.worst_samples:
            dump_worst(scored, step=st.step, per_kind=run.cfg.logging.worst_samples, out_dir=run.out_dir)
        # a clock, not a duration: consecutive records differ by the wall time between step ends,
        # everything included (logging, checkpoints, evaluations): how `pfppo bench trl` times us
        metrics["perf/step_end_s"] = time.monotonic()
        return over_dp(metrics, run.dp.group)

    # ------------------------------------------------------------------ phases, bound to the run's parts
    # (trainer/phases.py, update.py, evaluation.py take the parts they read; the collector gets
    # rollout and score as functions)

    def rollout(self, samples: list[Sample]) -> tuple[RolloutBatch, dict[str, float]]:
        r = self.run
        return phases.rollout(samples, colocation=r.colocation, strategies=r.strategies, step=r.state.step)

    def score(self, rb: RolloutBatch) -> ScoredBatch:
        r = self.run
        return phases.score(rb, cfg=r.cfg, reward_fn=r.reward_fn, state=r.state, dp=r.dp, device=r.device)

    def filter(self, sb: ScoredBatch) -> ScoredBatch:
        return self.run.strategies.filtration(sb)

    def prepare(self, sb: ScoredBatch) -> PreparedBatch:
        r = self.run
        return phases.prepare(sb, cfg=r.cfg, models=r.models, strategies=r.strategies, pad_id=r.tokenizer.pad_id,
                              device=r.device)

    def advantages(self, sb: ScoredBatch, prep: PreparedBatch) -> ExperienceBatch:
        r = self.run
        return phases.advantages(sb, prep, algorithm=r.cfg.algorithm, strategies=r.strategies,
                                 kernels=r.models.kernels, dp=r.dp, step=r.state.step, device=r.device)

    def update(self, eb: ExperienceBatch, *, observe: bool = False) -> tuple[dict[str, float], Optional[Observed]]:
        r = self.run
        return update(eb, cfg=r.cfg, models=r.models, strategies=r.strategies, state=r.state, dp=r.dp,
                      device=r.device, log=r.log, observe=observe)

    def evaluate(self) -> dict[str, float]:
        r = self.run
        return evaluate(r.eval_samples, cfg=r.cfg, gen=r.colocation.gen, tokenizer=r.tokenizer, reward_fn=r.reward_fn,
                        state=r.state)

    def kl_probe(self) -> float:
        r = self.run
        return kl_probe(r.eval_samples, cfg=r.cfg, gen=r.colocation.gen, models=r.models, tokenizer=r.tokenizer,
                        step=r.state.step, device=r.device)

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
        eval_before = self.evaluate()
        run.log(f"[pfppo] held-out accuracy at step {st.step} ({len(run.eval_samples)} prompts): "
                f"sampled {eval_before['eval/accuracy']:.3f}, greedy {eval_before['eval/accuracy_greedy']:.3f}")
        if st.step == 0:
            logger.log(0, eval_before)
        eval_acc = eval_before
        while st.step < total:
            metrics = self.train_step()
            ev = cfg.logging.eval_interval
            if (ev and st.step % ev == 0) or st.step == total:
                eval_acc = self.evaluate()
                metrics.update(eval_acc)
            if st.step % cfg.logging.log_interval == 0 or "eval/accuracy" in metrics:
                logger.log(st.step, metrics)
            si = cfg.checkpoint.save_interval
            stop = self._stop_requested()  # Slurm asked for a checkpoint before preemption / time limit
            if (si and st.step % si == 0) or st.step == total or stop:
                run.colocation.gen.work.saved(resume.save(run, ckpt_root))  # once per step, whichever reasons coincide
                asynchronous.save_pending(run)  # the asynchronous mode's requests in flight, beside it
            if stop:
                run.log(f"[pfppo] stop requested ($PFPPO_STOP_FILE): checkpointed step {st.step}, exiting")
                break
        run.strategies.collector.close()  # no generator process outlives the training steps
        resume.wait(ckpt_root)  # the background writes of the last saves, committed on every rank
        logger.close()
        plot = None
        if cfg.logging.plots and run.is_logger:
            plot = plot_curves(read_jsonl(logger.jsonl_path), run.out_dir / "curves.png",
                               title=f"PPO on {cfg.data.task if cfg.data.source == 'task' else 'data.train_files'} "
                                     f"({run.models.model_cfg.num_layers} layers)")
        export = None
        if cfg.checkpoint.export_hf:
            export = run.out_dir / "hf_export"
            hf_io.export_hf(run.models.actor, run.models.model_cfg, export,
                            tokenizer_files=run.tokenizer.files())  # merged
            spec = lora.spec_of(run.models.actor)
            if spec is not None:  # the adapters alone as well, in PEFT's layout (beside it: not inside, where
                # transformers would read the directory as an adapter)
                lora.export_peft(run.models.actor, spec, run.out_dir / "lora_adapter",
                                 base=cfg.actor_rollout.model_path)
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
