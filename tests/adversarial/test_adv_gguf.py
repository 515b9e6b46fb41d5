"""Damaged GGUF files (issue 40): `pfppo import-gguf` wrote a checkpoint from them and exited 0, or
ended in a bare TypeError from the tokenizers library. Each must now be refused by name (the file,
the tensor or metadata key, the rule), exit 2, and leave nothing at the output directory.

Every case starts from one valid tiny Llama GGUF (tests/test_gguf.py's writer: llama.cpp's names,
permuted q/k, tokenizer and template) and damages it the way a bad converter, a hand edit or a
broken download would: tensor offsets patched in the header, metadata values patched in place, a
weight made NaN / Inf, a tensor left out, a merge entry edited to the same length.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
import types
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch

if importlib.util.find_spec("gguf") is None:
    pytest.skip("package gguf absent (it is in requirements.lock: make setup installs it)", allow_module_level=True)

import gguf  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_gguf import SPM_TOKENS, VOCAB, _random_llama, spm_vocab, write_gguf  # noqa: E402

from pfppo_mega.models import gguf as gg  # noqa: E402

torch.set_num_threads(1)


# ----------------------------------------------------------------------------- damage


def _set_meta(key: str, value) -> Callable[[Path], None]:
    """Overwrite metadata scalar `key` in place (same type, so the layout does not move)."""
    def damage(path: Path) -> None:
        field = gguf.GGUFReader(str(path)).fields[key]
        part = field.parts[-1]
        pos = field.offset + sum(int(p.nbytes) for p in field.parts[:-1])
        data = bytearray(path.read_bytes())
        data[pos:pos + part.nbytes] = np.array([value], dtype=part.dtype).tobytes()
        path.write_bytes(bytes(data))
    return damage


def _set_offset(name: str, offset: Callable[[gguf.GGUFReader], int]) -> Callable[[Path], None]:
    """Point tensor `name`'s data at another place (offset relative to the data section)."""
    def damage(path: Path) -> None:
        r = gguf.GGUFReader(str(path))
        t = next(t for t in r.tensors if t.name == name)
        pos = t.field.offset + sum(int(p.nbytes) for p in t.field.parts[:5])
        value = offset(r)
        data = bytearray(path.read_bytes())
        data[pos:pos + 8] = np.array([value], dtype=np.uint64).tobytes()
        path.write_bytes(bytes(data))
    return damage


def _offset_of(name: str) -> Callable[[gguf.GGUFReader], int]:
    return lambda r: next(t for t in r.tensors if t.name == name).data_offset - r.data_offset


def _replace(old: bytes, new: bytes) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        data = path.read_bytes()
        assert data.count(old) == 1 and len(old) == len(new)
        path.write_bytes(data.replace(old, new))
    return damage


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:-64])


def _written(edit_state: Callable[[dict], None] = lambda sd: None, *, qtype: str = "F32", layers: int = 2):
    """A file written from a model whose state dict `edit_state` changed (a weight poisoned, a tensor
    dropped); `layers` is what the metadata says (block_count)."""
    def make(path: Path) -> None:
        model = _random_llama(tied=True)
        sd = {k: v.clone() for k, v in model.state_dict().items()}
        edit_state(sd)
        proxy = types.SimpleNamespace(config=model.config.__class__(**{**model.config.to_dict(),
                                                                      "num_hidden_layers": layers}),
                                      state_dict=lambda: sd)
        write_gguf(path, proxy, qtype=qtype)
    return make


def _poison(name: str, value: float) -> Callable[[dict], None]:
    def edit(sd: dict) -> None:
        sd[name][0, 1] = value
    return edit


# (id, damage of the valid file or None with a maker instead, maker, fragments the message must hold)
CASES = [
    ("overlapping_tensors", _set_offset("blk.0.ffn_norm.weight", _offset_of("blk.0.attn_norm.weight")), None,
     ("tensors blk.0.", "overlap", "attn_norm.weight", "ffn_norm.weight")),
    ("data_past_the_end", _set_offset("output_norm.weight", lambda r: len(r.data) - r.data_offset - 16), None,
     ("runs past the end of the file",)),
    ("truncated_file", _truncate, None, ("runs past the end of the file",)),
    ("vocab_size_vs_embedding_rows", _set_meta("llama.vocab_size", VOCAB + 5), None,
     ("tensor token_embd.weight", f"[{VOCAB}, 64]", f"vocab {VOCAB + 5} from llama.vocab_size")),
    ("feed_forward_length_vs_tensors", _set_meta("llama.feed_forward_length", 96), None,
     ("tensor blk.0.ffn_gate.weight", "ffn 96 from llama.feed_forward_length")),
    ("block_count_beyond_layers", _set_meta("llama.block_count", 3), None,
     ("llama.block_count = 3", "layer(s) [2] have no tensors")),
    ("block_count_short_of_layers", _set_meta("llama.block_count", 1), None,
     ("layer(s) [1]", "llama.block_count = 1")),
    ("layer_tensor_missing", None, _written(lambda sd: sd.pop("model.layers.1.mlp.up_proj.weight")),
     ("tensor(s) blk.1.ffn_up.weight missing",)),
    ("norm_missing", None, _written(lambda sd: sd.pop("model.norm.weight")), ("output_norm.weight missing",)),
    ("nan_weight", None, _written(_poison("model.layers.1.mlp.down_proj.weight", float("nan"))),
     ("tensor blk.1.ffn_down.weight (F32)", "1 non-finite values")),
    ("inf_weight_f16", None, _written(_poison("model.layers.0.self_attn.o_proj.weight", float("inf")), qtype="F16"),
     ("tensor blk.0.attn_output.weight (F16)", "non-finite")),
    ("merge_without_space", _replace(b"\x03\x00\x00\x00\x00\x00\x00\x00h e", b"\x03\x00\x00\x00\x00\x00\x00\x00h_e"),
     None, ("tokenizer.ggml.merges entry 1 = 'h_e'", "two tokens separated by one space")),
    ("merge_outside_vocab", _replace(b"\x03\x00\x00\x00\x00\x00\x00\x00h e", b"\x03\x00\x00\x00\x00\x00\x00\x00h x"),
     None, ("tokenizer.ggml.merges entry 1 = 'h x'", "'hx', which is not in tokenizer.ggml.tokens")),
]


