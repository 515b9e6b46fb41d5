"""A user's sampler over the training rows (data.sampler_path / data.sampler_class, verl's
data.sampler.*): its order drives the draws, every rank draws the same global order, a curriculum
learns from each step's rows, and resume is exact (the sampler's state, or a replay from its seed)."""

import json
import random
import textwrap
from types import SimpleNamespace

import pytest
import torch

from pfppo_mega.config import load_config_dict
from pfppo_mega.data import build_prompt_data
from pfppo_mega.data.examples import write_example
from pfppo_mega.data.sampler import SampledPrompts, SamplerResumeError, load_sampler_class
from pfppo_mega.tokenizer import Tokenizer
from pfppo_mega.trainer import phases

SAMPLERS = textwrap.dedent('''
    import torch
    from torch.utils.data import RandomSampler, Sampler

    class Backwards(Sampler):
        """Every row once per pass, last first."""
        def __init__(self, data_source, data_config):
            self.n = len(data_source)
        def __iter__(self):
            return iter(range(self.n - 1, -1, -1))
        def __len__(self):
            return self.n

    class RandomCurriculum(Sampler):
        """verl's test sampler: a RandomSampler on the global stream, update() a no-op."""
        def __init__(self, data_source, data_config):
            self.inner = RandomSampler(data_source)
            self.seen = []
        def __iter__(self):
            return iter(self.inner)
        def __len__(self):
            return len(self.inner)
        def update(self, batch):
            self.seen.append(batch)

    class Shuffled(RandomCurriculum):
        update = None  # not a curriculum: replayed from its seed on resume

    class HardFirst(Sampler):
        """A curriculum with state: draws rows in proportion to 1 + the failures seen on them."""
        def __init__(self, data_source, data_config):
            self.fails = torch.zeros(len(data_source))
            self.drawn = 0
            self.batches = []
        def __iter__(self):
            while True:
                w = 1.0 + self.fails
                self.drawn += 1
                yield int(torch.multinomial(w, 1).item())
        def __len__(self):
            return len(self.fails)
        def update(self, batch):
            self.batches.append(batch)
            self.fails.index_add_(0, batch["index"], 1.0 - batch["score"])
        def state_dict(self):
            return {"fails": self.fails.clone(), "drawn": self.drawn}
        def load_state_dict(self, state):
            self.fails, self.drawn = state["fails"].clone(), state["drawn"]
''')


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    out = tmp_path_factory.mktemp("sampler")
    paths = write_example(out, n_train=20, n_test=4, seed=0, vocab_size=320)
    (out / "my_samplers.py").write_text(SAMPLERS)
    return paths, Tokenizer.from_dir(paths["tokenizer"]), out / "my_samplers.py"


def _source(example, name, *, dp_rank=0, dp_size=1, logs=None, seed=5):
    paths, tok, file = example
    cfg = load_config_dict({"actor_rollout": {"model_path": str(paths["tokenizer"])},
                            "data": {"source": "files", "train_files": [str(paths["train.parquet"])],
                                     "max_prompt_length": 128, "sampler_path": str(file), "sampler_class": name},
                            "training": {"seed": seed}})
    return build_prompt_data(cfg, tok, model_dir=paths["tokenizer"], rng=random.Random(0), dp_rank=dp_rank,
                             dp_size=dp_size, log=(logs.append if logs is not None else lambda *_: None)).train


def _idx(src, rows):
    return [src._row_index[s.row] for s in rows]


def test_the_samplers_order_decides_the_draws(example):
    src = _source(example, "Backwards")
    assert isinstance(src, SampledPrompts) and src.rows_per_pass == 20
    assert _idx(src, src.next_batch(8)) == list(range(19, 11, -1))
    assert _idx(src, src.next_batch(16)) == list(range(11, -1, -1)) + [19, 18, 17, 16]  # a pass wraps
    assert (src.epoch, src.offset) == (1, 4)


def test_ranks_draw_one_global_order_and_the_trainers_streams_are_untouched(example):
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    ranks = [_source(example, "Shuffled", dp_rank=r, dp_size=2) for r in range(2)]
    a, b = (_idx(s, s.next_batch(5)) for s in ranks)
    assert torch.equal(torch.rand(3), before)           # building and drawing used private streams
    assert not set(a) & set(b) and len(set(a + b)) == 10  # disjoint halves of one permutation
    assert a + b != list(range(10))                     # shuffled
    alone = _source(example, "Shuffled")
    assert _idx(alone, alone.next_batch(10)) == a + b   # the same global order at dp = 1
    other = _source(example, "Shuffled", seed=6)
    assert _idx(other, other.next_batch(10)) != a + b   # training.seed seeds it


