"""A user's sampler over the training rows (data.sampler_path / data.sampler_class; verl's
data.sampler.class_path / class_name): a `torch.utils.data.Sampler` built as verl builds it,
``cls(data_source=rows, data_config=config)``, whose indices decide which rows each step draws.

A sampler with an ``update(batch)`` method is a curriculum: after every step it is given the step's
rows and their scores (`feedback_batch` says what the dict holds; verl passes its DataProto).

Everything the sampler draws from the global random streams (torch's, Python's ``random``,
numpy's) comes from a private set of streams seeded by training.seed, swapped in around every call
into the sampler: the draws are the same on every data-parallel rank and in every run of the same
seed, and the trainer's own streams are untouched.

Resume is exact or refused:
- a sampler with ``state_dict()`` / ``load_state_dict()``: its state and the private streams are
  checkpointed; after loading, a fresh ``iter()`` continues where it stood (the sampler's state
  holds its position, as torchdata's StatefulDataLoader expects of it);
- a sampler without them and without ``update``: the epoch is replayed from its start (the private
  streams as they were when the epoch began), skipping the indices already drawn;
- a curriculum (``update``) without them: what it learnt cannot be restored, so resuming is refused
  (`SamplerResumeError`; a warning says so at start).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import random
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch.utils.data import Sampler

from pfppo_mega.data.files import DataError
from pfppo_mega.types import Sample

PKG, FILE = "pkg://", "file://"


class SamplerError(DataError):
    """A user's sampler that cannot be used; the message names the class and the rule."""


class SamplerLoadError(SamplerError):
    """data.sampler_path / data.sampler_class do not name a loadable class."""


class SamplerTypeError(SamplerError):
    """The class is not a torch Sampler, or its constructor refused verl's arguments."""


class SamplerIndexError(SamplerError):
    """The sampler yielded something that is not an index of a training row."""


class SamplerDryError(SamplerError):
    """A fresh pass of the sampler yielded no index: no batch can ever be drawn."""


class SamplerResumeError(SamplerError):
    """A checkpoint's sampler position cannot be restored exactly."""


# ----------------------------------------------------------------------------- loading


def _module(path: str, cwd: Path) -> Any:
    """verl's forms: pkg://a.b.c or pkg://a/b/c (a module), file://x.py or x.py (a file); a plain
    dotted name is a module too."""
    if path.startswith(PKG):
        name = path[len(PKG):].replace("/", ".")
        return _import(name, path)
    file = path[len(FILE):] if path.startswith(FILE) else path
    if path.startswith(FILE) or file.endswith(".py") or "/" in file:
        where = Path(file) if Path(file).is_absolute() else cwd / file
        if not where.is_file():
            raise SamplerLoadError(f"data.sampler_path = {path!r}: no such file ({where})")
        spec = importlib.util.spec_from_file_location(f"pfppo_user_sampler_{abs(hash(str(where.resolve())))}", where)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as e:  # the user's file: any error it raises is reported with its type
            raise SamplerLoadError(f"data.sampler_path = {path!r}: running the file raised "
                                   f"{type(e).__name__}: {e}{_verl_hint(e)}") from e
        return module
    return _import(path, path)


def _import(name: str, given: str) -> Any:
    try:
        return importlib.import_module(name)
    except Exception as e:  # ModuleNotFoundError, or whatever the module raises on import
        raise SamplerLoadError(f"data.sampler_path = {given!r}: importing module {name!r} raised "
                               f"{type(e).__name__}: {e} (a module on sys.path, pkg://a.b.c, or a .py file)"
                               f"{_verl_hint(e)}") from e


def _verl_hint(e: Exception) -> str:
    """A sampler written for verl imports verl (its AbstractSampler) and omegaconf, absent here."""
    if isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] in ("verl", "omegaconf"):
        return ("; verl is not installed here: subclass torch.utils.data.Sampler instead of verl's "
                "AbstractSampler / AbstractCurriculumSampler (the same methods: __init__(data_source, data_config), "
                "__iter__, update(batch))")
    return ""


