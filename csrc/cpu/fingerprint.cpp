// Refit byte fingerprint (pfppo_mega.rollout.weights.fingerprint): one pass that copies weight
// bytes into a refit bucket and checksums them while they are in registers.
//
// Definition (the torch fallback in pfppo_mega/rollout/weights.py computes the same 32 words):
// the bytes, zero-padded to a multiple of 128, are rows of 16 little-endian uint64 words
// w[j][l]; for rows j = 0 .. n-1 in order and every lane l: s1[l] += w[j][l]; s2[l] += s1[l]
// (mod 2^64). Result: int64 [32] = s1[0..15], s2[0..15]. Any single flipped bit changes s1; a
// reordering of words within a lane changes s2. (Fletcher-style, not cryptographic.)
//
// Parallel and still exact: a run of n rows whose lane sums from zero are (A, B) takes a state
// (a0, b0) to (a0 + A, b0 + n * a0 + B) (mod 2^64). The bytes are cut into row-aligned chunks
// (several per torch intra-op thread, claimed in turn inside at::parallel_for), each chunk is
// copied and summed from zero, and the chunks are combined in order: the result does not depend on
// the thread count or on which thread took which chunk.
//
// Ops (registered here as a fragment of the pfppo library, CPU only):
//   pfppo::fingerprint(Tensor src) -> Tensor
//   pfppo::pack_fingerprint(Tensor(a!) dst, Tensor[] srcs) -> Tensor   dst <- cat(srcs), fused
#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define PFPPO_FP_X86 1
#endif

namespace pfppo {
namespace {

constexpr int kLanes = 16;
constexpr size_t kRow = kLanes * sizeof(uint64_t);  // 128 bytes
constexpr size_t kMinParallel = 1 << 20;            // bytes below which one thread does it all
constexpr size_t kMinChunk = 256 << 10;             // smallest chunk a thread claims
constexpr int kChunksPerThread = 8;                 // a late or preempted thread's share is taken over

// whole rows from src (copied to dst when kCopy): s1 += w, s2 += s1 per lane, per row
template <bool kCopy>
void rows_generic(uint64_t* s1, uint64_t* s2, const uint8_t* src, uint8_t* dst, size_t nrows) {
  uint64_t a[kLanes], b[kLanes];
  std::memcpy(a, s1, sizeof(a));
  std::memcpy(b, s2, sizeof(b));
  for (size_t r = 0; r < nrows; ++r) {
    uint64_t w[kLanes];
    std::memcpy(w, src + r * kRow, kRow);
    if (kCopy) std::memcpy(dst + r * kRow, w, kRow);
    for (int l = 0; l < kLanes; ++l) {
      a[l] += w[l];
      b[l] += a[l];
    }
  }
  std::memcpy(s1, a, sizeof(a));
  std::memcpy(s2, b, sizeof(b));
}

#ifdef PFPPO_FP_X86
// The same in AVX2 registers: a row is 4 ymm words, the 32 sums stay in 8 ymm registers (the
// compiler's own vectorisation of rows_generic spilled them to the stack every row and stalled on
// store forwarding: ~12 GB/s from cache, vs ~25 GB/s for memcpy).
template <bool kCopy>
__attribute__((target("avx2"))) void rows_avx2(uint64_t* s1, uint64_t* s2, const uint8_t* src, uint8_t* dst,
                                                size_t nrows) {
  __m256i a0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s1));
  __m256i a1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s1 + 4));
  __m256i a2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s1 + 8));
  __m256i a3 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s1 + 12));
  __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s2));
  __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s2 + 4));
  __m256i b2 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s2 + 8));
  __m256i b3 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s2 + 12));
  for (size_t r = 0; r < nrows; ++r) {
    const __m256i* p = reinterpret_cast<const __m256i*>(src + r * kRow);
    __m256i w0 = _mm256_loadu_si256(p), w1 = _mm256_loadu_si256(p + 1);
    __m256i w2 = _mm256_loadu_si256(p + 2), w3 = _mm256_loadu_si256(p + 3);
    if (kCopy) {
      __m256i* q = reinterpret_cast<__m256i*>(dst + r * kRow);
      _mm256_storeu_si256(q, w0);
      _mm256_storeu_si256(q + 1, w1);
      _mm256_storeu_si256(q + 2, w2);
      _mm256_storeu_si256(q + 3, w3);
    }
    a0 = _mm256_add_epi64(a0, w0);
    a1 = _mm256_add_epi64(a1, w1);
    a2 = _mm256_add_epi64(a2, w2);
    a3 = _mm256_add_epi64(a3, w3);
    b0 = _mm256_add_epi64(b0, a0);
    b1 = _mm256_add_epi64(b1, a1);
    b2 = _mm256_add_epi64(b2, a2);
    b3 = _mm256_add_epi64(b3, a3);
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(s1), a0);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(s1 + 4), a1);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(s1 + 8), a2);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(s1 + 12), a3);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(s2), b0);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(s2 + 4), b1);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(s2 + 8), b2);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(s2 + 12), b3);
}

