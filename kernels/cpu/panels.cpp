// Products of a few rows y = x W^T (+ b) on the CPU, float32 or bfloat16, over the weight packed into 12-column
// panels (kernels/cpu_matvec.py): what a decode batch of 2 to a few dozen requests multiplies by every layer.
//
//   panels = pack_panels(weight)            // weight [N, K] float32 or bfloat16 -> [1, N, K], the values reordered
//   y = panel_linear(x, panels, bias?)      // x [M, K] of the panels' dtype (unit column stride) -> [M, N]
//
// The packed layout: columns (output features) in panels of 12, each panel [K][12] (the 12 weights of one k
// side by side), the N % 12 last columns a narrower panel [K][N % 12]; the tensor keeps W's element count,
// shaped [1, N, K] so N and K travel with it and nothing mistakes it for a plain weight.
//
// x is transposed into [K][8 * ceil(rows / 8)] float32 blocks of up to 24 rows, so the 8 lanes of a vector are
// 8 rows of x at one k. A tile holds 12 accumulators: rows in RV vectors (RV = 1, 2, 3 for 8, 16, 24 rows)
// times 12 / RV columns; each k costs RV loads of x, 12 / RV broadcasts of a weight and 12 multiply-adds, and
// every weight is read from memory once whatever the rows (a packed panel is one sequential stream, which
// the prefetchers keep ahead of). On AVX-512 a block takes up to 32 rows, past 8 of them in 16-row vectors:
// tiles of RV = 1, 2 vectors times the panel's 12 columns, each multiply-add taking its weight as a broadcast
// memory operand (the AVX2 tiles serve blocks of at most 8 rows there). K goes in blocks of 256 so a panel's
// tiles reuse x's block from L1; the threads take chunks of 4 panels, all rows of x through each chunk before
// the next (or, where a rank gave cores back, claim them with its row helpers, kernels/cpu/row_helpers.h, which
// the caller never waits for). A bfloat16 panel's block is widened to float32 (exact) into an L1 buffer first and read from
// there, so it streams half the bytes.
//
// Pair panels (bfloat16, an even K): pack_panels(weight, pairs=True) -> [2, N, K / 2], each panel [K / 2][12]
// 32-bit words, the column's weights at k = 2q, 2q + 1 side by side; x's rows are read as such pairs too.
// Where the CPU runs vdpbf16ps (AVX512-BF16) and the path is AVX-512, a tile's instruction does the 16 rows'
// two multiply-adds at once (twice a float32 FMA's, over half the bytes); elsewhere a portable copy of its
// arithmetic (odd k then even, each a fused multiply-add, denormals read as zero and flushed) gives the same
// bits. Batch-invariant as the panels are.
//
// Each output is one chain of fused multiply-adds over k = 0 .. K-1 in order, in whatever lane, tile or
// thread it lands: a row's result is the same bits alone or in any batch (batch-invariant), and the
// portable path (std::fma in the same order) gives the same bits as the AVX2 and AVX-512 ones. A bfloat16
// product is the float32 product of the widened rows and weights (plus the widened bias), rounded to
// bfloat16 once.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define RS_PANELS_X86 1
#endif

#include "bf16.h"
#include "chunk_shares.h"
#include "row_helpers.h"

namespace radixserve_cpu_paths {
bool avx512();  // matvec.cpp: the products' chosen path (use_matvec_isa switches it)
bool avx2();
}  // namespace radixserve_cpu_paths

