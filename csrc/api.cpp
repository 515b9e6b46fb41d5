#include "api.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#ifdef PFPPO_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#endif

#include <algorithm>
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

GaeArgs check_gae(const at::Tensor& rewards, const at::Tensor& values, const at::Tensor& mask,
                  double gamma, double lam, bool whiten, bool shift_mean, int64_t row_chunks) {
  const char* op = "pfppo::gae";
  check_defined(op, values, "values", "[B, T]");
  TORCH_CHECK_VALUE(values.dim() == 2, op, ": values must have shape [B, T] (2-D); got ",
                    shape_str(values));
  TORCH_CHECK_VALUE(values.is_contiguous(), op,
                    ": values [B, T] must be contiguous; got strides ", strides_str(values),
                    " for shape ", shape_str(values));
  const Scalar dtype = scalar_kind(values, op, "values", "[B, T]");
  check_like_bt(op, values, "values", rewards, "rewards");
  TORCH_CHECK_TYPE(rewards.scalar_type() == values.scalar_type(), op,
                   ": rewards [B, T] must have the dtype of values (", values.scalar_type(),
                   "); got ", rewards.scalar_type());
  check_like_bt(op, values, "values", mask, "mask");
  const Mask mk = mask_kind(mask, op, "mask", "[B, T]");
  TORCH_CHECK_VALUE(gamma >= 0.0 && gamma <= 1.0, op, ": gamma=", gamma, " must be in [0, 1]");
  TORCH_CHECK_VALUE(lam >= 0.0 && lam <= 1.0, op, ": lam=", lam, " must be in [0, 1]");
  TORCH_CHECK_VALUE(row_chunks >= 0, op, ": row_chunks=", row_chunks,
                    " must be >= 0 (0 = choose automatically)");
  return GaeArgs{rewards.data_ptr(), values.data_ptr(), dtype,       mask.data_ptr(),
                 mk,                 values.size(0),    values.size(1), float(gamma),
                 float(lam),         whiten,            shift_mean,  row_chunks};
}

#ifdef PFPPO_WITH_CUDA
CudaLaunch::CudaLaunch(const at::Tensor& t, const char* op) : guard_(t.device()), op_(op) {}

void* CudaLaunch::stream() const { return c10::cuda::getCurrentCUDAStream().stream(); }

void CudaLaunch::check(int err) const {
  TORCH_CHECK(err == 0, op_, ": CUDA kernel launch failed: ",
              cudaGetErrorString(static_cast<cudaError_t>(err)));
}
#endif

std::vector<at::Tensor> empty_rows(const at::Tensor& logits, int n) {
  std::vector<at::Tensor> out;
  for (int i = 0; i < n; ++i) out.push_back(at::empty({logits.size(0)}, logits.options().dtype(at::kFloat)));
  return out;
}

}  // namespace pfppo
