// Token log-prob and entropy of softmax(logits [N, V]) on the GPU, one block per row.
//
// Every thread keeps an online-softmax state over its share of the row (one read of the row,
// 16-byte loads when the row is aligned), the block merges the states:
//   m = max x,  s = sum e^{x - m},  u = sum e^{x - m} (x - m)
//   (m1, s1, u1) + (m2, s2, u2) at M = max(m1, m2):
//       s = s1 e^{m1-M} + s2 e^{m2-M},  u = e^{m1-M} (u1 + (m1 - M) s1) + (same for 2)
//   logp = x_label - (m + log s),  H = log s - u / s
// Backward (grid over rows x column blocks, elementwise):
//   grad_x = g [x is the label] - p (g + h (log p + H)),  log p = (x - m) - log s
// With a temperature T every logit is divided by T as it is loaded (y = x / T, as torch's
// logits / T) and the gradient is divided by T. Columns [valid, V) are vocabulary padding:
// never read in the forward, gradient 0.
// A label outside [0, valid) gives logp = NaN (the host API checks labels only for CPU tensors).
#include <cmath>

#include "device_math.cuh"
#include "launch.h"

namespace pfppo::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kBwdIters = 4;  // vectors per thread per backward block

// m in fp32 (a logit); the sums in fp64, so that ~V / 512 sequential adds per thread cost no
// more precision than torch's tree reductions (fp64 is half rate on sm_90: still far from
// the memory bound here).
struct Online {
  float m;
  double s;
  double u;
};

__device__ __forceinline__ void push(Online& st, float x) {
  if (x > st.m) {
    if (st.s != 0.0) {
      const double d = double(st.m) - double(x);
      const double scale = exp(d);
      st.u = (st.u + d * st.s) * scale;
      st.s *= scale;
    }
    st.m = x;
  }
  if (st.m == -INFINITY) return;  // x is -inf too: it adds nothing
  const float d = x - st.m;
  const float e = expf(d);
  st.s += double(e);              // NaN logits propagate through s
  st.u += e > 0.0f ? double(e) * double(d) : 0.0;
}

__device__ __forceinline__ Online merge(const Online& a, const Online& b) {
  Online r{fmaxf(a.m, b.m), 0.0, 0.0};
  if (r.m == -INFINITY) return r;
  if (a.s != 0.0) {
    const double d = double(a.m) - double(r.m);
    const double e = exp(d);
    r.s += a.s * e;
    r.u += (a.u + d * a.s) * e;
  }
  if (b.s != 0.0) {
    const double d = double(b.m) - double(r.m);
    const double e = exp(d);
    r.s += b.s * e;
    r.u += (b.u + d * b.s) * e;
  }
  return r;
}

__device__ __forceinline__ Online shfl_down(const Online& st, int off) {
  return Online{__shfl_down_sync(kFullMask, st.m, off), __shfl_down_sync(kFullMask, st.s, off),
                __shfl_down_sync(kFullMask, st.u, off)};
}

// Merged state of the whole block, valid in thread 0.
__device__ Online block_merge(Online st) {
  __shared__ Online warp_states[kThreads / 32];
  for (int off = 16; off > 0; off >>= 1) st = merge(st, shfl_down(st, off));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_states[warp] = st;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w) st = merge(st, warp_states[w]);
  }
  return st;
}

// kVec elements loaded or stored as one access (16 bytes when kVec * sizeof(T) == 16).
template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) Pack {
  T v[kVec];
};

// This thread's online state over its share of y = row[0, vocab) / t (kVec > 1: 16-byte
// loads; the caller guarantees alignment and vocab % kVec == 0).
template <typename T, int kVec>
__device__ Online row_state(const T* __restrict__ row, int64_t vocab, float t) {
  Online st{-INFINITY, 0.0, 0.0};
  if constexpr (kVec > 1) {
    const Pack<T, kVec>* packs = reinterpret_cast<const Pack<T, kVec>*>(row);
    const int64_t n = vocab / kVec;
    int64_t i = threadIdx.x;
    for (; i + kThreads < n; i += 2 * kThreads) {  // two loads in flight per thread
      const Pack<T, kVec> a = packs[i];
      const Pack<T, kVec> b = packs[i + kThreads];
#pragma unroll
      for (int j = 0; j < kVec; ++j) push(st, to_f32(a.v[j]) / t);
#pragma unroll
      for (int j = 0; j < kVec; ++j) push(st, to_f32(b.v[j]) / t);
    }
    if (i < n) {
      const Pack<T, kVec> a = packs[i];
#pragma unroll
      for (int j = 0; j < kVec; ++j) push(st, to_f32(a.v[j]) / t);
    }
  } else {
    for (int64_t i = threadIdx.x; i < vocab; i += kThreads) push(st, to_f32(row[i]) / t);
  }
  return st;
}

