"""Run under torchrun (2 processes): the full PPO trainer at TP2, PP2 and DP2, 3 steps each, then
resume a TP2 run from its sharded checkpoint. Global rank 0 prints one `RESULT <name> <json>` line
per layout for tests/test_trainer_parallel.py to compare with the single-process run.

At DP2 it also checks DP-size invariance of the batch statistics: one rollout batch per rank goes
through the trainer's score -> prepare -> advantages phases (reductions over the DP group), and
rank 0 runs the same phases at DP1 on the two ranks' rows concatenated (`RESULT dp2_invariance`).
Last, a DP2 run with the distributed optimizer checkpoints and resumes (`RESULT dp2_distopt`), and
so does a DP2 PF-PPO run whose pool is split across the ranks (`RESULT dp2_pf_resume`). A TP2 and
a PP2 run with the distributed optimizer checkpoint at step 2 and take step 3 uninterrupted
(`RESULT tp2_distopt` / `pp2_distopt`): the test resumes their checkpoints in one process (TP1,
resharded) and compares its step 3. A PP2 run with the engine's log-probs as the proximal policy
(`RESULT pp2_engine_logp`) is compared with the same run in one process.

Each layout's RESULT holds every replica's rollout requests (prompts, seed) of its 3 steps: at DP2
the two together must be the one-process run's. Resumes at another layout (trainer/checkpoint/resume.py), each
recording the rollout request (prompts, seed) and the sampled responses of its next step: the TP2 checkpoint at PP2 and the PP2 one at TP2 (`RESULT tp2_to_pp2` /
`pp2_to_tp2`, against `tp2_resumed` / `pp2_resumed`); the one-process checkpoint the test wrote
(argument 2) at TP2, PP2 and DP2 (`RESULT tp1_to_tp2` ...); and a TP2 step whose tp1 part was
copied from another run, which both ranks must refuse (`RESULT tp2_foreign`). A case that fails
prints its error as its result, so the others still report.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/multirank/trainer_layouts.py CONFIG.json \
        [ONE_PROCESS_CHECKPOINTS]
"""

import json
import shutil
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from pfppo_mega import parallel, ppo
from pfppo_mega.config import load_config_dict
from pfppo_mega.parallel import destroy_parallel
from pfppo_mega.trainer.batch import PreparedBatch, ScoredBatch, concat_rollouts, pack
from pfppo_mega.trainer.instruments import devicecheck
from pfppo_mega.trainer.checkpoint import resume
from pfppo_mega.trainer.build import DataParallel
from pfppo_mega.trainer.loop import PPOTrainer

KEYS = ("policy/pg_loss", "critic/value_loss", "reward/mean", "kl/ref_k1", "policy/grad_norm")
LAYOUTS = (("tp2", 2, 1), ("pp2", 1, 2), ("dp2", 1, 1))


def record_requests(tr: PPOTrainer, responses: list | None = None) -> list:
    """[[prompts, seed]] of each rollout this rank asks its engines for from now on (its replica's);
    ``responses``: the response tokens each returned are appended to it."""
    seen: list = []
    inner = tr.run.colocation.gen.run_engine

    def recorded(prompt_ids, params, **kw):
        out = inner(prompt_ids, params, **kw)
        if str(kw.get("what", "")).startswith("rollout"):
            seen.append([[list(p) for p in prompt_ids], params.seed])
            if responses is not None:
                responses.append([r[: int(n)].tolist() for r, n in zip(out.responses, out.lengths)])
        return out

    tr.run.colocation.gen.run_engine = recorded
    return seen


def resumed_at(base: dict, name: str, source: Path, tp: int, pp: int) -> dict:
    """The checkpoints under `source` (another layout's) copied to this case's folder and resumed at
    tp x pp (the rest DP) by both ranks; one step: its metrics and every replica's request."""
    d = json.loads(json.dumps(base))
    d["parallel"] = {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp}
    d["logging"]["output_dir"] = f"{base['logging']['output_dir']}/{name}"
    d["checkpoint"] = {"save_interval": 0, "resume": True, "export_hf": False}
    if dist.get_rank() == 0:
        shutil.copytree(source, Path(d["logging"]["output_dir"]) / "checkpoints")
    dist.barrier()
    msgs: list[str] = []
    tr = PPOTrainer(load_config_dict(d), log=msgs.append)
    resumed_step = tr.step
    responses: list = []
    requests = record_requests(tr, responses)
    m = tr.train_step()
    everyone = parallel.dp_gather_objects({"dp_rank": tr.run.parallel.dp_rank, "requests": requests,
                                           "responses": responses}, parallel.world_group())
    return {"resumed_step": resumed_step, "step": tr.step, "metrics": {k: m[k] for k in KEYS}, "msgs": msgs,
            "replicas": {e["dp_rank"]: e["requests"] for e in everyone},
            "responses": {e["dp_rank"]: e["responses"] for e in everyone}}


