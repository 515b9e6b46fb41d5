"""The model families users bring (pfppo_mega.families) at TP1, against transformers.

For each family a tiny random checkpoint is built here with transformers (the shapes of
tests/multirank/common.py; TP2 / PP2 run in that file's shared torchrun launch): Llama with
llama3 RoPE scaling (positions past original_max_position_embeddings), Qwen3 (q/k RMSNorm,
head_dim != hidden / heads), Mistral (explicit head_dim, a sliding window as wide as the
context), plus Llama with linear RoPE scaling here. Checked: the megatron actor's logits (fp32;
megatron-core's CPU path has no fp64 layers) vs transformers in fp64, the built-in engine's
decoder vs both, the critic trunk, the exact HF export round trip (tensors and config.json), the
planner's parameter count, and the refusal of what is not supported (key, value, what is).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

sys.path.insert(0, str(Path(__file__).resolve().parent / "multirank"))

import common  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from pfppo_mega import families, parallel  # noqa: E402
from pfppo_mega.compat import megatron_cpu  # noqa: E402
from pfppo_mega.config.tree import ModelConfig  # noqa: E402
from pfppo_mega.models import gpt, hf_io  # noqa: E402
from pfppo_mega.planning import shapes as plan_shapes  # noqa: E402
from pfppo_mega.rollout.llama import LlamaDecoder, positions_from_mask, prefill_mask  # noqa: E402

LOGITS_TOL = 2e-5  # fp32 vs fp64, as tests/test_models.py
KINDS = common.FAMILIES + ("llama_linear",)
EXPECTED = {
    "llama3": families.Architecture("llama", rope=families.RopeScaling("llama3", 4.0, 1.0, 4.0, common.ROPE_ORIG)),
    "qwen3": families.Architecture("qwen3", qk_norm=True, head_dim=24),
    "mistral": families.Architecture("mistral", head_dim=32),
    "llama_linear": families.Architecture("llama", rope=families.RopeScaling("linear", 2.0)),
}


def _hf_model(kind: str) -> torch.nn.Module:
    if kind != "llama_linear":
        return common.hf_model(kind)
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=common.VOCAB, hidden_size=common.HIDDEN, num_hidden_layers=2, num_attention_heads=common.HEADS,
        num_key_value_heads=common.KV_HEADS, intermediate_size=common.FFN, max_position_embeddings=common.MAX_POS,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}))
    common._randomise(model, seed=12)
    return model.float().eval()


@pytest.fixture(scope="module", autouse=True)
def world():
    parallel.init_parallel(tp=1, pp=1, seed=1234)
    yield
    parallel.destroy_parallel()
    megatron_cpu.disable()


@pytest.fixture(scope="module", params=KINDS)
def ckpt(request, tmp_path_factory):
    kind = request.param
    model = _hf_model(kind)
    path = tmp_path_factory.mktemp(kind)
    model.save_pretrained(path)
    ids = common.family_ids()
    with torch.no_grad():
        ref64 = model.double()(ids).logits  # [2, S, V]
        ref32 = model.float()(ids).logits.double()
    cfg, arch = common.model_config(path)
    actor = gpt.build_actor(cfg, arch=arch)
    hf_io.load_actor_from_hf(actor, path)
    return kind, path, model, cfg, arch, actor.eval(), ids, ref64, ref32


def test_architecture_read_from_config(ckpt):
    kind, path, *_ = ckpt
    arch = hf_io.architecture_from_hf(hf_io.read_hf_config(path))
    assert arch == EXPECTED[kind]


def test_actor_logits_match_transformers_fp64(ckpt):
    kind, _, _, _, arch, actor, ids, ref64, ref32 = ckpt
    with torch.no_grad():
        ours = gpt.actor_logits(actor, ids).double()
    err = (ours - ref64).abs().max().item()
    hf_err = (ref32 - ref64).abs().max().item()
    print(f"\n[{kind} tp1] logits max |megatron fp32 - HF fp64| = {err:.2e} (HF fp32 vs fp64 {hf_err:.2e}; "
          f"scale {ref64.abs().max().item():.1f}; {ids.shape[1]} positions)")
    assert ref64.abs().max() > 1.0
    assert err < LOGITS_TOL and err <= 4 * hf_err + 1e-6


def test_rope_scaling_is_exercised(ckpt):
    """Unscaled RoPE must give visibly different logits past the original context: the parity
    above is a test of the scaling, not of positions where it does not act."""
    kind, path, _, cfg, arch, _, ids, ref64, _ = ckpt
    if arch.rope.rope_type == "default":  # unscaled family: the model must carry the plain frequencies
        rotary = gpt.unwrap(ckpt[5]).rotary_pos_emb
        head_dim = arch.head_dim_of(cfg.hidden_size, cfg.num_attention_heads)
        plain_freq = families.rope_inv_freq(head_dim, cfg.rope_theta)
        assert torch.equal(rotary.inv_freq.float().cpu(), plain_freq), kind
        return
    plain = gpt.build_actor(cfg, arch=families.Architecture(arch.family, arch.qkv_bias, arch.qk_norm, arch.head_dim))
    with torch.no_grad():
        for p, q in zip(plain.parameters(), ckpt[5].parameters()):
            p.copy_(q)
        wrong = gpt.actor_logits(plain.eval(), ids).double()
    assert (wrong - ref64).abs().max().item() > 100 * LOGITS_TOL


def test_engine_decoder_matches_trainer_and_transformers(ckpt):
    """The built-in engine's pure-torch decoder, loaded with the checkpoint's tensors: its
    log-probs vs the trainer's (megatron) and vs transformers' fp64 logits."""
    kind, path, _, _, _, actor, ids, ref64, _ = ckpt
    shape = families.DecoderShape.from_hf_config(hf_io.read_hf_config(path))
    decoder = LlamaDecoder(shape)
    decoder.load_state_dict(hf_io.load_hf_state_dict(path), strict=True)
    valid = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        engine = decoder(ids, positions_from_mask(valid), prefill_mask(valid)).double()
        trainer = gpt.actor_logits(actor, ids).double()
    logp_engine, logp_trainer = engine.log_softmax(-1), trainer.log_softmax(-1)
    gap = (logp_engine - logp_trainer).abs().max().item()
    err = (engine - ref64).abs().max().item()
    print(f"\n[{kind}] engine vs trainer log-probs max |diff| = {gap:.2e}; engine logits vs HF fp64 {err:.2e}")
    assert err < LOGITS_TOL and gap < 2 * LOGITS_TOL


def test_critic_trunk_loads(ckpt):
    _, path, _, cfg, arch, actor, *_ = ckpt
    critic = gpt.build_critic(cfg, arch=arch)
    hf_io.load_critic_trunk_from_hf(critic, path)
    trunk = dict(hf_io.gather_critic_weights(critic, cfg))
    for name, t in hf_io.gather_hf_weights(actor, cfg):
        if name != "lm_head.weight":
            assert torch.equal(trunk[name], t), name


def test_export_round_trip_is_exact(ckpt, tmp_path):
    from transformers import AutoModelForCausalLM

    kind, path, model, cfg, arch, actor, ids, _, _ = ckpt
    out = hf_io.export_hf(actor, cfg, tmp_path / "export")
    original, exported = load_file(str(path / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[n], original[n]) for n in original)
    written = json.loads((out / "config.json").read_text())
    assert hf_io.architecture_from_hf(written) == arch
    assert hf_io.model_config_from_hf(written, ModelConfig()) == cfg
    reread = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reread) is type(model)
    with torch.no_grad():
        assert torch.equal(reread.float()(ids).logits, model.float()(ids).logits)


def test_planner_counts_the_parameters(ckpt):
    _, _, model, cfg, arch, actor, *_ = ckpt
    shape = families.DecoderShape.from_model_config(cfg, arch)
    hf_params = sum(p.numel() for p in model.parameters())  # tied weights counted once
    assert plan_shapes.total_param_count(shape) == hf_params == sum(p.numel() for p in actor.parameters())
    assert plan_shapes.param_shapes(shape, 1, 1, 0) == {n: tuple(p.shape) for n, p in actor.named_parameters()}


def test_qwen2_biases_are_one_shape_for_builder_planner_and_engine():
    """Qwen2's q/k/v biases, from one DecoderShape: the megatron actor's parameters, the planner's
    shapes and count, and the HF tensors of transformers' model and of the built-in engine."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hf = dict(vocab_size=common.VOCAB, hidden_size=common.HIDDEN, num_hidden_layers=2, num_attention_heads=common.HEADS,
              num_key_value_heads=common.KV_HEADS, intermediate_size=common.FFN, max_position_embeddings=common.MAX_POS,
              rms_norm_eps=1e-5, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(Qwen2Config(**hf))
    shape = families.DecoderShape.from_hf_config(model.config.to_dict())
    cfg = hf_io.model_config_from_hf(model.config.to_dict(), ModelConfig())
    assert shape.arch.qkv_bias and shape == families.DecoderShape.from_model_config(cfg, shape.arch)
    actor = gpt.build_actor(cfg, arch=shape.arch)
    assert plan_shapes.param_shapes(shape, 1, 1, 0) == {n: tuple(p.shape) for n, p in actor.named_parameters()}
    assert plan_shapes.total_param_count(shape) == sum(p.numel() for p in model.parameters())
    assert shape.hf_shapes() == {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert shape.hf_shapes() == {n: tuple(p.shape) for n, p in LlamaDecoder(shape).named_parameters()}


def test_decoder_shape_holds_the_model_configs_shape_fields():
    assert set(families.DecoderShape.from_model_config(ModelConfig(
        num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2, vocab_size=51,
        max_position_embeddings=64, rope_theta=1e4, norm_epsilon=1e-5, tie_word_embeddings=True)).dimensions()) \
        == set(ModelConfig.SHAPE_FIELDS)
    with pytest.raises(ValueError, match=r"model config is incomplete \(unset: vocab_size, rope_theta\)"):
        families.DecoderShape.from_model_config(ModelConfig(
            num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
            max_position_embeddings=64, norm_epsilon=1e-5, tie_word_embeddings=True))


# ----------------------------------------------------------------------------- refused at load

_LLAMA = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 64}
BAD = [
    ("mistral_window", {**_LLAMA, "model_type": "mistral", "sliding_window": 16},
     ("sliding_window = 16", "max_position_embeddings = 64", "full attention")),
    ("qwen2_window", {**_LLAMA, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 32},
     ("sliding_window = 32",)),
    ("qwen3_layer_types", {**_LLAMA, "model_type": "qwen3", "layer_types": ["sliding_attention"],
                           "sliding_window": 8}, ("sliding_window = 8",)),
    ("mixtral", {**_LLAMA, "model_type": "mixtral", "num_local_experts": 8},
     ("model_type = 'mixtral'", "'llama', 'qwen2', 'qwen3', 'mistral'", "num_local_experts = 8", "mixture-of-experts")),
    ("qwen3_moe_keys", {**_LLAMA, "model_type": "qwen3", "num_experts": 64}, ("num_experts = 64",)),
    ("yarn", {**_LLAMA, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
     ("rope_type = 'yarn'", "'default', 'linear', 'llama3'")),
    ("dynamic", {**_LLAMA, "rope_scaling": {"type": "dynamic", "factor": 2.0}}, ("rope_type = 'dynamic'", "padding")),
    ("unknown_rope", {**_LLAMA, "rope_parameters": {"rope_type": "spiral"}}, ("rope_type = 'spiral'",)),
    ("llama3_no_orig", {**_LLAMA, "rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                       "high_freq_factor": 4.0}},
     ("original_max_position_embeddings = None",)),
    ("llama3_factor_text", {**_LLAMA, "rope_scaling": {"rope_type": "llama3", "factor": "8", "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}},
     ("rope factor = '8'",)),
    ("llama_attention_bias", {**_LLAMA, "attention_bias": True}, ("attention_bias = True", "o_proj", "must be false")),
    ("llama_mlp_bias", {**_LLAMA, "mlp_bias": True}, ("mlp_bias = True",)),
    ("qwen3_attention_bias", {**_LLAMA, "model_type": "qwen3", "attention_bias": True}, ("attention_bias = True",)),
    ("mistral_attention_bias", {**_LLAMA, "model_type": "mistral", "attention_bias": True}, ("attention_bias = True",)),
    ("gelu", {**_LLAMA, "hidden_act": "gelu"}, ("hidden_act = 'gelu'", "'silu'")),
    ("odd_head_dim", {**_LLAMA, "model_type": "qwen3", "head_dim": 7}, ("head_dim = 7", "even")),
    ("partial_rotary", {**_LLAMA, "partial_rotary_factor": 0.5}, ("partial_rotary_factor = 0.5",)),
]


@pytest.mark.parametrize("case,hf,fragments", BAD, ids=[b[0] for b in BAD])
def test_unsupported_architecture_refused_at_load(case, hf, fragments, tmp_path):
    """Refused by the trainer's loader, the built-in engine and a load from a directory alike."""
    full = {"num_hidden_layers": 2, "intermediate_size": 128, "num_key_value_heads": 2, "vocab_size": 51,
            "rms_norm_eps": 1e-5, **hf}
    for load in (lambda: hf_io.model_config_from_hf(full, ModelConfig()),
                 lambda: families.DecoderShape.from_hf_config(full)):
        with pytest.raises(families.ModelDirError) as e:
            load()
        missing = [f for f in fragments if f not in str(e.value)]
        assert not missing, f"{case}: {missing} not in {str(e.value)!r}"


def test_window_as_wide_as_the_context_is_accepted():
    hf = {**_LLAMA, "model_type": "mistral", "sliding_window": 64}
    assert families.architecture_from_hf(hf) == families.Architecture("mistral")
    assert families.architecture_from_hf({**hf, "sliding_window": None}) == families.Architecture("mistral")


def test_rope_inv_freq_matches_transformers():
    """families.rope_inv_freq vs transformers' own RoPE initialisation, for every supported type."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for params in ({"rope_type": "linear", "factor": 3.0},
                   {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192}):
        cfg = LlamaConfig(hidden_size=8192, num_attention_heads=64, max_position_embeddings=131072,
                          rope_parameters={**params, "rope_theta": 500000.0})
        ref, _ = ROPE_INIT_FUNCTIONS[params["rope_type"]](cfg, "cpu")
        ours = families.rope_inv_freq(128, 500000.0, families.architecture_from_hf(cfg.to_dict()).rope)
        assert torch.equal(ours, ref.float()), params["rope_type"]
