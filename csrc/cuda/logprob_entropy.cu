// Token log-prob and entropy of softmax(logits [N, V] / T) on the GPU. The op's modes, arguments,
// row outputs and per-element math are csrc/logprob_entropy.h, shared with the CPU kernel.
//
// Roofline. The forward must read every logit once and writes 16 bytes per row: N V sizeof(T)
// bytes (bf16, 16384 x 152064: 4.98 GB, 1.2 ms at the H200's 4.1 TB/s copy rate). The
// backward reads the logits and writes the gradient, 2 N V sizeof(T). Both are memory bound
// if the per-element work stays small, so the goal is >= 75% of copy bandwidth (the Quack
// row reductions reach ~90% of HBM on Hopper). What the design does for it:
//   * one pass (online softmax): every thread keeps (m, s, u) over its columns,
//       m = max y,  s = sum e^{y - m},  u = sum e^{y - m} (y - m),    y = x / T,
//     and states merge at M = max(m1, m2):
//       s = s1 e^{m1-M} + s2 e^{m2-M},  u = e^{m1-M} (u1 + (m1 - M) s1) + (same for 2);
//       logp = y_label - (m + log s),  H = log s - u / s.
//     The max is taken per 16-byte pack first, so a pack costs one compare-and-rescale and
//     then one expf per element;
//   * fp32 accumulation (not fp64, a 1/64-rate unit on consumer parts and half rate here):
//     s and u are sums of positive (resp. non-positive) terms, so there is no cancellation;
//     two states per thread (two packs in flight) and the tree merge keep each sum's rounding
//     near torch's own fp32 reduction (checked against fp64 on the GPU by
//     tests/test_kernels_cuda.py);
//   * 16-byte vector loads when the rows allow them (aligned, V a multiple of the pack);
//   * no divide per element when T = 1 (x / 1 == x: the kernel is instantiated without it);
//   * long rows with few rows are split across blocks (splits chosen so that the grid holds
//     >= 4 blocks per SM); a second, tiny pass merges a row's split states (12 bytes each)
//     and reads the label's logit. One split per row writes the outputs directly.
// Backward (grid over rows x column blocks, elementwise, 16-byte loads and stores):
//   grad_x = (g [x is the label] - p (g + h (log p + H))) / T,  log p = (y - m) - log s.
// Columns [valid, V) are vocabulary padding: never read in the forward, gradient 0.
// A label outside [0, valid) gives logp = NaN (the host API checks labels only for CPU tensors).
#include <algorithm>
#include <cmath>

#include "../logprob_entropy.h"
#include "device_math.cuh"

namespace pfppo::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kBwdIters = 4;       // packs per thread per backward block
constexpr int kMinPacksPerThread = 4;  // a split is at least this much work per thread
constexpr int kBlocksPerSm = 4;

struct Online {
  float m;
  float s;
  float u;
};

constexpr Online kEmpty{-INFINITY, 0.0f, 0.0f};

// Fold the pack y[0, kVec) into st: one rescale for the pack's max, then one expf each.
template <int kVec>
__device__ __forceinline__ void push(Online& st, const float (&y)[kVec]) {
  float pm = y[0];
#pragma unroll
  for (int j = 1; j < kVec; ++j) pm = fmaxf(pm, y[j]);
  if (pm != pm) {  // fmaxf skips NaN: pm is NaN only for an all-NaN pack
    st.s = NAN;
    return;
  }
  if (pm > st.m) {
    if (st.s != 0.0f) {
      const float d = st.m - pm;
      rescale_sums(st.s, st.u, d, expf(d));
    }
    st.m = pm;
  }
  if (st.m == -INFINITY) return;  // the pack is all -inf: it adds nothing
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    const float d = y[j] - st.m;  // a NaN logit propagates through s
    const float e = expf(d);
    st.s += e;
    st.u += e > 0.0f ? e * d : 0.0f;
  }
}

