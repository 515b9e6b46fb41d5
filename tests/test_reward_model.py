"""Reward models (reward.model_path, pfppo_mega/rewards/model.py).

- parity: a tiny random one-label *ForSequenceClassification per family, built here with
  transformers (tests/multirank/reward_model_checks.py: Llama default RoPE, Llama llama3 RoPE with
  rows past original_max_position_embeddings, Qwen2, Qwen3 with head_dim != hidden / heads, Mistral
  without sliding window): our scores (fp32, right-padded batch, last real token) vs
  transformers' fp64 scores of each row alone, at TP1 here; TP2 / PP2 / DP2 run in the shared
  torchrun launch of tests/test_parallel.py;
- the reward the trainer gets: rule_weight * rule score + model_weight * model score, through
  build_reward_fn and the RewardFn protocol (the response text re-encoded with the policy tokenizer,
  EOS appended when finished);
- refusals at start naming path, key and value: another vocabulary (vocab_size, tokenizer.json,
  no tokenizer.json), num_labels 2, a score bias, a CausalLM, a missing directory / config.json,
  and the config keys' own validation;
- end to end: PPO steps on the project's GSM8K parquet scored by a reward model plus the rule.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

sys.path.insert(0, str(Path(__file__).resolve().parent / "multirank"))

import reward_model_checks as rmc  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from pfppo_mega import parallel  # noqa: E402
from pfppo_mega.compat import megatron_cpu  # noqa: E402
from pfppo_mega.config import load_config_dict  # noqa: E402
from pfppo_mega.config.tree import ConfigError  # noqa: E402
from pfppo_mega.data.examples import write_example  # noqa: E402
from pfppo_mega.rewards import build_reward_fn  # noqa: E402
from pfppo_mega.rewards.base import RewardSetupError  # noqa: E402
from pfppo_mega.rewards.model import RewardModel, WeightedReward, last_token_inputs  # noqa: E402
from pfppo_mega.rewards.rules import gsm8k_score  # noqa: E402
from pfppo_mega.tokenizer import Tokenizer  # noqa: E402
from pfppo_mega.types import RewardFn, Sample  # noqa: E402


@pytest.fixture(scope="module")
def world():
    parallel.init_parallel(tp=1, pp=1, seed=1234)
    yield
    parallel.destroy_parallel()
    megatron_cpu.disable()


# ----------------------------------------------------------------------------- parity per family


@pytest.fixture(scope="module")
def family_ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm_families")
    return root, rmc.make_checkpoints(root)


@pytest.mark.parametrize("kind", rmc.KINDS)
def test_scores_match_transformers_at_tp1(world, family_ckpts, kind):
    root, paths = family_ckpts
    ref = load_file(str(root / rmc.REFERENCES))[f"scores/{kind}"]
    got = rmc.scores(paths[kind], micro_batch_size=4).double()  # 6 rows: two micro-batches
    gap = float((got - ref).abs().max())
    print(f"[reward model {kind} tp1] max |ours fp32 - transformers fp64| = {gap:.2e} (tol {rmc.SCORE_TOL:.0e}); "
          f"scores {[round(x, 4) for x in ref.tolist()]}")
    assert gap <= rmc.SCORE_TOL
    assert float(ref.std()) > 0.1  # the rows score differently: a constant head would not pass by luck


def test_weighted_reward_through_the_protocol_matches_transformers(world, family_ckpts):
    """The RewardFn path the shared launch runs at TP2 / PP2 / DP2 (reward_fn_weighted), at TP1."""
    root, paths = family_ckpts
    got = rmc.weighted_scores(paths["llama3"], micro_batch_size=4).double()
    want = rmc.weighted_reference(load_file(str(root / rmc.REFERENCES)))
    print(f"[weighted reward llama3 tp1] max gap {(got - want).abs().max():.2e}")
    assert (got - want).abs().max() <= rmc.MODEL_WEIGHT * rmc.SCORE_TOL


def test_the_last_real_token_is_scored(world, family_ckpts):
    """A row's score depends on its last token only through the prefix: padding never counts, and
    scoring at another position (the first pad, or one token earlier) gives another value."""
    _, paths = family_ckpts
    rm = RewardModel(paths["llama"], log=lambda *_: None)
    rows = rmc.rows()
    batch = rm.score_ids(rows)
    alone = torch.stack([rm.score_ids([r])[0] for r in rows])
    assert torch.allclose(batch, alone, atol=1e-5, rtol=0)
    shorter = rm.score_ids([r[:-1] for r in rows if len(r) > 1])
    assert (shorter - batch[[i for i, r in enumerate(rows) if len(r) > 1]]).abs().min() > 1e-4
    inp = last_token_inputs([[5, 6, 7], [8]])
    assert inp.resp_pos.tolist() == [[2], [0]] and inp.attention_mask.sum(1).tolist() == [3, 1]


def test_bf16_reward_model_tracks_fp32(world, family_ckpts):
    """model.params_dtype bfloat16: bf16 weights and compute (megatron's Float16Module casts the
    output to fp32); scores within bf16 resolution of the fp32 model's."""
    root, paths = family_ckpts
    ref = load_file(str(root / rmc.REFERENCES))["scores/qwen3"]
    rm = RewardModel(paths["qwen3"], params_dtype="bfloat16", log=lambda *_: None)
    assert next(rm.model.parameters()).dtype == torch.bfloat16
    got = rm.score_ids(rmc.rows())
    gap = float((got.double() - ref).abs().max())
    print(f"[reward model qwen3 bf16] max |ours bf16 - transformers fp64| = {gap:.2e}")
    assert got.dtype == torch.float32 and gap < 0.1 * float(ref.abs().max())


