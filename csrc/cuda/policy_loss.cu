// PPO clipped policy loss on the GPU, forward and d loss / d logp in one pass over [B, T]. The
// per-token math, the modes and the clamp are csrc/policy_loss.h (shared with the CPU kernel).
//
// Roofline. The op is memory bound: per token it must read logp, old_logp, advantages (and the
// IS weight when given) and the mask, and write grad_logp; the scaled loss needs the mask counts
// first, so the mask is read twice. Bytes per token, without / with weights:
//   fp32: 3*4 + 2*1 (bool mask) + 4 = 18 / 22 B;   bf16: 3*2 + 2*1 + 2 = 10 / 12 B.
// B = 512, T = 4096 fp32 is 38 MB: 9 us at the H200's 4.1 TB/s copy rate; the goal is >= 75% of
// copy bandwidth. The fp64 per-token math (~60 flops with the exp) at that rate needs ~12
// TFLOP/s of fp64, a third of Hopper's; so fp64 stays (it keeps every token bit-equal to the
// CPU kernel and the fp64 reference rounded once). What the design does for the bytes:
//   * each thread owns spans of 16 / sizeof(T) consecutive tokens (4 fp32, 8 bf16), read and
//     written with one 16-byte access per tensor: the lanes of a warp cover one contiguous
//     512-byte run per access (coalesced), and 2 spans per thread keep 2 loads in flight per
//     tensor;
//   * the row counts read the mask 16 bytes per load too (16 bool tokens);
//   * blocks tile (row, column range), so a few long rows still fill every SM;
//   * the stats leave each block as 5 doubles (no atomics on floats: deterministic), and one
//     small block adds them in a fixed order.
// Kernels: 1. count_rows  real tokens per row; total and rows with tokens (integer atomics);
//          2. loss_tokens every token once: grad_logp and the per-block sums;
//          3. finalize    the five scalars.
#include <cmath>

#include "../policy_loss.h"
#include "device_math.cuh"

namespace pfppo::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kSpans = 2;  // spans per thread in loss_tokens
constexpr int kSums = 5;   // pg w, clip, dual, k3, w

template <typename T>
constexpr int span_len() {
  return 16 / int(sizeof(T));
}

struct PolicyStatPtrs {  // the five 0-dim outputs (a kernel argument by value)
  void* stat[kNumPolicyStats];
};

struct Header {
  unsigned long long total;
  unsigned long long rows_with_tokens;
};

struct Workspace {
  Header* header;
  int* row_count;   // [B]
  double* partial;  // [blocks, kSums]
};

int64_t col_blocks(const PolicyLossArgs& a) {
  const int64_t span = a.dtype == Scalar::kF32 ? span_len<float>() : span_len<__nv_bfloat16>();
  return ceil_div(a.cols, int64_t(kThreads) * kSpans * span);
}

Workspace carve(void* base, const PolicyLossArgs& a) {
  char* p = static_cast<char*>(base);
  Workspace w;
  w.header = reinterpret_cast<Header*>(p);
  p += 256;
  w.row_count = reinterpret_cast<int*>(p);
  p += ceil_div(a.rows * int64_t(sizeof(int)), 256) * 256;
  w.partial = reinterpret_cast<double*>(p);
  return w;
}

template <typename M>
__global__ void __launch_bounds__(kThreads) count_rows(const M* __restrict__ mask, int64_t cols,
                                                       Workspace w) {
  __shared__ double smem[32];
  constexpr int kSpan = 16 / int(sizeof(M));  // 16 bytes of mask per load
  const M* row = mask + int64_t(blockIdx.x) * cols;
  double c = 0.0;
  for (int64_t t0 = int64_t(threadIdx.x) * kSpan; t0 < cols; t0 += int64_t(kThreads) * kSpan) {
    const int n = int(min(int64_t(kSpan), cols - t0));
    M m[kSpan];
    load_span<kSpan>(row + t0, n, m);
#pragma unroll
    for (int j = 0; j < kSpan; ++j) c += (j < n && nonzero(m[j])) ? 1.0 : 0.0;
  }
  c = block_sum(c, smem);
  if (threadIdx.x == 0) {
    const int count = int(c);
    w.row_count[blockIdx.x] = count;
    atomicAdd(&w.header->total, (unsigned long long)count);
    if (count > 0) atomicAdd(&w.header->rows_with_tokens, 1ull);
  }
}

