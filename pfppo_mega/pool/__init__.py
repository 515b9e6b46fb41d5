"""PF-PPO behaviour-policy snapshot pool: snapshots, snapshot sampling, off-policy correction.

snapshots: SnapshotPool (host copies of recent policy weights, checksummed).
sampling, correction: pure torch.
"""

from pfppo_mega.pool.correction import (
    IS_MODES,
    ISStats,
    SnapshotBatchStats,
    behaviour_is_weights,
    per_snapshot_stats,
    tis_policy_loss,
)
from pfppo_mega.pool.sampling import (
    SAMPLING_METHODS,
    assign_snapshots,
    group_by_snapshot,
    recency_scale,
    snapshot_weights,
)
from pfppo_mega.pool.snapshots import (
    CHECKSUMS,
    Candidate,
    CorruptSnapshotError,
    HostMemoryError,
    Snapshot,
    SnapshotPool,
    SnapshotStats,
    check_host_memory,
    compute_checksum,
    named_tensors_nbytes,
    snapshot_due,
)
