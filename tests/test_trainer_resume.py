"""Resume through the trainer: bit-identical to an uninterrupted run (plain PPO and PF-PPO, whose
pool travels in the checkpoint), one save per step, metrics.jsonl without repeated steps, and
checkpoints whose state contradicts the run refused with a named error.

One tiny SFT checkpoint (few steps: these tests need a policy, not a good one) shared by the module.
"""

import json
from pathlib import Path

import pytest
import torch

from pfppo_mega.config import load_config_dict
from pfppo_mega.sft import run_sft
from pfppo_mega.trainer.checkpoint import store as ckpt
from pfppo_mega.trainer.checkpoint import resume
from pfppo_mega.trainer.loop import PPOTrainer
from test_trainer import TINY, _cfg

# timings, and the bytes an engine switch moves: a resumed engine holds none of the restored
# snapshots, so its first switch to each reloads it (engine state is not checkpoint state)
_TIMING = ("time/", "perf/", "pool/switch_s", "work/switch_bytes_received")
_PF = {"use_pf_ppo": True, "pool": {"pool_size": 2, "snapshot_interval": 1, "sampling": "reward"}}
_LOG = {"eval_interval": 2, "log_interval": 1, "tensorboard": False, "plots": False, "progress": False}


def quiet(*_):
    pass


