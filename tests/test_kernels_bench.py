"""The kernel benchmark's baselines compute what the references compute, and its pieces run."""

import json

import pytest
import torch

from pfppo_mega import ppo
from pfppo_mega.bench import kernels as bench
from pfppo_mega.kernels import is_built
from pfppo_mega.kernels.testing import gae_inputs, labels_for, logits, policy_inputs, ragged_mask

torch.set_num_threads(1)


def test_gae_chunked_baseline_equals_reference():
    """On right-padded rows, the benchmark's inputs (a gap inside a row is cut there, not skipped as
    compute_gae skips a multi-turn gap: the baseline is not a multi-turn GAE)."""
    g = gae_inputs(5, 150, seed=60, dtype=torch.float64)
    mask = ragged_mask(5, 150, seed=60)
    got = bench.gae_chunked(g["rewards"], g["values"], mask, gamma=0.99, lam=0.95, chunk=16)
    want = ppo.compute_gae(g["rewards"], g["values"], mask, gamma=0.99, lam=0.95)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_verl_gae_loop_equals_reference_on_right_padded_rows():
    g = gae_inputs(5, 80, seed=63, dtype=torch.float64)
    mask = ragged_mask(5, 80, seed=63)
    adv, ret = bench.gae_verl_loop(g["rewards"], g["values"], mask, gamma=0.99, lam=0.95)
    want_adv, want_ret = ppo.compute_gae(g["rewards"], g["values"], mask, gamma=0.99, lam=0.95)
    torch.testing.assert_close(adv, want_adv)
    torch.testing.assert_close(ret[mask], want_ret[mask])


def test_verl_baselines_equal_reference():
    x = logits(4, 300, seed=61, dtype=torch.float64)
    labels = labels_for(x, seed=61)
    got = bench.logprob_entropy_verl(x, labels)
    torch.testing.assert_close(got[0], ppo.logprobs_from_logits(x, labels))
    torch.testing.assert_close(got[1], ppo.entropy_from_logits(x))

    inp = policy_inputs(4, 50, seed=62, dtype=torch.float64)
    mask = ragged_mask(4, 50, seed=62, empty_rows=False)
    opts = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, dual_clip_c=3.0)
    loss, clipfrac, _kl, clipfrac_lower = bench.policy_loss_verl(
        inp["logp"], inp["old_logp"], inp["advantages"], mask, **opts)
    ref = ppo.policy_loss(inp["logp"], inp["old_logp"], inp["advantages"], mask, **opts)
    torch.testing.assert_close(loss, ref.loss)
    torch.testing.assert_close(clipfrac, ref.pg_clipfrac)
    torch.testing.assert_close(clipfrac_lower, ref.pg_clipfrac_lower)


@pytest.mark.skipif(not is_built(), reason="pfppo_mega._C not built")
def test_run_case_table_and_json(tmp_path):
    torch.set_num_threads(1)
    result = bench.run_case(bench.gae_case("cpu", 8, 64), "cpu", copy_gbps=10.0, reps=2, loop_reps=1)
    assert result.fused_ms > 0 and result.bytes == 8 * 64 * (4 + 4 + 1 + 4 + 4)
    assert result.speedup["verl"] > 0 and result.baseline_ms["compile"] is None
    table = bench.format_table([result], 10.0, "cpu")
    assert "gae" in table and "x verl" in table
    targets = bench.check_targets([result], "cpu")
    assert [t.name for t in targets][:2] == ["gae x verl loop", "gae fraction of 2-thread memcpy"]
    json.dumps([t.__dict__ for t in targets])


def test_cli_arguments():
    args = bench.parse_args(["--quick", "--json", "out.json", "--device", "cpu"])
    assert args.quick and str(args.json) == "out.json" and args.device == "cpu"
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "tpu"])


def test_plans_and_report_json(tmp_path):
    cpu, gpu = bench.make_plan("cpu", quick=True), bench.make_plan("cuda", quick=False)
    assert cpu.gae_shape == (512, 4096) and cpu.logprob_rows < bench.make_plan("cpu", False).logprob_rows
    assert gpu.loss_shape == (8192, 8192)
    report = bench.Report(
        complete=False, git_sha="x", mode="quick", device="cpu", machine={}, allocator="a",
        copy_bandwidth_gbps=1.0, copy_ms=bench.Timing(1.0, 1.0, 1), results=[], targets=[],
        elapsed_s=0.0,
    )
    path = tmp_path / "sub" / "bench.json"
    bench.write_report(path, report)
    data = json.loads(path.read_text())
    assert data["complete"] is False and data["copy_ms"]["min_ms"] == 1.0
