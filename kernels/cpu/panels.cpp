// Float32 products of a few rows y = x W^T (+ b) on the CPU, over the weight packed into 12-column panels
// (kernels/cpu_matvec.py): what a decode batch of 2 to a few dozen requests multiplies by every layer.
//
//   panels = pack_panels(weight)            // weight [N, K] float32 -> [1, N, K], the same values reordered
//   y = panel_linear(x, panels, bias?)      // x [M, K] float32 (unit column stride) -> [M, N]
//
// The packed layout: columns (output features) in panels of 12, each panel [K][12] (the 12 weights of one k
// side by side), the N % 12 last columns a narrower panel [K][N % 12]; the tensor keeps W's element count,
// shaped [1, N, K] so N and K travel with it and nothing mistakes it for a plain weight.
//
// x is transposed into [K][8 * ceil(rows / 8)] blocks of up to 24 rows, so the 8 lanes of a vector are 8 rows
// of x at one k. A tile holds 12 accumulators: rows in RV vectors (RV = 1, 2, 3 for 8, 16, 24 rows) times
// 12 / RV columns; each k costs RV loads of x, 12 / RV broadcasts of a weight and 12 multiply-adds, and
// every weight is read from memory once whatever the rows (a packed panel is one sequential stream, which
// the prefetchers keep ahead of). K goes in blocks of 256 so a panel's tiles reuse x's block from L1; the
// threads take chunks of 4 panels, all rows of x through each chunk before the next.
//
// Each output is one chain of fused multiply-adds over k = 0 .. K-1 in order, in whatever lane, tile or
// thread it lands: a row's result is the same bits alone or in any batch (batch-invariant), and the
// portable path (std::fma in the same order) gives the same bits as the AVX2 one.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define RS_PANELS_X86 1
#endif

namespace radixserve_cpu_paths {
bool avx512();  // matvec.cpp: the products' chosen path (use_matvec_isa switches it)
bool avx2();
}  // namespace radixserve_cpu_paths

namespace {

constexpr int64_t kPanel = 12;        // columns a full panel holds
constexpr int64_t kBlockRows = 24;    // rows of x a pass over a panel takes (3 vectors of 8)
constexpr int64_t kChunkPanels = 4;   // panels a thread finishes before writing their columns out
constexpr int64_t kKBlock = 256;      // k per block: x's block (at most 24 KiB) stays in L1
constexpr int64_t kPrefetchAhead = 256;  // weights ahead of the read (1 KiB of the panel's stream)

// Where panel p starts and how wide it is: full panels first, then the N % 12 tail.
struct PanelAt {
  int64_t offset;
  int64_t width;
};

inline PanelAt panel_at(int64_t p, int64_t n, int64_t k) {
  return {p * kPanel * k, std::min(kPanel, n - p * kPanel)};
}

// acc[c][m] (the panel's column c, row m of the block; mp rows a column) += x_block . W[k0 .. k0 + kl) for
// the columns of one panel; the first block starts from zero. The reference for the vector path.
void panel_portable(const float* xt, int64_t mp, const float* w, int64_t width, int64_t k0, int64_t kl,
                    float* acc) {
  for (int64_t c = 0; c < width; ++c) {
    for (int64_t m = 0; m < mp; ++m) {
      float a = k0 == 0 ? 0.0f : acc[c * mp + m];
      for (int64_t k = k0; k < k0 + kl; ++k) a = std::fma(xt[k * mp + m], w[k * width + c], a);
      acc[c * mp + m] = a;
    }
  }
}

#ifdef RS_PANELS_X86
// C columns (from w, a panel's column, `width` weights per k) times RV vectors of rows, k in [k0, k0 + kl).
template <int RV, int C>
__attribute__((target("avx2,fma"))) inline void tile_avx2(const float* xt, const float* w, int64_t width, int64_t k0,
                                                         int64_t kl, float* acc, bool prefetch) {
  constexpr int64_t mp = 8 * RV;
  __m256 a[RV][C];
#pragma GCC unroll 4
  for (int r = 0; r < RV; ++r) {
#pragma GCC unroll 12
    for (int c = 0; c < C; ++c) a[r][c] = k0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + c * mp + 8 * r);
  }
  const float* xk = xt + k0 * mp;
  const float* wk = w + k0 * width;
  for (int64_t k = 0; k < kl; ++k, xk += mp, wk += width) {
    if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(wk + kPrefetchAhead), _MM_HINT_T0);
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
__attribute__((target("avx2,fma"))) void panel_avx2(const float* xt, const float* w, int64_t width, int64_t k0,
                                                   int64_t kl, float* acc) {
  constexpr int C = 12 / RV;
  constexpr int64_t mp = 8 * RV;
  int64_t c = 0;
  for (; c + C <= width; c += C) tile_avx2<RV, C>(xt, w + c, width, k0, kl, acc + c * mp, c == 0);
  for (; c < width; ++c) tile_avx2<RV, 1>(xt, w + c, width, k0, kl, acc + c * mp, c == 0);
}
#endif

bool use_avx2() {
#ifdef RS_PANELS_X86
  return radixserve_cpu_paths::avx2() || radixserve_cpu_paths::avx512();  // every AVX-512F CPU has AVX2 + FMA
#else
  return false;
#endif
}

void panel_block(const float* xt, int64_t mp, const float* w, int64_t width, int64_t k, float* acc, bool avx2) {
  for (int64_t k0 = 0; k0 < k; k0 += kKBlock) {
    const int64_t kl = std::min(kKBlock, k - k0);
#ifdef RS_PANELS_X86
    if (avx2) {
      if (mp == 8) panel_avx2<1>(xt, w, width, k0, kl, acc);
      else if (mp == 16) panel_avx2<2>(xt, w, width, k0, kl, acc);
      else panel_avx2<3>(xt, w, width, k0, kl, acc);
      continue;
    }
#endif
    (void)avx2;
    panel_portable(xt, mp, w, width, k0, kl, acc);
  }
}

void check_float_cpu(const char* what, const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, "panel_linear: ", what,
              " must be a float32 CPU tensor, got ", t.scalar_type(), " on ", t.device());
}

