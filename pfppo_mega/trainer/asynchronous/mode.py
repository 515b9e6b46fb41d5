"""The asynchronous mode's seams in the trainer (chosen once at build: trainer/build.py).

    AsyncCollector   the collect phase: submits the step's prompts to the generator process (and,
                     at the first step, prefetch_steps steps' more), then takes the step's groups
                     from the buffer within the staleness bound (stale ones dropped, counted, asked
                     again) and scores them. The loop trains on whatever versions wrote them.
    AsyncBehaviour   the behaviour policy: decoupled PPO's correction (algorithm.pool.is_mode /
                     is_clip on pi_prox / pi_behav, pi_prox the recomputed current-before-update
                     policy), and after each update the new version into the pool and the generator.

Checkpoints: each save writes the requests in flight beside it (pending.py); a resume asks them
again first, same prompts and seeds, so the resumed run trains the same prompts in the same order.
A checkpoint without that record is refused (AsyncResumeError).

Parallel layouts (docs/async.md, "Data, tensor and pipeline parallel"): one generator process per
model replica, on its leader (tp_rank = pp_rank = 0, the lowest rank of megatron's model-parallel
group); the leader takes the step's groups and broadcasts them to the replica's other ranks, which
draw the same prompts and seeds (the prompt stream stays in step) but ask nothing. Each version's
file holds the full Hugging Face layout, gathered from the TP shards and pipeline stages into global
rank 0 (export.write_version), the only writer; every rank makes the same calls.
"""

from __future__ import annotations

import random
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from pfppo_mega import pool as pfpool
from pfppo_mega.rollout import SamplingParams
from pfppo_mega.rollout.base import oldest_versions
from pfppo_mega.trainer.asynchronous import pending as pending_file
from pfppo_mega.trainer.asynchronous.logp_check import VersionLogpCheck
from pfppo_mega.trainer.asynchronous.buffer import Group, StalenessBuffer, busy_fraction, staleness_metrics, \
    token_staleness_metrics, version_window
from pfppo_mega.trainer.asynchronous.export import write_version
from pfppo_mega.trainer.asynchronous.process import GeneratorFailed, GeneratorProcess
from pfppo_mega.trainer.asynchronous.worker import Request, Result, WorkerSpec
from pfppo_mega.trainer.batch import RolloutBatch
from pfppo_mega.trainer.behaviour import BehaviourPolicy
from pfppo_mega.types import Sample


class AsyncResumeError(ValueError):
    """A run with algorithm.async_rl.enable cannot resume its checkpoint: the record of the requests
    in flight at that save is missing or malformed (a ValueError: `pfppo train` reports it as a run
    that cannot start, exit status 2)."""


def check_resume(run) -> None:
    """After resume.resume(run): an asynchronous run resumed at step S > 0 reads the requests in
    flight at that save (pending.py) and asks them again before any new prompt."""
    if not run.cfg.algorithm.async_rl.enable or run.state.step == 0:
        return
    try:
        next_key, requests = pending_file.read(run.out_dir, run.state.step, run.parallel.dp_rank, run.parallel.dp)
    except pending_file.PendingFileError as e:
        raise AsyncResumeError(
            f"algorithm.async_rl.enable: the checkpoint at step {run.state.step} cannot be resumed asynchronously: "
            f"{e}. Resume it with algorithm.async_rl.enable=false, or start afresh (checkpoint.resume=false or a "
            f"new logging.output_dir)") from e
    run.strategies.collector.restore(next_key, requests)
    run.log(f"[pfppo] async: {len(requests)} request(s) in flight at step {run.state.step} asked again "
            f"({sum(len(r.pending) for r in requests)} untrained prompt groups)")


def save_pending(run) -> None:
    """After a checkpoint save: the requests in flight, beside it (each replica leader its own
    generator's, named by its dp_rank; the replica's other ranks ask nothing and write nothing)."""
    if run.cfg.algorithm.async_rl.enable and run.strategies.collector.leader:
        c = run.strategies.collector
        try:
            pending_file.write(run.out_dir, run.state.step, c._next_key, c.in_flight_requests(),
                               keep=run.cfg.checkpoint.keep_last or 1, rank=run.parallel.dp_rank,
                               dp_size=run.parallel.dp)
        except TypeError as e:  # a prompt's metadata JSON cannot hold: this checkpoint resumes only synchronously
            run.log(f"[pfppo] async: the requests in flight at step {run.state.step} were not recorded ({e}); "
                    f"its checkpoint cannot be resumed asynchronously")


