// GAE over right-padded [B, T] on the GPU. The op's modes, arguments and per-token math
// (delta, A, R, whitening) are csrc/gae.h, shared with the CPU kernel:
//   delta_t = r_t + gamma m_{t+1} V_{t+1} - V_t,   A_t = m_t (delta_t + gamma lam A_{t+1})
//   R_t = m_t (A_t + V_t)
// A_t = a_t A_{t+1} + b_t (a_t = m_t gamma lam, b_t = m_t delta_t) is a linear recurrence:
// maps (p, q): A_begin = p A_end + q compose associatively,
//   (p1, q1) after (p2, q2) = (p1 p2, p1 q2 + q1),
// so T can be cut into chunks, each chunk scanned on its own, and the carries combined.
//
// Roofline. Per token the op must read r, V (sizeof(T) each) and the mask, and write A and R:
//   fp32 + bool mask: 17 B/token (1024 x 8192: 143 MB, 35 us at the H200's 4.1 TB/s copy
//   rate); bf16: 9 B/token. The goal is >= 75% of copy bandwidth.
//   Chunked rows (few rows, below) read r, V and the mask twice: 26 / 14 B/token; whitening
//   adds a pass that reads the mask and A and writes A (+9 / +5 B/token).
// What the design does for the bytes:
//   * each thread owns kItems = 16 / sizeof(T) consecutive tokens (4 fp32, 8 bf16) and reads
//     them with one 16-byte load per tensor (the mask: 4 or 8 bytes), the lanes of a warp
//     covering one contiguous run: coalesced (the old layout of 8 fp32 tokens per thread
//     strided the lanes 32 bytes apart, 8 scalar loads per tensor);
//   * pieces and tiles start at multiples of kItems from the row's start, so those loads stay
//     aligned whenever T is a multiple of kItems (else each thread falls back to scalar loads);
//   * the next tile's loads are issued before the current tile's scan and its barriers (two
//     tiles in flight per block), so the latency of HBM hides behind the scan;
//   * a block scans one piece of one row, tile by tile from the end: each thread composes the
//     map of its tokens, a warp-shuffle suffix scan and a pass over the warps give every
//     thread the A just after its tokens, and it writes A and R;
//   * the chunked scan along T when rows are few (rows < 4 blocks per SM): each row is cut
//     into pieces scanned by separate blocks, so a short batch still fills the GPU:
//       pass 1 (scan, no writes): the map of every piece;  carry: A after each piece, per
//       row (a serial pass over a row's few pieces);  pass 3 (scan, writes) with that carry.
//     One piece per row (rows enough) skips passes 1-2: the minimum bytes.
// Whitening: per-block fp64 sums -> one block computes mean and 1/std -> an elementwise pass.
#include <algorithm>
#include <cmath>

#include "../gae.h"
#include "device_math.cuh"

namespace pfppo::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kBlocksPerSm = 4;

template <typename T>
constexpr int items() {  // tokens per thread: one 16-byte load of T
  return 16 / int(sizeof(T));
}

template <typename T>
constexpr int64_t tile() {
  return int64_t(kThreads) * items<T>();
}

struct Map {
  float p;
  float q;
};

__device__ __forceinline__ Map compose(const Map& first, const Map& then) {
  // `first` is applied to the output of `then` (first is earlier in time).
  return Map{first.p * then.p, first.p * then.q + first.q};
}

struct GaeWorkspace {
  Map* piece_map;  // [B * pieces]
  float* carry;    // [B * pieces]: A just after each piece
  double* stats;   // [B * pieces, 3]: sum A, sum A^2, real tokens
  WhitenScale* whiten;  // mean, 1 / std, value added back
};

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

GaeWorkspace carve(void* base, const GaeArgs& g, int64_t pieces) {
  const size_t jobs = size_t(g.rows * pieces);
  char* p = static_cast<char*>(base);
  GaeWorkspace w;
  w.piece_map = reinterpret_cast<Map*>(p);
  p += align256(jobs * sizeof(Map));
  w.carry = reinterpret_cast<float*>(p);
  p += align256(jobs * sizeof(float));
  w.stats = reinterpret_cast<double*>(p);
  p += align256(jobs * 3 * sizeof(double));
  w.whiten = reinterpret_cast<WhitenScale*>(p);
  return w;
}