def _checkpointed(state):
    """What a checkpoint gives back: the store's JSON + tensors round trip."""
    from pfppo_mega.trainer.checkpoint.store import decode_state, encode_state
    tensors = {}
    text = json.dumps(encode_state(state, tensors))
    return decode_state(json.loads(text), {k: v.clone() for k, v in tensors.items()}, set(), "test")


@pytest.mark.parametrize("draw_before", [7, 20, 27])  # mid-pass, at the pass's end, into the next pass
def test_a_sampler_without_state_is_replayed_exactly(example, draw_before):
    src = _source(example, "Shuffled")
    src.next_batch(draw_before)
    state = _checkpointed(src.state_dict())
    want = _idx(src, src.next_batch(30))
    again = _source(example, "Shuffled")
    again.load_state_dict(state)
    assert _idx(again, again.next_batch(30)) == want


def _scored(rows, scores):
    return SimpleNamespace(rollout=SimpleNamespace(samples=rows), raw_scores=torch.tensor(scores),
                           scores=torch.tensor(scores) * 2)


def test_a_curriculum_learns_from_each_step_and_resumes_from_its_state(example):
    src, logs = _source(example, "HardFirst"), []
    dp = SimpleNamespace(group=None, size=1)
    assert src.observes and src.stateful
    for step in (1, 2):
        rows = src.next_batch(6)
        phases.feed_back(_scored(rows, [float(i % 2) for i in range(6)]), prompts=src, dp=dp, step=step)
    got = src.sampler.batches[-1]
    assert got["index"].tolist() == _idx(src, rows) and got["step"] == 2
    assert got["score"].tolist() == [0.0, 1.0] * 3 and got["reward"].tolist() == [0.0, 2.0] * 3
    assert got["row"] == [s.row for s in rows] and len(got["data_source"]) == 6
    assert float(src.sampler.fails.sum()) == 6.0        # 3 failures a step
    state = _checkpointed(src.state_dict())
    want = []
    for step in (3, 4):
        rows = src.next_batch(6)
        want.append(_idx(src, rows))
        phases.feed_back(_scored(rows, [1.0, 0.0] * 3), prompts=src, dp=dp, step=step)
    again = _source(example, "HardFirst")
    again.load_state_dict(state)
    for step in (3, 4):
        rows = again.next_batch(6)
        assert _idx(again, rows) == want[step - 3]
        phases.feed_back(_scored(rows, [1.0, 0.0] * 3), prompts=again, dp=dp, step=step)
    fresh = _source(example, "HardFirst")
    fresh.next_batch(12)
    assert _idx(fresh, fresh.next_batch(6)) != want[0]  # without the learnt state the draws differ


def test_a_curriculum_without_state_warns_and_refuses_resume(example):
    logs = []
    src = _source(example, "RandomCurriculum", logs=logs)
    assert any("SamplerResumeError ahead" in line and "RandomCurriculum" in line for line in logs)
    src.next_batch(4)
    state = _checkpointed(src.state_dict())
    with pytest.raises(SamplerResumeError, match="RandomCurriculum has update.*no state_dict"):
        _source(example, "RandomCurriculum").load_state_dict(state)
    with pytest.raises(SamplerResumeError, match="drawn by .*RandomCurriculum.*Backwards"):
        _source(example, "Backwards").load_state_dict(state)


def test_plain_sources_do_not_observe(example):
    paths, tok, _ = example
    cfg = load_config_dict({"actor_rollout": {"model_path": str(paths["tokenizer"])},
                            "data": {"source": "files", "train_files": [str(paths["train.parquet"])],
                                     "max_prompt_length": 128}})
    plain = build_prompt_data(cfg, tok, model_dir=paths["tokenizer"], rng=random.Random(0), log=lambda *_: None)
    assert plain.train.observes is False


def test_module_forms_load(example, monkeypatch):
    _, _, file = example
    monkeypatch.syspath_prepend(str(file.parent))
    assert load_sampler_class("my_samplers", "Backwards").__name__ == "Backwards"
    assert load_sampler_class("pkg://my_samplers", "Backwards").__name__ == "Backwards"
    assert load_sampler_class(f"file://{file}", "HardFirst").__name__ == "HardFirst"