namespace {

using radixserve_cpu_bf16::bf16_to_float;

constexpr int64_t kPanel = 12;        // columns a full panel holds
constexpr int64_t kBlockRows = 24;     // rows of x a pass over a panel takes (3 vectors of 8)
constexpr int64_t kBlockRows512 = 32;  // on AVX-512 (2 vectors of 16)
constexpr int64_t kChunkPanels = 4;   // panels a thread finishes before writing their columns out
constexpr int64_t kKBlock = 256;      // k per block: x's block (at most 24 KiB) stays in L1
constexpr int64_t kPrefetchAhead = 1024;  // weights ahead of the read (4 KiB of the panel's stream; 1 KiB was
                                          // 1-3 ms slower a 16-row pass on a Zen 4 guest, both paths)

// Where panel p starts and how wide it is: full panels first, then the N % 12 tail.
struct PanelAt {
  int64_t offset;
  int64_t width;
};

inline PanelAt panel_at(int64_t p, int64_t n, int64_t k) {
  return {p * kPanel * k, std::min(kPanel, n - p * kPanel)};
}

// acc[c][m] (the panel's column c, row m of the block; mp rows a column) += x's block . the panel's block of
// kl k (xk, wk: both at the block's first k), from zero unless `accumulate`. The reference for the vector path.
void panel_portable(const float* xk, int64_t mp, const float* wk, int64_t width, int64_t kl, float* acc,
                    bool accumulate) {
  for (int64_t c = 0; c < width; ++c) {
    for (int64_t m = 0; m < mp; ++m) {
      float a = accumulate ? acc[c * mp + m] : 0.0f;
      for (int64_t k = 0; k < kl; ++k) a = std::fma(xk[k * mp + m], wk[k * width + c], a);
      acc[c * mp + m] = a;
    }
  }
}

#ifdef RS_PANELS_X86
// C columns (from wk, a panel's column at the block's first k, `width` weights per k) times RV vectors of rows
// (xk, x's block at the same k), kl k; the block's sums start from acc where `accumulate`, else from zero.
// With pf, each k also asks for the line at pf + k * pf_step (the weights to come).
template <int RV, int C>
__attribute__((target("avx2,fma"))) inline void tile_avx2(const float* xk, const float* wk, int64_t width, int64_t kl,
                                                         float* acc, bool accumulate, const char* pf, int64_t pf_step) {
  constexpr int64_t mp = 8 * RV;
  __m256 a[RV][C];
#pragma GCC unroll 4
  for (int r = 0; r < RV; ++r) {
#pragma GCC unroll 12
    for (int c = 0; c < C; ++c) a[r][c] = accumulate ? _mm256_loadu_ps(acc + c * mp + 8 * r) : _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < kl; ++k, xk += mp, wk += width) {
    if (pf != nullptr) _mm_prefetch(pf + k * pf_step, _MM_HINT_T0);
    __m256 xv[RV];
#pragma GCC unroll 4
    for (int r = 0; r < RV; ++r) xv[r] = _mm256_loadu_ps(xk + 8 * r);
#pragma GCC unroll 12
    for (int c = 0; c < C; ++c) {
      const __m256 b = _mm256_broadcast_ss(wk + c);
#pragma GCC unroll 4
      for (int r = 0; r < RV; ++r) a[r][c] = _mm256_fmadd_ps(xv[r], b, a[r][c]);
    }
  }
#pragma GCC unroll 12
  for (int c = 0; c < C; ++c) {
#pragma GCC unroll 4
    for (int r = 0; r < RV; ++r) _mm256_storeu_ps(acc + c * mp + 8 * r, a[r][c]);
  }
}

// out[j] = lane j of each of v[0 .. 8): an 8 x 8 transpose in registers.
__attribute__((target("avx2,fma"))) inline void transpose8(const __m256* v, __m256* out) {
  const __m256 t0 = _mm256_unpacklo_ps(v[0], v[1]), t1 = _mm256_unpackhi_ps(v[0], v[1]);
  const __m256 t2 = _mm256_unpacklo_ps(v[2], v[3]), t3 = _mm256_unpackhi_ps(v[2], v[3]);
  const __m256 t4 = _mm256_unpacklo_ps(v[4], v[5]), t5 = _mm256_unpackhi_ps(v[4], v[5]);
  const __m256 t6 = _mm256_unpacklo_ps(v[6], v[7]), t7 = _mm256_unpackhi_ps(v[6], v[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  out[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
  out[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  out[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
  out[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  out[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  out[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  out[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  out[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// dst [k][mp] = rows 0 .. rows of x (row stride xs, unit column stride) transposed, zero past them: eight
// rows by eight k at a time through transpose8, the k past the last eight one by one.
__attribute__((target("avx2,fma"))) void transpose_rows_avx2(const float* x, int64_t xs, int64_t rows, int64_t k,
                                                            float* dst, int64_t mp) {
  const int64_t k8 = k / 8 * 8;
  for (int64_t r8 = 0; r8 < mp; r8 += 8) {
    for (int64_t i = 0; i < k8; i += 8) {
      __m256 v[8], t[8];
      for (int j = 0; j < 8; ++j) v[j] = r8 + j < rows ? _mm256_loadu_ps(x + (r8 + j) * xs + i) : _mm256_setzero_ps();
      transpose8(v, t);
      for (int j = 0; j < 8; ++j) _mm256_storeu_ps(dst + (i + j) * mp + r8, t[j]);
    }
    for (int64_t i = k8; i < k; ++i) {
      for (int64_t j = 0; j < 8; ++j) dst[i * mp + r8 + j] = r8 + j < rows ? x[(r8 + j) * xs + i] : 0.0f;
    }
  }
}

// acc [cols][mp] (a chunk's columns n0 .. n1, each its mp rows) into out's rows 0 .. rows (row stride n), plus
// the bias where given: eight columns at a time through an 8 x 8 transpose in registers, the rest one by one.
__attribute__((target("avx2,fma"))) void write_rows_avx2(const float* acc, int64_t mp, int64_t rows, int64_t n0,
                                                        int64_t n1, const float* bias, float* out, int64_t n) {
  int64_t col = n0;
  for (; col + 8 <= n1; col += 8) {
    const float* a = acc + (col - n0) * mp;
    const __m256 b = bias != nullptr ? _mm256_loadu_ps(bias + col) : _mm256_setzero_ps();
    for (int64_t r8 = 0; r8 < rows; r8 += 8) {
      __m256 v[8];
      for (int i = 0; i < 8; ++i) v[i] = _mm256_loadu_ps(a + i * mp + r8);  // column col + i, rows r8 ..
      __m256 row[8];
      transpose8(v, row);
      const int64_t live = std::min<int64_t>(8, rows - r8);
      for (int64_t j = 0; j < live; ++j) {
        const __m256 y = bias != nullptr ? _mm256_add_ps(row[j], b) : row[j];
        _mm256_storeu_ps(out + (r8 + j) * n + col, y);
      }
    }
  }
  for (; col < n1; ++col) {
    for (int64_t r = 0; r < rows; ++r) {
      const float v = acc[(col - n0) * mp + r];
      out[r * n + col] = bias != nullptr ? v + bias[col] : v;
    }
  }
}

template <int RV>
__attribute__((target("avx2,fma"))) void panel_avx2(const float* xk, const float* wk, int64_t width, int64_t kl,
                                                   float* acc, bool accumulate, const char* pf, int64_t pf_step) {
  constexpr int C = 12 / RV;
  constexpr int64_t mp = 8 * RV;
  int64_t c = 0;  // the first tile alone asks for the weights to come
  for (; c + C <= width; c += C) {
    tile_avx2<RV, C>(xk, wk + c, width, kl, acc + c * mp, accumulate, c == 0 ? pf : nullptr, pf_step);
  }
  for (; c < width; ++c) tile_avx2<RV, 1>(xk, wk + c, width, kl, acc + c * mp, accumulate, c == 0 ? pf : nullptr, pf_step);
}

// AVX-512: RV vectors of 16 rows times C columns, each multiply-add taking its weight as a broadcast memory
// operand (no separate broadcast), 12 * RV of the 32 registers accumulating. The same chains as tile_avx2.
template <int RV, int C>
__attribute__((target("avx512f,fma"))) inline void tile_avx512(const float* xk, const float* wk, int64_t width,
                                                              int64_t kl, float* acc, bool accumulate, const char* pf,
                                                              int64_t pf_step) {
  constexpr int64_t mp = 16 * RV;
  __m512 a[RV][C];
#pragma GCC unroll 4
  for (int r = 0; r < RV; ++r) {
#pragma GCC unroll 12
    for (int c = 0; c < C; ++c) a[r][c] = accumulate ? _mm512_loadu_ps(acc + c * mp + 16 * r) : _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < kl; ++k, xk += mp, wk += width) {
    if (pf != nullptr) _mm_prefetch(pf + k * pf_step, _MM_HINT_T0);
    __m512 xv[RV];
#pragma GCC unroll 4
    for (int r = 0; r < RV; ++r) xv[r] = _mm512_loadu_ps(xk + 16 * r);
#pragma GCC unroll 12
    for (int c = 0; c < C; ++c) {
      const __m512 b = _mm512_set1_ps(wk[c]);
#pragma GCC unroll 4
      for (int r = 0; r < RV; ++r) a[r][c] = _mm512_fmadd_ps(xv[r], b, a[r][c]);
    }
  }
#pragma GCC unroll 12
  for (int c = 0; c < C; ++c) {
#pragma GCC unroll 4
    for (int r = 0; r < RV; ++r) _mm512_storeu_ps(acc + c * mp + 16 * r, a[r][c]);
  }
}

template <int RV>
__attribute__((target("avx512f,fma"))) void panel_avx512(const float* xk, const float* wk, int64_t width, int64_t kl,
                                                        float* acc, bool accumulate, const char* pf, int64_t pf_step) {
  constexpr int64_t mp = 16 * RV;
  int64_t c = 0;
  for (; c + kPanel <= width; c += kPanel) {
    tile_avx512<RV, kPanel>(xk, wk + c, width, kl, acc + c * mp, accumulate, c == 0 ? pf : nullptr, pf_step);
  }
  for (; c < width; ++c) tile_avx512<RV, 1>(xk, wk + c, width, kl, acc + c * mp, accumulate, c == 0 ? pf : nullptr, pf_step);
}

// count bfloat16 weights widened to float32 (exact) into dst.
__attribute__((target("avx2,fma"))) void widen_avx2(const uint16_t* src, int64_t count, float* dst) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
  }
  for (; i < count; ++i) dst[i] = bf16_to_float(src[i]);
}

// bfloat16 pair panels (AVX512-BF16): a vector's 16 lanes are 16 rows of x, each lane the pair of x's bfloat16
// values at k = 2q, 2q + 1; each weight operand is the column's pair at the same k, broadcast. vdpbf16ps adds
// the odd k's product, then the even one's, each a fused multiply-add (the products of two bfloat16 are exact
// in float32), inputs denormal-as-zero and results flushed to zero: twice the multiply-adds of a float32 FMA
// an instruction, over half the bytes.
template <int RV, int C>
__attribute__((target("avx512f,avx512bf16"))) inline void tile_pairs(const uint32_t* xq, const uint32_t* wq,
                                                                    int64_t width, int64_t ql, float* acc,
                                                                    bool accumulate, const char* pf,
                                                                    int64_t pf_step) {
  constexpr int64_t mp = 16 * RV;
  __m512 a[RV][C];
#pragma GCC unroll 4
  for (int r = 0; r < RV; ++r) {
#pragma GCC unroll 12
    for (int c = 0; c < C; ++c) a[r][c] = accumulate ? _mm512_loadu_ps(acc + c * mp + 16 * r) : _mm512_setzero_ps();
  }
  for (int64_t q = 0; q < ql; ++q, xq += mp, wq += width) {
    if (pf != nullptr) _mm_prefetch(pf + q * pf_step, _MM_HINT_T0);
    __m512bh xv[RV];
#pragma GCC unroll 4
    for (int r = 0; r < RV; ++r) xv[r] = (__m512bh)_mm512_loadu_si512(xq + 16 * r);
#pragma GCC unroll 12
    for (int c = 0; c < C; ++c) {
      const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(wq[c]));
#pragma GCC unroll 4
      for (int r = 0; r < RV; ++r) a[r][c] = _mm512_dpbf16_ps(a[r][c], xv[r], b);
    }
  }
#pragma GCC unroll 12
  for (int c = 0; c < C; ++c) {
#pragma GCC unroll 4
    for (int r = 0; r < RV; ++r) _mm512_storeu_ps(acc + c * mp + 16 * r, a[r][c]);
  }
}

template <int RV>
__attribute__((target("avx512f,avx512bf16"))) void panel_pairs(const uint32_t* xq, const uint32_t* wq, int64_t width,
                                                              int64_t ql, float* acc, bool accumulate, const char* pf,
                                                              int64_t pf_step) {
  constexpr int64_t mp = 16 * RV;
  int64_t c = 0;
  for (; c + kPanel <= width; c += kPanel) {
    tile_pairs<RV, kPanel>(xq, wq + c, width, ql, acc + c * mp, accumulate, c == 0 ? pf : nullptr, pf_step);
  }
  for (; c < width; ++c) tile_pairs<RV, 1>(xq, wq + c, width, ql, acc + c * mp, accumulate, c == 0 ? pf : nullptr, pf_step);
}
#endif

// The kernels a product takes: the chosen path of matvec.cpp (use_matvec_isa switches it).
enum class Path { kPortable, kAvx2, kAvx512 };

Path chosen_path() {
#ifdef RS_PANELS_X86
  if (radixserve_cpu_paths::avx512()) return Path::kAvx512;
  if (radixserve_cpu_paths::avx2()) return Path::kAvx2;
#endif
  return Path::kPortable;
}

// Whether this CPU runs vdpbf16ps (AVX512-BF16) and the chosen path is AVX-512 (use_matvec_isa switches it).
bool use_pairs_avx512() {
#ifdef RS_PANELS_X86
  static const bool has = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512f");
  return has && chosen_path() == Path::kAvx512;
#else
  return false;
#endif
}

// vdpbf16ps' arithmetic in portable C++: float32 fused multiply-adds, the odd k's then the even one's,
// denormal inputs read as zero and denormal results flushed to zero.
inline float daz(float v) { return std::fpclassify(v) == FP_SUBNORMAL ? std::copysign(0.0f, v) : v; }

inline float dp_pair(float acc, uint32_t xp, uint32_t wp) {
  const float x0 = daz(bf16_to_float(static_cast<uint16_t>(xp))), x1 = daz(bf16_to_float(static_cast<uint16_t>(xp >> 16)));
  const float w0 = daz(bf16_to_float(static_cast<uint16_t>(wp))), w1 = daz(bf16_to_float(static_cast<uint16_t>(wp >> 16)));
  acc = daz(std::fma(x1, w1, daz(acc)));
  return daz(std::fma(x0, w0, acc));
}

// acc[c][m] (+)= the pair block's products, as panel_portable for pairs (xq: [ql][mp] pairs, wq: [ql][width]).
void pairs_portable(const uint32_t* xq, int64_t mp, const uint32_t* wq, int64_t width, int64_t ql, float* acc,
                    bool accumulate) {
  for (int64_t c = 0; c < width; ++c) {
    for (int64_t m = 0; m < mp; ++m) {
      float a = accumulate ? acc[c * mp + m] : 0.0f;
      for (int64_t q = 0; q < ql; ++q) a = dp_pair(a, xq[q * mp + m], wq[q * width + c]);
      acc[c * mp + m] = a;
    }
  }
}

// The float32 weights of a panel's block of `count` values: the block itself, or (bfloat16) widened into scratch.
const float* block_weights(const float* w, int64_t, float*, bool) { return w; }

const float* block_weights(const uint16_t* w, int64_t count, float* scratch, bool avx2) {
#ifdef RS_PANELS_X86
  if (avx2) {
    widen_avx2(w, count, scratch);
    return scratch;
  }
#endif
  (void)avx2;
  for (int64_t i = 0; i < count; ++i) scratch[i] = bf16_to_float(w[i]);
  return scratch;
}

// acc [width][mp] = x's block (xt, [k][mp]) times one panel (w, [k][width]), k in blocks of kKBlock; scratch
// holds kKBlock * kPanel floats (a bfloat16 panel's block widened).
// Prefetching, so the weights' stream overlaps the multiply-adds: a float32 block's tiles ask for the
// panel's weights kPrefetchAhead ahead of their reads; a bfloat16 block's (read from scratch) for the next
// block's source, row by row (the next panel's first block after a panel's last: panels lie in order).
template <typename W>
void panel_block(const float* xt, int64_t mp, const W* w, int64_t width, int64_t k, float* acc, float* scratch,
                 Path path) {
  constexpr bool plain = std::is_same_v<W, float>;
  const bool avx2 = path != Path::kPortable;  // every AVX-512F CPU has AVX2 + FMA
  for (int64_t k0 = 0; k0 < k; k0 += kKBlock) {
    const int64_t kl = std::min(kKBlock, k - k0);
    const float* xk = xt + k0 * mp;
    const float* wk = block_weights(w + k0 * width, kl * width, scratch, avx2);
#ifdef RS_PANELS_X86
    if (avx2) {
      const char* pf = plain ? reinterpret_cast<const char*>(wk + kPrefetchAhead)
                             : reinterpret_cast<const char*>(w + (k0 + kl) * width);
      const int64_t pf_step = width * static_cast<int64_t>(sizeof(W));
      if (path == Path::kAvx512 && mp % 16 == 0) {
        if (mp == 16) panel_avx512<1>(xk, wk, width, kl, acc, k0 > 0, pf, pf_step);
        else panel_avx512<2>(xk, wk, width, kl, acc, k0 > 0, pf, pf_step);
        continue;
      }
      if (mp == 8) panel_avx2<1>(xk, wk, width, kl, acc, k0 > 0, pf, pf_step);
      else if (mp == 16) panel_avx2<2>(xk, wk, width, kl, acc, k0 > 0, pf, pf_step);
      else panel_avx2<3>(xk, wk, width, kl, acc, k0 > 0, pf, pf_step);
      continue;
    }
#endif
    panel_portable(xk, mp, wk, width, kl, acc, k0 > 0);
  }
}

void check_cpu(const char* op, const char* what, const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu() && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16), op, ": ",
              what, " must be a float32 or bfloat16 CPU tensor, got ", t.scalar_type(), " on ", t.device());
}

template <typename T>
const T* elements(const at::Tensor& t) {
  return reinterpret_cast<const T*>(t.const_data_ptr());
}

template <typename T>
void pack(const at::Tensor& w, at::Tensor& out) {
  const int64_t n = w.size(0), k = w.size(1), panels = (n + kPanel - 1) / kPanel;
  const T* src = elements<T>(w);
  T* dst = reinterpret_cast<T*>(out.mutable_data_ptr());
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const PanelAt at_p = panel_at(p, n, k);
      for (int64_t c = 0; c < at_p.width; ++c) {
        const T* row = src + (p * kPanel + c) * k;
        for (int64_t j = 0; j < k; ++j) dst[at_p.offset + j * at_p.width + c] = row[j];
      }
    }
  });
}

at::Tensor pack_panels(const at::Tensor& weight, bool pairs) {
  check_cpu("pack_panels", "weight", weight);
  TORCH_CHECK(weight.dim() == 2, "pack_panels: weight must be [N, K], got ", weight.sizes());
  const at::Tensor w = weight.contiguous();
  if (pairs) {  // [2, N, K / 2]: the panels of k pairs, each pair one 32-bit word
    TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.size(1) % 2 == 0,
                "pack_panels: pairs need a bfloat16 weight with an even K, got ", w.scalar_type(), " ", w.sizes());
    at::Tensor out = at::empty({2, w.size(0), w.size(1) / 2}, w.options());
    if (w.size(1) > 0) pack<uint32_t>(w.view(at::kInt), out);  // K = 0: nothing to pack (nor to view)
    return out;
  }
  at::Tensor out = at::empty({1, w.size(0), w.size(1)}, w.options());
  if (w.scalar_type() == at::kFloat) pack<float>(w, out);
  else pack<uint16_t>(w, out);
  return out;
}

at::Tensor pair_product(const at::Tensor& x, const at::Tensor& panels, const float* bp);

template <typename W>
at::Tensor panel_product(const at::Tensor& x, const at::Tensor& panels, const float* bp);

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, const c10::optional<at::Tensor>& bias) {
  check_cpu("panel_linear", "x", x);
  check_cpu("panel_linear", "panels", panels);
  const at::ScalarType dtype = panels.scalar_type();
  const bool pairs = panels.dim() == 3 && panels.size(0) == 2 && dtype == at::kBFloat16;
  TORCH_CHECK(panels.dim() == 3 && (panels.size(0) == 1 || pairs) && panels.is_contiguous(),
              "panel_linear: panels must be pack_panels' contiguous [1, N, K] (or bfloat16 pairs [2, N, K / 2]), got ",
              panels.sizes());
  TORCH_CHECK(x.scalar_type() == dtype, "panel_linear: x (", x.scalar_type(), ") must have the panels' dtype (",
              dtype, ")");
  const int64_t n = panels.size(1), k = pairs ? 2 * panels.size(2) : panels.size(2);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "panel_linear: x must be [M, ", k, "], got ", x.sizes());
  at::Tensor b;  // float32: added to the float32 sums, before a bfloat16 result's one rounding
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == dtype && bias->device().is_cpu(),
                "panel_linear: bias must be a CPU tensor of the panels' dtype (", dtype, "), got ",
                bias->scalar_type());
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "panel_linear: bias must be [", n, "], got ", bias->sizes());
    b = bias->to(at::kFloat).contiguous();
  }
  const float* bp = bias.has_value() ? b.const_data_ptr<float>() : nullptr;
  if (dtype == at::kFloat) return panel_product<float>(x, panels, bp);
  // bfloat16 pairs: vdpbf16ps' sums (or their portable copy), rounded once.
  if (pairs) return pair_product(x, panels, bp).to(at::kBFloat16);
  // bfloat16: the rows widened (exact), float32 sums over the widened weights, the result rounded once.
  return panel_product<uint16_t>(x.to(at::kFloat), panels, bp).to(at::kBFloat16);
}

