// The fused PPO policy loss (pfppo::policy_loss), written once for every device. Torch-free:
// included by the host wrapper (csrc/policy_loss.cpp), the CPU kernel
// (csrc/cpu/policy_loss.cpp), the CUDA kernel (csrc/cuda/policy_loss.cu) and csrc/module.cpp,
// which exports the mode table to Python as pfppo_mega._C.policy_loss_agg_modes.
//
//   PFPPO_POLICY_LOSS_AGG_MODES   the table of loss_agg_mode names (one row per mode)
//   agg_scale                     c_i / m_i: the weight of a real token of a row, per mode
//   clamp_log_ratio, ppo_token    the per-token clip math (loss term, flags, d loss / d logp)
//
// The functions are PFPPO_HD: __host__ __device__ under nvcc, plain inline functions under a
// C++ compiler, so the CPU's vectorised loop and the CUDA kernel run the same statements.
// Reference: pfppo_mega/ppo/losses.py policy_loss; per token
//   lr = clamp(logp - old_logp, -20, 20),  ratio = exp(lr)
//   pg1 = -A ratio,  pg2 = -A clamp(ratio, 1 - lo, 1 + hi),  pg = max(pg1, pg2)
//   pg = -A c where A < 0 and pg > -A c   (dual clip),  pg *= w   (behaviour IS weight)
// loss = sum_i c_i pg_i, so d loss / d logp_i = c_i w_i ratio_i [|d_i| <= 20] d pg / d ratio.
// Ties of max(pg1, pg2) split the gradient in half, as torch.maximum does.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernel_types.h"

#if defined(__CUDACC__)
#define PFPPO_HD __host__ __device__ __forceinline__
#else
#define PFPPO_HD inline __attribute__((always_inline))
#endif

