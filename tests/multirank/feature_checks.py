"""Training features of the config, run where they run (CPU, gloo) inside the shared launches of
tests/multirank/checks.py (``run`` is called per layout, after the PPO-update checks):

- ``parallel.use_distributed_optimizer``: the same actor update with megatron's distributed
  optimizer (fp32 main weights and Adam states sharded over DP, reduce-scatter / all-gather)
  equals the plain DDP optimizer's, and each DP rank holds only its shard of the main weights;
- ``model.params_dtype: bfloat16``: parameters and compute in bf16, fp32 main weights in
  megatron's optimizer: an update far below bf16's resolution (lr 1e-5 on weights of order 1)
  moves the fp32 main weights by ~lr while the bf16 parameters are their rounding;
- refused on CPU with the key named (``gpt.check_features``): ``parallel.sequence_parallel``
  (megatron's torch norm cannot run it), ``training.recompute: selective | full`` (megatron
  re-runs the forward inside the backward pass and makes CUDA tensors there: tried here, both
  fail with "Torch not compiled with CUDA enabled"), ``model.layer_spec: transformer_engine``
  and ``parallel.virtual_pipeline_size`` (not wired into the trainer).

Rank 0 prints ``RESULT <layout> feature[<name>] PASS|FAIL ...`` lines (tests/test_parallel.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

import common

CHECKS = ("feature[distributed_optimizer]", "feature[distributed_optimizer_sharded]", "feature[bf16_fp32_main]",
          "feature[refused_on_cpu]")
_LR = 1e-5  # far below bf16's resolution (2^-8 relative) at the weights' scale


def _main_params(opt) -> list[torch.Tensor]:
    """The parameters megatron's optimizer steps (fp32 main weights, or their DP shard)."""
    inner = [o.optimizer for o in opt.chained_optimizers] if hasattr(opt, "chained_optimizers") else [opt.optimizer]
    return [p for o in inner for g in o.param_groups for p in g["params"]]


def _update(path: Path, batch: common.PPOBatch, mbs: int, *, features=None, dtype: str = "float32"):
    """One actor update (token-mean -logp of the batch's responses) at the current layout. Returns
    the gathered weights after it (fp32), the DDP module, the step result, and the optimizer's
    main parameters before and after the step."""
    from megatron.core import parallel_state as ps

    from pfppo_mega.models import passes, gpt, hf_io

    cfg, arch = common.model_config(path)
    cfg = dataclasses.replace(cfg, params_dtype=dtype)
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    local = batch.rows(rank * common.BATCH // dp, (rank + 1) * common.BATCH // dp)
    actor = gpt.build_actor(cfg, arch=arch, features=features)
    hf_io.load_actor_from_hf(actor, path)
    model = gpt.wrap_ddp(actor, features=features)
    opt = gpt.build_optimizer(model, lr=_LR, weight_decay=0.0, grad_clip=0.0)
    mains_before = [p.detach().clone() for p in _main_params(opt)]

    def loss(logp, entropy, mb):
        m = mb.inputs.response_mask
        return -(logp.float() * m).sum() * passes.share_scale(m, mb.norm, mode="token-mean"), {}

    model.train()
    res = passes.train_step(model, opt, local.inputs, loss, temperature=1.0, micro_batch_size=mbs)
    after = {n: t.detach().float().clone() for n, t in hf_io.gather_hf_weights(model, cfg)}
    return after, model, res, mains_before, [p.detach().clone() for p in _main_params(opt)]


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def run(layout: str, path: Path, batch: common.PPOBatch, mbs: int, report, all_ranks_ok) -> None:
    from megatron.core import parallel_state as ps

    from pfppo_mega.models import gpt

    dp = ps.get_data_parallel_world_size()
    plain, *_ = _update(path, batch, mbs)
    tol = _LR / 50  # Adam's first step is ~lr * sign(g): reduction order may move a weight by a fraction of lr

    dist_w, model, res, mains, _ = _update(path, batch, mbs, features=gpt.Features(use_distributed_optimizer=True))
    d = _max_diff(plain, dist_w)
    report(layout, "feature[distributed_optimizer]", all_ranks_ok(d <= tol and res.update_successful), d, tol)
    # each DP rank's optimizer steps the main weights of its shard only: ~1/dp of the parameters
    n_model = sum(p.numel() for p in model.parameters())
    share = sum(p.numel() for p in mains) / n_model
    report(layout, "feature[distributed_optimizer_sharded]", all_ranks_ok(abs(share - 1 / dp) <= 0.1 / dp),
           abs(share - 1 / dp), 0.1 / dp, f"main_share={share:.3f} dp={dp}")

    # bf16 parameters with fp32 main weights (through the distributed optimizer as well when dp > 1)
    _, model, res, before, after = _update(path, batch, mbs, dtype="bfloat16",
                                           features=gpt.Features(use_distributed_optimizer=dp > 1))
    bf16_params = all(p.dtype == torch.bfloat16 for p in model.parameters())
    fp32_main = bool(after) and all(p.dtype == torch.float32 for p in after)
    # Adam's first step moves every main weight with a gradient by ~lr (lr * g / (|g| + eps)): kept
    # in fp32, although lr is far below the bf16 spacing of the weights (2^-8 x |w|).
    step = max(float((a - b).abs().max()) for a, b in zip(after, before))
    ok = bf16_params and fp32_main and res.update_successful and 0.5 * _LR <= step <= 1.01 * _LR
    report(layout, "feature[bf16_fp32_main]", all_ranks_ok(ok), abs(step - _LR), 0.5 * _LR,
           f"bf16_params={bf16_params} fp32_main={fp32_main} main_step_max={step:.3e}")

    # refused on CPU, with the key named, before any model is built
    cfg, _ = common.model_config(path)
    named = []
    for feats, model_cfg, key in ((gpt.Features(sequence_parallel=True), cfg, "parallel.sequence_parallel"),
                                  (gpt.Features(), dataclasses.replace(cfg, layer_spec="transformer_engine"),
                                   "model.layer_spec"),
                                  (gpt.Features(virtual_pipeline_size=2), cfg, "parallel.virtual_pipeline_size"),
                                  (gpt.Features(recompute="selective"), cfg, "training.recompute"),
                                  (gpt.Features(recompute="full"), cfg, "training.recompute")):
        try:
            gpt.check_features(model_cfg, feats, device_type="cpu")
            named.append(False)
        except gpt.FeatureError as e:
            named.append(key in str(e))
    report(layout, "feature[refused_on_cpu]", all_ranks_ok(all(named)), 0.0, 0.0, f"named={named}")