template <typename T, typename M, bool kWrite>
__global__ void __launch_bounds__(kThreads)
    scan_kernel(GaeArgs g, int64_t pieces, int64_t piece_len, T* __restrict__ adv,
                T* __restrict__ ret, GaeWorkspace w) {
  constexpr int kItems = items<T>();
  constexpr int64_t kTile = tile<T>();
  __shared__ Map warp_map[kWarps];
  __shared__ float warp_end[kWarps];
  __shared__ float tile_carry;
  __shared__ double smem[32];
  const int64_t job = blockIdx.x;
  const int64_t b = job / pieces, k = job % pieces, T_ = g.cols;
  const int64_t begin = min(T_, k * piece_len), end = min(T_, begin + piece_len);
  const T* rewards = static_cast<const T*>(g.rewards) + b * T_;
  const T* values = static_cast<const T*>(g.values) + b * T_;
  const M* mask = static_cast<const M*>(g.mask) + b * T_;
  T* adv_row = kWrite ? adv + b * T_ : nullptr;
  T* ret_row = kWrite ? ret + b * T_ : nullptr;
  const float gamma = g.gamma;
  const float gamma_lam = gae_gamma_lam(g);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

  float carry = kWrite ? w.carry[job] : 0.0f;  // A just after the current tile
  Map piece{1.0f, 0.0f};                        // pass 1: map of the tiles done so far
  double s1 = 0.0, s2 = 0.0, count = 0.0;
  // Tiles start at begin + j kTile (begin: a multiple of kItems), scanned from the last. The
  // loads of the next tile (earlier in T) are issued before this tile's scan, so a block
  // keeps two tiles of loads in flight across its barriers.
  const int64_t n_tiles = (end - begin + kTile - 1) / kTile;
  auto span_of = [&](int64_t j_tile, int64_t& seg_begin, int& n) {
    const int64_t tile_end = min(end, begin + (j_tile + 1) * kTile);
    seg_begin = begin + j_tile * kTile + int64_t(threadIdx.x) * kItems;
    n = tile_end > seg_begin ? int(min(int64_t(kItems), tile_end - seg_begin)) : 0;
  };
  T rt[kItems], vt[kItems];  // the tile being loaded
  M mt[kItems];
  if (n_tiles > 0) {
    int64_t sb;
    int nn;
    span_of(n_tiles - 1, sb, nn);
    load_span<kItems>(mask + sb, nn, mt);
    load_span<kItems>(values + sb, nn, vt);
    load_span<kItems>(rewards + sb, nn, rt);
  }
  for (int64_t j_tile = n_tiles - 1; j_tile >= 0; --j_tile) {
    int64_t seg_begin;
    int n;
    span_of(j_tile, seg_begin, n);
    const int64_t seg_end = seg_begin + n;
    T rc[kItems], vc[kItems];
    M mc[kItems];
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      rc[j] = rt[j];
      vc[j] = vt[j];
      mc[j] = mt[j];
    }
    if (j_tile > 0) {  // prefetch the next tile
      int64_t sb;
      int nn;
      span_of(j_tile - 1, sb, nn);
      load_span<kItems>(mask + sb, nn, mt);
      load_span<kItems>(values + sb, nn, vt);
      load_span<kItems>(rewards + sb, nn, rt);
    }
    float r[kItems], v[kItems];
    bool m[kItems];
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      m[j] = j < n && nonzero(mc[j]);
      v[j] = m[j] ? to_f32(vc[j]) : 0.0f;  // padding is never used
      r[j] = m[j] ? to_f32(rc[j]) : 0.0f;
    }
    // m V just after this thread's tokens (the next thread's first token, or past the tile).
    const float v_after =
        (n > 0 && seg_end < T_ && nonzero(mask[seg_end])) ? to_f32(values[seg_end]) : 0.0f;

    // The map of this thread's tokens, last token first.
    Map own{1.0f, 0.0f};
