"""Run under torchrun (2 processes): the full PPO trainer at TP2, PP2 and DP2, 3 steps each, then
resume a TP2 run from its sharded checkpoint. Global rank 0 prints one `RESULT <name> <json>` line
per layout for tests/test_trainer_parallel.py to compare with the single-process run.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/multirank/trainer_layouts.py CONFIG.json
"""

import json
import sys

import torch
import torch.distributed as dist

from pfppo_mega.config import load_config_dict
from pfppo_mega.parallel import destroy_parallel
from pfppo_mega.trainer.loop import PPOTrainer

KEYS = ("policy/pg_loss", "critic/value_loss", "reward/mean", "kl/ref_k1", "policy/grad_norm")
LAYOUTS = (("tp2", 2, 1), ("pp2", 1, 2), ("dp2", 1, 1))


def main(path: str) -> None:
    base = json.load(open(path))
    torch.set_num_threads(1)
    # Own the world group here, so destroy_parallel() between layouts keeps it (re-creating a
    # torchrun world group in the same processes does not work).
    dist.init_process_group("gloo")
    for name, tp, pp in LAYOUTS:
        d = json.loads(json.dumps(base))
        d["parallel"] = {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp}
        d["logging"]["output_dir"] = f"{base['logging']['output_dir']}/{name}"
        d["checkpoint"] = {"save_interval": 3, "resume": False, "export_hf": False}
        tr = PPOTrainer(load_config_dict(d), log=lambda *_: None)
        steps = [{k: m[k] for k in KEYS} for m in (tr.train_step() for _ in range(3))]
        tr.save(tr.out_dir / "checkpoints")
        if tr.is_logger:
            print("RESULT", name, json.dumps({"steps": steps, "dp": tr.parallel.dp}), flush=True)
        if name == "tp2":  # resume from the per-model-parallel-rank checkpoints, take one more step
            d["checkpoint"]["resume"] = True
            again = PPOTrainer(load_config_dict(d), log=lambda *_: None)
            m = again.train_step()
            if again.is_logger:
                print("RESULT tp2_resumed", json.dumps({"step": again.step, "pg_loss": m["policy/pg_loss"]}),
                      flush=True)
        destroy_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
