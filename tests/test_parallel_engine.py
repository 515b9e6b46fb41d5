"""Single-process pieces of the parallel model side: the vocab-parallel math on simulated shards,
the reshard rules, loss shares, bad-input errors, Qwen2 at tp = 1, and the engine API at
tp = pp = dp = 1 against the trainer's current computation (bit-exact).

Multi-rank behaviour is tested by tests/test_parallel.py (one torchrun launch per world size).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

torch.set_num_threads(1)

sys.path.insert(0, str(Path(__file__).resolve().parent / "multirank"))

import common  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from pfppo_mega import parallel, ppo  # noqa: E402
from pfppo_mega.compat import megatron_cpu  # noqa: E402
from pfppo_mega.config.tree import ModelConfig  # noqa: E402
from pfppo_mega.kernels import available_backends, get_backend, shard_math, vocab_parallel_logprob_entropy  # noqa: E402
from pfppo_mega.models import passes, gpt, hf_io, reshard  # noqa: E402
from pfppo_mega.models.reshard import Split, Stage  # noqa: E402


@pytest.fixture(scope="module")
def world():
    info = parallel.init_parallel(tp=1, pp=1, seed=1234)
    yield info
    parallel.destroy_parallel()
    megatron_cpu.disable()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    return common.make_checkpoints(tmp_path_factory.mktemp("engine"))


# ----------------------------------------------------------------------------- first: no parallel state yet


def test_init_parallel_refuses_a_layout_before_starting_anything(monkeypatch):
    """Runs first in this file, before the module's parallel state exists."""
    assert parallel.current() is None, "parallel state is initialised at this point; test order changed"
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match=r"tp\(2\) \* pp\(1\) = 2 does not divide WORLD_SIZE\(3\)"):
        parallel.init_parallel(tp=2, pp=1, seed=0)
    assert parallel.current() is None and not torch.distributed.is_initialized()


# ----------------------------------------------------------------------------- vocab-parallel math


def _simulated_tp(backend, x: torch.Tensor, labels: torch.Tensor, vocab_size: int, tp: int, g_logp, g_ent,
                  temperature: float):
    """The vocab-parallel Function's forward and backward with the collectives done by hand over
    tp shards, on the backend's shard math."""
    shards = list(x.chunk(tp, dim=1))
    width = shards[0].shape[1]
    opts = [dict(vocab_start=r * width, vocab_size=vocab_size, temperature=temperature) for r in range(tp)]
    parts = [backend.logprob_entropy_partials(s, labels, **o) for s, o in zip(shards, opts)]
    combined = shard_math.combine_partials(parts)                               # the two all-reduces
    grad = torch.cat([backend.logprob_entropy_shard_backward(s, labels, combined=combined, grad_logp=g_logp,
                                                             grad_entropy=g_ent, **o)
                      for s, o in zip(shards, opts)], dim=1)
    return combined.logp, combined.entropy, grad


@pytest.mark.parametrize("backend", available_backends(), ids=lambda b: b.name)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vocab_parallel_math_matches_fp64_full_vocabulary(backend, tp):
    n, v, temperature = 10, 37, 0.7
    vp = reshard.padded_vocab_size(v, tp) + 8 * tp  # padding as megatron's make_vocab_size_divisible_by adds
    gen = torch.Generator().manual_seed(tp)
    x = 4.0 * torch.randn(n, v, generator=gen)
    x[2] = -30.0
    x[2, 5] = 30.0  # a row with all its mass on one token: one shard contributes ~0
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[3] = v - 1
    g_logp, g_ent = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    padded = torch.cat([x, torch.full((n, vp - v), 50.0)], dim=1)  # padding columns must not count
    logp, ent, grad = _simulated_tp(backend, padded, labels, v, tp, g_logp, g_ent, temperature)

    ref = x.double().requires_grad_(True)
    logq = F.log_softmax(ref / temperature, dim=-1)
    ref_logp, ref_ent = logq.gather(1, labels[:, None])[:, 0], -(logq.exp() * logq).sum(-1)
    (ref_logp * g_logp.double() + ref_ent * g_ent.double()).sum().backward()
    err = max((logp.double() - ref_logp).abs().max().item(), (ent.double() - ref_ent).abs().max().item(),
              (grad[:, :v].double() - ref.grad).abs().max().item())
    print(f"\n[{backend.name} tp{tp}] vocab-parallel math vs fp64: max |diff| {err:.2e}")
    assert err < 1e-5
    assert torch.count_nonzero(grad[:, v:]) == 0