template <typename T, int kVec, bool kPartials>
__global__ void __launch_bounds__(kThreads)
    row_kernel(LogProbArgs a, LogProbOut full, LogProbPartialsOut part) {
  const int64_t r = blockIdx.x;
  const T* row = static_cast<const T*>(a.logits) + r * a.row_stride;
  const Online st = block_merge(row_state<T, kVec>(row, a.valid, a.temperature));
  if (threadIdx.x != 0) return;
  const int64_t col = a.labels[r] - a.vocab_start;
  const bool in_shard = col >= 0 && col < a.valid;
  if constexpr (kPartials) {
    part.max[r] = st.m;
    part.sumexp[r] = float(st.s);
    part.sumexp_shifted[r] = float(st.u);
    part.target[r] = in_shard ? to_f32(row[col]) / a.temperature : 0.0f;
  } else {
    const double log_s = log(st.s);
    const double target = in_shard ? double(to_f32(row[col]) / a.temperature) : double(NAN);
    full.logp[r] = float(target - (double(st.m) + log_s));
    full.entropy[r] = float(log_s - st.u / st.s);
    full.row_max[r] = st.m;
    full.log_sumexp[r] = float(log_s);
  }
}

template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads)
    bwd_kernel(LogProbArgs a, LogProbBwdArgs b, int64_t col_blocks) {
  const int64_t r = blockIdx.x / col_blocks;
  const int64_t cb = blockIdx.x % col_blocks;
  const T* row = static_cast<const T*>(a.logits) + r * a.row_stride;
  T* out = static_cast<T*>(b.grad_logits) + r * a.vocab;
  const float m = b.row_max[r], log_s = b.log_sumexp[r], ent = b.entropy[r];
  const float g = b.grad_logp[r], h = b.grad_entropy[r];
  const int64_t label = a.labels[r] - a.vocab_start;
  const float t = a.temperature;
  const int64_t n_packs = a.vocab / kVec;
  const int64_t first = cb * int64_t(kThreads) * kBwdIters;
#pragma unroll
  for (int it = 0; it < kBwdIters; ++it) {
    const int64_t i = first + int64_t(it) * kThreads + threadIdx.x;  // pack index
    if (i >= n_packs) break;
    const Pack<T, kVec> x = reinterpret_cast<const Pack<T, kVec>*>(row)[i];
    Pack<T, kVec> y;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const int64_t c = i * kVec + j;
      const float lp = (to_f32(x.v[j]) / t - m) - log_s;
      const float p = expf(lp);
      float v = p > 0.0f ? -p * (g + h * (lp + ent)) : 0.0f;  // -inf logits: 0, not NaN
      if (c == label) v += g;
      y.v[j] = from_f32<T>(c < a.valid ? v / t : 0.0f);  // padding columns: 0
    }
    reinterpret_cast<Pack<T, kVec>*>(out)[i] = y;
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Pack width for these rows: 16 bytes when the rows allow it, else 1 element.
template <typename T>
bool can_vectorize(const LogProbArgs& a, const void* out) {
  constexpr int kVec = 16 / sizeof(T);
  return aligned16(a.logits) && (out == nullptr || aligned16(out)) && a.vocab % kVec == 0 &&
         (a.row_stride * int64_t(sizeof(T))) % 16 == 0;
}

template <bool kPartials>
cudaError_t launch_rows(const LogProbArgs& a, const LogProbOut& full,
                        const LogProbPartialsOut& part, cudaStream_t stream) {
  if (a.rows == 0) return cudaSuccess;
  return with_scalar(a.dtype, [&](auto t) {
    using T = decltype(t);
    constexpr int kVec = 16 / sizeof(T);
    if (can_vectorize<T>(a, nullptr) && a.valid % kVec == 0) {
      row_kernel<T, kVec, kPartials><<<a.rows, kThreads, 0, stream>>>(a, full, part);
    } else {
      row_kernel<T, 1, kPartials><<<a.rows, kThreads, 0, stream>>>(a, full, part);
    }
    return cudaGetLastError();
  });
}

}  // namespace

cudaError_t logprob_entropy_fwd(const LogProbArgs& a, const LogProbOut& out, cudaStream_t stream) {
  return launch_rows<false>(a, out, LogProbPartialsOut{}, stream);
}

cudaError_t logprob_entropy_partials(const LogProbArgs& a, const LogProbPartialsOut& out,
                                     cudaStream_t stream) {
  return launch_rows<true>(a, LogProbOut{}, out, stream);
}

cudaError_t logprob_entropy_bwd(const LogProbArgs& a, const LogProbBwdArgs& b,
                                cudaStream_t stream) {
  if (a.rows == 0) return cudaSuccess;
  return with_scalar(a.dtype, [&](auto t) {
    using T = decltype(t);
    constexpr int kVec = 16 / sizeof(T);
    if (can_vectorize<T>(a, b.grad_logits)) {
      const int64_t col_blocks = ceil_div(a.vocab / kVec, int64_t(kThreads) * kBwdIters);
      bwd_kernel<T, kVec><<<a.rows * col_blocks, kThreads, 0, stream>>>(a, b, col_blocks);
    } else {
      const int64_t col_blocks = ceil_div(a.vocab, int64_t(kThreads) * kBwdIters);
      bwd_kernel<T, 1><<<a.rows * col_blocks, kThreads, 0, stream>>>(a, b, col_blocks);
    }
    return cudaGetLastError();
  });
}

}  // namespace pfppo::cuda
