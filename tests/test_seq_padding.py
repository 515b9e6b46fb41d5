"""Sequence parallelism splits S over the TP ranks, so S must be a multiple of tp: the batch is
padded to the longest row rounded up (``pack(..., multiple_of=)``, and the engine's guard
``passes.seq_multiple`` for inputs packed without it). The padding is masked, and attention is
causal, so log-probs, entropies and values at the response positions do not change. Sequence
parallelism itself cannot run on CPU (tests/test_every_config.py): the rounding is checked here
with the multiple faked at tp = 1."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from pfppo_mega import parallel
from pfppo_mega.config.tree import ModelConfig
from pfppo_mega.models import passes, gpt
from pfppo_mega.types import pack

torch.set_num_threads(1)

MODEL = ModelConfig(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
                    vocab_size=19, max_position_embeddings=64, rope_theta=10000.0, norm_epsilon=1e-5,
                    tie_word_embeddings=False)


def _batch():
    g = torch.Generator().manual_seed(3)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    responses = torch.randint(1, 19, (3, 6), generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    return prompts, responses, mask  # longest row: 4 + 3 = 7 / 2 + 6 = 8 tokens


def test_pack_rounds_the_sequence_up_and_masks_the_padding():
    prompts, responses, mask = _batch()
    plain = pack(prompts, responses, mask, pad_id=0)
    for m in (1, 2, 3, 8):
        p = pack(prompts, responses, mask, pad_id=0, multiple_of=m)
        s = p.input_ids.shape[1]
        assert s % m == 0 and s - 8 < m, (m, s)
        assert torch.equal(p.input_ids[:, :8], plain.input_ids) and not p.attention_mask[:, 8:].any()
        real = mask.bool()  # masked response slots may point elsewhere (clamped to S - 1)
        assert torch.equal(p.resp_pos[real], plain.resp_pos[real]) and torch.equal(p.labels, plain.labels)
    with pytest.raises(ValueError, match=r"multiple_of\(0\) must be an int >= 1"):
        pack(prompts, responses, mask, pad_id=0, multiple_of=0)


def test_seq_multiple_is_tp_under_sequence_parallelism_only():
    def fake(tp, sp):
        return SimpleNamespace(module=None, config=SimpleNamespace(tensor_model_parallel_size=tp, sequence_parallel=sp))
    assert passes.seq_multiple(fake(8, True)) == 8
    assert passes.seq_multiple(fake(8, False)) == 1
    ids = torch.arange(14).view(2, 7)
    chunks = passes._chunks(ids, 1, pad=False, device=torch.device("cpu"), multiple=4)
    assert [tuple(c.input_ids.shape) for c in chunks] == [(1, 8), (1, 8)]
    assert torch.equal(chunks[1].input_ids[0, :7], ids[1]) and int(chunks[1].input_ids[0, 7]) == 0


def test_log_probs_and_values_unchanged_by_the_padding(monkeypatch):
    parallel.init_parallel(tp=1, pp=1, seed=1)
    torch.manual_seed(0)
    actor = gpt.build_actor(MODEL)
    critic = gpt.build_critic(MODEL)
    with torch.no_grad():
        critic.output_layer.weight.normal_()
    prompts, responses, mask = _batch()
    plain = pack(prompts, responses, mask, pad_id=0)
    seen: list[int] = []
    actor.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[1]))

    def run(inputs):
        logp, ent = passes.forward_logp_entropy(actor, inputs, temperature=0.7, micro_batch_size=2)
        return logp, ent, passes.forward_values(critic, inputs, micro_batch_size=2)

    ref = run(plain)
    assert set(seen) == {8}
    packed = run(pack(prompts, responses, mask, pad_id=0, multiple_of=3))  # S 9, padded by pack
    monkeypatch.setattr(passes, "seq_multiple", lambda model: 5)           # S 10, padded by the engine
    guarded = run(plain)
    assert set(seen) == {8, 9, 10}
    m = mask.bool()
    for got in (packed, guarded):
        for a, b in zip(ref, got):
            torch.testing.assert_close(a[m], b[m], rtol=0, atol=2e-6)
    logits = passes.forward_logits(actor, plain.input_ids, micro_batch_size=3)
    assert logits.shape == (3, 8, 19)  # the engine's padding is dropped again