@pytest.mark.parametrize("backend", available_backends(), ids=lambda b: b.name)
def test_vocab_parallel_function_single_shard_autograd_and_no_inplace(backend):
    n, v = 7, 19
    gen = torch.Generator().manual_seed(3)
    x = (2.0 * torch.randn(n, v, generator=gen)).requires_grad_(True)
    before = x.detach().clone()
    labels = torch.randint(0, v, (n,), generator=gen)
    logp, ent = vocab_parallel_logprob_entropy(x, labels, vocab_start=0, vocab_size=v, group=None, backend=backend)
    (logp.sum() + 0.5 * ent.sum()).backward()
    assert torch.equal(x.detach(), before)  # never written in place (megatron's cross entropy does)
    ref = before.double().requires_grad_(True)
    logq = F.log_softmax(ref, -1)
    (logq.gather(1, labels[:, None]).sum() - 0.5 * (logq.exp() * logq).sum()).backward()
    assert (x.grad.double() - ref.grad).abs().max() < 1e-6
    with pytest.raises(ValueError, match=r"labels must have shape \[N\] = \[7\]"):
        vocab_parallel_logprob_entropy(x, labels[:3], vocab_start=0, vocab_size=v, group=None, backend=backend)


# ----------------------------------------------------------------------------- reshard rules


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shard_layouts_follow_megatron_conventions(tp):
    heads, groups, d, hidden, ffn = 8, 4, 3, 5, 12
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n * d, hidden, generator=gen) for n in (heads, groups, groups))
    qkv = hf_io.fuse_qkv(q, k, v, heads=heads, groups=groups)
    gate, up = torch.randn(ffn, hidden, generator=gen), torch.randn(ffn, hidden, generator=gen)
    o = torch.randn(hidden, heads * d, generator=gen)
    for r in range(tp):
        # QKV: rank r holds query groups [r*g/tp, (r+1)*g/tp) with their query heads, key and value.
        g0, g1, per = r * groups // tp, (r + 1) * groups // tp, heads // groups
        expect = hf_io.fuse_qkv(q[g0 * per * d:g1 * per * d], k[g0 * d:g1 * d], v[g0 * d:g1 * d],
                                heads=(g1 - g0) * per, groups=g1 - g0)
        assert torch.equal(reshard.shard(qkv, reshard.split_of("decoder.layers.3.self_attention.linear_qkv.weight"),
                                         tp, r), expect)
        # fc1: cat(gate shard, up shard); o_proj: the same heads' input columns.
        fc1 = reshard.shard(torch.cat([gate, up]), Split.GLU_ROWS, tp, r)
        assert torch.equal(fc1, torch.cat([gate.chunk(tp)[r], up.chunk(tp)[r]]))
        assert torch.equal(reshard.shard(o, Split.COLUMNS, tp, r), o[:, g0 * per * d:g1 * per * d])
    for split, full in ((Split.ROWS, qkv), (Split.GLU_ROWS, torch.cat([gate, up])), (Split.COLUMNS, o),
                        (Split.REPLICATED, torch.randn(hidden))):
        shards = [reshard.shard(full, split, tp, r) for r in range(tp)]
        assert all(tuple(s.shape) == reshard.shard_shape(tuple(full.shape), split, tp) for s in shards)
        assert torch.equal(reshard.unshard(shards, split), full)


def test_split_rules_agree_with_megatron_parameter_attributes(world, ckpts):
    cfg, arch = common.model_config(ckpts["qwen2"])
    actor = gpt.build_actor(cfg, arch=arch)
    expected_dim = {Split.ROWS: 0, Split.GLU_ROWS: 0, Split.COLUMNS: 1}
    for name, p in actor.named_parameters():
        split = reshard.split_of(name)
        if getattr(p, "tensor_model_parallel", False):
            assert split is not Split.REPLICATED and p.partition_dim == expected_dim[split], name
        else:
            assert split is Split.REPLICATED, name


def test_stage_layers_and_names():
    s = Stage(1, 2, 4)
    assert list(s.layers) == [2, 3] and not s.first and s.last
    assert s.to_global("decoder.layers.1.mlp.linear_fc1.weight") == "decoder.layers.3.mlp.linear_fc1.weight"
    assert s.to_local("decoder.layers.2.input_layernorm.weight") == "decoder.layers.0.input_layernorm.weight"
    with pytest.raises(ValueError, match="not on pipeline stage 1"):
        s.to_local("decoder.layers.0.input_layernorm.weight")
    with pytest.raises(ValueError, match=r"num_layers\(5\) must be divisible by pp\(2\)"):
        Stage(0, 2, 5)
    assert [reshard.padded_vocab_size(51, tp) for tp in (1, 2, 4, 8)] == [51, 52, 52, 56]


