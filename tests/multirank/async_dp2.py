"""Run under torchrun (2 processes, gloo): the asynchronous mode at DP2, one generator process per
trainer rank (docs/async.md, "Data, tensor and pipeline parallel"). Each rank prints one `RESULT <json>` line for
tests/test_async_dp.py.

A run of 3 steps checkpoints at step 3 with requests in flight (each rank its own pending file);
a second run resumes it and takes step 4. Each rank records: its generator's pid (alive during the
run, gone after), the prompts it asked for, the weight files its generator was told about and
whether each holds exactly this rank's own replica of the weights (rank 0 writes them: the owner),
and its step records.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/multirank/async_dp2.py CONFIG OUT SFT
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from pfppo_mega import parallel
from pfppo_mega.config import load_config
from pfppo_mega.parallel import destroy_parallel
from pfppo_mega.rollout.live import LiveWeights
from pfppo_mega.trainer.asynchronous import weightfile
from pfppo_mega.trainer.loop import PPOTrainer


def _own_replica_matches(run, version: int, path: str) -> bool:
    """The file's buckets equal the ones this rank would pack from its own replica of the actor."""
    sync = run.colocation.sync
    mine = LiveWeights(sync.actor, sync.model_cfg, sync.layout, version)
    mine.dp_rank = 0  # test only: let a replica other than the owner produce its copy to compare
    theirs = {b.spec.index: b for b in weightfile.read(path, version)}
    return all(torch.equal(mine.produce(spec).flat, theirs[spec.index].flat) for spec in sync.plan)


def _watch(tr, record: dict) -> None:
    col = tr.run.strategies.collector
    push, submit = col.push, col.proc.submit

    def pushed(version):
        push(version)
        record["pids"].add(col.proc.pid)
        path = col.proc.pool.held[version]
        record["files"].append([version, path, _own_replica_matches(tr.run, version, path)])

    def submitted(req):
        record["prompts"].extend(req.prompts)
        record["row_offsets"].add(req.params.row_offset)
        return submit(req)

    col.push, col.proc.submit = pushed, submitted


def main(config: str, out: str, sft: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # owned here: destroy_parallel between the two runs keeps it
    rank = dist.get_rank()
    over = [f"actor_rollout.model_path={sft}", f"logging.output_dir={out}", "training.total_training_steps=3",
            "checkpoint.save_interval=3", "algorithm.async_rl.request_prompts=4"]
    record = {"rank": rank, "pids": set(), "files": [], "prompts": [], "row_offsets": set()}
    lines: list[str] = []
    with PPOTrainer(load_config(config, over), log=lines.append) as tr:
        _watch(tr, record)
        first = tr.fit()
        record["dp"] = tr.run.parallel.dp
        record["pid_after_fit"] = tr.run.strategies.collector.proc.pid
    with PPOTrainer(load_config(config, over + ["checkpoint.resume=true", "training.total_training_steps=4"]),
                    log=lines.append) as tr:
        record["resumed_at"] = tr.step
        record["restored_requests"] = len(tr.run.strategies.collector.restored or [])  # read from this rank's own file
        _watch(tr, record)
        second = tr.fit()
    destroy_parallel()  # the DP2 layout's groups (the world group stays)
    record["pids_alive_after"] = [p for p in record["pids"] if p is not None and os.path.exists(f"/proc/{p}")
                                  and open(f"/proc/{p}/stat").read().split(") ")[1][0] != "Z"]
    record["steps"] = [first.steps, second.steps]
    record["metrics"] = [json.loads(line) for line in open(second.metrics_path)] if rank == 0 else []
    record["pids"], record["row_offsets"] = sorted(p for p in record["pids"] if p), sorted(record["row_offsets"])
    everyone = parallel.dp_gather_objects(record, None if dist.get_world_size() == 1 else dist.group.WORLD)
    if rank == 0:
        print("RESULT", json.dumps(everyone), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
