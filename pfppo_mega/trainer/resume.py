"""A run's checkpoints: what a step saves and how a run resumes from one (the file format, its
atomic writes and verification are trainer/checkpoint.py's).

Layout: one checkpoint series per model-parallel rank (its TP/PP shards), written by dp_rank 0;
under PF-PPO each dp_rank > 0 also keeps its own shards of the node-sharded pool in a series of
its own. Every rank resumes from the newest step that verifies on all ranks; a checkpoint that
cannot be trusted or contradicts this run is refused on every rank (CheckpointError), never
silently replaced by a fresh start.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from pfppo_mega import parallel
from pfppo_mega.config import config_to_dict
from pfppo_mega.models import gpt
from pfppo_mega.trainer import checkpoint as ckpt
from pfppo_mega.trainer.build import Run
from pfppo_mega.trainer.seeds import stream_seed

STATE_KEYS = frozenset({"step", "rng", "torch_rng", "assign_rng", "running_reward", "guards", "data",
                        "consecutive_skips", "actor_opt", "critic_opt", "config", "pool"})


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


def series_dir(run: Run, root: Path) -> Path:
    """One checkpoint series per model-parallel rank (its TP/PP shards); dp_rank 0 writes it."""
    p = run.parallel
    return root if p.tp * p.pp == 1 else root / f"mp-tp{p.tp_rank}-pp{p.pp_rank}"


def pool_shard_dir(run: Run, series: Path) -> Path:
    """Where dp_rank > 0 keeps its own shards of the sharded PF-PPO pool (dp_rank 0's are in the
    checkpoint itself): a checkpoint series of its own inside the model-parallel rank's dir."""
    return series / f"pool-dp{run.parallel.dp_rank}"


_SERIES = re.compile(r"mp-tp(\d+)-pp(\d+)")


def other_layout(run: Run, root: Path) -> str | None:
    """The tensor/pipeline layout other checkpoint series under ``root`` were written at, when it is
    not this run's ("tp=A pp=B"), else None."""
    if not root.is_dir():
        return None
    ranks = [tuple(map(int, m.groups())) for d in root.iterdir() if (m := _SERIES.fullmatch(d.name))]
    layouts = set()
    if ranks:
        layouts.add((max(r[0] for r in ranks) + 1, max(r[1] for r in ranks) + 1))
    if ckpt.step_dirs(root):
        layouts.add((1, 1))
    mine = (run.parallel.tp, run.parallel.pp)
    others = sorted(layouts - {mine})
    return None if not others else " and ".join(f"tp={tp} pp={pp}" for tp, pp in others)


# ============================================================================ save


def save(run: Run, root: Path) -> Path | None:
    """Checkpoint this step (once: a second call at the same step writes nothing)."""
    st, b = run.state, run.behaviour
    if st.saved_step == st.step:
        return None
    st.saved_step = st.step
    keep = run.cfg.checkpoint.keep_last
    # the distributed optimizer's state is gathered to dp_rank 0: every DP rank takes part
    opt_states = {name: ckpt.optimizer_state(opt) for name, opt in run.optimizers().items()}
    if run.parallel.dp_rank != 0:
        if b.keeps_state:  # the node's pool is split across its ranks: each saves its own shards
            ckpt.save_checkpoint(pool_shard_dir(run, series_dir(run, root)), st.step, {"pool": b.state_tensors()},
                                 {"step": st.step, "pool": b.state_meta()}, keep_last=keep)
        return None
    state = {"step": st.step, "rng": run.rng.getstate(), "torch_rng": torch.get_rng_state(),
             "assign_rng": run.assign_gen.get_state(), "running_reward": st.running_reward.state_dict(),
             "guards": dict(st.guards), "consecutive_skips": dict(st.consecutive_skips),
             "data": run.prompts.state_dict(), "critic_opt": None, **opt_states,
             "config": config_to_dict(run.cfg), "pool": b.state_meta() if b.keeps_state else None}
    tensors = {name: tensor_state(m) for name, m in run.models().items()}
    if b.keeps_state:
        tensors["pool"] = b.state_tensors()
    return ckpt.save_checkpoint(series_dir(run, root), st.step, tensors, state, keep_last=keep)


# ============================================================================ resume

# What a resumed run depends on: a change would train another run under this one's name (the
# reference is rebuilt from model_path, the saved data position indexes another permutation).
FIXED = ("training.seed", "actor_rollout.model_path", "data.source", "data.task", "data.train_files",
         "data.num_digits", "algorithm.adv_estimator", "actor_rollout.n_samples_per_prompt")
# The optimizer's hyper-parameters: the checkpoint's param groups would silently win; a change is applied.
HYPER = ("training.lr", "training.critic_lr", "training.weight_decay")


def _get(d: dict, key: str):
    for part in key.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d