def foreign_part(base: dict) -> dict:
    """The TP2 run's step 3 with its tp1 part replaced by the TP2 distributed-optimizer run's (another
    run, step 2), the global manifest re-signed: rank 1 reads that part, rank 0 does not, and both
    must refuse the step by name (PartBindingError) before loading anything."""
    from pfppo_mega.trainer.checkpoint import store as ckpt

    d = json.loads(json.dumps(base))
    d["parallel"] = {"tensor_model_parallel_size": 2}
    d["logging"]["output_dir"] = f"{base['logging']['output_dir']}/tp2_foreign"
    d["checkpoint"] = {"save_interval": 0, "resume": True, "export_hf": False}
    root = Path(base["logging"]["output_dir"])
    step = Path(d["logging"]["output_dir"]) / "checkpoints" / "step_000003"
    if dist.get_rank() == 0:
        shutil.copytree(root / "tp2" / "checkpoints", step.parent)
        shutil.rmtree(step / "tp1-pp0-dp0")
        shutil.copytree(root / "tp2_distopt" / "checkpoints" / "step_000002" / "tp1-pp0-dp0", step / "tp1-pp0-dp0")
        top = json.loads((step / ckpt.MANIFEST).read_text())
        top["parts"]["tp1-pp0-dp0"] = ckpt.part_digest(step / "tp1-pp0-dp0")
        (step / ckpt.MANIFEST).write_text(json.dumps(top))
    dist.barrier()
    try:
        PPOTrainer(load_config_dict(d), log=lambda *_: None)
        mine = None
    except Exception as e:  # noqa: BLE001 -- what each rank raised is the result
        mine = f"{type(e).__name__}: {e}"
    return {"errors": parallel.dp_gather_objects(mine, parallel.world_group())}


def guarded(name: str, fn, *args) -> None:
    """Run one case and print its RESULT (rank 0), or its error as the result: the launch goes on."""
    try:
        r = fn(*args)
    except Exception as e:  # noqa: BLE001
        r = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
    if dist.get_rank() == 0:
        print("RESULT", name, json.dumps(r), flush=True)
    destroy_parallel()


def _record(store: list, sb: ScoredBatch) -> ScoredBatch:
    store.append(sb.raw_scores)
    return sb


def _pad(t: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, (0, width - t.shape[1]))