__device__ __forceinline__ Online merge(const Online& a, const Online& b) {
  Online r{fmaxf(a.m, b.m), 0.0f, 0.0f};
  if (a.s != a.s || b.s != b.s) return Online{r.m, NAN, NAN};  // NaN logits stay visible
  if (r.m == -INFINITY) return r;
  if (a.s != 0.0f) {
    const float d = a.m - r.m;
    const float e = expf(d);
    r.s += a.s * e;
    r.u += (a.u + d * a.s) * e;
  }
  if (b.s != 0.0f) {
    const float d = b.m - r.m;
    const float e = expf(d);
    r.s += b.s * e;
    r.u += (b.u + d * b.s) * e;
  }
  return r;
}

__device__ __forceinline__ Online shfl_down(const Online& st, int off) {
  return Online{__shfl_down_sync(kFullMask, st.m, off), __shfl_down_sync(kFullMask, st.s, off),
                __shfl_down_sync(kFullMask, st.u, off)};
}

__device__ __forceinline__ Online warp_merge(Online st) {
  for (int off = 16; off > 0; off >>= 1) st = merge(st, shfl_down(st, off));
  return st;
}

// Merged state of the whole block, valid in thread 0.
__device__ Online block_merge(Online st) {
  __shared__ Online warp_states[kThreads / 32];
  st = warp_merge(st);
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

template <bool kScaled>
__device__ __forceinline__ float scaled(float x, float t) {
  if constexpr (kScaled) return x / t;  // division, as torch's logits / T
  return x;
}

template <typename T, int kVec, bool kScaled>
__device__ __forceinline__ void unpack(const Pack<T, kVec>& p, float t, float (&y)[kVec]) {
#pragma unroll
  for (int j = 0; j < kVec; ++j) y[j] = scaled<kScaled>(to_f32(p.v[j]), t);
}

// This thread's state over y = row[begin, end) / t; kVec > 1: begin and end are multiples of
// kVec and the row is 16-byte aligned.
template <typename T, int kVec, bool kScaled>
__device__ Online range_state(const T* __restrict__ row, int64_t begin, int64_t end, float t) {
  Online a = kEmpty, b = kEmpty;  // two states: two packs in flight, shorter sums
  const Pack<T, kVec>* packs = reinterpret_cast<const Pack<T, kVec>*>(row);
  const int64_t last = end / kVec;
  int64_t i = begin / kVec + threadIdx.x;
  float y[kVec];
  for (; i + kThreads < last; i += 2 * kThreads) {
    const Pack<T, kVec> pa = packs[i];
    const Pack<T, kVec> pb = packs[i + kThreads];
    unpack<T, kVec, kScaled>(pa, t, y);
    push<kVec>(a, y);
    unpack<T, kVec, kScaled>(pb, t, y);
    push<kVec>(b, y);
  }
  if (i < last) {
    unpack<T, kVec, kScaled>(packs[i], t, y);
    push<kVec>(a, y);
  }
  return merge(a, b);
}

// Row r's outputs (mode kMode) from its merged state; reads the label's logit.
template <typename T, bool kScaled, LogProbMode kMode>
__device__ __forceinline__ void finish_row(const LogProbArgs& a, const T* row, int64_t r,
                                           const Online& st, const LogProbRows& out) {
  const int64_t col = a.labels[r] - a.vocab_start;
  const bool has_label = col >= 0 && col < a.valid;
  const float y_label = has_label ? scaled<kScaled>(to_f32(row[col]), a.temperature) : 0.0f;
  write_row(kMode, out, r, st.m, st.s, st.u, has_label, y_label);
}

// Block (r, k) of rows x splits: the state of columns [k chunk, (k + 1) chunk) of row r.
// splits == 1 writes the row's outputs; else the state goes to states[r * splits + k].
template <typename T, int kVec, bool kScaled, LogProbMode kMode>
__global__ void __launch_bounds__(kThreads)
    split_kernel(LogProbArgs a, int64_t splits, int64_t chunk, Online* __restrict__ states,
                 LogProbRows out) {
  const int64_t r = blockIdx.x / splits, k = blockIdx.x % splits;
  const T* row = static_cast<const T*>(a.logits) + r * a.row_stride;
  const int64_t begin = min(a.valid, k * chunk), end = min(a.valid, begin + chunk);
  const Online st = block_merge(range_state<T, kVec, kScaled>(row, begin, end, a.temperature));
  if (threadIdx.x != 0) return;
  if (splits == 1) {
    finish_row<T, kScaled, kMode>(a, row, r, st, out);
  } else {
    states[blockIdx.x] = st;
  }
}

// One warp per row: merge the row's split states, write its outputs.
template <typename T, bool kScaled, LogProbMode kMode>
__global__ void combine_kernel(LogProbArgs a, int64_t splits, const Online* __restrict__ states,
                               LogProbRows out) {
  const int64_t r = int64_t(blockIdx.x) * (blockDim.x / 32) + (threadIdx.x >> 5);
  if (r >= a.rows) return;
  const int lane = threadIdx.x & 31;
  Online st = kEmpty;
  for (int64_t k = lane; k < splits; k += 32) st = merge(st, states[r * splits + k]);
  st = warp_merge(st);
  if (lane != 0) return;
  const T* row = static_cast<const T*>(a.logits) + r * a.row_stride;
  finish_row<T, kScaled, kMode>(a, row, r, st, out);
}

template <typename T, int kVec, bool kScaled>
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
  Pack<T, kVec> x[kBwdIters];
#pragma unroll
  for (int it = 0; it < kBwdIters; ++it) {  // every load issued before the math
    const int64_t i = first + int64_t(it) * kThreads + threadIdx.x;
    if (i < n_packs) x[it] = reinterpret_cast<const Pack<T, kVec>*>(row)[i];
  }
#pragma unroll
  for (int it = 0; it < kBwdIters; ++it) {
    const int64_t i = first + int64_t(it) * kThreads + threadIdx.x;  // pack index
    if (i >= n_packs) break;
    Pack<T, kVec> y;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const int64_t c = i * kVec + j;
      const float lp = softmax_logp(scaled<kScaled>(to_f32(x[it].v[j]), t), m, log_s);
      const float p = expf(lp);
      float v = p > 0.0f ? softmax_grad(p, lp, g, h, ent) : 0.0f;  // -inf logits: 0, not NaN
      if (c == label) v += g;
      y.v[j] = from_f32<T>(c < a.valid ? scaled<kScaled>(v, t) : 0.0f);  // padding: 0
    }
    reinterpret_cast<Pack<T, kVec>*>(out)[i] = y;
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// 16-byte packs for these rows when they allow it (else one element at a time).
template <typename T>
bool can_vectorize(const LogProbArgs& a, const void* out) {
  constexpr int kVec = 16 / sizeof(T);
  return aligned16(a.logits) && (out == nullptr || aligned16(out)) && a.vocab % kVec == 0 &&
         (a.row_stride * int64_t(sizeof(T))) % 16 == 0;
}

int current_sm_count() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 1;
  return sm_count(device);
}

