// Token log-prob and entropy of softmax(logits) without any [N, V] temporary.
//
// Each row is read once, in chunks of kChunk columns that stay in L1: pass 1 takes the
// chunk max, pass 2 sums exp(x - m) and exp(x - m) * (x - m) against the running max m,
// rescaling the running sums when the max grows (online softmax, one exp per element):
//   s = sum_v exp(x_v - m),  u = sum_v exp(x_v - m) * (x_v - m)
//   lse = m + log s,  logp = x_label - lse,  H = log s - u / s
// Backward: grad_x = g [x is the label] - p (g + h (log p + H)),  log p = (x - m) - log s.
#include <algorithm>
#include <cmath>

#include "cpu_kernels.h"
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
      const double scale = std::exp(d);
      st.sumexp_shifted = (st.sumexp_shifted + d * st.sumexp) * scale;
      st.sumexp *= scale;
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

PFPPO_CLONES RowStats row_stats(const float* x, int64_t vocab) {
  RowStats st{kNegInf, 0.0, 0.0};
  for (int64_t c0 = 0; c0 < vocab; c0 += kChunk) {
    chunk_update(x + c0, std::min(kChunk, vocab - c0), st);
  }
  return st;
}

// bf16 rows are widened chunk by chunk into an L1 buffer first.
PFPPO_CLONES RowStats row_stats(const Bf16* x, int64_t vocab) {
  alignas(64) float buf[kChunk];
  RowStats st{kNegInf, 0.0, 0.0};
  for (int64_t c0 = 0; c0 < vocab; c0 += kChunk) {
    const int64_t n = std::min(kChunk, vocab - c0);
    const uint16_t* bits = reinterpret_cast<const uint16_t*>(x + c0);
#pragma omp simd simdlen(32)
    for (int64_t i = 0; i < n; ++i) buf[i] = bits_to_f32(uint32_t(bits[i]) << 16);
    chunk_update(buf, n, st);
  }
  return st;
}

// grad_x_v = g [v == label] - p_v (g + h (log p_v + H)),  log p_v = (x_v - m) - log s.
template <typename T>
PFPPO_INLINE void row_grad_impl(const T* x, T* out, int64_t n, float m, float log_s, float entropy,
                                float g, float h) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    float lp = (to_f32(x[i]) - m) - log_s;
    float p = exp_bounded(lp);
    float val = -p * (g + h * (lp + entropy));
    out[i] = from_f32<T>(p > 0.0f ? val : 0.0f);  // -inf logits: 0, not NaN
  }
}

PFPPO_CLONES void row_grad(const float* x, float* out, int64_t n, float m, float log_s,
                          float entropy, float g, float h) {
  row_grad_impl(x, out, n, m, log_s, entropy, g, h);
}
PFPPO_CLONES void row_grad(const Bf16* x, Bf16* out, int64_t n, float m, float log_s,
                          float entropy, float g, float h) {
  row_grad_impl(x, out, n, m, log_s, entropy, g, h);
}

template <typename T>
const T* row_ptr(const LogProbArgs& a, int64_t row) {
  return static_cast<const T*>(a.logits) + row * a.row_stride;
}

// Local column of the label, or -1 when it lies outside this shard.
int64_t local_label(const LogProbArgs& a, int64_t row) {
  int64_t col = a.labels[row] - a.vocab_start;
  return (col >= 0 && col < a.vocab) ? col : -1;
}

template <typename T>
void fwd_impl(const LogProbArgs& a, const LogProbOut& out) {
#pragma omp parallel for schedule(dynamic)
  for (int64_t row = 0; row < a.rows; ++row) {
    const T* x = row_ptr<T>(a, row);
    RowStats st = row_stats(x, a.vocab);
    double log_s = std::log(st.sumexp);
    double lse = double(st.max) + log_s;
    int64_t col = local_label(a, row);
    double target = col >= 0 ? double(to_f32(x[col])) : std::nan("");
    out.logp[row] = float(target - lse);
    out.entropy[row] = float(log_s - st.sumexp_shifted / st.sumexp);
    out.row_max[row] = st.max;
    out.log_sumexp[row] = float(log_s);
  }
}

template <typename T>
void partials_impl(const LogProbArgs& a, const LogProbPartialsOut& out) {
#pragma omp parallel for schedule(dynamic)
  for (int64_t row = 0; row < a.rows; ++row) {
    const T* x = row_ptr<T>(a, row);
    RowStats st = row_stats(x, a.vocab);
    int64_t col = local_label(a, row);
    out.max[row] = st.max;
    out.sumexp[row] = float(st.sumexp);
    out.sumexp_shifted[row] = float(st.sumexp_shifted);
    out.target[row] = col >= 0 ? to_f32(x[col]) : 0.0f;
  }
}

template <typename T>
void bwd_impl(const LogProbArgs& a, const LogProbBwdArgs& b) {
  // Rows are cut into column blocks so that few rows still use every thread.
  const int64_t blocks_per_row = (a.vocab + 16 * kChunk - 1) / (16 * kChunk);
  const int64_t block_cols = (a.vocab + blocks_per_row - 1) / blocks_per_row;
  const int64_t total = a.rows * blocks_per_row;
  T* grad = static_cast<T*>(b.grad_logits);
#pragma omp parallel for schedule(dynamic)
  for (int64_t job = 0; job < total; ++job) {
    const int64_t row = job / blocks_per_row;
    const int64_t c0 = (job % blocks_per_row) * block_cols;
    const int64_t n = std::min(block_cols, a.vocab - c0);
    const T* x = row_ptr<T>(a, row);
    T* out = grad + row * a.vocab;
    const float m = b.row_max[row];
    const float log_s = b.log_sumexp[row];
    const float ent = b.entropy[row];
    const float g = b.grad_logp[row];
    const float h = b.grad_entropy[row];
    row_grad(x + c0, out + c0, n, m, log_s, ent, g, h);
    const int64_t col = local_label(a, row);
    if (col >= c0 && col < c0 + n) {
      float lp = (to_f32(x[col]) - m) - log_s;
      float p = std::exp(lp);
      float ent_term = p > 0.0f ? h * p * (lp + ent) : 0.0f;
      out[col] = from_f32<T>(g * (1.0f - p) - ent_term);
    }
  }
}

}  // namespace

void logprob_entropy_fwd(const LogProbArgs& a, const LogProbOut& out) {
  if (a.dtype == Scalar::kF32) {
    fwd_impl<float>(a, out);
  } else {
    fwd_impl<Bf16>(a, out);
  }
}

void logprob_entropy_partials(const LogProbArgs& a, const LogProbPartialsOut& out) {
  if (a.dtype == Scalar::kF32) {
    partials_impl<float>(a, out);
  } else {
    partials_impl<Bf16>(a, out);
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
