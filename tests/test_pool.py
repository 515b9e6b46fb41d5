"""PF-PPO snapshot pool: eviction, private copies, checksums, memory check, snapshot sampling,
behaviour IS weights and per-snapshot statistics (references in float64 / plain Python)."""

import math

import pytest
import torch

from pfppo_mega.config.tree import IS_MODES as CONFIG_IS_MODES
from pfppo_mega.config.tree import POOL_SAMPLING
from pfppo_mega.pool import (
    CHECKSUMS,
    IS_MODES,
    SAMPLING_METHODS,
    CorruptSnapshotError,
    HostMemoryError,
    SnapshotPool,
    assign_snapshots,
    behaviour_is_weights,
    check_host_memory,
    compute_checksum,
    group_by_snapshot,
    per_snapshot_stats,
    snapshot_due,
    snapshot_weights,
    tis_policy_loss,
)
from pfppo_mega.ppo import policy_loss

torch.set_num_threads(1)
F64 = torch.float64


def weights_of(version: int) -> list[tuple[str, torch.Tensor]]:
    """A tiny model's named tensors whose values encode `version`."""
    g = torch.Generator().manual_seed(version)
    return [
        ("model.embed_tokens.weight", torch.randn(7, 4, generator=g) + version),
        ("model.layers.0.mlp.up_proj.weight", torch.randn(4, 4, generator=g).to(torch.bfloat16)),
        ("lm_head.weight", torch.randn(7, 4, generator=g)),
    ]


def new_pool(pool_size: int, **kw) -> SnapshotPool:
    return SnapshotPool(pool_size, check_memory=False, log=kw.pop("log", lambda _: None), **kw)


def assert_same_tensors(a, b):
    assert [n for n, _ in a] == [n for n, _ in b]
    for (_, x), (_, y) in zip(a, b):
        assert x.dtype == y.dtype and torch.equal(x, y)


def test_choice_lists_match_config():
    assert SAMPLING_METHODS == POOL_SAMPLING
    assert IS_MODES == CONFIG_IS_MODES


# ---------------------------------------------------------------------------- pool contents
def test_eviction_order_over_many_adds():
    pool = new_pool(3)
    for i in range(12):
        v = 10 * i
        pool.add(v, weights_of(v))
        expected = [10 * j for j in range(max(0, i - 2), i + 1)]
        assert pool.versions == expected and len(pool) == len(expected)
        for s in pool.snapshots:
            assert_same_tensors(s.tensors, weights_of(s.version))
    assert pool.bytes_total() == 3 * pool.bytes_per_snapshot
    # 7*4*4 + 4*4*2 + 7*4*4 bytes
    assert pool.bytes_per_snapshot == 112 + 32 + 112


def test_readd_replaces_in_place_with_fresh_stats():
    pool = new_pool(3)
    for v in (0, 10, 20):
        pool.add(v, weights_of(v))
    pool.record_samples(10, torch.tensor([1.0, 0.0]), 0.5)
    pool.add(10, weights_of(99))
    assert pool.versions == [0, 10, 20]  # no eviction, same position
    s = pool.snapshots[1]
    assert_same_tensors(s.tensors, weights_of(99))
    assert s.stats.n_samples == 0 and s.stats.kl_to_current is None


def test_fewer_than_pool_size_samples_only_what_is_there():
    pool = new_pool(5)
    pool.add(0, weights_of(0))  # the SFT policy
    g = torch.Generator().manual_seed(0)
    for method in SAMPLING_METHODS:
        cands = pool.candidates(current_version=3, include_current=False)
        probs = snapshot_weights(
            [c.version for c in cands], method=method, temperature=0.5, current_version=3,
            kl=[c.kl_to_current for c in cands], mean_reward=[c.mean_reward for c in cands],
        )
        assert probs.tolist() == [1.0]
        assert assign_snapshots(6, probs, g).tolist() == [0] * 6
    pool.add(10, weights_of(10))
    probs = snapshot_weights(pool.versions, method="uniform", temperature=1.0, current_version=12)
    assert probs.tolist() == [0.5, 0.5]


