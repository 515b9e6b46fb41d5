// PPO clipped policy loss on the CPU, forward and backward in one pass over [B, T]. The
// per-token math, the modes and the log-ratio clamp are csrc/policy_loss.h (shared with the
// CUDA kernel); this file is the OpenMP/SIMD schedule around them.
#include <algorithm>
#include <limits>
#include <type_traits>
#include <vector>

#include "../policy_loss.h"
#include "cpu_math.h"

namespace pfppo::cpu {
namespace {

constexpr int64_t kPiece = 8192;   // columns per parallel job
constexpr int64_t kBlock = 1024;   // tokens widened to fp32 in L1 at a time

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

// The per-token math (ppo_token) on fp32 arrays (mask as 0/1 floats, weights all 1 when none
// are given), in fp64. The loop sits directly in the cloned function: inlined into a clone
// from a helper, GCC left it scalar; ppo_token itself is always inlined.
PFPPO_CLONES BlockSums loss_core(const float* __restrict logp, const float* __restrict old_logp,
                                 const float* __restrict adv, const float* __restrict weights,
                                 const float* __restrict maskf, float* __restrict grad,
                                 int64_t n, double scale, ClipBounds c) {
  double s_loss = 0.0, s_kl = 0.0;
  float s_clip = 0.0f, s_dual = 0.0f, s_w = 0.0f;
#pragma omp simd reduction(+ : s_loss, s_clip, s_dual, s_kl, s_w)
  for (int64_t i = 0; i < n; ++i) {
    const bool m = maskf[i] != 0.0f;
    const double d = double(logp[i]) - double(old_logp[i]);
    const double lr = clamp_log_ratio(d);
    const double ratio = exp_f64(lr);
    const PpoToken tok = ppo_token(d, ratio, adv[i], weights[i], scale, c);
    grad[i] = m ? float(tok.grad) : 0.0f;
    s_loss += m ? tok.pg : 0.0;  // scaled by the caller
    s_clip += m ? float(tok.clip) : 0.0f;
    s_dual += m ? float(tok.dual) : 0.0f;
    s_kl += m ? k3_term(lr, ratio) : 0.0;
    s_w += m ? weights[i] : 0.0f;
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
                const M* mask, T* grad, int64_t n, double scale, const ClipBounds& c,
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
                          as_f32(adv, buf[3], n), w, maskf, g, n, scale, c);
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

  // c_i / m_i for each row (rows without tokens never use it).
  std::vector<double> row_scale(B);
  for (int64_t b = 0; b < B; ++b) row_scale[b] = agg_scale(a.agg, row_count[b], total, rows_with_tokens);
  const ClipBounds c = clip_bounds(a, std::numeric_limits<double>::infinity());
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
                 std::min(kBlock, c_end - c0), row_scale[b], c, sums);
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
