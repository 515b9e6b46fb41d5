"""Pieces shared by tests/test_parallel.py (the serial TP1 reference, in the pytest process) and
tests/multirank/checks.py (every parallel layout, under torchrun): tiny checkpoints, one PPO batch,
one PPO update. Imports only torch, transformers, safetensors and pfppo_mega."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from pfppo_mega import ppo
from pfppo_mega.config.tree import ModelConfig
from pfppo_mega.trainer.batch import PackedInputs, pack

# Tiny shapes that every tested layout can split: 4 heads, 2 query groups, ffn 128 (tp = 2),
# 4 layers (pp = 2). VOCAB is odd, so tp = 2 pads the vocabulary to 52.
VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, MAX_POS = 51, 64, 4, 4, 2, 128, 64
CHECKPOINTS = ("llama", "qwen2")  # llama: untied; qwen2: tied + q/k/v biases
# The other families (pfppo_mega.families), checked for logits and exact export at every layout:
# llama3: RoPE scaling llama3 with original_max_position_embeddings ROPE_ORIG < FAMILY_SEQ, so the
# scaled and the ramped frequency bands both act; qwen3: q/k RMSNorm and head_dim 24 != 64 / 4,
# tied; mistral: explicit head_dim 32 and a sliding window as wide as the context (full attention).
FAMILIES = ("llama3", "qwen3", "mistral")
ROPE_ORIG, FAMILY_SEQ = 32, 48
TEMPERATURE = 0.8
BATCH = 8
LR, WEIGHT_DECAY, GRAD_CLIP, ADAM_EPS = 1e-3, 0.01, 1.0, 1e-6
# world size -> (name, tp, pp, micro_batch_size). B = 8: tp2 runs 4 micro-batches, pp2 3 of which the
# last is padded, dp2 4 rows per rank in micro-batches of 3 and 1. The serial reference runs one
# micro-batch of 8 rows at tp = pp = dp = 1.
LAYOUTS = {
    2: [("tp2", 2, 1, 2), ("pp2", 1, 2, 3), ("dp2", 1, 1, 3)],
    4: [("tp2pp2", 2, 2, 3)],
}
CLIP_LOW, CLIP_HIGH, VALUE_CLIP, ENTROPY_COEFF = 0.2, 0.28, 0.2, 0.01


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Larger-than-init weights so logits are O(1) and a layout error cannot hide in small numbers."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))


def hf_model(kind: str) -> torch.nn.Module:
    """The transformers model behind checkpoint ``kind`` (fp32, eval)."""
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

    shape = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                 num_key_value_heads=KV_HEADS, intermediate_size=FFN, max_position_embeddings=MAX_POS,
                 rms_norm_eps=1e-5)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**shape, rope_theta=5000.0, tie_word_embeddings=False))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**shape, rope_theta=10000.0, tie_word_embeddings=True))
    elif kind == "llama3":
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": ROPE_ORIG}
        model = LlamaForCausalLM(LlamaConfig(**shape, rope_parameters=rope, tie_word_embeddings=False))
    elif kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**shape, head_dim=24, rope_theta=20000.0, tie_word_embeddings=True))
    elif kind == "mistral":
        model = MistralForCausalLM(MistralConfig(**shape, head_dim=32, sliding_window=MAX_POS, rope_theta=10000.0,
                                                 tie_word_embeddings=False))
    else:
        raise ValueError(kind)
    _randomise(model, seed={"llama": 7, "qwen2": 8, "llama3": 9, "qwen3": 10, "mistral": 11}[kind])
    return model.float().eval()


REFERENCES = "references.safetensors"


def make_checkpoints(root: Path) -> dict[str, Path]:
    """root/<kind> for each checkpoint and family, and root/references.safetensors with
    transformers' fp64 outputs (so the rank processes need not import transformers): on
    ppo_batch(), logits/<kind> [B, S, V], logp/<kind> and entropy/<kind> [B, T] at TEMPERATURE;
    for the FAMILIES, logits/<kind> [2, FAMILY_SEQ, V] of family_ids()."""
    import torch.nn.functional as F
    from safetensors.torch import save_file

    out, refs = {}, {}
    inp = ppo_batch().inputs
    for kind in CHECKPOINTS + FAMILIES:
        path = root / kind
        model = hf_model(kind)
        model.save_pretrained(path)
        out[kind] = path
        with torch.no_grad():  # the families: logits of family_ids() [2, FAMILY_SEQ, V] only
            logits = model.double()(family_ids() if kind in FAMILIES else inp.input_ids).logits  # [B, S, V]
        refs[f"logits/{kind}"] = logits
        if kind in FAMILIES:
            continue
        sel = logits.gather(1, inp.resp_pos[..., None].expand(-1, -1, logits.shape[-1])) / TEMPERATURE
        logq = F.log_softmax(sel, dim=-1)  # [B, T, V]
        refs[f"logp/{kind}"] = logq.gather(2, inp.labels[..., None])[..., 0]
        refs[f"entropy/{kind}"] = -(logq.exp() * logq).sum(-1)
    save_file({k: v.contiguous() for k, v in refs.items()}, str(root / REFERENCES))
    return out


def tp1_world(root: Path):
    """Generator for a pytest module fixture: a TP1 megatron world for the module, and the
    CHECKPOINTS saved under root by kind (no references)."""
    from pfppo_mega import parallel
    from pfppo_mega.compat import megatron_cpu

    parallel.init_parallel(tp=1, pp=1, seed=1234)
    for kind in CHECKPOINTS:
        hf_model(kind).save_pretrained(root / kind)
    yield {kind: root / kind for kind in CHECKPOINTS}
    parallel.destroy_parallel()
    megatron_cpu.disable()


def family_ids() -> torch.Tensor:
    """[2, FAMILY_SEQ] token ids: positions past ROPE_ORIG (llama3's original context)."""
    return torch.randint(0, VOCAB, (2, FAMILY_SEQ), generator=torch.Generator().manual_seed(31))


def model_config(path: Path):
    """(ModelConfig, Architecture) of checkpoint ``path``."""
    from pfppo_mega.models import hf_io

    hf_cfg = hf_io.read_hf_config(path)
    return hf_io.model_config_from_hf(hf_cfg, ModelConfig()), hf_io.architecture_from_hf(hf_cfg)


@dataclass
class PPOBatch:
    inputs: PackedInputs          # [B, S] / [B, T]
    logp_noise: torch.Tensor      # [B, T] old_logp = current logp + noise (some ratios leave the clip range)
    advantages: torch.Tensor      # [B, T]
    value_noise: torch.Tensor     # [B, T] old_values = current values + noise
    returns: torch.Tensor         # [B, T]

    def rows(self, start: int, stop: int) -> "PPOBatch":
        r = slice(start, stop)
        i = self.inputs
        return PPOBatch(PackedInputs(i.input_ids[r], i.attention_mask[r], i.resp_pos[r], i.labels[r],
                                     i.response_mask[r]),
                        self.logp_noise[r], self.advantages[r], self.value_noise[r], self.returns[r])


def ppo_batch() -> PPOBatch:
    """8 rows, prompts of 2..5 tokens, responses of 1..6 tokens (uneven token counts per row, so
    a wrong normalisation across micro-batches or DP ranks shows)."""
    gen = torch.Generator().manual_seed(2024)
    t = 6
    prompts = [torch.randint(1, VOCAB, (int(n),), generator=gen).tolist()
               for n in torch.randint(2, 6, (BATCH,), generator=gen)]
    lengths = [6, 1, 4, 2, 6, 3, 5, 1]
    responses = torch.randint(0, VOCAB, (BATCH, t), generator=gen)
    mask = (torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]).float()
    inputs = pack(prompts, responses, mask, pad_id=0)
    return PPOBatch(inputs=inputs,
                    logp_noise=0.3 * torch.randn(BATCH, t, generator=gen),
                    advantages=torch.randn(BATCH, t, generator=gen),
                    value_noise=0.3 * torch.randn(BATCH, t, generator=gen),
                    returns=torch.randn(BATCH, t, generator=gen))