def dp_invariance(tr: PPOTrainer) -> dict | None:
    """The trainer's score/prepare/advantages on this rank's rows (DP reductions) vs the same phases
    at DP1 on every rank's rows concatenated (rank 0 only). Max abs differences, plus how far the
    per-rank (unreduced) statistics would be off, so the check is known to be sensitive."""
    seen_rows = tr.run.state.running_reward.count  # rewards merged so far (every rank: the global count)
    tr.run.state.running_reward.load_state_dict({"count": 0.0, "mean": 0.0, "m2": 0.0})  # the probe's batch alone
    rb, _ = tr.rollout(tr.run.prompts.next_batch(tr.run.cfg.training.rollout_batch_size // tr.run.parallel.dp))
    sb = tr.score(rb)
    prep = tr.prepare(sb)
    eb = tr.advantages(sb, prep)
    mine = {"rb": rb, "raw": sb.raw_scores, "scores": sb.scores, "prep": prep, "adv": eb.advantages,
            "running": tr.run.state.running_reward.state_dict(), "seen_rows": seen_rows}
    everyone = parallel.dp_gather_objects(mine, tr.run.dp.group)
    if tr.run.parallel.dp_rank != 0:
        return None
    n = sum(len(e["raw"]) for e in everyone)
    rb_all = concat_rollouts([e["rb"] for e in everyone], list(range(n)), pad_id=tr.run.tokenizer.pad_id)
    width = rb_all.responses.shape[1]
    inputs = pack(rb_all.prompt_ids, rb_all.responses, rb_all.response_mask, pad_id=tr.run.tokenizer.pad_id)
    prep_all = PreparedBatch(inputs=inputs, **{k: torch.cat([_pad(getattr(e["prep"], k), width) for e in everyone])
                                               for k in ("old_logp", "ref_logp", "values", "entropy")})
    raw_all = torch.cat([e["raw"] for e in everyone])
    c = tr.run.cfg.reward
    serial = ppo.RunningMoments()
    scores_all = ppo.scale_rewards(raw_all, method=c.scaling, running=serial)  # DP1: no reduction
    scores_all = ppo.clip_rewards(ppo.quantile_clip(scores_all, quantile=c.quantile_clip), clip_range=c.clip_range)
    saved = tr.run.dp
    tr.run.dp = DataParallel.of(None, 1)  # the advantages phase at DP1 on the concatenation (no collective inside)
    eb_all = tr.advantages(ScoredBatch(rb_all, raw_all, scores_all, 0), prep_all)
    tr.run.dp = saved
    adv_dp = torch.cat([_pad(e["adv"], width) for e in everyone])
    # What per-rank statistics would give: each rank's rows re-whitened on their own.
    local = torch.cat([_pad(ppo.masked_whiten(e["adv"], e["prep"].inputs.response_mask), width) for e in everyone])
    return {"scores_diff": float((torch.cat([e["scores"] for e in everyone]) - scores_all).abs().max()),
            "adv_diff": float((adv_dp - eb_all.advantages).abs().max()),
            "adv_local_diff": float((local - eb_all.advantages).abs().max()),
            "rows": n, "scaling": c.scaling, "seen_rows": [e["seen_rows"] for e in everyone],
            "running_count": [e["running"]["count"] for e in everyone], "serial_count": serial.count,
            "running_mean_diff": max(abs(e["running"]["mean"] - serial.mean) for e in everyone)}


def split_vs_single(tr: PPOTrainer) -> dict:
    """The rollout split across the engines (every rank generates a share, the rows are exchanged)
    against this rank's engine generating the replica's whole batch alone, same weights and seed, its
    rows at their place in the job's rows (row_offset: replicas of equal batches, in dp_rank order):
    tokens and log-probs must be identical (row_seed makes a row's draw independent of its call)."""
    from dataclasses import replace

    from pfppo_mega.rollout import SamplingParams

    run = tr.run
    samples = run.prompts.next_batch(run.cfg.training.rollout_batch_size // run.parallel.dp)
    prompts = [list(x.prompt_ids) for x in samples for _ in range(2)]
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=run.cfg.algorithm.max_response_length,
                            eos_token_id=run.tokenizer.eos_id, seed=1234)  # the job's seed, every replica
    run.colocation.gen.work.take()
    split = run.colocation.gen.run_engine(prompts, params, step=tr.step, what="split check")
    work = run.colocation.gen.work.take()
    alone = run.colocation.engine.generate(prompts, replace(params, row_offset=run.parallel.dp_rank * len(prompts)))
    return {"tokens_equal": bool(torch.equal(split.responses, alone.responses)),
            "logp_max_gap": float((split.logprobs - alone.logprobs).abs().max()),
            "generated": work.generated, "needed": work.needed}


def split_run(d: dict, steps: int, *, against_one_engine: bool = False) -> dict:
    """A trainer with the layout and engine ``d`` names, ``steps`` steps with PF-PPO on (rank 0 draws
    each step's snapshot assignment, every rank must hold the same table): the job's generated /
    needed tokens per step, each rank's work, and whether every rank's assignment equals rank 0's
    own draw (recorded around the broadcast); ``against_one_engine`` (an engine each rank can call
    alone): split_vs_single afterwards."""
    from pfppo_mega.trainer import behaviour

    drawn: list = []
    broadcast = behaviour.broadcast_assignment

    def recorded(assign, n, group=None):
        out = broadcast(assign, n, group=group)
        drawn.append((None if assign is None else assign.tolist(), out.tolist()))
        return out

    behaviour.broadcast_assignment = recorded
    try:
        tr = PPOTrainer(load_config_dict(d), log=lambda *_: None)
        metrics = [tr.train_step() for _ in range(steps)]
    finally:
        behaviour.broadcast_assignment = broadcast
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"drawn": drawn, "generated": [m["work/tokens_generated"] for m in metrics],
                                      "refit_bytes": [m["work/refit_bytes_received"] for m in metrics],
                                      "switch_bytes": [m["work/switch_bytes_received"] for m in metrics],
                                      "host_bytes": [m.get("work/host_bytes_held") for m in metrics]})
    rank0 = [mine for mine, _ in everyone[0]["drawn"]]
    same = all([got for _, got in e["drawn"]] == rank0 for e in everyone)
    split: list = [None] * dist.get_world_size()
    if against_one_engine:  # the split rows vs this rank's engine generating the replica's batch alone
        dist.all_gather_object(split, split_vs_single(tr))
    return {"generated_over_needed": [m["rollout/generated_over_needed"] for m in metrics], "split": split,
            "assignment_from_rank0": same and len(rank0) == steps, "ranks": everyone,
            "tp": tr.run.parallel.tp, "pp": tr.run.parallel.pp, "dp": tr.run.parallel.dp,
            "rollout_tp": d["actor_rollout"].get("tensor_model_parallel_size", 1),
            "engine": type(tr.run.colocation.engine).__name__}


