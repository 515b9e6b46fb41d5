// Fused token log-prob + entropy (pfppo::logprob_entropy, its vocab-shard partials
// pfppo::logprob_entropy_partials and their backward pfppo::logprob_entropy_backward), the
// whole op but its two kernels. Torch-free above the PFPPO_HOST line: included by the CPU
// kernel (csrc/cpu/logprob_entropy.cpp), the CUDA kernel (csrc/cuda/logprob_entropy.cu) and
// csrc/module.cpp, which exports the mode table to Python as pfppo_mega._C.logprob_modes.
// csrc/ops.cpp includes it with PFPPO_HOST for the schemas, the input checks and the one host
// wrapper per entry of both devices. Autograd and the fake kernels: pfppo_mega/kernels/ops.py
// (one fake per row of the table). References: pfppo_mega/ppo/logprobs.py (full vocabulary)
// and pfppo_mega/kernels/shard_math.py (a shard's partials and their combine).
//
//   PFPPO_LOGPROB_MODES      what a forward writes per row (one row per forward op)
//   write_row                a row's outputs from its online-softmax state, per mode
//   rescale_sums, softmax_logp, softmax_grad   the per-element math of both devices
//
// Online softmax over y = x / T: per row m = max y, s = sum e^(y-m), u = sum e^(y-m)(y-m);
//   lse = m + log s,  logp = y_label - lse,  H = log s - u / s.
// Backward: grad_x = (g [x is the label] - p (g + h (log p + H))) / T, log p = (y - m) - log s.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "kernel_types.h"

