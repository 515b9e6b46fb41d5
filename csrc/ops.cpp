// The one translation unit of the host wrappers. Each fused op of both devices is one header
// (csrc/<op>.h): included here with PFPPO_HOST, it adds its schema, its input checks and its
// one wrapper for both dispatch keys. Below them: the CPU-only decoder-layer ops (RMSNorm,
// SwiGLU, RoPE; kernels in csrc/cpu/layers.cpp). Autograd and fake (meta) implementations are
// registered from Python in pfppo_mega/kernels/ops.py and pfppo_mega/kernels/layers.py.
#define PFPPO_HOST 1

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cmath>

#include "api.h"
#include "cpu/cpu_kernels.h"
#include "gae.h"
#include "logprob_entropy.h"
#include "policy_loss.h"

namespace pfppo {
namespace {

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
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> (Tensor y, Tensor rstd)");
  m.def(
      "rms_norm_backward(Tensor grad_y, Tensor x, Tensor weight, Tensor rstd) -> "
      "(Tensor grad_x, Tensor grad_weight)");
  m.def("swiglu(Tensor h) -> Tensor");
  m.def("swiglu_backward(Tensor grad_y, Tensor h) -> Tensor");
  m.def("rope(Tensor x, Tensor cos, Tensor sin, bool inverse=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(pfppo, CPU, m) {
  m.impl("rms_norm", &rms_norm_cpu);
  m.impl("rms_norm_backward", &rms_norm_backward_cpu);
  m.impl("swiglu", &swiglu_cpu);
  m.impl("swiglu_backward", &swiglu_backward_cpu);
  m.impl("rope", &rope_cpu);
}

}  // namespace pfppo
