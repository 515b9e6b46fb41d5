"""The version assignment: one decision about which weights generate what, the same on every rank.

Rank 0 decides which snapshot each prompt group uses and broadcasts the table, so every rank
(every node) generates with the same assignment; after generating, every engine reports the
version and weight checksum it generated with, and any rank that differs from rank 0 stops the
step with an error that names the rank and both versions. (Two nodes silently sampling from
different snapshots would corrupt the off-policy correction without any visible failure.)
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from pfppo_mega.rollout.weights import CHECKSUM_BYTES


class VersionMismatchError(RuntimeError):
    """Engines generated one step with different weights."""


def _distributed(group: Optional[dist.ProcessGroup]) -> bool:
    return dist.is_initialized() and dist.get_world_size(group) > 1


def broadcast_assignment(assign: Optional[torch.Tensor], n_groups: int,
                         group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Rank 0's snapshot index per prompt group ([n_groups] int64) on every rank."""
    if not _distributed(group):
        return assign
    from pfppo_mega.parallel import comm_device

    src = dist.get_global_rank(group, 0) if group is not None else 0
    if dist.get_rank() == src:
        table = assign.to(torch.int64)
        if table.shape != (n_groups,):
            raise ValueError(f"assignment has shape {tuple(table.shape)}, expected ({n_groups},)")
    else:
        table = torch.empty(n_groups, dtype=torch.int64)
    table = table.to(comm_device(group))
    dist.broadcast(table, src=src, group=group)
    return table.cpu()


def _encode(version: int, checksum: str) -> torch.Tensor:
    text = checksum[-CHECKSUM_BYTES:].rjust(CHECKSUM_BYTES)
    return torch.tensor([version] + [ord(c) for c in text], dtype=torch.int64)


def check_engine_versions(version: int, checksum: str, *, what: str = "generation",
                          group: Optional[dist.ProcessGroup] = None) -> None:
    """Every rank reports the (version, weight checksum) its engine generated ``what`` with;
    raises VersionMismatchError on every rank when any rank differs from the group's first rank."""
    if not _distributed(group):
        return
    from pfppo_mega.parallel import comm_device

    device = comm_device(group)
    mine = _encode(version, checksum).to(device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    reports = [(int(t[0]), "".join(chr(int(c)) for c in t[1:].cpu()).strip()) for t in everyone]
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(len(reports)))
    ref_v, ref_c = reports[0]
    bad = [(r, v, c) for r, (v, c) in zip(ranks, reports) if (v, c) != (ref_v, ref_c)]
    if bad:
        r, v, c = bad[0]
        raise VersionMismatchError(
            f"{what}: rank {r} generated with weight version {v} (checksum {c}), rank {ranks[0]} with version "
            f"{ref_v} (checksum {ref_c}); {len(bad)} rank(s) differ -- step stopped")