def load_sampler_class(path: str, name: str, *, cwd: Path | None = None) -> type:
    module = _module(path, cwd or Path.cwd())
    cls = getattr(module, name, None)
    if cls is None:
        found = sorted(k for k, v in vars(module).items()
                       if inspect.isclass(v) and issubclass(v, Sampler) and v.__module__ == module.__name__)
        raise SamplerLoadError(f"data.sampler_class = {name!r}: {path!r} has no such name; its Sampler classes: "
                               f"{found or 'none'}")
    if not (inspect.isclass(cls) and issubclass(cls, Sampler)):
        raise SamplerTypeError(f"data.sampler_class = {name!r} in {path!r} is {type(cls).__name__} "
                               f"{cls!r}, not a subclass of torch.utils.data.Sampler (verl's AbstractSampler is one)")
    return cls


# ----------------------------------------------------------------------------- what the sampler sees


class SamplerRows(Sequence):
    """The training rows as the sampler's ``data_source``: row i is a dict of its prompt's token ids,
    its rendered text, data_source, ground_truth, extra_info and "file:row"."""

    def __init__(self, samples: list[Sample]):
        self._samples = samples

    def __len__(self) -> int:
        return len(self._samples)

    def __getitem__(self, i):
        s = self._samples[i]
        return {"prompt_ids": list(s.prompt_ids), "prompt_text": s.prompt_text, "data_source": s.data_source,
                "ground_truth": s.ground_truth, "extra_info": s.extra_info, "row": s.row}


class SamplerConfig(dict):
    """The sampler's ``data_config``: our data section's keys plus ``seed`` (training.seed), read as a
    mapping or by attribute (verl passes an OmegaConf DictConfig); a copy, so writes change nothing."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None


def feedback_batch(indices: list[int], rows: list[Sample], scores: torch.Tensor, rewards: torch.Tensor,
                   step: int) -> dict[str, Any]:
    """What a curriculum's ``update(batch)`` gets after each step, one entry per response (all the
    step's rows on every data-parallel rank, before policy filtration):
    index [B] long: the row's index in data_source; score [B] float: the verifier's score; reward [B]
    float: the reward trained on (after data.reward preprocessing); data_source, row: lists of str;
    step: the step just finished (1-based)."""
    return {"index": torch.tensor(indices, dtype=torch.long), "score": scores.detach().float().cpu(),
            "reward": rewards.detach().float().cpu(), "data_source": [s.data_source for s in rows],
            "row": [s.row for s in rows], "step": step}


# ----------------------------------------------------------------------------- private random streams


def _seeded_streams(seed: int) -> dict[str, Any]:
    """The three streams seeded by ``seed``, made without touching the global ones."""
    g = torch.Generator()
    g.manual_seed(seed)
    return {"torch": g.get_state(), "random": random.Random(seed).getstate(),
            "numpy": _np_portable(np.random.RandomState(seed % 2 ** 32).get_state())}


def _np_portable(state: tuple) -> tuple:
    """numpy's state with its key array as a tensor (a checkpoint stores tensors, not arrays)."""
    name, keys, pos, has_gauss, gauss = state
    return name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)


def _capture() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "random": random.getstate(),
            "numpy": _np_portable(np.random.get_state())}


