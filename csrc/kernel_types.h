// Torch-free argument structs shared by the CPU kernels (csrc/cpu), the CUDA kernels
// (csrc/cuda) and the torch API layer (csrc/ops.cpp, csrc/cuda/ops_cuda.cpp).
// Pointers are raw device or host pointers; the API layer has already checked shapes,
// dtypes, devices and strides, so kernels trust these fields.
#pragma once

#include <cstdint>

namespace pfppo {

// Element type of a floating input. All arithmetic is in fp32 (sums in fp64 on the CPU).
enum class Scalar : int { kF32 = 0, kBF16 = 1 };

// Element type of a [B, T] mask. Every kind is read as "nonzero means a real token".
enum class Mask : int { kBool = 0, kF32 = 1, kBF16 = 2 };

// Rows of logits [N, V] (row i starts at logits + i * row_stride elements) and one label per
// row. vocab_start: global index of column 0 (0 unless this is a vocab shard). Only columns
// [0, valid) are vocabulary: columns [valid, V) are padding (megatron pads the vocabulary to a
// multiple of tp * make_vocab_size_divisible_by) and count as -inf logits (gradient 0). The
// softmax is taken over x / temperature (division per element, as torch's logits / T). A label
// whose local index label - vocab_start falls outside [0, valid) contributes no target logit.
struct LogProbArgs {
  const void* logits;
  Scalar dtype;
  int64_t rows;
  int64_t vocab;
  int64_t row_stride;
  const int64_t* labels;  // [N]
  int64_t vocab_start;
  int64_t valid;          // 0 <= valid <= vocab
  float temperature;      // > 0; 1 = the logits as they are
};

// Full (unsharded) forward: all [N], fp32, of y = x / temperature. lse = row_max + log_sumexp is kept as two parts so
// that log p = (x - row_max) - log_sumexp loses no more precision than torch's log_softmax.
struct LogProbOut {
  float* logp;        // logits[label] - lse
  float* entropy;     // -sum_v p_v log p_v
  float* row_max;     // m = max_v logits_v               (saved for backward)
  float* log_sumexp;  // log sum_v exp(logits_v - m)      (saved for backward)
};

// Vocab-parallel forward: per-row partials of one shard, all [N], fp32, over the columns
// [0, valid) of y = x / temperature (a shard of only padding: m = -inf, s = u = 0).
//   max            m = max_v y_v
//   sumexp         s = sum_v exp(y_v - m)
//   sumexp_shifted u = sum_v exp(y_v - m) * (y_v - m)
//   target         y_label if label is in this shard, else 0
struct LogProbPartialsOut {
  float* max;
  float* sumexp;
  float* sumexp_shifted;
  float* target;
};

// Backward: grad_x_v = (g * ([v == label] - p_v) - h * p_v * (log p_v + H)) / temperature,
// log p_v = (y_v - row_max) - log_sumexp; 0 on padding columns. For a shard: the global
// (combined) values.
struct LogProbBwdArgs {
  const float* row_max;       // [N]
  const float* log_sumexp;    // [N]
  const float* entropy;       // [N]
  const float* grad_logp;     // [N]
  const float* grad_entropy;  // [N]
  void* grad_logits;          // [N, V] contiguous, dtype of logits
};

// The policy loss has its own header, csrc/policy_loss.h (its modes, math and arguments).

struct GaeArgs {
  const void* rewards;  // [B, T]
  const void* values;   // [B, T]
  Scalar dtype;         // of rewards, values and both outputs
  const void* mask;     // [B, T]
  Mask mask_kind;
  int64_t rows;
  int64_t cols;
  float gamma;
  float lam;
  bool whiten;
  bool shift_mean;
  // Pieces each row is cut into for the chunked (associative) scan; 0 = choose.
  int64_t row_chunks;
};

}  // namespace pfppo
