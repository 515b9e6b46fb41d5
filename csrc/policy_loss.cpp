// pfppo::policy_loss on the host: its schema, its input checks and the one wrapper that runs
// the CPU or the CUDA kernel (csrc/policy_loss.h). Autograd and the fake (meta) kernel are
// registered from Python (pfppo_mega/kernels/ops.py), which reads the keyword list from this
// schema and the modes from pfppo_mega._C.policy_loss_agg_modes.
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <limits>
#include <sstream>

#include "api.h"
#include "policy_loss.h"

namespace pfppo {
namespace {

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
    at::Tensor ws = at::empty({int64_t(cuda::policy_loss_workspace_bytes(a))},
                              logp.options().dtype(at::kByte));
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(pfppo, m) {
  m.def(
      "policy_loss(Tensor logp, Tensor old_logp, Tensor advantages, Tensor mask, "
      "Tensor? is_weights, float clip_ratio_low, float clip_ratio_high, float? dual_clip_c, "
      "str loss_agg_mode) -> (Tensor loss, "
      "Tensor pg_clipfrac, Tensor pg_clipfrac_lower, Tensor approx_kl, Tensor is_weight_mean, "
      "Tensor grad_logp)");
}

TORCH_LIBRARY_IMPL(pfppo, CPU, m) { m.impl("policy_loss", &policy_loss); }

#ifdef PFPPO_WITH_CUDA
TORCH_LIBRARY_IMPL(pfppo, CUDA, m) { m.impl("policy_loss", &policy_loss); }
#endif

}  // namespace pfppo