namespace pfppo {

// X(enumerator, name): every mode the op takes. A new mode is one row here plus its case in
// agg_scale (the switch has no default, so -Wswitch names a row without a case).
#define PFPPO_POLICY_LOSS_AGG_MODES(X)      \
  X(kTokenMean, "token-mean")               \
  X(kSeqMeanTokenSum, "seq-mean-token-sum") \
  X(kSeqMeanTokenMean, "seq-mean-token-mean")

// How the per-token policy loss is reduced (see pfppo_mega/ppo/losses.py agg_loss).
enum class AggMode : int {
#define PFPPO_AGG_ENUM(id, name) id,
  PFPPO_POLICY_LOSS_AGG_MODES(PFPPO_AGG_ENUM)
#undef PFPPO_AGG_ENUM
};

constexpr const char* kAggModeNames[] = {
#define PFPPO_AGG_NAME(id, name) name,
    PFPPO_POLICY_LOSS_AGG_MODES(PFPPO_AGG_NAME)
#undef PFPPO_AGG_NAME
};
constexpr int kNumAggModes = int(sizeof(kAggModeNames) / sizeof(kAggModeNames[0]));

// The log-ratio clamp (pfppo_mega/constants.py LOG_RATIO_LIMIT; tests/test_config.py compares).
constexpr double kLogRatioLimit = 20.0;

struct PolicyLossArgs {
  const void* logp;        // [B, T]
  const void* old_logp;    // [B, T]
  const void* advantages;  // [B, T]
  const void* is_weights;  // [B, T] or nullptr (all ones)
  Scalar dtype;            // of the four above
  const void* mask;        // [B, T]
  Mask mask_kind;
  int64_t rows;
  int64_t cols;
  double clip_ratio_low;
  double clip_ratio_high;
  bool dual_clip;
  double dual_clip_c;
  AggMode agg;
};

// The five scalars of PolicyLossOutput, in this order.
enum PolicyStat : int {
  kLoss = 0,
  kClipFrac = 1,
  kClipFracLower = 2,
  kApproxKl = 3,
  kIsWeightMean = 4,
  kNumPolicyStats = 5
};

// c_i / m_i of a real token of a row with row_count real tokens; total real tokens and
// rows_with_tokens (rows with >= 1) over the batch. 0 for a row without tokens.
PFPPO_HD double agg_scale(AggMode mode, int64_t row_count, int64_t total,
                          int64_t rows_with_tokens) {
  if (row_count == 0) return 0.0;
  switch (mode) {
    case AggMode::kTokenMean: return 1.0 / double(total);
    case AggMode::kSeqMeanTokenSum: return 1.0 / double(rows_with_tokens);
    case AggMode::kSeqMeanTokenMean:
      return 1.0 / (double(row_count) * double(rows_with_tokens));
  }
  return 0.0;
}

// The clip bounds of one call: ratios [lo, hi] and the dual-clip constant (+inf: none; -A c
// is then +inf, or NaN for A = 0, never below pg).
struct ClipBounds {
  double lo;
  double hi;
  double dual_c;
};

PFPPO_HD ClipBounds clip_bounds(const PolicyLossArgs& a, double inf) {
  return ClipBounds{1.0 - a.clip_ratio_low, 1.0 + a.clip_ratio_high,
                    a.dual_clip ? a.dual_clip_c : inf};
}

// clamp(d, -20, 20) with ternaries (not fmin/fmax: a NaN must stay NaN).
PFPPO_HD double clamp_log_ratio(double d) {
  const double lr = d < -kLogRatioLimit ? -kLogRatioLimit : d;
  return lr > kLogRatioLimit ? kLogRatioLimit : lr;
}

// One token's terms. d = logp - old_logp in fp64 (exact for two floats, so every token's
// loss, clip decision and gradient is the fp64 reference's, rounded once); ratio = exp(lr)
// from the device's own exp; scale = c_i.
// (The flags are 0/1 doubles, not bools: with bool fields GCC left the CPU loop scalar.)
struct PpoToken {
  double pg;    // loss term (times w; summed and scaled by the caller)
  double grad;  // d loss / d logp
  double clip;  // 1 where pg2 > pg1, else 0
  double dual;  // 1 where the dual clip is active, else 0
};

PFPPO_HD PpoToken ppo_token(double d, double ratio, double adv, double w, double scale,
                            const ClipBounds& c) {
  const bool in_clamp = d >= -kLogRatioLimit && d <= kLogRatioLimit;
  const double neg_a = -adv;
  double ratio_c = ratio < c.lo ? c.lo : ratio;
  ratio_c = ratio_c > c.hi ? c.hi : ratio_c;
  const bool in_range = ratio >= c.lo && ratio <= c.hi;
  const double pg1 = neg_a * ratio;
  const double pg2 = neg_a * ratio_c;
  const bool clip = pg2 > pg1;
  const bool tie = pg1 == pg2;
  double pg = clip ? pg2 : pg1;
  const double w1 = pg1 > pg2 ? 1.0 : (tie ? 0.5 : 0.0);
  const double w2 = clip ? 1.0 : (tie ? 0.5 : 0.0);
  double dpg = neg_a * (w1 + (in_range ? w2 : 0.0));  // d pg / d ratio
  const double pg3 = neg_a * c.dual_c;
  const bool dual = adv < 0.0 && pg > pg3;
  pg = dual ? pg3 : pg;
  dpg = dual ? 0.0 : dpg;
  return PpoToken{pg * w, in_clamp ? dpg * w * ratio * scale : 0.0, clip ? 1.0 : 0.0, dual ? 1.0 : 0.0};
}

// The kernels behind the host wrapper (raw pointers; the wrapper has checked every input).
namespace cpu {
// grad_logp [B, T] (d loss / d logp) and stats[kNumPolicyStats].
void policy_loss_fwd(const PolicyLossArgs& a, void* grad_logp, double* stats);
}  // namespace cpu

namespace cuda {
size_t policy_loss_workspace_bytes(const PolicyLossArgs& a);
// grad_logp [B, T] (dtype of logp) and stat[k]: 0-dim device scalars of that dtype; stream: a
// cudaStream_t. Returns the cudaError_t of the launches (0 = queued).
int policy_loss_fwd(const PolicyLossArgs& a, void* grad_logp, void* const* stat,
                    void* workspace, void* stream);
}  // namespace cuda

}  // namespace pfppo