bool have_avx2() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0;
  }();
  return yes;
}
#endif

void fingerprint_rows(uint64_t* s1, uint64_t* s2, const uint8_t* src, uint8_t* dst, size_t nrows) {
#ifdef PFPPO_FP_X86
  if (have_avx2()) {
    if (dst != nullptr) {
      rows_avx2<true>(s1, s2, src, dst, nrows);
    } else {
      rows_avx2<false>(s1, s2, src, nullptr, nrows);
    }
    return;
  }
#endif
  if (dst != nullptr) {
    rows_generic<true>(s1, s2, src, dst, nrows);
  } else {
    rows_generic<false>(s1, s2, src, nullptr, nrows);
  }
}

// the running state of one run of rows (from zero), fed byte ranges in order
struct alignas(64) Fingerprint {  // one per chunk: no two threads write one cache line
  uint64_t s1[kLanes] = {0};
  uint64_t s2[kLanes] = {0};
  uint8_t row[kRow];
  size_t fill = 0;

  void rows(const uint8_t* src, uint8_t* dst, size_t nrows) { fingerprint_rows(s1, s2, src, dst, nrows); }

  void feed(const uint8_t* src, uint8_t* dst, size_t n) {
    if (fill != 0) {
      size_t take = std::min(kRow - fill, n);
      std::memcpy(row + fill, src, take);
      if (dst != nullptr) {
        std::memcpy(dst, src, take);
        dst += take;
      }
      fill += take;
      src += take;
      n -= take;
      if (fill == kRow) {
        rows(row, nullptr, 1);
        fill = 0;
      }
    }
    size_t nrows = n / kRow;
    rows(src, dst, nrows);
    size_t done = nrows * kRow;
    size_t rest = n - done;
    if (rest != 0) {
      std::memcpy(row, src + done, rest);
      if (dst != nullptr) std::memcpy(dst + done, src + done, rest);
      fill = rest;
    }
  }

  void pad() {  // the zero padding of the last row
    if (fill != 0) {
      std::memset(row + fill, 0, kRow - fill);
      rows(row, nullptr, 1);
      fill = 0;
    }
  }
};

// a contiguous run of source bytes that lands at dst offset `at` (copied there when copy)
struct Segment {
  const uint8_t* src;
  size_t at;
  size_t len;
  bool copy;
};

// the fingerprint of the concatenated segments (total bytes), each copied to out + at when its
// copy flag is set; chunked over torch's intra-op threads, combined in order (see the top)
at::Tensor run_segments(const std::vector<Segment>& segs, uint8_t* out, size_t total) {
  const size_t nrows = (total + kRow - 1) / kRow;
  const int64_t threads = at::in_parallel_region() || total < kMinParallel ? 1 : at::get_num_threads();
  size_t rows_per_chunk = std::max<size_t>(nrows, 1);
  if (threads > 1) {
    rows_per_chunk = std::max(kMinChunk, total / (threads * kChunksPerThread)) / kRow;
  }
  const int64_t nchunks = static_cast<int64_t>(std::max<size_t>(1, (nrows + rows_per_chunk - 1) / rows_per_chunk));
  std::vector<Fingerprint> parts(nchunks);
  std::vector<size_t> part_rows(nchunks, 0);
  auto work = [&](int64_t c) {
    size_t lo = std::min(total, static_cast<size_t>(c) * rows_per_chunk * kRow);
    size_t hi = std::min(total, (static_cast<size_t>(c) + 1) * rows_per_chunk * kRow);
    part_rows[c] = (hi - lo + kRow - 1) / kRow;
    Fingerprint& fp = parts[c];
    // first segment ending after lo
    auto it = std::upper_bound(segs.begin(), segs.end(), lo,
                               [](size_t v, const Segment& s) { return v < s.at + s.len; });
    for (; it != segs.end() && it->at < hi; ++it) {
      size_t p0 = std::max(lo, it->at), p1 = std::min(hi, it->at + it->len);
      if (p1 > p0) fp.feed(it->src + (p0 - it->at), it->copy ? out + p0 : nullptr, p1 - p0);
    }
    fp.pad();  // only the last chunk can end inside a row
  };
  if (nchunks == 1) {
    work(0);
  } else {  // each thread claims the next chunk until none is left (dynamic: a loaded core does less)
    std::atomic<int64_t> next{0};
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      for (int64_t c = next++; c < nchunks; c = next++) work(c);
    });
  }
  uint64_t s1[kLanes] = {0}, s2[kLanes] = {0};
  for (int64_t c = 0; c < nchunks; ++c) {
    const uint64_t n = part_rows[c];
    for (int l = 0; l < kLanes; ++l) {
      s2[l] += n * s1[l] + parts[c].s2[l];
      s1[l] += parts[c].s1[l];
    }
  }
  at::Tensor res = at::empty({2 * kLanes}, at::TensorOptions().dtype(at::kLong));
  std::memcpy(res.data_ptr<int64_t>(), s1, sizeof(s1));
  std::memcpy(res.data_ptr<int64_t>() + kLanes, s2, sizeof(s2));
  return res;
}

