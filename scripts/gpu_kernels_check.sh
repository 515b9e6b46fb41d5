#!/usr/bin/env bash
# GPU check of the fused kernels, prepared for one H200 (sm_90) and <= 8 minutes:
#   1. build pfppo_mega._C with its CUDA kernels in place   (python build_ext.py, <= 5 min)
#   2. run the kernel tests (CUDA ones included)             (pytest, <= 2.5 min)
#   3. run the GPU kernel benchmark                          (pfppo bench kernels --device cuda)
#      without torch.compile (<= 2.5 min), then with it in the time left
# Logs, bench_cuda.json and bench_cuda_compile.json go to $OUT (default build/gpu_check); when the
# kernel tests pass, the marker that lets `kernels: auto` use the CUDA kernels on this GPU kind
# (build/kernels_verified/<device>.json) is written, and copied to $OUT.
# Exit status 0 when the build, the tests and the first benchmark pass.
#
# The GPU machine may lack pytest (and has no network). Beforehand, on the CPU machine, run
#   scripts/gpu_kernels_check.sh --vendor-pytest
# which copies the pure-Python pytest packages of .venv into build/gpu_pytest; carry that path
# along (it is git-ignored). Env: PYTHON (default python3), MAX_JOBS (default 16),
# PFPPO_BENCH_MODE (quick | full, default quick).
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--vendor-pytest" ]; then
  site=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  rm -rf build/gpu_pytest && mkdir -p build/gpu_pytest
  for pkg in pytest _pytest pluggy iniconfig packaging pygments py.py pytest_timeout.py; do
    [ -e "$site/$pkg" ] && cp -r "$site/$pkg" build/gpu_pytest/
  done
  find build/gpu_pytest -name __pycache__ -prune -exec rm -rf {} +
  du -sh build/gpu_pytest
  exit 0
fi

OUT=${OUT:-build/gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
status=0
log() { echo "[gpu_kernels_check +$((SECONDS))s] $*" | tee -a "$OUT/summary.txt"; }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee "$OUT/gpu.txt"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" 2>&1 | tee -a "$OUT/gpu.txt"
if ! "$PY" -c "import pytest" 2>/dev/null && [ -d build/gpu_pytest ]; then
  export PYTHONPATH="$PWD/build/gpu_pytest${PYTHONPATH:+:$PYTHONPATH}"
fi
command -v ninja >/dev/null 2>&1 || "$PY" -c "import ninja" 2>/dev/null || log "no ninja: the build compiles one file at a time"

# 1. Build.
t0=$SECONDS
PFPPO_BUILD_CUDA=1 MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} \
  timeout 300 "$PY" build_ext.py > "$OUT/build.log" 2>&1
rc=$?
log "build: exit $rc in $((SECONDS - t0)) s"
if [ $rc -ne 0 ] || ! "$PY" -c "from pfppo_mega.kernels import ops; assert ops.has_cuda(), 'no CUDA kernels in _C'" >> "$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"
  log "FAILED: build"
  exit 1
fi

# 2. Tests.
t0=$SECONDS
timeout 150 "$PY" -m pytest -q -rs -o addopts= -p no:cacheprovider \
  tests/test_kernels_cuda.py tests/test_kernels.py tests/test_kernels_backends.py \
  > "$OUT/tests.log" 2>&1
rc=$?
tail -15 "$OUT/tests.log"
log "tests: exit $rc in $((SECONDS - t0)) s"
[ $rc -eq 0 ] || status=1
# The kernel tests passed on this GPU: record it for the device name, so that `kernels: auto` uses
# the fused CUDA kernels on this machine kind (pfppo_mega.kernels.backends.marker_path; without a
# marker auto means torch on GPUs). A copy goes to $OUT.
if [ $rc -eq 0 ]; then
  marker=$("$PY" -c "from pfppo_mega.kernels.backends import write_marker; print(write_marker('cuda'))" 2>>"$OUT/tests.log") \
    && cp "$marker" "$OUT/" && log "kernels verified on this GPU: $marker"
fi

# 3. Benchmark: first without torch.compile (bandwidth targets; triton compiles take minutes),
#    then, with the time left of the 8 minutes, again with the torch.compile baselines.
t0=$SECONDS
mode=${PFPPO_BENCH_MODE:-quick}
flag=$([ "$mode" = quick ] && echo --quick)
timeout 150 "$PY" -m pfppo_mega.bench.kernels --device cuda $flag --no-compile \
  --json "$OUT/bench_cuda.json" > "$OUT/bench.log" 2>&1
rc=$?
grep -v "^  done" "$OUT/bench.log"
log "bench ($mode, no compile): exit $rc in $((SECONDS - t0)) s"
[ $rc -eq 0 ] || status=1
left=$((470 - SECONDS))
if [ $left -gt 60 ]; then
  t0=$SECONDS
  TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-16} \
    timeout $left "$PY" -m pfppo_mega.bench.kernels --device cuda $flag \
    --json "$OUT/bench_cuda_compile.json" > "$OUT/bench_compile.log" 2>&1
  log "bench ($mode, with torch.compile): exit $? in $((SECONDS - t0)) s (partial JSON kept on timeout)"
else
  log "bench with torch.compile skipped: ${left}s left"
fi

log "total $SECONDS s, status $status"
exit $status