def _reask_rng(seed: int, dropped: list[Group]) -> random.Random:
    """The seeds of stale groups asked again: from their keys, not from the run's prompt stream, so
    how many groups a rank drops (timing) never moves the prompts every rank draws in step."""
    return random.Random(f"reask:{seed}:{','.join(str(g.key) for g in dropped)}")


ROWS_PER_RANK = 1 << 20  # a data-parallel rank's rows are seeded from row_offset dp_rank * this on


def replica_leader(replica_group, *, rank: int, first_rank_of_replica: bool) -> int:
    """The global rank of this rank's replica leader: the lowest of megatron's model-parallel group
    (tp_rank = pp_rank = 0 in its tp-dp-pp order), or ``rank`` itself when the replica is one rank."""
    if replica_group is None:
        return rank
    leader = min(dist.get_process_group_ranks(replica_group))
    if (leader == rank) != first_rank_of_replica:
        raise RuntimeError(f"rank {rank}: the lowest rank of its model-parallel group is {leader}, but tp_rank = "
                           f"pp_rank = 0 is {'' if first_rank_of_replica else 'not '}this rank: the asynchronous "
                           f"mode assumes megatron's tp-dp-pp order")
    return leader


class AsyncCollector:
    def __init__(self, cfg, *, spec: WorkerSpec, sync, next_batch: Callable[[int], list[Sample]],
                 state, rng, tokenizer, device, log: Callable[[str], None], dp_rank: int = 0,
                 replica_group=None, leader_rank: int = 0, rank: int = 0) -> None:
        ac = cfg.algorithm.async_rl
        # every data-parallel replica has its own generator process, on its leader, and its share of the
        # prompts; global rank 0 writes each version's file (write_version), every leader announces it to
        # its generator. The replica's other ranks (replica_group, TP x PP) get the leader's groups.
        self.dp_rank, self.replica_group, self.leader_rank = dp_rank, replica_group, leader_rank
        self.leader = rank == leader_rank
        self.cfg, self.ac, self.sync, self.next_batch, self.log = cfg, ac, sync, next_batch, log
        # the run's training state (its step), prompt-seed stream, tokenizer and device: shared, not copied
        self.state, self.rng, self.tokenizer, self.device = state, rng, tokenizer, device
        self.n = cfg.actor_rollout.n_samples_per_prompt
        self.proc: Optional[GeneratorProcess] = self._new_process(spec) if self.leader else None
        self.buffer = StalenessBuffer(ac.max_staleness)
        self.started = False
        self.keys: dict[int, list[tuple[int, Sample]]] = {}  # request id -> its groups' (key, prompt), until answered
        # every request with a group not trained yet: id -> (seed, its (key, prompt)s, the keys still untrained)
        self.asked: dict[int, tuple[int, list[tuple[int, Sample]], set[int]]] = {}
        self.origin: dict[int, int] = {}  # untrained group key -> its request id
        self.discard: set[int] = set()    # keys a replayed request answers again but were trained already
        self.restored: Optional[list[pending_file.PendingRequest]] = None
        self._next_rid = self._next_key = 0
        self._last_collect: Optional[float] = None
        self._prev_wait = 0.0
        self._eos: Optional[int] = None

    # ------------------------------------------------------------------ the generator

    def _new_process(self, spec: WorkerSpec) -> GeneratorProcess:
        return GeneratorProcess(spec, max_restarts=self.ac.max_restarts, result_timeout_s=self.ac.result_timeout_s,
                                log=self.log, output_dir=self.cfg.logging.output_dir)

    def push(self, version: int) -> None:
        """The actor's weights ``version`` into the pool and the generator (between its requests).
        Every rank calls it (write_version: rank 0 writes the file, every rank learns its path); each
        replica leader announces it to its generator."""
        path = write_version(self.sync, self.proc.files if self.proc is not None else None, version)
        if self.proc is not None:
            self.proc.push_file(version, path)

    def close(self) -> None:
        """Stop the generator process (idempotent). A later collect starts a new one afresh."""
        if self.proc is not None:
            self.proc.stop()
        if self.started:
            if self.proc is not None:
                self.proc = self._new_process(self.proc.spec)
            self.buffer, self.keys, self.started = StalenessBuffer(self.ac.max_staleness), {}, False
            self.asked, self.origin, self.discard = {}, {}, set()

    def _submit(self, samples: list[Sample], rng) -> None:
        """Requests for ``samples`` (leader); a follower draws the same seeds and asks nothing, so
        the run's prompt-seed stream stays in step on every rank of the replica."""
        size = self.ac.request_prompts
        for i in range(0, len(samples), size):
            chunk = samples[i:i + size]
            seed = rng.randrange(1 << 31)
            if not self.leader:
                continue
            groups = [(self._next_key + j, s) for j, s in enumerate(chunk)]
            self._next_key += len(chunk)
            self._ask(groups, seed, {k for k, _ in groups})

    def _ask(self, groups: list[tuple[int, Sample]], seed: int, untrained: set[int]) -> None:
        """One request for ``groups`` with sampling seed ``seed``; its answers for keys outside
        ``untrained`` are dropped on arrival (a replayed request whose other groups were trained)."""
        ar = self.cfg.actor_rollout
        params = SamplingParams(temperature=ar.temperature, top_p=ar.top_p,
                                max_new_tokens=self.cfg.algorithm.max_response_length, eos_token_id=self._eos,
                                seed=seed, row_offset=self.dp_rank * ROWS_PER_RANK)
        rid = self._next_rid
        self._next_rid += 1
        self.keys[rid] = groups
        self.asked[rid] = (seed, groups, set(untrained))
        self.origin.update({k: rid for k in untrained})
        self.discard |= {k for k, _ in groups} - untrained
        self.proc.submit(Request(rid, [list(s.prompt_ids) for _, s in groups], self.n, params))

    def _retire(self, groups: list[Group]) -> None:
        """These groups leave the buffer (trained, or dropped as stale): their requests forget them."""
        for g in groups:
            rid = self.origin.pop(g.key)
            left = self.asked[rid][2]
            left.discard(g.key)
            if not left:
                del self.asked[rid]

    def in_flight_requests(self) -> list[pending_file.PendingRequest]:
        """The requests with a group not trained yet (answered and buffered, or unanswered), in order."""
        return [pending_file.PendingRequest(seed, groups, frozenset(left))
                for _, (seed, groups, left) in sorted(self.asked.items())]

    def restore(self, next_key: int, requests: list[pending_file.PendingRequest]) -> None:
        """A resume's requests in flight (check_resume): asked again, first, at the next collect."""
        self.restored, self._next_key = list(requests), next_key

    def _receive(self, result: Result) -> None:
        n = self.n
        for j, (key, sample) in enumerate(self.keys.pop(result.rid)):
            if key in self.discard:  # trained before the checkpoint this run resumed from
                self.discard.discard(key)
                continue
            rows = slice(j * n, (j + 1) * n)
            tv = None if result.token_versions is None else result.token_versions[rows]
            version = result.version if tv is None else int(oldest_versions(tv, result.version).min())
            self.buffer.add(Group(key, sample, version, result.responses[rows], result.mask[rows],
                                  result.logprobs[rows], result.finished[rows], tv))

    # ------------------------------------------------------------------ the collect phase

    def collect(self, samples: list[Sample], *, rollout, score, timer):
        # rollout: unused, the generator process writes the rows (the collector protocol, trainer/collect.py)
        step, need = self.state.step, len(samples)
        t_enter = time.perf_counter()
        if not self.started:
            self._eos = self.tokenizer.eos_id
            if self.proc is not None:
                self.proc.start()
            self.push(step)
            self.started = True
            if self.restored is None:
                samples = samples + [s for _ in range(self.ac.prefetch_steps) for s in self.next_batch(need)]
            else:  # a resume: the requests in flight at the checkpoint first, as they were asked
                for r in self.restored if self.leader else []:
                    self._ask(r.groups, r.seed, set(r.pending))
                self.restored = None
        self._submit(samples, self.rng)
        with timer("rollout"):
            taken, gen_stats = self._replica_rows(step, need, t_enter)
        with timer("score"):
            scored = score(self._rollout(taken))
        stats = staleness_metrics(scored.rollout.versions, step, self.ac.max_staleness)
        stats.update(gen_stats)
        if self.ac.partial_rollouts:
            stats.update(self._token_stats(taken, step))
        return scored, stats

    def _replica_rows(self, step: int, need: int, t_enter: float) -> tuple[list[Group], dict[str, float]]:
        """The leader's groups and generator metrics, on every rank of the replica (one broadcast on
        its model-parallel group). A generator that failed for good fails every rank of the replica
        at once (GeneratorFailed), none is left waiting in the broadcast."""
        if self.replica_group is None:
            return self._take(step, need, t_enter)
        failure, rows = None, (None, None)
        if self.leader:
            try:
                rows = self._take(step, need, t_enter)
            except GeneratorFailed as e:
                failure = e
        box = [str(failure) if failure is not None else rows]
        dist.broadcast_object_list(box, src=self.leader_rank, group=self.replica_group)
        if failure is not None:
            raise failure
        if isinstance(box[0], str):
            raise GeneratorFailed(f"the generator of this rank's replica (on rank {self.leader_rank}) failed: {box[0]}")
        return box[0]

    def _take(self, step: int, need: int, t_enter: float) -> tuple[list[Group], dict[str, float]]:
        """The leader: the step's groups from the buffer (waiting for the generator, dropping and
        asking again what is too stale), and the generator's metrics of this step."""
        got: list[Result] = []
        dropped_now = 0
        t0 = time.perf_counter()
        taken: list[Group] = []
        while True:
            while (r := self.proc.next_result(block=False)) is not None:  # every result already here
                got.append(r)
                self._receive(r)
            t = self.buffer.take(need - len(taken), step)
            taken += t.groups
            self._retire(t.groups + t.dropped)
            if t.dropped:  # too stale to train on: counted, and their prompts are asked again
                dropped_now += len(t.dropped)
                self._submit([g.sample for g in t.dropped], _reask_rng(self.cfg.training.seed, t.dropped))
            if len(taken) >= need:
                break
            r = self.proc.next_result()  # wait for the generator
            got.append(r)
            self._receive(r)
        waited = time.perf_counter() - t0
        window = t_enter - self._last_collect if self._last_collect is not None else 0.0
        self._last_collect = t_enter
        return taken, self._generator_stats(got, waited, window, dropped_now)

    def _rollout(self, groups: list[Group]) -> RolloutBatch:
        n, pad = self.n, self.tokenizer.pad_id
        T = max(g.responses.shape[1] for g in groups)

        def cat(name: str, value) -> torch.Tensor:
            return torch.cat([torch.nn.functional.pad(getattr(g, name), (0, T - g.responses.shape[1]), value=value)
                              for g in groups])                                                   # [B, T]
        responses = cat("responses", pad)
        mask = cat("mask", 0.0)
        lengths = mask.sum(1).long()
        samples = [g.sample for g in groups for _ in range(n)]
        texts = [self.tokenizer.decode(r[: int(k)].tolist()) for r, k in zip(responses, lengths)]
        return RolloutBatch(samples=samples, prompt_ids=[list(s.prompt_ids) for s in samples], responses=responses,
                            response_mask=mask, behav_logp=cat("logprobs", 0.0),
                            finished=torch.cat([g.finished for g in groups]),
                            versions=torch.cat([g.row_versions() for g in groups]),  # [B] oldest token's
                            texts=texts, group_ids=torch.arange(len(groups)).repeat_interleave(n),
                            ).to(self.device)

    def _generator_stats(self, got: list[Result], waited: float, window: float, dropped: int) -> dict[str, float]:
        """The leader's: its generator, buffer and waits this step (the replica's other ranks log the same)."""
        gen_busy = sum(r.generate_s for r in got)
        out = {
            "async/dropped_stale": float(dropped * self.n),                  # rows, this step
            "async/dropped_stale_total": float(self.buffer.dropped_total * self.n),
            "async/trainer_wait_s": waited,                                  # the trainer waited for samples
            "async/generator_idle_s": sum(r.idle_s for r in got),            # the generator waited for requests
            "async/generator_busy_s": gen_busy,
            "async/switch_s": sum(r.switch_s for r in got),
            "async/restarts": float(self.proc.restarts),
            "async/pool_versions": float(len(self.proc.pool.held)),
            "async/buffer_groups": float(len(self.buffer)),
            "async/requests_in_flight": float(len(self.proc.in_flight)),
        }
        if window > 0:  # since the previous step's collect: the previous step's wall time
            out["async/generator_busy_frac"] = busy_fraction(gen_busy, window)
            out["async/trainer_busy_frac"] = busy_fraction(window - self._prev_wait, window)
        self._prev_wait = waited
        if self.ac.partial_rollouts:  # versions loaded inside requests, answers received this step
            out["async/partial_switches"] = float(sum(r.switches for r in got))
        return out

    def _token_stats(self, groups: list[Group], step: int) -> dict[str, float]:
        """Partial rollouts: the share of tokens by age and rows with mixed versions."""
        T = max(g.responses.shape[1] for g in groups)
        tv = torch.cat([torch.nn.functional.pad(g.row_token_versions(), (0, T - g.responses.shape[1]), value=-1)
                        for g in groups])                                                         # [B, T]
        return token_staleness_metrics(tv, step, self.ac.max_staleness)