// A chunk's sums acc [cols][mp] (columns n0 .. n1) into out's rows 0 .. rows (row stride n), plus the bias
// where given: through the 8 x 8 register transposes where AVX2 runs, else one by one.
void write_rows(const float* acc, int64_t mp, int64_t rows, int64_t n0, int64_t n1, const float* bp, float* out,
                int64_t n, bool avx2) {
#ifdef RS_PANELS_X86
  if (avx2) {
    write_rows_avx2(acc, mp, rows, n0, n1, bp, out, n);
    return;
  }
#endif
  (void)avx2;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t col = n0; col < n1; ++col) {
      const float v = acc[(col - n0) * mp + r];
      out[r * n + col] = bp != nullptr ? v + bp[col] : v;
    }
  }
}

// y [m, n] = the bias in every row (or zeros): a product over K = 0.
void bias_rows(at::Tensor& y, const float* bp) {
  const int64_t n = y.size(1);
  float* yp = y.mutable_data_ptr<float>();
  for (int64_t i = 0; i < y.numel(); ++i) yp[i] = bp != nullptr ? bp[i % n] : 0.0f;
}

// A panel product for the row helpers (row_helpers.h): chunk c is the kChunkPanels panels from c * kChunkPanels,
// through every row block, into a thread's buffer (the blocks' sums side by side, then the k-block scratch and,
// for bfloat16 over several blocks, the chunk's widened weights), then written out as the threads' chunks are:
// the same arithmetic, so the same bits. Used up to kHelperMaxRows rows (a chunk's sums stay ~200 KB or less).
constexpr int64_t kHelperMaxRows = 1024;

