// GAE over right-padded [B, T] on the CPU. The op's modes, arguments and per-token math
// (delta, A, R, whitening) are csrc/gae.h, shared with the CUDA kernel; this file is the
// OpenMP/SIMD schedule around them:
// A_t = a_t A_{t+1} + b_t with a_t = m_t gamma lam, b_t = m_t delta_t is an affine recurrence,
// so a row can be cut into pieces scanned in parallel (chunked scan):
//   1. each piece scans itself with A_end = 0, giving A'_start and P = prod_t a_t;
//   2. carries run back over the pieces: A_end(k) = A'_start(k+1) + P(k+1) A_end(k+1);
//   3. each piece rescans with its true A_end and writes A and R.
// With at least as many rows as threads every row is one piece and steps 1-2 vanish; rows
// are then scanned kGroup at a time (independent recurrences side by side hide FMA latency).
// Optional whitening: (A - mean) / sqrt(var + 1e-8) over real tokens (unbiased var), with
// the sums taken in fp64 during step 3 and a second pass that rescales A in place.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "../gae.h"
#include "cpu_math.h"

namespace pfppo::cpu {
namespace {

constexpr int kGroup = 4;
constexpr int64_t kWhitenBlock = 16384;

// Sums over the real tokens of what step 3 wrote (for whitening).
struct ScanSums {
  double sum = 0.0;
  double sum_sq = 0.0;
  double count = 0.0;
};

enum class Pass { kCarryFactor, kWrite, kWriteAndSum };

// Reverse scan of tokens [begin, end) of G rows (row g at offset g * cols): G independent
// recurrences side by side, so the loop carries G FMA chains instead of one. next_value,
// next_adv [G]: m V and A just after the piece; next_adv is updated to A at `begin`.
// kCarryFactor: no writes, prod [G] = prod_t a_t; kWrite: write A and R; kWriteAndSum: also
// add the real tokens' count, sum A, sum A^2 to sums (for whitening). Compiled per ISA.
// (Staging blocks in L1 and vectorising all but the FMA chain was 2x slower: measured.)
template <typename T, typename M, Pass kPass, int G>
PFPPO_CLONES void scan_group(const T* rewards, const T* values, const M* mask, T* adv_out,
                             T* ret_out, int64_t cols, int64_t begin, int64_t end, float gamma,
                             float gamma_lam, const float* next_value, float* next_adv,
                             float* prod, ScanSums* sums) {
  float nv[G], na[G], pr[G];
  double s1[G], s2[G], s0[G];
  for (int g = 0; g < G; ++g) {
    nv[g] = next_value[g];
    na[g] = next_adv[g];
    pr[g] = 1.0f;
    s0[g] = s1[g] = s2[g] = 0.0;
  }
  for (int64_t t = end - 1; t >= begin; --t) {
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const int64_t i = g * cols + t;
      // Padding is loaded (the memory is there) but selected away, never used.
      const bool m = nonzero(mask[i]);
      const float v_raw = to_f32(values[i]), r_raw = to_f32(rewards[i]);
      const float v = m ? v_raw : 0.0f;
      const float r = m ? r_raw : 0.0f;
      const float a = gae_advantage(m, gae_delta(r, gamma, nv[g], v), gamma_lam, na[g]);
      if constexpr (kPass == Pass::kCarryFactor) {
        pr[g] *= m ? gamma_lam : 0.0f;
      } else {
        adv_out[i] = from_f32<T>(a);
        ret_out[i] = from_f32<T>(gae_return(m, a, v));
        if constexpr (kPass == Pass::kWriteAndSum) {
          s0[g] += m ? 1.0 : 0.0;
          s1[g] += a;
          s2[g] += double(a) * a;
        }
      }
      nv[g] = v;
      na[g] = a;
    }
  }
  for (int g = 0; g < G; ++g) {
    next_adv[g] = na[g];
    if constexpr (kPass == Pass::kCarryFactor) prod[g] = pr[g];
    if constexpr (kPass == Pass::kWriteAndSum) {
      sums->count += s0[g];
      sums->sum += s1[g];
      sums->sum_sq += s2[g];
    }
  }
}

// m_{end} V_{end} of one row: the value just after a piece (0 past the row or on padding).
template <typename T, typename M>
PFPPO_INLINE float value_after(const T* values, const M* mask, int64_t end, int64_t cols) {
  return end < cols && nonzero(mask[end]) ? to_f32(values[end]) : 0.0f;
}

// Rows [0, g.rows) (a multiple of G), each cut into `pieces`. Jobs are (G rows, one piece)
// and are handed out dynamically, so a thread that loses its core does not hold up the rest.
template <typename T, typename M, int G>
ScanSums gae_impl(const GaeArgs& g, int64_t pieces, T* adv, T* ret) {
  const int64_t B = g.rows, T_ = g.cols;
  const T* rewards = static_cast<const T*>(g.rewards);
  const T* values = static_cast<const T*>(g.values);
  const M* mask = static_cast<const M*>(g.mask);
  const float gamma = g.gamma;
  const float gamma_lam = gae_gamma_lam(g);
  const int64_t piece_len = (T_ + pieces - 1) / pieces;
  const int64_t jobs = (B / G) * pieces;
  auto span = [&](int64_t k) {
    const int64_t begin = std::min(T_, k * piece_len);
    return std::pair<int64_t, int64_t>{begin, std::min(T_, begin + piece_len)};
  };

  // Steps 1-2: A just after each piece of each row (0 after the last piece).
  std::vector<float> carry_adv(B * pieces, 0.0f);
  if (pieces > 1) {
    std::vector<float> local_start(B * pieces), prod(B * pieces);
#pragma omp parallel for schedule(dynamic)
    for (int64_t j = 0; j < jobs; ++j) {
      const int64_t b = (j / pieces) * G, k = j % pieces;
      const auto [begin, end] = span(k);
      float nv[G], na[G], pr[G];
      for (int r = 0; r < G; ++r) {
        nv[r] = value_after(values + (b + r) * T_, mask + (b + r) * T_, end, T_);
        na[r] = 0.0f;
      }
      const int64_t off = b * T_;
      scan_group<T, M, Pass::kCarryFactor, G>(rewards + off, values + off, mask + off, nullptr,
                                              nullptr, T_, begin, end, gamma, gamma_lam, nv, na,
                                              pr, nullptr);
      for (int r = 0; r < G; ++r) {
        local_start[(b + r) * pieces + k] = na[r];
        prod[(b + r) * pieces + k] = pr[r];
      }
    }
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t k = pieces - 2; k >= 0; --k) {
        const int64_t j = b * pieces + k;
        carry_adv[j] = local_start[j + 1] + prod[j + 1] * carry_adv[j + 1];
      }
    }
  }

  // Step 3.
  double s0 = 0.0, s1 = 0.0, s2 = 0.0;
