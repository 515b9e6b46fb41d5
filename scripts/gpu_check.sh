#!/usr/bin/env bash
# GPU check of issue 11 for ONE H200, <= 8 minutes in all (each step has its own timeout):
#   1. build pfppo_mega._C with the CUDA kernels                     (<= 200 s)
#   2. the CUDA tests (tests/test_kernels_cuda.py, tests/test_kernels_backends.py) (<= 90 s)
#   3. the kernel targets: GAE [1024, 8192] >= 1000x the verl-style loop and >= 75% of HBM copy
#      bandwidth; log-prob+entropy bf16 [16384, 152064] >= 5x eager  (<= 60 s)
#      (python -m pfppo_mega.bench.gpu_check kernels)
#   4. PPO, PF-PPO on, of a random-init ~1B Llama (configs/gpu_check_1b.yaml, bf16): the policy
#      written by `pfppo sft` (1 step), then 10 PPO steps, colocated: the trainer's states
#      offloaded to pinned host memory while the engine generates and the engine put to sleep
#      after it (training.offload_during_rollout=true); step 1 in the device-check mode
#      (PFPPO_DEVICE_CHECK's session). The colocated order of issue 20: the engine built with
#      the trainer offloaded, then every generation offload trainer -> wake weights -> refit ->
#      wake KV cache -> generate -> sleep -> reload trainer, then prepare -> update. Prints the
#      step time, the pool switch time, offload / reload time, the trainer's bytes on the GPU
#      during generation, the peak GPU memory against the planner's training- and rollout-phase
#      predictions, and the device-memory ledger per phase: its prediction next to
#      torch.cuda.max_memory_allocated / memory_allocated (pfppo_mega/trainer/ledger.py; every
#      phase is also checked against the card: a predicted overflow stops the run, named)
#      (python -m pfppo_mega.bench.gpu_check ppo)                    (the time left, >= 60 s)
# Logs and JSON go to $OUT (default build/gpu_check); summary.txt lists every step's status.
# Exit status: 0 all passed, 1 something failed (see summary.txt), 2 not a GPU machine.
#
# What the GPU machine lacks (python 3.12, torch 2.11+cu130, no network, no megatron-core):
# prepare the wheels on a machine with PyPI access, from the repository root, then carry them:
#   scripts/gpu_check.sh --prepare        # build/gpu_wheels (cp312 wheels: megatron-core, PyYAML, psutil,
#                                         # tokenizers, numpy, packaging) + build/gpu_pytest
# and run with build/gpu_wheels and build/gpu_pytest carried along (both git-ignored), e.g.
#   run(command="bash scripts/gpu_check.sh", carry=["build/gpu_wheels", "build/gpu_pytest"])
# Not covered (not on that machine): the vLLM engine (too large to carry: the PPO run uses the
# built-in engine, so there is no vLLM sleep / wake or refit time), transformer-engine
# (model.layer_spec stays local), more than one GPU (TP / PP / NCCL collectives).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if [ "${1:-}" = "--prepare" ]; then
  set -e
  rm -rf build/gpu_wheels && mkdir -p build/gpu_wheels
  pin() { grep -i "^$1==" requirements.lock | head -1; }
  .venv/bin/python -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    -d build/gpu_wheels "$(pin megatron-core)" "$(pin PyYAML)" "$(pin tokenizers)" "$(pin psutil)" numpy packaging
  bash scripts/gpu_kernels_check.sh --vendor-pytest
  du -sh build/gpu_wheels build/gpu_pytest
  exit 0
fi
[ $# -eq 0 ] || { echo "usage: $0 [--prepare]" >&2; exit 2; }

OUT=${OUT:-build/gpu_check}
mkdir -p "$OUT"
status=0
log() { echo "[gpu_check +$((SECONDS))s] $*" | tee -a "$OUT/summary.txt"; }
step() {  # step NAME TIMEOUT_S CMD...: run with a timeout, log to $OUT/NAME.log, record the status
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  tail -25 "$OUT/$name.log"
  log "$name: exit $rc in $((SECONDS - t0)) s$([ $rc -eq 124 ] && echo " (timed out after $limit s)")"
  [ $rc -eq 0 ] || status=1
  return $rc
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  log "no CUDA device: nothing to check"; exit 2
fi
# Carried wheels (see above): installed into a private directory, never into the system.
if [ -d build/gpu_wheels ]; then
  "$PY" -m pip install -q --no-deps --no-index --target build/gpu_site build/gpu_wheels/*.whl > "$OUT/wheels.log" 2>&1 \
    || log "installing build/gpu_wheels failed (see wheels.log)"
  export PYTHONPATH="$PWD/build/gpu_site${PYTHONPATH:+:$PYTHONPATH}"
fi
[ -d build/gpu_pytest ] && export PYTHONPATH="$PWD/build/gpu_pytest:$PYTHONPATH"
export PYTHONPATH="$PWD:$PYTHONPATH"
missing=$("$PY" - <<'EOF'
import importlib.util
print(" ".join(m for m in ("megatron.core", "yaml", "tokenizers", "psutil", "pytest", "safetensors")
               if importlib.util.find_spec(m.split(".")[0]) is None))
EOF
)
[ -z "$missing" ] || log "missing modules: $missing (run scripts/gpu_check.sh --prepare and carry the wheels)"

# 1. Build the extension with its CUDA kernels.
PFPPO_BUILD_CUDA=1 MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} \
  step build 200 "$PY" build_ext.py

# 2. CUDA tests (every test here skips on CPU; on this machine they run).
step tests 90 "$PY" -m pytest -q -rs -x -o addopts= -p no:cacheprovider \
  tests/test_kernels_cuda.py tests/test_kernels_backends.py \
  && step kernels_marker 30 "$PY" -c "from pfppo_mega.kernels.backends import write_marker; print(write_marker('cuda'))"
# (the marker, build/kernels_verified/<device>.json, lets `kernels: auto` use the fused CUDA kernels
# on this GPU kind, in step 4 too; without it auto means torch on GPUs)

# 3. Kernel targets of issue 11.
step kernels 60 "$PY" -m pfppo_mega.bench.gpu_check kernels --json "$OUT/kernels.json"

# 4. PPO of the random-init ~1B Llama, with the time left (of 470 s: 10 s for the summary).
left=$((470 - SECONDS))
if [ $left -ge 60 ]; then
  rm -rf "$OUT/policy" "$OUT/ppo"
  step ppo $left bash -c "'$PY' -m pfppo_mega sft configs/gpu_check_1b.yaml sft.output_dir='$OUT/policy' \
    && '$PY' -m pfppo_mega.bench.gpu_check ppo --model-dir '$OUT/policy' --steps 10 \
       --out-dir '$OUT/ppo' --json '$OUT/ppo.json'"
else
  log "ppo: skipped, ${left}s left"; status=1
fi
log "total $SECONDS s, status $status"
exit $status