# ----------------------------------------------------------------------------- loss shares


@pytest.mark.parametrize("mode", ppo.LOSS_AGG_MODES)
def test_shares_over_micro_batches_and_dp_sum_to_the_global_aggregate(mode):
    gen = torch.Generator().manual_seed(1)
    loss_mat = torch.randn(10, 6, generator=gen, dtype=torch.float64)
    mask = (torch.rand(10, 6, generator=gen) < 0.6).double()
    mask[4] = 0  # a row without tokens
    whole = ppo.agg_loss(loss_mat, mask, mode=mode)
    norm = passes.Normalizers(tokens=float(mask.sum()), rows=float((mask.sum(1) > 0).sum()))
    for split in ([10], [3, 3, 4], [1] * 10, [5, 5]):  # micro-batches (and DP ranks: the same rule)
        parts = torch.split(torch.arange(10), split)
        total = sum(passes.agg_loss_share(loss_mat[i], mask[i], norm, mode=mode) for i in parts)
        assert abs(total.item() - whole.item()) < 1e-12, split
    assert passes.share_scale(mask, norm, mode=mode) == 1.0


# ----------------------------------------------------------------------------- bad input


def test_layout_errors_name_every_factor():
    cfg = ModelConfig(num_layers=3, hidden_size=48, ffn_hidden_size=102, num_attention_heads=6,
                      num_query_groups=2, vocab_size=51, max_position_embeddings=32, rope_theta=1e4,
                      norm_epsilon=1e-5, tie_word_embeddings=False)
    with pytest.raises(ValueError) as e:
        gpt.check_layout(cfg, tp=4, pp=2)
    msg = str(e.value)
    for part in ("num_attention_heads(6) is not divisible by tp(4)", "num_query_groups(2) is not divisible by tp(4)",
                 "ffn_hidden_size(102) is not divisible by tp(4)", "num_layers(3) is not divisible by pp(2)"):
        assert part in msg
    gpt.check_layout(cfg, tp=2, pp=3)  # vocab 51 is padded, not refused
    with pytest.raises(ValueError, match=r"^tp\(2\) \* pp\(2\) = 4 does not divide WORLD_SIZE\(6\)$"):
        parallel.data_parallel_size(6, 2, 2)


