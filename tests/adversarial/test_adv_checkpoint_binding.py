"""The parts of a checkpoint step are one save (issue 40): each part's manifest names the run that
wrote it (run_id, made at the run's first save and kept across resumes) and the step; the global
manifest names them too. A part copied in from another run or another step -- even one whose
files verify against its own manifest, with the global manifest re-signed -- is refused by name
before anything is loaded, never mixed in and never skipped over silently. The 2-rank case (the
rank that reads the copied part is not rank 0, and both must refuse) is in
tests/multirank/trainer_layouts.py (RESULT tp2_foreign, tests/test_trainer_parallel.py)."""

import json
import shutil
import sys
from pathlib import Path

import pytest

from pfppo_mega.trainer.checkpoint import store as ckpt
from pfppo_mega.trainer.checkpoint import resume
from pfppo_mega.trainer.loop import PPOTrainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_trainer import _cfg  # noqa: E402
from test_trainer_resume import _LOG, PART, quiet, sft_small  # noqa: E402,F401  (the tiny SFT fixture)


def _run(sft: Path, out: Path, steps: int, **training):
    return PPOTrainer(_cfg(out, sft, logging=_LOG, training={"total_training_steps": steps, **training},
                           checkpoint={"save_interval": 1, "keep_last": 3}), log=quiet)


@pytest.fixture(scope="module")
def runs(sft_small, tmp_path_factory):
    """Two runs of 2 steps, checkpoints at steps 1 and 2: A, and B with another seed."""
    root = tmp_path_factory.mktemp("binding")
    for name, seed in (("a", 3), ("b", 4)):
        _run(sft_small, root / name, 2, seed=seed).fit()
    return root


def _manifest(path: Path) -> dict:
    return json.loads((path / ckpt.MANIFEST).read_text())


def _step(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"step_{step:06d}"


def _put_part(src: Path, dst_step: Path) -> None:
    """Replace dst_step's part with the directory `src` and re-sign the global manifest's entry (the
    part verifies against its own manifest, and the step against its global manifest)."""
    shutil.rmtree(dst_step / PART)
    shutil.copytree(src, dst_step / PART)
    top = _manifest(dst_step)
    top["parts"][PART] = ckpt.part_digest(dst_step / PART)
    (dst_step / ckpt.MANIFEST).write_text(json.dumps(top))


def test_every_part_and_step_of_a_run_carry_its_identity(runs, sft_small, tmp_path):
    """A's steps 1 and 2 name one run in every manifest; B is another run; a resume keeps A's."""
    ids = {(_manifest(_step(runs / "a", s)).get("run_id"), _manifest(_step(runs / "a", s) / PART).get("run_id"))
           for s in (1, 2)}
    assert len(ids) == 1
    (a_id, part_id), = ids
    assert a_id == part_id and len(a_id) == 32
    assert _manifest(_step(runs / "b", 2))["run_id"] != a_id
    out = tmp_path / "a"
    shutil.copytree(runs / "a", out)
    tr = _run(sft_small, out, 3, seed=3)
    assert tr.step == 2 and tr.run.state.run_id == a_id
    tr.fit()
    assert _manifest(_step(out, 3))["run_id"] == a_id == _manifest(_step(out, 3) / PART)["run_id"]


@pytest.mark.parametrize("case", ["another_run", "another_step", "another_run_not_resigned"])
def test_a_part_of_another_run_or_step_is_refused_by_name(runs, sft_small, tmp_path, case):
    out = tmp_path / "a"
    shutil.copytree(runs / "a", out)
    a_id = _manifest(_step(out, 2))["run_id"]
    if case == "another_step":
        _put_part(_step(runs / "a", 1) / PART, _step(out, 2))
        found = rf"run {a_id} at step 1"
    else:
        b_id = _manifest(_step(runs / "b", 2))["run_id"]
        if case == "another_run":
            _put_part(_step(runs / "b", 2) / PART, _step(out, 2))
        else:  # copied over as `cp -r` does, the global manifest left alone
            shutil.rmtree(_step(out, 2) / PART)
            shutil.copytree(_step(runs / "b", 2) / PART, _step(out, 2) / PART)
        found = rf"run {b_id} at step 2"
    with pytest.raises(ckpt.PartBindingError, match=rf"step_000002/{PART}: this part was written by {found}, but "
                                                    rf"step_000002's global manifest belongs to run {a_id} at step 2: "
                                                    rf"a part copied from another run or another step"):
        _run(sft_small, out, 3, seed=3)


def test_a_checkpoint_written_before_run_identities_still_resumes(runs, sft_small, tmp_path):
    """No run_id in any manifest (an older checkpoint): resumes, and its next save makes one."""
    out = tmp_path / "a"
    shutil.copytree(runs / "a", out)
    step = _step(out, 2)
    part = _manifest(step / PART)
    part.pop("run_id")
    (step / PART / ckpt.MANIFEST).write_text(json.dumps(part))
    top = _manifest(step)
    top.pop("run_id")
    top["parts"][PART] = ckpt.part_digest(step / PART)
    (step / ckpt.MANIFEST).write_text(json.dumps(top))
    tr = _run(sft_small, out, 3, seed=3)
    assert tr.step == 2 and tr.run.state.run_id == ""
    tr.fit()
    new = _manifest(_step(out, 3))["run_id"]
    assert len(new) == 32 and new != _manifest(_step(runs / "a", 2))["run_id"]
    assert resume.load_part(out / "checkpoints").step == 3


@pytest.mark.parametrize("value", ["x" * 32, 7, "A" * 32])
def test_a_malformed_run_id_is_named(runs, tmp_path, value):
    out = tmp_path / "a"
    shutil.copytree(runs / "a", out)
    step = _step(out, 2)
    top = _manifest(step)
    top["run_id"] = value
    (step / ckpt.MANIFEST).write_text(json.dumps(top))
    with pytest.raises(ckpt.CheckpointError, match=r"manifest.json: run_id = .* must be 32 lowercase hex digits"):
        ckpt.read_sharded_manifest(step)
