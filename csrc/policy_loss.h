// The fused PPO policy loss (pfppo::policy_loss), the whole op but its two kernels. Torch-free
// above the PFPPO_HOST line: included by the CPU kernel (csrc/cpu/policy_loss.cpp), the CUDA
// kernel (csrc/cuda/policy_loss.cu) and csrc/module.cpp, which exports the mode table to
// Python as pfppo_mega._C.policy_loss_agg_modes. csrc/ops.cpp includes it with PFPPO_HOST for
// the part below that line: the schema, the input checks and the one host wrapper of both
// devices. Autograd and the fake (meta) kernel: pfppo_mega/kernels/ops.py, which reads the
// keyword list from the schema and the modes from the extension.
//
//   PFPPO_POLICY_LOSS_AGG_MODES   the table of loss_agg_mode names (one row per mode)
//   agg_scale                     c_i / m_i: the weight of a real token of a row, per mode
//   clamp_log_ratio, ppo_token    the per-token clip math (loss term, flags, d loss / d logp)
//   k3_term                       the per-token k3 KL estimate
//
// The functions are PFPPO_HD (csrc/kernel_types.h), so both devices run the same statements.
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

namespace pfppo {

// X(enumerator, name): every mode the op takes. A new mode is one row here plus its case in
// agg_scale (the switch has no default, so -Wswitch names a row without a case).
#define PFPPO_POLICY_LOSS_AGG_MODES(X)      \
  X(kTokenMean, "token-mean")               \
  X(kSeqMeanTokenSum, "seq-mean-token-sum") \
  X(kSeqMeanTokenMean, "seq-mean-token-mean")

// How the per-token policy loss is reduced (see pfppo_mega/ppo/losses.py agg_loss).
enum class AggMode : int { PFPPO_POLICY_LOSS_AGG_MODES(PFPPO_TABLE_ENUM) };
constexpr const char* kAggModeNames[] = {PFPPO_POLICY_LOSS_AGG_MODES(PFPPO_TABLE_NAME)};
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

// k3 KL term exp(x) - 1 - x in fp64 (ratio = exp(x) given): the series to x^9 for
// |x| < 0.25 (truncation < 1e-10 relative), where the direct form cancels; direct beyond.
PFPPO_HD double k3_term(double x, double ratio) {
  double q = 1.0 / 362880.0;
  q = q * x + 1.0 / 40320.0;
  q = q * x + 1.0 / 5040.0;
  q = q * x + 1.0 / 720.0;
  q = q * x + 1.0 / 120.0;
  q = q * x + 1.0 / 24.0;
  q = q * x + 1.0 / 6.0;
  q = q * x + 0.5;
  const double series = q * (x * x);
  const double direct = (ratio - 1.0) - x;
  const double ax = x < 0.0 ? -x : x;
  return ax < 0.25 ? series : direct;
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

// ---------------------------------------------------------------------------------------------
// Host (torch): the schema, the input checks and the one wrapper that runs the CPU or, in a
// CUDA build (PFPPO_WITH_CUDA), the CUDA kernel. Compiled once, by csrc/ops.cpp.
#ifdef PFPPO_HOST
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <sstream>
#include <string>

#include "api.h"

namespace pfppo {
namespace policy_loss_host {

constexpr const char* kOp = "pfppo::policy_loss";

AggMode parse_agg_mode(const std::string& name) {
  for (int k = 0; k < kNumAggModes; ++k) {
    if (name == kAggModeNames[k]) return static_cast<AggMode>(k);
  }
  std::ostringstream allowed;
  for (int k = 0; k < kNumAggModes; ++k) allowed << (k ? ", '" : "('") << kAggModeNames[k] << "'";
  TORCH_CHECK_VALUE(false, kOp, ": loss_agg_mode='", name, "' is not one of ", allowed.str(), ")");
}

PolicyLossArgs check_policy_loss(const at::Tensor& logp, const at::Tensor& old_logp,
                                 const at::Tensor& advantages, const at::Tensor& mask,
                                 const std::optional<at::Tensor>& is_weights,
                                 double clip_ratio_low, double clip_ratio_high,
                                 std::optional<double> dual_clip_c,
                                 const std::string& loss_agg_mode) {
  const char* op = kOp;
  check_defined(op, logp, "logp", "[B, T]");
  TORCH_CHECK_VALUE(logp.dim() == 2, op, ": logp must have shape [B, T] (2-D); got ",
                    shape_str(logp));
  TORCH_CHECK_VALUE(logp.is_contiguous(), op, ": logp [B, T] must be contiguous; got strides ",
                    strides_str(logp), " for shape ", shape_str(logp));
  const Scalar dtype = scalar_kind(logp, op, "logp", "[B, T]");
  auto same_dtype = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK_TYPE(t.scalar_type() == logp.scalar_type(), op, ": ", name,
                     " [B, T] must have the dtype of logp (", logp.scalar_type(), "); got ",
                     t.scalar_type());
  };
  check_like_bt(op, logp, "logp", old_logp, "old_logp");
  same_dtype(old_logp, "old_logp");
  check_like_bt(op, logp, "logp", advantages, "advantages");
  same_dtype(advantages, "advantages");
  check_like_bt(op, logp, "logp", mask, "mask");
  const Mask mk = mask_kind(mask, op, "mask", "[B, T]");
  const void* weights = nullptr;
  if (is_weights.has_value() && is_weights->defined()) {
    check_like_bt(op, logp, "logp", *is_weights, "is_weights");
    same_dtype(*is_weights, "is_weights");
    weights = is_weights->data_ptr();
  }
  TORCH_CHECK_VALUE(clip_ratio_low >= 0.0 && clip_ratio_low < 1.0, op,
                    ": clip_ratio_low=", clip_ratio_low, " must be in [0, 1)");
  TORCH_CHECK_VALUE(clip_ratio_high >= 0.0, op, ": clip_ratio_high=", clip_ratio_high,
                    " must be >= 0");
  TORCH_CHECK_VALUE(!dual_clip_c.has_value() || *dual_clip_c > 1.0, op,
                    ": dual_clip_c=", dual_clip_c.value_or(0.0),
                    " must be > 1 (it bounds the loss at -A*c for A < 0)");
  const AggMode agg = parse_agg_mode(loss_agg_mode);
  return PolicyLossArgs{logp.data_ptr(),  old_logp.data_ptr(), advantages.data_ptr(),
                        weights,          dtype,               mask.data_ptr(),
                        mk,               logp.size(0),        logp.size(1),
                        clip_ratio_low,   clip_ratio_high,     dual_clip_c.has_value(),
                        dual_clip_c.value_or(0.0), agg};
}

// One wrapper for both devices: the five stats as 0-dim tensors of logp's dtype, and
// d loss / d logp [B, T].
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> policy_loss(
    const at::Tensor& logp, const at::Tensor& old_logp, const at::Tensor& advantages,
    const at::Tensor& mask, const std::optional<at::Tensor>& is_weights, double clip_ratio_low,
    double clip_ratio_high, std::optional<double> dual_clip_c, c10::string_view loss_agg_mode) {
  PolicyLossArgs a =
      check_policy_loss(logp, old_logp, advantages, mask, is_weights, clip_ratio_low,
                        clip_ratio_high, dual_clip_c, std::string(loss_agg_mode));
  at::Tensor grad = at::empty_like(logp, at::MemoryFormat::Contiguous);
  at::Tensor stats[kNumPolicyStats];
  for (auto& s : stats) s = at::empty({}, logp.options());
  if (logp.is_cuda()) {
#ifdef PFPPO_WITH_CUDA
    CudaLaunch launch(logp, kOp);
    void* stat[kNumPolicyStats];
    for (int k = 0; k < kNumPolicyStats; ++k) stat[k] = stats[k].data_ptr();
    at::Tensor ws = workspace_bytes(logp, cuda::policy_loss_workspace_bytes(a));
    launch.check(cuda::policy_loss_fwd(a, grad.data_ptr(), stat, ws.data_ptr(), launch.stream()));
#endif
  } else {
    double values[kNumPolicyStats];
    cpu::policy_loss_fwd(a, grad.data_ptr(), values);
    for (int k = 0; k < kNumPolicyStats; ++k) stats[k].fill_(values[k]);
  }
  return {stats[kLoss],     stats[kClipFrac],     stats[kClipFracLower],
          stats[kApproxKl], stats[kIsWeightMean], grad};
}

}  // namespace policy_loss_host

TORCH_LIBRARY_FRAGMENT(pfppo, m) {
  m.def(
      "policy_loss(Tensor logp, Tensor old_logp, Tensor advantages, Tensor mask, "
      "Tensor? is_weights, float clip_ratio_low, float clip_ratio_high, float? dual_clip_c, "
      "str loss_agg_mode) -> (Tensor loss, "
      "Tensor pg_clipfrac, Tensor pg_clipfrac_lower, Tensor approx_kl, Tensor is_weight_mean, "
      "Tensor grad_logp)");
}

TORCH_LIBRARY_IMPL(pfppo, CPU, m) { m.impl("policy_loss", &policy_loss_host::policy_loss); }

#ifdef PFPPO_WITH_CUDA
TORCH_LIBRARY_IMPL(pfppo, CUDA, m) { m.impl("policy_loss", &policy_loss_host::policy_loss); }
#endif

}  // namespace pfppo
#endif  // PFPPO_HOST
