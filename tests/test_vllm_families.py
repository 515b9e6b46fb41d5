"""The vLLM engine on every supported model family, fed our weights through the trainer's refit path.

Families (tiny random checkpoints built with transformers, head_dim 32, see
tests/vllm_families_run.py): Llama (plain RoPE), Llama with llama3 RoPE scaling (sequences of 48
tokens, original context 24), Llama with linear RoPE scaling (tied), Qwen2 (q/k/v biases, tied),
Qwen3 (q/k RMSNorm, head_dim 32 != 64 / 4, tied), Mistral (head_dim 32 != 96 / 4, no sliding
window). Each engine is started from checkpoint A and then refitted, by EngineSync.refit_live
from a megatron actor holding checkpoint B: what it generates must be B's distribution. Last, the
PPO trainer itself runs two steps with ``actor_rollout.engine: vllm`` on a tied Qwen3.

All families run in one subprocess (vLLM's in-process distributed state is process-global and
must not meet the megatron worlds other test modules create here); its figures are checked here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pfppo_mega.rollout import vllm as rvllm

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from vllm_families_run import FAMILIES  # noqa: E402

NEEDS_VLLM = pytest.mark.skipif(bool(rvllm.unavailable_reason()), reason=rvllm.unavailable_reason() or "-")
LOGP_TOL = 1e-4  # nats; fp32 engine vs fp32 trainer / fp64 transformers (measured ~1e-5)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("vllm-families") / "results.json"
    # this checkout's package, not whichever one the environment installed
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parent))
    proc = subprocess.run([sys.executable, str(HERE / "vllm_families_run.py"), str(out)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-3000:] + proc.stderr[-6000:]
    data = json.loads(out.read_text())
    print(f"\n[vllm families] {len(FAMILIES)} families and the trainer in {data['_total_s']:.0f} s (after imports)")
    return data


def _family(results: dict, family: str) -> dict:
    res = results[family]
    assert "error" not in res, f"{family}: {res.get('error')}\n{res.get('traceback', '')}"
    return res


@NEEDS_VLLM
@pytest.mark.parametrize("family", list(FAMILIES))
def test_engine_logprobs_match_trainer_and_transformers(results, family):
    """Log-probs (T = 1 and 0.7) of the tokens vLLM sampled: vLLM vs the trainer's recomputation
    (forward_logp_entropy on the megatron actor) and vs transformers fp64 on the same weights B.
    Had the refit missed a tensor (or vLLM kept A's weights anywhere), the gap would be O(1)."""
    res = _family(results, family)
    a, b, c = res["vllm_vs_trainer"], res["vllm_vs_hf64"], res["trainer_vs_hf64"]
    print(f"\n[{family}] {res['seq_len']} positions, {a['tokens']} tokens, engine start {res['start_s']:.1f} s: "
          f"vLLM vs trainer max {a['max']:.1e} mean {a['mean']:.1e}; vLLM vs HF fp64 max {b['max']:.1e} "
          f"mean {b['mean']:.1e}; trainer vs HF fp64 max {c['max']:.1e}")
    assert a["tokens"] >= 300
    assert a["max"] < LOGP_TOL and b["max"] < LOGP_TOL and c["max"] < LOGP_TOL


@NEEDS_VLLM
@pytest.mark.parametrize("family", [f for f in FAMILIES if "rope_parameters" in FAMILIES[f][2]])
def test_scaled_rope_acts_in_the_engine(results, family):
    """The same weights under plain RoPE give other log-probs: the scaling, not only the
    positions below original_max_position_embeddings, is what the parity above tests."""
    res = _family(results, family)
    assert res["rope"] == FAMILIES[family][2]["rope_parameters"]["rope_type"]
    if res["rope"] == "llama3":
        assert res["seq_len"] > 1.5 * res["rope_orig"]
    print(f"\n[{family}] vLLM vs the same weights under plain RoPE (HF fp64): max {res['vllm_vs_plain_rope_hf64_max']:.2f}")
    assert res["vllm_vs_plain_rope_hf64_max"] > 100 * LOGP_TOL, res["vllm_vs_plain_rope_hf64_max"]


@NEEDS_VLLM
@pytest.mark.parametrize("family", list(FAMILIES))
def test_refit_and_back_is_bit_identical(results, family):
    """A perturbed actor refitted in changes the sampled tokens; refitting the original weights
    back gives bit-identical tokens and log-probs (same seeds)."""
    r = _family(results, family)["refit"]
    print(f"\n[{family}] perturbed: {r['perturbed_tokens_changed']}/{r['tokens']} tokens changed; "
          f"back: tokens identical {r['back_tokens_identical']}, log-probs identical {r['back_logprobs_identical']}")
    assert r["perturbed_tokens_changed"] > r["tokens"] // 4
    assert r["back_tokens_identical"] and r["back_logprobs_identical"]
    assert r["versions"] == [2, 3]


@NEEDS_VLLM
def test_refit_carries_each_family_s_own_tensors(results):
    """The engine's layout (what refit sends) names what the family has: Qwen2's q/k/v biases,
    Qwen3's q_norm / k_norm, no lm_head when tied; buckets several per layer."""
    layouts = {f: set(_family(results, f)["layout"]) for f in FAMILIES}
    assert "model.layers.1.self_attn.q_proj.bias" in layouts["qwen2"]
    assert {"model.layers.0.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight"} <= layouts["qwen3"]
    for family, names in layouts.items():
        has_bias = any(n.endswith(".bias") for n in names)
        assert has_bias == (family == "qwen2"), family
        assert any("q_norm" in n for n in names) == (family == "qwen3"), family
        assert ("lm_head.weight" in names) == (not FAMILIES[family][2]["tie_word_embeddings"]), family
        assert _family(results, family)["buckets"] >= 10, family


@pytest.mark.parametrize("change, key", [
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}}, "rope_type = 'dynamic'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0}}, "rope_type = 'yarn'"),
    ({"sliding_window": 16}, "sliding_window = 16"),
    ({"attention_bias": True}, "attention_bias = True"),
    # the trainer takes it; vLLM's Qwen2 would build heads of hidden / heads = 16 from it
    ({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "num_attention_heads": 4,
      "num_key_value_heads": 2, "head_dim": 32}, "head_dim = 32 with model_type 'qwen2'.*only head_dim = .* = 16"),
])
def test_unsupported_checkpoint_is_refused_before_vllm_starts(tmp_path, change, key):
    """What the trainer cannot match is refused by the engine at construction, naming the key and
    value, before any vLLM engine (or import) happens: never a silent approximation."""
    from pfppo_mega.families import ModelDirError

    cfg = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 96, "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
           "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "sliding_window": None,
           "hidden_act": "silu", **change}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    if rvllm.unavailable_reason():
        pytest.skip(rvllm.unavailable_reason())
    with pytest.raises(ModelDirError, match=key):
        rvllm.VLLMEngine(tmp_path, pad_token_id=0)


@NEEDS_VLLM
def test_trainer_with_vllm_engine_on_tied_qwen3(results):
    """The PPO trainer with actor_rollout.engine: vllm on a tied Qwen3 (q/k RMSNorm, head_dim 32 !=
    64 / 4): two steps, the engine's sampling log-probs match the trainer's recomputation after
    each refit (rollout/logp_gap_max, on-policy rows)."""
    res = results["trainer_qwen3"]
    assert "error" not in res, f"{res.get('error')}\n{res.get('traceback', '')}"
    print(f"\n[trainer, qwen3, engine vllm] logp gap per step: max {res['logp_gap_max']} mean {res['logp_gap_mean']}")
    assert res["steps"] == 2
    assert all(0 <= g < LOGP_TOL for g in res["logp_gap_max"])
