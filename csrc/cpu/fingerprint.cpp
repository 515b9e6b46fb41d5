// Refit byte fingerprint (pfppo_mega.rollout.weights.fingerprint): one pass that copies weight
// bytes into a refit bucket and checksums them while they are in registers.
//
// Definition (the torch fallback in pfppo_mega/rollout/weights.py computes the same 32 words):
// the bytes, zero-padded to a multiple of 128, are rows of 16 little-endian uint64 words
// w[j][l]; for rows j = 0 .. n-1 in order and every lane l: s1[l] += w[j][l]; s2[l] += s1[l]
// (mod 2^64). Result: int64 [32] = s1[0..15], s2[0..15]. Any single flipped bit changes s1; a
// reordering of words within a lane changes s2. (Fletcher-style, not cryptographic.)
//
// Ops (registered here as a fragment of the pfppo library, CPU only):
//   pfppo::fingerprint(Tensor src) -> Tensor
//   pfppo::pack_fingerprint(Tensor(a!) dst, Tensor[] srcs) -> Tensor   dst <- cat(srcs), fused
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace pfppo {
namespace {

constexpr int kLanes = 16;
constexpr size_t kRow = kLanes * sizeof(uint64_t);  // 128 bytes

// whole rows from src (copied to dst when dst is not null); an AVX2 clone is picked at load time
// where the CPU has it (the extension itself is built for baseline x86-64)
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target_clones("avx2", "default")))
#endif
void fingerprint_rows(uint64_t* s1, uint64_t* s2, const uint8_t* src, uint8_t* dst, size_t nrows) {
  uint64_t a[kLanes], b[kLanes];
  std::memcpy(a, s1, sizeof(a));
  std::memcpy(b, s2, sizeof(b));
  for (size_t r = 0; r < nrows; ++r) {
    uint64_t w[kLanes];
    std::memcpy(w, src + r * kRow, kRow);
    if (dst != nullptr) std::memcpy(dst + r * kRow, w, kRow);
    for (int l = 0; l < kLanes; ++l) {
      a[l] += w[l];
      b[l] += a[l];
    }
  }
  std::memcpy(s1, a, sizeof(a));
  std::memcpy(s2, b, sizeof(b));
}

struct Fingerprint {
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

  at::Tensor finish() {
    if (fill != 0) {
      std::memset(row + fill, 0, kRow - fill);
      rows(row, nullptr, 1);
      fill = 0;
    }
    at::Tensor out = at::empty({2 * kLanes}, at::TensorOptions().dtype(at::kLong));
    std::memcpy(out.data_ptr<int64_t>(), s1, sizeof(s1));
    std::memcpy(out.data_ptr<int64_t>() + kLanes, s2, sizeof(s2));
    return out;
  }
};

size_t nbytes(const at::Tensor& t) { return static_cast<size_t>(t.numel()) * t.element_size(); }

at::Tensor fingerprint_cpu(const at::Tensor& src) {
  TORCH_CHECK(src.is_contiguous(), "pfppo::fingerprint: src must be contiguous");
  Fingerprint fp;
  fp.feed(static_cast<const uint8_t*>(src.data_ptr()), nullptr, nbytes(src));
  return fp.finish();
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
  Fingerprint fp;
  uint8_t* out = static_cast<uint8_t*>(dst.data_ptr());
  at::Tensor flat = dst.view({-1});
  int64_t offset = 0;
  for (const at::Tensor& src : srcs) {
    size_t n = nbytes(src);
    if (src.is_contiguous()) {
      fp.feed(static_cast<const uint8_t*>(src.data_ptr()), out, n);
    } else {  // strided: ATen copies a slab of rows, checksummed while it is still in cache
      at::Tensor piece = flat.narrow(0, offset, src.numel()).view(src.sizes());
      int64_t dim0 = src.dim() == 0 ? 1 : src.size(0);
      int64_t per_row = dim0 == 0 ? 1 : std::max<int64_t>(1, src.numel() / dim0);
      int64_t step = std::max<int64_t>(1, (256 << 10) / (per_row * src.element_size()));
      if (src.dim() == 0) {
        piece.copy_(src);
        fp.feed(out, nullptr, n);
      } else {
        for (int64_t r = 0; r < dim0; r += step) {
          int64_t k = std::min(step, dim0 - r);
          piece.narrow(0, r, k).copy_(src.narrow(0, r, k));
          fp.feed(out + r * per_row * src.element_size(), nullptr,
                  static_cast<size_t>(k * per_row * src.element_size()));
        }
      }
    }
    out += n;
    offset += src.numel();
  }
  return fp.finish();
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

}  // namespace pfppo