@pytest.fixture(scope="module")
def valid(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("adv_gguf") / "ok.gguf"
    write_gguf(path, _random_llama(tied=True))
    return path


def test_the_valid_file_imports(valid, tmp_path):
    assert gg.main([str(valid), str(tmp_path / "hf")]) == 0 and (tmp_path / "hf" / "model.safetensors").is_file()


@pytest.mark.parametrize("name,damage,make,said", CASES, ids=[c[0] for c in CASES])
def test_a_damaged_gguf_is_refused_by_name(valid, tmp_path, capsys, name, damage, make, said):
    src = tmp_path / f"{name}.gguf"
    if make is not None:
        make(src)
    else:
        shutil.copy(valid, src)
        damage(src)
    out = tmp_path / "hf"
    assert gg.main([str(src), str(out)]) == 2, f"{name}: imported (exit 0)"
    err = capsys.readouterr().err
    assert err.startswith(f"pfppo import-gguf: {src}: "), err
    for fragment in said:
        assert fragment in err, (fragment, err)
    assert not out.exists() and not list(tmp_path.glob(".hf.*")), "something was written"


# A hostile user's second round (issue 40's follow-up): metadata numbers that no model has were read
# with int() / float() as they came: a head count of 0 ended in ZeroDivisionError, a block count of
# 10**9 in MemoryError (or the OOM killer) while listing the absent layers, and a NaN RoPE base, a
# negative norm epsilon or a context of 0 were written into config.json with exit 0; a token listed
# twice was imported (exit 0) and a token that is not UTF-8 refused without the file's name.
SECOND = [
    ("head_count_zero", _set_meta("llama.attention.head_count", 0),
     ("metadata llama.attention.head_count = 0: must be a positive integer",)),
    ("block_count_huge", _set_meta("llama.block_count", 10**9),
     ("llama.block_count = 1000000000", "layer(s) [2, 3, 4, 5, 6] ... have no tensors")),
    ("rope_base_nan", _set_meta("llama.rope.freq_base", float("nan")),
     ("metadata llama.rope.freq_base = nan: must be a finite number > 0",)),
    ("norm_eps_negative", _set_meta("llama.attention.layer_norm_rms_epsilon", -1.0),
     ("metadata llama.attention.layer_norm_rms_epsilon = -1.0: must be a finite number > 0",)),
    ("context_length_zero", _set_meta("llama.context_length", 0),
     ("metadata llama.context_length = 0: must be a positive integer",)),
    # a token listed twice: imported with exit 0, "b" gone from the byte-level vocabulary (unencodable)
    ("token_twice", _replace(b"\x01\x00\x00\x00\x00\x00\x00\x00b", b"\x01\x00\x00\x00\x00\x00\x00\x00a"),
     ("tokenizer.ggml.tokens lists 'a' twice (ids",)),
    # a token that is not UTF-8: refused, but without the file's name
    ("token_not_utf8", _replace(b"\x01\x00\x00\x00\x00\x00\x00\x00b", b"\x01\x00\x00\x00\x00\x00\x00\x00\xff"),
     ("metadata key 'tokenizer.ggml.tokens' cannot be read", "utf-8")),
]


@pytest.mark.parametrize("name,damage,said", SECOND, ids=[c[0] for c in SECOND])
def test_impossible_metadata_is_refused_by_key(valid, tmp_path, capsys, name, damage, said):
    test_a_damaged_gguf_is_refused_by_name(valid, tmp_path, capsys, name, damage, None, said)


def _last_score_nan(path: Path) -> None:
    """The last entry of tokenizer.ggml.scores (a float32 array) set to NaN in place."""
    field = gguf.GGUFReader(str(path)).fields["tokenizer.ggml.scores"]
    at = field.offset + sum(int(p.nbytes) for p in field.parts[:field.data[-1]])
    data = bytearray(path.read_bytes())
    data[at:at + 4] = np.array([np.nan], dtype=np.float32).tobytes()
    path.write_bytes(bytes(data))


def test_a_sentencepiece_score_nan_is_refused(tmp_path, capsys):
    """A NaN among a SentencePiece vocabulary's scores (they order the merges) imported with exit 0,
    the merge order then arbitrary."""
    src = tmp_path / "spm.gguf"
    write_gguf(src, _random_llama(False, vocab=len(SPM_TOKENS)), vocab=spm_vocab)
    _last_score_nan(src)
    assert gg.main([str(src), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pfppo import-gguf: {src}: tokenizer.ggml.scores entry {len(SPM_TOKENS) - 1} "
                          f"(token {SPM_TOKENS[-1]!r}) = nan: must be a finite number"), err
    assert not (tmp_path / "hf").exists()
