#include "api.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#ifdef PFPPO_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#endif

#include <sstream>

namespace pfppo {

std::string shape_str(const at::Tensor& t) {
  std::ostringstream s;
  s << "[";
  for (int64_t d = 0; d < t.dim(); ++d) s << (d ? ", " : "") << t.size(d);
  s << "]";
  return s.str();
}

std::string strides_str(const at::Tensor& t) {
  std::ostringstream s;
  s << "(";
  for (int64_t d = 0; d < t.dim(); ++d) s << (d ? ", " : "") << t.stride(d);
  s << ")";
  return s.str();
}

void check_same_device(const char* op, const at::Tensor& ref, const char* ref_name,
                       const at::Tensor& t, const char* name, const char* shape) {
  TORCH_CHECK_VALUE(t.device() == ref.device(), op, ": ", name, " ", shape, " is on ",
                    t.device(), " but ", ref_name, " is on ", ref.device(),
                    "; every tensor must be on one device");
}

void check_defined(const char* op, const at::Tensor& t, const char* name, const char* shape) {
  TORCH_CHECK_VALUE(t.defined(), op, ": ", name, " ", shape, " is an undefined tensor");
}

void check_like_bt(const char* op, const at::Tensor& ref, const char* ref_name,
                   const at::Tensor& t, const char* name) {
  check_defined(op, t, name, "[B, T]");
  TORCH_CHECK_VALUE(t.dim() == 2 && t.sizes() == ref.sizes(), op, ": ", name,
                    " must have shape [B, T] = ", shape_str(ref), " like ", ref_name, "; got ",
                    shape_str(t));
  check_same_device(op, ref, ref_name, t, name, "[B, T]");
  TORCH_CHECK_VALUE(t.is_contiguous(), op, ": ", name, " [B, T] must be contiguous; got strides ",
                    strides_str(t), " for shape ", shape_str(t));
}

Scalar scalar_kind(const at::Tensor& t, const char* op, const char* name, const char* shape) {
  if (t.scalar_type() == at::kFloat) return Scalar::kF32;
  if (t.scalar_type() == at::kBFloat16) return Scalar::kBF16;
  TORCH_CHECK_TYPE(false, op, ": ", name, " ", shape, " must be float32 or bfloat16; got ",
                   t.scalar_type());
}

Mask mask_kind(const at::Tensor& t, const char* op, const char* name, const char* shape) {
  if (t.scalar_type() == at::kBool) return Mask::kBool;
  if (t.scalar_type() == at::kFloat) return Mask::kF32;
  if (t.scalar_type() == at::kBFloat16) return Mask::kBF16;
  TORCH_CHECK_TYPE(false, op, ": ", name, " ", shape,
                   " must be bool, float32 or bfloat16 (nonzero = real token); got ",
                   t.scalar_type());
}

#ifdef PFPPO_WITH_CUDA
CudaLaunch::CudaLaunch(const at::Tensor& t, const char* op) : guard_(t.device()), op_(op) {}

void* CudaLaunch::stream() const { return c10::cuda::getCurrentCUDAStream().stream(); }

void CudaLaunch::check(int err) const {
  TORCH_CHECK(err == 0, op_, ": CUDA kernel launch failed: ",
              cudaGetErrorString(static_cast<cudaError_t>(err)));
}
#endif

at::Tensor workspace_bytes(const at::Tensor& like, size_t bytes) {
  return at::empty({int64_t(bytes)}, like.options().dtype(at::kByte));
}

}  // namespace pfppo