namespace pfppo {

// X(enumerator, op name): every forward of the op. A new mode is one row here plus its case in
// write_row and with_logprob_mode (the switches have no default: -Wswitch names a row without
// a case), its schema below and its outputs' names in LogProbRows.
#define PFPPO_LOGPROB_MODES(X)       \
  X(kFull, "logprob_entropy")        \
  X(kPartials, "logprob_entropy_partials")

enum class LogProbMode : int { PFPPO_LOGPROB_MODES(PFPPO_TABLE_ENUM) };
constexpr const char* kLogProbModeNames[] = {PFPPO_LOGPROB_MODES(PFPPO_TABLE_NAME)};
constexpr int kNumLogProbModes = int(sizeof(kLogProbModeNames) / sizeof(kLogProbModeNames[0]));

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

// The four [N] float32 outputs of a forward, in the order of the op's schema:
//   kFull (unsharded), of y = x / temperature; lse = row_max + log_sumexp is kept as two parts
//   so that log p = (y - row_max) - log_sumexp loses no more precision than torch's
//   log_softmax:
//     logp        y_label - lse
//     entropy     -sum_v p_v log p_v
//     row_max     m = max_v y_v                  (saved for backward)
//     log_sumexp  log sum_v exp(y_v - m)         (saved for backward)
//   kPartials (vocab-parallel: one shard's columns [0, valid); a shard of only padding has
//   m = -inf, s = u = 0):
//     max             m = max_v y_v
//     sumexp          s = sum_v exp(y_v - m)
//     sumexp_shifted  u = sum_v exp(y_v - m) (y_v - m)
//     target          y_label if the label is in this shard, else 0
constexpr int kLogProbRowOutputs = 4;
struct LogProbRows {
  float* out[kLogProbRowOutputs];
};

// Runs f(LogProbModeTag<mode>{}): a kernel instantiated per mode (decltype(tag)::value).
template <LogProbMode kMode>
struct LogProbModeTag {
  static constexpr LogProbMode value = kMode;
};

template <typename F>
auto with_logprob_mode(LogProbMode mode, F&& f) {
  switch (mode) {
    case LogProbMode::kFull: return f(LogProbModeTag<LogProbMode::kFull>{});
    case LogProbMode::kPartials: return f(LogProbModeTag<LogProbMode::kPartials>{});
  }
  return f(LogProbModeTag<LogProbMode::kFull>{});
}

// Row r's outputs from its state (m, s, u) (S: float on the GPU, double sums on the CPU) and
// its target y_label (has_label: the label lies among this shard's columns [0, valid)).
template <typename S>
PFPPO_HD void write_row(LogProbMode mode, const LogProbRows& o, int64_t r, float m, S s, S u,
                        bool has_label, float y_label) {
  switch (mode) {
    case LogProbMode::kFull: {
      const double log_s = log(double(s));
      const double target = has_label ? double(y_label) : double(NAN);
      o.out[0][r] = float(target - (double(m) + log_s));  // logp
      o.out[1][r] = float(log_s - double(u) / double(s));  // entropy
      o.out[2][r] = m;                                     // row_max
      o.out[3][r] = float(log_s);                          // log_sumexp
      return;
    }
    case LogProbMode::kPartials:
      o.out[0][r] = m;                              // max
      o.out[1][r] = float(s);                       // sumexp
      o.out[2][r] = float(u);                       // sumexp_shifted
      o.out[3][r] = has_label ? y_label : 0.0f;     // target
      return;
  }
}

// Move the running sums from reference m to a larger max m' (d = m - m', scale = e^d):
//   s' = s e^d,  u' = e^d (u + d s).
template <typename S>
PFPPO_HD void rescale_sums(S& s, S& u, S d, S scale) {
  u = (u + d * s) * scale;
  s *= scale;
}

// log p_v = (y_v - m) - log s.
PFPPO_HD float softmax_logp(float y, float m, float log_s) { return (y - m) - log_s; }

// d loss / d y_v off the label: -p (g + h (log p + H)).
PFPPO_HD float softmax_grad(float p, float lp, float g, float h, float entropy) {
  return -p * (g + h * (lp + entropy));
}

// The kernels behind the host wrapper (raw pointers; the wrapper has checked every input).
namespace cpu {
// The forward of one mode over every row of logits [N, V].
void logprob_entropy_rows(const LogProbArgs& a, LogProbMode mode, const LogProbRows& out);
// grad_logits [N, V] from grad_logp, grad_entropy [N] and the saved lse, entropy [N].
void logprob_entropy_bwd(const LogProbArgs& a, const LogProbBwdArgs& b);
}  // namespace cpu

namespace cuda {
// Workspace of the forwards (per-split states when long rows are split).
size_t logprob_workspace_bytes(const LogProbArgs& a);
// stream: a cudaStream_t. Return the cudaError_t of the launches (0 = queued).
int logprob_entropy_rows(const LogProbArgs& a, LogProbMode mode, const LogProbRows& out,
                         void* workspace, void* stream);
int logprob_entropy_bwd(const LogProbArgs& a, const LogProbBwdArgs& b, void* stream);
}  // namespace cuda

}  // namespace pfppo

// ---------------------------------------------------------------------------------------------
// Host (torch): the schemas, the input checks and one wrapper per entry that runs the CPU or,
// in a CUDA build (PFPPO_WITH_CUDA), the CUDA kernel. Compiled once, by csrc/ops.cpp.
#ifdef PFPPO_HOST
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>

#include "api.h"

