// What every fused op shares, torch-free: the element kinds the kernels take, the PFPPO_HD
// marker of device-neutral inline functions, the X-macro helpers that turn an op's table of
// modes into its enum and its name list, and the launcher facts of the CUDA build.
//
// One op = one header (csrc/<op>.h: its table of modes, arguments, device-neutral math, the
// kernels' entry points and, under PFPPO_HOST, its schema, input checks and host wrapper),
// one kernel per device (csrc/cpu/<op>.cpp, csrc/cuda/<op>.cu), the autograd op and fake
// (pfppo_mega/kernels/ops.py), the pure-torch reference and the test (tests/test_kernels.py).
#pragma once

#include <cstdint>

// __host__ __device__ under nvcc, plain always-inline functions under a C++ compiler, so the
// CPU's vectorised loops and the CUDA kernels run the same statements.
#if defined(__CUDACC__)
#define PFPPO_HD __host__ __device__ __forceinline__
#else
#define PFPPO_HD inline __attribute__((always_inline))
#endif

// An op's table is an X-macro of rows X(enumerator, "name"). These two expand it into the
// enumerators and the names (in table order); pfppo_mega._C exports the names to Python.
#define PFPPO_TABLE_ENUM(id, name) id,
#define PFPPO_TABLE_NAME(id, name) name,

namespace pfppo {

// Element type of a floating input. All arithmetic is in fp32 (sums in fp64 on the CPU).
enum class Scalar : int { kF32 = 0, kBF16 = 1 };

// Element type of a [B, T] mask. Every kind is read as "nonzero means a real token".
enum class Mask : int { kBool = 0, kF32 = 1, kBF16 = 2 };

namespace cuda {
// Streaming multiprocessors of a device (cached per device; csrc/cuda/logprob_entropy.cu).
int sm_count(int device);
}  // namespace cuda

}  // namespace pfppo