def set_value_head(critic: torch.nn.Module, seed: int = 99) -> None:
    """A fixed non-zero value head (a zero head passes no gradient into the trunk)."""
    from pfppo_mega.models import gpt

    inner = gpt.unwrap(critic)
    if inner.post_process:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            inner.output_layer.weight.copy_(0.3 * torch.randn(inner.output_layer.weight.shape, generator=gen))


@dataclass
class UpdateResult:
    actor_loss: float
    actor_stats: dict
    actor_grad_norm: float
    critic_loss: float
    critic_stats: dict
    critic_grad_norm: float
    weights: dict[str, torch.Tensor]  # "actor/<hf name>", "critic/<hf name>": after the update

    def scalars(self) -> dict:
        return {"actor_loss": self.actor_loss, "actor_grad_norm": self.actor_grad_norm,
                "critic_loss": self.critic_loss, "critic_grad_norm": self.critic_grad_norm,
                **{f"actor/{k}": v for k, v in self.actor_stats.items()},
                **{f"critic/{k}": v for k, v in self.critic_stats.items()}}

    def save(self, stem: Path) -> None:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in self.weights.items()}, str(stem) + ".safetensors")
        Path(str(stem) + ".json").write_text(json.dumps(self.scalars(), indent=1, sort_keys=True))