size_t nbytes(const at::Tensor& t) { return static_cast<size_t>(t.numel()) * t.element_size(); }

at::Tensor fingerprint_cpu(const at::Tensor& src) {
  TORCH_CHECK(src.is_contiguous(), "pfppo::fingerprint: src must be contiguous");
  std::vector<Segment> segs;
  size_t n = nbytes(src);
  if (n != 0) segs.push_back({static_cast<const uint8_t*>(src.data_ptr()), 0, n, false});
  return run_segments(segs, nullptr, n);
}

// true when every slab src[i] is contiguous (e.g. q/k/v cut out of a fused weight along dim 1)
bool slabs_contiguous(const at::Tensor& t) {
  if (t.dim() < 2) return false;
  int64_t expected = 1;
  for (int64_t d = t.dim() - 1; d >= 1; --d) {
    if (t.size(d) != 1 && t.stride(d) != expected) return false;
    expected *= t.size(d);
  }
  return true;
}

at::Tensor pack_fingerprint_cpu(const at::Tensor& dst, at::TensorList srcs) {
  TORCH_CHECK(dst.is_contiguous(), "pfppo::pack_fingerprint: dst must be contiguous");
  size_t total = 0;
  for (size_t i = 0; i < srcs.size(); ++i) {
    TORCH_CHECK(srcs[i].device().is_cpu(), "pfppo::pack_fingerprint: srcs[", i, "] is on ",
                srcs[i].device(), ", expected cpu");
    TORCH_CHECK(srcs[i].scalar_type() == dst.scalar_type(), "pfppo::pack_fingerprint: srcs[", i,
                "] is ", srcs[i].scalar_type(), ", dst is ", dst.scalar_type());
    total += nbytes(srcs[i]);
  }
  TORCH_CHECK(total == nbytes(dst), "pfppo::pack_fingerprint: srcs hold ", total,
              " bytes, dst holds ", nbytes(dst));
  uint8_t* out = static_cast<uint8_t*>(dst.data_ptr());
  at::Tensor flat = dst.view({-1});
  std::vector<Segment> segs;
  size_t at = 0;
  int64_t offset = 0;
  for (const at::Tensor& src : srcs) {
    size_t n = nbytes(src);
    const uint8_t* base = static_cast<const uint8_t*>(src.data_ptr());
    if (n == 0) {
    } else if (src.is_contiguous()) {
      segs.push_back({base, at, n, true});
    } else if (slabs_contiguous(src)) {  // one contiguous run per slab, still one fused pass
      size_t slab = n / src.size(0);
      size_t stride = static_cast<size_t>(src.stride(0)) * src.element_size();
      for (int64_t i = 0; i < src.size(0); ++i) segs.push_back({base + i * stride, at + i * slab, slab, true});
    } else {  // any other layout: ATen copies it first (below autograd), the fingerprint reads the copy
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      flat.narrow(0, offset, src.numel()).view(src.sizes()).copy_(src);
      segs.push_back({out + at, at, n, false});
    }
    at += n;
    offset += src.numel();
  }
  return run_segments(segs, out, total);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pfppo, m) {
  m.def("fingerprint(Tensor src) -> Tensor");
  m.def("pack_fingerprint(Tensor(a!) dst, Tensor[] srcs) -> Tensor");
}

TORCH_LIBRARY_IMPL(pfppo, CPU, m) {
  m.impl("fingerprint", &fingerprint_cpu);
  m.impl("pack_fingerprint", &pack_fingerprint_cpu);
}

// never differentiated: parameters that require grad go in as they are (no detach per tensor in
// Python) and the packed buffer is not marked as requiring grad
TORCH_LIBRARY_IMPL(pfppo, Autograd, m) {
  m.impl("fingerprint", torch::CppFunction::makeFallthrough());
  m.impl("pack_fingerprint", torch::CppFunction::makeFallthrough());
}

}  // namespace pfppo
