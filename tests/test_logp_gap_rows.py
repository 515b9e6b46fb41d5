"""rollout/logp_gap_* (the engine's log-probs against the trainer's, on the rows the current weights
wrote) is never silently absent: rollout/logp_gap_rows counts the rows it covered in every record,
0 when every row came from an older version (the asynchronous mode after its first step), summed over
the data-parallel ranks; `pfppo doctor` names a run where the check saw (almost) nothing."""

from types import SimpleNamespace

import torch

from pfppo_mega.doctor.rules import RULES_BY_NAME, Series
from pfppo_mega.trainer.metrics import aggregate_rank_metrics
from pfppo_mega.trainer.step_metrics import logp_gap


def _eb(on_policy, lengths, *, gap=1e-3, T=4):
    B = len(on_policy)
    mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).float()    # [B, T]
    old = torch.randn(B, T, generator=torch.Generator().manual_seed(0))
    behav = old + gap * torch.arange(1, B + 1, dtype=torch.float)[:, None]         # row i off by (i+1) gap
    return SimpleNamespace(on_policy=torch.tensor(on_policy), old_logp=old, behav_logp=behav,
                           inputs=SimpleNamespace(response_mask=mask))


def test_no_row_of_the_current_weights_is_logged_as_zero_rows():
    assert logp_gap(_eb([False, False, False], [4, 2, 3])) == {"rollout/logp_gap_rows": 0.0}


def test_the_gap_covers_only_the_current_weights_rows_and_counts_them():
    m = logp_gap(_eb([False, True, True, True], [4, 2, 0, 3]))                      # row 2 generated nothing
    assert m["rollout/logp_gap_rows"] == 2.0
    assert abs(m["rollout/logp_gap_max"] - 4e-3) < 1e-6                            # row 3's, not row 0's
    assert abs(m["rollout/logp_gap_mean"] - (2 * 2e-3 + 3 * 4e-3) / 5) < 1e-6


def test_the_update_path_counts_only_its_fresh_rows():
    eb = _eb([True, True], [3, 3])
    seen = SimpleNamespace(fresh=torch.tensor([True, False]), logp=eb.old_logp)
    assert logp_gap(eb, seen)["rollout/logp_gap_rows"] == 1.0


def test_rows_sum_over_the_data_parallel_ranks():
    out = aggregate_rank_metrics([{"rollout/logp_gap_rows": 3.0, "rollout/logp_gap_max": 1e-4},
                                  {"rollout/logp_gap_rows": 0.0}])
    assert out == {"rollout/logp_gap_rows": 3.0, "rollout/logp_gap_max": 1e-4}


def _series(rows):
    return {"rollout/logp_gap_rows": Series(list(range(1, len(rows) + 1)), [float(r) for r in rows])}


def test_doctor_names_a_run_whose_check_saw_nothing_after_the_first_step():
    rule = RULES_BY_NAME["engine_gap_unchecked"]
    v = rule.detect(_series([64, 0, 0, 0, 0]), {"algorithm": {"async_rl": {"enable": True}}})
    assert v.status == "finding" and v.steps == [2, 3, 4, 5]
    assert "0 in 4 of the 4 steps after the first" in v.evidence[0] and "algorithm.async_rl" in v.evidence[0]
    assert rule.detect(_series([64, 0, 8, 0, 0]), None).status == "healthy"      # 1 of 4 covered
    assert rule.detect(_series([64, 0, 0]), None).status == "not_checked"         # too few steps
    assert rule.detect({}, None).status == "not_checked"                          # a run from before the key
    checked = {**_series([64, 0, 0, 0, 0]),
               "rollout/logp_gap_check_rows": Series([1, 2, 3, 4, 5], [0.0, 0.0, 8.0, 0.0, 0.0])}
    assert rule.detect(checked, None).status == "healthy"                         # the periodic check ran
