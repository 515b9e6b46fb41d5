// Fused GAE (pfppo::gae), the whole op but its two kernels. Torch-free above the PFPPO_HOST
// line: included by the CPU kernel (csrc/cpu/gae.cpp), the CUDA kernel (csrc/cuda/gae.cu) and
// csrc/module.cpp, which exports the mode table to Python as pfppo_mega._C.gae_whiten_modes.
// csrc/ops.cpp includes it with PFPPO_HOST for the schema, the input checks and the one host
// wrapper of both devices. Autograd (none: backward raises) and the fake kernel:
// pfppo_mega/kernels/ops.py. Reference: pfppo_mega/ppo/advantages.py compute_gae and
// pfppo_mega/ppo/masked.py masked_whiten.
//
//   PFPPO_GAE_WHITEN_MODES   what happens to the advantages after the scan (one row per mode)
//   whiten_scale             mean, 1/std and the value added back, per mode
//   gae_delta, gae_advantage, gae_return, whiten_token   the per-token math of both devices
//
// Per token, over right-padded [B, T] with mask m (a mask with gaps, a multi-turn row, reaches the
// kernels compacted: pfppo_mega/kernels/ops.py gae moves each row's real tokens to its front):
//   delta_t = r_t + gamma m_{t+1} V_{t+1} - V_t
//   A_t     = m_t (delta_t + gamma lam A_{t+1}),   R_t = m_t (A_t + V_t),   A_T = 0
// Whitening: A <- (A - mean) / sqrt(var + 1e-8) over real tokens (unbiased var), + mean again
// when the mode keeps it; 0 on padding.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "kernel_types.h"

namespace pfppo {

// X(enumerator, name): every whitening mode the op takes. A new mode is one row here plus its
// cases in whitens and whiten_scale (the switches have no default: -Wswitch names a row
// without a case). The schema's (whiten, shift_mean) pair picks a row (gae_whiten_mode).
#define PFPPO_GAE_WHITEN_MODES(X)      \
  X(kNone, "none")                     \
  X(kWhiten, "whiten")                 \
  X(kWhitenKeepMean, "whiten-keep-mean")

enum class GaeWhiten : int { PFPPO_GAE_WHITEN_MODES(PFPPO_TABLE_ENUM) };
constexpr const char* kGaeWhitenNames[] = {PFPPO_GAE_WHITEN_MODES(PFPPO_TABLE_NAME)};
constexpr int kNumGaeWhiten = int(sizeof(kGaeWhitenNames) / sizeof(kGaeWhitenNames[0]));

constexpr float kWhitenEps = 1e-8f;

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
  GaeWhiten whiten;
  // Pieces each row is cut into for the chunked (associative) scan; 0 = choose.
  int64_t row_chunks;
};

// The schema's two flags as a row of the table.
PFPPO_HD GaeWhiten gae_whiten_mode(bool whiten, bool shift_mean) {
  return !whiten ? GaeWhiten::kNone : (shift_mean ? GaeWhiten::kWhiten : GaeWhiten::kWhitenKeepMean);
}

// Whether the mode needs the sums of the scan and the whitening pass.
PFPPO_HD bool whitens(GaeWhiten mode) {
  switch (mode) {
    case GaeWhiten::kNone: return false;
    case GaeWhiten::kWhiten: return true;
    case GaeWhiten::kWhitenKeepMean: return true;
  }
  return false;
}

// gamma lam, rounded once from the product in fp64 (both devices scan with this).
PFPPO_HD float gae_gamma_lam(const GaeArgs& g) { return float(double(g.gamma) * double(g.lam)); }

// delta_t from r_t, V_t (0 on padding) and m_{t+1} V_{t+1}.
PFPPO_HD float gae_delta(float r, float gamma, float next_value, float v) {
  return r + gamma * next_value - v;
}

// A_t from delta_t and A_{t+1} (0 on padding).
PFPPO_HD float gae_advantage(bool m, float delta, float gamma_lam, float next_adv) {
  return m ? delta + gamma_lam * next_adv : 0.0f;
}

// R_t = m_t (A_t + V_t).
PFPPO_HD float gae_return(bool m, float a, float v) { return m ? a + v : 0.0f; }

// Of the real tokens' count n, sum A and sum A^2 (fp64): A' = (A - mean) rstd + add_back.
struct WhitenScale {
  float mean;
  float rstd;
  float add_back;
};

