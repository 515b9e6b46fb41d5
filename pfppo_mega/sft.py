"""Supervised warm start for the built-in task: `pfppo sft CONFIG [overrides]`.

Trains the `model` section's shape from scratch (megatron-core GPTModel, the same code path as
the PPO actor) on noisy demonstrations (`sft.noise`), then writes an ordinary Hugging Face
checkpoint (config.json, model.safetensors, tokenizer.json) that `actor_rollout.model_path`
can point at.
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from pfppo_mega.config import Config
from pfppo_mega.models import gpt, hf_io
from pfppo_mega.parallel import init_parallel
from pfppo_mega.tasks.addition import AdditionTask, Problem
from pfppo_mega.tasks.tokenizer import Tokenizer, char_tokenizer


class SFTTimeout(RuntimeError):
    """sft.max_seconds (a safety limit) ran out before sft.steps were done."""


def demo_batch(task: AdditionTask, tok: Tokenizer, problems: list[Problem], rng: random.Random,
               noise: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids [B, S], targets [B, S] (next token), loss mask [B, S] on answer + EOS targets."""
    rows, masks = [], []
    for p in problems:
        prompt = tok.encode(p.prompt)
        answer = tok.encode(task.demonstration(p, rng, noise=noise), add_bos=False) + [tok.eos_id]
        rows.append(prompt + answer)
        masks.append([0] * (len(prompt) - 1) + [1] * len(answer))  # aligned with targets
    S = max(len(r) for r in rows)
    ids = torch.full((len(rows), S), tok.pad_id, dtype=torch.long)
    tgt = torch.full((len(rows), S), tok.pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), S)
    for i, (r, m) in enumerate(zip(rows, masks)):
        ids[i, : len(r)] = torch.tensor(r)
        tgt[i, : len(r) - 1] = torch.tensor(r[1:])
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.float)
    return ids, tgt, mask


def run_sft(cfg: Config, *, log=print) -> Path:
    s = cfg.sft
    torch.set_num_threads(cfg.training.num_threads)
    random.seed(cfg.training.seed)
    torch.manual_seed(cfg.training.seed)
    tok = char_tokenizer()
    model_cfg = cfg.model
    if not model_cfg.is_complete():
        missing = [k for k in model_cfg.SHAPE_FIELDS if getattr(model_cfg, k) is None]
        raise ValueError(f"pfppo sft builds the model from the `model` section: set {', '.join(missing)}")
    if tok.vocab_size > model_cfg.vocab_size:
        raise ValueError(f"model.vocab_size = {model_cfg.vocab_size} < tokenizer size {tok.vocab_size}")
    task = AdditionTask(cfg.data.num_digits)
    init_parallel(tp=cfg.parallel.tensor_model_parallel_size, pp=cfg.parallel.pipeline_model_parallel_size,
                  backend=cfg.parallel.backend, seed=cfg.training.seed)
    model = gpt.wrap_ddp(gpt.build_actor(model_cfg))
    opt = gpt.build_optimizer(model, lr=s.lr, weight_decay=0.0, grad_clip=1.0)
    rng = random.Random(cfg.training.seed)
    t0 = time.monotonic()
    step = 0
    for step in range(1, s.steps + 1):
        lr = s.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / s.steps)))
        for group in opt.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
        ids, tgt, mask = demo_batch(task, tok, task.train_prompts(s.batch_size, rng), rng, s.noise)
        model.train()
        gpt.zero_grads(model, opt)
        logits = gpt.actor_logits(model, ids, ids != tok.pad_id)                    # [B, S, V]
        nll = F.cross_entropy(logits.flatten(0, 1), tgt.flatten(), reduction="none")  # [B*S]
        loss = (nll * mask.flatten()).sum() / mask.sum()
        loss.backward()
        gpt.optimizer_step(model, opt)
        if step % 50 == 0 or step == 1:
            log(f"[sft] step {step}/{s.steps} loss {loss.item():.4f} ({time.monotonic() - t0:.0f}s)")
        if s.max_seconds and time.monotonic() - t0 > s.max_seconds and step < s.steps:
            # A safety limit, not a stopping rule: a checkpoint cut short by wall time would depend
            # on the machine's load, so nothing is written.
            raise SFTTimeout(
                f"sft.max_seconds = {s.max_seconds} exceeded at step {step} of sft.steps = {s.steps} "
                f"({time.monotonic() - t0:.0f}s): SFT stops on steps only; lower sft.steps or raise / unset "
                f"sft.max_seconds (0 = no limit). No checkpoint written.")
    out = Path(s.output_dir)
    hf_io.export_hf(model, model_cfg, out, tokenizer_files=tok.files())
    (out / "sft_info.json").write_text(json.dumps(
        {"steps": step, "noise": s.noise, "seconds": time.monotonic() - t0, "seed": cfg.training.seed}))
    log(f"[sft] wrote {out} ({step} steps, {time.monotonic() - t0:.0f}s)")
    return out