struct PanelJob {
  const void* wp;
  bool narrow;  // bfloat16 panels (uint16_t), else float32
  const float* xt;
  const int64_t* offsets;
  const int64_t* mps;
  const int64_t* acc_at;  // block j's sums at acc_at[j] in a chunk's buffer; acc_at[blocks]: their total
  const float* bp;
  float* y;
  int64_t m, n, k, blocks, block_rows, num_panels;
  Path path;
  bool avx2;
};

// A job's inputs, kept until its slot is refilled (a late helper may still read them).
struct PanelSlot {
  at::Tensor panels;
  std::unique_ptr<float[]> xt;
  std::vector<int64_t> offsets, mps, acc_at;
  std::vector<float> bias;
  PanelJob job{};
};

std::array<PanelSlot, radixserve_cpu_helpers::RowHelpers::kSlots>& panel_slots() {
  static auto* slots = new std::array<PanelSlot, radixserve_cpu_helpers::RowHelpers::kSlots>();
  return *slots;
}

// Chunk c's panels widened to float32 into `wide` (bfloat16 over several row blocks: once, at most 4 * 12 * K
// floats, L2, which every block then reads as float32 panels, instead of each block widening them again).
// True where it did so.
bool widen_chunk(const PanelJob& j, int64_t c, float* wide) {
  if (!j.narrow || j.blocks < 2) return false;
  const int64_t p0 = c * kChunkPanels, p1 = std::min(j.num_panels, p0 + kChunkPanels);
  const int64_t n0 = p0 * kPanel, n1 = std::min(j.n, p1 * kPanel);
  block_weights(static_cast<const uint16_t*>(j.wp) + p0 * kPanel * j.k, (n1 - n0) * j.k, wide, j.avx2);
  return true;
}

