// The checks every op's host wrapper (csrc/<op>.h, under PFPPO_HOST) is made of: each names
// the argument and spells the expected shape, so the op's own checks read as a list.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

#include "kernel_types.h"

#ifdef PFPPO_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#endif

namespace pfppo {

// "[2, 3]" and "(3, 1)": a tensor's shape and strides for messages.
std::string shape_str(const at::Tensor& t);
std::string strides_str(const at::Tensor& t);
void check_defined(const char* op, const at::Tensor& t, const char* name, const char* shape);
void check_same_device(const char* op, const at::Tensor& ref, const char* ref_name,
                       const at::Tensor& t, const char* name, const char* shape);
// t: a [B, T] tensor of the same shape as ref, contiguous, on ref's device.
void check_like_bt(const char* op, const at::Tensor& ref, const char* ref_name,
                   const at::Tensor& t, const char* name);

// Floating inputs may be float32 or bfloat16; masks bool, float32 or bfloat16.
Scalar scalar_kind(const at::Tensor& t, const char* op, const char* name, const char* shape);
Mask mask_kind(const at::Tensor& t, const char* op, const char* name, const char* shape);

#ifdef PFPPO_WITH_CUDA
// A launch on t's device and its current stream; check() raises with the op's name.
struct CudaLaunch {
  explicit CudaLaunch(const at::Tensor& t, const char* op);
  void* stream() const;
  void check(int err) const;

 private:
  c10::cuda::CUDAGuard guard_;
  const char* op_;
};
#endif

// A byte workspace of `bytes` on like's device (the CUDA kernels' scratch).
at::Tensor workspace_bytes(const at::Tensor& like, size_t bytes);

}  // namespace pfppo
