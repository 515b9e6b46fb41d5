// Token log-prob and entropy of softmax(logits) without any [N, V] temporary, on the CPU. The
// op's modes, arguments, row outputs and per-element math are csrc/logprob_entropy.h, shared
// with the CUDA kernel; this file is the OpenMP/SIMD schedule around them.
//
// Each row is read once, in chunks of kChunk columns that stay in L1: pass 1 takes the
// chunk max, pass 2 sums exp(x - m) and exp(x - m) * (x - m) against the running max m,
// rescaling the running sums when the max grows (online softmax, one exp per element):
//   s = sum_v exp(x_v - m),  u = sum_v exp(x_v - m) * (x_v - m)
//   lse = m + log s,  logp = x_label - lse,  H = log s - u / s
// Backward: grad_x = g [x is the label] - p (g + h (log p + H)),  log p = (x - m) - log s.
// With a temperature T the softmax is over y = x / T (divided per element as torch does, in
// the L1 chunk) and the gradient is the one above with y for x, divided by T. Columns
// [valid, V) (vocabulary padding) are never read in the forward and get gradient 0.
#include <algorithm>
#include <cmath>

#include "../logprob_entropy.h"
#include "cpu_math.h"

namespace pfppo::cpu {
namespace {

constexpr int64_t kChunk = 2048;

struct RowStats {
  float max;
  double sumexp;
  double sumexp_shifted;
};

// sum_i e^{d_i} and sum_i e^{d_i} d_i, d_i = x_i - m, into st. Acc: the lane type. A full
// chunk puts kChunk / 16 terms in each fp32 lane; a short one (small V, the tail of a row) has
// too few for fp32 lane roundings to average out, so it sums in fp64.
template <typename Acc>
PFPPO_INLINE void chunk_sums(const float* __restrict x, int64_t n, float m, RowStats& st) {
  Acc cs = 0;
  Acc cu = 0;
#pragma omp simd reduction(+ : cs, cu) simdlen(64)
  for (int64_t i = 0; i < n; ++i) {
    const float d = x[i] - m;
    const float e = exp_bounded(d);
    cs += Acc(e);
    cu += e > 0.0f ? Acc(e) * Acc(d) : Acc(0);  // -inf logits add 0, not 0 * -inf
  }
  st.sumexp += cs;
  st.sumexp_shifted += cu;
}

// Adds one chunk x[0, n) (fp32, in L1) to the running (m, s, u).
PFPPO_INLINE void chunk_update(const float* __restrict x, int64_t n, RowStats& st) {
  float cm = kNegInf;
#pragma omp simd reduction(max : cm) simdlen(64)
  for (int64_t i = 0; i < n; ++i) cm = x[i] > cm ? x[i] : cm;
  float m = st.max;
  if (cm > m) {
    if (st.sumexp > 0.0) {
      // Move the running sums from reference m to cm:
      //   s' = s e^{m-cm},  u' = e^{m-cm} (u + (m - cm) s)
      const double d = double(m) - double(cm);
      rescale_sums(st.sumexp, st.sumexp_shifted, d, std::exp(d));
    }
    m = cm;
    st.max = m;
  }
  if (m == kNegInf) return;  // every logit so far is -inf
  if (n == kChunk) {
    chunk_sums<float>(x, n, m, st);
  } else {
    chunk_sums<double>(x, n, m, st);
  }
}

// Stats of x[0, n) / t. fp32 rows at t = 1 are read in place; otherwise each chunk is
// widened and divided into an L1 buffer first.
PFPPO_CLONES RowStats row_stats(const float* x, int64_t n, float t) {
  RowStats st{kNegInf, 0.0, 0.0};
  if (t == 1.0f) {
    for (int64_t c0 = 0; c0 < n; c0 += kChunk) chunk_update(x + c0, std::min(kChunk, n - c0), st);
    return st;
  }
  alignas(64) float buf[kChunk];
  for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
    const int64_t k = std::min(kChunk, n - c0);
#pragma omp simd simdlen(32)
    for (int64_t i = 0; i < k; ++i) buf[i] = x[c0 + i] / t;
    chunk_update(buf, k, st);
  }
  return st;
}

PFPPO_CLONES RowStats row_stats(const Bf16* x, int64_t n, float t) {
  alignas(64) float buf[kChunk];
  RowStats st{kNegInf, 0.0, 0.0};
  for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
    const int64_t k = std::min(kChunk, n - c0);
    const uint16_t* bits = reinterpret_cast<const uint16_t*>(x + c0);
    if (t == 1.0f) {
#pragma omp simd simdlen(32)
      for (int64_t i = 0; i < k; ++i) buf[i] = bits_to_f32(uint32_t(bits[i]) << 16);
    } else {
#pragma omp simd simdlen(32)
      for (int64_t i = 0; i < k; ++i) buf[i] = bits_to_f32(uint32_t(bits[i]) << 16) / t;
    }
    chunk_update(buf, k, st);
  }
  return st;
}

