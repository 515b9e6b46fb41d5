// PPO clipped policy loss on the GPU, forward and d loss / d logp in one pass over [B, T].
// Same per-token math as csrc/cpu/policy_loss.cpp (reference: pfppo_mega/ppo/losses.py):
//   1. count_rows:  real tokens per row (block per row); total and rows-with-tokens (atomics
//                   on integers, so the result does not depend on the order);
//   2. loss_tokens: every token once: grad_logp = c_i w_i ratio_i [|d_i| <= 20] dpg/dratio and
//                   per-block sums (pg w, clip, dual, k3, w), written per block;
//   3. finalize:    one block adds the per-block sums in a fixed order and writes the scalars.
// c_i = 1 / total (token-mean), 1 / rows (seq-mean-token-sum), 1 / (row_count rows)
// (seq-mean-token-mean); ties of max(pg1, pg2) split the gradient in half like torch.maximum.
#include <cmath>

#include "device_math.cuh"
#include "launch.h"

namespace pfppo::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kItems = 8;  // tokens per thread in loss_tokens
constexpr int kSums = 5;   // pg w, clip, dual, k3, w
constexpr double kLogRatioLimit = 20.0;

struct Header {
  unsigned long long total;
  unsigned long long rows_with_tokens;
};

struct Workspace {
  Header* header;
  int* row_count;   // [B]
  double* partial;  // [blocks, kSums]
};

int64_t col_blocks(const PolicyLossArgs& a) { return ceil_div(a.cols, int64_t(kThreads) * kItems); }

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
  const M* row = mask + int64_t(blockIdx.x) * cols;
  double c = 0.0;
  for (int64_t t = threadIdx.x; t < cols; t += kThreads) c += nonzero(row[t]) ? 1.0 : 0.0;
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
  __shared__ double smem[32];
  const int64_t b = blockIdx.x / blocks_per_row;
  const int64_t c0 = (blockIdx.x % blocks_per_row) * int64_t(kThreads) * kItems;
  const int count = w.row_count[b];
  const double total = double(w.header->total), rows = double(w.header->rows_with_tokens);
  double scale = 0.0;
  if (count > 0) {
    scale = a.agg == AggMode::kTokenMean          ? 1.0 / total
            : a.agg == AggMode::kSeqMeanTokenSum ? 1.0 / rows
                                                  : 1.0 / (double(count) * rows);
  }
  const double lo = 1.0 - a.clip_ratio_low, hi = 1.0 + a.clip_ratio_high;
  const double dual_c = a.dual_clip ? a.dual_clip_c : INFINITY;  // +inf: never active

  const T* logp = static_cast<const T*>(a.logp);
  const T* old_logp = static_cast<const T*>(a.old_logp);
  const T* adv = static_cast<const T*>(a.advantages);
  const T* weights = static_cast<const T*>(a.is_weights);
  const M* mask = static_cast<const M*>(a.mask);
  // Per-token math in fp64, as on the CPU: logp - old_logp of two floats is exact in fp64,
  // so each token's terms are the fp64 reference's, rounded once.
  double s[kSums] = {0.0, 0.0, 0.0, 0.0, 0.0};
#pragma unroll
  for (int it = 0; it < kItems; ++it) {
    const int64_t t = c0 + int64_t(it) * kThreads + threadIdx.x;
    if (t >= a.cols) break;
    const int64_t i = b * a.cols + t;
    if (!nonzero(mask[i])) {
      grad[i] = from_f32<T>(0.0f);  // padding is never read
      continue;
    }
    const double A = to_f32(adv[i]);
    const double d = double(to_f32(logp[i])) - double(to_f32(old_logp[i]));
    const bool in_clamp = d >= -kLogRatioLimit && d <= kLogRatioLimit;
    // Ternaries, not fmin/fmax: a NaN input must stay NaN (fmax would drop it).
    const double lr = d < -kLogRatioLimit ? -kLogRatioLimit : (d > kLogRatioLimit ? kLogRatioLimit : d);
    const double ratio = exp(lr);
    const double neg_a = -A;
    const bool in_range = ratio >= lo && ratio <= hi;
    const double pg1 = neg_a * ratio;
    const double pg2 = neg_a * (ratio < lo ? lo : (ratio > hi ? hi : ratio));
    const bool clip = pg2 > pg1;
    const bool tie = pg1 == pg2;
    double pg = clip ? pg2 : pg1;
    const double w1 = pg1 > pg2 ? 1.0 : (tie ? 0.5 : 0.0);
    const double w2 = clip ? 1.0 : (tie ? 0.5 : 0.0);
    double dpg = neg_a * (w1 + (in_range ? w2 : 0.0));  // d pg / d ratio
    const double pg3 = neg_a * dual_c;
    const bool dual = A < 0.0 && pg > pg3;
    pg = dual ? pg3 : pg;
    dpg = dual ? 0.0 : dpg;
    const double wt = kWeights ? double(to_f32(weights[i])) : 1.0;
    grad[i] = from_f32<T>(float(in_clamp ? dpg * wt * ratio * scale : 0.0));
    s[0] += pg * wt;
    s[1] += clip ? 1.0 : 0.0;
    s[2] += dual ? 1.0 : 0.0;
    s[3] += expm1(lr) - lr;
    s[4] += wt;
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
    finalize(Workspace w, int64_t blocks, PolicyStatsOut out) {
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
  for (int k = 0; k < kNumPolicyStats; ++k) *static_cast<T*>(out.stat[k]) = from_f32<T>(float(values[k]));
}

}  // namespace

size_t policy_loss_workspace_bytes(const PolicyLossArgs& a) {
  const int64_t blocks = a.rows * col_blocks(a);
  return 256 + ceil_div(a.rows * int64_t(sizeof(int)), 256) * 256 +
         size_t(blocks) * kSums * sizeof(double) + 256;
}

cudaError_t policy_loss_fwd(const PolicyLossArgs& a, void* grad_logp, const PolicyStatsOut& out,
                            void* workspace, cudaStream_t stream) {
  Workspace w = carve(workspace, a);
  cudaError_t err = cudaMemsetAsync(w.header, 0, sizeof(Header), stream);
  if (err != cudaSuccess) return err;
  const int64_t per_row = col_blocks(a);
  const int64_t blocks = a.rows * per_row;
  return with_scalar(a.dtype, [&](auto t) {
    using T = decltype(t);
    return with_mask(a.mask_kind, [&](auto m) {
      using M = decltype(m);
      if (a.rows > 0 && a.cols > 0) {
        count_rows<M><<<a.rows, kThreads, 0, stream>>>(static_cast<const M*>(a.mask), a.cols, w);
        if (a.is_weights != nullptr) {
          loss_tokens<T, M, true><<<blocks, kThreads, 0, stream>>>(a, static_cast<T*>(grad_logp), w, per_row);
        } else {
          loss_tokens<T, M, false><<<blocks, kThreads, 0, stream>>>(a, static_cast<T*>(grad_logp), w, per_row);
        }
      }
      finalize<T><<<1, kThreads, 0, stream>>>(w, blocks, out);
      return cudaGetLastError();
    });
  });
}

}  // namespace pfppo::cuda