def ppo_update(path: Path, batch: PPOBatch, *, micro_batch_size: int, dp_rank: int, dp: int,
               features=None) -> UpdateResult:
    """Build actor and critic from ``path`` at the current layout, run one PPO update on this DP
    rank's rows (B / dp contiguous rows), and gather the updated weights under HF names.
    ``features``: gpt.Features for wrap_ddp (None: the defaults)."""
    from pfppo_mega.kernels import get_backend
    from pfppo_mega.models import passes, gpt, hf_io

    cfg, arch = model_config(path)
    local = batch.rows(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
    actor = gpt.build_actor(cfg, arch=arch, features=features)
    hf_io.load_actor_from_hf(actor, path)
    critic = gpt.build_critic(cfg, arch=arch, features=features)
    hf_io.load_critic_trunk_from_hf(critic, path)
    set_value_head(critic)
    actor, critic = gpt.wrap_ddp(actor, features=features), gpt.wrap_ddp(critic, features=features)
    actor_opt = gpt.build_optimizer(actor, lr=LR, weight_decay=WEIGHT_DECAY, grad_clip=GRAD_CLIP, eps=ADAM_EPS)
    critic_opt = gpt.build_optimizer(critic, lr=LR, weight_decay=WEIGHT_DECAY, grad_clip=GRAD_CLIP, eps=ADAM_EPS)

    inp = local.inputs
    mask = inp.response_mask
    kernels = get_backend("auto")  # the trainer's default: the fused kernels when built (vocab-parallel at tp > 1)
    logp, _ = passes.forward_logp_entropy(actor, inp, temperature=TEMPERATURE, micro_batch_size=micro_batch_size,
                                          kernels=kernels)
    old_logp = (logp + local.logp_noise) * mask
    old_values = (passes.forward_values(critic, inp, micro_batch_size=micro_batch_size) + local.value_noise) * mask

    def actor_loss(logp, entropy, mb):
        m = mb.inputs.response_mask
        out = ppo.policy_loss(logp, old_logp[mb.rows], local.advantages[mb.rows], m,
                              clip_ratio_low=CLIP_LOW, clip_ratio_high=CLIP_HIGH)
        ent = ppo.agg_loss(entropy, m, mode="token-mean")
        scale = passes.share_scale(m, mb.norm, mode="token-mean", like=out.loss)
        return (out.loss - ENTROPY_COEFF * ent) * scale, {"clipfrac": out.pg_clipfrac}

    def critic_loss(values, mb):
        m = mb.inputs.response_mask
        out = ppo.value_loss(values, old_values[mb.rows], local.returns[mb.rows], m, value_clip=VALUE_CLIP)
        return out.loss * passes.share_scale(m, mb.norm, mode="token-mean", like=out.loss), {"vf_clipfrac": out.vf_clipfrac}

    actor.train()
    critic.train()
    a = passes.train_step(actor, actor_opt, inp, actor_loss, temperature=TEMPERATURE,
                          micro_batch_size=micro_batch_size, kernels=kernels)
    c = passes.critic_train_step(critic, critic_opt, inp, critic_loss, micro_batch_size=micro_batch_size)
    assert a.update_successful and c.update_successful
    weights = {f"actor/{n}": t.detach().clone() for n, t in hf_io.gather_hf_weights(actor, cfg)}
    weights.update({f"critic/{n}": t.detach().clone() for n, t in hf_io.gather_critic_weights(critic, cfg)})
    return UpdateResult(a.loss, a.stats, a.grad_norm, c.loss, c.stats, c.grad_norm, weights)


def actor_loss(batch: "PPOBatch"):
    """A model-passes ActorLossFn over ``batch``: the clipped policy loss against perturbed old log-probs
    minus 0.01 x the token-mean entropy, as this micro-batch's share (gradients reach both outputs)."""
    from pfppo_mega.models import passes

    def loss(logp, entropy, mb):
        m = mb.inputs.response_mask
        out = ppo.policy_loss(logp, (logp.detach() + batch.logp_noise[mb.rows]) * m, batch.advantages[mb.rows], m,
                              clip_ratio_low=CLIP_LOW, clip_ratio_high=CLIP_HIGH)
        ent = ppo.agg_loss(entropy, m, mode="token-mean")
        return (out.loss - 0.01 * ent) * passes.share_scale(m, mb.norm, mode="token-mean", like=out.loss), {}

    return loss