at::Tensor pack_panels(const at::Tensor& weight) {
  check_float_cpu("weight", weight);
  TORCH_CHECK(weight.dim() == 2, "pack_panels: weight must be [N, K], got ", weight.sizes());
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), panels = (n + kPanel - 1) / kPanel;
  at::Tensor out = at::empty({1, n, k}, w.options());
  const float* src = w.const_data_ptr<float>();
  float* dst = out.mutable_data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const PanelAt at_p = panel_at(p, n, k);
      for (int64_t c = 0; c < at_p.width; ++c) {
        const float* row = src + (p * kPanel + c) * k;
        for (int64_t j = 0; j < k; ++j) dst[at_p.offset + j * at_p.width + c] = row[j];
      }
    }
  });
  return out;
}

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, const c10::optional<at::Tensor>& bias) {
  check_float_cpu("x", x);
  check_float_cpu("panels", panels);
  TORCH_CHECK(panels.dim() == 3 && panels.size(0) == 1 && panels.is_contiguous(),
              "panel_linear: panels must be pack_panels' contiguous [1, N, K], got ", panels.sizes());
  const int64_t n = panels.size(1), k = panels.size(2);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "panel_linear: x must be [M, ", k, "], got ", x.sizes());
  const float* bp = nullptr;
  at::Tensor b;
  if (bias.has_value()) {
    check_float_cpu("bias", *bias);
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "panel_linear: bias must be [", n, "], got ", bias->sizes());
    b = bias->contiguous();
    bp = b.const_data_ptr<float>();
  }
  const int64_t m = x.size(0);
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return y;
  if (k == 0) return bias.has_value() ? y.copy_(b.expand({m, n})) : y.zero_();

  // x transposed, block by block of up to 24 rows: block j at offsets[j], [k][mps[j]], zero past the rows.
  const int64_t blocks = (m + kBlockRows - 1) / kBlockRows;
  std::vector<int64_t> offsets(blocks + 1, 0), mps(blocks);
  for (int64_t j = 0; j < blocks; ++j) {
    mps[j] = 8 * ((std::min(kBlockRows, m - j * kBlockRows) + 7) / 8);
    offsets[j + 1] = offsets[j] + k * mps[j];
  }
  const bool avx2 = use_avx2();
  std::vector<float> xt(offsets[blocks], 0.0f);
  const float* xp = x.const_data_ptr<float>();
  const int64_t xs = x.stride(0), xcs = x.stride(1);
  for (int64_t j = 0; j < blocks; ++j) {
    const int64_t rows = std::min(kBlockRows, m - j * kBlockRows);
    float* dst = xt.data() + offsets[j];
#ifdef RS_PANELS_X86
    if (avx2 && xcs == 1) {
      transpose_rows_avx2(xp + j * kBlockRows * xs, xs, rows, k, dst, mps[j]);
      continue;
    }
#endif
    for (int64_t r = 0; r < rows; ++r) {
      const float* row = xp + (j * kBlockRows + r) * xs;
      for (int64_t i = 0; i < k; ++i) dst[i * mps[j] + r] = row[i * xcs];
    }
  }

  const float* wp = panels.const_data_ptr<float>();
  float* yp = y.mutable_data_ptr<float>();
  const int64_t num_panels = (n + kPanel - 1) / kPanel;
  const int64_t chunks = (num_panels + kChunkPanels - 1) / kChunkPanels;
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    std::vector<float> acc(kChunkPanels * kPanel * kBlockRows);
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t p0 = c * kChunkPanels, p1 = std::min(num_panels, p0 + kChunkPanels);
      const int64_t n0 = p0 * kPanel, n1 = std::min(n, p1 * kPanel);
      for (int64_t j = 0; j < blocks; ++j) {
        const int64_t mp = mps[j];
        for (int64_t p = p0; p < p1; ++p) {
          const PanelAt at_p = panel_at(p, n, k);
          panel_block(xt.data() + offsets[j], mp, wp + at_p.offset, at_p.width, k, acc.data() + (p - p0) * kPanel * mp,
                      avx2);
        }
        const int64_t r0 = j * kBlockRows, rows = std::min(kBlockRows, m - r0);
#ifdef RS_PANELS_X86
        if (avx2) {
          write_rows_avx2(acc.data(), mp, rows, n0, n1, bp, yp + r0 * n, n);
          continue;
        }
#endif
        for (int64_t r = 0; r < rows; ++r) {
          float* out = yp + (r0 + r) * n;
          for (int64_t col = n0; col < n1; ++col) {
            const float v = acc[(col - n0) * mp + r];
            out[col] = bp != nullptr ? v + bp[col] : v;
          }
        }
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def("pack_panels(Tensor weight) -> Tensor");
  m.def("panel_linear(Tensor x, Tensor panels, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) {
  m.impl("pack_panels", &pack_panels);
  m.impl("panel_linear", &panel_linear);
}