// grad_x_v = (g [v == label] - p_v (g + h (log p_v + H))) / t,  log p_v = (x_v / t - m) - log s.
template <typename T, bool kScaled>
PFPPO_INLINE void row_grad_impl(const T* x, T* out, int64_t n, float m, float log_s, float entropy,
                                float g, float h, float t) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float y = kScaled ? to_f32(x[i]) / t : to_f32(x[i]);
    const float lp = softmax_logp(y, m, log_s);
    const float p = exp_bounded(lp);
    float val = softmax_grad(p, lp, g, h, entropy);
    if (kScaled) val = val / t;
    out[i] = from_f32<T>(p > 0.0f ? val : 0.0f);  // -inf logits: 0, not NaN
  }
}

template <typename T>
PFPPO_INLINE void row_grad_any(const T* x, T* out, int64_t n, float m, float log_s,
                               float entropy, float g, float h, float t) {
  if (t == 1.0f) {
    row_grad_impl<T, false>(x, out, n, m, log_s, entropy, g, h, t);
  } else {
    row_grad_impl<T, true>(x, out, n, m, log_s, entropy, g, h, t);
  }
}

PFPPO_CLONES void row_grad(const float* x, float* out, int64_t n, float m, float log_s,
                          float entropy, float g, float h, float t) {
  row_grad_any(x, out, n, m, log_s, entropy, g, h, t);
}
PFPPO_CLONES void row_grad(const Bf16* x, Bf16* out, int64_t n, float m, float log_s,
                          float entropy, float g, float h, float t) {
  row_grad_any(x, out, n, m, log_s, entropy, g, h, t);
}

template <typename T>
const T* row_ptr(const LogProbArgs& a, int64_t row) {
  return static_cast<const T*>(a.logits) + row * a.row_stride;
}

// Local column of the label, or -1 when it lies outside this shard's vocabulary columns.
int64_t local_label(const LogProbArgs& a, int64_t row) {
  int64_t col = a.labels[row] - a.vocab_start;
  return (col >= 0 && col < a.valid) ? col : -1;
}

// x[col] / t, rounded as in the forward's chunk buffer.
template <typename T>
float scaled(const T* x, int64_t col, float t) {
  return t == 1.0f ? to_f32(x[col]) : to_f32(x[col]) / t;
}

template <typename T>
void rows_impl(const LogProbArgs& a, LogProbMode mode, const LogProbRows& out) {
#pragma omp parallel for schedule(dynamic)
  for (int64_t row = 0; row < a.rows; ++row) {
    const T* x = row_ptr<T>(a, row);
    const RowStats st = row_stats(x, a.valid, a.temperature);
    const int64_t col = local_label(a, row);
    write_row(mode, out, row, st.max, st.sumexp, st.sumexp_shifted, col >= 0,
              col >= 0 ? scaled(x, col, a.temperature) : 0.0f);
  }
}

template <typename T>
void bwd_impl(const LogProbArgs& a, const LogProbBwdArgs& b) {
  if (a.rows == 0 || a.vocab == 0) return;  // nothing to write (and no zero divisor below)
  // Rows are cut into column blocks so that few rows still use every thread.
  const int64_t blocks_per_row = (a.vocab + 16 * kChunk - 1) / (16 * kChunk);
  const int64_t block_cols = (a.vocab + blocks_per_row - 1) / blocks_per_row;
  const int64_t total = a.rows * blocks_per_row;
  const float t = a.temperature;
  T* grad = static_cast<T*>(b.grad_logits);
#pragma omp parallel for schedule(dynamic)
  for (int64_t job = 0; job < total; ++job) {
    const int64_t row = job / blocks_per_row;
    const int64_t c0 = (job % blocks_per_row) * block_cols;
    const int64_t c1 = std::min(c0 + block_cols, a.vocab);
    const int64_t v1 = std::min(c1, std::max(c0, a.valid));  // [c0, v1) vocabulary, [v1, c1) padding
    const T* x = row_ptr<T>(a, row);
    T* out = grad + row * a.vocab;
    const float m = b.row_max[row];
    const float log_s = b.log_sumexp[row];
    const float ent = b.entropy[row];
    const float g = b.grad_logp[row];
    const float h = b.grad_entropy[row];
    if (v1 > c0) row_grad(x + c0, out + c0, v1 - c0, m, log_s, ent, g, h, t);
    for (int64_t i = v1; i < c1; ++i) out[i] = from_f32<T>(0.0f);
    const int64_t col = local_label(a, row);
    if (col >= c0 && col < v1) {
      float lp = softmax_logp(scaled(x, col, t), m, log_s);
      float p = std::exp(lp);
      float ent_term = p > 0.0f ? h * p * (lp + ent) : 0.0f;
      float val = g * (1.0f - p) - ent_term;
      out[col] = from_f32<T>(t == 1.0f ? val : val / t);
    }
  }
}

}  // namespace

void logprob_entropy_rows(const LogProbArgs& a, LogProbMode mode, const LogProbRows& out) {
  if (a.dtype == Scalar::kF32) {
    rows_impl<float>(a, mode, out);
  } else {
    rows_impl<Bf16>(a, mode, out);
  }
}

void logprob_entropy_bwd(const LogProbArgs& a, const LogProbBwdArgs& b) {
  if (a.dtype == Scalar::kF32) {
    bwd_impl<float>(a, b);
  } else {
    bwd_impl<Bf16>(a, b);
  }
}

}  // namespace pfppo::cpu
