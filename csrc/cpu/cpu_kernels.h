// Raw-pointer CPU kernels of the decoder-layer ops (CPU only; OpenMP over rows, SIMD inside a
// row). No torch types here: csrc/ops.cpp checks the tensors and calls these. The fused ops of
// both devices declare their kernels in their own headers (csrc/<op>.h).
#pragma once

#include <cstdint>

namespace pfppo::cpu {

// Fused decoder-layer kernels (csrc/cpu/layers.cpp), fp32, contiguous rows.
// RMSNorm of N rows of E: y [N, E], rstd [N]; backward: gx [N, E], gw [E].
void rms_norm_fwd(const float* x, const float* w, float* y, float* rstd, int64_t N, int64_t E,
                  float eps);
void rms_norm_bwd(const float* gy, const float* x, const float* w, const float* rstd, float* gx,
                  float* gw, int64_t N, int64_t E);
// SwiGLU of N rows h = [gate F | up F] -> y [N, F]; backward gh [N, 2F].
void swiglu_fwd(const float* h, float* y, int64_t N, int64_t F);
void swiglu_bwd(const float* gy, const float* h, float* gh, int64_t N, int64_t F);
// Rotate-half RoPE of x [S, rows, D] by the angles' cos, sin [S, D] (inverse: the transpose, for
// the backward).
void rope(const float* x, const float* cos, const float* sin, float* y, int64_t S, int64_t rows,
          int64_t D, bool inverse);

}  // namespace pfppo::cpu