// Row block b's sums over chunk c's panels into acc ([cols][mps[b]], panel after panel): the one arithmetic of
// both the threads' chunks and the helpers', so the same bits.
void chunk_block(const PanelJob& j, int64_t c, int64_t b, const float* wide, float* acc, float* scratch) {
  const int64_t p0 = c * kChunkPanels, p1 = std::min(j.num_panels, p0 + kChunkPanels);
  const int64_t mp = j.mps[b];
  const float* xb = j.xt + j.offsets[b];
  for (int64_t p = p0; p < p1; ++p) {
    const PanelAt at_p = panel_at(p, j.n, j.k);
    float* out = acc + (p - p0) * kPanel * mp;
    if (wide != nullptr) {
      panel_block(xb, mp, wide + (at_p.offset - p0 * kPanel * j.k), at_p.width, j.k, out, scratch, j.path);
    } else if (j.narrow) {
      panel_block(xb, mp, static_cast<const uint16_t*>(j.wp) + at_p.offset, at_p.width, j.k, out, scratch, j.path);
    } else {
      panel_block(xb, mp, static_cast<const float*>(j.wp) + at_p.offset, at_p.width, j.k, out, scratch, j.path);
    }
  }
}

// Row block b's sums of chunk c (acc) written into y's rows.
void write_block(const PanelJob& j, int64_t c, int64_t b, const float* acc) {
  const int64_t p0 = c * kChunkPanels, p1 = std::min(j.num_panels, p0 + kChunkPanels);
  const int64_t n0 = p0 * kPanel, n1 = std::min(j.n, p1 * kPanel);
  const int64_t r0 = b * j.block_rows;
  write_rows(acc, j.mps[b], std::min(j.block_rows, j.m - r0), n0, n1, j.bp, j.y + r0 * j.n, j.n, j.avx2);
}

