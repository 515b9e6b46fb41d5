#!/usr/bin/env bash
# GPU check v2 for ONE fresh H200, <= 8 minutes in all, build included. Every step is its own
# process with its own timeout; no step stops another; each leaves a JSON record. Most important first:
#   build        pfppo_mega._C with the CUDA kernels (sm_90a)
#   kernel_tests the CUDA kernel tests; when they pass (they alone), the marker that lets
#                `kernels: auto` use the fused CUDA kernels on this GPU kind
#   sft          `pfppo sft` of the ~300M config (2 steps on the GPU): writes the policy the next steps use
#   audit        the trainer built on the GPU: every parameter, buffer and optimizer tensor of actor,
#                reference, critic and engine on the device; an offload round trip (bit-identical;
#                memory_allocated and the pinned host bytes against the ledger)
#   matmul       the device's bf16 matmul rate (8192^3), which the update's model FLOP/s is read against
#   speed        the update's tokens/s and MFU at a ~1B Llama shape (Llama-3.2-1B's, vocabulary 128k) with
#                4k-token rows, bf16, the default layers (TE's where installed, else the fused SDPA path)
#                and LM head; then 4 of its layers fused vs megatron's local ones, interleaved, with their
#                peak memory (pfppo_mega.bench.model_speed)
#   ppo          PPO of the ~300M config (32k vocabulary, PF-PPO, engine on the GPU, fused kernels,
#                distributed optimizer, selective recompute, offload during rollout): step 1 in the
#                device-check session, then an evaluation and a KL probe at one version, the step after
#                them, a checkpoint; ledger vs measured per phase; the update's tokens/s and TFLOP/s
#   resume       a second process resumes that checkpoint and trains one step
#   grpo         2 GRPO steps of the same model
#   contracts    the CPU suite's GPU-fault tests on the GPU (level-2 sleep, non-finite grad norm, resume
#                placement)
#   kernels      the kernel targets (inputs made on the device), reported
# Files back (<= 8, under $OUT): summary.txt (one line a step + the summary table), steps.jsonl (one JSON
# record a step), log.txt (every step's output), and the parts' own JSON: audit.json, speed.json (with the
# matmul rate), ppo.json, grpo.json, kernels.json. No weights.
# Exit status: 0 every step passed, 1 some step failed (summary.txt), 2 not a GPU machine.
#
# What the GPU machine lacks: megatron-core (python 3.12, torch 2.11+cu130 there). Fetch its cp312
# wheel here (nothing else: the machine's numpy and torch must not be shadowed) and carry it:
#   scripts/gpu_check.sh --prepare                     # -> build/gpu_wheels/megatron_core-*.whl
#   run(command="bash scripts/gpu_check.sh", carry=["build/gpu_wheels"])
# Not covered (not on that machine): vLLM (too large to carry: the built-in engine generates; the
# level-2 sleep contract runs with the test suite's engine double), transformer-engine, more than one
# GPU (TP / PP / NCCL collectives).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
BUDGET_S=${GPU_CHECK_BUDGET_S:-470}

if [ "${1:-}" = "--prepare" ]; then
  set -e
  rm -rf build/gpu_wheels && mkdir -p build/gpu_wheels
  .venv/bin/python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    -d build/gpu_wheels "$(grep -i '^megatron-core==' requirements.lock | head -1)"
  du -sh build/gpu_wheels
  exit 0