def test_candidates_include_current():
    pool = new_pool(3)
    pool.add(0, weights_of(0))
    pool.add(5, weights_of(5))
    pool.record_samples(0, torch.tensor([1.0, 3.0]), 0.25, current_version=7)
    cands = pool.candidates(current_version=7, include_current=True)
    assert [(c.version, c.kl_to_current, c.mean_reward) for c in cands] == [
        (0, 0.25, 2.0), (5, None, None), (7, 0.0, None)
    ]
    assert cands[2].snapshot is None and cands[0].snapshot is pool.snapshots[0]
    # a snapshot of the current version is the current policy: KL 0, no live duplicate
    cands = pool.candidates(current_version=5, include_current=True)
    assert [(c.version, c.kl_to_current) for c in cands] == [(0, 0.25), (5, 0.0)]


def test_record_samples_running_mean_and_unknown_version():
    pool = new_pool(2)
    pool.add(0, weights_of(0))
    assert pool.record_samples(0, torch.tensor([1.0, 0.0, 0.0]), None)
    assert pool.record_samples(0, torch.tensor([1.0]), 0.1, current_version=4)
    st = pool.snapshots[0].stats
    assert (st.n_samples, st.uses, st.kl_to_current, st.kl_measured_at) == (4, 2, 0.1, 4)
    assert st.reward_mean == pytest.approx(0.5, abs=1e-15)
    assert not pool.record_samples(42, torch.tensor([1.0]), 0.0)
    with pytest.raises(ValueError, match="finite"):
        pool.record_samples(0, torch.tensor([float("nan")]), None)


def test_copies_are_private_contiguous_detached():
    src = weights_of(1)
    base = torch.randn(4, 6, requires_grad=True)
    src.append(("model.norm.weight", base.t()))  # non-contiguous view of a leaf with grad
    pool = new_pool(2)
    snap = pool.add(1, src)
    before = [(n, t.detach().clone()) for n, t in src]
    with torch.no_grad():
        for _, t in src:
            t.add_(1)
    assert_same_tensors(snap.tensors, before)
    for (_, t), (_, s) in zip(snap.tensors, src):
        assert t.is_contiguous() and not t.requires_grad and t.device.type == "cpu"
        assert t.untyped_storage().data_ptr() != s.untyped_storage().data_ptr()
    assert pool.verify(snap)


def test_layout_mismatch_and_duplicate_names_rejected():
    pool = new_pool(2)
    pool.add(0, weights_of(0))
    bad = weights_of(1)
    bad[2] = ("lm_head.weight", torch.zeros(7, 5))
    with pytest.raises(ValueError, match=r"lm_head.weight.*\(7, 5\)"):
        pool.add(1, bad)
    with pytest.raises(ValueError, match="repeated"):
        pool.add(1, weights_of(1) + [("lm_head.weight", torch.zeros(7, 4))])
    assert pool.versions == [0]


def test_pin_memory_without_cuda_is_an_error_or_pins():
    if torch.cuda.is_available():
        pool = SnapshotPool(1, pin_memory=True, check_memory=False)
        snap = pool.add(0, [(n, t.cuda()) for n, t in weights_of(0)])
        assert all(t.is_pinned() for _, t in snap.tensors)
        assert_same_tensors(snap.tensors, weights_of(0))
    else:
        print("no CUDA: pinned-memory path not run; checking the error instead")
        with pytest.raises(ValueError, match="pin_memory=True needs CUDA"):
            SnapshotPool(1, pin_memory=True)
        assert SnapshotPool(1).pin_memory is False


# ------------------------------------------------------------------------------ integrity
@pytest.mark.parametrize("method", CHECKSUMS)
def test_checksum_detects_flipped_element_and_get_verified_refuses(method):
    logs = []
    pool = new_pool(3, checksum=method, log=logs.append)
    for v in (0, 1, 2):
        pool.add(v, weights_of(v))
    snap = pool.get_verified(1)
    assert pool.verify(snap) and pool.n_corrupt == 0
    bits = snap.tensors[0][1].view(torch.int32)
    bits[3, 2] ^= 1  # one flipped low mantissa bit
    assert not pool.verify(snap)
    with pytest.raises(CorruptSnapshotError, match="version 1"):
        pool.get_verified(1)
    assert pool.versions == [0, 2] and pool.n_corrupt == 1
    assert len(logs) == 1 and "version 1" in logs[0] and "evicted" in logs[0]
    assert pool.get_verified(2) is pool.snapshots[1]
    with pytest.raises(KeyError, match=r"version 1 .*\[0, 2\]"):
        pool.get_verified(1)