#pragma omp parallel for schedule(dynamic) reduction(+ : s0, s1, s2)
  for (int64_t j = 0; j < jobs; ++j) {
    const int64_t b = (j / pieces) * G, k = j % pieces;
    const auto [begin, end] = span(k);
    float nv[G], na[G];
    for (int r = 0; r < G; ++r) {
      nv[r] = value_after(values + (b + r) * T_, mask + (b + r) * T_, end, T_);
      na[r] = carry_adv[(b + r) * pieces + k];
    }
    const int64_t off = b * T_;
    ScanSums part;
    if (whitens(g.whiten)) {
      scan_group<T, M, Pass::kWriteAndSum, G>(rewards + off, values + off, mask + off,
                                              adv + off, ret + off, T_, begin, end, gamma,
                                              gamma_lam, nv, na, nullptr, &part);
    } else {
      scan_group<T, M, Pass::kWrite, G>(rewards + off, values + off, mask + off, adv + off,
                                        ret + off, T_, begin, end, gamma, gamma_lam, nv, na,
                                        nullptr, nullptr);
    }
    s0 += part.count;
    s1 += part.sum;
    s2 += part.sum_sq;
  }
  ScanSums sums;
  sums.count = s0;
  sums.sum = s1;
  sums.sum_sq = s2;
  return sums;
}

