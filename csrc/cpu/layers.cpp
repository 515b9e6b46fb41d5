// Fused decoder-layer kernels for the trainer's CPU path (reference: pfppo_mega/models/fused_layers.py,
// which also holds megatron's unfused formulas these replace). fp32 rows, contiguous; OpenMP over rows,
// one pass over memory per kernel where megatron's composite ops make 4-8.
//
//   rms_norm      y = w * x * r,  r = 1 / sqrt(mean(x^2) + eps)                        per row of E
//   rms_norm_bwd  gx = r * (gy * w - x * r * mean(gy * w * x * r)),  gw = sum_rows gy * x * r
//   swiglu        y = silu(a) * b,  [a | b] = one row of 2F (megatron's fc1 output: gate, then up)
//   swiglu_bwd    ga = gy * b * s * (1 + a * (1 - s)),  gb = gy * a * s,  s = sigmoid(a)
//   rope          y = x * cos(f) + rotate_half(x) * sin(f),  rotate_half([x1, x2]) = [-x2, x1]
//                 (inverse = the transposed rotation: the backward of rope)
#include <omp.h>

#include <cmath>
#include <vector>

#include "cpu_kernels.h"
#include "cpu_math.h"

namespace pfppo::cpu {
namespace {

PFPPO_CLONES void norm_row(const float* x, const float* w, float* y, float* rstd, int64_t E,
                           float eps) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t e = 0; e < E; ++e) ss += x[e] * x[e];
  const float r = 1.0f / std::sqrt(ss / float(E) + eps);
#pragma omp simd
  for (int64_t e = 0; e < E; ++e) y[e] = w[e] * (x[e] * r);
  *rstd = r;
}

// gx for one row; adds gy * x * r into gw_acc (this thread's partial of gw).
PFPPO_CLONES void norm_bwd_row(const float* gy, const float* x, const float* w, float r, float* gx,
                               float* gw_acc, int64_t E) {
  float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
  for (int64_t e = 0; e < E; ++e) dot += gy[e] * w[e] * x[e];
  const float c = dot * r * r / float(E);  // mean(gy * w * xhat) / r ... times r below
#pragma omp simd
  for (int64_t e = 0; e < E; ++e) {
    gx[e] = r * (gy[e] * w[e] - x[e] * c);
    gw_acc[e] += gy[e] * x[e] * r;
  }
}

PFPPO_INLINE float sigmoid(float a) {
  float t = -a;
  t = t > 80.0f ? 80.0f : t;  // exp_bounded's range; sigmoid(-80) ~ 1.8e-35 either way
  return 1.0f / (1.0f + exp_bounded(t));
}

PFPPO_CLONES void swiglu_row(const float* h, float* y, int64_t F) {
  const float* a = h;
  const float* b = h + F;
#pragma omp simd
  for (int64_t f = 0; f < F; ++f) y[f] = a[f] * sigmoid(a[f]) * b[f];
}

PFPPO_CLONES void swiglu_bwd_row(const float* gy, const float* h, float* gh, int64_t F) {
  const float* a = h;
  const float* b = h + F;
  float* ga = gh;
  float* gb = gh + F;
#pragma omp simd
  for (int64_t f = 0; f < F; ++f) {
    const float s = sigmoid(a[f]);
    gb[f] = gy[f] * a[f] * s;
    ga[f] = gy[f] * b[f] * s * (1.0f + a[f] * (1.0f - s));
  }
}

// One head vector x [D] with its angles' cos / sin [D]; sign -1 for the inverse rotation.
PFPPO_CLONES void rope_vec(const float* x, const float* c, const float* s, float* y, int64_t D,
                           float sign) {
  const int64_t h = D / 2;
#pragma omp simd
  for (int64_t d = 0; d < h; ++d) {
    const float x1 = x[d], x2 = x[d + h];
    // forward: y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2; inverse (transpose): y1 = x1 c1 + x2 s2,
    // y2 = x2 c2 - x1 s1
    const float s_a = sign > 0 ? s[d] : s[d + h];
    const float s_b = sign > 0 ? s[d + h] : s[d];
    y[d] = x1 * c[d] - sign * x2 * s_a;
    y[d + h] = x2 * c[d + h] + sign * x1 * s_b;
  }
}

}  // namespace

void rms_norm_fwd(const float* x, const float* w, float* y, float* rstd, int64_t N, int64_t E,
                  float eps) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) norm_row(x + n * E, w, y + n * E, rstd + n, E, eps);
}

void rms_norm_bwd(const float* gy, const float* x, const float* w, const float* rstd, float* gx,
                  float* gw, int64_t N, int64_t E) {
  const int threads = omp_get_max_threads();
  std::vector<float> partial(size_t(threads) * size_t(E), 0.0f);  // [threads, E]
#pragma omp parallel num_threads(threads)
  {
    float* acc = partial.data() + size_t(omp_get_thread_num()) * size_t(E);
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n)
      norm_bwd_row(gy + n * E, x + n * E, w, rstd[n], gx + n * E, acc, E);
  }
  for (int64_t e = 0; e < E; ++e) gw[e] = 0.0f;
  for (int t = 0; t < threads; ++t)
    for (int64_t e = 0; e < E; ++e) gw[e] += partial[size_t(t) * size_t(E) + size_t(e)];
}

void swiglu_fwd(const float* h, float* y, int64_t N, int64_t F) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) swiglu_row(h + n * 2 * F, y + n * F, F);
}

void swiglu_bwd(const float* gy, const float* h, float* gh, int64_t N, int64_t F) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) swiglu_bwd_row(gy + n * F, h + n * 2 * F, gh + n * 2 * F, F);
}

void rope(const float* x, const float* cos, const float* sin, float* y, int64_t S, int64_t rows,
          int64_t D, bool inverse) {
  const float sign = inverse ? -1.0f : 1.0f;
#pragma omp parallel for schedule(static)
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t off = (s * rows + r) * D;
      rope_vec(x + off, cos + s * D, sin + s * D, y + off, D, sign);
    }
  }
}

}  // namespace pfppo::cpu