def test_verl_keys_map_to_ours():
    from pfppo_mega.config.verl.translate import translate
    out = translate([("data.train_files", ["t.parquet"], "override"), ("data.sampler.class_path", "pkg://a.b", "override"),
                     ("data.sampler.class_name", "Curriculum", "override")])
    assert not out.problems
    assert out.values["data.sampler_path"] == "pkg://a.b" and out.values["data.sampler_class"] == "Curriculum"
    bad = translate([("data.sampler.class_path", "pkg://a.b", "override")])
    assert any("class_name" in str(p) for p in bad.problems)


@pytest.fixture(scope="module")
def tiny_ckpt(example, tmp_path_factory):
    import transformers
    paths, tok, _ = example
    ckpt = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    hf = transformers.LlamaConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                  max_position_embeddings=160, tie_word_embeddings=False,
                                  bos_token_id=tok.bos_id, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    transformers.LlamaForCausalLM(hf).save_pretrained(ckpt)
    tok.save(ckpt)
    return ckpt


def _train_cfg(example, ckpt, out, sampler, steps):
    paths, _, file = example
    return load_config_dict({
        "actor_rollout": {"model_path": str(ckpt), "n_samples_per_prompt": 2},
        "data": {"source": "files", "train_files": [str(paths["train.parquet"])],
                 "val_files": [str(paths["test.parquet"])], "max_prompt_length": 128, "eval_size": 2,
                 "sampler_path": str(file), "sampler_class": sampler},
        "algorithm": {"max_response_length": 4},
        "training": {"rollout_batch_size": 3, "batch_size": 6, "total_training_steps": steps, "seed": 2,
                     "num_threads": 1},
        "logging": {"output_dir": str(out), "eval_interval": 0, "tensorboard": False, "plots": False,
                    "progress": False},
        "checkpoint": {"export_hf": False, "save_interval": 2}})


def test_the_trainer_draws_from_the_sampler_feeds_it_each_step_and_resumes_it(example, tiny_ckpt, tmp_path):
    """PPO steps on a tiny random Llama: the step's prompts are the sampler's, update() gets every row of
    each step with the scores the reward gave them, and a resumed run draws what the run that wrote the
    checkpoint would have drawn next (the curriculum's learnt state restored)."""
    from pfppo_mega.trainer.loop import PPOTrainer
    with PPOTrainer(_train_cfg(example, tiny_ckpt, tmp_path, "HardFirst", 2), log=lambda *_: None) as tr:
        src = tr.run.prompts
        drawn = []
        real_next = src.next_batch
        src.next_batch = lambda n: drawn.append(real_next(n)) or drawn[-1]
        tr.fit()
        batches = src.sampler.batches
        assert [b["step"] for b in batches] == [1, 2]
        for b, rows in zip(batches, drawn):
            assert len(b["index"]) == 6                                   # 3 prompts x 2 responses
            assert sorted(set(b["index"].tolist())) == sorted(set(_idx(src, rows)))
            assert b["score"].shape == (6,) and torch.isfinite(b["reward"]).all()
        fails = src.sampler.fails.clone()
        assert float(fails.sum()) > 0                                     # the tiny model fails: it learnt
        expected = _idx(src, real_next(3))                                # what step 3 would draw
    with PPOTrainer(_train_cfg(example, tiny_ckpt, tmp_path, "HardFirst", 3), log=lambda *_: None) as again:
        assert again.step == 2 and torch.equal(again.run.prompts.sampler.fails, fails)
        assert _idx(again.run.prompts, again.run.prompts.next_batch(3)) == expected


def test_resuming_a_curriculum_without_state_is_refused_by_name(example, tiny_ckpt, tmp_path):
    from pfppo_mega.trainer.checkpoint.store import CheckpointError
    from pfppo_mega.trainer.loop import PPOTrainer
    logs = []
    with PPOTrainer(_train_cfg(example, tiny_ckpt, tmp_path, "RandomCurriculum", 2), log=logs.append) as tr:
        tr.fit()
    assert any("SamplerResumeError ahead" in line for line in logs)
    with pytest.raises(CheckpointError, match="SamplerResumeError: the curriculum sampler .*RandomCurriculum"):
        PPOTrainer(_train_cfg(example, tiny_ckpt, tmp_path, "RandomCurriculum", 3), log=lambda *_: None)
