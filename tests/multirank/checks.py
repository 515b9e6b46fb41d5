"""Every multi-rank check for one world size, in ONE torchrun launch (started by tests/test_parallel.py):

    python -m torch.distributed.run --standalone --nproc_per_node=N tests/multirank/checks.py DIR

DIR holds the checkpoints and transformers' fp64 references written by common.make_checkpoints
(the rank processes never import transformers). For each layout of common.LAYOUTS[N] the
script re-initialises megatron's parallel state on the same process group and runs the checks;
rank 0 prints one line per check,

    RESULT <layout> <check> PASS|FAIL max_diff=<x> tol=<y>

and writes the PPO update results to DIR/results/<layout>_<checkpoint>.{safetensors,json}, which
the pytest side compares with its serial (tp = pp = dp = 1) run.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

torch.set_num_threads(1)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import common  # noqa: E402
import feature_checks  # noqa: E402
import refit_checks  # noqa: E402
import reward_model_checks  # noqa: E402
from pfppo_mega import parallel  # noqa: E402

LOGITS_TOL = 2e-5      # fp32 megatron vs fp64 transformers (as tests/test_models.py)
LOGP_TOL = 2e-5        # log-prob / entropy, fp32 vs fp64
GRAD_TOL = 1e-5        # vocab-parallel gradients, fp32 vs fp64


def report(layout: str, check: str, ok: bool, max_diff: float, tol: float, note: str = "") -> None:
    if dist.get_rank() == 0:
        status = "PASS" if ok else "FAIL"
        print(f"RESULT {layout} {check} {status} max_diff={max_diff:.3e} tol={tol:.1e} {note}".rstrip(), flush=True)


def all_ranks_ok(ok: bool) -> bool:
    """True when ``ok`` holds on every rank (one all-reduce)."""
    flag = torch.tensor([0 if ok else 1])
    dist.all_reduce(flag)
    return int(flag) == 0


def max_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _actor(path: Path):
    from pfppo_mega.models import gpt, hf_io

    cfg, arch = common.model_config(path)
    actor = gpt.build_actor(cfg, arch=arch)
    hf_io.load_actor_from_hf(actor, path)
    return cfg, actor.eval()


# ----------------------------------------------------------------------------- checks


def check_logits(layout: str, kind: str, path: Path, mbs: int, batch: common.PPOBatch, refs: dict) -> None:
    from pfppo_mega.models import passes

    _, actor = _actor(path)
    ours = passes.forward_logits(actor, batch.inputs.input_ids, micro_batch_size=mbs).double()
    ref = refs[f"logits/{kind}"]
    err = max_over_ranks((ours - ref).abs().max().item())
    report(layout, f"logits_vs_transformers[{kind}]", err < LOGITS_TOL and ours.shape == ref.shape, err, LOGITS_TOL)


def check_family_logits(layout: str, kind: str, path: Path, mbs: int, refs: dict) -> None:
    """Logits of common.family_ids() (positions past llama3's original context) vs transformers."""
    from pfppo_mega.models import passes

    _, actor = _actor(path)
    ids = common.family_ids()
    ours = passes.forward_logits(actor, ids, micro_batch_size=mbs).double()
    ref = refs[f"logits/{kind}"]
    err = max_over_ranks((ours - ref).abs().max().item())
    report(layout, f"logits_vs_transformers[{kind}]", err < LOGITS_TOL and ours.shape == ref.shape, err, LOGITS_TOL)


def check_logp_entropy(layout: str, kind: str, path: Path, mbs: int, batch: common.PPOBatch, refs: dict) -> None:
    """forward_logp_entropy with each kernels backend (vocab-parallel at tp > 1) vs the
    full-vocabulary fp64 softmax of transformers' logits, at common.TEMPERATURE."""
    from pfppo_mega.kernels import available_backends
    from pfppo_mega.models import passes

    _, actor = _actor(path)
    for backend in available_backends():
        for fused, tag in ((False, ""), (True, ",fused_head")):  # the fused head: 3-row chunks (several per batch)
            batching = passes.Batching(mbs, fused_head=fused, head_chunk_tokens=3)
            logp, ent = passes.forward_logp_entropy(actor, batch.inputs, temperature=common.TEMPERATURE,
                                                    micro_batch_size=batching, kernels=backend)
            err = max_over_ranks(max((logp.double() - refs[f"logp/{kind}"]).abs().max().item(),
                                     (ent.double() - refs[f"entropy/{kind}"]).abs().max().item()))
            report(layout, f"logp_entropy_vs_fp64[{kind},{backend.name}{tag}]", err < LOGP_TOL, err, LOGP_TOL)


def check_vocab_parallel_grads(layout: str) -> None:
    """vocab_parallel_logprob_entropy on TP shards of a vocabulary with megatron's padding
    (vocab_size 51 padded to a multiple of tp * make_vocab_size_divisible_by, with 8: 64, rank 1
    partly padding; with 128: 256, rank 1 all padding), temperature 0.7, padding holding a huge
    logit, for each kernels backend: forward and gradients vs the same backend at TP = 1 (the
    whole unpadded vocabulary in one process) and vs fp64 autograd."""
    from megatron.core import parallel_state as ps

    from pfppo_mega.kernels import available_backends, vocab_parallel_logprob_entropy

    tp, rank, group = (ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank(),
                       ps.get_tensor_model_parallel_group())
    n, v, temperature = 24, common.VOCAB, 0.7
    gen = torch.Generator().manual_seed(5)
    full = 3.0 * torch.randn(n, v, generator=gen)
    full[0, 7] = 40.0  # one dominant logit
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[1] = v - 1  # the last real column, which sits next to the padding
    g_logp, g_ent = torch.randn(n, generator=gen), torch.randn(n, generator=gen)

    ref_x = full.double().requires_grad_(True)
    logq = F.log_softmax(ref_x / temperature, dim=-1)
    ref_logp = logq.gather(1, labels[:, None])[:, 0]
    ref_ent = -(logq.exp() * logq).sum(-1)
    ((ref_logp * g_logp.double()).sum() + (ref_ent * g_ent.double()).sum()).backward()

    def run(x, **kw):
        logp, ent = vocab_parallel_logprob_entropy(x, labels, temperature=temperature, **kw)
        ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()
        return logp.detach(), ent.detach()

    for backend in available_backends():
        one = full.clone().requires_grad_(True)  # TP = 1: the whole vocabulary, no group
        one_logp, one_ent = run(one, vocab_start=0, vocab_size=v, group=None, backend=backend)
        vs_tp1, vs_fp64, ok, notes = [0.0, 0.0, 0.0], 0.0, True, []
        for divisible_by in (8, 128):
            vp = -(-v // (tp * divisible_by)) * tp * divisible_by
            padded = torch.cat([full, torch.full((n, vp - v), 1e4)], dim=1)  # padding must not count
            shard = padded.chunk(tp, dim=1)[rank].clone().requires_grad_(True)
            before = shard.detach().clone()
            logp, ent = run(shard, vocab_start=rank * (vp // tp), vocab_size=v, group=group, backend=backend)
            grads = [torch.empty_like(shard) for _ in range(tp)]
            dist.all_gather(grads, shard.grad.contiguous(), group=group)
            grad = torch.cat(grads, dim=1)
            diffs = [(logp - one_logp).abs().max().item(), (ent - one_ent).abs().max().item(),
                     (grad[:, :v] - one.grad).abs().max().item()]
            vs_tp1 = [max(a, b) for a, b in zip(vs_tp1, diffs)]
            vs_fp64 = max(vs_fp64, (logp.double() - ref_logp).abs().max().item(),
                          (ent.double() - ref_ent).abs().max().item(),
                          (grad[:, :v].double() - ref_x.grad).abs().max().item())
            pad_grad_zero = bool((grad[:, v:] == 0).all())
            untouched = torch.equal(shard.detach(), before)
            ok = ok and pad_grad_zero and untouched
            notes.append(f"pad{divisible_by}:cols={vp - v},pad_grad_zero={pad_grad_zero},untouched={untouched}")
        vs_tp1 = [max_over_ranks(d) for d in vs_tp1]
        vs_fp64 = max_over_ranks(vs_fp64)
        ok = all_ranks_ok(ok and max(vs_tp1) < GRAD_TOL and vs_fp64 < GRAD_TOL)
        report(layout, f"vocab_parallel_fwd_bwd[{backend.name}]", ok, vs_fp64, GRAD_TOL,
               f"vs_tp1: logp={vs_tp1[0]:.2e} entropy={vs_tp1[1]:.2e} grad={vs_tp1[2]:.2e} T={temperature} "
               + " ".join(notes))
        check_fused_head_grads(layout, backend, group=group, tp=tp, rank=rank)


def check_fused_head_grads(layout: str, backend, *, group, tp: int, rank: int) -> None:
    """kernels.fused_head on this rank's rows of a head weight padded as megatron pads it (vocab 51 to
    a multiple of tp * 8 and tp * 128: rank 1 partly / all padding, padding rows huge), temperature
    0.7, 5-row chunks: log-prob, entropy, d hidden (all-reduced inside) and d W (all-gathered here)
    vs today's path at TP = 1 (logits = hidden @ W^T, vocab_parallel_logprob_entropy) and vs fp64."""
    from pfppo_mega.kernels import vocab_parallel_logprob_entropy
    from pfppo_mega.kernels.fused_head import fused_linear_logprob_entropy

    n, h, v, temperature = 24, 12, common.VOCAB, 0.7
    gen = torch.Generator().manual_seed(6)
    hidden, weight = torch.randn(n, h, generator=gen), torch.randn(v, h, generator=gen)
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[1] = v - 1
    g_logp, g_ent = torch.randn(n, generator=gen), torch.randn(n, generator=gen)

    def run(x, w, fused: bool, **kw):
        x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        if fused:
            logp, ent = fused_linear_logprob_entropy(x, w, labels, temperature=temperature, backend=backend,
                                                     chunk_tokens=5, vocab_size=v, **kw)
        else:
            logp, ent = vocab_parallel_logprob_entropy(x @ w.t(), labels, temperature=temperature, backend=backend,
                                                       vocab_start=0, vocab_size=v, group=None)
        ((logp * g_logp).sum() + (ent * g_ent).sum()).backward()
        return [logp.detach(), ent.detach(), x.grad, w.grad]

    one = run(hidden, weight, False)
    xd, wd = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    logq = F.log_softmax((xd @ wd.t()) / temperature, dim=-1)
    ref_logp, ref_ent = logq.gather(1, labels[:, None])[:, 0], -(logq.exp() * logq).sum(-1)
    ((ref_logp * g_logp.double()).sum() + (ref_ent * g_ent.double()).sum()).backward()
    ref = [ref_logp, ref_ent, xd.grad, wd.grad]
    vs_tp1, vs_fp64, notes, ok = 0.0, 0.0, [], True
    for divisible_by in (8, 128):
        vp = -(-v // (tp * divisible_by)) * tp * divisible_by
        padded = torch.cat([weight, torch.full((vp - v, h), 30.0)])  # padding rows must not count
        shard = padded.chunk(tp, dim=0)[rank]
        got = run(hidden, shard, True, vocab_start=rank * (vp // tp), group=group)
        grads = [torch.empty_like(got[3]) for _ in range(tp)]
        dist.all_gather(grads, got[3].contiguous(), group=group)
        full_w = torch.cat(grads)
        got = got[:3] + [full_w[:v]]
        vs_tp1 = max(vs_tp1, *((a - b).abs().max().item() for a, b in zip(got, one)))
        vs_fp64 = max(vs_fp64, *((a.double() - b).abs().max().item() for a, b in zip(got, ref)))
        pad_zero = bool((full_w[v:] == 0).all())
        ok = ok and pad_zero
        notes.append(f"pad{divisible_by}:rows={vp - v},pad_grad_zero={pad_zero}")
    vs_tp1, vs_fp64 = max_over_ranks(vs_tp1), max_over_ranks(vs_fp64)
    ok = all_ranks_ok(ok and vs_tp1 < GRAD_TOL and vs_fp64 < GRAD_TOL)
    report(layout, f"fused_head_fwd_bwd[{backend.name}]", ok, vs_fp64, GRAD_TOL,
           f"vs_tp1_unfused={vs_tp1:.2e} T={temperature} " + " ".join(notes))


def check_round_trip(layout: str, kind: str, path: Path, out_root: Path) -> None:
    """gather_hf_weights on every rank, and a sharded export written by rank 0, equal the checkpoint."""
    from pfppo_mega.models import hf_io

    cfg, actor = _actor(path)
    original = hf_io.load_hf_state_dict(path)
    pairs = hf_io.gather_hf_weights(actor, cfg)
    names = [n for n, _ in pairs]
    same = sorted(names) == sorted(original) and len(names) == len(set(names))
    same = same and all(torch.equal(t, original[n]) for n, t in pairs)
    report(layout, f"gather_hf_weights_exact[{kind}]", all_ranks_ok(same), 0.0, 0.0,
           f"tensors={len(pairs)}")

    out = out_root / f"{layout}_{kind}"
    hf_io.export_hf(actor, cfg, out, max_shard_bytes=60_000)
    ok, shards = True, 0
    if dist.get_rank() == 0:
        written = hf_io.load_hf_state_dict(out)
        shards = len(list(out.glob("model-*-of-*.safetensors")))
        ok = (sorted(written) == sorted(original) and all(torch.equal(written[n], original[n]) for n in original)
              and (out / hf_io.INDEX_FILE).is_file() and shards > 1)
    report(layout, f"export_sharded_exact[{kind}]", all_ranks_ok(ok), 0.0, 0.0, f"shards={shards}")


def check_ppo_update(layout: str, kind: str, path: Path, mbs: int, batch: common.PPOBatch,
                     results: Path) -> None:
    """One PPO update; rank 0 saves losses and gathered weights for the pytest side. With DP,
    every replica must hold bit-identical weights afterwards."""
    from megatron.core import parallel_state as ps

    res = common.ppo_update(path, batch, micro_batch_size=mbs, dp_rank=ps.get_data_parallel_rank(),
                            dp=ps.get_data_parallel_world_size())
    if dist.get_rank() == 0:
        res.save(results / f"{layout}_{kind}")
    flat = torch.cat([res.weights[k].reshape(-1) for k in sorted(res.weights)])
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    report(layout, f"ppo_update_ran[{kind}]", True, 0.0, 0.0,
           f"actor_loss={res.actor_loss:.6f} critic_loss={res.critic_loss:.6f}")
    report(layout, f"replicas_identical[{kind}]", all_ranks_ok(torch.equal(flat, reference)), 0.0, 0.0)


BUDGET = 24  # tokens per micro-batch: 2-3 of ppo_batch()'s rows (3-11 tokens), each micro-batch its own shape


def check_token_budget(layout: str, path: Path, mbs: int, batch: common.PPOBatch, refs: dict, results: Path) -> None:
    """Token-budget micro-batches (a shape of their own each, through the pipeline stages) with the
    head at the response tokens only: log-probs vs fp64, and one PPO update saved for the pytest
    side to compare with the serial padded one (tests/test_token_budget.py has the single-rank
    comparisons)."""
    from megatron.core import parallel_state as ps

    from pfppo_mega.models import passes

    batching = passes.Batching(mbs, max_tokens=BUDGET, response_only=True)
    _, actor = _actor(path)
    logp, ent = passes.forward_logp_entropy(actor, batch.inputs, temperature=common.TEMPERATURE,
                                            micro_batch_size=batching)
    m = batch.inputs.response_mask.bool()
    err = max_over_ranks(max((logp.double() - refs["logp/llama"])[m].abs().max().item(),
                             (ent.double() - refs["entropy/llama"])[m].abs().max().item()))
    report(layout, "token_budget_logp_vs_fp64[llama]", err < LOGP_TOL, err, LOGP_TOL)
    res = common.ppo_update(path, batch, micro_batch_size=batching, dp_rank=ps.get_data_parallel_rank(),
                            dp=ps.get_data_parallel_world_size())
    if dist.get_rank() == 0:
        res.save(results / f"{layout}_llama_budget")


def check_bad_layout(world: int) -> None:
    """A layout whose product does not divide the world size fails before any collective."""
    try:
        parallel.init_parallel(tp=world * 2, pp=1, seed=1)
        ok, msg = False, "no error"
    except ValueError as e:
        msg = str(e)
        ok = f"tp({world * 2}) * pp(1) = {world * 2} does not divide WORLD_SIZE({world})" in msg
    report("any", "bad_layout_rejected", all_ranks_ok(ok), 0.0, 0.0)


# ----------------------------------------------------------------------------- main


def main() -> None:
    data = Path(sys.argv[1])
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    results = data / "results"
    exports = data / "exports"
    if dist.get_rank() == 0:
        results.mkdir(exist_ok=True)
        exports.mkdir(exist_ok=True)
    dist.barrier()
    batch = common.ppo_batch()
    refs = load_file(str(data / common.REFERENCES))
    paths = {kind: data / kind for kind in common.CHECKPOINTS}
    if world == 2:
        check_bad_layout(world)
    for layout, tp, pp, mbs in common.LAYOUTS[world]:
        t0 = time.perf_counter()
        parallel.init_parallel(tp=tp, pp=pp, seed=1234)
        for kind, path in paths.items():
            check_logits(layout, kind, path, mbs, batch, refs)
            check_round_trip(layout, kind, path, exports)
            check_ppo_update(layout, kind, path, mbs, batch, results)
        for kind in common.FAMILIES:  # logits and exact export; the update is family-agnostic
            check_family_logits(layout, kind, data / kind, mbs, refs)
            check_round_trip(layout, kind, data / kind, exports)
        check_logp_entropy(layout, "llama", paths["llama"], mbs, batch, refs)
        refit_checks.run(layout, paths, report, all_ranks_ok)  # broadcast refit, sharded pool, registry
        if world == 2:  # token-budget micro-batches at tp2, pp2, dp2
            check_token_budget(layout, paths["llama"], mbs, batch, refs, results)
        if world == 2:  # distributed optimizer, bf16 with fp32 main weights, features refused on CPU
            feature_checks.run(layout, paths["llama"], batch, mbs, report, all_ranks_ok)
            reward_model_checks.run(layout, data, mbs, report, all_ranks_ok)  # scores vs transformers, per family
        if tp > 1:
            check_vocab_parallel_grads(layout)
        parallel.destroy_parallel()
        if dist.get_rank() == 0:
            print(f"TIME {layout} {time.perf_counter() - t0:.1f}s", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