// Column splits per row: enough blocks for kBlocksPerSm per SM, each split >= kMinPacksPerThread
// packs per thread. chunk: columns per split (a multiple of the pack).
struct Split {
  int64_t splits;
  int64_t chunk;
};

Split choose_split(const LogProbArgs& a, int64_t vec) {
  const int64_t min_chunk = int64_t(kThreads) * kMinPacksPerThread * vec;
  const int64_t want = int64_t(kBlocksPerSm) * current_sm_count();
  int64_t splits = 1;
  if (a.rows > 0 && a.rows < want) {
    splits = std::min(ceil_div(want, a.rows), std::max<int64_t>(1, a.valid / min_chunk));
  }
  const int64_t chunk = std::max<int64_t>(vec, ceil_div(ceil_div(a.valid, splits), vec) * vec);
  return Split{splits, chunk};
}

template <LogProbMode kMode>
cudaError_t launch_rows(const LogProbArgs& a, const LogProbRows& out, void* workspace,
                        cudaStream_t stream) {
  if (a.rows == 0) return cudaSuccess;
  return with_scalar(a.dtype, [&](auto t) {
    using T = decltype(t);
    constexpr int kVec = 16 / sizeof(T);
    const bool vec = can_vectorize<T>(a, nullptr) && a.valid % kVec == 0;
    const Split sp = choose_split(a, vec ? kVec : 1);
    Online* states = static_cast<Online*>(workspace);
    const int64_t blocks = a.rows * sp.splits;
    auto run = [&](auto scaled_tag) {
      constexpr bool kScaled = decltype(scaled_tag)::value;
      if (vec) {
        split_kernel<T, kVec, kScaled, kMode>
            <<<blocks, kThreads, 0, stream>>>(a, sp.splits, sp.chunk, states, out);
      } else {
        split_kernel<T, 1, kScaled, kMode>
            <<<blocks, kThreads, 0, stream>>>(a, sp.splits, sp.chunk, states, out);
      }
      if (sp.splits > 1) {
        combine_kernel<T, kScaled, kMode>
            <<<ceil_div(a.rows, 8), 256, 0, stream>>>(a, sp.splits, states, out);
      }
    };
    if (a.temperature == 1.0f) {
      run(std::false_type{});
    } else {
      run(std::true_type{});
    }
    return cudaGetLastError();
  });
}

}  // namespace

