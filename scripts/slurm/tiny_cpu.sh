#!/usr/bin/env bash
# The structure of scripts/slurm/70b_pfppo.sh on a CPU cluster (e.g. the local one from
# scripts/local_slurm.sh): 2 nodes x 1 torchrun agent x 1 gloo worker, running the distributed
# smoke job scripts/slurm/smoke.py (world all-reduce, megatron TP=2 groups and a vocab-parallel
# cross entropy across the nodes, and the checkpoint / requeue protocol).
#
#   sbatch scripts/slurm/tiny_cpu.sh                 # from the repository root
#   SMOKE_STEPS=40 SMOKE_STEP_SECONDS=0.5 sbatch scripts/slurm/tiny_cpu.sh
#   scancel --signal=USR1 --batch JOBID              # checkpoint now, requeue, resume
#
#SBATCH --job-name=pfppo-tiny
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=1
#SBATCH --time=00:05:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@60
#SBATCH --output=%x-%j.out
#SBATCH --open-mode=append

source "${PFPPO_REPO:-$SLURM_SUBMIT_DIR}/scripts/slurm/lib.sh"
pfppo_job_init
pfppo_rdzv

export OMP_NUM_THREADS=1
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore:Transformer Engine and Apex}"  # megatron notices on CPU
export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-lo}"

pfppo_run_step --kill-on-bad-exit=1 --ntasks-per-node=1 \
  "$REPO/scripts/slurm/node_launch.sh" "${SMOKE_NPROC_PER_NODE:-1}" \
  "$REPO/scripts/slurm/smoke.py" --tp "${SMOKE_TP:-2}" \
  --steps "${SMOKE_STEPS:-3}" --step-seconds "${SMOKE_STEP_SECONDS:-0}"
pfppo_job_finish $?
