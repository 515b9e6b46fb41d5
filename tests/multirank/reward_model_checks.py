"""Reward models (pfppo_mega.rewards.model) against transformers, per family and layout.

For each family a tiny random one-label ``*ForSequenceClassification`` is built with transformers
(the shapes of common.py): Llama with default RoPE, Llama with llama3 RoPE scaling (rows longer
than original_max_position_embeddings, so the scaled bands act), Qwen2 (q/k/v biases), Qwen3 (q/k
RMSNorm, head_dim 24 != 64 / 4), Mistral without a sliding window. ``make_checkpoints`` writes them
and transformers' fp64 scores of ``rows()`` (each row alone, unpadded: the score at its last token)
in the pytest process; ``scores`` runs our reward model at the current layout on the same rows,
right-padded into one batch. tests/test_reward_model.py compares at TP1 in-process; ``run`` is
called per layout inside the shared launches of checks.py (tests/test_parallel.py) and prints
``RESULT <layout> reward_model_vs_transformers[<kind>] PASS|FAIL max_diff=...`` (the gap over all
ranks; every rank must hold the same scores), and ``reward_fn_weighted[llama3]``: the trainer's
path, through the RewardFn protocol (texts encoded, EOS appended when finished) and weighted with
a rule-based scorer, equals 0.5 * rule + 2 * transformers. Imports only torch, safetensors and pfppo_mega at
run time (transformers only in ``make_checkpoints``).
"""

from __future__ import annotations

from pathlib import Path

import torch

import common

KINDS = ("llama", "llama3", "qwen2", "qwen3", "mistral")
CHECKS = tuple(f"reward_model_vs_transformers[{k}]" for k in KINDS) + ("reward_fn_weighted[llama3]",)
RULE_WEIGHT, MODEL_WEIGHT, EOS = 0.5, 2.0, common.VOCAB - 1
REFERENCES = "reward_references.safetensors"
SCORE_TOL = 2e-5  # fp32 megatron vs fp64 transformers (as the logits checks)
LENGTHS = (common.FAMILY_SEQ, 5, common.ROPE_ORIG + 3, 1, 17, 40)  # uneven: padding and the last token matter


def rows() -> list[list[int]]:
    gen = torch.Generator().manual_seed(77)
    return [torch.randint(0, common.VOCAB, (n,), generator=gen).tolist() for n in LENGTHS]


def encode(text: str) -> list[int]:
    """A stand-in for the policy tokenizer: one token per character."""
    return [ord(c) % (common.VOCAB - 1) for c in text]


