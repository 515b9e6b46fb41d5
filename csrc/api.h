// Thin torch API layer: every op checks its tensors (dtype, shape, device, strides) and
// scalars here, with a message that names the argument and spells the expected shape,
// then fills a torch-free argument struct for the CPU or CUDA kernel.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <tuple>
#include <vector>

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

// logits [N, V] (unit stride along V) and labels [N] int64; temperature finite and > 0;
// vocab_size: global columns >= vocab_size are padding (-1: none). full_vocab: logits hold the
// whole (possibly padded) vocabulary, vocab_size <= V. Host labels are read: each must lie in
// [0, vocab_size) (shard without vocab_size: >= 0). CUDA labels are not read on the host (the
// kernels write NaN for a bad label).
LogProbArgs check_logprob(const char* op, const at::Tensor& logits, const at::Tensor& labels,
                          int64_t vocab_start, double temperature, int64_t vocab_size,
                          bool full_vocab);

// grad_logp, grad_entropy, row_max, log_sumexp, entropy: [N] float32 on the logits' device.
LogProbBwdArgs check_logprob_bwd(const char* op, const LogProbArgs& a, const at::Tensor& logits,
                                 const at::Tensor& grad_logp, const at::Tensor& grad_entropy,
                                 const at::Tensor& row_max, const at::Tensor& log_sumexp,
                                 const at::Tensor& entropy);

GaeArgs check_gae(const at::Tensor& rewards, const at::Tensor& values, const at::Tensor& mask,
                  double gamma, double lam, bool whiten, bool shift_mean, int64_t row_chunks);

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

// n new float32 tensors [N] on the logits' device (outputs of the log-prob ops).
std::vector<at::Tensor> empty_rows(const at::Tensor& logits, int n);

}  // namespace pfppo