# ----------------------------------------------------------------------------- policy + reward model


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The project's GSM8K parquet + BPE tokenizer, a tiny Llama policy and a tiny Llama reward
    model with the same tokenizer files."""
    import transformers

    root = tmp_path_factory.mktemp("rm_e2e")
    paths = write_example(root / "data", n_train=24, n_test=6, seed=0, vocab_size=320)
    tok = Tokenizer.from_dir(paths["tokenizer"])
    shape = dict(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                 bos_token_id=tok.bos_id, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    torch.manual_seed(0)
    policy = root / "policy"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape, tie_word_embeddings=False)).save_pretrained(policy)
    tok.save(policy)
    rm = root / "rm"
    model = transformers.LlamaForSequenceClassification(transformers.LlamaConfig(**shape, num_labels=1))
    with torch.no_grad():
        model.score.weight.normal_(0.0, 1.0)  # scores of order 1 (the default init is 0.02)
    model.save_pretrained(rm)
    tok.save(rm)
    return paths, policy, rm, tok, model.float().eval()


def _cfg(setup, out, **over):
    paths, policy, rm, *_ = setup
    d = {"actor_rollout": {"model_path": str(policy), "n_samples_per_prompt": 2},
         "data": {"source": "files", "train_files": [str(paths["train.parquet"])],
                  "val_files": [str(paths["test.parquet"])], "max_prompt_length": 96, "eval_size": 6},
         "algorithm": {"max_response_length": 8},
         "reward": {"model_path": str(rm)},
         "training": {"rollout_batch_size": 4, "batch_size": 8, "lr": 1e-4, "total_training_steps": 3,
                      "seed": 2, "num_threads": 1},
         "logging": {"output_dir": str(out), "eval_interval": 2, "tensorboard": False, "plots": False,
                     "progress": False},
         "checkpoint": {"export_hf": False, "save_interval": 0}}
    for sec, vals in over.items():
        d[sec].update(vals)
    return load_config_dict(d)


def _samples(tok, n=4):
    texts = ["so #### 12", "I think #### 7", "no idea", "#### 3"][:n]
    samples = [Sample(prompt_ids=tuple(tok.encode(f"question {i}?")), data_source="openai/gsm8k",
                      ground_truth=str([12, 8, 1, 3][i]), row=f"r{i}") for i in range(n)]
    return samples, texts, [True, False, True, True][:n]


def test_reward_is_the_weighted_sum_through_the_protocol(world, setup, tmp_path):
    paths, policy, rm_path, tok, hf = setup
    samples, texts, finished = _samples(tok)
    fn = build_reward_fn(_cfg(setup, tmp_path, reward={"rule_weight": 0.5, "model_weight": 2.0}), log=lambda *_: None)
    assert isinstance(fn, WeightedReward) and isinstance(fn, RewardFn)
    res = fn(samples, texts, finished)
    # the rows the model scores: prompt ids + the re-encoded response (+ EOS when finished)
    seqs = [list(s.prompt_ids) + tok.encode(t, add_bos=False) + ([tok.eos_id] if f else [])
            for s, t, f in zip(samples, texts, finished)]
    with torch.no_grad():
        model_scores = torch.cat([hf.double()(torch.tensor([q])).logits[:, 0] for q in seqs])
        hf.float()
    rule = torch.tensor([gsm8k_score(t, s.ground_truth) for s, t in zip(samples, texts)], dtype=torch.float64)
    assert rule.tolist() == [1.0, 0.0, 0.0, 1.0]
    want = 0.5 * rule + 2.0 * model_scores
    print(f"[weighted reward] max |ours - (0.5 rule + 2 transformers)| = {(res.scores.double() - want).abs().max():.2e}")
    assert torch.allclose(res.scores.double(), want, atol=1e-4, rtol=0) and res.outcomes == ["ok"] * 4
    # rule_weight 0: the reward model alone (its own class), and no scorer needed for the data
    alone = build_reward_fn(_cfg(setup, tmp_path, reward={"rule_weight": 0.0}), log=lambda *_: None)
    assert isinstance(alone, RewardModel)
    odd = [Sample(s.prompt_ids, "my/unknown_source", None, row=s.row) for s in samples]
    alone.check(odd, "data")
    assert torch.allclose(alone(odd, texts, finished).scores.double(), model_scores, atol=1e-5, rtol=0)
    with pytest.raises(RewardSetupError, match="reward.rule_weight: 0"):  # the combined one needs a scorer
        fn.check(odd, "data")


def test_config_keys_are_validated():
    base = {"data": {"source": "task"}, "actor_rollout": {"model_path": "/p"}}
    cases = [({"model_weight": 2.0}, "reward.model_weight = 2.0: weighs the reward model"),
             ({"rule_weight": 0.0}, "reward.rule_weight = 0.0: weighs the reward model"),
             ({"model_path": "/x", "model_weight": 0.0}, "reward.model_weight = 0.0: must be > 0 when"),
             ({"model_path": "/x", "rule_weight": -1.0}, "reward.rule_weight = -1.0: must be >= 0"),
             ({"model_path": ""}, "reward.model_path = '': must be a checkpoint directory or null")]
    for reward, fragment in cases:
        with pytest.raises(ConfigError) as e:
            load_config_dict({**base, "reward": reward})
        assert fragment in str(e.value), (reward, str(e.value))
    ok = load_config_dict({**base, "reward": {"model_path": "/x", "model_weight": 0.3, "rule_weight": 0.0}}).reward
    assert (ok.model_path, ok.model_weight, ok.rule_weight) == ("/x", 0.3, 0.0)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(path: Path, fn) -> None:
    sd = load_file(str(path / "model.safetensors"))
    fn(sd)
    save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})


def _bad_checkpoints(setup, root: Path) -> list[tuple[str, Path, tuple[str, ...]]]:
    """(case, reward model dir, fragments the refusal must contain)."""
    paths, policy, rm, tok, _ = setup
    out = []
    p = _copy(rm, root / "vocab_size")
    _edit_config(p, vocab_size=tok.vocab_size + 1)
    out.append(("vocab_size", p, (str(p), f"vocab_size = {tok.vocab_size + 1}", str(policy),
                                  f"vocab_size = {tok.vocab_size}")))
    p = _copy(rm, root / "tokenizer")
    t = json.loads((p / "tokenizer.json").read_text())
    vocab = t["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[40:42]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size, two ids swapped
    (p / "tokenizer.json").write_text(json.dumps(t))
    out.append(("tokenizer_ids", p, (str(p / "tokenizer.json"), str(policy / "tokenizer.json"), "first difference: token")))
    p = _copy(rm, root / "no_tokenizer")
    (p / "tokenizer.json").unlink()
    out.append(("no_tokenizer", p, (str(p), "tokenizer.json", "policy's tokenizer files")))
    p = _copy(rm, root / "two_labels")
    _edit_config(p, id2label={"0": "LABEL_0", "1": "LABEL_1"}, label2id={"LABEL_0": 0, "LABEL_1": 1})
    _edit_tensors(p, lambda sd: sd.update({"score.weight": torch.cat([sd["score.weight"]] * 2)}))
    out.append(("num_labels_2", p, (str(p), "id2label", "(2 labels)", "num_labels = 1")))
    p = _copy(rm, root / "num_labels_key")
    _edit_config(p, num_labels=3)
    out.append(("num_labels_3", p, ("num_labels = 3", "(3 labels)")))
    p = _copy(rm, root / "bias")
    _edit_tensors(p, lambda sd: sd.update({"score.bias": torch.zeros(1)}))
    out.append(("score_bias", p, (str(p), "score.bias (1,)", "no bias")))
    p = _copy(rm, root / "no_score")
    _edit_tensors(p, lambda sd: sd.pop("score.weight"))
    out.append(("missing_score_weight", p, (str(p), "score.weight is missing")))
    p = _copy(policy, root / "causal")
    out.append(("causal_lm", p, (str(p), "architectures = ['LlamaForCausalLM']", "LlamaForSequenceClassification")))
    p = _copy(policy, root / "causal_no_arch")
    _edit_config(p, architectures=None, id2label={"0": "LABEL_0"})
    out.append(("causal_lm_no_architectures", p, ("score.weight is missing", "lm_head.weight: a CausalLM")))
    out.append(("missing_dir", root / "nowhere", (str(root / "nowhere"), "does not exist")))
    p = _copy(rm, root / "no_config")
    (p / "config.json").unlink()
    out.append(("missing_config", p, (str(p), "config.json", "is missing")))
    # issue 24.8: a bad hidden_size / vocab_size names the reward model's config file and the key
    for case, change in [("hidden_size_str", {"hidden_size": "32"}), ("hidden_size_0", {"hidden_size": 0}),
                         ("hidden_size_neg", {"hidden_size": -32}), ("hidden_size_missing", {"hidden_size": None}),
                         ("hidden_size_33", {"hidden_size": 33}), ("hidden_size_true", {"hidden_size": True}),
                         ("vocab_size_str", {"vocab_size": str(tok.vocab_size)}),
                         ("vocab_size_missing", {"vocab_size": None}), ("vocab_size_neg", {"vocab_size": -1})]:
        p = _copy(rm, root / case)
        _edit_config(p, **change)
        key, value = next(iter(change.items()))
        out.append((case, p, (f"the reward model's config file {str(p / 'config.json')!r}",
                              f"{key} = {value!r}" if value is not None else f"no {key}")))
    # consistent config, tensors of another shape: the embedding (vocab rows, hidden columns)
    for case, rows, cols in [("embed_rows", tok.vocab_size + 4, 32), ("embed_cols", tok.vocab_size, 16)]:
        p = _copy(rm, root / case)
        _edit_tensors(p, lambda sd, r=rows, c=cols: sd.update({"model.embed_tokens.weight": torch.zeros(r, c)}))
        out.append((case, p, (str(p), "model.embed_tokens.weight", f"({rows}, {cols})",
                              f"the reward model's config file {str(p / 'config.json')!r}")))
    return out


def test_bad_reward_models_are_refused_at_start_by_name(world, setup, tmp_path):
    for case, path, fragments in _bad_checkpoints(setup, tmp_path):
        cfg = _cfg(setup, tmp_path / "out", reward={"model_path": str(path)})
        with pytest.raises(RewardSetupError) as e:
            build_reward_fn(cfg, log=lambda *_: None)
        msg = str(e.value)
        missing = [f for f in fragments if f not in msg]
        assert not missing, f"{case}: {missing} not in {msg!r}"
        print(f"[refused {case}] {msg[:160]}")


def test_pfppo_train_refuses_another_vocabulary_without_a_traceback(world, setup, tmp_path, capsys):
    from pfppo_mega.cli import _train

    p = _copy(setup[2], tmp_path / "vocab")
    _edit_config(p, vocab_size=setup[3].vocab_size + 7)
    assert _train(_cfg(setup, tmp_path / "out", reward={"model_path": str(p)})) == 2
    err = capsys.readouterr().err
    assert err.startswith("pfppo: cannot start: the reward model's vocabulary differs from the policy's") \
        and "Traceback" not in err and f"vocab_size = {setup[3].vocab_size + 7}" in err


def test_a_context_shorter_than_prompt_plus_response_is_refused(world, setup, tmp_path):
    p = _copy(setup[2], tmp_path / "short")
    _edit_config(p, max_position_embeddings=64)
    with pytest.raises(RewardSetupError, match=r"max_position_embeddings = 64 < data.max_prompt_length \+ "
                                               r"algorithm.max_response_length = 104"):
        build_reward_fn(_cfg(setup, tmp_path / "out", reward={"model_path": str(p)}), log=lambda *_: None)


# ----------------------------------------------------------------------------- end to end


def test_ppo_steps_with_a_reward_model(world, setup, tmp_path):
    """The trainer builds the reward from the config and calls it only through RewardFn; the score
    phase's raw rewards are 0.5 * GSM8K rule + 1.0 * reward model."""
    from pfppo_mega.trainer.loop import PPOTrainer

    tr = PPOTrainer(_cfg(setup, tmp_path, reward={"rule_weight": 0.5}), log=lambda *_: None)
    try:
        assert isinstance(tr.run.reward_fn, WeightedReward)
        rm = next(fn for _, fn in tr.run.reward_fn.parts if isinstance(fn, RewardModel))
        rb, _ = tr.rollout(tr.run.prompts.next_batch(4))
        sb = tr.score(rb)
        finished = rb.finished.tolist()
        model_scores = rm.score_ids(rm.sequences(rb.samples, rb.texts, finished))
        rule = torch.tensor([gsm8k_score(t, s.ground_truth) for s, t in zip(rb.samples, rb.texts)])
        assert torch.allclose(sb.raw_scores, 0.5 * rule + model_scores, atol=1e-6, rtol=0)
        assert float(model_scores.std()) > 0  # the responses differ, and so do their scores
        res = tr.fit()
        recs = [json.loads(line) for line in open(res.metrics_path)]
        steps = [r for r in recs if "reward/mean" in r]
        assert len(steps) == 3 and all(math.isfinite(r["reward/mean"]) and math.isfinite(r["policy/pg_loss"])
                                       for r in steps)
        assert all(r["guard/reward_errors"] == 0 and r["guard/bad_rewards"] == 0 for r in steps)
    finally:
        tr.run.reward_fn.close()


