"""Ranks that disagree on a rollout raise on every rank (trainer/colocation/rollout_split.py).

The exchange is an all_gather: every rank sees every rank's request and output. A check of a
rank's own request only raised on the rank that differed while its replica's leader went on to
generate and waited forever in the next collective. Here each rank's view of the exchange is
played back (the all_gather replaced by the gathered list), for the leader and for the others."""

import pytest
import torch

from pfppo_mega.rollout import SamplingParams
from pfppo_mega.rollout.base import RolloutOutput
from pfppo_mega.trainer.colocation import rollout_split as rs

PROMPTS = [[1, 2, 3], [4, 5]]
OTHER = [[1, 2, 3], [4, 6]]


def _gathered(monkeypatch, values: list) -> None:
    def fake(out, obj, group=None):
        out[:] = values
    monkeypatch.setattr(rs.dist, "all_gather_object", fake)


def _layout(rank: int, dp_rank: int = 0, leader: bool = False) -> rs.SplitLayout:
    return rs.SplitLayout(world=2, rank=rank, rollout_tp=1, dp_rank=dp_rank, replica_leader=leader)


def _params(seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=2, eos_token_id=0, seed=seed)


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("case,request1,match", [
    ("prompts", (OTHER, 7), r"rank 1's request differs from its replica's leader \(dp_rank 0\) in its prompts "
                            r"\(row 1 first\)"),
    ("seed", (PROMPTS, 8), r"rank 1's request differs from its replica's leader \(dp_rank 0\) in its seed; "
                           r"seeds 8 vs 7"),
])
def test_a_replica_whose_ranks_disagree_raises_on_every_rank(monkeypatch, rank, case, request1, match):
    """TP2 (one replica, rank 0 its leader): rank 1 asks for other prompts or another seed (what a
    resume at a larger TP did). The leader raises too, naming rank 1, instead of generating."""
    _gathered(monkeypatch, [(0, True, PROMPTS, 7), (0, False, *request1)])
    mine = (PROMPTS, 7) if rank == 0 else request1
    with pytest.raises(rs.RolloutMismatchError, match=match):
        rs.plan_share(_layout(rank, leader=rank == 0), mine[0], _params(mine[1]))


def test_agreeing_ranks_plan_their_shares(monkeypatch):
    """The control: the same request on both ranks of a replica plans each engine's share."""
    _gathered(monkeypatch, [(0, True, PROMPTS, 7), (0, False, PROMPTS, 7)])
    share = rs.plan_share(_layout(1), PROMPTS, _params(7))
    assert [(d, first, p, prm.seed, prm.row_offset) for d, first, p, prm in share.calls] == [(0, 1, [[4, 5]], 7, 1)]


def _piece(d: int, first: int, version: int) -> tuple:
    z = torch.zeros(1, 2)
    return (d, first, z.long(), z, z, torch.ones(1, dtype=torch.long), torch.ones(1, dtype=torch.bool), version, "c")


def test_another_replicas_mixed_weights_raise_on_every_rank(monkeypatch):
    """DP2, one engine per rank: replica 1's rows were generated with two weight versions. Rank 0
    (replica 0, whose own rows agree) raises as well, so nobody waits for the other."""
    _gathered(monkeypatch, [(0, [_piece(0, 0, 3), _piece(1, 0, 3)]), (1, [_piece(1, 1, 4)])])
    share = rs.Share(calls=[(0, 0, [[1]], _params(1)), (1, 0, [[1]], _params(1))])
    out = RolloutOutput(prompts=[[1]], responses=torch.zeros(1, 2, dtype=torch.long), response_mask=torch.zeros(1, 2),
                        logprobs=torch.zeros(1, 2), lengths=torch.ones(1, dtype=torch.long),
                        finished=torch.ones(1, dtype=torch.bool), weight_version=3, weight_checksum="c")
    with pytest.raises(rs.RolloutMismatchError, match=r"replica 1's rows with different weights"):
        rs.assemble(_layout(0, dp_rank=0, leader=True), share, [out, out], [[1]], pad_token_id=0)