def check_edits(saved, current: dict, need) -> list[tuple[str, object, object]]:
    """Refuse a resume whose FIXED settings differ from the checkpoint's (naming the key and both
    values); return the HYPER settings that changed, to apply."""
    need(isinstance(saved, dict), "state config must be the config the checkpoint was written with (an object)")
    for key in FIXED:
        old, new = _get(saved, key), _get(current, key)
        need(old == new, f"{key} changed since this checkpoint was written ({old!r} -> {new!r}): the run would "
                         f"continue as another one; resume with the value it was written with, or start a new "
                         f"logging.output_dir (or checkpoint.resume=false)")
    return [(key, _get(saved, key), _get(current, key)) for key in HYPER if _get(saved, key) != _get(current, key)]


def _apply_hyper(opts: dict, key: str, value: float) -> None:
    names = {"training.lr": ("actor_opt",), "training.critic_lr": ("critic_opt",),
             "training.weight_decay": ("actor_opt", "critic_opt")}[key]
    field, mult = ("weight_decay", "wd_mult") if key.endswith("weight_decay") else ("lr", "lr_mult")
    for name in names:
        if name in opts:
            for group in opts[name].param_groups:
                group[field] = value * group.get(mult, 1.0)


def resume(run: Run) -> None:
    """Every rank resumes from the newest step that verifies on all model-parallel ranks (see the
    module docstring). No checkpoint, or checkpoint.resume: false: the run starts at step 0."""
    if not run.cfg.checkpoint.resume:
        return
    root = series_dir(run, run.out_dir / "checkpoints")
    refused: list[str] = []

    def note(msg: str) -> None:
        refused.append(msg)
        run.log(msg)

    other = other_layout(run, run.out_dir / "checkpoints")
    if other is not None and not ckpt.step_dirs(root):
        raise ckpt.CheckpointError(
            f"checkpoint.resume: the checkpoints under {run.out_dir / 'checkpoints'} were written at {other}, this run "
            f"has tp={run.parallel.tp} pp={run.parallel.pp}: a training checkpoint is not resharded to another "
            f"tensor/pipeline layout yet; resume with the layout it was written at, or use another "
            f"logging.output_dir, or checkpoint.resume=false (the HF export of a run loads at any layout)")
    step = ckpt.latest_valid_step(root, log=note)
    if step is not None and run.behaviour.keeps_state and run.parallel.dp_rank != 0:  # and its pool shards
        shards = pool_shard_dir(run, root)
        shard_step = ckpt.latest_valid_step(shards, log=note)
        if shard_step is None:
            refused.append(f"dp_rank {run.parallel.dp_rank} finds no PF-PPO pool shards under {shards}")
        step = None if shard_step is None else min(step, shard_step)
    if step is None and ckpt.step_dirs(root):
        step = -2  # there are checkpoints, none can be trusted
    step = parallel.world_min(-1 if step is None else step)
    if step == -2:
        raise ckpt.CheckpointError(
            f"checkpoint.resume: no checkpoint under {root} can be used ({'; '.join(refused) or 'another rank'}); "
            f"repair or move them, or set checkpoint.resume=false")
    if step < 0:
        return
    error, pending = None, []
    try:
        pending = _install(run, ckpt.load_step(root, step))
    except ckpt.CheckpointError as e:
        error = e
    if parallel.world_min(-1 if error is not None else 0) < 0:
        raise error or ckpt.CheckpointError(f"checkpoint step {step}: refused on another rank (see its log)")
    ckpt.scatter_parameter_state(pending)  # collective: only once every rank accepted the checkpoint
    run.state.saved_step = run.state.step
    run.log(f"[pfppo] resumed from {root / f'step_{step:06d}'} (step {run.state.step})")