def pf_ppo(base: dict, name: str, **sections) -> dict:
    """``base`` with PF-PPO on (a pool of 2, a snapshot every step) and ``sections`` merged in."""
    d = json.loads(json.dumps(base))
    d["algorithm"]["use_pf_ppo"] = True
    d["algorithm"]["pool"] = {"pool_size": 2, "snapshot_interval": 1, "sampling": "uniform"}
    d["logging"]["output_dir"] = f"{base['logging']['output_dir']}/{name}"
    d["checkpoint"] = {"save_interval": 0, "resume": False, "export_hf": False}
    for sec, vals in sections.items():
        d.setdefault(sec, {}).update(vals)
    return d


def _shard_state(tr: PPOTrainer) -> list[torch.Tensor]:
    """This rank's distributed-optimizer shards (fp32 main params, exp_avg, exp_avg_sq, step) of
    both models, in the optimizers' parameter order."""
    out = []
    for opt in (tr.run.models.actor_opt, tr.run.models.critic_opt):
        for o in getattr(opt, "chained_optimizers", None) or [opt]:
            for group in o.optimizer.param_groups:
                for p in group["params"]:
                    per = o.optimizer.state[p]
                    out += [p.detach().clone(), *(per[k].detach().clone() for k in ("exp_avg", "exp_avg_sq", "step"))]
    return out


def dp2_distributed_optimizer(base: dict) -> dict:
    """DP2 with parallel.use_distributed_optimizer and bf16 params: 2 steps, a checkpoint (each
    rank's optimizer shard gathered to dp_rank 0), then a trainer resumed from it must hold every
    rank's shard exactly (scattered back), and take a further step."""
    d = json.loads(json.dumps(base))
    d["parallel"] = {"use_distributed_optimizer": True}
    d["model"]["params_dtype"] = "bfloat16"
    d["logging"]["output_dir"] = f"{base['logging']['output_dir']}/dp2_distopt"
    d["checkpoint"] = {"save_interval": 0, "resume": False, "export_hf": False}
    tr = PPOTrainer(load_config_dict(d), log=lambda *_: None)
    for _ in range(2):
        tr.train_step()
    resume.save(tr.run, tr.run.out_dir / "checkpoints")
    saved = _shard_state(tr)
    d["checkpoint"]["resume"] = True
    again = PPOTrainer(load_config_dict(d), log=lambda *_: None)
    loaded = _shard_state(again)
    diff = max((a.double() - b.double()).abs().max().item() for a, b in zip(saved, loaded))
    mine = {"diff": diff if len(saved) == len(loaded) else float("inf"), "n": len(saved),
            "numel": sum(t.numel() for t in saved[::4]), "sum": sum(float(t.double().sum()) for t in saved[1::4]),
            "model_numel": sum(p.numel() for m in (tr.run.models.actor, tr.run.models.critic) for p in m.parameters())}
    m = again.train_step()
    everyone = parallel.dp_gather_objects(mine, again.run.dp.group)
    return {"dp": again.run.parallel.dp, "resumed_step": again.step - 1, "ranks": everyone,
            "next_loss_finite": bool(torch.isfinite(torch.tensor(m["policy/pg_loss"])))}