def text_batch():
    """(samples, texts, finished) for the RewardFn path; ground truths match rows 0 and 2."""
    from pfppo_mega.types import Sample

    prompts = [r[: max(1, len(r) // 2)] for r in rows()]
    texts = ["so it is 42", "", "abc", "x" * 20, "the answer", "y" * 9]
    truth = ["so it is 42", "no", "abc", "z", "nope", "no"]
    samples = [Sample(prompt_ids=tuple(p), data_source="my/source", ground_truth=g, row=f"r{i}")
               for i, (p, g) in enumerate(zip(prompts, truth))]
    return samples, texts, [True, False, True, True, False, True]


def text_sequences() -> list[list[int]]:
    samples, texts, finished = text_batch()
    return [list(s.prompt_ids) + encode(t) + ([EOS] if f else []) for s, t, f in zip(samples, texts, finished)]


def hf_classifier(kind: str) -> torch.nn.Module:
    """A transformers *ForSequenceClassification of family ``kind`` with one label (fp32, eval)."""
    import transformers as T

    shape = dict(vocab_size=common.VOCAB, hidden_size=common.HIDDEN, num_hidden_layers=common.LAYERS,
                 num_attention_heads=common.HEADS, num_key_value_heads=common.KV_HEADS,
                 intermediate_size=common.FFN, max_position_embeddings=common.MAX_POS, rms_norm_eps=1e-5,
                 num_labels=1)
    if kind == "llama":
        model = T.LlamaForSequenceClassification(T.LlamaConfig(**shape, rope_theta=5000.0))
    elif kind == "llama3":
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": common.ROPE_ORIG}
        model = T.LlamaForSequenceClassification(T.LlamaConfig(**shape, rope_parameters=rope))
    elif kind == "qwen2":
        model = T.Qwen2ForSequenceClassification(T.Qwen2Config(**shape, rope_theta=10000.0))
    elif kind == "qwen3":
        model = T.Qwen3ForSequenceClassification(T.Qwen3Config(**shape, head_dim=24, rope_theta=20000.0))
    elif kind == "mistral":
        model = T.MistralForSequenceClassification(T.MistralConfig(**shape, head_dim=32, sliding_window=None,
                                                                  rope_theta=10000.0))
    else:
        raise ValueError(kind)
    common._randomise(model, seed=100 + KINDS.index(kind))
    return model.float().eval()


def hf_scores(model: torch.nn.Module, sequences: list[list[int]]) -> torch.Tensor:
    """transformers' fp64 score of each row alone [B] (batch of one: the last token is scored)."""
    with torch.no_grad():
        m = model.double()
        out = torch.cat([m(torch.tensor([r])).logits[:, 0] for r in sequences])
        model.float()
    return out


def make_checkpoints(root: Path) -> dict[str, Path]:
    """root/rm_<kind> for each kind and root/REFERENCES (scores/<kind> [B] fp64 of rows())."""
    from safetensors.torch import save_file

    out, refs = {}, {}
    for kind in KINDS:
        model = hf_classifier(kind)
        out[kind] = root / f"rm_{kind}"
        model.save_pretrained(out[kind])
        refs[f"scores/{kind}"] = hf_scores(model, rows())
        if kind == "llama3":
            refs[f"text_scores/{kind}"] = hf_scores(model, text_sequences())
    save_file(refs, str(root / REFERENCES))
    return out


def scores(path: Path, micro_batch_size: int) -> torch.Tensor:
    """Our reward model's scores [B] of rows() at the current layout (one right-padded batch)."""
    from pfppo_mega.rewards.model import RewardModel

    rm = RewardModel(path, micro_batch_size=micro_batch_size, log=lambda *_: None)
    return rm.score_ids(rows())


def run(layout: str, data: Path, mbs: int, report, all_ranks_ok) -> None:
    import torch.distributed as dist
    from safetensors.torch import load_file

    refs = load_file(str(data / REFERENCES))
    for kind in KINDS:
        got = scores(data / f"rm_{kind}", mbs).double()
        diff = float((got - refs[f"scores/{kind}"]).abs().max())
        gathered = [torch.zeros_like(got) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, got)
        same = all(torch.equal(g, got) for g in gathered)  # every rank (DP replicas too: same rows) alike
        worst = torch.tensor([diff], dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        report(layout, f"reward_model_vs_transformers[{kind}]", all_ranks_ok(diff <= SCORE_TOL and same),
               float(worst), SCORE_TOL, f"same_on_all_ranks={same}")
    got, want = weighted_scores(data / "rm_llama3", mbs), weighted_reference(refs)
    diff = float((got.double() - want).abs().max())
    report(layout, "reward_fn_weighted[llama3]", all_ranks_ok(diff <= MODEL_WEIGHT * SCORE_TOL), diff,
           MODEL_WEIGHT * SCORE_TOL)


def weighted_scores(path: Path, micro_batch_size: int) -> torch.Tensor:
    """RULE_WEIGHT * exact_match + MODEL_WEIGHT * reward model on text_batch(), through RewardFn."""
    from pfppo_mega.rewards.base import RuleReward
    from pfppo_mega.rewards.model import RewardModel, WeightedReward

    quiet = lambda *_: None  # noqa: E731
    fn = WeightedReward([(RULE_WEIGHT, RuleReward(default_scorer="exact_match", log=quiet)),
                         (MODEL_WEIGHT, RewardModel(path, encode=encode, eos_id=EOS, micro_batch_size=micro_batch_size,
                                                    log=quiet))])
    res = fn(*text_batch())
    assert res.outcomes == ["ok"] * len(res.outcomes), res.outcomes
    return res.scores


def weighted_reference(refs: dict) -> torch.Tensor:
    rule = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 0.0], dtype=torch.float64)  # exact matches of text_batch()
    return RULE_WEIGHT * rule + MODEL_WEIGHT * refs["text_scores/llama3"]