# ----------------------------------------------------------------------------- the memory plan


def test_plan_counts_the_reward_model_weights(tmp_path, capsys):
    """`pfppo plan` with reward.model_path: each training-phase stage holds 2 B x the reward model's
    params on that rank (the critic's layout: trunk + [1, H] head) more, counted as a trainer state
    (it stays beside the engine without offload); a model the layout cannot split is refused."""
    from pfppo_mega.config.loader import load_config
    from pfppo_mega.planning.cli import main as plan_main, reward_model_shape
    from pfppo_mega.planning.memory import BYTES_WEIGHT, Hardware, Knobs, RunShape, make_plan
    from pfppo_mega.planning.shapes import stage_param_count

    config = Path(__file__).resolve().parents[1] / "configs" / "70b_llama33_pfppo.yaml"
    rm = tmp_path / "rm8b"
    rm.mkdir()
    hf = {"architectures": ["LlamaForSequenceClassification"], "model_type": "llama", "hidden_size": 4096,
          "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
          "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
          "id2label": {"0": "LABEL_0"}}
    (rm / "config.json").write_text(json.dumps(hf))
    cfg = load_config(config, [f"reward.model_path={rm}"])
    shape, line = reward_model_shape(cfg)
    assert "reward model: llama" in line and "7,504,928,768 params" in line  # 8B trunk without LM head + [1, H]
    hw, knobs = Hardware.preset("h200", nodes=8, gpus_per_node=8), Knobs()
    without = make_plan(RunShape.from_config(cfg), hw, knobs)
    with_rm = make_plan(RunShape.from_config(cfg, None, shape), hw, knobs)
    lay = with_rm.layout
    for k, (a, b) in enumerate(zip(without.stages, with_rm.stages)):
        extra = BYTES_WEIGHT * stage_param_count(shape, lay.tp, lay.pp, k, "value")
        assert b.train.total - a.train.total == extra > 0
        assert [c.name for c in b.train.components if c.name.startswith("reward model")] == ["reward model weights (bf16)"]
    assert plan_main([str(config), f"reward.model_path={rm}", "--gpu", "h200"]) in (0, 2)
    assert "reward model: llama from" in capsys.readouterr().out
    (rm / "config.json").write_text(json.dumps({**hf, "num_hidden_layers": 31}))  # 31 layers over pp 2
    odd, _ = reward_model_shape(load_config(config, [f"reward.model_path={rm}"]))
    with pytest.raises(ValueError, match="does not divide the reward model"):
        make_plan(RunShape.from_config(cfg, None, odd), hw, knobs)
