# Shared by the Slurm batch scripts of this directory (sourced, not run). See docs/scaling.md.
#
# Job life cycle of scripts/slurm/70b_pfppo.sh (any config: the 70B ones, or configs/tiny_cpu.yaml on CPUs):
#
#   pfppo_job_init        REPO, JOB_DIR (runs/slurm/<name>-<jobid>/), ATTEMPT (restart count),
#                         STOP_FILE, STATE_FILE; traps USR1 (checkpoint request) and TERM
#   pfppo_rdzv            RDZV_ENDPOINT = <first node of the allocation>:<port>
#   pfppo_run_step ARGS   `srun ARGS` in the background, waiting through trapped signals
#   pfppo_job_finish RC   requeue the job if a checkpoint was requested and the step exited 0
#
# Checkpoint-and-requeue protocol (what the trainer must do):
#   Slurm sends SIGUSR1 to this batch shell (`#SBATCH --signal=B:USR1@<seconds>`) some time
#   before the job's time limit (or an operator runs `scancel --signal=USR1 --batch JOBID`).
#   The trap creates $PFPPO_STOP_FILE. The trainer, at every step boundary, has rank 0 test
#   whether that file exists and broadcasts the answer to all ranks (a shared decision: ranks
#   checking the file on their own could stop at different steps and hang in a collective);
#   when it is set, every rank saves the checkpoint of the finished step and exits 0. When the
#   step then ends with status 0 and the stop file exists, this script runs
#   `scontrol requeue $SLURM_JOB_ID`: the same job id starts again from the top, ATTEMPT
#   (SLURM_RESTART_COUNT) grows by one and the trainer resumes from its latest checkpoint
#   (checkpoint.resume: true). A step that exits non-zero is never requeued (a crash would loop).
#
# The per-job directory JOB_DIR holds: state (one line per event, read by tests/test_slurm.py),
# attempt<R>/node<N>/ (torchrun's per-worker stdout/stderr logs) and whatever the job writes there.

pfppo_log() { echo "[pfppo-slurm $(date -u +%H:%M:%S)] $*"; }

pfppo_state() {  # pfppo_state EVENT [key=value ...]: one line in $STATE_FILE
  echo "attempt=$ATTEMPT event=$* time=$(date -u +%FT%TZ)" >> "$STATE_FILE"
}

pfppo_job_init() {
  : "${SLURM_JOB_ID:?run this script with sbatch (SLURM_JOB_ID is not set)}"
  REPO="${PFPPO_REPO:-$SLURM_SUBMIT_DIR}"
  if [[ ! -d "$REPO/pfppo_mega" ]]; then
    echo "error: REPO=$REPO has no pfppo_mega/: submit from the repository root or set PFPPO_REPO" >&2
    exit 2
  fi
  PFPPO_PYTHON="${PFPPO_PYTHON:-$REPO/.venv/bin/python}"
  ATTEMPT="${SLURM_RESTART_COUNT:-0}"
  JOB_DIR="${PFPPO_JOB_DIR:-$REPO/runs/slurm/${SLURM_JOB_NAME}-${SLURM_JOB_ID}}"
  STOP_FILE="$JOB_DIR/stop_requested"
  STATE_FILE="$JOB_DIR/state"
  mkdir -p "$JOB_DIR"
  rm -f "$STOP_FILE"  # a request of the previous attempt has been served
  export REPO PFPPO_PYTHON ATTEMPT JOB_DIR
  export PFPPO_STOP_FILE="$STOP_FILE"
  export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
  trap pfppo_on_usr1 USR1
  trap pfppo_on_term TERM
  pfppo_state start "nodes=$SLURM_JOB_NUM_NODES nodelist=$SLURM_JOB_NODELIST"
  pfppo_log "job $SLURM_JOB_ID attempt $ATTEMPT on $SLURM_JOB_NUM_NODES node(s) $SLURM_JOB_NODELIST; logs in $JOB_DIR"
}

pfppo_on_usr1() {
  pfppo_log "SIGUSR1: asking the trainer to checkpoint and exit ($STOP_FILE)"
  touch "$STOP_FILE"
  pfppo_state usr1
}

pfppo_on_term() {
  # Time limit reached or scancel: Slurm signals the job steps itself; only record it.
  pfppo_log "SIGTERM: the job is being ended by Slurm"
  pfppo_state term
}

pfppo_rdzv() {
  local first
  first="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
  # One port per job id, so that jobs sharing a host (the local test cluster) do not collide.
  RDZV_ENDPOINT="$first:${PFPPO_RDZV_PORT:-$((20000 + SLURM_JOB_ID % 20000))}"
  export RDZV_ENDPOINT
}

pfppo_run_step() {  # pfppo_run_step SRUN_ARGS...; returns srun's exit status
  # srun runs in the background: bash runs a trap only between commands, so a foreground srun
  # would delay the USR1 handler until the step has ended (too late to ask for a checkpoint).
  srun "$@" &
  local pid=$! rc=0
  while :; do
    wait "$pid"; rc=$?
    kill -0 "$pid" 2>/dev/null || break  # still running: wait was interrupted by a trap
  done
  if (( rc > 128 )); then  # interrupted just as srun exited: collect its own status
    local again=0
    wait "$pid" 2>/dev/null; again=$?
    (( again != 127 )) && rc=$again
  fi
  return "$rc"
}

pfppo_job_finish() {  # pfppo_job_finish RC: requeue after a requested checkpoint, else record the end
  local rc="$1"
  if [[ -e "$STOP_FILE" && "$rc" -eq 0 && "${PFPPO_REQUEUE:-1}" != 0 ]]; then
    pfppo_state requeue "rc=$rc"
    pfppo_log "checkpoint written on request: requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
  fi
  pfppo_state end "rc=$rc"
  pfppo_log "step finished with status $rc"
  exit "$rc"
}
