// Device helpers shared by the CUDA kernels: typed loads/stores (fp32 and bf16 compute in fp32),
// mask reads, block reductions. Torch-free.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../kernel_types.h"

namespace pfppo::cuda {

constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_f32(float x);
template <>
__device__ __forceinline__ float from_f32<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

__device__ __forceinline__ bool nonzero(uint8_t m) { return m != 0; }
__device__ __forceinline__ bool nonzero(float m) { return m != 0.0f; }
__device__ __forceinline__ bool nonzero(__nv_bfloat16 m) { return __bfloat162float(m) != 0.0f; }

// Sum over the block of a double (every thread gets the result). blockDim.x % 32 == 0.
__device__ __forceinline__ double block_sum(double v, double* smem /* [32] */) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(kFullMask, v, off);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // smem may still be read by a previous call
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  double total = 0.0;
  const int warps = blockDim.x >> 5;
  for (int w = 0; w < warps; ++w) total += smem[w];  // fixed order: deterministic
  return total;
}

__host__ inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Dispatch helpers: run f(T{}) / f(M{}) with the element type of a Scalar / Mask kind.
template <typename F>
__host__ cudaError_t with_scalar(Scalar s, F&& f) {
  if (s == Scalar::kF32) return f(float{});
  return f(__nv_bfloat16{});
}

template <typename F>
__host__ cudaError_t with_mask(Mask m, F&& f) {
  if (m == Mask::kBool) return f(uint8_t{});
  if (m == Mask::kF32) return f(float{});
  return f(__nv_bfloat16{});
}

}  // namespace pfppo::cuda
