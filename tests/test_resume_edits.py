"""A resume is exact or refused (issue 24.2): a setting the run depends on (seed, data, estimator,
samples per prompt) changed since the checkpoint is refused by name with both values; a changed lr /
critic_lr / weight_decay is applied to the optimizer on purpose and said so (the checkpoint's param
groups used to win silently). The model and the prompt files are judged by content (issue 36): the
same content at another path resumes with a note, other content is refused by name."""

import os
import shutil

import pytest

from pfppo_mega.trainer.checkpoint.store import CheckpointError
from pfppo_mega.trainer.loop import PPOTrainer

from test_data_e2e import _cfg as e2e_cfg, setup  # noqa: F401  (prompt files and their model)
from test_trainer import _cfg, sft_dir  # noqa: F401  (the module's SFT checkpoint fixture)


@pytest.fixture
def saved(sft_dir, tmp_path):  # noqa: F811
    PPOTrainer(_cfg(tmp_path, sft_dir, training={"total_training_steps": 2}), log=lambda *_: None).fit()
    return tmp_path


def _resume(out, sft, log, **sections):
    training = {"total_training_steps": 3, **sections.pop("training", {})}
    return PPOTrainer(_cfg(out, sft, training=training, **sections), log=log)


@pytest.mark.parametrize("sections,key", [
    ({"training": {"seed": 4}}, r"training.seed changed since this checkpoint was written \(3 -> 4\)"),
    ({"actor_rollout": {"n_samples_per_prompt": 2}}, r"actor_rollout.n_samples_per_prompt changed .* \(1 -> 2\)"),
    ({"data": {"num_digits": 2}}, r"data.num_digits changed .* \(1 -> 2\)"),
])
def test_a_changed_setting_the_run_depends_on_is_refused(saved, sft_dir, sections, key):  # noqa: F811
    with pytest.raises(CheckpointError, match=key):
        _resume(saved, sft_dir, lambda *_: None, **sections)


@pytest.mark.parametrize("where", ["staged", "dot_slash"])
def test_the_same_model_at_another_path_resumes_with_a_note(saved, sft_dir, tmp_path_factory, where):  # noqa: F811
    """Issue 36: the content decides, not the path. A copy staged on another disk, or the same
    directory spelled ./<relative path>, resumes (the reference is the same model), and says so."""
    if where == "staged":
        other = tmp_path_factory.mktemp("node_local") / "sft"
        shutil.copytree(sft_dir, other)  # same files, another path
    else:
        other = "./" + os.path.relpath(sft_dir)
    lines: list[str] = []
    tr = _resume(saved, other, lines.append)
    assert tr.step == 2
    said = [line for line in lines if "actor_rollout.model_path is" in line]
    assert len(said) == 1 and "the same content (model identity" in said[0], lines
    tr.fit()
    assert tr.step == 3


def test_another_model_at_another_path_is_refused_by_name(saved, sft_dir, tmp_path_factory):  # noqa: F811
    """Another path with other content (weights of the same shapes, changed): refused by name, both
    identities in the message, nothing installed."""
    from safetensors.torch import load_file, save_file

    other = tmp_path_factory.mktemp("other") / "sft"
    shutil.copytree(sft_dir, other)
    sd = load_file(str(other / "model.safetensors"))
    save_file({k: v + 0.01 if v.is_floating_point() else v for k, v in sd.items()}, str(other / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"the frozen reference \(.*\) is not the one this checkpoint was "
                                              r"trained against \(identity '[0-9a-f]{64}' of .* -> [0-9a-f]{64}\): "
                                              r"other content"):
        _resume(saved, other, lambda *_: None)


def test_a_changed_learning_rate_is_applied_and_said(saved, sft_dir):  # noqa: F811
    lines: list[str] = []
    tr = _resume(saved, sft_dir, lines.append, training={"lr": 1e-4, "critic_lr": 2e-4, "weight_decay": 0.05})
    assert tr.step == 2
    for opt, lr in ((tr.run.models.actor_opt, 1e-4), (tr.run.models.critic_opt, 2e-4)):
        for g in opt.param_groups:
            assert g["lr"] == pytest.approx(lr * g.get("lr_mult", 1.0))
            assert g["weight_decay"] == pytest.approx(0.05 * g.get("wd_mult", 1.0))
    said = [line for line in lines if "resume: training." in line]
    assert len(said) == 3 and any("training.lr changed since the checkpoint (0.0003 -> 0.0001)" in s for s in said)
    tr.fit()
    assert tr.step == 3


def test_an_unchanged_resume_says_nothing_about_edits(saved, sft_dir):  # noqa: F811
    lines: list[str] = []
    tr = _resume(saved, sft_dir, lines.append)
    assert tr.step == 2 and not [line for line in lines if "changed since" in line]


def test_the_same_prompt_files_at_another_path_resume_with_a_note(setup, tmp_path):  # noqa: F811
    """data.train_files copied elsewhere (same rows): the rows' sha256 decides, so the run resumes at
    its data position and says so; the same path with other rows stays refused (test_data_e2e)."""
    paths, _ = setup
    first = PPOTrainer(e2e_cfg(setup, tmp_path, training={"total_training_steps": 2}), log=lambda *_: None)
    first.fit()
    expected = [(s.row.rsplit(":", 1)[1], s.prompt_ids) for s in first.run.prompts.next_batch(4)]  # step 3's
    staged = tmp_path / "staged"
    staged.mkdir()
    shutil.copy(paths["train.parquet"], staged / "renamed.parquet")
    lines: list[str] = []
    resumed = PPOTrainer(e2e_cfg(setup, tmp_path, training={"total_training_steps": 3},
                                 data={"train_files": [str(staged / "renamed.parquet")]}), log=lines.append)
    got = [(s.row.rsplit(":", 1)[1], s.prompt_ids) for s in resumed.run.prompts.next_batch(4)]
    assert resumed.step == 2 and got == expected
    said = [line for line in lines if "data.train_files is" in line]
    assert len(said) == 1 and "the same content (training rows sha256" in said[0], lines