@pytest.mark.parametrize("method", CHECKSUMS)
def test_checksum_covers_names_shapes_dtypes(method):
    t = torch.arange(12, dtype=torch.float32)
    base = compute_checksum([("a", t)], method)
    assert compute_checksum([("a", t.clone())], method) == base
    assert compute_checksum([("b", t)], method) != base
    assert compute_checksum([("a", t.reshape(3, 4))], method) != base
    assert compute_checksum([("a", t.view(torch.int32))], method) != base
    swapped = compute_checksum([("b", t), ("a", t)], method)
    assert compute_checksum([("a", t), ("b", t)], method) != swapped


def test_host_memory_check_message():
    with pytest.raises(HostMemoryError) as err:
        check_host_memory(5, 12_300_000, available=40_000_000)
    msg = str(err.value)
    assert "pool_size(5) x 12.3 MB = 61.5 MB" in msg and "40.0 MB available" in msg
    assert isinstance(err.value, MemoryError)
    check_host_memory(5, 8_000_000, available=40_000_000)  # exactly fits
    with pytest.raises(HostMemoryError, match=r"\(4\) x 28.0 GB = 112.0 GB .* 64.0 GB available"):
        check_host_memory(4, 28_000_000_000, available=64_000_000_000)


def test_first_add_checks_host_memory():
    huge = [("w", torch.zeros(1))]
    pool = SnapshotPool(2**62, log=lambda _: None)  # 4 bytes x 2**62 snapshots cannot fit
    with pytest.raises(HostMemoryError, match="pool_size"):
        pool.add(0, huge)
    assert len(pool) == 0


def test_snapshot_due():
    assert [s for s in range(25) if snapshot_due(s, 10)] == [0, 10, 20]
    assert all(snapshot_due(s, 1) for s in range(5))
    with pytest.raises(ValueError, match="snapshot_interval=0"):
        snapshot_due(3, 0)


# ------------------------------------------------------------------------------- sampling
def softmax_ref(xs):
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    return [x / sum(e) for x in e]


def sw(versions, method, temperature=1.0, current=20, kl=None, reward=None):
    probs = snapshot_weights(
        versions, method=method, temperature=temperature, current_version=current,
        kl=kl, mean_reward=reward,
    )
    return probs.tolist()


def close(xs):
    return pytest.approx(xs, abs=1e-14)


def test_uniform_and_recency_hand_computed():
    assert sw([0, 10, 20], "uniform", 0.1) == close([1 / 3] * 3)
    # scale = (20 - 0) / 2 = 10 -> ages in intervals [2, 1, 0]
    assert sw([0, 10, 20], "recency", 1.0) == close(softmax_ref([-2.0, -1.0, 0.0]))
    assert sw([0, 10, 20], "recency", 2.0) == close(softmax_ref([-1.0, -0.5, 0.0]))
    # current beyond the newest: a common shift, same probabilities
    assert sw([0, 10, 20], "recency", 1.0, current=27) == close(softmax_ref([-2.0, -1.0, 0.0]))
    # irregular spacing: scale = (9 - 0) / 3 = 3
    ref = softmax_ref([-6.0, -16 / 3, -8 / 3, 0.0])
    assert sw([0, 1, 5, 9], "recency", 0.5, current=9) == close(ref)
    # spacing below 1 version: scale 1
    assert sw([4, 5], "recency", 1.0, current=5) == close(softmax_ref([-1.0, 0.0]))


def test_kl_and_reward_hand_computed_with_unknowns():
    kl = [0.3, None, 0.1]  # None -> min known = 0.1
    assert sw([0, 1, 2], "kl", 0.1, kl=kl) == close(softmax_ref([-3.0, -1.0, -1.0]))
    assert sw([0, 1, 2], "kl", 1.0, kl=[None, None, None]) == close([1 / 3] * 3)
    reward = [1.0, None, 0.0]  # None -> max known = 1.0
    assert sw([0, 1, 2], "reward", 0.5, reward=reward) == close(softmax_ref([2.0, 2.0, 0.0]))
    assert sw([0, 1], "reward", 2.0, reward=[-1.0, 1.0]) == close(softmax_ref([-0.5, 0.5]))