template <typename T, typename M, bool kWeights>
__global__ void __launch_bounds__(kThreads)
    loss_tokens(PolicyLossArgs a, T* __restrict__ grad, Workspace w, int64_t blocks_per_row) {
  constexpr int kSpan = span_len<T>();
  __shared__ double smem[32];
  const int64_t b = blockIdx.x / blocks_per_row;
  const int64_t c0 = (blockIdx.x % blocks_per_row) * int64_t(kThreads) * kSpans * kSpan;
  const double scale = agg_scale(a.agg, w.row_count[b], int64_t(w.header->total),
                                 int64_t(w.header->rows_with_tokens));
  const ClipBounds bounds = clip_bounds(a, INFINITY);
  const int64_t row = b * a.cols;
  const T* logp = static_cast<const T*>(a.logp) + row;
  const T* old_logp = static_cast<const T*>(a.old_logp) + row;
  const T* adv = static_cast<const T*>(a.advantages) + row;
  const T* weights = static_cast<const T*>(a.is_weights) + (kWeights ? row : 0);
  const M* mask = static_cast<const M*>(a.mask) + row;
  T* grad_row = grad + row;

  double s[kSums] = {0.0, 0.0, 0.0, 0.0, 0.0};
#pragma unroll
  for (int it = 0; it < kSpans; ++it) {
    const int64_t t0 = c0 + (int64_t(it) * kThreads + threadIdx.x) * kSpan;
    if (t0 >= a.cols) break;
    const int n = int(min(int64_t(kSpan), a.cols - t0));
    T lp[kSpan], old[kSpan], ad[kSpan], wt[kSpan], g[kSpan];
    M m[kSpan];
    load_span<kSpan>(mask + t0, n, m);
    load_span<kSpan>(logp + t0, n, lp);
    load_span<kSpan>(old_logp + t0, n, old);
    load_span<kSpan>(adv + t0, n, ad);
    if constexpr (kWeights) load_span<kSpan>(weights + t0, n, wt);
#pragma unroll
    for (int j = 0; j < kSpan; ++j) {
      g[j] = from_f32<T>(0.0f);  // padding (and tokens past the row) write 0
      if (j >= n || !nonzero(m[j])) continue;
      const double d = double(to_f32(lp[j])) - double(to_f32(old[j]));
      const double lr = clamp_log_ratio(d);
      const double ratio = exp(lr);
      const double weight = kWeights ? double(to_f32(wt[j])) : 1.0;
      const PpoToken tok = ppo_token(d, ratio, to_f32(ad[j]), weight, scale, bounds);
      g[j] = from_f32<T>(float(tok.grad));
      s[0] += tok.pg;
      s[1] += tok.clip;
      s[2] += tok.dual;
      s[3] += k3_term(lr, ratio);
      s[4] += weight;
    }
    store_span<kSpan>(grad_row + t0, n, g);
  }
  double* out = w.partial + int64_t(blockIdx.x) * kSums;
#pragma unroll
  for (int k = 0; k < kSums; ++k) {
    const double v = block_sum(s[k], smem);
    if (threadIdx.x == 0) out[k] = k == 0 ? v * scale : v;
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    finalize(Workspace w, int64_t blocks, PolicyStatPtrs out) {
  __shared__ double smem[32];
  double sums[kSums];
#pragma unroll
  for (int k = 0; k < kSums; ++k) {
    double v = 0.0;
    for (int64_t j = threadIdx.x; j < blocks; j += kThreads) v += w.partial[j * kSums + k];
    sums[k] = block_sum(v, smem);
  }
  if (threadIdx.x != 0) return;
  const double total = double(w.header->total);
  const double inv = total > 0.0 ? 1.0 / total : 0.0;
  const double values[kNumPolicyStats] = {sums[0], sums[1] * inv, sums[2] * inv, sums[3] * inv,
                                          sums[4] * inv};
#pragma unroll
  for (int k = 0; k < kNumPolicyStats; ++k) {
    *static_cast<T*>(out.stat[k]) = from_f32<T>(float(values[k]));
  }
}

}  // namespace

size_t policy_loss_workspace_bytes(const PolicyLossArgs& a) {
  const int64_t blocks = a.rows * col_blocks(a);
  return 256 + ceil_div(a.rows * int64_t(sizeof(int)), 256) * 256 +
         size_t(blocks) * kSums * sizeof(double) + 256;
}

int policy_loss_fwd(const PolicyLossArgs& a, void* grad_logp, void* const* stat,
                    void* workspace, void* stream_ptr) {
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  Workspace w = carve(workspace, a);
  cudaError_t err = cudaMemsetAsync(w.header, 0, sizeof(Header), stream);
  if (err != cudaSuccess) return int(err);
  PolicyStatPtrs out;
  for (int k = 0; k < kNumPolicyStats; ++k) out.stat[k] = stat[k];
  const int64_t per_row = col_blocks(a);
  const int64_t blocks = a.rows * per_row;
  return int(with_scalar(a.dtype, [&](auto t) {
    using T = decltype(t);
    return with_mask(a.mask_kind, [&](auto m) {
      using M = decltype(m);
      if (a.rows > 0 && a.cols > 0) {
        count_rows<M><<<a.rows, kThreads, 0, stream>>>(static_cast<const M*>(a.mask), a.cols, w);
        T* grad = static_cast<T*>(grad_logp);
        if (a.is_weights != nullptr) {
          loss_tokens<T, M, true><<<blocks, kThreads, 0, stream>>>(a, grad, w, per_row);
        } else {
          loss_tokens<T, M, false><<<blocks, kThreads, 0, stream>>>(a, grad, w, per_row);
        }
      }
      finalize<T><<<1, kThreads, 0, stream>>>(w, blocks, out);
      return cudaGetLastError();
    });
  }));
}

}  // namespace pfppo::cuda
