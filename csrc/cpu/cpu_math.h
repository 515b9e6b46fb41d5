// Scalar helpers written so that GCC vectorises the loops that call them (compile with
// -O3 -fno-trapping-math -fno-math-errno; no -ffast-math: NaN and inf keep their meaning).
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>

#include "../kernel_types.h"

#define PFPPO_INLINE inline __attribute__((always_inline))

// Hot loops are compiled three times (AVX-512, AVX2+FMA, baseline x86-64) and the best one
// for the running CPU is picked when the library loads (GCC ifunc).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PFPPO_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define PFPPO_CLONES
#endif

namespace pfppo::cpu {

struct Bf16 {
  uint16_t bits;
};

PFPPO_INLINE float bits_to_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

PFPPO_INLINE uint32_t f32_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

PFPPO_INLINE float to_f32(float x) { return x; }
PFPPO_INLINE float to_f32(Bf16 x) { return bits_to_f32(uint32_t(x.bits) << 16); }

// Round to nearest even; NaN stays a (quiet) NaN.
PFPPO_INLINE Bf16 to_bf16(float f) {
  uint32_t u = f32_to_bits(f);
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  uint32_t nan = (u >> 16) | 0x40u;
  bool is_nan = (u & 0x7fffffffu) > 0x7f800000u;
  return Bf16{uint16_t(is_nan ? nan : rounded)};
}

template <typename T>
PFPPO_INLINE T from_f32(float x);
template <>
PFPPO_INLINE float from_f32<float>(float x) {
  return x;
}
template <>
PFPPO_INLINE Bf16 from_f32<Bf16>(float x) {
  return to_bf16(x);
}

// torch bool masks are read as bytes (GCC does not vectorise loads of C++ bool).
PFPPO_INLINE bool nonzero(uint8_t m) { return m != 0; }
PFPPO_INLINE bool nonzero(float m) { return m != 0.0f; }
PFPPO_INLINE bool nonzero(Bf16 m) { return (m.bits & 0x7fffu) != 0; }

// fp32 view of a mask byte (1 or 0) or of a bf16 value (a bf16 mask keeps "!= 0" meaning).
PFPPO_INLINE float widen(uint8_t m) { return m != 0 ? 1.0f : 0.0f; }
PFPPO_INLINE float widen(Bf16 x) { return to_f32(x); }

// exp(x) for x <= 80 within ~2 ulp (Cody-Waite reduction, Cephes expf polynomial).
// x < -87.3 gives 0 (no denormals), NaN gives NaN. Callers guarantee x <= 80.
PFPPO_INLINE float exp_bounded(float x) {
  const float lo = -87.3f;
  float xc = x < lo ? lo : x;
  xc = xc > 80.0f ? 80.0f : xc;
  float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round(x / ln 2)
  float r = xc - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  int32_t e = int32_t(n) << 23;
  float out = bits_to_f32(f32_to_bits(p) + uint32_t(e));
  return x < lo ? 0.0f : (x >= lo ? out : x);
}

// exp(x) in fp64 for |x| <= 700 within 1e-10 relative (Cody-Waite reduction, Taylor to r^9
// on |r| <= ln2 / 2: truncation 0.347^10 / 10! = 7e-11) -- far below an fp32 ulp (6e-8),
// at half the cost of a full fp64 exp. Callers clamp x; NaN gives NaN.
PFPPO_INLINE double exp_f64(double x) {
  const double xc = x < -700.0 ? -700.0 : (x > 700.0 ? 700.0 : x);
  const double n = (xc * 1.4426950408889634 + 6755399441055744.0) - 6755399441055744.0;
  double r = xc - n * 6.93147180369123816490e-01;  // ln 2, high part (exact product)
  r = r - n * 1.90821492927058770002e-10;          // ln 2, low part
  double p = 1.0 / 362880.0;
  p = p * r + 1.0 / 40320.0;
  p = p * r + 1.0 / 5040.0;
  p = p * r + 1.0 / 720.0;
  p = p * r + 1.0 / 120.0;
  p = p * r + 1.0 / 24.0;
  p = p * r + 1.0 / 6.0;
  p = p * r + 0.5;
  p = p * r + 1.0;
  p = p * r + 1.0;
  uint64_t bits;
  std::memcpy(&bits, &p, 8);
  bits += uint64_t(int64_t(n)) << 52;
  double out;
  std::memcpy(&out, &bits, 8);
  return x == x ? out : x;
}

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

}  // namespace pfppo::cpu
