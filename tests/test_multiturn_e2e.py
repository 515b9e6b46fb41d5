"""Multi-turn rollouts through the trainer: 2 PPO steps (GAE: the critic and the gap-skipping GAE) on
the CPU with the built-in engine, a tiny random Llama and the project's example tokenizer, a
calculator tool given to Generation in Python. The random policy does not write tool calls, so the
engine's first turn of every other row is replaced by a call (the rest is the policy's own)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pfppo_mega.config import load_config_dict
from pfppo_mega.data import chat_template_of
from pfppo_mega.data.examples import write_example
from pfppo_mega.rollout.multiturn import ToolSet, TurnLimits, TurnTokens
from pfppo_mega.rollout.tools.base import ToolResult
from pfppo_mega.tokenizer import Tokenizer
from pfppo_mega.trainer.colocation.generation import Turns
from pfppo_mega.trainer.loop import PPOTrainer

ROOT = Path(__file__).resolve().parents[1]
CALL = '<tool_call>{"name": "calc", "arguments": {"expr": "2+3"}}</tool_call>'


class Calc:
    name = "calc"
    schema = {"type": "function", "function": {"name": "calc", "description": "add two numbers",
                                                "parameters": {"type": "object", "properties": {}}}}

    def __init__(self) -> None:
        self.created, self.released, self.calls = [], [], []

    def create(self, instance_id, **kw):
        self.created.append(instance_id)

    def execute(self, instance_id, arguments):
        self.calls.append(arguments)
        a, b = str(arguments["expr"]).split("+")
        return ToolResult(str(int(a) + int(b)), reward=1.0)

    def release(self, instance_id):
        self.released.append(instance_id)


def write_turn(out, b: int, ids: list[int], pad_id: int) -> None:
    """Row b of an engine's output replaced by the turn ``ids`` (ended by EOS; log-probs 0: not the policy's)."""
    n = len(ids)
    out.responses[b] = pad_id
    out.responses[b, :n] = torch.tensor(ids)
    out.response_mask[b] = 0
    out.response_mask[b, :n] = 1
    out.logprobs[b] = 0
    out.lengths[b], out.finished[b] = n, True


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import transformers
    root = tmp_path_factory.mktemp("mt")
    paths = write_example(root / "data", n_train=8, n_test=4, seed=0, vocab_size=320)
    tok = Tokenizer.from_dir(paths["tokenizer"])
    ckpt = root / "ckpt"
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                   max_position_embeddings=512, tie_word_embeddings=False,
                                   bos_token_id=tok.bos_id, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    transformers.LlamaForCausalLM(cfg).save_pretrained(ckpt)
    tok.save(ckpt)
    return paths, ckpt, tok


REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # the tool's reward (Generation puts it into the row's extra_info) and a length term, so rows differ
    return float(extra_info.get("tool_rewards", 0.0)) + len(solution_str) / 1000.0
'''


@pytest.mark.parametrize("pf_ppo", [False, True])
def test_two_ppo_steps_with_a_tool(setup, tmp_path, pf_ppo):
    """PPO, and PF-PPO (each prompt group generated with a snapshot of the pool, a multi-turn rollout
    per snapshot used)."""
    paths, ckpt, tok = setup
    (tmp_path / "reward.py").write_text(REWARD)
    cfg = load_config_dict({
        "actor_rollout": {"model_path": str(ckpt), "n_samples_per_prompt": 2},
        "data": {"source": "files", "train_files": [str(paths["train.parquet"])],
                 "val_files": [str(paths["test.parquet"])], "max_prompt_length": 160, "eval_size": 2},
        "algorithm": {"max_response_length": 96, "use_pf_ppo": pf_ppo,
                      "pool": {"pool_size": 2, "snapshot_interval": 1, "sampling": "uniform"}},
        "training": {"rollout_batch_size": 2, "batch_size": 4, "lr": 1e-3, "total_training_steps": 2, "seed": 3,
                     "num_threads": 1},
        "logging": {"output_dir": str(tmp_path), "eval_interval": 2, "tensorboard": False, "plots": False,
                    "progress": False},
        "checkpoint": {"export_hf": False, "save_interval": 0},
        "reward": {"custom_function": {"path": str(tmp_path / "reward.py")}}})
    tr = PPOTrainer(cfg, log=lambda *_: None)
    gen = tr.run.colocation.gen
    calc = Calc()
    template = chat_template_of(tok, ckpt)
    gen.turns = Turns(ToolSet({"calc": calc}), TurnTokens(template, tok), TurnLimits(max_assistant_turns=3))

    engine = gen.engine
    real = engine.generate
    originals: set[tuple[int, ...]] = set()
    call_ids = tok.encode(CALL, add_bos=False) + [tok.eos_id]

    def scripted(prompts, params):
        out = real(prompts, params)
        for b, p in enumerate(prompts):
            if tuple(p) in originals and b % 2 == 0 and params.max_new_tokens >= len(call_ids):
                write_turn(out, b, call_ids, tok.pad_id)  # turn 1 of every other row: a call
        return out

    engine.generate = scripted
    originals.update(tuple(s.prompt_ids) for s in tr.run.eval_samples)  # the evaluation calls the tool too
    seen_rb, seen_eb = [], []
    rollout, update = tr.rollout, tr.update

    def capture_rollout(samples):
        originals.update(tuple(s.prompt_ids) for s in samples)
        rb, stats = rollout(samples)
        seen_rb.append(rb)
        return rb, stats

    def capture_update(eb, **kw):
        seen_eb.append(eb)
        return update(eb, **kw)

    tr.rollout, tr.update = capture_rollout, capture_update
    before = {n: p.detach().clone() for n, p in tr.run.models.actor.named_parameters()}
    res = tr.fit()

    # (a) the tool ran, every instance released, the metrics say so
    assert len(calc.calls) >= 2 and calc.calls[0] == {"expr": "2+3"}
    recs = [json.loads(line) for line in open(res.metrics_path)]
    evals = [r for r in recs if "eval/accuracy" in r]
    # 2 steps x 4 rows, and each evaluation (before training, at step 2): 2 held-out rows, sampled and greedy
    assert len(evals) == 2 and evals[-1]["eval/accuracy"] > 0.2  # the held-out rows' tool rewards reached it
    assert sorted(calc.created) == sorted(calc.released) and len(calc.created) == 2 * 4 + len(evals) * 2 * 2
    steps = [r for r in recs if "reward/mean" in r]
    assert len(steps) == 2 and all(r["reward/mean"] > 0.2 and r["guard/reward_errors"] == 0 for r in steps)
    assert all(r["rollout/tool_calls_mean"] > 0 and r["rollout/turns_max"] >= 2 and r["tool/calc/calls"] >= 1
               and 0 < r["rollout/tool_tokens_frac"] < 1 for r in steps)
    # (b) the tool's tokens are in the rows with mask 0, and the update's mask and advantages are 0 there
    answer = tok.encode("\n<|tool|>5\n<|assistant|>", add_bos=False)
    found = 0
    for rb, eb in zip(seen_rb, seen_eb):
        for b in range(rb.responses.shape[0]):
            row = rb.responses[b].tolist()
            if row[:len(call_ids)] != call_ids:
                continue
            at = len(call_ids)
            assert row[at:at + len(answer)] == answer, tok.hf.decode(row[at:at + len(answer)], skip_special_tokens=False)
            assert torch.all(rb.response_mask[b, at:at + len(answer)] == 0)
            assert torch.all(eb.inputs.response_mask[b, at:at + len(answer)] == 0)
            assert torch.all(eb.advantages[b, at:at + len(answer)] == 0)
            assert rb.response_mask[b, at + len(answer)] == 1  # the policy's second turn follows
            assert rb.samples[b].extra_info["tool_rewards"] == 1.0
            found += 1
    assert found >= 2
    # (c) the weights moved
    moved = [n for n, p in tr.run.models.actor.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert moved


def test_tools_from_verl_config_files(setup, tmp_path):
    """The config's tool and interaction files (verl's layout) reach the rollout: verl's gsm8k tool graded
    each row's call against the row's own create_kwargs (tool reward 1.0 for the right answer, 0.0 for a
    wrong one), and the gsm8k interaction asked again after a turn without a call."""
    import dataclasses

    from pfppo_mega.rollout.tools.answers import Gsm8kInteraction, Gsm8kTool

    import pyarrow as pa
    import pyarrow.parquet as pq

    paths, ckpt, tok = setup
    data = ROOT / "tests" / "data" / "tools"
    files = {}
    for name in ("train.parquet", "test.parquet"):  # each row's ground truth in its tool's and user's kwargs,
        rows = pq.read_table(paths[name]).to_pylist()  # as verl's gsm8k multi-turn preprocessing writes it
        for r in rows:
            gt = r["reward_model"]["ground_truth"]
            r["extra_info"] = {**r["extra_info"],
                               "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": gt}}},
                               "interaction_kwargs": {"name": "gsm8k", "ground_truth": gt}}
        files[name] = tmp_path / name
        pq.write_table(pa.Table.from_pylist(rows), files[name])
    cfg = load_config_dict({
        "actor_rollout": {"model_path": str(ckpt), "n_samples_per_prompt": 1,
                          "multi_turn": {"enable": True, "max_assistant_turns": 3,
                                         "tool_config_path": str(data / "gsm8k_tool_config.yaml"),
                                         "interaction_config_path": str(data / "gsm8k_interaction_config.yaml")}},
        "data": {"source": "files", "train_files": [str(files["train.parquet"])],
                 "val_files": [str(files["test.parquet"])], "max_prompt_length": 160, "eval_size": 2},
        "algorithm": {"max_response_length": 320},
        "training": {"rollout_batch_size": 2, "batch_size": 2, "total_training_steps": 1, "seed": 3,
                     "num_threads": 1},
        "logging": {"output_dir": str(tmp_path), "tensorboard": False, "plots": False, "progress": False},
        "checkpoint": {"export_hf": False, "save_interval": 0}})
    tr = PPOTrainer(cfg, log=lambda *_: None)
    gen = tr.run.colocation.gen
    toolset = gen.turns.toolset
    assert isinstance(toolset.tools["calc_gsm8k_reward"], Gsm8kTool)
    assert isinstance(toolset.interactions["gsm8k"], Gsm8kInteraction)

    call = '<tool_call>{"name": "calc_gsm8k_reward", "arguments": {"answer": "5"}}</tool_call>'
    call_ids = tok.encode(call, add_bos=False) + [tok.eos_id]
    base = tr.run.eval_samples[0]
    samples = [dataclasses.replace(base, extra_info={
        "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": gt}}},
        "interaction_kwargs": {"name": "gsm8k", "ground_truth": gt}}) for gt in ("5", "7")]
    real, firsts = gen.engine.generate, {tuple(s.prompt_ids) for s in samples}

    answer_ids = tok.encode("#### 3", add_bos=False) + [tok.eos_id]

    def scripted(prompts, params):  # turn 1 of each row: the call; turn 2: a wrong final answer, no call
        out = real(prompts, params)
        for b, p in enumerate(prompts):
            first = tuple(p) in firsts
            if first or any(tuple(p[:len(f)]) == f for f in firsts):
                write_turn(out, b, call_ids if first else answer_ids, tok.pad_id)
        return out

    gen.engine.generate = scripted
    with gen.colocated(0, refit=False):
        rb = gen.generate(samples, 1, step=0)
    # verl's step reward: 0.0 for a call that improves on the row's best score, -0.05 for one that does not
    assert [s.extra_info["tool_rewards"] for s in rb.samples] == [0.0, -0.05]
    for b, want in enumerate(("reward=1.0", "reward=0.0")):
        assert want in rb.texts[b], rb.texts[b]
    # turn 2 (no call, "#### 3") was graded by the interaction, which asked again
    from pfppo_mega.rollout.tools.answers import INCORRECT
    assert all(INCORRECT in text for text in rb.texts), rb.texts