PFPPO_HD WhitenScale whiten_scale(GaeWhiten mode, double n, double sum, double sum_sq) {
  const double mean = n > 0.0 ? sum / n : 0.0;
  double var = n >= 2.0 ? (sum_sq - n * mean * mean) / (n - 1.0) : 0.0;  // unbiased
  var = var < 0.0 ? 0.0 : var;  // a NaN stays NaN
  const float meanf = float(mean);
  const float rstd = float(1.0 / sqrt(var + double(kWhitenEps)));
  switch (mode) {
    case GaeWhiten::kNone: return WhitenScale{0.0f, 1.0f, 0.0f};
    case GaeWhiten::kWhiten: return WhitenScale{meanf, rstd, 0.0f};
    case GaeWhiten::kWhitenKeepMean: return WhitenScale{meanf, rstd, meanf};
  }
  return WhitenScale{0.0f, 1.0f, 0.0f};
}

PFPPO_HD float whiten_token(bool m, float a, const WhitenScale& w) {
  return m ? (a - w.mean) * w.rstd + w.add_back : 0.0f;
}

// The kernels behind the host wrapper (raw pointers; the wrapper has checked every input).
namespace cpu {
// advantages and returns [B, T] (advantages optionally whitened over real tokens).
void gae(const GaeArgs& a, void* advantages, void* returns);
}  // namespace cpu

namespace cuda {
// Pieces each row is cut into for the chunked scan (g.row_chunks, or chosen for sm_count).
int64_t gae_pieces(const GaeArgs& g, int sm_count);
size_t gae_workspace_bytes(const GaeArgs& g, int64_t pieces);
// stream: a cudaStream_t. Returns the cudaError_t of the launches (0 = queued).
int gae(const GaeArgs& g, int64_t pieces, void* advantages, void* returns, void* workspace,
        void* stream);
}  // namespace cuda

}  // namespace pfppo

// ---------------------------------------------------------------------------------------------
// Host (torch): the schema, the input checks and the one wrapper that runs the CPU or, in a
// CUDA build (PFPPO_WITH_CUDA), the CUDA kernel. Compiled once, by csrc/ops.cpp.
#ifdef PFPPO_HOST
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "api.h"

namespace pfppo {
namespace gae_host {

constexpr const char* kOp = "pfppo::gae";

GaeArgs check_gae(const at::Tensor& rewards, const at::Tensor& values, const at::Tensor& mask,
                  double gamma, double lam, bool whiten, bool shift_mean, int64_t row_chunks) {
  const char* op = kOp;
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
  return GaeArgs{rewards.data_ptr(), values.data_ptr(), dtype,          mask.data_ptr(),
                 mk,                 values.size(0),    values.size(1), float(gamma),
                 float(lam),         gae_whiten_mode(whiten, shift_mean), row_chunks};
}

// One wrapper for both devices: advantages and returns [B, T] in the dtype of values.
std::tuple<at::Tensor, at::Tensor> gae(const at::Tensor& rewards, const at::Tensor& values,
                                       const at::Tensor& mask, double gamma, double lam,
                                       bool whiten, bool shift_mean, int64_t row_chunks) {
  GaeArgs g = check_gae(rewards, values, mask, gamma, lam, whiten, shift_mean, row_chunks);
  at::Tensor adv = at::empty_like(values, at::MemoryFormat::Contiguous);
  at::Tensor ret = at::empty_like(values, at::MemoryFormat::Contiguous);
  if (values.is_cuda()) {
#ifdef PFPPO_WITH_CUDA
    CudaLaunch launch(values, kOp);
    const int64_t pieces = cuda::gae_pieces(g, cuda::sm_count(values.device().index()));
    at::Tensor ws = workspace_bytes(values, cuda::gae_workspace_bytes(g, pieces));
    launch.check(
        cuda::gae(g, pieces, adv.data_ptr(), ret.data_ptr(), ws.data_ptr(), launch.stream()));
#endif
  } else {
    cpu::gae(g, adv.data_ptr(), ret.data_ptr());
  }
  return {adv, ret};
}

}  // namespace gae_host

TORCH_LIBRARY_FRAGMENT(pfppo, m) {
  m.def(
      "gae(Tensor rewards, Tensor values, Tensor mask, float gamma, float lam, "
      "bool whiten=False, bool shift_mean=True, int row_chunks=0) -> "
      "(Tensor advantages, Tensor returns)");
}

TORCH_LIBRARY_IMPL(pfppo, CPU, m) { m.impl("gae", &gae_host::gae); }

#ifdef PFPPO_WITH_CUDA
TORCH_LIBRARY_IMPL(pfppo, CUDA, m) { m.impl("gae", &gae_host::gae); }
#endif

}  // namespace pfppo
#endif  // PFPPO_HOST
