"""End to end on prompt files: the project's synthetic GSM8K parquet -> the checkpoint's chat
template -> generation -> the GSM8K rule reward -> PPO steps, evaluation per data_source, and the
data position through a checkpoint and resume. The checkpoint is a tiny random Llama written by
transformers with the project's BPE tokenizer (no downloads)."""

import json
import math
import shutil

import pytest
import torch

from pfppo_mega.config import load_config_dict
from pfppo_mega.data.examples import write_example
from pfppo_mega.rewards.rules import gsm8k_score
from pfppo_mega.tokenizer import Tokenizer
from pfppo_mega.trainer.loop import PPOTrainer


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import transformers  # pinned in requirements.lock
    root = tmp_path_factory.mktemp("e2e")
    paths = write_example(root / "data", n_train=24, n_test=6, seed=0, vocab_size=320)
    tok = Tokenizer.from_dir(paths["tokenizer"])
    ckpt = root / "ckpt"
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                   max_position_embeddings=128, tie_word_embeddings=False,
                                   bos_token_id=tok.bos_id, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    transformers.LlamaForCausalLM(cfg).save_pretrained(ckpt)
    tok.save(ckpt)  # tokenizer.json + tokenizer_config.json with the chat template
    return paths, ckpt


def _cfg(setup, out, **over):
    paths, ckpt = setup
    d = {"actor_rollout": {"model_path": str(ckpt), "n_samples_per_prompt": 2},
         "data": {"source": "files", "train_files": [str(paths["train.parquet"])],
                  "val_files": [str(paths["test.parquet"])], "max_prompt_length": 96, "eval_size": 6},
         "algorithm": {"max_response_length": 8},
         "training": {"rollout_batch_size": 4, "batch_size": 8, "lr": 1e-4, "total_training_steps": 3,
                      "seed": 2, "num_threads": 1},
         "logging": {"output_dir": str(out), "eval_interval": 2, "tensorboard": False, "plots": False,
                     "progress": False},
         "checkpoint": {"export_hf": False, "save_interval": 2}}
    for sec, vals in over.items():
        d[sec].update(vals)
    return load_config_dict(d)


def test_ppo_on_parquet_with_chat_template_and_math_reward(setup, tmp_path):
    logs = []
    tr = PPOTrainer(_cfg(setup, tmp_path), log=logs.append)
    assert type(tr.run.reward_fn).__name__ == "RuleReward" and len(tr.run.eval_samples) == 6
    # the prompts the engine sees are the chat-templated parquet rows
    batch = tr.run.prompts.next_batch(4)
    assert all(s.prompt_text.startswith("<s><|user|>") and s.prompt_text.endswith("<|assistant|>") for s in batch)
    # score phase = the GSM8K rule on the decoded responses (half the rows given the right answer)
    rb, _ = tr.rollout(batch)
    rb.texts = [f"so #### {s.ground_truth}" if i % 2 else t for i, (s, t) in enumerate(zip(rb.samples, rb.texts))]
    sb = tr.score(rb)
    want = [gsm8k_score(t, s.ground_truth) for s, t in zip(rb.samples, rb.texts)]
    assert sb.raw_scores.tolist() == want and sum(want) >= 4

    res = tr.fit()
    recs = [json.loads(line) for line in open(res.metrics_path)]
    steps = [r for r in recs if "reward/mean" in r]
    assert len(steps) == 3 and all(math.isfinite(r["policy/pg_loss"]) for r in steps)
    assert all(r["guard/reward_errors"] == 0 and r["guard/reward_timeouts"] == 0 for r in steps)
    evals = [r for r in recs if "eval/accuracy" in r]
    assert len(evals) >= 2 and all("eval/openai/gsm8k/accuracy_greedy" in r for r in evals)
    state = json.loads(json.dumps(tr.run.prompts.state_dict()))
    assert {k: state[k] for k in ("epoch", "offset", "rows")} == {"epoch": 0, "offset": 4 + 3 * 4, "rows": 24}
    assert len(state["digest"]) == 64  # 4 drawn above + 3 steps of 4; the rows' content digest


def test_data_position_survives_a_resume(setup, tmp_path):
    first = PPOTrainer(_cfg(setup, tmp_path, training={"total_training_steps": 2}), log=lambda *_: None)
    first.fit()
    assert first.run.prompts.state_dict()["offset"] == 8
    expected = [s.row for s in first.run.prompts.next_batch(4)]  # what step 3 would draw
    resumed = PPOTrainer(_cfg(setup, tmp_path, training={"total_training_steps": 3}), log=lambda *_: None)
    assert resumed.step == 2 and resumed.run.prompts.state_dict()["offset"] == 8
    assert [s.row for s in resumed.run.prompts.next_batch(4)] == expected


def test_a_resume_on_edited_prompt_files_of_the_same_length_is_refused(setup, tmp_path):
    """Issue 24.2: the same paths and row count, other content -- the saved position would index other
    prompts; refused by name instead of training on silently."""
    import pyarrow.parquet as pq
    from pfppo_mega.trainer.checkpoint.store import CheckpointError
    paths, ckpt = setup
    work = tmp_path / "data"
    work.mkdir()
    train = work / "train.parquet"
    shutil.copy(paths["train.parquet"], train)
    files = {"train_files": [str(train)], "val_files": [str(paths["test.parquet"])],
             "source": "files", "max_prompt_length": 96, "eval_size": 6}
    out = tmp_path / "run"
    PPOTrainer(_cfg(setup, out, data=files, training={"total_training_steps": 2}), log=lambda *_: None).fit()
    table = pq.read_table(train)
    rows = table.to_pylist()
    rows[0], rows[1] = rows[1], rows[0]  # same rows, same count, another order: other prompts at the position
    pq.write_table(type(table).from_pylist(rows, schema=table.schema), train)
    with pytest.raises(CheckpointError, match=r"the training rows changed since this checkpoint was written"):
        PPOTrainer(_cfg(setup, out, data=files, training={"total_training_steps": 3}), log=lambda *_: None)
    shutil.copy(paths["train.parquet"], train)  # the files it was written with: resumes
    assert PPOTrainer(_cfg(setup, out, data=files, training={"total_training_steps": 3}),
                      log=lambda *_: None).step == 2


USER_REWARD = '''
import time
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    k = extra_info["index"] % 3
    if k == 0:
        time.sleep(30)          # a hang: cut at reward.timeout_s
    if k == 1:
        raise ValueError("user bug")
    return {"score": 1.0}
'''


def test_custom_reward_that_hangs_and_raises_never_stops_training(setup, tmp_path):
    f = tmp_path / "user_reward.py"
    f.write_text(USER_REWARD)
    logs = []
    cfg = _cfg(setup, tmp_path / "run", training={"total_training_steps": 1},
               data={"eval_size": 3}, logging={"eval_interval": 0},
               checkpoint={"save_interval": 0})
    cfg.reward.custom_function.path, cfg.reward.num_workers, cfg.reward.timeout_s = str(f), 2, 0.5
    tr = PPOTrainer(cfg, log=logs.append)
    try:
        m = tr.train_step()
    finally:
        tr.run.reward_fn.close()
    rows = [s.extra_info["index"] % 3 for s in tr.run.prompts.samples]
    assert m["guard/reward_timeouts"] >= 1 and m["guard/reward_errors"] >= 1
    assert math.isfinite(m["policy/pg_loss"]) and 0 < m["reward/mean"] < 1
    assert sum("reward_timeouts; logged once" in x for x in logs) == 1
    assert sum("raised ValueError: user bug" in x for x in logs) == 1
    assert set(rows) == {0, 1, 2}