int sm_count(int device) {
  static int cached[64] = {0};
  if (device < 0 || device >= 64) return 1;
  if (cached[device] == 0) {
    int n = 0;
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || n < 1) {
      n = 1;
    }
    cached[device] = n;
  }
  return cached[device];
}

size_t logprob_workspace_bytes(const LogProbArgs& a) {
  const int64_t vec = a.dtype == Scalar::kF32 ? 4 : 8;
  const Split sp = choose_split(a, vec);
  const Split scalar = choose_split(a, 1);
  return size_t(a.rows * std::max(sp.splits, scalar.splits)) * sizeof(Online) + 256;
}

int logprob_entropy_rows(const LogProbArgs& a, LogProbMode mode, const LogProbRows& out,
                         void* workspace, void* stream) {
  return int(with_logprob_mode(mode, [&](auto tag) {
    return launch_rows<decltype(tag)::value>(a, out, workspace, static_cast<cudaStream_t>(stream));
  }));
}

int logprob_entropy_bwd(const LogProbArgs& a, const LogProbBwdArgs& b, void* stream_ptr) {
  if (a.rows == 0) return int(cudaSuccess);
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  return int(with_scalar(a.dtype, [&](auto t) {
    using T = decltype(t);
    constexpr int kVec = 16 / sizeof(T);
    auto run = [&](auto scaled_tag) {
      constexpr bool kScaled = decltype(scaled_tag)::value;
      if (can_vectorize<T>(a, b.grad_logits)) {
        const int64_t col_blocks = ceil_div(a.vocab / kVec, int64_t(kThreads) * kBwdIters);
        bwd_kernel<T, kVec, kScaled><<<a.rows * col_blocks, kThreads, 0, stream>>>(a, b, col_blocks);
      } else {
        const int64_t col_blocks = ceil_div(a.vocab, int64_t(kThreads) * kBwdIters);
        bwd_kernel<T, 1, kScaled><<<a.rows * col_blocks, kThreads, 0, stream>>>(a, b, col_blocks);
      }
    };
    if (a.temperature == 1.0f) {
      run(std::false_type{});
    } else {
      run(std::true_type{});
    }
    return cudaGetLastError();
  }));
}

}  // namespace pfppo::cuda
