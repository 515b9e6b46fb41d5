// Operator schemas (namespace pfppo) and their host wrappers: each checks its inputs
// (csrc/api.cpp) and runs the CPU kernel (csrc/cpu) or, in a CUDA build, the CUDA kernel
// (csrc/cuda) on the tensors' device -- one wrapper per op, registered for both dispatch keys.
// pfppo::policy_loss lives in csrc/policy_loss.cpp. Autograd and fake (meta) implementations
// are registered from Python in pfppo_mega/kernels/ops.py.
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/scalar_tensor.h>
#include <torch/library.h>

#include <cmath>

#include "api.h"
#include "cpu/cpu_kernels.h"
#ifdef PFPPO_WITH_CUDA
#include "cuda/launch.h"
#endif

namespace pfppo {
namespace {

#ifdef PFPPO_WITH_CUDA
at::Tensor workspace(const at::Tensor& like, size_t bytes) {
  return at::empty({int64_t(bytes)}, like.options().dtype(at::kByte));
}
#endif

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> logprob_entropy(
    const at::Tensor& logits, const at::Tensor& labels, double temperature, int64_t vocab_size) {
  const char* op = "pfppo::logprob_entropy";
  LogProbArgs a = check_logprob(op, logits, labels, 0, temperature, vocab_size, true);
  auto out = empty_rows(logits, 4);  // logp, entropy, row_max, log_sumexp
  const LogProbOut o{out[0].data_ptr<float>(), out[1].data_ptr<float>(),
                     out[2].data_ptr<float>(), out[3].data_ptr<float>()};
  if (logits.is_cuda()) {
#ifdef PFPPO_WITH_CUDA
    CudaLaunch launch(logits, op);
    at::Tensor ws = workspace(logits, cuda::logprob_workspace_bytes(a));
    launch.check(cuda::logprob_entropy_fwd(a, o, ws.data_ptr(), launch.stream()));
#endif
  } else {
    cpu::logprob_entropy_fwd(a, o);
  }
  return {out[0], out[1], out[2], out[3]};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> logprob_entropy_partials(
    const at::Tensor& logits, const at::Tensor& labels, int64_t vocab_start, double temperature,
    int64_t vocab_size) {
  const char* op = "pfppo::logprob_entropy_partials";
  LogProbArgs a = check_logprob(op, logits, labels, vocab_start, temperature, vocab_size, false);
  auto out = empty_rows(logits, 4);  // max, sumexp, sumexp_shifted, target
  const LogProbPartialsOut o{out[0].data_ptr<float>(), out[1].data_ptr<float>(),
                             out[2].data_ptr<float>(), out[3].data_ptr<float>()};
  if (logits.is_cuda()) {
#ifdef PFPPO_WITH_CUDA
    CudaLaunch launch(logits, op);
    at::Tensor ws = workspace(logits, cuda::logprob_workspace_bytes(a));
    launch.check(cuda::logprob_entropy_partials(a, o, ws.data_ptr(), launch.stream()));
#endif
  } else {
    cpu::logprob_entropy_partials(a, o);
  }
  return {out[0], out[1], out[2], out[3]};
}

at::Tensor logprob_entropy_backward(const at::Tensor& grad_logp, const at::Tensor& grad_entropy,
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
  if (logits.is_cuda()) {
#ifdef PFPPO_WITH_CUDA
    CudaLaunch launch(logits, op);
    launch.check(cuda::logprob_entropy_bwd(a, b, launch.stream()));
#endif
  } else {
    cpu::logprob_entropy_bwd(a, b);
  }
  return grad;
}

std::tuple<at::Tensor, at::Tensor> gae(const at::Tensor& rewards, const at::Tensor& values,
                                       const at::Tensor& mask, double gamma, double lam,
                                       bool whiten, bool shift_mean, int64_t row_chunks) {
  [[maybe_unused]] const char* op = "pfppo::gae";
  GaeArgs g = check_gae(rewards, values, mask, gamma, lam, whiten, shift_mean, row_chunks);
  at::Tensor adv = at::empty_like(values, at::MemoryFormat::Contiguous);
  at::Tensor ret = at::empty_like(values, at::MemoryFormat::Contiguous);
  if (values.is_cuda()) {
#ifdef PFPPO_WITH_CUDA
    CudaLaunch launch(values, op);
    const int64_t pieces = cuda::gae_pieces(g, cuda::sm_count(values.device().index()));
    at::Tensor ws = workspace(values, cuda::gae_workspace_bytes(g, pieces));
    launch.check(
        cuda::gae(g, pieces, adv.data_ptr(), ret.data_ptr(), ws.data_ptr(), launch.stream()));
#endif
  } else {
    cpu::gae(g, adv.data_ptr(), ret.data_ptr());
  }
  return {adv, ret};
}

// ---- fused decoder-layer ops (CPU, fp32; csrc/cpu/layers.cpp)

// t: float32, contiguous, on the CPU, at least 1-D with last dimension `last` (-1: any).
void check_rows(const char* op, const at::Tensor& t, const char* name, const char* shape,
                int64_t last) {
  TORCH_CHECK_VALUE(t.defined() && t.dim() >= 1, op, ": ", name, " ", shape,
                    " must be a tensor of at least one dimension");
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, op, ": ", name, " ", shape,
                   " must be float32; got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.device().is_cpu(), op, ": ", name, " ", shape, " must be on the CPU; got ",
                    t.device());
  TORCH_CHECK_VALUE(t.is_contiguous(), op, ": ", name, " ", shape, " must be contiguous");
  TORCH_CHECK_VALUE(last < 0 || t.size(-1) == last, op, ": ", name, " ", shape,
                    " must have last dimension ", last, "; got ", t.size(-1));
}

void check_same_shape(const char* op, const at::Tensor& t, const char* name,
                      const at::Tensor& ref, const char* ref_name) {
  TORCH_CHECK_VALUE(t.sizes() == ref.sizes(), op, ": ", name, " must have the shape of ",
                    ref_name, " ", ref.sizes(), "; got ", t.sizes());
}

std::tuple<at::Tensor, at::Tensor> rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight,
                                                double eps) {
  const char* op = "pfppo::rms_norm";
  check_rows(op, x, "x", "[..., E]", -1);
  const int64_t E = x.size(-1);
  check_rows(op, weight, "weight", "[E]", E);
  TORCH_CHECK_VALUE(weight.dim() == 1, op, ": weight [E] must be 1-D; got ", weight.sizes());
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps > 0, op, ": eps must be finite and > 0; got ", eps);
  const int64_t N = E ? x.numel() / E : 0;
  at::Tensor y = at::empty_like(x);
  at::Tensor rstd = at::empty({N}, x.options());
  cpu::rms_norm_fwd(x.data_ptr<float>(), weight.data_ptr<float>(), y.data_ptr<float>(),
                    rstd.data_ptr<float>(), N, E, float(eps));
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_cpu(const at::Tensor& grad_y,
                                                         const at::Tensor& x,
                                                         const at::Tensor& weight,
                                                         const at::Tensor& rstd) {
  const char* op = "pfppo::rms_norm_backward";
  check_rows(op, x, "x", "[..., E]", -1);
  const int64_t E = x.size(-1);
  const int64_t N = E ? x.numel() / E : 0;
  check_rows(op, grad_y, "grad_y", "[..., E]", E);
  check_same_shape(op, grad_y, "grad_y", x, "x");
  check_rows(op, weight, "weight", "[E]", E);
  check_rows(op, rstd, "rstd", "[N]", N);
  TORCH_CHECK_VALUE(rstd.dim() == 1, op, ": rstd [N] must be 1-D; got ", rstd.sizes());
  at::Tensor gx = at::empty_like(x);
  at::Tensor gw = at::empty_like(weight);
  cpu::rms_norm_bwd(grad_y.data_ptr<float>(), x.data_ptr<float>(), weight.data_ptr<float>(),
                    rstd.data_ptr<float>(), gx.data_ptr<float>(), gw.data_ptr<float>(), N, E);
  return {gx, gw};
}

at::Tensor swiglu_cpu(const at::Tensor& h) {
  const char* op = "pfppo::swiglu";
  check_rows(op, h, "h", "[..., 2F]", -1);
  TORCH_CHECK_VALUE(h.size(-1) % 2 == 0, op, ": h [..., 2F] must have an even last dimension; got ",
                    h.size(-1));
  const int64_t F = h.size(-1) / 2;
  const int64_t N = F ? h.numel() / (2 * F) : 0;
  auto sizes = h.sizes().vec();
  sizes.back() = F;
  at::Tensor y = at::empty(sizes, h.options());
  cpu::swiglu_fwd(h.data_ptr<float>(), y.data_ptr<float>(), N, F);
  return y;
}

at::Tensor swiglu_backward_cpu(const at::Tensor& grad_y, const at::Tensor& h) {
  const char* op = "pfppo::swiglu_backward";
  check_rows(op, h, "h", "[..., 2F]", -1);
  TORCH_CHECK_VALUE(h.size(-1) % 2 == 0, op, ": h [..., 2F] must have an even last dimension; got ",
                    h.size(-1));
  const int64_t F = h.size(-1) / 2;
  check_rows(op, grad_y, "grad_y", "[..., F]", F);
  TORCH_CHECK_VALUE(grad_y.numel() * 2 == h.numel() && grad_y.dim() == h.dim(), op,
                    ": grad_y [..., F] must match h [..., 2F] in its leading dimensions; got ",
                    grad_y.sizes(), " and ", h.sizes());
  const int64_t N = F ? h.numel() / (2 * F) : 0;
  at::Tensor gh = at::empty_like(h);
  cpu::swiglu_bwd(grad_y.data_ptr<float>(), h.data_ptr<float>(), gh.data_ptr<float>(), N, F);
  return gh;
}

at::Tensor rope_cpu(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                    bool inverse) {
  const char* op = "pfppo::rope";
  check_rows(op, x, "x", "[S, ..., D]", -1);
  const int64_t D = x.size(-1);
  TORCH_CHECK_VALUE(x.dim() >= 2 && D % 2 == 0, op,
                    ": x [S, ..., D] must be at least 2-D with an even D; got ", x.sizes());
  check_rows(op, cos, "cos", "[S, D]", D);
  check_rows(op, sin, "sin", "[S, D]", D);
  TORCH_CHECK_VALUE(cos.dim() == 2 && cos.size(0) == x.size(0), op, ": cos must be [S, D] = [",
                    x.size(0), ", ", D, "]; got ", cos.sizes());
  check_same_shape(op, sin, "sin", cos, "cos");
  const int64_t S = x.size(0);
  const int64_t rows = (S && D) ? x.numel() / (S * D) : 0;
  at::Tensor y = at::empty_like(x);
  cpu::rope(x.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), y.data_ptr<float>(),
            S, rows, D, inverse);
  return y;
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
      "gae(Tensor rewards, Tensor values, Tensor mask, float gamma, float lam, "
      "bool whiten=False, bool shift_mean=True, int row_chunks=0) -> "
      "(Tensor advantages, Tensor returns)");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> (Tensor y, Tensor rstd)");
  m.def(
      "rms_norm_backward(Tensor grad_y, Tensor x, Tensor weight, Tensor rstd) -> "
      "(Tensor grad_x, Tensor grad_weight)");
  m.def("swiglu(Tensor h) -> Tensor");
  m.def("swiglu_backward(Tensor grad_y, Tensor h) -> Tensor");
  m.def("rope(Tensor x, Tensor cos, Tensor sin, bool inverse=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(pfppo, CPU, m) {
  m.impl("logprob_entropy", &logprob_entropy);
  m.impl("logprob_entropy_partials", &logprob_entropy_partials);
  m.impl("logprob_entropy_backward", &logprob_entropy_backward);
  m.impl("gae", &gae);
  m.impl("rms_norm", &rms_norm_cpu);
  m.impl("rms_norm_backward", &rms_norm_backward_cpu);
  m.impl("swiglu", &swiglu_cpu);
  m.impl("swiglu_backward", &swiglu_backward_cpu);
  m.impl("rope", &rope_cpu);
}

#ifdef PFPPO_WITH_CUDA
TORCH_LIBRARY_IMPL(pfppo, CUDA, m) {
  m.impl("logprob_entropy", &logprob_entropy);
  m.impl("logprob_entropy_partials", &logprob_entropy_partials);
  m.impl("logprob_entropy_backward", &logprob_entropy_backward);
  m.impl("gae", &gae);
}
#endif

}  // namespace pfppo