def test_temperature_sharpens_and_extremes_stay_finite():
    rewards = [0.0, 0.5, 1.0]
    best = [sw([0, 1, 2], "reward", t, reward=rewards)[2] for t in (10.0, 1.0, 0.1)]
    assert best[0] < best[1] < best[2]
    assert sw([0, 1, 2], "kl", 1e-300, kl=[1e300, -1e300, 0.0]) == [0.0, 1.0, 0.0]
    hot = sw([0, 1, 2], "reward", 1e300, reward=[1e300, -1e300, 0.0])
    assert hot == close(softmax_ref([0.0, -2.0, -1.0]))
    tied = sw([0, 1, 2], "reward", 1e-200, reward=[1.0, 1.0, 0.0])
    assert tied == [0.5, 0.5, 0.0]


def test_snapshot_weights_errors():
    with pytest.raises(ValueError, match="method='best'"):
        sw([0], "best")
    for t in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=f"temperature={t}"):
            sw([0, 1], "uniform", t)
    with pytest.raises(ValueError, match="len\\(kl\\)=1"):
        sw([0, 1], "kl", kl=[0.1])
    with pytest.raises(ValueError, match=r"kl\[1\]=nan"):
        sw([0, 1], "kl", kl=[0.1, float("nan")])
    with pytest.raises(ValueError, match="no candidate"):
        sw([], "uniform")


def test_assignment_frequencies_match_probabilities():
    probs = torch.tensor([0.5, 0.3, 0.0, 0.2], dtype=F64)
    n = 20000
    assign = assign_snapshots(n, probs, torch.Generator().manual_seed(1234))
    assert assign.dtype == torch.int64 and assign.shape == (n,)
    counts = torch.bincount(assign, minlength=4).tolist()
    for c, p in zip(counts, probs.tolist()):
        assert abs(c - n * p) <= 5 * math.sqrt(n * p * (1 - p)), (counts, probs)
    assert counts[2] == 0
    again = assign_snapshots(n, probs, torch.Generator().manual_seed(1234))
    assert torch.equal(assign, again)
    assert assign_snapshots(0, probs, torch.Generator()).shape == (0,)
    with pytest.raises(ValueError, match="must be finite, >= 0"):
        assign_snapshots(3, torch.tensor([0.5, -0.1]), torch.Generator())
    with pytest.raises(ValueError, match="positive sum"):
        assign_snapshots(3, torch.zeros(2), torch.Generator())


def test_step_assignment_draws_once_per_step_with_the_same_probabilities():
    probs = torch.tensor([0.6, 0.1, 0.3], dtype=F64)
    g = torch.Generator().manual_seed(7)
    steps = [assign_snapshots(12, probs, g, per="step") for _ in range(6000)]
    assert all(a.shape == (12,) and a.dtype == torch.int64 and bool((a == a[0]).all()) for a in steps)
    counts = torch.bincount(torch.stack([a[0] for a in steps]), minlength=3).tolist()
    for c, p in zip(counts, probs.tolist()):  # across steps the mixture is Categorical(probs)
        assert abs(c - 6000 * p) <= 5 * math.sqrt(6000 * p * (1 - p)), (counts, probs)
    assert assign_snapshots(0, probs, g, per="step").shape == (0,)
    with pytest.raises(ValueError, match=r"per='batch' must be one of \('group', 'step'\)"):
        assign_snapshots(3, probs, g, per="batch")


def test_group_by_snapshot_covers_every_group_once():
    probs = torch.tensor([0.2, 0.0, 0.5, 0.3])
    assign = assign_snapshots(37, probs, torch.Generator().manual_seed(5))
    groups = group_by_snapshot(assign)
    assert list(groups) == sorted(groups) and 1 not in groups
    flat = sorted(g for gs in groups.values() for g in gs)
    assert flat == list(range(37))
    for k, gs in groups.items():
        assert gs == sorted(gs) and all(assign[g].item() == k for g in gs)
    assert group_by_snapshot(torch.tensor([2, 0, 2, 2])) == {0: [1], 2: [0, 2, 3]}