fi
[ $# -eq 0 ] || { echo "usage: $0 [--prepare]" >&2; exit 2; }

OUT=${OUT:-build/gpu_check}
mkdir -p "$OUT"
WORK=build/gpu_check_work   # policy, run directories, checkpoints: never sent back
rm -rf "$WORK" && mkdir -p "$WORK"
: > "$OUT/summary.txt"; : > "$OUT/steps.jsonl"; : > "$OUT/log.txt"
failed=0
log() { echo "[gpu_check +${SECONDS}s] $*" | tee -a "$OUT/summary.txt"; }
step() {  # step NAME TIMEOUT_S CMD...: its own process and timeout; output to log.txt; a JSON record
  local name=$1 limit=$2 t0=$SECONDS rc left=$((BUDGET_S - SECONDS))
  shift 2
  if [ "$left" -lt 15 ]; then
    log "$name: not run (${left}s of the budget left)"; failed=1
    echo "{\"step\": \"$name\", \"status\": \"not run\", \"seconds\": 0}" >> "$OUT/steps.jsonl"
    return 0
  fi
  [ "$limit" -le "$left" ] || limit=$left
  echo "===== $name (timeout ${limit}s)" >> "$OUT/log.txt"
  timeout "$limit" "$@" > "$WORK/$name.log" 2>&1
  rc=$?
  cat "$WORK/$name.log" >> "$OUT/log.txt"
  tail -6 "$WORK/$name.log"
  local status=passed
  [ $rc -eq 0 ] || { status=failed; failed=1; }
  [ $rc -eq 124 ] && status="timed out"
  log "$name: $status (exit $rc) in $((SECONDS - t0)) s"
  echo "{\"step\": \"$name\", \"status\": \"$status\", \"exit\": $rc, \"seconds\": $((SECONDS - t0)), \"limit_s\": $limit}" \
    >> "$OUT/steps.jsonl"
  return 0
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$OUT/summary.txt"
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  log "no CUDA device: nothing to check"; exit 2
fi
# The carried megatron-core wheel, installed into a private directory (no dependencies: nothing
# shadows the machine's own numpy / torch).
if [ -d build/gpu_wheels ]; then
  "$PY" -m pip install -q --no-deps --no-index --target build/gpu_site build/gpu_wheels/*.whl >> "$OUT/log.txt" 2>&1 \
    || log "installing build/gpu_wheels failed (see log.txt)"
  export PYTHONPATH="$PWD/build/gpu_site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD:$PYTHONPATH" PYTHONUNBUFFERED=1
missing=$("$PY" -c "import importlib.util as u; print(' '.join(m for m in ('megatron', 'yaml', 'tokenizers', \
'psutil', 'pytest', 'safetensors', 'transformers') if u.find_spec(m) is None))")
[ -z "$missing" ] || log "missing modules: $missing (scripts/gpu_check.sh --prepare, then carry build/gpu_wheels)"

CFG=configs/gpu_check_300m.yaml
POLICY="$WORK/policy"
PYTEST=("$PY" -m pytest -q -rs -o addopts= -p no:cacheprovider)

PFPPO_BUILD_CUDA=1 MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} \
  step build 150 "$PY" build_ext.py
step kernel_tests 100 bash -c "${PYTEST[*]} tests/test_kernels_cuda.py tests/test_kernels_backends.py \
  tests/test_rollout_engine.py::test_cuda_engine_matches_cpu \
  && $PY -c \"from pfppo_mega.kernels.backends import write_marker; print('marker', write_marker('cuda'))\""
step sft 60 "$PY" -m pfppo_mega sft "$CFG" sft.output_dir="$POLICY"
step audit 60 "$PY" -m pfppo_mega.bench.gpu_check audit --config "$CFG" --model-dir "$POLICY" \
  --out-dir "$WORK/audit" --json "$OUT/audit.json"
step matmul 20 "$PY" -m pfppo_mega.bench.gpu_check matmul --json "$WORK/matmul.json"
TFLOPS=$("$PY" -c "import json; print(json.load(open('$WORK/matmul.json'))['tflops'])" 2>/dev/null || echo "")
step speed 60 "$PY" -m pfppo_mega.bench.gpu_check speed ${TFLOPS:+--matmul-tflops "$TFLOPS"} --json "$OUT/speed.json"
step ppo 120 "$PY" -m pfppo_mega.bench.gpu_check ppo --config "$CFG" --model-dir "$POLICY" --steps 4 --eval-save \
  ${TFLOPS:+--matmul-tflops "$TFLOPS"} --out-dir "$WORK/ppo" --json "$OUT/ppo.json"
step resume 90 "$PY" -m pfppo_mega.bench.gpu_check ppo --config "$CFG" --model-dir "$POLICY" --steps 1 \
  --out-dir "$WORK/ppo" checkpoint.resume=true training.total_training_steps=8
step grpo 60 "$PY" -m pfppo_mega.bench.gpu_check ppo --config "$CFG" --model-dir "$POLICY" --steps 2 \
  --out-dir "$WORK/grpo" --json "$OUT/grpo.json" algorithm.adv_estimator=grpo algorithm.use_pf_ppo=false
step contracts 60 "${PYTEST[@]}" tests/test_gpu_faults.py
step kernels 60 "$PY" -m pfppo_mega.bench.gpu_check kernels --report --json "$OUT/kernels.json"  # targets reported

log "total ${SECONDS}s, $([ $failed -eq 0 ] && echo 'every step passed' || echo 'some step failed')"
exit $failed
