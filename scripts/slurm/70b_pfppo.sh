#!/usr/bin/env bash
# PF-PPO on Llama-3-70B, 8 nodes x 8 GPUs (docs/scaling.md). From the repository root:
#
#   sbatch scripts/slurm/70b_pfppo.sh                                   # H200 (141 GB) layout
#   PFPPO_GPU=h100 PFPPO_CONFIG=configs/70b_pfppo_h100.yaml sbatch scripts/slurm/70b_pfppo.sh
#   SBATCH_PARTITION=gpu SBATCH_ACCOUNT=myproj sbatch scripts/slurm/70b_pfppo.sh
#
# Environment overrides (the batch script passes them to the planner and the trainer alike):
#   PFPPO_CONFIG          config file (default configs/70b_pfppo.yaml)
#   PFPPO_OVERRIDES       space-separated key.path=value overrides, e.g.
#                         "actor_rollout.model_path=/ckpt/sft logging.output_dir=/scratch/run1"
#   PFPPO_GPU             h200 (default) or h100: the memory plan's GPU; none: no GPU memory
#                         plan (a CPU cluster, e.g. configs/tiny_cpu.yaml on scripts/local_slurm.sh)
#   PFPPO_NPROC_PER_NODE  workers per node (default: the GPUs Slurm gave the node, else 8)
#   PFPPO_PLAN_ARGS       extra planner flags (hardware: --reserve-gib, --host-memory-gib, ...)
#   nodes, time, partition: sbatch's own options / SBATCH_* variables (sbatch --nodes=2 ...)
#
# One torchrun agent per node (srun --ntasks-per-node=1) starts one worker per GPU; the
# workers meet through a c10d rendezvous on the first node of the allocation. Before any GPU
# work the memory planner (`python -m pfppo_mega.planning`) checks the config against the
# hardware and ends the job with status 2 if the layout does not fit.
#
# Time limit and requeue: Slurm sends SIGUSR1 to this script 10 minutes before the time limit
# (--signal=B:USR1@600; Slurm may deliver it up to a minute late). The trainer then saves a
# checkpoint at its next step boundary and exits 0, and the job requeues itself and resumes
# (protocol in scripts/slurm/lib.sh). A step must therefore take well under 10 minutes,
# checkpoint save included, or the time limit arrives first (the job then ends TIMEOUT and
# can be resubmitted: it resumes from the last periodic checkpoint).
#
# Logs: %x-%j.out in the submit directory (all ranks, prefixed by torchrun), and per job
# runs/slurm/pfppo-70b-<jobid>/: state (start / usr1 / requeue / end lines), plan.json,
# attempt<R>/node<N>/ (each worker's stdout and stderr).
#
#SBATCH --job-name=pfppo-70b
#SBATCH --nodes=8
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=24:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@600
#SBATCH --output=%x-%j.out
#SBATCH --open-mode=append

source "${PFPPO_REPO:-$SLURM_SUBMIT_DIR}/scripts/slurm/lib.sh"
pfppo_job_init
pfppo_rdzv

CONFIG="${PFPPO_CONFIG:-configs/70b_pfppo.yaml}"
GPU="${PFPPO_GPU:-h200}"
# The training features (training.recompute, parallel.sequence_parallel,
# parallel.use_distributed_optimizer, model.layer_spec) are config keys: the planner below and the
# trainer read the same file and overrides, so they cannot disagree. PFPPO_PLAN_ARGS: hardware /
# runtime flags of the planner only (--reserve-gib, --host-memory-gib, ...).
PLAN_ARGS="${PFPPO_PLAN_ARGS:-}"
GPUS_PER_NODE="${PFPPO_NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}"
read -r -a OVERRIDES <<<"${PFPPO_OVERRIDES:-}"
cd "$REPO" || exit 2
pfppo_log "config $CONFIG${PFPPO_OVERRIDES:+ with overrides: $PFPPO_OVERRIDES}; $GPUS_PER_NODE worker(s) per node"

# --- communication and runtime settings (all ranks inherit them through srun)
export CUDA_DEVICE_MAX_CONNECTIONS=1        # megatron: keeps TP communication / compute ordering
export TORCH_NCCL_ASYNC_ERROR_HANDLING=3    # a failed or timed-out collective ends the step (then resume)
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
export TORCH_NCCL_AVOID_RECORD_STREAMS=1
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
# Site-specific, left to the cluster's defaults unless set: NCCL_SOCKET_IFNAME (bootstrap
# interface), NCCL_IB_HCA (InfiniBand adapters), NCCL_IB_GID_INDEX (RoCE).
# Not set on purpose: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (vLLM's sleep-mode
# allocator refuses it, and the rollout engine shares these processes).

# --- preflight: the layout must fit (no GPU needed; exit 2 lists every component over budget)
if [[ "$GPU" == none ]]; then
  pfppo_log "PFPPO_GPU=none: no GPU memory plan (CPU workers)"
elif ! "$PFPPO_PYTHON" -m pfppo_mega.planning "$CONFIG" "${OVERRIDES[@]}" --gpu "$GPU" \
     --nodes "$SLURM_JOB_NUM_NODES" --gpus-per-node "$GPUS_PER_NODE" $PLAN_ARGS --json "$JOB_DIR/plan.json"; then
  pfppo_log "the memory plan refuses $CONFIG on $SLURM_JOB_NUM_NODES x $GPUS_PER_NODE $GPU (see above)"
  pfppo_job_finish 2
fi

pfppo_run_step --kill-on-bad-exit=1 --ntasks-per-node=1 --cpus-per-task="$SLURM_CPUS_ON_NODE" \
  --gpus-per-node="$GPUS_PER_NODE" \
  "$REPO/scripts/slurm/node_launch.sh" "$GPUS_PER_NODE" \
  -m pfppo_mega train "$CONFIG" "${OVERRIDES[@]}"
pfppo_job_finish $?
