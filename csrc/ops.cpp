// Operator schemas (namespace pfppo) and their CPU implementations. The CUDA
// implementations live in csrc/cuda/ops_cuda.cpp; autograd and fake (meta) implementations
// are registered from Python in pfppo_mega/kernels/ops.py.
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/scalar_tensor.h>
#include <torch/library.h>

#include "api.h"
#include "cpu/cpu_kernels.h"

namespace pfppo {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> logprob_entropy_cpu(
    const at::Tensor& logits, const at::Tensor& labels, double temperature, int64_t vocab_size) {
  LogProbArgs a =
      check_logprob("pfppo::logprob_entropy", logits, labels, 0, temperature, vocab_size, true);
  auto out = empty_rows(logits, 4);  // logp, entropy, row_max, log_sumexp
  cpu::logprob_entropy_fwd(a, {out[0].data_ptr<float>(), out[1].data_ptr<float>(),
                               out[2].data_ptr<float>(), out[3].data_ptr<float>()});
  return {out[0], out[1], out[2], out[3]};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> logprob_entropy_partials_cpu(
    const at::Tensor& logits, const at::Tensor& labels, int64_t vocab_start, double temperature,
    int64_t vocab_size) {
  LogProbArgs a = check_logprob("pfppo::logprob_entropy_partials", logits, labels, vocab_start,
                                temperature, vocab_size, false);
  auto out = empty_rows(logits, 4);  // max, sumexp, sumexp_shifted, target
  cpu::logprob_entropy_partials(a, {out[0].data_ptr<float>(), out[1].data_ptr<float>(),
                                    out[2].data_ptr<float>(), out[3].data_ptr<float>()});
  return {out[0], out[1], out[2], out[3]};
}

at::Tensor logprob_entropy_backward_cpu(const at::Tensor& grad_logp,
                                        const at::Tensor& grad_entropy,
                                        const at::Tensor& logits, const at::Tensor& labels,
                                        const at::Tensor& row_max, const at::Tensor& log_sumexp,
                                        const at::Tensor& entropy, int64_t vocab_start,
                                        double temperature, int64_t vocab_size) {
  const char* op = "pfppo::logprob_entropy_backward";
  LogProbArgs a = check_logprob(op, logits, labels, vocab_start, temperature, vocab_size, false);
  LogProbBwdArgs b =
      check_logprob_bwd(op, a, logits, grad_logp, grad_entropy, row_max, log_sumexp, entropy);
  at::Tensor grad = at::empty({a.rows, a.vocab}, logits.options());
  b.grad_logits = grad.data_ptr();
  cpu::logprob_entropy_bwd(a, b);
  return grad;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
policy_loss_cpu(const at::Tensor& logp, const at::Tensor& old_logp, const at::Tensor& advantages,
                const at::Tensor& mask, const std::optional<at::Tensor>& is_weights,
                double clip_ratio_low, double clip_ratio_high, std::optional<double> dual_clip_c,
                c10::string_view loss_agg_mode) {
  PolicyLossArgs a =
      check_policy_loss(logp, old_logp, advantages, mask, is_weights, clip_ratio_low,
                        clip_ratio_high, dual_clip_c, std::string(loss_agg_mode));
  at::Tensor grad = at::empty_like(logp, at::MemoryFormat::Contiguous);
  double stats[kNumPolicyStats];
  cpu::policy_loss_fwd(a, grad.data_ptr(), stats);
  auto scalar = [&](int i) { return at::scalar_tensor(stats[i], logp.options()); };
  return {scalar(kLoss),     scalar(kClipFrac),     scalar(kClipFracLower),
          scalar(kApproxKl), scalar(kIsWeightMean), grad};
}

std::tuple<at::Tensor, at::Tensor> gae_cpu(const at::Tensor& rewards, const at::Tensor& values,
                                           const at::Tensor& mask, double gamma, double lam,
                                           bool whiten, bool shift_mean, int64_t row_chunks) {
  GaeArgs g = check_gae(rewards, values, mask, gamma, lam, whiten, shift_mean, row_chunks);
  at::Tensor adv = at::empty_like(values, at::MemoryFormat::Contiguous);
  at::Tensor ret = at::empty_like(values, at::MemoryFormat::Contiguous);
  cpu::gae(g, adv.data_ptr(), ret.data_ptr());
  return {adv, ret};
}

}  // namespace

TORCH_LIBRARY(pfppo, m) {
  m.def(
      "logprob_entropy(Tensor logits, Tensor labels, float temperature=1.0, "
      "int vocab_size=-1) -> (Tensor logp, Tensor entropy, Tensor row_max, Tensor log_sumexp)");
  m.def(
      "logprob_entropy_partials(Tensor logits, Tensor labels, int vocab_start, "
      "float temperature=1.0, int vocab_size=-1) -> "
      "(Tensor max, Tensor sumexp, Tensor sumexp_shifted, Tensor target)");
  m.def(
      "logprob_entropy_backward(Tensor grad_logp, Tensor grad_entropy, Tensor logits, "
      "Tensor labels, Tensor row_max, Tensor log_sumexp, Tensor entropy, int vocab_start, "
      "float temperature=1.0, int vocab_size=-1) -> Tensor");
  m.def(
      "policy_loss(Tensor logp, Tensor old_logp, Tensor advantages, Tensor mask, "
      "Tensor? is_weights, float clip_ratio_low, float clip_ratio_high, float? dual_clip_c, "
      "str loss_agg_mode) -> (Tensor loss, Tensor pg_clipfrac, Tensor pg_clipfrac_lower, "
      "Tensor approx_kl, Tensor is_weight_mean, Tensor grad_logp)");
  m.def(
      "gae(Tensor rewards, Tensor values, Tensor mask, float gamma, float lam, "
      "bool whiten=False, bool shift_mean=True, int row_chunks=0) -> "
      "(Tensor advantages, Tensor returns)");
}

TORCH_LIBRARY_IMPL(pfppo, CPU, m) {
  m.impl("logprob_entropy", &logprob_entropy_cpu);
  m.impl("logprob_entropy_partials", &logprob_entropy_partials_cpu);
  m.impl("logprob_entropy_backward", &logprob_entropy_backward_cpu);
  m.impl("policy_loss", &policy_loss_cpu);
  m.impl("gae", &gae_cpu);
}

}  // namespace pfppo