#pragma unroll
    for (int j = kItems - 1; j >= 0; --j) {
      if (j >= n) continue;
      const float nv = j + 1 < n ? v[j + 1] : v_after;
      const float delta = gae_delta(r[j], gamma, nv, v[j]);
      own = compose(Map{m[j] ? gamma_lam : 0.0f, m[j] ? delta : 0.0f}, own);
    }

    // Suffix scan over the warp: lane i gets the map of lanes i..31.
    Map incl = own;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const Map later{__shfl_down_sync(kFullMask, incl.p, off),
                      __shfl_down_sync(kFullMask, incl.q, off)};
      if (lane + off < 32) incl = compose(incl, later);
    }
    if (lane == 0) warp_map[warp] = incl;
    __syncthreads();
    if (threadIdx.x == 0) {
      float x = carry;
      Map tile{1.0f, 0.0f};
      for (int wi = kWarps - 1; wi >= 0; --wi) {
        warp_end[wi] = x;
        x = warp_map[wi].p * x + warp_map[wi].q;
        tile = compose(warp_map[wi], tile);
      }
      tile_carry = x;
      piece = compose(tile, piece);
    }
    __syncthreads();

    if constexpr (kWrite) {
      // A just after this thread's tokens = (lanes after it) applied to the warp's end value.
      Map after{__shfl_down_sync(kFullMask, incl.p, 1), __shfl_down_sync(kFullMask, incl.q, 1)};
      if (lane == 31) after = Map{1.0f, 0.0f};
      float a_next = after.p * warp_end[warp] + after.q;
      T a_out[kItems], r_out[kItems];
#pragma unroll
      for (int j = kItems - 1; j >= 0; --j) {
        if (j >= n) continue;
        const float nv = j + 1 < n ? v[j + 1] : v_after;
        const float a = gae_advantage(m[j], gae_delta(r[j], gamma, nv, v[j]), gamma_lam, a_next);
        a_out[j] = from_f32<T>(a);
        r_out[j] = from_f32<T>(gae_return(m[j], a, v[j]));
        s1 += a;
        s2 += double(a) * a;
        count += m[j] ? 1.0 : 0.0;
        a_next = a;
      }
      store_span<kItems>(adv_row + seg_begin, n, a_out);
      store_span<kItems>(ret_row + seg_begin, n, r_out);
    }
    carry = tile_carry;
    __syncthreads();  // warp_map / warp_end / tile_carry are reused by the next tile
  }

  if constexpr (kWrite) {
    if (whitens(g.whiten)) {
      s1 = block_sum(s1, smem);
      s2 = block_sum(s2, smem);
      count = block_sum(count, smem);
      if (threadIdx.x == 0) {
        w.stats[job * 3 + 0] = s1;
        w.stats[job * 3 + 1] = s2;
        w.stats[job * 3 + 2] = count;
      }
    }
  } else {
    if (threadIdx.x == 0) w.piece_map[job] = piece;
  }
}

// Pass 2: A just after each piece, from the last piece of a row to the first.
__global__ void carry_kernel(int64_t rows, int64_t pieces, GaeWorkspace w) {
  const int64_t b = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= rows) return;
  float x = 0.0f;
  for (int64_t k = pieces - 1; k >= 0; --k) {
    w.carry[b * pieces + k] = x;
    const Map mp = w.piece_map[b * pieces + k];
    x = mp.p * x + mp.q;
  }
}

__global__ void __launch_bounds__(kThreads)
    whiten_stats_kernel(int64_t jobs, GaeWhiten mode, GaeWorkspace w) {
  __shared__ double smem[32];
  double s1 = 0.0, s2 = 0.0, n = 0.0;
  for (int64_t j = threadIdx.x; j < jobs; j += kThreads) {
    s1 += w.stats[j * 3 + 0];
    s2 += w.stats[j * 3 + 1];
    n += w.stats[j * 3 + 2];
  }
  s1 = block_sum(s1, smem);
  s2 = block_sum(s2, smem);
  n = block_sum(n, smem);
  if (threadIdx.x != 0) return;
  *w.whiten = whiten_scale(mode, n, s1, s2);
}