# ------------------------------------------------------------------------- IS correction
# rows: off-policy, on-policy, off-policy with padding; log w = prox - behav
LOG_W = [
    [0.0, math.log(3.0), math.log(0.5), math.log(1.25)],
    [math.log(5.0), -1.0, 0.3, 0.0],
    [math.log(1.5), math.log(2.5), 99.0, -99.0],  # last two are padding
]
MASK = [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]]
ON_POLICY = [False, True, False]
CLIP = 2.0


def is_inputs(dtype=torch.float32):
    behav = torch.tensor(
        [[-1.0, -2.0, -0.5, -3.0], [-0.2, -1.5, -2.5, -0.1], [-0.7, -1.1, -0.3, -0.4]], dtype=F64
    )
    prox = behav + torch.tensor(LOG_W, dtype=F64)
    return prox.to(dtype), behav.to(dtype), torch.tensor(MASK, dtype=dtype), torch.tensor(ON_POLICY)


def is_reference(mode):
    """Plain-Python weights, mask_out and stats."""
    W, M, trunc = [], [], 0
    for b, row in enumerate(LOG_W):
        wr, mr = [], []
        for t, lw in enumerate(row):
            real = MASK[b][t] == 1
            w = math.exp(lw)
            if not real:
                wr.append(0.0), mr.append(0)
            elif ON_POLICY[b]:
                wr.append(1.0), mr.append(1)
            elif w > CLIP:
                trunc += 1
                wr.append(0.0 if mode == "mask" else CLIP), mr.append(0 if mode == "mask" else 1)
            else:
                wr.append(w), mr.append(1)
        W.append(wr), M.append(mr)
    applied = [W[b][t] for b in range(3) for t in range(4) if MASK[b][t]]
    n = len(applied)
    s1, s2 = sum(applied), sum(a * a for a in applied)
    return W, M, dict(mean=s1 / n, max=max(applied), frac_truncated=trunc / n, ess=s1 * s1 / s2 / n)


@pytest.mark.parametrize("mode", IS_MODES)
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_is_weights_hand_computed(mode, dtype):
    prox, behav, mask, on = is_inputs(dtype)
    w, m, st = behaviour_is_weights(prox, behav, mask, mode=mode, is_clip=CLIP, on_policy=on)
    W, M, ref = is_reference(mode)
    tol = 1e-6 if dtype == torch.float32 else 1e-13
    assert w.dtype == dtype and m.dtype == dtype and not w.requires_grad
    assert torch.allclose(w.double(), torch.tensor(W, dtype=F64), atol=tol, rtol=0), (w, W)
    assert m.tolist() == M
    for k, v in ref.items():
        assert getattr(st, k) == pytest.approx(v, abs=tol), k
    # on-policy row: exactly 1.0 on every real token, whatever the log-prob gap (0.3 here)
    assert torch.equal(w[1, :3], torch.ones(3, dtype=dtype))


def test_hand_example_figures():
    # truncate: real weights [1, 2, 0.5, 1.25 | 1, 1, 1 | 1.5, 2] -> n=9, sum 11.25, sum sq 16.0625
    prox, behav, mask, on = is_inputs(F64)
    _, _, st = behaviour_is_weights(prox, behav, mask, mode="truncate", is_clip=CLIP, on_policy=on)
    assert st.mean == pytest.approx(11.25 / 9) and st.max == pytest.approx(2.0)
    assert st.ess == pytest.approx(11.25**2 / 16.0625 / 9)
    assert st.frac_truncated == pytest.approx(2 / 9)
    # mask: [1, 0, 0.5, 1.25 | 1, 1, 1 | 1.5, 0] -> sum 7.25, sum sq 8.0625
    _, _, st = behaviour_is_weights(prox, behav, mask, mode="mask", is_clip=CLIP, on_policy=on)
    assert st.ess == pytest.approx(7.25**2 / 8.0625 / 9) and st.mean == pytest.approx(7.25 / 9)