def dp2_pf_ppo_resume(base: dict) -> dict:
    """DP2 PF-PPO: each rank keeps half of every pool snapshot (the node's pool is split across its
    ranks). A checkpoint saves both halves (dp_rank 0's in the checkpoint, dp_rank 1's in its own
    pool-dp1 series); the resumed trainer holds, on every rank, exactly the shards it saved, and
    switches to a restored snapshot (every rank broadcasting its half) in the next step."""
    d = json.loads(json.dumps(base))
    d["algorithm"]["use_pf_ppo"] = True
    d["algorithm"]["pool"] = {"pool_size": 2, "snapshot_interval": 1, "sampling": "uniform"}
    d["actor_rollout"]["refit_bucket_mb"] = 0.01  # many buckets, so each rank keeps some
    d["logging"]["output_dir"] = f"{base['logging']['output_dir']}/dp2_pf"
    d["checkpoint"] = {"save_interval": 0, "resume": False, "export_hf": False}
    tr = PPOTrainer(load_config_dict(d), log=lambda *_: None)
    for _ in range(2):
        tr.train_step()
    resume.save(tr.run, tr.run.out_dir / "checkpoints")
    saved = (tr.run.strategies.behaviour.pool.versions, tr.run.strategies.behaviour.pool._producer_checksums)
    d["checkpoint"]["resume"] = True
    again = PPOTrainer(load_config_dict(d), log=lambda *_: None)
    restored = (again.run.strategies.behaviour.pool.versions, again.run.strategies.behaviour.pool._producer_checksums)
    m = again.train_step()
    mine = {"same": restored == saved, "kept": sorted(i for c in saved[1].values() for i in c),
            "versions": saved[0], "used": m.get("pool/snapshots_used", 0.0)}
    everyone = parallel.dp_gather_objects(mine, again.run.dp.group)
    return {"dp": again.run.parallel.dp, "step": again.step, "ranks": everyone,
            "next_loss_finite": bool(torch.isfinite(torch.tensor(m["policy/pg_loss"])))}


def distopt_step3(base: dict, name: str, tp: int, pp: int) -> dict:
    """The distributed optimizer at TP/PP 2 (fp32): 2 steps, a (background) checkpoint, then step 3
    straight on; its metrics are what a resharded resume of the checkpoint must reproduce."""
    d = json.loads(json.dumps(base))
    d["parallel"] = {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                     "use_distributed_optimizer": True}
    d["logging"]["output_dir"] = f"{base['logging']['output_dir']}/{name}"
    d["checkpoint"] = {"save_interval": 0, "resume": False, "export_hf": False}
    tr = PPOTrainer(load_config_dict(d), log=lambda *_: None)
    for _ in range(2):
        tr.train_step()
    root = tr.run.out_dir / "checkpoints"
    info = resume.save(tr.run, root)
    resume.wait(root)
    m = tr.train_step()
    return {"metrics": {k: m[k] for k in KEYS}, "bytes": info.bytes, "blocked_s": info.blocked_s}


ENGINE_LOGP_KEYS = KEYS + ("policy/entropy_first10", "rollout/logp_gap_max")


def engine_logp_run(base: dict, name: str, tp: int = 1, pp: int = 1, steps: int = 2) -> list[dict]:
    """``steps`` steps with algorithm.recompute_old_logp false (the engine's log-probs as the proximal
    policy): the entropy and the engine/trainer gap come from the update, on the last pipeline stage,
    and must reach the logging rank (stage 0 at pp2)."""
    d = json.loads(json.dumps(base))
    d["parallel"] = {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp}
    d["algorithm"]["recompute_old_logp"] = False
    d["logging"]["output_dir"] = f"{base['logging']['output_dir']}/{name}"
    d["checkpoint"] = {"save_interval": 0, "resume": False, "export_hf": False}
    tr = PPOTrainer(load_config_dict(d), log=lambda *_: None)
    return [{k: m.get(k) for k in ENGINE_LOGP_KEYS} for m in (tr.train_step() for _ in range(steps))]


