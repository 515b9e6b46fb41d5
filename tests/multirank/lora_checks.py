"""LoRA at tensor and pipeline parallelism (tests/test_lora.py launches it on 2 processes, gloo):

- TP1 reference (dp 2, every rank the whole batch): logits, every adapter's gradient of a fixed linear
  function of the logits, the merged HF weights, and the adapters after one optimizer step;
- tp2: the logits and the gathered gradients equal TP1's (column-parallel: B split by output rows;
  row-parallel: A split by input columns, the r-wide partial sums all-reduced), and the merged weights
  gathered for an engine / export equal TP1's;
- tp2: the adapter parameters of a rank equal the planner's count (ledger.lora_param_count);
- dp2: the step with megatron's distributed optimizer equals the plain one's, the base untouched;
- pp2: one optimizer step (megatron DDP + optimizer through the pipeline schedule) leaves the same
  adapters as TP1's, and every base weight bit-identical.

Rank 0 prints ``RESULT <layout> <check> PASS|FAIL max_diff=...``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch.distributed as dist  # noqa: E402

import common  # noqa: E402
from pfppo_mega import ledger, parallel  # noqa: E402
from pfppo_mega.families import DecoderShape  # noqa: E402
from pfppo_mega.config.tree import LoraConfig  # noqa: E402
from pfppo_mega.models import gpt, hf_io, lora, passes  # noqa: E402

LR = 1e-2
TOL = 1e-5


def report(layout: str, check: str, ok: bool, diff: float, tol: float) -> None:
    flag = torch.tensor([0 if ok else 1])
    dist.all_reduce(flag)
    if dist.get_rank() == 0:
        print(f"RESULT {layout} {check} {'PASS' if int(flag) == 0 else 'FAIL'} max_diff={diff:.3e} tol={tol:.1e}",
              flush=True)


def build(path: Path):
    cfg, arch = common.model_config(path)
    actor = gpt.build_actor(cfg, arch=arch)
    hf_io.load_actor_from_hf(actor, path)
    lora.apply(actor, LoraConfig(rank=4, alpha=8.0), seed=3)
    # B away from zero, the same whole tensors at every layout (then cut to this rank's shard)
    full = lora.gather_adapters(actor)
    g = torch.Generator().manual_seed(11)
    full = {n: (0.2 * torch.randn(t.shape, generator=g) if n.endswith(lora.B_NAME) else t) for n, t in sorted(full.items())}
    lora.load_adapters(actor, full)
    return actor, cfg


def probe(vocab: int, shape) -> torch.Tensor:
    return torch.randn(*shape[:2], vocab, generator=torch.Generator().manual_seed(7))


def grads_and_logits(path: Path, ids: torch.Tensor):
    """Logits [B, S, V] and each adapter's whole gradient of sum(logits * probe) (no DDP: plain .grad)."""
    actor, cfg = build(path)
    logits = gpt.actor_logits(actor, ids, gather_vocab=True)[..., :cfg.vocab_size]
    (logits * probe(cfg.vocab_size, ids.shape)).sum().backward()
    merged = {n: t.clone() for n, t in hf_io.gather_hf_weights(actor, cfg)}
    grads = {}
    for name, m in lora.adapted(actor):
        for which in (lora.A_NAME, lora.B_NAME):
            grads[f"{name}.{which}"] = getattr(m, which).grad.detach()
    # whole gradients: the same gathering as the adapters themselves
    with torch.no_grad():
        for name, m in lora.adapted(actor):
            for which in (lora.A_NAME, lora.B_NAME):
                getattr(m, which).copy_(grads[f"{name}.{which}"])
    whole = lora.gather_adapters(actor)
    return logits.detach(), whole, merged


def stepped(path: Path, batch: common.PPOBatch, features=None):
    """Adapters (whole) after one optimizer step (checked to have moved every B by ~lr), and the base
    weights (HF names) before / after."""
    actor, cfg = build(path)
    start = lora.gather_adapters(actor)
    with lora.adapters_off(actor):
        base_before = {n: t.clone() for n, t in hf_io.gather_hf_weights(actor, cfg)}
    model = gpt.wrap_ddp(actor, features=features)
    opt = gpt.build_optimizer(model, lr=LR, weight_decay=0.0, grad_clip=0.0)
    model.train()
    res = passes.train_step(model, opt, batch.inputs, common.actor_loss(batch), temperature=1.0,
                            micro_batch_size=3)
    assert res.update_successful
    with lora.adapters_off(actor):
        base_after = {n: t.clone() for n, t in hf_io.gather_hf_weights(actor, cfg)}
    after = lora.gather_adapters(actor)
    # Adam's first step moves every adapter with a gradient by ~lr: the step happened (B's all have one)
    moved = min(float((after[k] - start[k]).abs().max()) for k in after if k.endswith(lora.B_NAME))
    assert moved > LR / 2, moved
    return after, base_before, base_after


def diff(a: dict, b: dict) -> float:
    """The largest difference relative to the tensor's own scale (max |b|, at least 1)."""
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())[:4]
    return max(float((a[k].float() - b[k].float()).abs().max()) / max(1.0, float(b[k].abs().max())) for k in a)


def main() -> None:
    path = Path(sys.argv[1])
    dist.init_process_group("gloo")
    batch = common.ppo_batch()
    ids = batch.inputs.input_ids

    parallel.init_parallel(tp=1, pp=1, seed=1234)
    ref_logits, ref_grads, ref_merged = grads_and_logits(path, ids)
    ref_step, _, _ = stepped(path, batch)
    # dp2 (this world at tp1): megatron's distributed optimizer shards the adapters' fp32 state over DP
    dist_step, before_base, after_base = stepped(path, batch, gpt.Features(use_distributed_optimizer=True))
    d = diff(dist_step, ref_step)
    same = all(torch.equal(before_base[k], after_base[k]) for k in before_base)
    report("dp2", "distributed_optimizer_step", d <= LR / 50 and same, d, LR / 50)
    parallel.destroy_parallel()

    parallel.init_parallel(tp=2, pp=1, seed=1234)
    logits, grads, merged = grads_and_logits(path, ids)
    d = float((logits - ref_logits).abs().max())
    report("tp2", "logits", d <= TOL, d, TOL)
    d = diff(grads, ref_grads)
    report("tp2", "grads", d <= TOL, d, TOL)
    d = diff(merged, ref_merged)
    report("tp2", "merged_export", d <= TOL, d, TOL)
    actor, cfg = build(path)  # the planner's adapter count (pfppo_mega/ledger.py) against this rank's
    shape = DecoderShape.from_model_config(cfg, actor.architecture)
    counted = ledger.lora_param_count(shape, 2, 1, 4, lora.LoraSpec.of(LoraConfig(rank=4)).targets)
    report("tp2", "ledger_count", counted == lora.adapter_numel(actor), abs(counted - lora.adapter_numel(actor)), 0)
    after, before_base, after_base = stepped(path, batch)  # megatron DDP + optimizer at tp2
    d = diff(after, ref_step)
    same = all(torch.equal(before_base[k], after_base[k]) for k in before_base)
    report("tp2", "step", d <= LR / 50 and same, d, LR / 50)
    parallel.destroy_parallel()

    parallel.init_parallel(tp=1, pp=2, seed=1234)
    after, before_base, after_base = stepped(path, batch)
    d = diff(after, ref_step)
    report("pp2", "step", d <= LR / 50, d, LR / 50)
    same = all(torch.equal(before_base[k], after_base[k]) for k in before_base)
    report("pp2", "base_frozen", same, 0.0 if same else 1.0, 0.0)
    parallel.destroy_parallel()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
