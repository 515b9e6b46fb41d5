"""DAPO's overlong reward buffer (reward.overlong_buffer; verl's reward_model.overlong_buffer):
nothing up to max_response_length - len tokens, then a linear penalty to -penalty_factor."""

import pytest
import torch

from pfppo_mega import ppo
from pfppo_mega.config import ConfigError
from pfppo_mega.trainer.loop import PPOTrainer

from test_trainer import _cfg, sft_dir  # noqa: F401  (the module's SFT checkpoint fixture)


def _reference(score: float, length: int, max_length: int, buffer_len: int, factor: float) -> float:
    expected = max_length - buffer_len
    exceed = length - expected
    return score + min(-exceed / buffer_len * factor, 0.0)


@pytest.mark.parametrize("max_length,buffer_len,factor", [(16, 4, 1.0), (5, 2, 0.5), (4096, 1024, 1.0), (8, 7, 2.0)])
def test_overlong_penalty_matches_the_formula(max_length, buffer_len, factor):
    lengths = torch.arange(0, max_length + 1)                                      # every length incl. the limit
    scores = torch.linspace(-1, 1, len(lengths), dtype=torch.float64)
    got = ppo.overlong_penalty(scores, lengths, max_length=max_length, buffer_len=buffer_len, penalty_factor=factor)
    want = torch.tensor([_reference(float(s), int(n), max_length, buffer_len, factor)
                         for s, n in zip(scores, lengths)], dtype=torch.float64)
    assert torch.allclose(got, want, atol=1e-12, rtol=0)
    assert float(got[-1] - scores[-1]) == pytest.approx(-factor)                  # -factor at the limit
    assert torch.equal(got[: max_length - buffer_len + 1], scores[: max_length - buffer_len + 1])


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match=r"buffer_len=8 must be in \(0, max_length=8\)"):
        ppo.overlong_penalty(torch.zeros(2), torch.zeros(2), max_length=8, buffer_len=8, penalty_factor=1.0)
    with pytest.raises(ValueError, match="lengths.shape"):
        ppo.overlong_penalty(torch.zeros(2), torch.zeros(3), max_length=8, buffer_len=2, penalty_factor=1.0)


def test_the_config_refuses_a_buffer_as_long_as_the_response(sft_dir, tmp_path):  # noqa: F811
    with pytest.raises(ConfigError, match=r"reward.overlong_buffer.len = 5: must be less than "
                                          r"algorithm.max_response_length \(5\)"):
        _cfg(tmp_path, sft_dir, reward={"overlong_buffer": {"enable": True, "len": 5}})
    with pytest.raises(ConfigError, match=r"reward.overlong_buffer.len = 0: must be >= 1"):
        _cfg(tmp_path, sft_dir, reward={"overlong_buffer": {"enable": True, "len": 0}})


def test_the_score_phase_applies_it(sft_dir, tmp_path):  # noqa: F811
    tr = PPOTrainer(_cfg(tmp_path, sft_dir, reward={"overlong_buffer": {"enable": True, "len": 4,
                                                                           "penalty_factor": 0.5}}),
                    log=lambda *_: None)
    rb, _ = tr.rollout(tr.run.prompts.next_batch(16))
    sb = tr.score(rb)
    lengths = rb.response_mask.sum(1)
    want = torch.tensor([_reference(float(s), int(n), 5, 4, 0.5) for s, n in zip(sb.raw_scores, lengths)])
    assert torch.allclose(sb.scores.double(), want.double(), atol=1e-6)
    penalised = int((sb.scores < sb.raw_scores).sum())
    print(f"lengths {sorted(set(lengths.int().tolist()))}: penalised rows {penalised} of {len(lengths)}")
    assert penalised == int((lengths > 1).sum()) > 0