def _install(streams: dict[str, Any]) -> None:
    torch.set_rng_state(streams["torch"])
    random.setstate(tuple(tuple(x) if isinstance(x, list) else x for x in streams["random"]))
    name, keys, pos, has_gauss, gauss = streams["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))


@contextmanager
def _swapped(streams: dict[str, Any] | None):
    """Run a call with ``streams`` as the global random streams (None: leave them), then put the
    caller's back; the caller reads the advanced streams with _capture() inside."""
    outer = _capture()
    try:
        if streams is not None:
            _install(streams)
        yield streams
    finally:
        _install(outer)


# ----------------------------------------------------------------------------- the prompt source


class SampledPrompts:
    """The training rows in the order a user's sampler yields them; each global batch is the next
    n * dp_size indices (a pass that ends mid-batch continues with the next pass), each rank keeping its
    slice. Position = (epoch, indices drawn in it) + the private streams (+ the sampler's own state)."""

    def __init__(self, samples: list[Sample], cls: type, *, config: dict[str, Any], seed: int,
                 dp_rank: int = 0, dp_size: int = 1, log: Callable[[str], None] = print):
        self.samples, self.cls, self.dp_rank, self.dp_size = samples, cls, dp_rank, dp_size
        self.name = f"{cls.__module__}.{cls.__qualname__}"
        self._streams = _seeded_streams(seed)
        self.sampler = self._call(lambda: cls(data_source=SamplerRows(samples), data_config=SamplerConfig(config)),
                                  "its constructor", SamplerTypeError)
        if not isinstance(self.sampler, Sampler):
            raise SamplerTypeError(f"{self.name}(data_source, data_config) returned {type(self.sampler).__name__}, "
                                   f"not a torch.utils.data.Sampler")
        self.observes = callable(getattr(self.sampler, "update", None))
        self.stateful = callable(getattr(self.sampler, "state_dict", None)) and \
            callable(getattr(self.sampler, "load_state_dict", None))
        if self.observes and not self.stateful:
            log(f"[pfppo] warning: SamplerResumeError ahead: the curriculum sampler {self.name} has update() but no "
                f"state_dict() / load_state_dict(); a checkpoint of this run cannot be resumed exactly and resuming "
                f"it will be refused. Add both methods to resume")
        self._row_index = {}
        for i, s in enumerate(samples):
            self._row_index.setdefault(s.row, i)
        self.epoch, self.offset = 0, 0
        self._epoch_streams = self._streams
        self._it: Iterator | None = None
        self._digest_src = None

    # a call into the user's code, inside the private streams; its exceptions named
    def _call(self, fn: Callable[[], Any], what: str, error: type = SamplerError) -> Any:
        with _swapped(self._streams):
            try:
                out = fn()
            except StopIteration:
                raise
            except SamplerError:
                raise
            except Exception as e:  # the user's code: reported with its type and where it was called
                raise error(f"{self.name}: {what} raised {type(e).__name__}: {e}") from e
            self._streams = _capture()
        return out

    @property
    def rows_per_pass(self) -> int:
        """Prompts this rank draws in one pass (the sampler's len() when it has one, else the rows)."""
        n = len(self.samples)
        if callable(getattr(self.sampler, "__len__", None)):
            n = self._call(lambda: len(self.sampler), "__len__")
        return max(1, -(-n // self.dp_size))

    def _start_epoch(self) -> None:
        self._epoch_streams = self._streams
        self._it = self._call(lambda: iter(self.sampler), "__iter__")

    def _next_index(self) -> int:
        if self._it is None:
            self._start_epoch()
        try:
            raw = self._call(lambda: next(self._it), "__next__")
        except StopIteration:
            if self.offset == 0:
                raise SamplerDryError(f"{self.name}: pass {self.epoch} over {len(self.samples)} rows yielded no "
                                      f"index; a sampler must yield at least one index per pass") from None
            self.epoch, self.offset = self.epoch + 1, 0
            self._start_epoch()
            return self._next_index()
        index = self._check_index(raw)
        self.offset += 1
        return index

    def _check_index(self, raw: Any) -> int:
        value = raw
        if isinstance(raw, torch.Tensor) and raw.numel() == 1 or isinstance(raw, np.ndarray) and raw.size == 1:
            value = raw.item()
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise SamplerIndexError(f"{self.name} yielded {raw!r} ({type(raw).__name__}) at pass {self.epoch}, "
                                    f"position {self.offset}: it must yield int row indices")
        value = int(value)
        if not 0 <= value < len(self.samples):
            raise SamplerIndexError(f"{self.name} yielded index {value} at pass {self.epoch}, position "
                                    f"{self.offset}: the training rows are 0..{len(self.samples) - 1}")
        return value

    def next_batch(self, n: int) -> list[Sample]:
        """n prompts for this rank: slice dp_rank of the next n * dp_size indices."""
        idx = [self._next_index() for _ in range(n * self.dp_size)]
        return [self.samples[i] for i in idx[self.dp_rank * n: (self.dp_rank + 1) * n]]

    def observe(self, rows: list[Sample], scores: torch.Tensor, rewards: torch.Tensor, step: int) -> None:
        """A curriculum's update with the step's rows (all ranks'); nothing for a plain sampler."""
        if not self.observes:
            return
        missing = [s.row for s in rows if s.row not in self._row_index]
        if missing:
            raise SamplerIndexError(f"{self.name}: the step's rows {missing[:3]} are not training rows")
        batch = feedback_batch([self._row_index[s.row] for s in rows], rows, scores, rewards, step)
        self._call(lambda: self.sampler.update(batch), "update(batch)")

    # ------------------------------------------------------------------ checkpoint state

    def digest(self) -> str:
        from pfppo_mega.data.files import FilePrompts  # the same content digest as plain files
        if self._digest_src is None:
            self._digest_src = FilePrompts(self.samples, seed=0, shuffle=False)
        return self._digest_src.digest()

    def state_dict(self) -> dict[str, Any]:
        own = self._call(lambda: self.sampler.state_dict(), "state_dict()") if self.stateful else None
        return {"epoch": self.epoch, "offset": self.offset, "rows": len(self.samples), "digest": self.digest(),
                "sampler": self.name, "sampler_state": own, "curriculum": self.observes,
                "streams": self._streams, "epoch_streams": self._epoch_streams}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or "sampler" not in state:
            raise SamplerResumeError(f"data position {str(state)[:120]!r} was not written with a sampler; this run "
                                     f"uses {self.name} (data.sampler_path): resume with the sampler it was "
                                     f"written with, or start a new logging.output_dir")
        if state["sampler"] != self.name:
            raise SamplerResumeError(f"the checkpoint's prompts were drawn by {state['sampler']}, this run's by "
                                     f"{self.name}: resume with the same data.sampler_path / data.sampler_class")
        if state.get("rows") != len(self.samples) or state.get("digest") != self.digest():
            raise DataError(f"data.train_files: the training rows changed since this checkpoint was written "
                            f"({state.get('rows')} rows -> {len(self.samples)}, or their content); the sampler's "
                            f"indices would name other prompts. Resume with the files it was written with")
        epoch, offset = state["epoch"], state["offset"]
        if not (type(epoch) is int and type(offset) is int and epoch >= 0 and offset >= 0):
            raise DataError(f"data position epoch={epoch!r} offset={offset!r}: must be ints >= 0")
        if self.stateful:
            self._call(lambda: self.sampler.load_state_dict(state["sampler_state"]), "load_state_dict()")
            self._streams, self.epoch, self.offset = state["streams"], epoch, offset
            self._epoch_streams = state["epoch_streams"]
            self._it = self._call(lambda: iter(self.sampler), "__iter__")
            return
        if self.observes:
            raise SamplerResumeError(f"the curriculum sampler {self.name} has update() but no state_dict() / "
                                     f"load_state_dict(): what it learnt in {epoch} pass(es) and {offset} draws "
                                     f"cannot be restored, so this run would draw other prompts than the one that "
                                     f"wrote the checkpoint. Add both methods to the sampler, or start a new "
                                     f"logging.output_dir")
        # replay the epoch from its start and skip what was drawn
        self._streams, self.epoch, self.offset = state["epoch_streams"], epoch, 0
        self._start_epoch()
        for _ in range(offset):
            try:
                self._check_index(self._call(lambda: next(self._it), "__next__"))
            except StopIteration:
                raise SamplerResumeError(f"{self.name}: replaying pass {epoch} stopped after {self.offset} of the "
                                         f"{offset} indices the checkpoint had drawn; the sampler's order is not "
                                         f"a function of its seed") from None
            self.offset += 1


__all__ = ["SampledPrompts", "SamplerDryError", "SamplerError", "SamplerIndexError", "SamplerLoadError",
           "SamplerResumeError", "SamplerTypeError", "feedback_batch", "load_sampler_class"]