class AsyncBehaviour(BehaviourPolicy):
    """Decoupled PPO over the generator's versions (see the module docstring)."""

    def __init__(self, collector: AsyncCollector, pool_cfg, check: Optional[VersionLogpCheck] = None) -> None:
        self.collector, self.pool_cfg, self.check = collector, pool_cfg, check

    def rollout(self, samples, step):
        raise RuntimeError("algorithm.async_rl: rows come from the generator process (AsyncCollector), "
                           "not from a rollout in the trainer")

    def correction(self, old_logp, behav_logp, mask, on_policy, *, reduce_sum, reduce_max):
        """w = pi_prox / pi_behav per token (truncated or masked at pool.is_clip), exactly 1 on rows
        the current weights wrote."""
        return pfpool.behaviour_is_weights(old_logp, behav_logp, mask, mode=self.pool_cfg.is_mode,
                                           is_clip=self.pool_cfg.is_clip, on_policy=on_policy,
                                           reduce_sum=reduce_sum, reduce_max=reduce_max)

    def after_update(self, step: int) -> None:
        if self.check is not None:
            self.check.keep(step)  # the weights about to be published as version `step`
        if self.collector.started:
            self.collector.push(step)

    def metrics(self, scored, sb, eb, step: int) -> dict[str, float]:
        # `step` has just finished: this batch was trained at version step - 1 (its on-policy rows')
        checked = {} if self.check is None else self.check.measure(eb.inputs, eb.behav_logp, sb.rollout.versions,
                                                                  step - 1)
        s = eb.is_stats
        if s is None:
            return checked
        return {"is/mean": s.mean, "is/max": s.max, "is/frac_truncated": s.frac_truncated, "is/ess": s.ess,
                "async/ess": s.ess, **checked}

    def host_bytes(self) -> int:
        return 0 if self.check is None else self.check.host_bytes


