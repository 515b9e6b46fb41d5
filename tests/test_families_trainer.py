"""The PPO trainer on checkpoints of the other families: tiny random Qwen3 (q/k RMSNorm, head_dim
24 != 64 / 4) and Llama with llama3 RoPE scaling (original context 8 < prompt + response), with
the built-in tokenizer. Two PPO steps each: actor, critic and reference are built for the family,
the built-in engine generates with the trainer's weights pushed under HF names (q_norm / k_norm
included), and the gap between the engine's sampling log-probs and the trainer's recomputation
(`rollout/logp_gap_max`) stays at fp32 round-off: a wrong RoPE or norm on either side would put
it at O(1).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

from pfppo_mega.config import load_config_dict  # noqa: E402
from pfppo_mega.tokenizer import char_tokenizer  # noqa: E402
from pfppo_mega.trainer.loop import PPOTrainer  # noqa: E402

SHAPE = dict(vocab_size=16, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, max_position_embeddings=24, rms_norm_eps=1e-5)
RUN = {
    "data": {"task": "addition", "num_digits": 1, "eval_size": 16, "max_prompt_length": 8},
    "training": {"rollout_batch_size": 16, "batch_size": 16, "lr": 1e-4, "critic_lr": 1e-3,
                 "total_training_steps": 2, "seed": 3, "num_threads": 1},
    "algorithm": {"kl_coeff": 0.01, "kl_estimator": "k1", "vf_coef": 0.5, "max_response_length": 5},
    "logging": {"eval_interval": 0, "tensorboard": False, "plots": False, "progress": False},
    "checkpoint": {"export_hf": False},
}
LOGP_GAP_TOL = 1e-4  # nats; fp32 engine vs fp32 trainer


def _model_dir(kind: str, path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**SHAPE, head_dim=24, tie_word_embeddings=True))
    else:
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
        model = LlamaForCausalLM(LlamaConfig(**SHAPE, rope_parameters=rope))
    with torch.no_grad():  # O(1) logits, so a wrong RoPE or norm shows in the log-prob gap
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight") else 0.3 * torch.randn_like(p))
    model.save_pretrained(path)
    char_tokenizer().save(path)
    return path


@pytest.mark.parametrize("kind", ["qwen3", "llama3"])
def test_ppo_steps_on_family_checkpoint(kind, tmp_path):
    model_dir = _model_dir(kind, tmp_path / kind)
    cfg = load_config_dict({**json.loads(json.dumps(RUN)), "actor_rollout": {"model_path": str(model_dir)},
                            "logging": {**RUN["logging"], "output_dir": str(tmp_path / "run")}})
    trainer = PPOTrainer(cfg, log=lambda *_: None)
    assert trainer.run.models.arch.family == ("qwen3" if kind == "qwen3" else "llama")
    res = trainer.fit()
    rows = [json.loads(line) for line in res.metrics_path.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "rollout/logp_gap_max" in r]
    assert len(steps) == 2, rows
    gaps = [r["rollout/logp_gap_max"] for r in steps]
    print(f"\n[{kind}] engine vs trainer log-prob gap per step: {gaps}")
    assert all(math.isfinite(g) and g < LOGP_GAP_TOL for g in gaps)
