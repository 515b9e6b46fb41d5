// Thin torch API layer: every op checks its tensors (dtype, shape, device, strides) and
// scalars here, with a message that names the argument and spells the expected shape,
// then fills a torch-free argument struct for the CPU or CUDA kernel.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <tuple>
#include <vector>

#include "kernel_types.h"

namespace pfppo {

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

PolicyLossArgs check_policy_loss(const at::Tensor& logp, const at::Tensor& old_logp,
                                 const at::Tensor& advantages, const at::Tensor& mask,
                                 const std::optional<at::Tensor>& is_weights,
                                 double clip_ratio_low, double clip_ratio_high,
                                 std::optional<double> dual_clip_c,
                                 const std::string& loss_agg_mode);

GaeArgs check_gae(const at::Tensor& rewards, const at::Tensor& values, const at::Tensor& mask,
                  double gamma, double lam, bool whiten, bool shift_mean, int64_t row_chunks);

// n new float32 tensors [N] on the logits' device (outputs of the log-prob ops).
std::vector<at::Tensor> empty_rows(const at::Tensor& logits, int n);

}  // namespace pfppo
