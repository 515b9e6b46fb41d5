"""The vocabulary-sized weights' gradients straight into DDP's buffer (training.sparse_vocab_grads,
pfppo_mega/models/vocab_grads.py): the LM head's held over micro-batches and added as one product,
the embedding's added at the looked-up rows. Every parameter's accumulated gradient (main_grad)
equals megatron's own backward's up to the order of floating-point sums, tied and untied, padded
and token-budget micro-batches, fp32 and bf16; one PPO update ends at the same weights. TP2 / PP2
run this path in tests/test_parallel.py's layouts (tests/multirank/checks.py), against the serial
reference."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)

sys.path.insert(0, str(Path(__file__).resolve().parent / "multirank"))

import common  # noqa: E402

from pfppo_mega.config import ConfigError, load_config_dict  # noqa: E402
from pfppo_mega.models import passes, gpt, hf_io, vocab_grads  # noqa: E402


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    """A TP1 world for the module, and tests/multirank/common.py's checkpoints by kind."""
    yield from common.tp1_world(tmp_path_factory.mktemp("vocab"))


def _actor(path: Path, *, sparse: bool, dtype: str = "float32"):
    cfg, arch = common.model_config(path)
    cfg = dataclasses.replace(cfg, params_dtype=dtype)
    actor = gpt.build_actor(cfg, arch=arch)
    hf_io.load_actor_from_hf(actor, path)
    ddp = gpt.wrap_ddp(actor, features=gpt.Features(sparse_vocab_grads=sparse))
    opt = gpt.build_optimizer(ddp, lr=common.LR, weight_decay=0.0, grad_clip=0.0)
    return actor, ddp, opt


def _grads(path: Path, batching, *, sparse: bool, dtype: str = "float32"):
    """Every parameter's accumulated gradient after one actor step, and the step's figures."""
    batch = common.ppo_batch()
    inp = batch.inputs
    actor, ddp, opt = _actor(path, sparse=sparse, dtype=dtype)

    loss = common.actor_loss(batch)

    ddp.train()
    res = passes.train_step(ddp, opt, inp, loss, temperature=common.TEMPERATURE, micro_batch_size=batching)
    assert vocab_grads.pending_rows([ddp]) == 0, "held head gradients must be flushed by the step"
    return {n: p.main_grad.detach().clone() for n, p in actor.named_parameters()}, res


BATCHINGS = [  # many micro-batches: the held rows pass HIDDEN (64), so a flush happens mid-step too
    pytest.param(2, id="rows2"),
    pytest.param(passes.Batching(2, response_only=True), id="rows2-response-only"),
    pytest.param(passes.Batching(common.BATCH, max_tokens=40, response_only=True), id="budget40-response-only"),
]


@pytest.mark.parametrize("batching", BATCHINGS)
@pytest.mark.parametrize("kind", common.CHECKPOINTS)  # llama: untied head; qwen2: tied to the embedding
def test_gradients_match_megatrons_backward(world, kind, batching):
    ref, ref_res = _grads(world[kind], batching, sparse=False)
    got, got_res = _grads(world[kind], batching, sparse=True)
    assert sorted(ref) == sorted(got)
    scale = max(g.abs().max().item() for g in ref.values())
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-6 * scale, msg=lambda m: f"{name}: {m}")
    emb = next(n for n in ref if "word_embeddings" in n)
    assert ref[emb].abs().sum() > 0  # the compared gradient is not trivially 0
    assert got_res.loss == pytest.approx(ref_res.loss, rel=1e-6)
    assert got_res.grad_norm == pytest.approx(ref_res.grad_norm, rel=1e-5)
    print(f"{kind} {batching}: grad norm {ref_res.grad_norm:.6f} vs {got_res.grad_norm:.6f}")


def test_bf16_parameters(world):
    """bf16 parameters (fp32 main grads): the held pairs are bf16, the product runs in fp32."""
    batching = passes.Batching(2, response_only=True)
    ref, _ = _grads(world["qwen2"], batching, sparse=False, dtype="bfloat16")
    got, _ = _grads(world["qwen2"], batching, sparse=True, dtype="bfloat16")
    for name in ref:
        assert got[name].dtype == torch.float32
        err = (got[name] - ref[name]).abs().max().item() / max(ref[name].abs().max().item(), 1e-12)
        assert err < 2e-2, (name, err)  # bf16 products rounded per micro-batch in megatron's path


