"""Run under torchrun (2 processes, gloo): the asynchronous mode with a tensor- and a
pipeline-parallel trainer (docs/async.md, "Data, tensor and pipeline parallel"). Each rank prints
one `RESULT <json>` line for tests/test_async_tp.py.

In one launch: a TP2 run of 3 steps that checkpoints at step 3 with requests in flight, its resume
at TP2 for step 4, then a PP2 run of 2 steps, after which a weight export fails on purpose on each
rank in turn, and the leader's generator "fails for good" (``failures``). Each rank records, per run: its generator's pid (only
the replica leader, rank 0, has one), the weight files announced and whether each holds exactly
the full weights the synchronous refit stream gathers from the shards (checked on every rank), a
digest of every step's trained batch (every rank of the replica must train the same rows), and
rank 0 the step records.

With 4 processes instead: TP2 x PP2 and DP2 x TP2 (two replicas), 2 steps each, the same records.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/multirank/async_tp.py CONFIG OUT SFT

``watch`` and ``batch_digest`` are also used in the test's own process for the TP1 reference.
"""

import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist

from pfppo_mega.config import load_config
from pfppo_mega.parallel import destroy_parallel
from pfppo_mega.trainer.asynchronous import weightfile
from pfppo_mega.trainer.loop import PPOTrainer


def batch_digest(scored) -> str:
    """The trained rows: prompts, responses, mask, behaviour log-probs and versions."""
    r = scored.rollout
    h = hashlib.sha256(json.dumps(r.prompt_ids).encode())
    for t in (r.responses, r.response_mask, r.behav_logp, r.versions):
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _file_matches_refit(sync, version: int, path: str) -> bool:
    """Every rank (collective): the file's buckets equal the ones the synchronous refit stream
    gathers from this layout's shards (rollout.refit.broadcast_stream over LiveWeights)."""
    theirs = {b.spec.index: b for b in weightfile.read(path, version)}
    live = sync.live(version)
    return all(torch.equal(b.flat, theirs[b.spec.index].flat) and b.checksum == theirs[b.spec.index].checksum
               for b in live.buckets(sync.plan, sync.groups.world))


def watch(tr, record: dict) -> None:
    """Record the run's pushes (the files, checked) and the digest of every trained batch."""
    col, sync = tr.run.strategies.collector, tr.run.colocation.sync
    push, collect = col.push, col.collect
    multi = dist.is_initialized() and dist.get_world_size() > 1

    def pushed(version):
        push(version)
        record["pids"].append(col.proc.pid if col.proc is not None else None)
        box = [col.proc.pool.held[version] if col.proc is not None else None]
        if multi:
            dist.broadcast_object_list(box, src=0)  # rank 0's path (every generator is told it)
        record["files"].append([version, box[0], _file_matches_refit(sync, version, box[0])])

    def collected(samples, **kw):
        scored, stats = collect(samples, **kw)
        record["digests"].append(batch_digest(scored))
        return scored, stats

    col.push, col.collect = pushed, collected


def _sabotaged(real, rank: int, who: int):
    """sync.live whose produce raises, on rank ``who`` only, for the buckets that rank owns."""
    def live_of(version):
        live = real(version)
        if rank == who:
            produce = live.produce

            def failing(spec, wire=None):
                if live.owner(spec) == rank:
                    raise RuntimeError(f"sabotaged producer on rank {rank}")
                return produce(spec, wire)
            live.produce = failing
        return live
    return live_of


def failures(tr, rank: int, out: str) -> dict:
    """A producer failing on rank 1 (stage 1's owner: its buckets travel point to point), then on
    rank 0 (stage 0, the writer): every rank raises WeightExportError, none waits; no file is left
    behind, and a version written afterwards works (the ranks are still in step)."""
    from pfppo_mega.trainer.asynchronous.export import WeightExportError, write_version
    from pfppo_mega.trainer.asynchronous.weightfile import WeightFiles

    sync, record = tr.run.colocation.sync, {}
    files = WeightFiles(out) if rank == 0 else None
    real = sync.live
    for who in (1, 0):
        sync.live = _sabotaged(real, rank, who)
        try:
            write_version(sync, files, 90 + who)
            record[f"fail_on_{who}"] = "written"
        except WeightExportError as e:
            record[f"fail_on_{who}"] = str(e)
    sync.live = real
    record["generator_failed"] = _generator_failure(tr.run.strategies.collector, rank)
    path = write_version(sync, files, 99)
    record["after"] = os.path.basename(path)
    if rank == 0:
        record["left"] = sorted(os.listdir(files.root))
        files.close()
    return record


