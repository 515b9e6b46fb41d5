"""A resume is exact or refused (issue 24.2): a setting the run depends on (seed, model path, data,
estimator, samples per prompt) changed since the checkpoint is refused by name with both values; a
changed lr / critic_lr / weight_decay is applied to the optimizer on purpose and said so (the
checkpoint's param groups used to win silently)."""

import shutil

import pytest

from pfppo_mega.trainer.checkpoint.store import CheckpointError
from pfppo_mega.trainer.loop import PPOTrainer

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


def test_another_model_path_is_refused(saved, sft_dir, tmp_path_factory):  # noqa: F811
    other = tmp_path_factory.mktemp("copy") / "sft"
    shutil.copytree(sft_dir, other)  # same shape and weights, another path: the reference would follow it
    with pytest.raises(CheckpointError, match=r"actor_rollout.model_path changed since this checkpoint"):
        _resume(saved, other, lambda *_: None)


def test_a_changed_learning_rate_is_applied_and_said(saved, sft_dir):  # noqa: F811
    lines: list[str] = []
    tr = _resume(saved, sft_dir, lines.append, training={"lr": 1e-4, "critic_lr": 2e-4, "weight_decay": 0.05})
    assert tr.step == 2
    for opt, lr in ((tr.run.actor_opt, 1e-4), (tr.run.critic_opt, 2e-4)):
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