// A helper's chunk: every block's sums side by side in the thread's buffer, then the k-block scratch and the
// widened weights; written out only by the thread that commits it.
void panel_chunk(const void* job, int64_t c, float* buf) {
  const PanelJob& j = *static_cast<const PanelJob*>(job);
  float* scratch = buf + j.acc_at[j.blocks];
  float* wide = scratch + kKBlock * kPanel;
  const bool widened = widen_chunk(j, c, wide);
  for (int64_t b = 0; b < j.blocks; ++b) chunk_block(j, c, b, widened ? wide : nullptr, buf + j.acc_at[b], scratch);
}

void panel_commit(const void* job, int64_t c, const float* buf) {
  const PanelJob& j = *static_cast<const PanelJob*>(job);
  for (int64_t b = 0; b < j.blocks; ++b) write_block(j, c, b, buf + j.acc_at[b]);
}

// x (float32 [M, K]) times the panels (of W: float32, or bfloat16 as uint16_t) plus bp where given: [M, N] float32.
template <typename W>
at::Tensor panel_product(const at::Tensor& x, const at::Tensor& panels, const float* bp) {
  const int64_t n = panels.size(1), k = panels.size(2), m = x.size(0);
  at::Tensor y = at::empty({m, n}, x.options().dtype(at::kFloat));
  if (m == 0 || n == 0) return y;
  if (k == 0) {  // no products: the bias alone (or zeros)
    bias_rows(y, bp);
    return y;
  }

  // x transposed, block by block of up to 24 rows (AVX-512: 32): block j at offsets[j], [k][mps[j]], zero past
  // the rows; mps[j] a multiple of 8 (AVX-512: of 16 past 8 rows).
  const Path path = chosen_path();
  const bool avx2 = path != Path::kPortable;
  const int64_t block_rows = path == Path::kAvx512 ? kBlockRows512 : kBlockRows;
  const int64_t blocks = (m + block_rows - 1) / block_rows;
  std::vector<int64_t> offsets(blocks + 1, 0), mps(blocks);
  for (int64_t j = 0; j < blocks; ++j) {
    const int64_t rows = std::min(block_rows, m - j * block_rows);
    mps[j] = path == Path::kAvx512 && rows > 8 ? 16 * ((rows + 15) / 16) : 8 * ((rows + 7) / 8);
    offsets[j + 1] = offsets[j] + k * mps[j];
  }
  // Blocks transposed by the threads in turn (a prompt's rows are many blocks: one thread alone left the
  // others waiting for it before every product).
  std::unique_ptr<float[]> xt(new float[offsets[blocks]]);
  const float* xp = x.const_data_ptr<float>();
  const int64_t xs = x.stride(0), xcs = x.stride(1);
  at::parallel_for(0, blocks, 1, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t rows = std::min(block_rows, m - j * block_rows);
      float* dst = xt.get() + offsets[j];
#ifdef RS_PANELS_X86
      if (avx2 && xcs == 1) {  // writes the zeros past the rows too
        transpose_rows_avx2(xp + j * block_rows * xs, xs, rows, k, dst, mps[j]);
        continue;
      }
#endif
      std::fill(dst, dst + k * mps[j], 0.0f);
      for (int64_t r = 0; r < rows; ++r) {
        const float* row = xp + (j * block_rows + r) * xs;
        for (int64_t i = 0; i < k; ++i) dst[i * mps[j] + r] = row[i * xcs];
      }
    }
  });

  constexpr bool narrow = !std::is_same_v<W, float>;
  const int64_t num_panels = (n + kPanel - 1) / kPanel;
  const int64_t chunks = (num_panels + kChunkPanels - 1) / kChunkPanels;
  PanelJob job{elements<W>(panels), narrow, xt.get(), offsets.data(), mps.data(), nullptr, bp,
               y.mutable_data_ptr<float>(), m, n, k, blocks, block_rows, num_panels, path, avx2};
  radixserve_cpu_helpers::RowHelpers& helpers = radixserve_cpu_helpers::RowHelpers::get();
  if (helpers.count() > 0 && chunks >= 2 && m <= kHelperMaxRows && !at::in_parallel_region()) {
    std::vector<int64_t> acc_at(blocks + 1, 0);
    for (int64_t b = 0; b < blocks; ++b) acc_at[b + 1] = acc_at[b] + kChunkPanels * kPanel * mps[b];
    radixserve_cpu_helpers::Work work;
    work.chunks = chunks;
    work.buffer_floats = acc_at[blocks] + kKBlock * kPanel + (narrow && blocks > 1 ? kChunkPanels * kPanel * k : 0);
    work.compute = panel_chunk;
    work.commit = panel_commit;
    auto fill = [&](int s) -> const void* {
      PanelSlot& slot = panel_slots()[s];
      slot.panels = panels;  // held until the slot is refilled, as the rest
      slot.xt = std::move(xt);
      slot.offsets = offsets;
      slot.mps = mps;
      slot.acc_at = std::move(acc_at);
      if (bp != nullptr) slot.bias.assign(bp, bp + n);
      slot.job = job;
      slot.job.xt = slot.xt.get();
      slot.job.offsets = slot.offsets.data();
      slot.job.mps = slot.mps.data();
      slot.job.acc_at = slot.acc_at.data();
      slot.job.bp = bp != nullptr ? slot.bias.data() : nullptr;
      return &slot.job;
    };
    if (helpers.run(fill, work)) return y;  // else fill never ran: x's transpose is still here
  }
  // One share of the chunks a thread (at::parallel_for hands each thread one index of [0, teams)), each row
  // block's sums written out as soon as computed (one block's buffer, L1).
  const int64_t teams = std::min<int64_t>(at::get_num_threads(), chunks);
  radixserve_cpu_shares::ChunkShares shares(chunks, teams);
  at::parallel_for(0, teams, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> acc(kChunkPanels * kPanel * block_rows), scratch(kKBlock * kPanel);
    std::vector<float> wide(narrow && blocks > 1 ? kChunkPanels * kPanel * k : 0);
    for (int64_t t = t0; t < t1; ++t) {  // one index, or all of them where the region runs on this thread alone
      for (int64_t c = shares.next(t); c >= 0; c = shares.next(t)) {
        const bool widened = widen_chunk(job, c, wide.data());
        for (int64_t b = 0; b < blocks; ++b) {
          chunk_block(job, c, b, widened ? wide.data() : nullptr, acc.data(), scratch.data());
          write_block(job, c, b, acc.data());
        }
      }
    }
  });
  return y;
}

