"""`pfppo plan CONFIG [key.path=value ...] [--gpu h100|h200] [...]`: the memory plan of a config.

Prints per-GPU memory of the training and rollout phases, the rollout engine's KV cache and
the host memory per node, and with ``--ledger`` the device-memory ledger phase by phase for every
pipeline stage (model and formulas: ``pfppo_mega.ledger``, which the trainer checks at
every phase too). Exit status:
0 the layout fits; 2 it does not (every budget over its capacity is named with the amount and
its components), or the config / flags are invalid; 1 a ``--dry-run-rank`` check found megatron
disagreeing with the planner's layout arithmetic.

Hardware facts come from flags (--gpu, --nodes, --gpus-per-node, --gpu-memory-gib,
--host-memory-gib); the model, the layout and the training features (training.recompute,
parallel.sequence_parallel, parallel.use_distributed_optimizer, model.layer_spec) from the config,
as the trainer and scripts/slurm/70b_pfppo.sh read them; runtime choices the config tree does not
hold (pool placement, reserves) from flags. The rollout engine's TP, dtype and sleep level are the
config's actor_rollout.tensor_model_parallel_size / dtype / sleep_level, as the engine reads them;
``--rollout-tp`` overrides the TP only when given, with a printed note. The offload of the trainer's states during
rollout is the config's training.offload_during_rollout (null: on, as the trainer does on GPUs).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pfppo_mega.planning.memory import (
    GPUS, POOL_PLACEMENT, Budget, GiB, Hardware, Knobs, Plan, RunShape, make_plan,
)
from pfppo_mega.planning.shapes import total_param_count
from pfppo_mega.ledger import reward_model_shape as ledger_reward_model_shape


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pfppo plan", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", help="YAML config")
    ap.add_argument("overrides", nargs="*", help="key.path=value, applied after the file")
    hw = ap.add_argument_group("hardware")
    hw.add_argument("--gpu", choices=sorted(GPUS), default="h200")
    hw.add_argument("--nodes", type=int, default=8)
    hw.add_argument("--gpus-per-node", type=int, default=8)
    hw.add_argument("--gpu-memory-gib", type=float, default=None, help="override the GPU's memory")
    hw.add_argument("--host-memory-gib", type=float, default=None, help="override host memory per node")
    tr = ap.add_argument_group("runtime choices (the training features are config keys: see --help of each)")
    d = Knobs()
    tr.add_argument("--micro-batch", type=int, default=None,
                    help="sequences per micro-batch (default: the config's training.micro_batch_size)")
    # Former flags, now config keys (so the plan, the Slurm script and the trainer read one value):
    # refused with the override to use instead.
    for flag, takes_value in (("--recompute", True), ("--no-sequence-parallel", False), ("--layer", True),
                              ("--no-distributed-optimizer", False)):
        kind = {"action": "store"} if takes_value else {"action": "store_const", "const": True}
        tr.add_argument(flag, dest="moved_" + flag.strip("-").replace("-", "_"), help=argparse.SUPPRESS, **kind)
    tr.add_argument("--no-offload", dest="offload_during_rollout", action="store_false",
                    help="keep the trainer's states on the GPU during rollout (the same as the override "
                         "training.offload_during_rollout=false, which the trainer reads)")
    tr.add_argument("--rollout-tp", type=int, default=None,
                    help="override the rollout engine TP (default: the config's actor_rollout.tensor_model_parallel_size, "
                         "which the engine uses; a note is printed when they differ)")
    tr.add_argument("--reserve-gib", type=float, default=d.reserve_gib)
    tr.add_argument("--rollout-workspace-gib", type=float, default=d.rollout_workspace_gib)
    tr.add_argument("--host-reserve-gib", type=float, default=d.host_reserve_gib)
    tr.add_argument("--pool-placement", choices=POOL_PLACEMENT, default=d.pool_placement)
    out = ap.add_argument_group("output")
    out.add_argument("--json", dest="json_path", default=None, help="also write the plan as JSON")
    out.add_argument("--ledger", action="store_true",
                     help="also print the device-memory ledger phase by phase for every pipeline stage (the "
                          "order the trainer runs: build, then one step; pfppo_mega/ledger.py)")
    out.add_argument("--dry-run-rank", action="append", default=[], metavar="R[,R...]",
                     help="build rank R's megatron groups and meta-device models at the full world "
                          "size (fake process group) and compare with the plan; repeatable")
    return ap


def _row(name: str, gib: float, formula: str) -> str:
    return f"  {name:<40} {gib:>8.2f}   {formula}"


def format_budget(b: Budget) -> list[str]:
    lines = [b.title + (f" [{b.note}]" if b.note else "")]
    lines.append(f"  {'component':<40} {'GiB':>8}   formula")
    lines += [_row(c.name, c.bytes / GiB, c.formula) for c in b.components]
    verdict = (f"free {-b.over / GiB:.2f} GiB" if b.fits() else f"OVER BY {b.over / GiB:.2f} GiB")
    lines.append(_row("total", b.total / GiB, f"of {b.capacity / GiB:.2f} GiB: {verdict}"))
    return lines


def format_plan(plan: Plan, config: str) -> str:
    r, hw, k, lay = plan.run, plan.hardware, plan.knobs, plan.layout
    sp = "on" if k.sequence_parallel and lay.tp > 1 else "off"
    kv = plan.kv
    lines = [
        f"pfppo plan: {config} on {hw.nodes} nodes x {hw.gpus_per_node} {hw.gpu} "
        f"({hw.gpu_memory / GiB:.2f} GiB per GPU, {hw.host_memory / GiB:.0f} GiB host per node)",
        f"model: actor {plan.actor_params_total / 1e9:.2f} B params, critic {plan.critic_params_total / 1e9:.2f} B, "
        f"reference {_reference(r)}; layout tp={lay.tp} pp={lay.pp} dp={lay.dp} "
        f"(world {lay.world_size}); rollout engine tp={plan.rollout_tp} ({kv.replicas} replicas), "
        f"{r.engine_dtype}, sleep level {r.sleep_level}",
        f"sequence {r.seq_len} tokens (prompt {r.max_prompt_length} + response {r.max_response_length}); "
        + (f"micro-batches of <= {r.max_tokens_per_micro_batch} tokens (use_dynamic_bsz; planned as {plan.micro_batch} "
         f"full-length row(s), at least {plan.num_microbatches} per mini-batch of {r.mini_batch})"
         if r.max_tokens_per_micro_batch is not None else
         f"micro-batch {plan.micro_batch}; {plan.num_microbatches} micro-batches per mini-batch of {r.mini_batch}")
        + f" per DP rank; pipeline bubble {plan.bubble:.1%}",
        f"activations: {k.recompute} recompute, sequence parallel {sp}, {k.layer} layer "
        f"(Korthikanti et al. 2022 accounting for a Llama layer; see pfppo_mega/planning/memory.py); "
        f"distributed optimizer {'on' if k.distributed_optimizer else 'off'}",
        "",
    ]
    lines += format_budget(plan.train)
    if lay.pp > 1:
        others = ", ".join(f"stage {st.pp_rank}: {st.train.total / GiB:.2f}" for st in plan.stages)
        lines.append(f"  (training phase per stage, GiB: {others}; the table shows the largest)")
    lines.append("")
    lines += format_budget(plan.rollout)
    lines.append(f"  KV cache: {kv.tokens:,} tokens per replica = {kv.sequences} sequences of {kv.seq_len}; "
                 f"rollout batch {r.rollout_samples} sequences = {kv.rollout_sequences_per_replica} per replica"
                 f" -> {kv.waves} wave(s)")
    lines.append("")
    lines += format_budget(plan.host)
    lines.append("")
    for note in plan.notes:
        lines.append(f"note: {note}")
    if plan.fits():
        lines.append("verdict: FITS")
    else:
        lines.append(f"verdict: REFUSED ({len(plan.problems)} problem(s))")
        lines += [f"  - {p}" for p in plan.problems]
    return "\n".join(lines)


def format_ledger(plan: Plan) -> str:
    """Per pipeline stage: one row per phase of the build and one step, device bytes by kind (GiB),
    the card's free bytes, this rank's host bytes."""
    cols = ("trainer", "engine", "refit", "transient", "reserve")
    lines = ["device-memory ledger, per GPU (GiB), in the order the trainer runs the phases "
             "(pfppo_mega/ledger.py; the training and rollout budgets above are its 'update' and "
             "'generate' rows)"]
    for h, recs in zip(plan.holdings, plan.ledger):
        trainer = {x.name for x in h.trainer}
        engine = {h.engine_weights.name, h.engine_kv.name}
        refit = {h.refit_slots.name, h.refit_gather.name}

        def kind(name: str) -> str:
            if name in trainer:
                return "trainer"
            if name in engine:
                return "engine"
            if name in refit:
                return "refit"
            return "reserve" if name == h.reserve.name else "transient"

        lines.append(f"ledger, pipeline stage {h.pp_rank} of {plan.layout.pp} "
                     f"(capacity {plan.hardware.gpu_memory / GiB:.2f} GiB)")
        lines.append(f"  {'phase':<22}" + "".join(f"{c:>10}" for c in cols) + f"{'device':>10}{'free':>10}{'host':>10}")
        for r in recs:
            by = dict.fromkeys(cols, 0.0)
            for x in r.device:
                by[kind(x.name)] += x.bytes
            lines.append(f"  {r.phase:<22}" + "".join(f"{by[c] / GiB:>10.2f}" for c in cols)
                         + f"{r.device_bytes / GiB:>10.2f}{-r.over / GiB:>10.2f}{r.host_bytes / GiB:>10.2f}"
                         + ("" if r.fits() else "  OVER"))
    return "\n".join(lines)


def _ranks(specs: list[str], world: int) -> list[int]:
    out = []
    for spec in specs:
        for part in spec.split(","):
            r = int(part)
            if not 0 <= r < world:
                raise ValueError(f"--dry-run-rank {r} must be in [0, {world})")
            out.append(r)
    return out


def checkpoint_architecture(cfg):
    """(Architecture, source line) of ``actor_rollout.model_path``'s config.json when it is on
    this machine; else (None, ...): plain Llama shaped by the config's model section (RoPE scaling
    adds no parameters; a Qwen3 head_dim or q/k norms would need the checkpoint)."""
    path = cfg.actor_rollout.model_path
    if path is None or not (Path(path) / "config.json").is_file():
        return None, f"family: llama (from the config's model section; {path!r} has no config.json here)"
    from pfppo_mega.families import architecture_from_hf
    from pfppo_mega.models.hf_io import read_hf_config

    arch = architecture_from_hf(read_hf_config(path))
    return arch, f"family: {arch.family} from {path}/config.json ({arch})"


def reward_model_shape(cfg):
    """(DecoderShape, source line) of ``reward.model_path``'s config.json when it is on this machine;
    (None, line) without a reward model, or with one whose config.json is elsewhere (then not counted)."""
    path = cfg.reward.model_path
    if path is None:
        return None, None
    shape = ledger_reward_model_shape(path)
    if shape is None:
        return None, f"reward model: {path!r} has no config.json here: its weights are NOT counted"
    return shape, (f"reward model: {shape.arch.family} from {path}/config.json, {total_param_count(shape, 'value'):,} "
                   f"params (bf16 weights on the actor's ranks)")


def main(argv: list[str]) -> int:
    ap = build_parser()
    try:
        args = ap.parse_intermixed_args(list(argv))
    except SystemExit as e:
        return 0 if e.code in (0, None) else 2
    from pfppo_mega.config import load_config_cli

    try:
        cfg = load_config_cli("pfppo plan", args.config, args.overrides)
    except SystemExit as e:  # every problem printed
        return int(e.code)
    moved = {"recompute": "training.recompute=none|selective|full",
             "no_sequence_parallel": "parallel.sequence_parallel=false",
             "layer": "model.layer_spec=auto|local|transformer_engine",
             "no_distributed_optimizer": "parallel.use_distributed_optimizer=false"}
    used = [f"--{k.replace('_', '-')}: use the override {v}" for k, v in moved.items()
            if getattr(args, "moved_" + k) is not None]
    if used:
        print("pfppo plan: these flags are config keys now (the trainer and the Slurm script read the same "
              "values):\n" + "\n".join(f"  - {u}" for u in used), file=sys.stderr)
        return 2
    knobs = Knobs.from_config(cfg, micro_batch=args.micro_batch, offload_during_rollout=args.offload_during_rollout,
                              rollout_tp=args.rollout_tp, reserve_gib=args.reserve_gib,
                              rollout_workspace_gib=args.rollout_workspace_gib,
                              host_reserve_gib=args.host_reserve_gib, pool_placement=args.pool_placement)
    try:
        hw = Hardware.preset(args.gpu, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                             gpu_memory_gib=args.gpu_memory_gib, host_memory_gib=args.host_memory_gib)
        arch, arch_line = checkpoint_architecture(cfg)
        rm_shape, rm_line = reward_model_shape(cfg)
        plan = make_plan(RunShape.from_config(cfg, arch, rm_shape), hw, knobs)
        ranks = _ranks(args.dry_run_rank, hw.world_size)
    except ValueError as e:
        print(f"pfppo plan: {args.config}: {e}", file=sys.stderr)
        return 2

    if args.rollout_tp is not None and args.rollout_tp != cfg.actor_rollout.tensor_model_parallel_size:
        note = (f"--rollout-tp {args.rollout_tp} overrides the config's actor_rollout.tensor_model_parallel_size "
                f"({cfg.actor_rollout.tensor_model_parallel_size}), which the trainer's engine uses: this plan is not "
                f"the run's unless you pass actor_rollout.tensor_model_parallel_size={args.rollout_tp}")
        plan.notes.insert(0, note)
        print(f"pfppo plan: note: {note}", file=sys.stderr)
    print(format_plan(plan, args.config))
    if args.ledger:
        print()
        print(format_ledger(plan))
    print(arch_line)
    if rm_line:
        print(rm_line)
    report = plan.to_json()
    status = 0 if plan.fits() else 2
    if ranks:
        from pfppo_mega.models.gpt import features_from_config
        from pfppo_mega.planning.dryrun import dry_run_rank

        print("\ndry run (fake process group, meta-device megatron models):")
        report["dry_run"] = []
        for r in ranks:
            res = dry_run_rank(cfg.model, tp=plan.layout.tp, pp=plan.layout.pp, world_size=hw.world_size, rank=r,
                               arch=arch, features=features_from_config(cfg))
            c = res.coords
            verdict = "OK" if res.ok else "MISMATCH"
            print(f"  rank {r:>3}/{res.world_size}: tp {c['tp_rank']} dp {c['dp_rank']} pp {c['pp_rank']}; "
                  f"tensor {_span(res.groups['tensor'])} data {_span(res.groups['data'])} "
                  f"pipeline {_span(res.groups['pipeline'])}; params actor {res.actor_params:,} "
                  f"(planner {res.planner_actor_params:,}) critic {res.critic_params:,} "
                  f"(planner {res.planner_critic_params:,}); {res.seconds:.2f}s {verdict}")
            for m in res.mismatches[:20]:
                print(f"    - {m}")
            report["dry_run"].append({"rank": r, "ok": res.ok, "coords": c, "groups": res.groups,
                                      "actor_params": res.actor_params, "critic_params": res.critic_params,
                                      "planner_actor_params": res.planner_actor_params,
                                      "planner_critic_params": res.planner_critic_params,
                                      "mismatches": res.mismatches, "seconds": res.seconds})
            if not res.ok:
                status = 1
    if args.json_path:
        path = Path(args.json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report | {"config": args.config}, indent=2) + "\n")
    return status


def _span(ranks: list[int]) -> str:
    """[0, 8, 16] -> "0,8,16"; long lists abbreviated as first..last step k."""
    if len(ranks) > 4:
        step = ranks[1] - ranks[0]
        if all(b - a == step for a, b in zip(ranks, ranks[1:])):
            return f"{ranks[0]}..{ranks[-1]}" + (f"/{step}" if step != 1 else "")
    return ",".join(map(str, ranks))


def _reference(run) -> str:
    """How the plan holds the reference policy."""
    if run.lora_rank:
        return f"the actor's frozen base (LoRA rank {run.lora_rank}: adapters off, no copy)"
    return "yes" if run.reference else "no (kl_coeff = 0)"
