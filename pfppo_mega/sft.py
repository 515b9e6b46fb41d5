"""Supervised warm start for the built-in task: `pfppo sft CONFIG [overrides]`.

Trains the `model` section's shape from scratch (megatron-core GPTModel, the same code path as
the PPO actor) on imperfect demonstrations (random noise `sft.noise`, a systematic dropped carry
`sft.carry_drop`), then writes an ordinary Hugging Face checkpoint (config.json,
model.safetensors, tokenizer.json) that `actor_rollout.model_path` can point at, with
sft_info.json: the steps run and the held-out accuracy (greedy and sampled) of the result, which
`sft.min_accuracy` checks before anything trains on it.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from pfppo_mega.config import Config
from pfppo_mega.models import gpt, hf_io
from pfppo_mega.parallel import init_parallel
from pfppo_mega.tasks.addition import AdditionProblem, AdditionTask
from pfppo_mega.tokenizer import Tokenizer, char_tokenizer


class SFTTimeout(RuntimeError):
    """sft.max_seconds (a safety limit) ran out before sft.steps were done."""


class WarmStartTooWeak(RuntimeError):
    """The warm start's held-out greedy accuracy is below sft.min_accuracy (or unknown)."""


@dataclass(frozen=True)
class HeldOut:
    """Held-out accuracy of a warm start (data.eval_size prompts, the task's exact reward)."""

    greedy: float
    sampled: float
    greedy_carry: float | None   # greedy, on the prompts that carry into sft.carry_digit (None: carry_drop = 0)
    greedy_other: float | None   # greedy, on the others


