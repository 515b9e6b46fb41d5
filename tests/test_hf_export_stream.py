"""The HF export streams: one unit (embedding, a decoder layer, final norm + head) at a time
reaches the writer, which fills safetensors shards of at most max_shard_bytes (a larger tensor
alone) and writes model.safetensors.index.json; the import reads the sharded export back exactly
(transformers too). The multi-rank export (TP2, PP2, TP2xPP2, sent to rank 0 unit by unit) is
checked by tests/multirank/checks.py (export_sharded_exact)."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from pfppo_mega import parallel
from pfppo_mega.compat import megatron_cpu
from pfppo_mega.config.tree import ModelConfig
from pfppo_mega.models import gpt, hf_io


@pytest.fixture(scope="module", autouse=True)
def parallel_world():
    info = parallel.init_parallel(tp=1, pp=1, seed=1234)
    yield info
    parallel.destroy_parallel()
    megatron_cpu.disable()


def test_a_sharded_export_streams_unit_by_unit_and_reads_back_exactly(tmp_path, monkeypatch):
    cfg = LlamaConfig(vocab_size=48, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64,
                      tie_word_embeddings=False)
    torch.manual_seed(3)
    model = LlamaForCausalLM(cfg).eval()
    src = tmp_path / "src"
    model.save_pretrained(src)
    mcfg = hf_io.model_config_from_hf(hf_io.read_hf_config(src), ModelConfig())
    actor = gpt.build_actor(mcfg)
    hf_io.load_actor_from_hf(actor, src)
    limit = 40_000  # bytes: a decoder layer's tensors (fp32) span several shards
    held, largest = [], 0
    real_add = hf_io._ShardWriter.add

    def add(self, name, t):
        nonlocal largest
        real_add(self, name, t)
        largest = max(largest, t.numel() * t.element_size())
        held.append(self.size)  # bytes the writer holds on the host after this tensor

    monkeypatch.setattr(hf_io._ShardWriter, "add", add)
    units = []
    real_units = hf_io._export_units

    def count_units(*a, **k):
        for u in real_units(*a, **k):
            units.append(sorted(u[1]))
            yield u

    monkeypatch.setattr(hf_io, "_export_units", count_units)
    out = hf_io.export_hf(actor, mcfg, tmp_path / "export", max_shard_bytes=limit)
    assert len(units) == 3 + 2  # embedding, 3 layers, final norm + head: one unit at a time
    assert max(held) <= max(limit, largest)  # never more than one shard (or one tensor) on the host
    index = json.loads((out / hf_io.INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3 and all(f.endswith(f"-of-{len(files):05d}.safetensors") for f in files)
    assert not (out / hf_io.SINGLE_FILE).exists() and not list(out.glob(".shard-*"))
    original = load_file(str(src / "model.safetensors"))
    exported = hf_io.load_hf_state_dict(out)  # the import side reads shards + index
    assert sorted(exported) == sorted(original) and sorted(index["weight_map"]) == sorted(original)
    assert all(torch.equal(exported[n], t) for n, t in original.items())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in original.values())
    reread = LlamaForCausalLM.from_pretrained(out).eval()  # and transformers does too
    ids = torch.arange(10).reshape(2, 5)
    with torch.no_grad():
        assert torch.equal(reread(ids).logits, model(ids).logits)
    # under the limit: one model.safetensors, no index, as before
    small = hf_io.export_hf(actor, mcfg, tmp_path / "one")
    assert (small / hf_io.SINGLE_FILE).is_file() and not (small / hf_io.INDEX_FILE).exists()
