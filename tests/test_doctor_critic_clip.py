"""training.critic_grad_clip (the doctor's remedy for a diverging value loss): the config resolves
it (defaults to training.grad_clip, refuses a negative value) and the trainer builds the critic's
optimizer with it, the actor's with training.grad_clip."""

import json

import pytest

from pfppo_mega.config import load_config_dict
from pfppo_mega.config.tree import ConfigError
from pfppo_mega.sft import run_sft
from pfppo_mega.trainer.loop import PPOTrainer

TINY = {
    "model": {"num_layers": 1, "hidden_size": 32, "ffn_hidden_size": 64, "num_attention_heads": 2,
              "num_query_groups": 1, "vocab_size": 16, "max_position_embeddings": 24,
              "rope_theta": 10000.0, "norm_epsilon": 1e-5, "tie_word_embeddings": False},
    "data": {"task": "addition", "num_digits": 1, "eval_size": 8, "max_prompt_length": 8},
    "training": {"rollout_batch_size": 8, "batch_size": 8, "total_training_steps": 1, "num_threads": 1},
    "algorithm": {"max_response_length": 4},
    "logging": {"eval_interval": 0, "tensorboard": False, "plots": False, "progress": False},
    "checkpoint": {"export_hf": False},
    "sft": {"steps": 2, "batch_size": 8, "max_seconds": 0},
}


def _cfg(tmp_path, overrides=()):
    d = json.loads(json.dumps(TINY))
    d["sft"]["output_dir"] = str(tmp_path / "sft")
    d["actor_rollout"] = {"model_path": str(tmp_path / "sft")}
    d["logging"]["output_dir"] = str(tmp_path / "run")
    return load_config_dict(d, list(overrides))


def test_critic_grad_clip_defaults_to_grad_clip_and_is_checked(tmp_path):
    assert _cfg(tmp_path, ["training.grad_clip=0.7"]).training.critic_grad_clip == 0.7
    assert _cfg(tmp_path, ["training.critic_grad_clip=0.2"]).training.critic_grad_clip == 0.2
    with pytest.raises(ConfigError, match="training.critic_grad_clip"):
        _cfg(tmp_path, ["training.critic_grad_clip=-1"])


def test_trainer_clips_the_critic_apart_from_the_actor(tmp_path):
    cfg = _cfg(tmp_path, ["training.grad_clip=0.9", "training.critic_grad_clip=0.25"])
    run_sft(cfg, log=lambda *_: None)
    trainer = PPOTrainer(cfg, log=lambda *_: None)
    assert trainer.run.models.actor_opt.config.clip_grad == 0.9
    assert trainer.run.models.critic_opt.config.clip_grad == 0.25
