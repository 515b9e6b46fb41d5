// CUDA implementations of the pfppo:: ops (schemas in csrc/ops.cpp). Compiled only into a
// CUDA build (torch.utils.cpp_extension.CUDAExtension); the kernels behind csrc/cuda/launch.h
// are torch-free. Same checks as the CPU ops (csrc/api.cpp), except that labels are not read
// on the host: a label outside [0, V) gives logp = NaN instead of an error.
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../api.h"
#include "launch.h"

namespace pfppo {
namespace {

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, op, ": CUDA kernel launch failed: ", cudaGetErrorString(err));
}

at::Tensor workspace(const at::Tensor& like, size_t bytes) {
  return at::empty({int64_t(bytes)}, like.options().dtype(at::kByte));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> logprob_entropy_cuda(
    const at::Tensor& logits, const at::Tensor& labels, double temperature, int64_t vocab_size) {
  const char* op = "pfppo::logprob_entropy";
  LogProbArgs a = check_logprob(op, logits, labels, 0, temperature, vocab_size, true);
  c10::cuda::CUDAGuard guard(logits.device());
  auto out = empty_rows(logits, 4);  // logp, entropy, row_max, log_sumexp
  check_launch(cuda::logprob_entropy_fwd(
                   a,
                   {out[0].data_ptr<float>(), out[1].data_ptr<float>(),
                    out[2].data_ptr<float>(), out[3].data_ptr<float>()},
                   c10::cuda::getCurrentCUDAStream()),
               op);
  return {out[0], out[1], out[2], out[3]};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> logprob_entropy_partials_cuda(
    const at::Tensor& logits, const at::Tensor& labels, int64_t vocab_start, double temperature,
    int64_t vocab_size) {
  const char* op = "pfppo::logprob_entropy_partials";
  LogProbArgs a = check_logprob(op, logits, labels, vocab_start, temperature, vocab_size, false);
  c10::cuda::CUDAGuard guard(logits.device());
  auto out = empty_rows(logits, 4);  // max, sumexp, sumexp_shifted, target
  check_launch(cuda::logprob_entropy_partials(
                   a,
                   {out[0].data_ptr<float>(), out[1].data_ptr<float>(),
                    out[2].data_ptr<float>(), out[3].data_ptr<float>()},
                   c10::cuda::getCurrentCUDAStream()),
               op);
  return {out[0], out[1], out[2], out[3]};
}

at::Tensor logprob_entropy_backward_cuda(const at::Tensor& grad_logp,
                                         const at::Tensor& grad_entropy,
                                         const at::Tensor& logits, const at::Tensor& labels,
                                         const at::Tensor& row_max, const at::Tensor& log_sumexp,
                                         const at::Tensor& entropy, int64_t vocab_start,
                                         double temperature, int64_t vocab_size) {
  const char* op = "pfppo::logprob_entropy_backward";
  LogProbArgs a = check_logprob(op, logits, labels, vocab_start, temperature, vocab_size, false);
  LogProbBwdArgs b =
      check_logprob_bwd(op, a, logits, grad_logp, grad_entropy, row_max, log_sumexp, entropy);
  c10::cuda::CUDAGuard guard(logits.device());
  at::Tensor grad = at::empty({a.rows, a.vocab}, logits.options());
  b.grad_logits = grad.data_ptr();
  check_launch(cuda::logprob_entropy_bwd(a, b, c10::cuda::getCurrentCUDAStream()), op);
  return grad;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
policy_loss_cuda(const at::Tensor& logp, const at::Tensor& old_logp, const at::Tensor& advantages,
                 const at::Tensor& mask, const std::optional<at::Tensor>& is_weights,
                 double clip_ratio_low, double clip_ratio_high, std::optional<double> dual_clip_c,
                 c10::string_view loss_agg_mode) {
  const char* op = "pfppo::policy_loss";
  PolicyLossArgs a =
      check_policy_loss(logp, old_logp, advantages, mask, is_weights, clip_ratio_low,
                        clip_ratio_high, dual_clip_c, std::string(loss_agg_mode));
  c10::cuda::CUDAGuard guard(logp.device());
  at::Tensor grad = at::empty_like(logp, at::MemoryFormat::Contiguous);
  at::Tensor stats[kNumPolicyStats];
  cuda::PolicyStatsOut out;
  for (int i = 0; i < kNumPolicyStats; ++i) {
    stats[i] = at::empty({}, logp.options());
    out.stat[i] = stats[i].data_ptr();
  }
  at::Tensor ws = workspace(logp, cuda::policy_loss_workspace_bytes(a));
  check_launch(cuda::policy_loss_fwd(a, grad.data_ptr(), out, ws.data_ptr(),
                                     c10::cuda::getCurrentCUDAStream()),
               op);
  return {stats[kLoss],     stats[kClipFrac],     stats[kClipFracLower],
          stats[kApproxKl], stats[kIsWeightMean], grad};
}

std::tuple<at::Tensor, at::Tensor> gae_cuda(const at::Tensor& rewards, const at::Tensor& values,
                                            const at::Tensor& mask, double gamma, double lam,
                                            bool whiten, bool shift_mean, int64_t row_chunks) {
  const char* op = "pfppo::gae";
  GaeArgs g = check_gae(rewards, values, mask, gamma, lam, whiten, shift_mean, row_chunks);
  c10::cuda::CUDAGuard guard(values.device());
  at::Tensor adv = at::empty_like(values, at::MemoryFormat::Contiguous);
  at::Tensor ret = at::empty_like(values, at::MemoryFormat::Contiguous);
  int sm_count = 0;
  check_launch(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount,
                                      values.device().index()),
               op);
  const int64_t pieces = cuda::gae_pieces(g, sm_count);
  at::Tensor ws = workspace(values, cuda::gae_workspace_bytes(g, pieces));
  check_launch(cuda::gae(g, pieces, adv.data_ptr(), ret.data_ptr(), ws.data_ptr(),
                         c10::cuda::getCurrentCUDAStream()),
               op);
  return {adv, ret};
}

}  // namespace

TORCH_LIBRARY_IMPL(pfppo, CUDA, m) {
  m.impl("logprob_entropy", &logprob_entropy_cuda);
  m.impl("logprob_entropy_partials", &logprob_entropy_partials_cuda);
  m.impl("logprob_entropy_backward", &logprob_entropy_backward_cuda);
  m.impl("policy_loss", &policy_loss_cuda);
  m.impl("gae", &gae_cuda);
}

}  // namespace pfppo