def test_is_weights_without_on_policy_and_ess_of_equal_weights():
    prox, behav, mask, _ = is_inputs(F64)
    w, _, _ = behaviour_is_weights(prox, behav, mask, mode="truncate", is_clip=CLIP)
    assert w[1, 0].item() == pytest.approx(CLIP) and w[1, 1].item() == pytest.approx(math.exp(-1.0))
    equal = behav + math.log(1.5)
    w, m, st = behaviour_is_weights(equal, behav, mask, mode="mask", is_clip=CLIP)
    assert st.ess == pytest.approx(1.0, abs=1e-14) and st.mean == pytest.approx(1.5)
    assert st.frac_truncated == 0.0 and torch.equal(m, mask)
    empty = torch.zeros_like(mask)
    _, _, st = behaviour_is_weights(prox, behav, empty, mode="tis", is_clip=CLIP)
    assert (st.mean, st.max, st.frac_truncated, st.ess) == (0.0, 0.0, 0.0, 0.0)


def test_is_weights_edge_values_and_errors():
    behav = torch.tensor([[float("-inf"), -1.0, float("nan")]])
    prox = torch.tensor([[-1.0, float("-inf"), float("nan")]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # NaN only in padding: ignored
    w, m, _ = behaviour_is_weights(prox, behav, mask, mode="truncate", is_clip=CLIP)
    assert w.tolist() == [[CLIP, 0.0, 0.0]]
    w, m, _ = behaviour_is_weights(prox, behav, mask, mode="mask", is_clip=CLIP)
    assert w.tolist() == [[0.0, 0.0, 0.0]] and m.tolist() == [[0.0, 1.0, 0.0]]
    with pytest.raises(ValueError, match="NaN on a real token"):
        behaviour_is_weights(prox, behav, torch.ones(1, 3), mode="truncate", is_clip=CLIP)
    with pytest.raises(ValueError, match="mode='clip'"):
        behaviour_is_weights(prox, behav, mask, mode="clip", is_clip=CLIP)
    with pytest.raises(ValueError, match="is_clip=1.0"):
        behaviour_is_weights(prox, behav, mask, mode="mask", is_clip=1.0)
    with pytest.raises(ValueError, match=r"mask.shape=\(1, 2\)"):
        behaviour_is_weights(prox, behav, mask[:, :2], mode="mask", is_clip=CLIP)
    with pytest.raises(ValueError, match=r"on_policy .* shape \[1\]"):
        two = torch.ones(2, dtype=torch.bool)
        behaviour_is_weights(prox, behav, mask, mode="mask", is_clip=CLIP, on_policy=two)


@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_pool_of_one_every_step_is_bit_identical_to_ppo(mode):
    """pool_size=1, snapshot_interval=1: every row on-policy -> loss and gradient of plain PPO."""
    g = torch.Generator().manual_seed(3)
    prox = -torch.rand(4, 6, generator=g) * 3
    behav = prox + 0.05 * torch.randn(4, 6, generator=g)  # engine / trainer numeric gap
    adv = torch.randn(4, 6, generator=g)
    mask = (torch.rand(4, 6, generator=g) > 0.2).float()
    on = torch.ones(4, dtype=torch.bool)
    w, m, st = behaviour_is_weights(prox, behav, mask, mode=mode, is_clip=1.01, on_policy=on)
    assert torch.equal(m, mask) and st.frac_truncated == 0.0
    out = {}
    for name, is_w, msk in (("ppo", None, mask), ("pool", w, m)):
        noise = torch.randn(4, 6, generator=torch.Generator().manual_seed(9))
        logp = (prox + 0.1 * noise).requires_grad_()
        res = policy_loss(
            logp, prox, adv, msk,
            clip_ratio_low=0.2, clip_ratio_high=0.2, dual_clip_c=3.0, is_weights=is_w,
        )
        res.loss.backward()
        out[name] = (res.loss.detach(), logp.grad)
    assert torch.equal(out["ppo"][0], out["pool"][0]) and torch.equal(out["ppo"][1], out["pool"][1])


def test_tis_policy_loss_value_and_gradient():
    behav = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.9, -4.0]], dtype=F64)
    log_r = torch.tensor([[0.0, math.log(3.0), -0.7], [math.log(1.5), 50.0, 0.0]], dtype=F64)
    adv = torch.tensor([[1.0, -2.0, 0.5], [-1.0, 3.0, 7.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=F64)
    logp = (behav + log_r).requires_grad_()
    loss = tis_policy_loss(logp, behav, adv, mask, is_clip=CLIP)
    rho = [[min(math.exp(x), CLIP) for x in row] for row in log_r.tolist()]
    rows = zip(adv.tolist(), rho, mask.tolist())
    ref = [[-a * r * m for a, r, m in zip(ar, rr, mr)] for ar, rr, mr in rows]
    ref = torch.tensor(ref, dtype=F64)
    assert torch.allclose(loss.detach(), ref, atol=1e-13, rtol=0), (loss, ref)
    loss.sum().backward()
    assert torch.allclose(logp.grad, ref, atol=1e-13, rtol=0)  # d pg / d logp = -A * rho


# ---------------------------------------------------------------------- per-snapshot stats
def test_per_snapshot_stats_hand_computed():
    prox, behav, mask, on = is_inputs(F64)
    w, _, _ = behaviour_is_weights(prox, behav, mask, mode="truncate", is_clip=CLIP, on_policy=on)
    versions = torch.tensor([10, 20, 10])
    rewards = torch.tensor([1.0, 0.5, 0.0])
    out = per_snapshot_stats(versions, rewards, w, mask, behav, prox, is_clip=CLIP, on_policy=on)
    assert list(out) == [10, 20]
    a, b = out[10], out[20]
    # version 10: rows 0 and 2, 6 real tokens, applied [1, 2, 0.5, 1.25, 1.5, 2], 2 truncated
    lw10 = LOG_W[0] + LOG_W[2][:2]
    assert (a.count, a.reward_mean) == (2, 0.5)
    assert a.kl_to_current == pytest.approx(-sum(lw10) / 6, abs=1e-13)
    assert a.is_mean == pytest.approx(8.25 / 6) and a.is_max == pytest.approx(2.0)
    assert a.frac_truncated == pytest.approx(2 / 6)
    assert a.ess == pytest.approx(8.25**2 / 13.0625 / 6)
    # version 20: the on-policy row; KL still measures the raw gap, weights are 1
    assert (b.count, b.reward_mean, b.is_mean, b.is_max) == (1, 0.5, 1.0, 1.0)
    assert (b.frac_truncated, b.ess) == (0.0, 1.0)
    assert b.kl_to_current == pytest.approx(-sum(LOG_W[1][:3]) / 3, abs=1e-13)
    with pytest.raises(ValueError, match=r"versions.shape=\(2,\)"):
        per_snapshot_stats(versions[:2], rewards, w, mask, behav, prox, is_clip=CLIP)


TINY_RUN = {
    "model": {"num_layers": 1, "hidden_size": 32, "ffn_hidden_size": 64, "num_attention_heads": 2,
              "num_query_groups": 1, "vocab_size": 16, "max_position_embeddings": 24,
              "rope_theta": 10000.0, "norm_epsilon": 1e-5, "tie_word_embeddings": False},
    "data": {"num_digits": 1, "eval_size": 8, "max_prompt_length": 8},
    "training": {"rollout_batch_size": 8, "batch_size": 8, "lr": 3e-4, "total_training_steps": 9, "seed": 2,
                 "num_threads": 1},
    "algorithm": {"max_response_length": 4, "use_pf_ppo": True,
                  "pool": {"pool_size": 3, "snapshot_interval": 2, "sampling": "reward", "include_current": True,
                           "sampling_temperature": 0.5}},
    "logging": {"eval_interval": 0, "tensorboard": False, "plots": False, "progress": False},
    "checkpoint": {"export_hf": False, "resume": False},
    "sft": {"steps": 10, "batch_size": 16, "max_seconds": 0},
}


def test_trainer_flow(tmp_path):
    """The real trainer's per-step pool flow (pool_size 3, a snapshot every 2 steps, reward-weighted
    sampling with the live weights offered): which versions are held, that every generated row is
    attributed to one behaviour policy, and that the pool's reward statistics are exactly the
    rewards of the rows each snapshot generated."""
    import json

    from pfppo_mega.config import load_config_dict
    from pfppo_mega.sft import run_sft
    from pfppo_mega.trainer.loop import PPOTrainer

    d = json.loads(json.dumps(TINY_RUN))
    d["sft"]["output_dir"] = str(tmp_path / "sft")
    d["actor_rollout"] = {"model_path": str(tmp_path / "sft")}
    d["logging"]["output_dir"] = str(tmp_path / "run")
    run_sft(load_config_dict(d), log=lambda *_: None)
    tr = PPOTrainer(load_config_dict(d), log=lambda *_: None)
    rows_by_version: dict[int, int] = {}
    reward_by_version: dict[int, float] = {}
    step_versions: list[set[int]] = []
    score = tr.score

    def spy(rb):  # the real score phase; records which version generated each row and its reward
        sb = score(rb)
        step_versions.append(set(rb.versions.tolist()))
        for v, r in zip(rb.versions.tolist(), sb.raw_scores.tolist()):
            rows_by_version[v] = rows_by_version.get(v, 0) + 1
            reward_by_version[v] = reward_by_version.get(v, 0.0) + r
        return sb

    tr.score = spy
    for step in range(9):
        held = list(tr.run.strategies.behaviour.pool.versions)
        m = tr.train_step()
        assert held == [v for v in range(0, step + 1, 2)][-3:]  # snapshots at 0, 2, 4, ...: the 3 newest
        live = step not in held  # the current version is not a snapshot: include_current offers it
        n_cands = len(held) + live
        assert sum(m[f"pool/slot{k}/prob"] for k in range(n_cands)) == pytest.approx(1.0)
        assert f"pool/slot{n_cands}/prob" not in m
        assert sum(m[k] for k in m if k.startswith("pool/snap") and k.endswith("/count")) == 8
        assert step_versions[-1] <= set(held) | ({step} if live else set())
    assert tr.run.strategies.behaviour.pool.versions == [4, 6, 8] and tr.run.strategies.behaviour.pool.n_corrupt == 0
    for snap in tr.run.strategies.behaviour.pool.snapshots:  # stats are exactly the rows each held snapshot generated
        assert snap.stats.n_samples == rows_by_version.get(snap.version, 0)
        assert snap.stats.reward_sum == pytest.approx(reward_by_version.get(snap.version, 0.0))
    assert sum(s.stats.n_samples for s in tr.run.strategies.behaviour.pool.snapshots) > 0


def test_is_stats_are_those_of_the_global_batch_under_dp():
    """Two DP "ranks" (threads exchanging through a barrier, as ranks do through a collective) each
    hold half the rows; with the reductions every rank reports the whole batch's ISStats."""
    import threading

    g = torch.Generator().manual_seed(21)
    prox = -torch.rand(6, 5, generator=g, dtype=F64)
    behav = prox - torch.randn(6, 5, generator=g, dtype=F64)
    mask = (torch.rand(6, 5, generator=g) > 0.2).to(F64)
    whole = behaviour_is_weights(prox, behav, mask, mode="truncate", is_clip=2.0)[2]
    barrier = threading.Barrier(2)
    slots: list = [None, None]

    def exchange(rank, combine):
        def red(t):
            slots[rank] = t.clone()
            barrier.wait()
            out = combine(slots[0], slots[1])
            barrier.wait()
            return out
        return red

    rows = [slice(0, 2), slice(2, 6)]  # unequal shares: an average of the ranks' stats would be off
    got: list = [None, None]

    def run(r):
        got[r] = behaviour_is_weights(prox[rows[r]], behav[rows[r]], mask[rows[r]], mode="truncate", is_clip=2.0,
                                      reduce_sum=exchange(r, torch.add),
                                      reduce_max=exchange(r, torch.maximum))[2]

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for st in got:
        for k in ("mean", "max", "frac_truncated", "ess"):
            assert getattr(st, k) == pytest.approx(getattr(whole, k), abs=1e-12), k
    local = [behaviour_is_weights(prox[r], behav[r], mask[r], mode="truncate", is_clip=2.0)[2] for r in rows]
    assert abs((local[0].mean + local[1].mean) / 2 - whole.mean) > 1e-3  # the unweighted mean is off