def demo_batch(task: AdditionTask, tok: Tokenizer, problems: list[AdditionProblem], rng: random.Random,
               noise: float, *, carry_drop: float = 0.0, carry_digit: int = 2,
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids [B, S], targets [B, S] (next token), loss mask [B, S] on answer + EOS targets."""
    rows, masks = [], []
    for p in problems:
        prompt = tok.encode(task.prompt_text(p))
        demo = task.demonstration(p, rng, noise=noise, carry_drop=carry_drop, carry_digit=carry_digit)
        answer = tok.encode(demo, add_bos=False) + [tok.eos_id]
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


@torch.no_grad()
def fan_in_init(model: torch.nn.Module, gain: float, *, tp: int = 1) -> None:
    """Every weight matrix (embedding and output layer included) drawn from N(0, gain**2 / fan_in),
    fan_in = the full input width (a row-parallel shard holds 1/tp of it); norms stay at 1.

    Why: megatron's init (N(0, 0.02), whatever the width) is made for wide models. At hidden size
    128 it is 4-5x smaller than 1/sqrt(fan_in), so attention starts uniform and the query/key
    products grow out of a near-saddle: the demo's SFT sat on a loss plateau (~1.2) for 500-1000+
    steps, seed-dependently. With this init the same model leaves it within ~200-300 steps (seeds 1-3).
    Not a rule for every width: a 2-layer 64-wide model learned 1-digit addition with megatron's
    init and not with this one in 300 steps."""
    for param in model.parameters():
        if param.dim() != 2:
            continue
        fan_in = param.shape[1] * (tp if getattr(param, "partition_dim", None) == 1 else 1)
        param.normal_(0.0, gain / math.sqrt(fan_in))


@torch.no_grad()
def held_out_accuracy(model, task: AdditionTask, tok: Tokenizer, problems: list[AdditionProblem], *, max_new_tokens: int,
                      temperature: float, seed: int, carry_digit: int | None = None) -> HeldOut:
    """Greedy and sampled (at `temperature`, torch generator seeded with `seed`) accuracy of `model`
    on `problems` under the task's exact reward, decoded as the trainer's evaluation decodes (up to
    max_new_tokens, stop at EOS). Prompts of one length are decoded together (right-padded batches
    only, so the plain form's varying lengths go in groups)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)  # draws where the logits are
    scores = {}
    for greedy in (True, False):
        ok = [0.0] * len(problems)
        groups: dict[int, list[int]] = {}
        for i, p in enumerate(problems):
            groups.setdefault(len(task.prompt_text(p)), []).append(i)
        for rows in groups.values():
            ids = torch.tensor([tok.encode(task.prompt_text(problems[i])) for i in rows], device=device)  # [b, P]
            start = ids.shape[1]
            done = torch.zeros(len(rows), dtype=torch.bool, device=device)
            for _ in range(max_new_tokens):
                logits = gpt.actor_logits(model, ids, gather_vocab=True)[:, -1, : tok.vocab_size].float()
                if greedy:
                    nxt = logits.argmax(-1)
                else:
                    nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen).squeeze(1)
                nxt = torch.where(done, torch.full_like(nxt, tok.eos_id), nxt)
                ids = torch.cat([ids, nxt[:, None]], 1)
                done |= nxt == tok.eos_id
                if bool(done.all()):
                    break
            for row, i in zip(ids[:, start:].tolist(), rows):
                finished = tok.eos_id in row
                ok[i] = task.reward(problems[i], tok.decode(row), finished)
        scores[greedy] = ok
    model.train(was_training)

    def mean(xs):
        return sum(xs) / len(xs) if xs else float("nan")

    g = scores[True]
    carry = other = None
    if carry_digit is not None:
        c = [task.carries_into(p, carry_digit) for p in problems]
        carry = mean([x for x, ci in zip(g, c) if ci])
        other = mean([x for x, ci in zip(g, c) if not ci])
    return HeldOut(greedy=mean(g), sampled=mean(scores[False]), greedy_carry=carry, greedy_other=other)


def check_warm_start(cfg: Config, sft_dir: str | Path | None = None) -> HeldOut | None:
    """The warm start's held-out accuracy from its sft_info.json, refused (WarmStartTooWeak, with
    the value, the key and what to do) below sft.min_accuracy; None when sft.min_accuracy = 0."""
    need = cfg.sft.min_accuracy
    if not need:
        return None
    info_path = Path(sft_dir or cfg.sft.output_dir, "sft_info.json")
    try:
        info = json.loads(info_path.read_text())
        acc = HeldOut(**info["held_out"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise WarmStartTooWeak(
            f"the warm start's held-out accuracy is unknown ({info_path}: {type(e).__name__}: {e}); "
            f"sft.min_accuracy = {need} needs it: redo the warm start (pfppo demo --fresh, or pfppo sft) "
            f"or set sft.min_accuracy=0 to skip the check") from None
    if not acc.greedy >= need:
        raise WarmStartTooWeak(
            f"the SFT warm start in {info_path.parent} reaches held-out greedy accuracy {acc.greedy:.3f} "
            f"(sampled {acc.sampled:.3f}) after {info.get('steps')} steps, below sft.min_accuracy = {need}: "
            f"PPO from it would start from a model that has not learned the task. Train it longer "
            f"(sft.steps), try another training.seed, check sft.lr / sft.warmup_steps, or lower "
            f"sft.min_accuracy (0 = no check) to go on anyway")
    return acc


def _settings(cfg: Config) -> dict:
    """What a warm start was made with (recorded in sft_info.json; a change means a redo)."""
    s = cfg.sft
    return {"seed": cfg.training.seed, "steps": s.steps, "batch_size": s.batch_size, "lr": s.lr,
            "warmup_steps": s.warmup_steps, "init_gain": s.init_gain, "noise": s.noise,
            "carry_drop": s.carry_drop, "carry_digit": s.carry_digit, "num_digits": cfg.data.num_digits,
            "addition_format": cfg.data.addition_format}


def stale_reason(cfg: Config, sft_dir: str | Path) -> str | None:
    """Why the checkpoint in sft_dir is not the warm start `cfg` asks for (None: it is): missing,
    or its sft_info.json records other settings (seed, steps, demonstrations, task form)."""
    info_path = Path(sft_dir, "sft_info.json")
    if not Path(sft_dir, "model.safetensors").is_file() or not info_path.is_file():
        return "none yet"
    try:
        info = json.loads(info_path.read_text())
    except (OSError, ValueError) as e:
        return f"{info_path} unreadable: {e}"
    want = _settings(cfg)
    diff = [f"{k} {info.get(k)!r} -> {v!r}" for k, v in want.items() if info.get(k) != v]
    return f"settings changed: {', '.join(diff)}" if diff else None


def run_sft(cfg: Config, *, log=print) -> Path:
    """Train, export, measure the held-out accuracy and write sft_info.json; then refuse
    (WarmStartTooWeak) a result below sft.min_accuracy (the checkpoint stays for inspection)."""
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
    task = AdditionTask.from_config(cfg.data)
    par = init_parallel(tp=cfg.parallel.tensor_model_parallel_size, pp=cfg.parallel.pipeline_model_parallel_size,
                        backend=cfg.parallel.backend, seed=cfg.training.seed,
                        timeout_s=cfg.parallel.collective_timeout_s, watchdog_s=cfg.parallel.watchdog_s)
    actor = gpt.build_actor(model_cfg, device=par.device)
    if s.init_gain:
        fan_in_init(actor, s.init_gain, tp=cfg.parallel.tensor_model_parallel_size)
    model = gpt.wrap_ddp(actor)
    opt = gpt.build_optimizer(model, lr=s.lr, weight_decay=0.0, grad_clip=1.0)
    rng = random.Random(cfg.training.seed)
    t0 = time.monotonic()
    step = 0
    for step in range(1, s.steps + 1):
        lr = s.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / s.steps)))
        if step <= s.warmup_steps:
            lr = s.lr * step / s.warmup_steps
        for group in opt.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
        ids, tgt, mask = (t.to(par.device) for t in demo_batch(  # made on the host, trained on the device
            task, tok, task.train_prompts(s.batch_size, rng), rng, s.noise, carry_drop=s.carry_drop,
            carry_digit=s.carry_digit))
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
    train_s = time.monotonic() - t0
    acc = held_out_accuracy(model, task, tok, task.eval_prompts(cfg.data.eval_size),
                            max_new_tokens=cfg.algorithm.max_response_length,
                            temperature=cfg.actor_rollout.temperature, seed=cfg.training.seed,
                            carry_digit=s.carry_digit if s.carry_drop > 0 else None)
    out = Path(s.output_dir)
    hf_io.export_hf(model, model_cfg, out, tokenizer_files=tok.files())
    (out / "sft_info.json").write_text(json.dumps(
        {**_settings(cfg), "steps": step, "seconds": train_s, "eval_size": cfg.data.eval_size,
         "held_out": asdict(acc)}, indent=1))
    split = ""
    if acc.greedy_carry is not None:
        split = (f"; greedy {acc.greedy_carry:.3f} where the sum carries into digit {s.carry_digit} "
                 f"(the demonstrations drop that carry {s.carry_drop:.0%} of the time), {acc.greedy_other:.3f} elsewhere")
    log(f"[sft] wrote {out} ({step} steps, {train_s:.0f}s); held-out accuracy ({cfg.data.eval_size} prompts): "
        f"greedy {acc.greedy:.3f}, sampled {acc.sampled:.3f}{split}")
    check_warm_start(cfg, out)
    return out