// x (bfloat16 [M, K]) times the pair panels ([2, N, K / 2]) plus bp where given: [M, N] float32 sums.
at::Tensor pair_product(const at::Tensor& x, const at::Tensor& panels, const float* bp) {
  const int64_t n = panels.size(1), kq = panels.size(2), m = x.size(0);
  at::Tensor y = at::empty({m, n}, x.options().dtype(at::kFloat));
  if (m == 0 || n == 0) return y;
  if (kq == 0) {
    bias_rows(y, bp);
    return y;
  }
  // Rows as 32-bit pairs: unit column stride, an even row stride and 4-byte alignment, else a copy.
  const bool direct = x.stride(1) == 1 && x.stride(0) % 2 == 0 &&
                      reinterpret_cast<uintptr_t>(x.const_data_ptr()) % 4 == 0;
  const at::Tensor xc = direct ? x : x.contiguous();
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(xc.const_data_ptr());
  const int64_t xs = xc.stride(0) / 2;
  const bool simd = use_pairs_avx512();

  // x's pairs transposed, blocks of up to 32 rows: block j at offsets[j], [kq][mps[j]] (16 or 32), zero past rows.
  const int64_t blocks = (m + kBlockRows512 - 1) / kBlockRows512;
  std::vector<int64_t> offsets(blocks + 1, 0), mps(blocks);
  for (int64_t j = 0; j < blocks; ++j) {
    mps[j] = 16 * ((std::min(kBlockRows512, m - j * kBlockRows512) + 15) / 16);
    offsets[j + 1] = offsets[j] + kq * mps[j];
  }
  std::unique_ptr<uint32_t[]> xt(new uint32_t[offsets[blocks]]);
  at::parallel_for(0, blocks, 1, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      const int64_t rows = std::min(kBlockRows512, m - j * kBlockRows512);
      uint32_t* dst = xt.get() + offsets[j];
#ifdef RS_PANELS_X86
      if (simd) {  // 32-bit moves only: the float transposition carries the pairs' bits
        transpose_rows_avx2(reinterpret_cast<const float*>(xp + j * kBlockRows512 * xs), xs, rows, kq,
                            reinterpret_cast<float*>(dst), mps[j]);
        continue;
      }
#endif
      std::fill(dst, dst + kq * mps[j], 0u);
      for (int64_t r = 0; r < rows; ++r) {
        const uint32_t* row = xp + (j * kBlockRows512 + r) * xs;
        for (int64_t i = 0; i < kq; ++i) dst[i * mps[j] + r] = row[i];
      }
    }
  });

  const uint32_t* wp = reinterpret_cast<const uint32_t*>(panels.const_data_ptr());
  float* yp = y.mutable_data_ptr<float>();
  constexpr int64_t kPairBlock = kKBlock / 2;  // pairs of k per block
  const int64_t num_panels = (n + kPanel - 1) / kPanel;
  const int64_t chunks = (num_panels + kChunkPanels - 1) / kChunkPanels;
  const int64_t teams = std::min<int64_t>(at::get_num_threads(), chunks);
  radixserve_cpu_shares::ChunkShares shares(chunks, teams);
  at::parallel_for(0, teams, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> acc(kChunkPanels * kPanel * kBlockRows512);
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t c = shares.next(t); c >= 0; c = shares.next(t)) {
        const int64_t p0 = c * kChunkPanels, p1 = std::min(num_panels, p0 + kChunkPanels);
        const int64_t n0 = p0 * kPanel, n1 = std::min(n, p1 * kPanel);
        for (int64_t j = 0; j < blocks; ++j) {
          const int64_t mp = mps[j];
          for (int64_t p = p0; p < p1; ++p) {
            const PanelAt at_p = panel_at(p, n, kq);
            float* out = acc.data() + (p - p0) * kPanel * mp;
            for (int64_t q0 = 0; q0 < kq; q0 += kPairBlock) {
              const int64_t ql = std::min(kPairBlock, kq - q0);
              const uint32_t* xq = xt.get() + offsets[j] + q0 * mp;
              const uint32_t* wq = wp + at_p.offset + q0 * at_p.width;
#ifdef RS_PANELS_X86
              if (simd) {
                const char* pf = reinterpret_cast<const char*>(wq + kPrefetchAhead);
                const int64_t pf_step = at_p.width * static_cast<int64_t>(sizeof(uint32_t));
                if (mp == 16) panel_pairs<1>(xq, wq, at_p.width, ql, out, q0 > 0, pf, pf_step);
                else panel_pairs<2>(xq, wq, at_p.width, ql, out, q0 > 0, pf, pf_step);
                continue;
              }
#endif
              pairs_portable(xq, mp, wq, at_p.width, ql, out, q0 > 0);
            }
          }
          const int64_t r0 = j * kBlockRows512;
          write_rows(acc.data(), mp, std::min(kBlockRows512, m - r0), n0, n1, bp, yp + r0 * n, n, simd);
        }
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def("pack_panels(Tensor weight, bool pairs=False) -> Tensor");
  m.def("pair_panels_native() -> bool", &use_pairs_avx512);
  m.def("panel_linear(Tensor x, Tensor panels, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) {
  m.impl("pack_panels", &pack_panels);
  m.impl("panel_linear", &panel_linear);
}

namespace radixserve_cpu_panels {
void clear_helper_slots() {
  for (PanelSlot& slot : panel_slots()) slot = PanelSlot{};
}
}  // namespace radixserve_cpu_panels