def _install(run: Run, found: ckpt.Checkpoint) -> list:
    """Check a loaded checkpoint against this run, then install it (no collectives).
    CheckpointError names the file, the value and the rule it breaks. Returns the distributed
    optimizer's parameter state, for ckpt.scatter_parameter_state once every rank accepted."""
    where, s, t, st = found.path, found.state, run.cfg.training, run.state

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ckpt.CheckpointError(f"{where}: {what}")

    need(set(s) == STATE_KEYS, f"state keys {sorted(s)} must be {sorted(STATE_KEYS)}")
    need(type(s["step"]) is int and s["step"] == found.step,
         f"state step = {s['step']!r} must equal the checkpoint's step {found.step}")
    need(found.step <= t.total_training_steps,
         f"step {found.step} > training.total_training_steps ({t.total_training_steps}): this checkpoint is "
         f"from a longer run; raise total_training_steps, or use another logging.output_dir or "
         f"checkpoint.resume=false")
    has_pool, keeps = s["pool"] is not None, run.behaviour.keeps_state
    need(has_pool == keeps,
         f"the checkpoint {'holds' if has_pool else 'has no'} PF-PPO pool but this run has "
         f"algorithm.use_pf_ppo={keeps}: resume with the setting it was written with")
    models, opts = run.models(), run.optimizers()
    groups = set(models) | ({"pool"} if has_pool else set())
    wants, holds = "critic" in models, "critic" in found.tensors
    hint = "" if wants == holds else (
        f" (algorithm.adv_estimator = {run.cfg.algorithm.adv_estimator!r} {'needs a' if wants else 'needs no'} "
        f"critic; this checkpoint {'has none' if wants else 'has one'}: resume with the estimator it was written with)")
    need(set(found.tensors) == groups, f"tensor files {sorted(found.tensors)} must be {sorted(groups)}{hint}")
    for group, model in models.items():
        bad = [k for k, v in found.tensors[group].items() if v.is_floating_point() and not bool(v.isfinite().all())]
        need(not bad, f"{group}.safetensors: tensors {bad[:3]} hold NaN/inf")
        try:
            load_tensor_state(model, found.tensors[group])
        except ValueError as e:
            need(False, f"{group}.safetensors does not fit the configured model: {e}")
    need(("critic_opt" in opts) == (s["critic_opt"] is not None),
         f"state critic_opt is {'absent' if s['critic_opt'] is None else 'present'} but this run "
         f"{'builds' if 'critic_opt' in opts else 'has no'} a critic")
    for name, opt in opts.items():
        ckpt.check_optimizer_state(opt, s[name], f"{where}: state {name}")
    edits = check_edits(s["config"], config_to_dict(run.cfg), need)  # before anything is installed
    pending = [p for name, opt in opts.items() for p in ckpt.load_optimizer_state(opt, s[name])]
    for key, old, new in edits:  # the optimizer's saved hyper-parameters would win: the new value, on purpose
        _apply_hyper(opts, key, new)
        run.log(f"[pfppo] resume: {key} changed since the checkpoint ({old!r} -> {new!r}); the new value is "
                f"applied to the optimizer")
    need(isinstance(s["guards"], dict) and set(s["guards"]) <= set(st.guards)
         and all(type(v) is int and v >= 0 for v in s["guards"].values()),
         f"guards = {str(s['guards'])[:200]}: keys must be among {sorted(st.guards)}, values ints >= 0")
    need(isinstance(s["consecutive_skips"], dict) and set(s["consecutive_skips"]) == set(st.consecutive_skips)
         and all(type(v) is int and v >= 0 for v in s["consecutive_skips"].values()),
         f"consecutive_skips = {str(s['consecutive_skips'])[:200]}: keys must be {sorted(st.consecutive_skips)}, "
         f"values ints >= 0")
    try:
        if run.parallel.dp == 1:
            run.rng.setstate(s["rng"])
        else:  # only dp_rank 0's stream is saved: the others restart theirs deterministically
            run.rng.seed(stream_seed("prompts", t.seed, dp_rank=run.parallel.dp_rank, step=s["step"]))
        for name in ("torch_rng", "assign_rng"):
            need(isinstance(s[name], torch.Tensor) and s[name].dtype == torch.uint8 and s[name].dim() == 1,
                 f"state {name} must be a 1-D uint8 tensor")
        torch.set_rng_state(s["torch_rng"])
        run.assign_gen.set_state(s["assign_rng"])
        st.running_reward.load_state_dict(s["running_reward"])
    except (TypeError, ValueError, RuntimeError, AttributeError) as e:
        need(False, f"RNG or running-reward state refused ({type(e).__name__}: {str(e)[:200]})")
    try:  # the data position (prompt files: epoch and offset; the built-in task: in `rng`)
        run.prompts.load_state_dict(s["data"])
    except (ValueError, KeyError, TypeError) as e:
        need(False, f"state data (the data position) refused: {e}")
    if has_pool:
        meta, tensors = s["pool"], found.tensors["pool"]
        if run.parallel.dp_rank != 0:  # this rank's own shards of the pool (save())
            shards = ckpt.load_step(pool_shard_dir(run, found.path.parent), found.step)
            need(set(shards.state) == {"step", "pool"} and shards.state["step"] == found.step
                 and set(shards.tensors) == {"pool"},
                 f"pool shards {shards.path}: state keys {sorted(shards.state)} must be ['pool', 'step'] of "
                 f"step {found.step}, tensor files {sorted(shards.tensors)} must be ['pool']")
            meta, tensors = shards.state["pool"], shards.tensors["pool"]
        run.behaviour.load_state(meta, tensors, found.step, need)
    st.guards.update(s["guards"])
    st.consecutive_skips.update(s["consecutive_skips"])
    st.step = s["step"]
    return pending