template <typename T, typename M>
__global__ void __launch_bounds__(kThreads)
    whiten_apply_kernel(int64_t n, const M* __restrict__ mask, T* __restrict__ adv, GaeWorkspace w) {
  const WhitenScale ws = *w.whiten;
  for (int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * kThreads) {
    adv[i] = from_f32<T>(whiten_token(nonzero(mask[i]), to_f32(adv[i]), ws));
  }
}

int64_t items_of(const GaeArgs& g) {
  return g.dtype == Scalar::kF32 ? items<float>() : items<__nv_bfloat16>();
}

// Tokens per piece: the row cut into `pieces`, rounded up to whole 16-byte spans (so every
// piece starts aligned; trailing pieces may be empty).
int64_t piece_len(const GaeArgs& g, int64_t pieces) {
  const int64_t s = items_of(g);
  return std::max<int64_t>(s, ceil_div(ceil_div(g.cols, pieces), s) * s);
}

}  // namespace

int64_t gae_pieces(const GaeArgs& g, int sm_count) {
  // Forced (tests): up to one piece per span; chosen: up to one piece per tile.
  if (g.row_chunks > 0) {
    return std::min<int64_t>(g.row_chunks, std::max<int64_t>(1, ceil_div(g.cols, items_of(g))));
  }
  const int64_t max_pieces = std::max<int64_t>(1, ceil_div(g.cols, kThreads * items_of(g)));
  const int64_t want_blocks = kBlocksPerSm * int64_t(sm_count);
  if (g.rows >= want_blocks || g.rows == 0) return 1;
  return std::min<int64_t>(ceil_div(want_blocks, g.rows), max_pieces);
}

size_t gae_workspace_bytes(const GaeArgs& g, int64_t pieces) {
  const size_t jobs = size_t(g.rows * pieces);
  return align256(jobs * sizeof(Map)) + align256(jobs * sizeof(float)) +
         align256(jobs * 3 * sizeof(double)) + 256;
}

int gae(const GaeArgs& g, int64_t pieces, void* advantages, void* returns, void* workspace,
        void* stream_ptr) {
  if (g.rows == 0 || g.cols == 0) return int(cudaSuccess);
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  GaeWorkspace w = carve(workspace, g, pieces);
  const int64_t jobs = g.rows * pieces;
  const int64_t len = piece_len(g, pieces);
  return int(with_scalar(g.dtype, [&](auto t) {
    using T = decltype(t);
    return with_mask(g.mask_kind, [&](auto m) {
      using M = decltype(m);
      T* adv = static_cast<T*>(advantages);
      T* ret = static_cast<T*>(returns);
      if (pieces > 1) {
        scan_kernel<T, M, false><<<jobs, kThreads, 0, stream>>>(g, pieces, len, adv, ret, w);
        carry_kernel<<<ceil_div(g.rows, 256), 256, 0, stream>>>(g.rows, pieces, w);
      } else {
        cudaError_t err = cudaMemsetAsync(w.carry, 0, size_t(jobs) * sizeof(float), stream);
        if (err != cudaSuccess) return err;
      }
      scan_kernel<T, M, true><<<jobs, kThreads, 0, stream>>>(g, pieces, len, adv, ret, w);
      if (whitens(g.whiten)) {
        whiten_stats_kernel<<<1, kThreads, 0, stream>>>(jobs, g.whiten, w);
        const int64_t n = g.rows * g.cols;
        const int64_t blocks = std::min<int64_t>(ceil_div(n, kThreads), 65535);
        whiten_apply_kernel<T, M><<<blocks, kThreads, 0, stream>>>(
            n, static_cast<const M*>(g.mask), adv, w);
      }
      return cudaGetLastError();
    });
  }));
}

}  // namespace pfppo::cuda
