#!/usr/bin/env bash
# One per node (srun --ntasks-per-node=1): torchrun with a c10d rendezvous on the first node of
# the allocation, per-node worker logs under $JOB_DIR/attempt<R>/node<N>/, then the program.
#
#   srun ... scripts/slurm/node_launch.sh NPROC_PER_NODE PROGRAM [ARGS...]
#   PROGRAM is a script path, or `-m module` for python -m.
#
# Environment (set by lib.sh in the batch script): PFPPO_PYTHON, RDZV_ENDPOINT, JOB_DIR, ATTEMPT;
# from srun: SLURM_JOB_NUM_NODES, SLURM_NODEID, SLURM_JOB_ID.
set -euo pipefail
nproc="$1"; shift
: "${PFPPO_PYTHON:?}" "${RDZV_ENDPOINT:?}" "${JOB_DIR:?}" "${ATTEMPT:?}"
log_dir="$JOB_DIR/attempt$ATTEMPT/node$SLURM_NODEID"
mkdir -p "$log_dir"
# --max-restarts=0: a failed worker ends the step; recovery is Slurm's requeue + checkpoint resume.
# --tee=3: each worker's stdout and stderr go to its file under log_dir and to the job log.
exec "$PFPPO_PYTHON" -m torch.distributed.run \
  --nnodes="$SLURM_JOB_NUM_NODES" \
  --nproc-per-node="$nproc" \
  --rdzv-backend=c10d \
  --rdzv-endpoint="$RDZV_ENDPOINT" \
  --rdzv-id="$SLURM_JOB_ID" \
  --max-restarts=0 \
  --log-dir="$log_dir" \
  --tee=3 \
  "$@"