def test_megatrons_path_where_it_does_not_apply(world):
    """Frozen weights, no-grad passes and an abandoned step leave nothing held."""
    _, ddp, opt = _actor(world["qwen2"], sparse=True)
    inp = common.ppo_batch().inputs
    with torch.no_grad():
        passes.forward_logp_entropy(ddp, inp, temperature=1.0, micro_batch_size=4)
    assert vocab_grads.pending_rows([ddp]) == 0
    ids = inp.input_ids[:2]
    logits = gpt.actor_logits(ddp, ids)
    logits.float().sum().backward()            # a backward without a step: the head's rows are held
    assert vocab_grads.pending_rows([ddp]) == ids.numel()
    gpt.zero_grads(ddp, opt)                   # ... and dropped with the step
    assert vocab_grads.pending_rows([ddp]) == 0
    assert all(not p.main_grad.any() for p in gpt.unwrap(ddp).parameters())
    ref = gpt.build_actor(common.model_config(world["qwen2"])[0], arch=common.model_config(world["qwen2"])[1])
    ref.requires_grad_(False)
    vocab_grads.install(ref)                  # no main_grad, frozen: megatron's forward
    out = gpt.actor_logits(ref, ids)
    assert out.grad_fn is None


def test_ppo_update_ends_at_the_same_weights(world):
    batch = common.ppo_batch()
    for kind in common.CHECKPOINTS:
        results = [common.ppo_update(world[kind], batch, micro_batch_size=2, dp_rank=0, dp=1,
                                     features=gpt.Features(sparse_vocab_grads=sparse)) for sparse in (False, True)]
        worst = max((results[1].weights[n] - results[0].weights[n]).abs().max().item() for n in results[0].weights)
        assert worst <= common.LR / 50, (kind, worst)
        assert results[1].actor_grad_norm == pytest.approx(results[0].actor_grad_norm, rel=1e-5)


def test_config_key():
    base = {"actor_rollout": {"model_path": "x"}}
    assert load_config_dict(base).training.sparse_vocab_grads is True
    with pytest.raises(ConfigError, match=r"training.sparse_vocab_grads"):
        load_config_dict({**base, "training": {"sparse_vocab_grads": "fast"}})
    cfg = load_config_dict({**base, "training": {"sparse_vocab_grads": False}})
    assert gpt.features_from_config(cfg).sparse_vocab_grads is False


def test_bench_update_ab_runs_every_arm(world, tmp_path):
    """python -m pfppo_mega.bench.update_ab at the tiny shape: three arms from the same weights, so
    their first losses agree; every step timed."""
    from pfppo_mega.bench import update_ab

    out = update_ab.main(["--shape", "tiny", "--rows", "6", "--threads", "1", "--steps", "2",
                          "--out", str(tmp_path / "ab.json")])
    arms = json.loads((tmp_path / "ab.json").read_text())["arms"]
    assert list(arms) == ["megatron", "vocab+adamw", "default"] and arms.keys() == out["arms"].keys()
    first = [a["losses"][0] for a in arms.values()]
    assert max(first) - min(first) <= 1e-6 * max(1.0, abs(first[0]))
    assert all(len(a["each_s"]) == 2 and a["median_s"] > 0 for a in arms.values())


class _Matmuls(torch.overrides.TorchFunctionMode):
    """Records (name, operand dtypes) of every matrix product."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name in ("matmul", "mm", "addmm", "addmm_"):
            self.seen.append((name, tuple(a.dtype for a in args if isinstance(a, torch.Tensor))))
        return func(*args, **(kwargs or {}))


def test_the_head_gradient_is_a_bf16_gemm_on_a_gpu_and_fp32_on_the_cpu():
    """Issue 35: on a GPU the held LM-head gradient was flushed with an fp32 GEMM (no TF32; ~3-5 s per
    70B step). Off the CPU (meta stands for the GPU) the product now takes bf16 operands into the fp32
    buffer; on the CPU it stays fp32. Numerics of the bf16 form: within bf16 rounding of fp64."""
    V, N, H = 64, 48, 32
    bf16, fp32 = torch.bfloat16, torch.float32
    for device, want in (("meta", [("matmul", (bf16, bf16))]), ("cpu", [("addmm_", (fp32, fp32, fp32))])):
        main = torch.zeros(V, H, device=device)
        g = torch.randn(N, V, device=device, dtype=bf16)
        x = torch.randn(N, H, device=device, dtype=bf16)
        with _Matmuls() as seen:
            vocab_grads.accumulate(main, g, x)
        assert seen.seen == want, (device, seen.seen)
    g = torch.randn(N, V, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    x = torch.randn(N, H, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
    ref = g.double().t() @ x.double()
    low = torch.matmul(g.t(), x).float()  # the GPU form's arithmetic, run here
    assert ((low.double() - ref).norm() / ref.norm()) < 1e-2