namespace pfppo {
namespace logprob_host {

// logits [N, V] (unit stride along V) and labels [N] int64; temperature finite and > 0;
// vocab_size: global columns >= vocab_size are padding (-1: none). full_vocab: logits hold the
// whole (possibly padded) vocabulary, vocab_size <= V. Host labels are read: each must lie in
// [0, vocab_size) (shard without vocab_size: >= 0). CUDA labels are not read on the host (the
// kernels write NaN for a bad label).
LogProbArgs check_logprob(const char* op, const at::Tensor& logits, const at::Tensor& labels,
                          int64_t vocab_start, double temperature, int64_t vocab_size,
                          bool full_vocab) {
  check_defined(op, logits, "logits", "[N, V]");
  check_defined(op, labels, "labels", "[N]");
  TORCH_CHECK_VALUE(logits.dim() == 2, op, ": logits must have shape [N, V] (2-D); got ",
                    shape_str(logits));
  const Scalar dtype = scalar_kind(logits, op, "logits", "[N, V]");
  const int64_t N = logits.size(0), V = logits.size(1);
  TORCH_CHECK_VALUE(V >= 1, op, ": logits [N, V] needs V >= 1 (a vocabulary); got shape ",
                    shape_str(logits));
  TORCH_CHECK_VALUE(logits.stride(1) == 1 || V == 1, op,
                    ": logits [N, V] must be contiguous along V (stride 1); got strides ",
                    strides_str(logits), " for shape ", shape_str(logits));
  TORCH_CHECK_VALUE(N <= 1 || logits.stride(0) >= V, op,
                    ": logits [N, V] rows must not overlap (stride(0) >= V); got strides ",
                    strides_str(logits), " for shape ", shape_str(logits));
  TORCH_CHECK_VALUE(labels.dim() == 1 && labels.size(0) == N, op,
                    ": labels must have shape [N] = [", N, "] (one per logits row); got ",
                    shape_str(labels));
  TORCH_CHECK_TYPE(labels.scalar_type() == at::kLong, op, ": labels [N] must be int64; got ",
                   labels.scalar_type());
  check_same_device(op, logits, "logits", labels, "labels", "[N]");
  TORCH_CHECK_VALUE(labels.is_contiguous(), op, ": labels [N] must be contiguous; got strides ",
                    strides_str(labels));
  TORCH_CHECK_VALUE(vocab_start >= 0, op, ": vocab_start must be >= 0; got ", vocab_start);
  // NaN fails both comparisons; inf would make every logit 0 (a silent uniform softmax).
  TORCH_CHECK_VALUE(temperature > 0.0 && temperature <= 3.4e38, op, ": temperature=",
                    temperature, " must be a finite number > 0 (the softmax is over logits / T)");
  // Columns whose global index is >= vocab_size are vocabulary padding (-1: none).
  TORCH_CHECK_VALUE(vocab_size == -1 || vocab_size >= 1, op, ": vocab_size=", vocab_size,
                    " must be >= 1, or -1 when the logits have no padding columns");
  if (full_vocab) {
    TORCH_CHECK_VALUE(vocab_size == -1 || vocab_size <= V, op, ": vocab_size=", vocab_size,
                      " must be in [1, V] = [1, ", V, "] for logits [N, V] = ", shape_str(logits),
                      " (columns >= vocab_size are padding)");
  }
  const int64_t valid =
      vocab_size == -1 ? V : std::min(V, std::max<int64_t>(0, vocab_size - vocab_start));
  const int64_t* lab = labels.data_ptr<int64_t>();
  if (labels.device().is_cpu()) {
    // A full vocabulary needs every label in [0, vocab_size); a shard global indices in
    // [0, vocab_size) (only >= 0 when vocab_size is not given).
    const int64_t hi = full_vocab ? valid : vocab_size;
    const char* range = vocab_size == -1 ? "[0, V) = [0, " : "[0, vocab_size) = [0, ";
    for (int64_t i = 0; i < N; ++i) {
      if (hi >= 0) {
        TORCH_CHECK_VALUE(lab[i] >= 0 && lab[i] < hi, op, ": labels[", i, "] = ", lab[i],
                          " is outside ", range, hi, ") for logits [N, V] = ",
                          shape_str(logits));
      } else {
        TORCH_CHECK_VALUE(lab[i] >= 0, op, ": labels[", i, "] = ", lab[i],
                          " must be a vocabulary index >= 0");
      }
    }
  }
  return LogProbArgs{logits.data_ptr(), dtype, N,   V,     N > 0 ? logits.stride(0) : V,
                     lab,               vocab_start, valid, float(temperature)};
}

LogProbBwdArgs check_logprob_bwd(const char* op, const LogProbArgs& a, const at::Tensor& logits,
                                 const at::Tensor& grad_logp, const at::Tensor& grad_entropy,
                                 const at::Tensor& row_max, const at::Tensor& log_sumexp,
                                 const at::Tensor& entropy) {
  const std::pair<const at::Tensor*, const char*> rows[] = {
      {&grad_logp, "grad_logp"}, {&grad_entropy, "grad_entropy"}, {&row_max, "row_max"},
      {&log_sumexp, "log_sumexp"}, {&entropy, "entropy"}};
  for (const auto& [t, name] : rows) {
    check_defined(op, *t, name, "[N]");
    TORCH_CHECK_VALUE(t->dim() == 1 && t->size(0) == a.rows, op, ": ", name,
                      " must have shape [N] = [", a.rows, "]; got ", shape_str(*t));
    TORCH_CHECK_TYPE(t->scalar_type() == at::kFloat, op, ": ", name,
                     " [N] must be float32; got ", t->scalar_type());
    check_same_device(op, logits, "logits", *t, name, "[N]");
    TORCH_CHECK_VALUE(t->is_contiguous(), op, ": ", name, " [N] must be contiguous; got strides ",
                      strides_str(*t));
  }
  return LogProbBwdArgs{row_max.data_ptr<float>(),   log_sumexp.data_ptr<float>(),
                        entropy.data_ptr<float>(),   grad_logp.data_ptr<float>(),
                        grad_entropy.data_ptr<float>(), nullptr};
}

// The forward of one mode: four [N] float32 outputs (the mode's LogProbRows fields, in order).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> rows(const char* op,
                                                                const at::Tensor& logits,
                                                                const LogProbArgs& a,
                                                                LogProbMode mode) {
  at::Tensor out[kLogProbRowOutputs];
  LogProbRows o;
  for (int k = 0; k < kLogProbRowOutputs; ++k) {
    out[k] = at::empty({a.rows}, logits.options().dtype(at::kFloat));
    o.out[k] = out[k].data_ptr<float>();
  }
  if (logits.is_cuda()) {
#ifdef PFPPO_WITH_CUDA
    CudaLaunch launch(logits, op);
    at::Tensor ws = workspace_bytes(logits, cuda::logprob_workspace_bytes(a));
    launch.check(cuda::logprob_entropy_rows(a, mode, o, ws.data_ptr(), launch.stream()));
#endif
  } else {
    cpu::logprob_entropy_rows(a, mode, o);
  }
  return {out[0], out[1], out[2], out[3]};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> logprob_entropy(
    const at::Tensor& logits, const at::Tensor& labels, double temperature, int64_t vocab_size) {
  const char* op = "pfppo::logprob_entropy";
  LogProbArgs a = check_logprob(op, logits, labels, 0, temperature, vocab_size, true);
  return rows(op, logits, a, LogProbMode::kFull);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> logprob_entropy_partials(
    const at::Tensor& logits, const at::Tensor& labels, int64_t vocab_start, double temperature,
    int64_t vocab_size) {
  const char* op = "pfppo::logprob_entropy_partials";
  LogProbArgs a = check_logprob(op, logits, labels, vocab_start, temperature, vocab_size, false);
  return rows(op, logits, a, LogProbMode::kPartials);
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

}  // namespace logprob_host

TORCH_LIBRARY_FRAGMENT(pfppo, m) {
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
}

TORCH_LIBRARY_IMPL(pfppo, CPU, m) {
  m.impl("logprob_entropy", &logprob_host::logprob_entropy);
  m.impl("logprob_entropy_partials", &logprob_host::logprob_entropy_partials);
  m.impl("logprob_entropy_backward", &logprob_host::logprob_entropy_backward);
}

#ifdef PFPPO_WITH_CUDA
TORCH_LIBRARY_IMPL(pfppo, CUDA, m) {
  m.impl("logprob_entropy", &logprob_host::logprob_entropy);
  m.impl("logprob_entropy_partials", &logprob_host::logprob_entropy_partials);
  m.impl("logprob_entropy_backward", &logprob_host::logprob_entropy_backward);
}
#endif

}  // namespace pfppo
#endif  // PFPPO_HOST