def build_async(cfg, *, sync, model_dir, hf_cfg: dict, next_batch, state, rng, tokenizer, device,
                log, dp_rank: int = 0, replica_group=None, rank: int = 0, first_rank_of_replica: bool = True,
                kernels=None) -> tuple[AsyncBehaviour, AsyncCollector]:
    ac = cfg.algorithm.async_rl
    spec = WorkerSpec(cfg=cfg, model_dir=str(model_dir), hf_cfg=hf_cfg, pad_token_id=tokenizer.pad_id,
                      window=version_window(ac.sampling, ac.max_staleness, ac.prefetch_steps), rule=ac.sampling,
                      temperature=ac.sampling_temperature, num_threads=cfg.training.num_threads,
                      partial=ac.partial_rollouts)
    leader = replica_leader(replica_group, rank=rank, first_rank_of_replica=first_rank_of_replica)
    collector = AsyncCollector(cfg, spec=spec, sync=sync, next_batch=next_batch, state=state, rng=rng,
                               tokenizer=tokenizer, device=device, log=log, dp_rank=dp_rank,
                               replica_group=replica_group, leader_rank=leader, rank=rank)
    log(f"[pfppo] async: a generator process {'on this rank' if collector.leader else f'on rank {leader}'}, "
        f"max_staleness {ac.max_staleness}, prefetch {ac.prefetch_steps} "
        f"step(s), sampling {ac.sampling} over {spec.window + 1} version(s), {ac.request_prompts} prompts a request"
        + (", partial rollouts (new weights between decode steps)" if ac.partial_rollouts else ""))
    check = None if not ac.logp_check_interval else VersionLogpCheck(
        sync.actor, interval=ac.logp_check_interval, rows=ac.logp_check_rows, max_age=ac.max_staleness,
        temperature=cfg.actor_rollout.temperature, kernels=kernels)
    return AsyncBehaviour(collector, cfg.algorithm.pool, check), collector
