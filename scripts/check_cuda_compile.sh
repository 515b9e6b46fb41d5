#!/usr/bin/env bash
# Compile every CUDA kernel (csrc/cuda/*.cu) with nvcc for sm_90 -- compile only, nothing runs --
# and syntax-check the host wrappers' CUDA paths (csrc/ops.cpp, which compiles every op header's
# host part, and csrc/api.cpp, with PFPPO_WITH_CUDA) against torch's headers, so the CUDA
# sources cannot rot on machines without a GPU. Exit status: 0 all compiled, 1 a compile
# error, 2 nvcc not found.
#   env: NVCC (default nvcc), PFPPO_CUDA_ARCH (default sm_90), PYTHON (torch for the binding
#        check; default .venv/bin/python, else python3; the check is skipped without torch).
set -uo pipefail
cd "$(dirname "$0")/.."

NVCC=${NVCC:-nvcc}
ARCH=${PFPPO_CUDA_ARCH:-sm_90}
if ! command -v "$NVCC" >/dev/null 2>&1; then
  echo "check_cuda_compile: $NVCC not found" >&2
  exit 2
fi
echo "check_cuda_compile: $("$NVCC" --version | tail -1), arch $ARCH"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
status=0
# The defines torch's BuildExtension passes to nvcc, so this compile matches the real build.
torch_nvcc_flags=(-D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__
                  -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__
                  --expt-relaxed-constexpr --compiler-options -fPIC)
for src in csrc/cuda/*.cu; do
  if "$NVCC" -c -arch="$ARCH" -O3 -std=c++17 --Werror all-warnings -Xcompiler=-Wall,-Werror=switch \
      "${torch_nvcc_flags[@]}" \
      -Icsrc "$src" -o "$tmp/$(basename "$src").o"; then
    echo "  ok    $src"
  else
    echo "  FAIL  $src" >&2
    status=1
  fi
done

PYTHON=${PYTHON:-}
if [ -z "$PYTHON" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
torch_inc=$("$PYTHON" -c "import torch.utils.cpp_extension as e; print(' '.join(e.include_paths()))" 2>/dev/null)
py_inc=$("$PYTHON" -c "import sysconfig; print(sysconfig.get_paths()['include'])" 2>/dev/null)
cuda_inc="$(dirname "$(dirname "$(command -v "$NVCC")")")/include"
[ -f "$cuda_inc/cuda_runtime.h" ] || cuda_inc=/usr/local/cuda/include
if [ -n "$torch_inc" ]; then
  # A CPU build of torch ships the c10/cuda headers but not this generated one.
  mkdir -p "$tmp/stub/c10/cuda/impl"
  echo "#pragma once" > "$tmp/stub/c10/cuda/impl/cuda_cmake_macros.h"
  inc=(-Icsrc -I"$cuda_inc" -I"$py_inc")
  for d in $torch_inc; do inc+=(-I"$d"); done
  inc+=(-I"$tmp/stub")
  for host in csrc/ops.cpp csrc/api.cpp; do
    if "${CXX:-g++}" -std=c++20 -fsyntax-only -Wall -Werror=switch -DPFPPO_WITH_CUDA "${inc[@]}" "$host"; then
      echo "  ok    $host (CUDA build, syntax, torch headers)"
    else
      echo "  FAIL  $host" >&2
      status=1
    fi
  done
else
  echo "  skip  host wrappers: no torch for $PYTHON"
fi
exit $status
