"""Where each weight of the megatron GPTModel lives in a TP x PP layout. Pure torch, no collectives.

A *full* tensor is the tp = 1 megatron tensor, named as at pp = 1 (global layer index), with the
vocabulary padded to a multiple of tp (``padded_vocab_size``). Rank ``r`` of a tensor-parallel
group of size ``tp`` holds ``shard(full, split_of(name), tp, r)``:

    ROWS        chunk r of dim 0          linear_qkv.weight / .bias, word_embeddings, output_layer
    COLUMNS     chunk r of dim 1          linear_proj, linear_fc2 (row-parallel: the input dim)
    GLU_ROWS    cat(gate chunk r, up chunk r) of linear_fc1 = [gate; up]
    REPLICATED  the whole tensor          norms, the critic's value head

linear_qkv is group-interleaved ([ng, (nh/ng + 2) * d] rows, see hf_io), so chunk r of its rows is
exactly query groups [r*ng/tp, (r+1)*ng/tp) with their query heads, key and value: the heads that
chunk r of linear_proj's input columns multiplies. The vocabulary chunk r is rows
[r*Vp/tp, (r+1)*Vp/tp) of the padded vocabulary Vp.

Pipeline stage p of pp holds layers [p*L/pp, (p+1)*L/pp) (megatron's even split, local names
decoder.layers.0 .. L/pp - 1), the embedding on stage 0, final norm and head on stage pp - 1.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

import torch
from torch import Tensor


class Split(enum.Enum):
    ROWS = "rows"
    COLUMNS = "columns"
    GLU_ROWS = "glu_rows"
    REPLICATED = "replicated"


_SPLITS: tuple[tuple[str, Split], ...] = (
    ("embedding.word_embeddings.weight", Split.ROWS),
    ("output_layer.weight", Split.ROWS),
    ("self_attention.linear_qkv.weight", Split.ROWS),
    ("self_attention.linear_qkv.bias", Split.ROWS),
    ("self_attention.linear_proj.weight", Split.COLUMNS),
    ("mlp.linear_fc1.weight", Split.GLU_ROWS),
    ("mlp.linear_fc2.weight", Split.COLUMNS),
    # LoRA adapters (models/lora.py): B of a column-parallel linear splits as its weight's rows, A of a
    # row-parallel one as its weight's columns; the other factor is replicated
    ("self_attention.linear_qkv.lora_B", Split.ROWS),
    ("mlp.linear_fc1.lora_B", Split.GLU_ROWS),
    ("self_attention.linear_proj.lora_A", Split.COLUMNS),
    ("mlp.linear_fc2.lora_A", Split.COLUMNS),
)

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def split_of(name: str) -> Split:
    """How the megatron parameter ``name`` (local or global) is split over tensor-parallel ranks."""
    for suffix, split in _SPLITS:
        if name == suffix or name.endswith("." + suffix):
            return split
    return Split.REPLICATED


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """Smallest multiple of tp >= vocab_size (VocabParallelEmbedding splits rows evenly).

    The padded rows of the embedding and LM head are zero; their logits are masked to -inf by
    pfppo_mega.kernels.vocab_parallel and they are dropped on export.
    """
    return -(-vocab_size // tp) * tp


def pad_rows(t: Tensor, rows: int) -> Tensor:
    """t [V, ...] -> [rows, ...] with zero rows appended (t itself when rows == V)."""
    if t.shape[0] == rows:
        return t
    if t.shape[0] > rows:
        raise ValueError(f"cannot pad {t.shape[0]} rows down to {rows}")
    return torch.cat([t, t.new_zeros((rows - t.shape[0],) + tuple(t.shape[1:]))])


def _chunk(t: Tensor, dim: int, tp: int, rank: int) -> Tensor:
    if t.shape[dim] % tp:
        raise ValueError(f"dim {dim} of size {t.shape[dim]} is not divisible by tp({tp})")
    return t.chunk(tp, dim=dim)[rank]


def shard(full: Tensor, split: Split, tp: int, rank: int) -> Tensor:
    """The part of ``full`` that tensor-parallel rank ``rank`` of ``tp`` holds (a view or a cat)."""
    if not 0 <= rank < tp:
        raise ValueError(f"tensor-parallel rank({rank}) must lie in [0, tp({tp}))")
    if tp == 1 or split is Split.REPLICATED:
        return full
    if split is Split.ROWS:
        return _chunk(full, 0, tp, rank)
    if split is Split.COLUMNS:
        return _chunk(full, 1, tp, rank)
    gate, up = full.chunk(2, dim=0)
    return torch.cat([_chunk(gate, 0, tp, rank), _chunk(up, 0, tp, rank)])


def shard_shape(full_shape: tuple[int, ...], split: Split, tp: int) -> tuple[int, ...]:
    """Shape of every shard of a full tensor of ``full_shape``."""
    shape = list(full_shape)
    if split in (Split.ROWS, Split.GLU_ROWS):
        shape[0] //= tp
    elif split is Split.COLUMNS:
        shape[1] //= tp
    return tuple(shape)


def unshard(shards: list[Tensor], split: Split) -> Tensor:
    """Inverse of shard: the full tensor from the shards of ranks 0 .. tp - 1, in order."""
    if len(shards) == 1 or split is Split.REPLICATED:
        return shards[0]
    if split is Split.ROWS:
        return torch.cat(shards, dim=0)
    if split is Split.COLUMNS:
        return torch.cat(shards, dim=1)
    halves = [s.chunk(2, dim=0) for s in shards]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)


def fuse_qkv(q: Tensor, k: Tensor, v: Tensor, *, heads: int, groups: int) -> Tensor:
    """[nh*d, ...], [ng*d, ...], [ng*d, ...] -> megatron linear_qkv [ng*(nh/ng + 2)*d, ...]
    (group-interleaved). Weights ([.., H]) and biases (1-D) alike."""
    rest = tuple(q.shape[1:])
    d = q.shape[0] // heads
    q = q.reshape(groups, heads // groups * d, *rest)
    k = k.reshape(groups, d, *rest)
    v = v.reshape(groups, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def split_qkv(qkv: Tensor, *, heads: int, groups: int) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of fuse_qkv: linear_qkv [ng*(nh/ng + 2)*d, ...] -> q [nh*d, ...], k, v [ng*d, ...]."""
    rest = tuple(qkv.shape[1:])
    d = qkv.shape[0] // (heads + 2 * groups)
    per_group = qkv.reshape(groups, (heads // groups + 2) * d, *rest)
    q, k, v = torch.split(per_group, [heads // groups * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)



@dataclass(frozen=True)
class Stage:
    """Pipeline stage ``index`` of ``pp`` for a model of ``num_layers`` layers."""

    index: int
    pp: int
    num_layers: int

    def __post_init__(self) -> None:
        if self.num_layers % self.pp:
            raise ValueError(f"num_layers({self.num_layers}) must be divisible by pp({self.pp})")
        if not 0 <= self.index < self.pp:
            raise ValueError(f"pipeline stage({self.index}) must lie in [0, pp({self.pp}))")

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.pp - 1

    @property
    def layer_offset(self) -> int:
        return self.index * (self.num_layers // self.pp)

    @property
    def layers(self) -> range:
        """Global indices of this stage's layers."""
        per = self.num_layers // self.pp
        return range(self.layer_offset, self.layer_offset + per)

    def to_global(self, name: str) -> str:
        """decoder.layers.<local>.x -> decoder.layers.<global>.x; other names unchanged."""
        m = _LAYER.match(name)
        return f"decoder.layers.{int(m.group(1)) + self.layer_offset}.{m.group(2)}" if m else name

    def to_local(self, name: str) -> str:
        m = _LAYER.match(name)
        if not m:
            return name
        i = int(m.group(1))
        if i not in self.layers:
            raise ValueError(f"{name!r} is not on pipeline stage {self.index} (layers {self.layers})")
        return f"decoder.layers.{i - self.layer_offset}.{m.group(2)}"
