// Device helpers shared by the CUDA kernels: typed loads/stores (fp32 and bf16 compute in fp32),
// mask reads, block reductions. Torch-free.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

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

template <typename X>
__device__ __forceinline__ X zero_of() {
  X z;
  memset(&z, 0, sizeof(X));
  return z;
}

// N consecutive elements p[0, n) (n <= N) into registers, the rest zero. A whole, aligned span
// is read with 16-byte loads (8 or 4 bytes for a span that small): a warp of lanes with
// consecutive spans reads one contiguous run of 32 * N * sizeof(X) bytes, every load coalesced.
template <int N, typename X>
__device__ __forceinline__ void load_span(const X* __restrict__ p, int n, X (&out)[N]) {
  constexpr int kBytes = N * int(sizeof(X));
  const uintptr_t addr = reinterpret_cast<uintptr_t>(p);
  if constexpr (kBytes % 16 == 0) {
    if (n == N && (addr & 15u) == 0) {
#pragma unroll
      for (int c = 0; c < kBytes / 16; ++c) {
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(p) + c);
        memcpy(reinterpret_cast<char*>(out) + 16 * c, &v, 16);
      }
      return;
    }
  } else if constexpr (kBytes == 8) {
    if (n == N && (addr & 7u) == 0) {
      const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
      memcpy(out, &v, 8);
      return;
    }
  } else if constexpr (kBytes == 4) {
    if (n == N && (addr & 3u) == 0) {
      const unsigned v = __ldg(reinterpret_cast<const unsigned*>(p));
      memcpy(out, &v, 4);
      return;
    }
  }
#pragma unroll
  for (int j = 0; j < N; ++j) out[j] = j < n ? p[j] : zero_of<X>();
}

// The store of load_span: p[0, n) = in[0, n).
template <int N, typename X>
__device__ __forceinline__ void store_span(X* __restrict__ p, int n, const X (&in)[N]) {
  constexpr int kBytes = N * int(sizeof(X));
  if constexpr (kBytes % 16 == 0) {
    if (n == N && (reinterpret_cast<uintptr_t>(p) & 15u) == 0) {
#pragma unroll
      for (int c = 0; c < kBytes / 16; ++c) {
        uint4 v;
        memcpy(&v, reinterpret_cast<const char*>(in) + 16 * c, 16);
        reinterpret_cast<uint4*>(p)[c] = v;
      }
      return;
    }
  }
#pragma unroll
  for (int j = 0; j < N; ++j) {
    if (j < n) p[j] = in[j];
  }
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