def main(path: str, one_process: str | None = None) -> None:
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
        rewards: list[torch.Tensor] = []  # this rank's generated rewards per step
        score = tr.score
        tr.score = lambda rb: _record(rewards, score(rb))
        requests = record_requests(tr)  # each replica's (prompts, seed) per step: at DP2 the DP1 run's rows
        metrics = [tr.train_step() for _ in range(3)]
        replicas = parallel.dp_gather_objects(requests, tr.run.dp.group)
        steps = [{k: m[k] for k in KEYS} for m in metrics]
        resume.save(tr.run, tr.run.out_dir / "checkpoints")
        everyone = parallel.dp_gather_objects(rewards, tr.run.dp.group)
        # reward/std and quantiles are those of the global batch (every DP rank's rewards)
        reward_gap = max(max(abs(m["reward/std"] - torch.cat([e[i] for e in everyone]).std().item()),
                             abs(m["reward/q90"] - torch.quantile(torch.cat([e[i] for e in everyone]), 0.9).item()))
                         for i, m in enumerate(metrics))
        checks: list = [None] * dist.get_world_size()
        dist.all_gather_object(checks, split_vs_single(tr))
        if tr.run.is_logger:
            print("RESULT", name, json.dumps({"steps": steps, "dp": tr.run.parallel.dp, "reward_stat_gap": reward_gap,
                                              "generated_over_needed": [m["rollout/generated_over_needed"]
                                                                        for m in metrics],
                                              "split": checks, "replica_requests": replicas}), flush=True)
        if name == "dp2":
            inv = dp_invariance(tr)
            if tr.run.is_logger:
                print("RESULT dp2_invariance", json.dumps(inv), flush=True)
        if name in ("tp2", "pp2"):  # resume from the sharded checkpoint, take one more step
            d["checkpoint"]["resume"] = True
            again = PPOTrainer(load_config_dict(d), log=lambda *_: None)
            requests = record_requests(again)
            m = again.train_step()
            if again.run.is_logger:
                print(f"RESULT {name}_resumed", json.dumps({"step": again.step, "pg_loss": m["policy/pg_loss"],
                                                            "metrics": {k: m[k] for k in KEYS},
                                                            "requests": requests}), flush=True)
            destroy_parallel()
            other, tp_pp = {"tp2": ("pp2", (1, 2)), "pp2": ("tp2", (2, 1))}[name]  # crossing TP <-> PP
            guarded(f"{name}_to_{other}", resumed_at, base, f"{name}_to_{other}",
                    Path(d["logging"]["output_dir"]) / "checkpoints", *tp_pp)
        destroy_parallel()
    result = dp2_distributed_optimizer(base)
    if dist.get_rank() == 0:
        print("RESULT dp2_distopt", json.dumps(result), flush=True)
    destroy_parallel()
    for name, tp, pp in (("tp2_distopt", 2, 1), ("pp2_distopt", 1, 2)):
        r = distopt_step3(base, name, tp, pp)
        if dist.get_rank() == 0:
            print("RESULT", name, json.dumps(r), flush=True)
        destroy_parallel()
    guarded("tp2_foreign", foreign_part, base)
    for name, tp, pp in (("tp1_to_tp2", 2, 1), ("tp1_to_pp2", 1, 2), ("tp1_to_dp2", 1, 1)) if one_process else ():
        guarded(name, resumed_at, base, name, Path(one_process), tp, pp)  # the one-process checkpoint, upward
    steps = engine_logp_run(base, "pp2_engine_logp", pp=2)
    if dist.get_rank() == 0:
        print("RESULT pp2_engine_logp", json.dumps({"steps": steps}), flush=True)
    destroy_parallel()
    pf = dp2_pf_ppo_resume(base)
    if dist.get_rank() == 0:
        print("RESULT dp2_pf_resume", json.dumps(pf), flush=True)
        # PFPPO_DEVICE_CHECK=1 (set by the test): every train_step above ran in a device-check session
        print("RESULT device_check", json.dumps({"requested": devicecheck.requested(), **devicecheck.TOTALS}),
              flush=True)
    destroy_parallel()
    # last (an in-process vLLM changes the process): rollout TP 2 -- one vLLM engine over both ranks
    # (external launcher) generating both DP replicas' rows, PF-PPO assignment from rank 0
    from pfppo_mega.rollout.vllm import unavailable_reason

    why = unavailable_reason()
    if why:
        if dist.get_rank() == 0:
            print("SKIP vllm_rtp2", why, flush=True)
    else:
        rtp2 = split_run(pf_ppo(base, "vllm_rtp2", actor_rollout={"engine": "vllm", "tensor_model_parallel_size": 2}),
                         steps=2)
        if dist.get_rank() == 0:
            print("RESULT vllm_rtp2", json.dumps(rtp2), flush=True)
        destroy_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