def test_checkpoint_shapes_are_checked_before_any_weight_is_written(world, ckpts, tmp_path):
    src = ckpts["llama"]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((src / "config.json").read_text())
    sd = load_file(str(src / "model.safetensors"))
    sd["model.layers.2.mlp.up_proj.weight"] = torch.zeros(common.FFN // 2, common.HIDDEN)
    save_file(sd, str(bad / "model.safetensors"))
    cfg, _ = common.model_config(src)
    actor = gpt.build_actor(cfg)
    before = {n: p.detach().clone() for n, p in actor.named_parameters()}
    with pytest.raises(ValueError, match=r"model.layers.2.mlp.up_proj.weight: expected \(128, 64\), found \(64, 64\)"):
        hf_io.load_actor_from_hf(actor, bad)
    assert all(torch.equal(p, before[n]) for n, p in actor.named_parameters())


def test_qkv_bias_mismatch_is_refused(world, ckpts):
    cfg, arch = common.model_config(ckpts["qwen2"])
    assert arch.qkv_bias
    with pytest.raises(ValueError, match=r"has q/k/v biases but the model was built with qkv_bias=False"):
        hf_io.load_actor_from_hf(gpt.build_actor(cfg), ckpts["qwen2"])


# ----------------------------------------------------------------------------- Qwen2 at tp = 1


def test_qwen2_logits_export_and_critic_weights(world, ckpts, tmp_path):
    path = ckpts["qwen2"]
    cfg, arch = common.model_config(path)
    actor = gpt.build_actor(cfg, arch=arch)
    hf_io.load_actor_from_hf(actor, path)
    ids = common.ppo_batch().inputs.input_ids
    refs = load_file(str(path.parent / common.REFERENCES))
    logits = passes.forward_logits(actor, ids, micro_batch_size=3).double()
    err = (logits - refs["logits/qwen2"]).abs().max().item()
    print(f"\n[qwen2 tp1] logits max |megatron - transformers fp64| = {err:.2e}")
    assert err < 2e-5
    out = hf_io.export_hf(actor, cfg, tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["tie_word_embeddings"] is True
    original = load_file(str(path / "model.safetensors"))
    written = load_file(str(out / "model.safetensors"))
    assert sorted(written) == sorted(original) and all(torch.equal(written[n], original[n]) for n in original)
    critic = gpt.build_critic(cfg, arch=arch)
    hf_io.load_critic_trunk_from_hf(critic, path)
    pairs = dict(hf_io.gather_critic_weights(critic, cfg))
    assert pairs[hf_io.CRITIC_HEAD].shape == (1, common.HIDDEN) and "lm_head.weight" not in pairs
    assert torch.equal(pairs["model.layers.1.self_attn.q_proj.bias"], original["model.layers.1.self_attn.q_proj.bias"])


# ----------------------------------------------------------------------------- engine == trainer at tp = pp = dp = 1


def _trainer_policy_logp(model, inp, temperature, kernels):
    """The trainer's _policy_logp (pfppo_mega/trainer/loop.py), verbatim."""
    logits = gpt.actor_logits(model, inp.input_ids, inp.attention_mask)
    V = logits.shape[-1]
    sel = logits.gather(1, inp.resp_pos[..., None].expand(-1, -1, V))
    sel = sel / temperature
    logp, ent = kernels.logprob_entropy(sel.reshape(-1, V).contiguous(), inp.labels.reshape(-1))
    B, T = inp.labels.shape
    return logp.view(B, T), ent.view(B, T)


def _actor(path: Path):
    cfg, arch = common.model_config(path)
    actor = gpt.build_actor(cfg, arch=arch)
    hf_io.load_actor_from_hf(actor, path)
    return cfg, actor


@pytest.mark.parametrize("kernel_mode", ["torch", "auto"])
def test_forward_logp_entropy_and_values_equal_trainer_exactly(world, ckpts, kernel_mode):
    kernels = get_backend(kernel_mode)
    path = ckpts["llama"]
    cfg, actor = _actor(path)
    inp = common.ppo_batch().inputs
    with torch.no_grad():
        ref = _trainer_policy_logp(actor, inp, common.TEMPERATURE, kernels)
    # The temperature is folded into the kernel (x / T per element, as the trainer's division):
    # the same numbers, bit for bit.
    got = passes.forward_logp_entropy(actor, inp, temperature=common.TEMPERATURE, micro_batch_size=common.BATCH,
                                      kernels=kernels)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    # The default (pure torch) and in micro-batches: fp32 rounding only.
    vp = passes.forward_logp_entropy(actor, inp, temperature=common.TEMPERATURE, micro_batch_size=3)
    assert (vp[0] - ref[0]).abs().max() < 1e-5 and (vp[1] - ref[1]).abs().max() < 1e-5

    critic = gpt.build_critic(cfg)
    hf_io.load_critic_trunk_from_hf(critic, path)
    common.set_value_head(critic)
    with torch.no_grad():
        ref_v = gpt.critic_values(critic, inp.input_ids, inp.attention_mask).gather(1, inp.resp_pos)
    assert torch.equal(passes.forward_values(critic, inp, micro_batch_size=common.BATCH), ref_v)


def test_train_step_equals_trainer_backward_and_step_exactly(world, ckpts):
    """passes.train_step with one micro-batch == the trainer's loss.backward() + optimizer_step."""
    kernels = get_backend("torch")
    path = ckpts["llama"]
    batch = common.ppo_batch()
    inp, mask = batch.inputs, batch.inputs.response_mask
    runs = []
    for use_engine in (False, True):
        cfg, actor = _actor(path)
        ddp = gpt.wrap_ddp(actor)
        opt = gpt.build_optimizer(ddp, lr=common.LR, weight_decay=common.WEIGHT_DECAY, grad_clip=common.GRAD_CLIP)
        with torch.no_grad():
            old_logp = (_trainer_policy_logp(ddp, inp, common.TEMPERATURE, kernels)[0] + batch.logp_noise) * mask

        def loss_of(logp, entropy, m):
            out = kernels.policy_loss(logp, old_logp, batch.advantages, m, clip_ratio_low=common.CLIP_LOW,
                                      clip_ratio_high=common.CLIP_HIGH, loss_agg_mode="token-mean")
            return out.loss - common.ENTROPY_COEFF * ppo.agg_loss(entropy, m, mode="token-mean")

        ddp.train()
        if use_engine:
            res = passes.train_step(
                ddp, opt, inp,
                lambda logp, ent, mb: (loss_of(logp, ent, mb.inputs.response_mask)
                                       * passes.share_scale(mb.inputs.response_mask, mb.norm, mode="token-mean"), {}),
                temperature=common.TEMPERATURE, micro_batch_size=common.BATCH, kernels=kernels)
            loss, grad_norm = res.loss, res.grad_norm
        else:
            gpt.zero_grads(ddp, opt)
            logp, ent = _trainer_policy_logp(ddp, inp, common.TEMPERATURE, kernels)
            loss_t = loss_of(logp, ent, mask)
            loss_t.backward()
            loss, grad_norm = loss_t.item(), gpt.optimizer_step(ddp, opt).grad_norm
        runs.append((loss, grad_norm, {n: p.detach().clone() for n, p in actor.named_parameters()}))
    (l0, g0, w0), (l1, g1, w1) = runs
    assert l0 == l1 and g0 == g1
    assert all(torch.equal(w0[n], w1[n]) for n in w0)


def test_train_step_skips_a_non_finite_loss(world, ckpts):
    cfg, actor = _actor(ckpts["llama"])
    ddp = gpt.wrap_ddp(actor)
    opt = gpt.build_optimizer(ddp, lr=1e-2, weight_decay=0.0, grad_clip=1.0)
    before = {n: p.detach().clone() for n, p in actor.named_parameters()}
    res = passes.train_step(ddp, opt, common.ppo_batch().inputs,
                            lambda logp, ent, mb: (logp.sum() * float("nan"), {"x": 1.0}),
                            temperature=1.0, micro_batch_size=4)
    assert not res.update_successful and res.loss != res.loss and res.stats == {"x": 1.0}
    assert all(torch.equal(p, before[n]) for n, p in actor.named_parameters())
    with pytest.raises(TypeError, match="wrap_ddp"):
        passes.train_step(actor, opt, common.ppo_batch().inputs, lambda *a: None, temperature=1.0,
                          micro_batch_size=4)
    with pytest.raises(ValueError, match=r"0-dim loss share"):
        passes.train_step(ddp, opt, common.ppo_batch().inputs, lambda logp, ent, mb: (logp, {}),
                          temperature=1.0, micro_batch_size=4)
    with pytest.raises(ValueError, match=r"micro_batch_size\(0\)"):
        passes.forward_logp_entropy(actor, common.ppo_batch().inputs, temperature=1.0, micro_batch_size=0)
    bad = dataclasses.replace(common.ppo_batch().inputs)
    bad.attention_mask = bad.attention_mask.flip(1)
    with pytest.raises(ValueError, match="not right-padded"):
        passes.forward_values(actor, bad, micro_batch_size=2)


class _HostSyncs(torch.overrides.TorchFunctionMode):
    """Counts the reads of a tensor's value into Python (each one a device -> host sync on a GPU)."""

    READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__float__, torch.Tensor.__bool__,
             torch.Tensor.__int__}

    def __init__(self, active=lambda: True):
        super().__init__()
        self.count, self.active = 0, active

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            from pfppo_mega.trainer.instruments.devicecheck import _tensor_type

            return _tensor_type(args[0])  # megatron's type asserts, answered as the CPU layer answers them
        self.count += func in self.READS and self.active()
        return func(*args, **(kwargs or {}))


def test_the_update_reads_its_losses_once_not_per_micro_batch(world, ckpts, monkeypatch):
    """Issue 35: the loss callback read every micro-batch's share, stats and token count into Python
    (three host syncs per micro-batch, each stalling a GPU's queue), and share_scale one more. Now the
    host reads of a step do not grow with the number of micro-batches. (The label range check of the
    torch backend reads host labels only, never a device tensor: not counted.)"""
    from pfppo_mega.kernels import shard_math

    counting = []
    check = shard_math.check_labels

    def unread(*a, **k):  # a host-only check: on a GPU the labels are on the device and it reads nothing
        counting.append(False)
        try:
            return check(*a, **k)
        finally:
            counting.pop()

    monkeypatch.setattr(shard_math, "check_labels", unread)
    reads = {}
    for mbs in (8, 1):
        cfg, actor = _actor(ckpts["llama"])
        ddp = gpt.wrap_ddp(actor)
        opt = gpt.build_optimizer(ddp, lr=1e-3, weight_decay=0.0, grad_clip=1.0)
        with _HostSyncs(lambda: not counting) as syncs:
            passes.train_step(ddp, opt, common.ppo_batch().inputs,
                              lambda logp, ent, mb: ((logp * mb.inputs.response_mask).sum() * passes.share_scale(
                                  mb.inputs.response_mask, mb.norm, mode="token-mean", like=logp),
                                  {"x": logp.detach().mean()}),
                              temperature=1.0, micro_batch_size=mbs)
        reads[mbs] = syncs.count
    assert reads[1] == reads[8], reads  # 8 micro-batches read no more than 1
