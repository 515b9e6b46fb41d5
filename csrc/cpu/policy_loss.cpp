// PPO clipped policy loss, forward and backward in one pass over [B, T].
//
// Per token (see pfppo_mega/ppo/losses.py policy_loss for the reference):
//   lr = clamp(logp - old_logp, -20, 20),  ratio = exp(lr)
//   pg1 = -A ratio,  pg2 = -A clamp(ratio, 1 - lo, 1 + hi),  pg = max(pg1, pg2)
//   pg = -A c where A < 0 and pg > -A c   (dual clip),  pg *= w   (behaviour IS weight)
// The loss is sum_i c_i pg_i with c_i = m_i / (normaliser of token i's aggregation mode), so
// d loss / d logp_i = c_i w_i ratio_i [|d_i| <= 20] d pg / d ratio is written in the same pass.
// Ties of max(pg1, pg2) split the gradient in half, as torch.maximum does.
#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_kernels.h"
#include "cpu_math.h"

namespace pfppo::cpu {
namespace {

constexpr int64_t kPiece = 8192;   // columns per parallel job
constexpr int64_t kBlock = 1024;   // tokens widened to fp32 in L1 at a time
constexpr double kLogRatioLimit = 20.0;

struct LossParams {
  double ratio_lo;
  double ratio_hi;
  double dual_clip_c;  // +inf without dual clip
};

struct LossSums {
  double loss = 0.0;
  double clip = 0.0;
  double dual = 0.0;
  double kl = 0.0;
  double weight = 0.0;
};

template <typename M>
PFPPO_INLINE int64_t count_nonzero_impl(const M* mask, int64_t n) {
  int64_t c = 0;
#pragma omp simd reduction(+ : c)
  for (int64_t i = 0; i < n; ++i) c += nonzero(mask[i]) ? 1 : 0;
  return c;
}

// Sums over one block (scaled and folded into LossSums by the caller).
struct BlockSums {
  double loss;
  float clip, dual;
  double kl;
  float weight;
};

// The per-token math, on fp32 arrays (mask as 0/1 floats, weights all 1 when none are given)
// but in fp64: logp - old_logp of two floats is exact in fp64, so every token's loss, clip
// decision and gradient is as the fp64 reference has it, rounded once. (In fp32 the rounding
// of that difference alone costs the loss a few ulp.) The loop sits directly in the cloned
// function: inlined into a clone from a helper, GCC left it scalar.
PFPPO_CLONES BlockSums loss_core(const float* __restrict logp, const float* __restrict old_logp,
                                 const float* __restrict adv, const float* __restrict weights,
                                 const float* __restrict maskf, float* __restrict grad,
                                 int64_t n, double scale, double ratio_lo, double ratio_hi,
                                 double dual_c) {
  double s_loss = 0.0, s_kl = 0.0;
  float s_clip = 0.0f, s_dual = 0.0f, s_w = 0.0f;
#pragma omp simd reduction(+ : s_loss, s_clip, s_dual, s_kl, s_w)
  for (int64_t i = 0; i < n; ++i) {
    const bool m = maskf[i] != 0.0f;
    const double a = adv[i];
    const double d = double(logp[i]) - double(old_logp[i]);
    const bool in_clamp = d >= -kLogRatioLimit && d <= kLogRatioLimit;
    double lr = d < -kLogRatioLimit ? -kLogRatioLimit : d;
    lr = lr > kLogRatioLimit ? kLogRatioLimit : lr;
    const double ratio = exp_f64(lr);
    const double neg_a = -a;
    double ratio_c = ratio < ratio_lo ? ratio_lo : ratio;
    ratio_c = ratio_c > ratio_hi ? ratio_hi : ratio_c;
    const bool in_range = ratio >= ratio_lo && ratio <= ratio_hi;
    const double pg1 = neg_a * ratio;
    const double pg2 = neg_a * ratio_c;
    const bool clip = pg2 > pg1;
    const bool tie = pg1 == pg2;
    double pg = clip ? pg2 : pg1;
    const double w1 = pg1 > pg2 ? 1.0 : (tie ? 0.5 : 0.0);
    const double w2 = clip ? 1.0 : (tie ? 0.5 : 0.0);
    double dpg = neg_a * (w1 + (in_range ? w2 : 0.0));  // d pg / d ratio
    const double pg3 = neg_a * dual_c;
    const bool dual = a < 0.0 && pg > pg3;
    pg = dual ? pg3 : pg;
    dpg = dual ? 0.0 : dpg;
    const double w = weights[i];
    const double g = in_clamp ? dpg * w * ratio * scale : 0.0;
    grad[i] = m ? float(g) : 0.0f;
    s_loss += m ? pg * w : 0.0;  // scaled by the caller
    s_clip += (m && clip) ? 1.0f : 0.0f;
    s_dual += (m && dual) ? 1.0f : 0.0f;
    s_kl += m ? k3_term_f64(lr, ratio) : 0.0;
    s_w += m ? float(w) : 0.0f;
  }
  return {s_loss, s_clip, s_dual, s_kl, s_w};
}

// x as fp32: itself when it already is, else widened into buf.
template <typename T>
PFPPO_INLINE const float* as_f32(const T* x, float* buf, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    for (int64_t i = 0; i < n; ++i) buf[i] = widen(x[i]);
    return buf;
  }
}

// Tokens [0, n <= kBlock) of one row; scale is c_i / m_i for this row. bf16 inputs, byte
// masks and absent weights become fp32 blocks that stay in L1.
template <typename T, typename M>
void loss_block(const T* logp, const T* old_logp, const T* adv, const T* weights,
                const M* mask, T* grad, int64_t n, double scale, const LossParams& p,
                LossSums& sums) {
  alignas(64) float buf[6][kBlock];
  const float* maskf = as_f32(mask, buf[0], n);  // read as "!= 0"
  const float* w = buf[4];
  if (weights != nullptr) {
    w = as_f32(weights, buf[4], n);
  } else {
    std::fill(buf[4], buf[4] + n, 1.0f);
  }
  float* g = std::is_same_v<T, float> ? reinterpret_cast<float*>(grad) : buf[5];
  BlockSums s = loss_core(as_f32(logp, buf[1], n), as_f32(old_logp, buf[2], n),
                          as_f32(adv, buf[3], n), w, maskf, g, n, scale, p.ratio_lo,
                          p.ratio_hi, p.dual_clip_c);
  if constexpr (!std::is_same_v<T, float>) {
    for (int64_t i = 0; i < n; ++i) grad[i] = from_f32<T>(g[i]);
  }
  sums.loss += s.loss * scale;
  sums.clip += s.clip;
  sums.dual += s.dual;
  sums.kl += s.kl;
  sums.weight += s.weight;
}

template <typename T, typename M>
void loss_impl(const PolicyLossArgs& a, void* grad_out, double* stats) {
  const int64_t B = a.rows, T_ = a.cols;
  const M* mask = static_cast<const M*>(a.mask);

  // Pass 1 (mask only): real tokens per row, in total, and rows with at least one.
  std::vector<int64_t> row_count(B);
#pragma omp parallel for schedule(dynamic, 16)
  for (int64_t b = 0; b < B; ++b) row_count[b] = count_nonzero_impl(mask + b * T_, T_);
  int64_t total = 0, rows_with_tokens = 0;
  for (int64_t b = 0; b < B; ++b) {
    total += row_count[b];
    rows_with_tokens += row_count[b] > 0 ? 1 : 0;
  }

  // c_i / m_i for each row (token-mean: 1/total; seq-mean-token-sum: 1/rows;
  // seq-mean-token-mean: 1/(row_count * rows)). Rows without tokens never use it.
  std::vector<double> row_scale(B, 0.0);
  for (int64_t b = 0; b < B; ++b) {
    if (row_count[b] == 0) continue;
    double s = 1.0 / double(total);
    if (a.agg == AggMode::kSeqMeanTokenSum) s = 1.0 / double(rows_with_tokens);
    if (a.agg == AggMode::kSeqMeanTokenMean) s = 1.0 / (double(row_count[b]) * rows_with_tokens);
    row_scale[b] = s;
  }

  // Without dual clip c = +inf: -A c is then +inf (or NaN for A = 0), never below pg.
  const double dual_c = a.dual_clip ? a.dual_clip_c : std::numeric_limits<double>::infinity();
  const LossParams p{1.0 - a.clip_ratio_low, 1.0 + a.clip_ratio_high, dual_c};
  const T* logp = static_cast<const T*>(a.logp);
  const T* old_logp = static_cast<const T*>(a.old_logp);
  const T* adv = static_cast<const T*>(a.advantages);
  const T* weights = static_cast<const T*>(a.is_weights);
  T* grad = static_cast<T*>(grad_out);

  // Pass 2: every token once. Jobs are (row, column piece) so few long rows still split.
  const int64_t pieces = std::max<int64_t>(1, (T_ + kPiece - 1) / kPiece);
  const int64_t jobs = B * pieces;
  double loss = 0.0, clip = 0.0, dual = 0.0, kl = 0.0, weight = 0.0;
#pragma omp parallel for schedule(dynamic) reduction(+ : loss, clip, dual, kl, weight)
  for (int64_t j = 0; j < jobs; ++j) {
    const int64_t b = j / pieces;
    const int64_t c_end = std::min(T_, (j % pieces + 1) * kPiece);
    LossSums sums;
    for (int64_t c0 = (j % pieces) * kPiece; c0 < c_end; c0 += kBlock) {
      const int64_t off = b * T_ + c0;
      loss_block(logp + off, old_logp + off, adv + off,
                 weights != nullptr ? weights + off : nullptr, mask + off, grad + off,
                 std::min(kBlock, c_end - c0), row_scale[b], p, sums);
    }
    loss += sums.loss;
    clip += sums.clip;
    dual += sums.dual;
    kl += sums.kl;
    weight += sums.weight;
  }

  const double inv_total = total > 0 ? 1.0 / double(total) : 0.0;
  stats[kLoss] = loss;
  stats[kClipFrac] = clip * inv_total;
  stats[kClipFracLower] = dual * inv_total;
  stats[kApproxKl] = kl * inv_total;
  stats[kIsWeightMean] = weight * inv_total;
}

template <typename T>
void dispatch_mask(const PolicyLossArgs& a, void* grad, double* stats) {
  switch (a.mask_kind) {
    case Mask::kBool: return loss_impl<T, uint8_t>(a, grad, stats);
    case Mask::kF32: return loss_impl<T, float>(a, grad, stats);
    case Mask::kBF16: return loss_impl<T, Bf16>(a, grad, stats);
  }
}

}  // namespace

void policy_loss_fwd(const PolicyLossArgs& a, void* grad_logp, double* stats) {
  if (a.dtype == Scalar::kF32) {
    dispatch_mask<float>(a, grad_logp, stats);
  } else {
    dispatch_mask<Bf16>(a, grad_logp, stats);
  }
}

}  // namespace pfppo::cpu
