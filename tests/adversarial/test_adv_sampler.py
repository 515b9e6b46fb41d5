"""A user's sampler that cannot be used (data.sampler_path / data.sampler_class) is refused by name:
a bad path, a missing class, a class that is not a torch Sampler, a constructor that fails, an index
that is not a training row, a pass that yields nothing, a config that cannot hold one."""

from __future__ import annotations

import random
import textwrap

import pytest

from pfppo_mega.config import ConfigError, load_config_dict
from pfppo_mega.data import build_prompt_data
from pfppo_mega.data.examples import write_example
from pfppo_mega.data.sampler import (SamplerDryError, SamplerIndexError, SamplerLoadError, SamplerResumeError,
                                     SamplerTypeError)
from pfppo_mega.tokenizer import Tokenizer

BAD = textwrap.dedent('''
    from torch.utils.data import Sampler

    class NotASampler:
        def __init__(self, data_source, data_config):
            pass
        def __iter__(self):
            return iter([0])

    class Refuses(Sampler):
        def __init__(self, data_source, data_config):
            raise ValueError("no rows for me")

    class OldSignature(Sampler):
        def __init__(self, data_source):
            pass

    class Yields(Sampler):
        def __init__(self, data_source, data_config):
            self.n = len(data_source)
        def __iter__(self):
            return iter(self.VALUES(self.n))

    class TooFar(Yields):
        VALUES = staticmethod(lambda n: [0, 1, n])

    class Negative(Yields):
        VALUES = staticmethod(lambda n: [-1])

    class Floats(Yields):
        VALUES = staticmethod(lambda n: [0.0])

    class Strings(Yields):
        VALUES = staticmethod(lambda n: ["0"])

    class Empty(Yields):
        VALUES = staticmethod(lambda n: [])

    class IterRaises(Yields):
        def __iter__(self):
            raise RuntimeError("broken iterator")

    class UpdateRaises(Yields):
        VALUES = staticmethod(lambda n: range(n))
        def update(self, batch):
            raise KeyError("non_tensor_batch")

    not_a_class = 3
''')


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    out = tmp_path_factory.mktemp("adv_sampler")
    paths = write_example(out, n_train=8, n_test=2, seed=0, vocab_size=300)
    (out / "bad_samplers.py").write_text(BAD)
    (out / "raises_on_import.py").write_text("raise ImportError('needs verl')\n")
    (out / "verl_sampler.py").write_text("from verl.experimental.dataset.sampler import AbstractCurriculumSampler\n")
    return paths, Tokenizer.from_dir(paths["tokenizer"]), out


def _cfg(paths, **data):
    d = {"source": "files", "train_files": [str(paths["train.parquet"])], "max_prompt_length": 128, **data}
    return load_config_dict({"actor_rollout": {"model_path": str(paths["tokenizer"])}, "data": d})


def _build(example, path, name):
    paths, tok, out = example
    path = path.replace("DIR", str(out))
    return build_prompt_data(_cfg(paths, sampler_path=path, sampler_class=name), tok, model_dir=paths["tokenizer"],
                             rng=random.Random(0), log=lambda *_: None).train


@pytest.mark.parametrize("path,name,error,match", [
    ("DIR/missing.py", "X", SamplerLoadError, "no such file"),
    ("file://DIR/missing.py", "X", SamplerLoadError, "no such file"),
    ("pkg://no_such_module_here", "X", SamplerLoadError, "importing module 'no_such_module_here'.*ModuleNotFound"),
    ("DIR/raises_on_import.py", "X", SamplerLoadError, "running the file raised ImportError: needs verl"),
    ("DIR/verl_sampler.py", "X", SamplerLoadError, "No module named 'verl'; verl is not installed here: subclass "
                                                   "torch.utils.data.Sampler"),
    ("DIR/bad_samplers.py", "Missing", SamplerLoadError, "has no such name; its Sampler classes: .*'Refuses'"),
    ("DIR/bad_samplers.py", "NotASampler", SamplerTypeError, "not a subclass of torch.utils.data.Sampler"),
    ("DIR/bad_samplers.py", "not_a_class", SamplerTypeError, "is int 3, not a subclass"),
    ("DIR/bad_samplers.py", "Refuses", SamplerTypeError, "its constructor raised ValueError: no rows for me"),
    ("DIR/bad_samplers.py", "OldSignature", SamplerTypeError, "its constructor raised TypeError"),
])
def test_bad_classes_are_refused_at_start(example, path, name, error, match):
    with pytest.raises(error, match=match):
        _build(example, path, name)


@pytest.mark.parametrize("name,error,match", [
    ("TooFar", SamplerIndexError, r"yielded index 8 at pass 0, position 2: the training rows are 0..7"),
    ("Negative", SamplerIndexError, r"yielded index -1"),
    ("Floats", SamplerIndexError, r"yielded 0.0 \(float\).*must yield int row indices"),
    ("Strings", SamplerIndexError, r"yielded '0' \(str\)"),
    ("Empty", SamplerDryError, r"pass 0 over 8 rows yielded no index"),
    ("IterRaises", Exception, r"__iter__ raised RuntimeError: broken iterator"),
])
def test_bad_draws_are_named(example, name, error, match):
    src = _build(example, "DIR/bad_samplers.py", name)
    with pytest.raises(error, match=match):
        src.next_batch(4)


def test_an_update_that_raises_is_named(example):
    src = _build(example, "DIR/bad_samplers.py", "UpdateRaises")
    import torch
    rows = src.next_batch(2)
    with pytest.raises(Exception, match=r"UpdateRaises: update\(batch\) raised KeyError"):
        src.observe(rows, torch.zeros(2), torch.zeros(2), 1)


def test_a_checkpoint_without_a_sampler_is_refused(example):
    src = _build(example, "DIR/bad_samplers.py", "UpdateRaises")
    with pytest.raises(SamplerResumeError, match="was not written with a sampler"):
        src.load_state_dict({"epoch": 0, "offset": 3, "rows": 8, "digest": src.digest()})


@pytest.mark.parametrize("data,key", [
    ({"sampler_path": "x.py"}, "data.sampler_class"),
    ({"sampler_class": "X"}, "data.sampler_path"),
    ({"sampler_path": "x.py", "sampler_class": "not a name"}, "data.sampler_class"),
])
def test_config_refuses_half_a_sampler(example, data, key):
    paths, _, _ = example
    with pytest.raises(ConfigError, match=key):
        _cfg(paths, **data)


def test_config_refuses_a_sampler_without_files(example):
    paths, _, _ = example
    with pytest.raises(ConfigError, match="data.sampler_path.*needs data.source = files"):
        load_config_dict({"actor_rollout": {"model_path": str(paths["tokenizer"])},
                          "data": {"sampler_path": "x.py", "sampler_class": "X"}})