def _generator_failure(col, rank: int) -> str:
    """The leader's generator failing for good (its _take raising GeneratorFailed, injected): every
    rank of the replica raises GeneratorFailed at the rows' broadcast, none waits in it."""
    from pfppo_mega.trainer.asynchronous.process import GeneratorFailed

    def failed(*_):
        raise GeneratorFailed("injected: died more than max_restarts times")

    if col.leader:
        col._take = failed
    try:
        col._replica_rows(0, 1, 0.0)
        return "no error"
    except GeneratorFailed as e:
        return str(e)
    finally:
        col.__dict__.pop("_take", None)


def _new_record() -> dict:
    return {"pids": [], "files": [], "digests": []}


def _finish(tr, result, record: dict, rank: int) -> dict:
    record["steps"] = result.steps
    record["pid_after_fit"] = tr.run.strategies.collector.proc.pid if tr.run.strategies.collector.proc else None
    record["metrics"] = [json.loads(line) for line in open(result.metrics_path)] if rank == 0 else []
    return record


def _alive(pids: list) -> list[int]:
    return [p for p in pids if p is not None and os.path.exists(f"/proc/{p}")
            and open(f"/proc/{p}/stat").read().split(") ")[1][0] != "Z"]


def _short_runs(config: str, out: str, base: list[str], rank: int, lines: list[str]) -> dict[str, dict]:
    """4 ranks: TP2 x PP2 (one replica: the TP gathers and the point-to-point sends together) and
    DP2 x TP2 (two replicas, two generators: leaders ranks 0 and 2), 2 steps each."""
    runs = {}
    for name, layout in (("tp2pp2", ["parallel.tensor_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2"]),
                         ("dp2tp2", ["parallel.tensor_model_parallel_size=2"])):
        with PPOTrainer(load_config(config, base + layout + [f"logging.output_dir={out}/{name}",
                                                            "training.total_training_steps=2"]), log=lines.append) as tr:
            rec = _new_record()
            watch(tr, rec)
            runs[name] = _finish(tr, tr.fit(), rec, rank)
        destroy_parallel()
    return runs


def main(config: str, out: str, sft: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # owned here: destroy_parallel between the layouts keeps it
    rank = dist.get_rank()
    base = [f"actor_rollout.model_path={sft}", "checkpoint.save_interval=3", "algorithm.async_rl.request_prompts=4"]
    if dist.get_world_size() == 4:
        lines4: list[str] = []
        _report(_short_runs(config, out, base, rank, lines4), rank)
        return
    tp2 = base + ["parallel.tensor_model_parallel_size=2", f"logging.output_dir={out}/tp2"]
    runs: dict[str, dict] = {}
    lines: list[str] = []
    with PPOTrainer(load_config(config, tp2 + ["training.total_training_steps=3"]), log=lines.append) as tr:
        rec = _new_record()
        watch(tr, rec)
        runs["tp2"] = _finish(tr, tr.fit(), rec, rank)
    with PPOTrainer(load_config(config, tp2 + ["checkpoint.resume=true", "training.total_training_steps=4"]),
                    log=lines.append) as tr:
        rec = _new_record()
        rec["resumed_at"] = tr.step
        rec["restored_requests"] = len(tr.run.strategies.collector.restored or [])  # the leader's file, every rank
        watch(tr, rec)
        runs["tp2_resumed"] = _finish(tr, tr.fit(), rec, rank)
    destroy_parallel()  # the TP2 layout's groups (the world group stays)
    pp2 = base + ["parallel.pipeline_model_parallel_size=2", f"logging.output_dir={out}/pp2",
                  "training.total_training_steps=2"]
    with PPOTrainer(load_config(config, pp2), log=lines.append) as tr:
        rec = _new_record()
        watch(tr, rec)
        runs["pp2"] = _finish(tr, tr.fit(), rec, rank)
        rec["failures"] = failures(tr, rank, out)
    destroy_parallel()
    _report(runs, rank)


def _report(runs: dict[str, dict], rank: int) -> None:
    for r in runs.values():
        r["pids_alive_after"] = _alive(r["pids"])
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"rank": rank, "runs": runs})
    if rank == 0:
        print("RESULT", json.dumps(everyone), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