@pytest.fixture(scope="module")
def sft_small(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft_small")
    d = json.loads(json.dumps(TINY))
    d["sft"].update(output_dir=str(out), steps=20, max_seconds=0)
    d["actor_rollout"] = {"model_path": str(out)}
    run_sft(load_config_dict(d), log=quiet)
    return out


def records_and_weights(tr, res):
    recs = [json.loads(line) for line in open(res.metrics_path)]
    weights = {f"{name}.{k}": v.clone() for name, model in (("actor", tr.run.models.actor), ("critic", tr.run.models.critic))
               for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    return recs, weights


def resume_comparison(straight, halves):
    """(step, key, a, b) for every metric value (timings aside) that differs between two runs,
    the number of values compared, and the largest weight difference. Each run: (records, weights)."""
    (ra, wa), (rb, wb) = straight, halves
    assert [r["step"] for r in ra] == [r["step"] for r in rb], ([r["step"] for r in ra], [r["step"] for r in rb])
    assert wa.keys() == wb.keys()
    differ = []
    for a, b in zip(ra, rb):
        keys = {k for k in a.keys() | b.keys() if not k.startswith(_TIMING)}
        differ += [(a["step"], k, a.get(k), b.get(k)) for k in sorted(keys) if a.get(k) != b.get(k)]
    n_values = sum(len([k for k in a if not k.startswith(_TIMING)]) for a in ra)
    max_diff = max((wa[k].double() - wb[k].double()).abs().max().item() for k in wa)
    return differ, n_values, max_diff


def straight_and_resumed(sft, tmp: Path, algorithm: dict):
    """4 steps in one trainer vs 2 steps, a new trainer resuming from the step-2 checkpoint, 2 more."""
    common = dict(algorithm=algorithm, logging=_LOG, checkpoint={"save_interval": 0})
    tr = PPOTrainer(_cfg(tmp / "a", sft, training={"total_training_steps": 4}, **common), log=quiet)
    straight = records_and_weights(tr, tr.fit())
    PPOTrainer(_cfg(tmp / "b", sft, training={"total_training_steps": 2}, **common), log=quiet).fit()
    tr = PPOTrainer(_cfg(tmp / "b", sft, training={"total_training_steps": 4}, **common), log=quiet)
    assert tr.step == 2
    return tr, straight, records_and_weights(tr, tr.fit())


@pytest.mark.parametrize("pf_ppo", [False, True], ids=["ppo", "pf_ppo"])
def test_resume_is_bit_identical_to_an_uninterrupted_run(sft_small, tmp_path, pf_ppo):
    """Every metric but timings and every actor/critic weight equal; under PF-PPO the pool
    (versions, stats, snapshots, checksums) and the assignment RNG come back from the checkpoint."""
    tr, straight, halves = straight_and_resumed(sft_small, tmp_path, _PF if pf_ppo else {})
    if pf_ppo:
        assert tr.run.strategies.behaviour.pool.versions == [3, 4]
    differ, n, max_diff = resume_comparison(straight, halves)
    print(f"resume vs straight ({'PF-PPO' if pf_ppo else 'PPO'}): {len(differ)} of {n} metric values differ, "
          f"max weight diff {max_diff:.3g}")
    assert not differ, differ[:10]
    assert max_diff == 0.0


def test_pool_is_rebuilt_exactly_from_the_checkpoint(sft_small, tmp_path):
    cfg = _cfg(tmp_path, sft_small, algorithm=_PF, logging=_LOG,
               training={"total_training_steps": 3}, checkpoint={"save_interval": 0})
    tr = PPOTrainer(cfg, log=quiet)
    tr.fit()
    again = PPOTrainer(cfg, log=quiet)
    assert again.step == 3
    assert again.run.strategies.behaviour.pool.state_meta() == tr.run.strategies.behaviour.pool.state_meta()
    a, b = tr.run.strategies.behaviour.pool.state_tensors(), again.run.strategies.behaviour.pool.state_tensors()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(again.run.state.assign_gen.get_state(), tr.run.state.assign_gen.get_state())


def test_stop_request_on_a_save_step_saves_once(sft_small, tmp_path, monkeypatch):
    """save_interval and a stop request on the same step: one save (it used to write the step
    twice, deleting the directory `latest` named before the second copy was in place)."""
    stop = tmp_path / "stop"
    stop.touch()
    monkeypatch.setenv("PFPPO_STOP_FILE", str(stop))
    saves = []
    real = ckpt.commit_sharded
    monkeypatch.setattr(ckpt, "commit_sharded", lambda root, step, *a, **k: (saves.append(step), real(root, step, *a, **k))[1])
    res = PPOTrainer(_cfg(tmp_path, sft_small, logging=_LOG, training={"total_training_steps": 3},
                          checkpoint={"save_interval": 1}), log=quiet).fit()
    assert res.steps == 1 and saves == [1]
    assert resume.load_part(tmp_path / "checkpoints").step == 1


def test_metrics_do_not_repeat_steps_after_a_fallback(sft_small, tmp_path):
    """A run logs steps 1..3 but its step-3 checkpoint is corrupt: the resumed run falls back to
    step 2, and metrics.jsonl then holds each step once (steps after 2 are rewritten)."""
    common = dict(logging=_LOG, checkpoint={"save_interval": 1, "keep_last": 3})
    PPOTrainer(_cfg(tmp_path, sft_small, training={"total_training_steps": 3}, **common), log=quiet).fit()
    f = tmp_path / "checkpoints" / "step_000003" / PART / "actor.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    with open(tmp_path / "metrics.jsonl", "a") as out:
        out.write('{"step": 4, "reward/mean": 0.')  # a torn line from a killed writer
    msgs = []
    tr = PPOTrainer(_cfg(tmp_path, sft_small, training={"total_training_steps": 4}, **common), log=msgs.append)
    assert tr.step == 2 and any("sha256 mismatch" in m for m in msgs), msgs
    res = tr.fit()
    steps = [json.loads(line)["step"] for line in open(res.metrics_path)]
    assert steps == [0, 1, 2, 3, 4], steps
    assert resume.load_part(tmp_path / "checkpoints").step == 4


PART = "tp0-pp0-dp0"  # the one part of a single-process run's checkpoint


def resign(part: Path, *names: str) -> None:
    """Re-sign files `names` of a checkpoint part in its manifest, and the part in the step's global
    manifest (as an attacker or a stale tool would): the checkpoint then verifies."""
    manifest = json.loads((part / ckpt.MANIFEST).read_text())
    for name in names:
        manifest["files"][name] = {"sha256": ckpt._sha256(part / name), "bytes": (part / name).stat().st_size}
    (part / ckpt.MANIFEST).write_text(json.dumps(manifest))
    top = json.loads((part.parent / ckpt.MANIFEST).read_text())
    top["parts"][part.name] = ckpt.part_digest(part)
    (part.parent / ckpt.MANIFEST).write_text(json.dumps(top))


def _tamper_state(root: Path, step: int, edit) -> None:
    """Rewrite state.json of a checkpoint through `edit` and re-sign it: the checkpoint verifies,
    so the trainer's own checks must refuse it."""
    path = root / f"step_{step:06d}" / PART
    state = json.loads((path / ckpt.STATE_JSON).read_text())
    edit(state)
    (path / ckpt.STATE_JSON).write_text(json.dumps(state))
    resign(path, ckpt.STATE_JSON)


@pytest.mark.parametrize("case,edit,match", [
    ("step_1000", lambda s: s.update(step=1000), r"state step = 1000 must equal the checkpoint's step 2"),
    ("step_str", lambda s: s.update(step="2"), r"state step = '2' must equal"),
    ("guards", lambda s: s.update(guards={"made_up": 1}), r"guards = .*made_up.*keys must be among"),
    ("rng", lambda s: s.update(rng=[1, 2]), r"RNG or running-reward state refused"),
    ("moments", lambda s: s.update(running_reward={"count": -1.0, "mean": 0.0, "m2": 0.0}),
     r"RNG or running-reward state refused"),
    ("missing_key", lambda s: s.pop("guards"), r"state keys .* must be"),
    ("opt_groups", lambda s: s["actor_opt"]["param_groups"].pop(), r"actor_opt: 1 param groups"),
    ("opt_lr", lambda s: s["actor_opt"]["param_groups"][0].update(lr=float("inf")), r"lr = inf must be finite"),
])
def test_contradicting_state_is_refused(sft_small, tmp_path, case, edit, match):
    cfg = _cfg(tmp_path, sft_small, logging=_LOG, training={"total_training_steps": 2},
               checkpoint={"save_interval": 0})
    PPOTrainer(cfg, log=quiet).fit()
    _tamper_state(tmp_path / "checkpoints", 2, edit)
    with pytest.raises(ckpt.CheckpointError, match=match):
        PPOTrainer(cfg, log=quiet)


def test_resume_keeps_this_builds_adamw_kernel(sft_small, tmp_path):
    """A checkpoint whose param groups say fused = False (written before gpt.build_optimizer chose torch's
    fused AdamW) resumes on the fused kernel: the implementation is the run's, the hyper-parameters the
    checkpoint's."""
    cfg = _cfg(tmp_path, sft_small, logging=_LOG, training={"total_training_steps": 2},
               checkpoint={"save_interval": 0})
    PPOTrainer(cfg, log=quiet).fit()

    def old_style(state):
        for name in ("actor_opt", "critic_opt"):
            for g in state[name]["param_groups"]:
                g.update(fused=False, foreach=None, lr=1.5e-3)

    _tamper_state(tmp_path / "checkpoints", 2, old_style)
    cfg = _cfg(tmp_path, sft_small, logging=_LOG, training={"total_training_steps": 3},
               checkpoint={"save_interval": 0})
    tr = PPOTrainer(cfg, log=quiet)
    assert tr.step == 2
    groups = [g for opt in tr.run.models.optimizers().values() for o in getattr(opt, "chained_optimizers", [opt])
              for g in o.optimizer.param_groups]
    assert groups and all(g["fused"] is True and g["foreach"] is False for g in groups)
    assert all(g["lr"] == 1.5e-3 for g in groups)  # the checkpoint's hyper-parameters still load
    tr.fit()


def test_checkpoint_that_does_not_fit_the_run_is_refused(sft_small, tmp_path):
    """A step beyond total_training_steps (a 4-step run given a step-6 checkpoint), a PF-PPO
    checkpoint resumed without the pool and vice versa, and a pool of another size: each names
    the value and the rule; so does a run directory whose checkpoints all fail verification."""
    six = _cfg(tmp_path, sft_small, logging=_LOG, training={"total_training_steps": 6}, algorithm=_PF,
               checkpoint={"save_interval": 0})
    PPOTrainer(six, log=quiet).fit()
    with pytest.raises(ckpt.CheckpointError, match=r"step 6 > training.total_training_steps \(4\)"):
        PPOTrainer(_cfg(tmp_path, sft_small, logging=_LOG, training={"total_training_steps": 4}, algorithm=_PF),
                   log=quiet)
    with pytest.raises(ckpt.CheckpointError, match=r"holds PF-PPO pool but this run has algorithm.use_pf_ppo=False"):
        PPOTrainer(_cfg(tmp_path, sft_small, logging=_LOG, training={"total_training_steps": 8}), log=quiet)
    with pytest.raises(ckpt.CheckpointError, match=r"pool_size = 2 must equal algorithm.pool.pool_size \(3\)"):
        PPOTrainer(_cfg(tmp_path, sft_small, logging=_LOG, training={"total_training_steps": 8},
                        algorithm={**_PF, "pool": {**_PF["pool"], "pool_size": 3}}), log=quiet)
    (tmp_path / "checkpoints" / "step_000006" / "stray.bin").write_bytes(b"x")
    with pytest.raises(ckpt.CheckpointError, match=r"no checkpoint under .* can be used .*stray.bin.* is not listed"):
        PPOTrainer(six, log=quiet)


def _tamper_tensors(path: Path, group: str, edit) -> None:
    """Rewrite <group>.safetensors through `edit` and re-sign it in the manifest."""
    from safetensors.torch import load_file, save_file

    path = path / PART
    f = path / f"{group}.safetensors"
    sd = load_file(str(f))
    edit(sd)
    save_file(sd, str(f))
    resign(path, f.name)


def _first(sd: dict) -> str:
    return sorted(k for k in sd if sd[k].dim() == 2)[0]


@pytest.mark.parametrize("group,edit,match", [
    ("actor", lambda sd: sd.update({_first(sd): torch.zeros(3, 3)}), r"actor.safetensors does not fit the "
                                                                      r"configured model: checkpoint tensor .* shape \(3, 3\)"),
    ("critic", lambda sd: sd.update({_first(sd): torch.full_like(sd[_first(sd)], float("nan"))}),
     r"critic.safetensors: tensors .* hold NaN/inf"),
    ("state", lambda sd: sd.update({k: torch.zeros(2, 2) for k in sd if k.endswith("/exp_avg")}),
     r"state actor_opt: state\[0\]\[exp_avg\] has shape \(2, 2\), parameter 0 has"),
])
def test_tensors_that_do_not_fit_the_model_are_refused(sft_small, tmp_path, group, edit, match):
    cfg = _cfg(tmp_path, sft_small, logging=_LOG, training={"total_training_steps": 2},
               checkpoint={"save_interval": 0})
    PPOTrainer(cfg, log=quiet).fit()
    _tamper_tensors(tmp_path / "checkpoints" / "step_000002", group, edit)
    with pytest.raises(ckpt.CheckpointError, match=match):
        PPOTrainer(cfg, log=quiet)
