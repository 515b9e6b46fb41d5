"""Every shipped config's models, built and trained one step on gloo, in ONE torchrun launch of 4
processes (started by tests/test_every_config.py):

    python -m torch.distributed.run --standalone --nproc_per_node=4 tests/multirank/config_steps.py CONFIG... \
        [--trainer=CONFIG.json]

(--trainer: afterwards, the whole trainer at TP2 x PP2 on these ranks, sharing the launch; see trainer_tp2pp2.)

For each config: the model at reduced width (hidden 8 per head, ffn 2 x hidden, vocab 128, one
layer per pipeline stage; heads and query groups kept), the config's layout clipped to these 4
ranks (tp = min(tp, 2), pp = min(pp, 2), dp the rest) and its training features (layer spec,
distributed optimizer, params dtype, sequence parallelism) as megatron runs them on CPU. The actor
is built, wrapped in megatron DDP, and trained one step (forward, backward, finalize, optimizer
step); the critic is built and runs a forward. What the CPU cannot run is replaced or skipped with
the reason printed (``gpt.check_features(..., device_type="cpu")`` must then pass): training.recompute
(megatron's recompute makes CUDA tensors in the backward pass; the meta-device build of
tests/test_every_config.py constructs it at the full layout). Rank 0 prints

    RESULT <config> step PASS|FAIL loss=<x> <note>
    SUBST <config> <key> <from> -> <to>: <reason>
    SKIP <config> <reason>
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

import torch.distributed as dist  # noqa: E402

from pfppo_mega import parallel  # noqa: E402
from pfppo_mega.config import load_config  # noqa: E402

CPU_SUBSTITUTIONS = {  # feature -> (value on CPU, why)
    "recompute": ("none", "megatron's recompute re-runs the forward inside the backward and makes CUDA tensors "
                          "there; its construction is checked at the full layout by the meta-device build"),
}


def say(line: str) -> None:
    if dist.get_rank() == 0:
        print(line, flush=True)


def all_ok(ok: bool) -> bool:
    t = torch.tensor([0 if ok else 1])
    dist.all_reduce(t)
    return int(t) == 0


def reduced(model, pp: int):
    h = 8 * model.num_attention_heads
    return dataclasses.replace(model, hidden_size=h, ffn_hidden_size=2 * h, vocab_size=128, num_layers=pp)


def batch(rows: int):
    from pfppo_mega.types import pack

    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(1, 128, (3 + i % 2,), generator=g).tolist() for i in range(rows)]
    responses = torch.randint(1, 128, (rows, 5), generator=g)
    mask = torch.ones(rows, 5, dtype=torch.long)
    mask[0, 3:] = 0
    return pack(prompts, responses, mask, pad_id=0)


def step(name: str, cfg) -> None:
    from pfppo_mega.models import passes, gpt

    world = dist.get_world_size()
    tp = min(cfg.parallel.tensor_model_parallel_size, 2)
    pp = min(cfg.parallel.pipeline_model_parallel_size, 2)
    feats = gpt.features_from_config(cfg)
    if cfg.model.layer_spec == "transformer_engine":  # auto: the local layers where TE is absent (here)
        say(f"SKIP {name} model.layer_spec={cfg.model.layer_spec}: transformer-engine cannot run on CPU")
        return
    for key, (value, why) in CPU_SUBSTITUTIONS.items():
        if getattr(feats, key) != value:
            say(f"SUBST {name} {key} {getattr(feats, key)} -> {value}: {why}")
            feats = dataclasses.replace(feats, **{key: value})
    if tp == 1 and feats.sequence_parallel:
        feats = dataclasses.replace(feats, sequence_parallel=False)
        say(f"SUBST {name} sequence_parallel True -> False: the clipped layout has tp 1")
    model = reduced(cfg.model, pp)
    t0 = time.perf_counter()
    parallel.init_parallel(tp=tp, pp=pp, seed=cfg.training.seed)
    loss, ok, note = float("nan"), False, ""
    try:
        gpt.check_features(model, feats, device_type="cpu", tp=tp)  # nothing else is refused on CPU
        actor = gpt.wrap_ddp(gpt.build_actor(model, features=feats), features=feats)
        opt = gpt.build_optimizer(actor, lr=1e-5, weight_decay=0.0, grad_clip=cfg.training.grad_clip)
        inputs = batch(2)

        def loss_fn(logp, entropy, mb):
            m = mb.inputs.response_mask
            return -(logp.float() * m).sum() * passes.share_scale(m, mb.norm, mode="token-mean"), {}

        actor.train()
        res = passes.train_step(actor, opt, inputs, loss_fn, temperature=1.0, micro_batch_size=1)
        critic = gpt.build_critic(model, features=feats)
        values = passes.forward_values(critic, inputs, micro_batch_size=1)
        dtypes = {str(p.dtype).replace("torch.", "") for p in actor.parameters()}
        loss = res.loss
        ok = res.update_successful and math.isfinite(loss) and bool(torch.isfinite(values).all()) and \
            dtypes == {cfg.model.params_dtype}
        note = (f"tp={tp} pp={pp} dp={world // (tp * pp)} dtype={','.join(sorted(dtypes))} "
                f"distopt={feats.use_distributed_optimizer} sp={feats.sequence_parallel} "
                f"recompute={feats.recompute} {time.perf_counter() - t0:.1f}s")
    except Exception as e:  # every rank raises alike (same config, same construction)
        note = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if dist.get_rank() == 0:
            traceback.print_exc()
    finally:
        parallel.destroy_parallel()
    say(f"RESULT {name} step {'PASS' if all_ok(ok) else 'FAIL'} loss={loss:.4g} {note}")


def trainer_tp2pp2(path: str) -> None:
    """The whole PPO trainer at TP2 x PP2 (these 4 ranks, one replica) with PF-PPO, 2 steps, from the
    config JSON of tests/test_trainer_parallel.py's setup: generated / needed tokens over the job and
    rank 0's snapshot assignment (tests/multirank/trainer_layouts.py:split_run). Prints
    ``TRAINER tp2pp2 <json>``."""
    import json

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from trainer_layouts import pf_ppo, split_run

    base = json.loads(Path(path).read_text())
    d = pf_ppo(base, "tp2pp2", parallel={"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2})
    try:
        res = split_run(d, steps=2, against_one_engine=True)
    finally:
        parallel.destroy_parallel()
    say("TRAINER tp2pp2 " + json.dumps(res))


def main() -> None:
    dist.init_process_group("gloo")
    trainer = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--trainer=")]
    for arg in (a for a in sys.argv[1:] if not a.startswith("--trainer=")):
        path = Path(arg)
        name = path.name
        try:
            cfg = load_config(path, [])
        except Exception as e:  # refused by key at load: printed, nothing built
            say(f"SKIP {name} refused at load: {str(e).splitlines()[-1].strip()}")
            continue
        if not cfg.model.is_complete():
            say(f"SKIP {name} no model shape in the file (it comes from actor_rollout.model_path's config.json)")
            continue
        step(name, cfg)
    for path in trainer:
        trainer_tp2pp2(path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
