"""Issue 40 (vague refusals): a reward model's config.json that breaks the model rules
(`num_attention_heads` not dividing `hidden_size`, key/value heads not dividing the heads, a width
past the limit) was refused as if the policy's YAML keys were wrong (`1 config problem(s): -
hidden_size = 32: must be divisible by num_attention_heads (3)`, or a DecoderShape ValueError
traceback), without the reward model's path or file. Both readers of reward.model_path are tried:
the reward model itself (the trainer) and the plan's shape reader (`pfppo plan`, the memory ledger)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pfppo_mega.families import ModelDirError
from pfppo_mega.rewards.base import RewardSetupError

SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=128)


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    import transformers

    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("rm") / "rm"
    transformers.LlamaForSequenceClassification(transformers.LlamaConfig(**SHAPE, num_labels=1)).save_pretrained(d)
    return d


CASES = [
    ("heads_not_dividing_hidden", {"num_attention_heads": 3},
     "config.json: hidden_size = 32: must be divisible by num_attention_heads (3)"),
    ("kv_heads_not_dividing_heads", {"num_key_value_heads": 3},
     "config.json: num_key_value_heads = 3: must divide num_attention_heads (2)"),
    ("ffn_too_wide", {"intermediate_size": 10**9}, "config.json: intermediate_size = 1000000000: must be >= 1"),
]


def _damaged(rm_dir, tmp_path, change):
    d = tmp_path / "bad_rm"
    shutil.copytree(rm_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(change)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("case,change,said", CASES, ids=[c[0] for c in CASES])
def test_the_reward_model_refuses_its_config_by_path_and_key(rm_dir, tmp_path, case, change, said):
    from pfppo_mega.rewards.model import RewardModel

    d = _damaged(rm_dir, tmp_path, change)
    with pytest.raises(RewardSetupError) as e:  # refused before any model is built (no parallel state needed)
        RewardModel(d, log=lambda *_: None)
    assert str(e.value).startswith(f"reward.model_path {str(d)!r}: {said}"), str(e.value)


@pytest.mark.parametrize("case,change,said", CASES, ids=[c[0] for c in CASES])
def test_the_plans_reader_refuses_it_by_path_and_key(rm_dir, tmp_path, case, change, said):
    from pfppo_mega.ledger import reward_model_shape

    d = _damaged(rm_dir, tmp_path, change)
    with pytest.raises(ModelDirError) as e:
        reward_model_shape(d)
    assert str(e.value).startswith(f"reward.model_path {str(d)!r}: {said}"), str(e.value)