// Rows in groups of kGroup when every row is one piece, the rest one by one.
template <typename T, typename M>
ScanSums run_rows(const GaeArgs& g, T* adv, T* ret) {
  const int64_t threads = omp_get_max_threads();
  int64_t pieces = g.row_chunks;
  if (pieces <= 0) {
    pieces = g.rows >= threads ? 1 : std::min<int64_t>((threads + g.rows - 1) / g.rows,
                                                        g.cols / 1024 + 1);
  }
  pieces = std::max<int64_t>(1, std::min<int64_t>(pieces, g.cols));
  const int64_t grouped = pieces == 1 ? (g.rows / kGroup) * kGroup : 0;
  ScanSums head, tail;
  GaeArgs head_args = g;
  head_args.rows = grouped;
  if (grouped > 0) head = gae_impl<T, M, kGroup>(head_args, pieces, adv, ret);
  GaeArgs tail_args = g;
  const int64_t off = grouped * g.cols;
  tail_args.rows = g.rows - grouped;
  tail_args.rewards = static_cast<const T*>(g.rewards) + off;
  tail_args.values = static_cast<const T*>(g.values) + off;
  tail_args.mask = static_cast<const M*>(g.mask) + off;
  if (tail_args.rows > 0) tail = gae_impl<T, M, 1>(tail_args, pieces, adv + off, ret + off);
  head.count += tail.count;
  head.sum += tail.sum;
  head.sum_sq += tail.sum_sq;
  return head;
}

// One block of the whitening pass, compiled per ISA.
template <typename T, typename M>
PFPPO_CLONES void whiten_block(T* adv, const M* mask, int64_t n, WhitenScale w) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    adv[i] = from_f32<T>(whiten_token(nonzero(mask[i]), to_f32(adv[i]), w));
  }
}

// A <- (A - mean) / sqrt(var + eps) (+ mean, per mode) on real tokens, 0 on padding.
template <typename T, typename M>
void whiten_impl(const GaeArgs& g, T* adv, const ScanSums& s) {
  if (s.count == 0.0) return;  // every A is already 0
  const M* mask = static_cast<const M*>(g.mask);
  const WhitenScale w = whiten_scale(g.whiten, s.count, s.sum, s.sum_sq);
  const int64_t n_total = g.rows * g.cols;
  const int64_t blocks = (n_total + kWhitenBlock - 1) / kWhitenBlock;
#pragma omp parallel for schedule(dynamic)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t i0 = blk * kWhitenBlock;
    whiten_block(adv + i0, mask + i0, std::min(kWhitenBlock, n_total - i0), w);
  }
}

template <typename T, typename M>
void run(const GaeArgs& g, void* adv_out, void* ret_out) {
  T* adv = static_cast<T*>(adv_out);
  T* ret = static_cast<T*>(ret_out);
  const ScanSums sums = run_rows<T, M>(g, adv, ret);
  if (whitens(g.whiten)) whiten_impl<T, M>(g, adv, sums);
}

template <typename T>
void dispatch_mask(const GaeArgs& g, void* adv, void* ret) {
  switch (g.mask_kind) {
    case Mask::kBool: return run<T, uint8_t>(g, adv, ret);
    case Mask::kF32: return run<T, float>(g, adv, ret);
    case Mask::kBF16: return run<T, Bf16>(g, adv, ret);
  }
}

}  // namespace

void gae(const GaeArgs& g, void* advantages, void* returns) {
  // No tokens: nothing to write, and run_rows would divide by rows (B = 0) to pick pieces.
  if (g.rows == 0 || g.cols == 0) return;
  if (g.dtype == Scalar::kF32) {
    dispatch_mask<float>(g, advantages, returns);
  } else {
    dispatch_mask<Bf16>(g, advantages, returns);
  }
}

}  // namespace pfppo::cpu
