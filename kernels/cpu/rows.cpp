// A decoder layer's row-wise steps for a batch of rows on the CPU (decode batches and prefill chunks), float32
// or bfloat16, each one op where torch takes several: at batch 16 the elementwise ops between the products
// were ~30 torch calls a layer, whose dispatch, allocations and Python glue ran on one thread while the
// other compute thread waited (a third of a SmolLM2 decode step on a 2-vCPU host).
//
//   add_rmsnorm_rows(x, residual, w, eps) -> (norm(x + residual), x + residual)
//   rmsnorm_rows(x, w, eps)               -> norm(x)
//   qk_norm_rope_rows_(q, k, positions, cos, sin, q_norm?, k_norm?, eps, head_dim)
//                                           per-head RMSNorm (Qwen3) then neox RoPE of q and k, in place
//   store_kv_rows_(k, v, k_dst, v_dst, rows) k_dst[rows[i]] = k[i], v_dst[rows[i]] = v[i]
//   silu_mul_rows(gate_up)                -> silu(gate) * up for rows [gate | up]
//   argmax_rows(x)                        -> each float32 row's first index of its maximum (a NaN counts as
//                                            the maximum), as torch's max(dim).indices: greedy sampling
//
// The arithmetic is layers/layernorm.py's and layers/rotary.py's, step for step: RMSNorm is
// w * (h * (1 / sqrt(mean(h^2) + eps))) with the squares summed in double (as the single-row
// rmsnorm_matvec in matvec.cpp), and the rotation is x1 * cos - x2 * sin, x2 * cos + x1 * sin with each
// product rounded before the sum (the library builds with -ffp-contract=off, so no multiply-add is fused:
// the bits are torch's). SiLU is g / (1 + exp(-g)) then times up, as torch orders it; its exp is exp16.h's
// on AVX-512 and its 8-lane exp8 on AVX2 (the attention's softmax's too: within 2 ulp of torch's Sleef exp),
// std::exp elsewhere (the path follows use_matvec_isa). Rows go to the compute threads in bands; a decode
// batch's few rows are one band.
//
// bfloat16: every tensor of a call in bfloat16 (the cos / sin tables stay float32), each value widened exactly
// as read, the arithmetic in float32 as above, and a rounding to bfloat16 (nearest even, as torch rounds)
// wherever torch's bfloat16 ops store a result: the sum x + residual; h * inv, then w times it; cos and sin
// before the products, each product, each sum; silu(g), then times up. So each op is the torch ops of
// layers/ on bfloat16 tensors, up to the norm's sum of squares (double here, float32 there).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define RS_X86 1
#endif

#include "bf16.h"
#include "exp16.h"

namespace radixserve_cpu_paths {
bool avx512();  // matvec.cpp: whether the products' chosen path is AVX-512 (use_matvec_isa switches it)
bool avx2();    // ... or AVX2 + FMA
}  // namespace radixserve_cpu_paths

namespace {

// Rows per thread band: a batch-16 decode step's rows go to two threads (the other compute thread is
// spinning at the barrier the products left it at, so it starts at once).
constexpr int64_t kGrain = 8;

// Stored elements: float, or a bfloat16's 16 bits.
using bf16 = uint16_t;

using radixserve_cpu_bf16::keep;
using radixserve_cpu_bf16::put;
using radixserve_cpu_bf16::widen;

// The tensor's elements as T (float32 or bfloat16 bits).
template <typename T>
T* elements(const at::Tensor& t) {
  if constexpr (std::is_same_v<T, bf16>) {
    return reinterpret_cast<bf16*>(t.data_ptr<at::BFloat16>());
  } else {
    return t.data_ptr<float>();
  }
}

bool row_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16; }

const char* dtype_name(at::ScalarType t) { return t == at::kBFloat16 ? "bfloat16" : "float32"; }

// A float32 or bfloat16 CPU tensor of `dtype` (the call's: its first operand's) [rows, K] with contiguous rows.
void check_rows(const char* op, const char* what, const at::Tensor& t, int64_t k, at::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu() && row_dtype(t.scalar_type()) && t.scalar_type() == dtype, op, ": ", what,
              " must be a ", dtype_name(dtype), " CPU tensor (all of a call's float32, or all bfloat16), got ",
              t.scalar_type(), " on ", t.device());
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1 && (k < 0 || t.size(1) == k), op, ": ", what,
              " must be [rows, K] with contiguous rows", k >= 0 ? " and K = " + std::to_string(k) : "", ", got ",
              t.sizes(), " with strides ", t.strides());
}

void check_vector(const char* op, const char* what, const at::Tensor& t, int64_t k, at::ScalarType dtype) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.dim() == 1 && t.size(0) == k && t.stride(0) == 1,
              op, ": ", what, " must be a contiguous ", dtype_name(dtype), " CPU vector of ", k,
              " values (the rows' dtype), got ", t.scalar_type(), " ", t.sizes());
}

#ifdef RS_X86
// 16 lanes of T as float32: `live` lanes read, the rest zero (a bfloat16 tail goes through a copy: masked
// 16-bit loads would need AVX512BW).
__attribute__((target("avx512f"))) inline __m512 load16(const float* p, __mmask16 live) {
  return _mm512_maskz_loadu_ps(live, p);
}

__attribute__((target("avx512f"))) inline __m512 load16(const bf16* p, __mmask16 live) {
  __m256i h;
  if (live == 0xFFFF) {
    h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  } else {
    alignas(32) bf16 part[16] = {};
    for (int i = 0; i < 16; ++i) {
      if (live >> i & 1) part[i] = p[i];
    }
    h = _mm256_load_si256(reinterpret_cast<const __m256i*>(part));
  }
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// keep<T> on 16 lanes: as they are for float; rounded to bfloat16 (nearest even, NaN stays NaN) for bf16.
template <typename T>
__attribute__((target("avx512f"))) inline __m512 keep16(__m512 f) {
  if constexpr (std::is_same_v<T, bf16>) {
    const __m512i u = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    r = _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
    return _mm512_castsi512_ps(r);
  } else {
    return f;
  }
}

// Stores 16 lanes already kept as T (keep16<T>): `live` lanes only.
__attribute__((target("avx512f"))) inline void store16(float* p, __m512 v, __mmask16 live) {
  _mm512_mask_storeu_ps(p, live, v);
}

__attribute__((target("avx512f"))) inline void store16(bf16* p, __m512 kept, __mmask16 live) {
  const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(kept), 16));
  if (live == 0xFFFF) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
    return;
  }
  alignas(32) bf16 part[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(part), h);
  for (int i = 0; i < 16; ++i) {
    if (live >> i & 1) p[i] = part[i];
  }
}

inline __mmask16 lanes(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
}

// sum(h^2) in double, 16 values a step (each product is exact in double, so only the sums round).
template <typename T>
__attribute__((target("avx512f"))) double squares_avx512(const T* h, int64_t k) {
  __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    const __m512 x = load16(h + i, 0xFFFF);
    const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    const __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    a0 = _mm512_fmadd_pd(lo, lo, a0);
    a1 = _mm512_fmadd_pd(hi, hi, a1);
  }
  double s = _mm512_reduce_add_pd(_mm512_add_pd(a0, a1));
  for (; i < k; ++i) s += static_cast<double>(widen(h[i])) * widen(h[i]);
  return s;
}

// o = keep(w * keep(h * inv)) on 16 lanes at a time.
template <typename T>
__attribute__((target("avx512f"))) void scale_row_avx512(const T* h, const T* w, float inv, int64_t k, T* o) {
  const __m512 iv = _mm512_set1_ps(inv);
  for (int64_t i = 0; i < k; i += 16) {
    const __mmask16 live = lanes(k - i);
    const __m512 y = keep16<T>(_mm512_mul_ps(load16(h + i, live), iv));
    store16(o + i, keep16<T>(_mm512_mul_ps(load16(w + i, live), y)), live);
  }
}

// h = keep(x + r) on 16 lanes at a time.
template <typename T>
__attribute__((target("avx512f"))) void add_row_avx512(const T* x, const T* r, int64_t k, T* h) {
  for (int64_t i = 0; i < k; i += 16) {
    const __mmask16 live = lanes(k - i);
    store16(h + i, keep16<T>(_mm512_add_ps(load16(x + i, live), load16(r + i, live))), live);
  }
}

// The same steps on 8 lanes (AVX2 + FMA) over a row's full groups of 8; the last k % 8 values take the scalar
// steps (the same arithmetic, value by value).
__attribute__((target("avx2,fma"))) inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

__attribute__((target("avx2,fma"))) inline __m256 load8(const bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

template <typename T>
__attribute__((target("avx2,fma"))) inline __m256 keep8(__m256 f) {
  if constexpr (std::is_same_v<T, bf16>) {
    const __m256i u = _mm256_castps_si256(f);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
    r = _mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
    const __m256 nan = _mm256_cmp_ps(f, f, _CMP_UNORD_Q);
    return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), nan);
  } else {
    return f;
  }
}

__attribute__((target("avx2,fma"))) inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }

__attribute__((target("avx2,fma"))) inline void store8(bf16* p, __m256 kept) {
  const __m256i hi = _mm256_srli_epi32(_mm256_castps_si256(kept), 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(hi, hi), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

template <typename T>
__attribute__((target("avx2,fma"))) double squares_avx2(const T* h, int64_t k) {
  __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    const __m256 x = load8(h + i);
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
    const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    a0 = _mm256_fmadd_pd(lo, lo, a0);
    a1 = _mm256_fmadd_pd(hi, hi, a1);
  }
  alignas(32) double lanes4[4];
  _mm256_store_pd(lanes4, _mm256_add_pd(a0, a1));
  double s = (lanes4[0] + lanes4[2]) + (lanes4[1] + lanes4[3]);
  for (; i < k; ++i) s += static_cast<double>(widen(h[i])) * widen(h[i]);
  return s;
}

template <typename T>
__attribute__((target("avx2,fma"))) void scale_row_avx2(const T* h, const T* w, float inv, int64_t k, T* o) {
  const __m256 iv = _mm256_set1_ps(inv);
  const int64_t kv = k - k % 8;
  for (int64_t i = 0; i < kv; i += 8) {
    const __m256 y = keep8<T>(_mm256_mul_ps(load8(h + i), iv));
    store8(o + i, keep8<T>(_mm256_mul_ps(load8(w + i), y)));
  }
  for (int64_t i = kv; i < k; ++i) put(o + i, widen(w[i]) * keep<T>(widen(h[i]) * inv));
}

template <typename T>
__attribute__((target("avx2,fma"))) void add_row_avx2(const T* x, const T* r, int64_t k, T* h) {
  const int64_t kv = k - k % 8;
  for (int64_t i = 0; i < kv; i += 8) store8(h + i, keep8<T>(_mm256_add_ps(load8(x + i), load8(r + i))));
  for (int64_t i = kv; i < k; ++i) put(h + i, widen(x[i]) + widen(r[i]));
}
#endif

template <typename T>
double squares(const T* h, int64_t k) {
#ifdef RS_X86
  if (radixserve_cpu_paths::avx512()) return squares_avx512(h, k);
  if (radixserve_cpu_paths::avx2()) return squares_avx2(h, k);
#endif
  double s = 0.0;
  for (int64_t i = 0; i < k; ++i) s += static_cast<double>(widen(h[i])) * widen(h[i]);
  return s;
}

// o = w * (h * inv), inv = 1 / sqrt(mean(h^2) + eps), over k values (each product kept as T).
template <typename T>
void norm_row(const T* h, const T* w, float eps, int64_t k, T* o) {
  const double sum = squares(h, k);
  const float inv = 1.0f / std::sqrt(static_cast<float>(sum / k) + eps);
#ifdef RS_X86
  if (radixserve_cpu_paths::avx512()) return scale_row_avx512(h, w, inv, k, o);
  if (radixserve_cpu_paths::avx2()) return scale_row_avx2(h, w, inv, k, o);
#endif
  for (int64_t i = 0; i < k; ++i) put(o + i, widen(w[i]) * keep<T>(widen(h[i]) * inv));
}

// h = x + r, kept as T.
template <typename T>
void add_row(const T* x, const T* r, int64_t k, T* h) {
#ifdef RS_X86
  if (radixserve_cpu_paths::avx512()) return add_row_avx512(x, r, k, h);
  if (radixserve_cpu_paths::avx2()) return add_row_avx2(x, r, k, h);
#endif
  for (int64_t i = 0; i < k; ++i) put(h + i, widen(x[i]) + widen(r[i]));
}

template <typename T>
void add_rmsnorm_impl(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, float eps,
                      at::Tensor& normed, at::Tensor& sum) {
  const int64_t m = x.size(0), k = x.size(1), xs = x.stride(0), rs = residual.stride(0);
  const T *xp = elements<T>(x), *rp = elements<T>(residual), *wp = elements<T>(weight);
  T *np = elements<T>(normed), *sp = elements<T>(sum);
  at::parallel_for(0, m, kGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      add_row(xp + r * xs, rp + r * rs, k, sp + r * k);
      norm_row(sp + r * k, wp, eps, k, np + r * k);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> add_rmsnorm_rows(const at::Tensor& x, const at::Tensor& residual,
                                                    const at::Tensor& weight, double eps) {
  const at::ScalarType dtype = x.scalar_type();
  check_rows("add_rmsnorm_rows", "x", x, -1, dtype);
  const int64_t m = x.size(0), k = x.size(1);
  check_rows("add_rmsnorm_rows", "residual", residual, k, dtype);
  TORCH_CHECK(residual.size(0) == m, "add_rmsnorm_rows: residual has ", residual.size(0), " rows, x ", m);
  check_vector("add_rmsnorm_rows", "weight", weight, k, dtype);
  at::Tensor normed = at::empty({m, k}, x.options()), sum = at::empty({m, k}, x.options());
  if (dtype == at::kBFloat16) {
    add_rmsnorm_impl<bf16>(x, residual, weight, static_cast<float>(eps), normed, sum);
  } else {
    add_rmsnorm_impl<float>(x, residual, weight, static_cast<float>(eps), normed, sum);
  }
  return {normed, sum};
}

template <typename T>
void rmsnorm_impl(const at::Tensor& x, const at::Tensor& weight, float eps, at::Tensor& normed) {
  const int64_t m = x.size(0), k = x.size(1), xs = x.stride(0);
  const T *xp = elements<T>(x), *wp = elements<T>(weight);
  T* np = elements<T>(normed);
  at::parallel_for(0, m, kGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) norm_row(xp + r * xs, wp, eps, k, np + r * k);
  });
}

at::Tensor rmsnorm_rows(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const at::ScalarType dtype = x.scalar_type();
  check_rows("rmsnorm_rows", "x", x, -1, dtype);
  const int64_t m = x.size(0), k = x.size(1);
  check_vector("rmsnorm_rows", "weight", weight, k, dtype);
  at::Tensor normed = at::empty({m, k}, x.options());
  if (dtype == at::kBFloat16) {
    rmsnorm_impl<bf16>(x, weight, static_cast<float>(eps), normed);
  } else {
    rmsnorm_impl<float>(x, weight, static_cast<float>(eps), normed);
  }
  return normed;
}

// One head of head_dim values in place: RMSNorm by `norm` (nullptr: none), then the first 2 * half values
// rotated as neox pairs (i, i + half) by the position's cos / sin rows (kept as T first, as torch casts them).
template <typename T>
void head_norm_rope(T* x, const T* norm, float eps, int64_t head_dim, const float* c, const float* s, int64_t half,
                    T* scratch) {
  if (norm != nullptr) {
    norm_row(x, norm, eps, head_dim, scratch);
    std::memcpy(x, scratch, head_dim * sizeof(T));
  }
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = widen(x[i]), x2 = widen(x[i + half]), ci = keep<T>(c[i]), si = keep<T>(s[i]);
    const float a = keep<T>(x1 * ci), b = keep<T>(x2 * si), e = keep<T>(x2 * ci), f = keep<T>(x1 * si);
    put(x + i, a - b);
    put(x + i + half, e + f);
  }
}

template <typename T>
void qk_norm_rope_impl(at::Tensor& q, at::Tensor& k, const int64_t* pp, const at::Tensor& cos, const at::Tensor& sin,
                       const c10::optional<at::Tensor>& q_norm, const c10::optional<at::Tensor>& k_norm, float eps,
                       int64_t head_dim) {
  const int64_t m = q.size(0), half = cos.size(1);
  T *qp = elements<T>(q), *kp = elements<T>(k);
  const int64_t qs = q.stride(0), ks = k.stride(0), q_heads = q.size(1) / head_dim, kv_heads = k.size(1) / head_dim;
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  const T* qn = q_norm.has_value() ? elements<T>(*q_norm) : nullptr;
  const T* kn = k_norm.has_value() ? elements<T>(*k_norm) : nullptr;
  at::parallel_for(0, m, kGrain, [&](int64_t r0, int64_t r1) {
    std::vector<T> scratch(head_dim);
    for (int64_t r = r0; r < r1; ++r) {
      const float *c = cp + pp[r] * half, *s = sp + pp[r] * half;
      for (int64_t h = 0; h < q_heads; ++h) {
        head_norm_rope(qp + r * qs + h * head_dim, qn, eps, head_dim, c, s, half, scratch.data());
      }
      for (int64_t h = 0; h < kv_heads; ++h) {
        head_norm_rope(kp + r * ks + h * head_dim, kn, eps, head_dim, c, s, half, scratch.data());
      }
    }
  });
}

void qk_norm_rope_rows_(at::Tensor& q, at::Tensor& k, const at::Tensor& positions, const at::Tensor& cos,
                        const at::Tensor& sin, const c10::optional<at::Tensor>& q_norm,
                        const c10::optional<at::Tensor>& k_norm, double eps, int64_t head_dim) {
  const at::ScalarType dtype = q.scalar_type();
  check_rows("qk_norm_rope_rows_", "q", q, -1, dtype);
  check_rows("qk_norm_rope_rows_", "k", k, -1, dtype);
  const int64_t m = q.size(0);
  TORCH_CHECK(k.size(0) == m, "qk_norm_rope_rows_: q has ", m, " rows, k ", k.size(0));
  TORCH_CHECK(head_dim > 0 && q.size(1) % head_dim == 0 && k.size(1) % head_dim == 0,
              "qk_norm_rope_rows_: q rows of ", q.size(1), " and k rows of ", k.size(1),
              " values are not whole heads of ", head_dim);
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.dim() == 2 &&
                  sin.sizes() == cos.sizes() && cos.is_contiguous() && sin.is_contiguous() && cos.device().is_cpu() &&
                  sin.device().is_cpu(),
              "qk_norm_rope_rows_: cos and sin must be contiguous float32 CPU tables [positions, rotary_dim / 2]");
  const int64_t half = cos.size(1), table = cos.size(0);
  TORCH_CHECK(2 * half <= head_dim, "qk_norm_rope_rows_: rotary_dim ", 2 * half, " exceeds head_dim ", head_dim);
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.size(0) == m &&
                  positions.device().is_cpu(),
              "qk_norm_rope_rows_: positions must be int64 [", m, "], got ", positions.scalar_type(), " ",
              positions.sizes());
  if (q_norm.has_value()) check_vector("qk_norm_rope_rows_", "q_norm", *q_norm, head_dim, dtype);
  if (k_norm.has_value()) check_vector("qk_norm_rope_rows_", "k_norm", *k_norm, head_dim, dtype);
  const at::Tensor pos = positions.contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t r = 0; r < m; ++r) {
    TORCH_CHECK(pp[r] >= 0 && pp[r] < table, "qk_norm_rope_rows_: position ", pp[r], " of row ", r,
                " is outside the rotary table's ", table);
  }
  const float e = static_cast<float>(eps);
  if (dtype == at::kBFloat16) {
    qk_norm_rope_impl<bf16>(q, k, pp, cos, sin, q_norm, k_norm, e, head_dim);
  } else {
    qk_norm_rope_impl<float>(q, k, pp, cos, sin, q_norm, k_norm, e, head_dim);
  }
}

void store_kv_rows_(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_dst, at::Tensor& v_dst,
                    const at::Tensor& rows) {
  const at::ScalarType dtype = k.scalar_type();
  check_rows("store_kv_rows_", "k", k, -1, dtype);
  const int64_t m = k.size(0), width = k.size(1);
  check_rows("store_kv_rows_", "v", v, width, dtype);
  TORCH_CHECK(v.size(0) == m, "store_kv_rows_: k has ", m, " rows, v ", v.size(0));
  for (const at::Tensor* dst : {&k_dst, &v_dst}) {
    TORCH_CHECK(dst->device().is_cpu() && dst->scalar_type() == dtype && dst->is_contiguous() && dst->dim() >= 2 &&
                    dst->numel() % width == 0 && dst->numel() / dst->size(0) == width,
                "store_kv_rows_: k_dst and v_dst must be contiguous ", dtype_name(dtype),
                " CPU tensors (k's dtype) of rows of ", width, " values, got ", dst->scalar_type(), " ",
                dst->sizes());
  }
  TORCH_CHECK(v_dst.size(0) == k_dst.size(0), "store_kv_rows_: k_dst and v_dst differ in rows");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.size(0) == m && rows.device().is_cpu(),
              "store_kv_rows_: rows must be int64 [", m, "], got ", rows.scalar_type(), " ", rows.sizes());
  const at::Tensor idx = rows.contiguous();
  const int64_t* ip = idx.data_ptr<int64_t>();
  const int64_t limit = k_dst.size(0);
  for (int64_t r = 0; r < m; ++r) {
    TORCH_CHECK(ip[r] >= 0 && ip[r] < limit, "store_kv_rows_: row ", ip[r], " is outside the destination's ", limit);
  }
  const int64_t size = k.element_size();
  const char *kp = static_cast<const char*>(k.data_ptr()), *vp = static_cast<const char*>(v.data_ptr());
  char *kd = static_cast<char*>(k_dst.data_ptr()), *vd = static_cast<char*>(v_dst.data_ptr());
  const int64_t ks = k.stride(0) * size, vs = v.stride(0) * size, bytes = width * size;
  at::parallel_for(0, m, 4 * kGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      std::memcpy(kd + ip[r] * bytes, kp + r * ks, bytes);
      std::memcpy(vd + ip[r] * bytes, vp + r * vs, bytes);
    }
  });
}

#ifdef RS_X86
template <typename T>
__attribute__((target("avx512f"))) void silu_mul_row_avx512(const T* g, const T* u, T* o, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 live = lanes(n - i);
    const __m512 gv = load16(g + i, live), uv = load16(u + i, live);
    const __m512 e = radixserve_cpu_vec::exp16(_mm512_sub_ps(zero, gv));
    const __m512 silu = keep16<T>(_mm512_div_ps(gv, _mm512_add_ps(one, e)));
    store16(o + i, keep16<T>(_mm512_mul_ps(silu, uv)), live);
  }
}

// On 8 lanes with exp8; the last n % 8 values through zero-padded copies (so every value's exp is exp8's).
template <typename T>
__attribute__((target("avx2,fma"))) inline void silu_mul_eight(const T* g, const T* u, T* o) {
  const __m256 gv = load8(g), uv = load8(u);
  const __m256 e = radixserve_cpu_vec::exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
  const __m256 silu = keep8<T>(_mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e)));
  store8(o, keep8<T>(_mm256_mul_ps(silu, uv)));
}

template <typename T>
__attribute__((target("avx2,fma"))) void silu_mul_row_avx2(const T* g, const T* u, T* o, int64_t n) {
  const int64_t nv = n - n % 8;
  for (int64_t i = 0; i < nv; i += 8) silu_mul_eight(g + i, u + i, o + i);
  if (nv < n) {
    alignas(32) T gp[8] = {}, up[8] = {}, op[8];
    std::memcpy(gp, g + nv, (n - nv) * sizeof(T));
    std::memcpy(up, u + nv, (n - nv) * sizeof(T));
    silu_mul_eight(gp, up, op);
    std::memcpy(o + nv, op, (n - nv) * sizeof(T));
  }
}
#endif

template <typename T>
void silu_mul_row(const T* g, const T* u, T* o, int64_t n) {
#ifdef RS_X86
  if (radixserve_cpu_paths::avx512()) return silu_mul_row_avx512(g, u, o, n);
  if (radixserve_cpu_paths::avx2()) return silu_mul_row_avx2(g, u, o, n);
#endif
  for (int64_t i = 0; i < n; ++i) {
    const float gi = widen(g[i]);
    put(o + i, keep<T>(gi / (1.0f + std::exp(-gi))) * widen(u[i]));
  }
}

template <typename T>
void silu_mul_impl(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t m = gate_up.size(0), n = gate_up.size(1) / 2, gs = gate_up.stride(0);
  const T* gp = elements<T>(gate_up);
  T* op = elements<T>(out);
  at::parallel_for(0, m, kGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) silu_mul_row(gp + r * gs, gp + r * gs + n, op + r * n, n);
  });
}

at::Tensor silu_mul_rows(const at::Tensor& gate_up) {
  check_rows("silu_mul_rows", "gate_up", gate_up, -1, gate_up.scalar_type());
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_mul_rows: gate_up rows must be [gate | up], an even ",
              "number of values, got ", gate_up.size(1));
  at::Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  if (gate_up.scalar_type() == at::kBFloat16) {
    silu_mul_impl<bf16>(gate_up, out);
  } else {
    silu_mul_impl<float>(gate_up, out);
  }
  return out;
}

// The first index of a row's maximum, a NaN counting as the maximum (torch's max(dim) / argmax): a pass for the
// row's maximum that also notes any NaN, then a pass for its first lane holding it (or the first NaN).
#ifdef RS_X86
__attribute__((target("avx512f"))) int64_t argmax_row_avx512(const float* x, int64_t n) {
  __m512 best = _mm512_set1_ps(-INFINITY);
  __mmask16 nan = 0;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 live = lanes(n - i);
    const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), live, x + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    best = _mm512_max_ps(best, v);
  }
  const float m = _mm512_reduce_max_ps(best);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 live = lanes(n - i);
    const __m512 v = _mm512_maskz_loadu_ps(live, x + i);
    const __mmask16 hit = live & (nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)
                                      : _mm512_cmp_ps_mask(v, _mm512_set1_ps(m), _CMP_EQ_OQ));
    if (hit) return i + __builtin_ctz(hit);
  }
  return 0;  // unreachable: the maximum (or the NaN) is some lane's
}
#endif

int64_t argmax_row(const float* x, int64_t n) {
#ifdef RS_X86
  if (radixserve_cpu_paths::avx512()) return argmax_row_avx512(x, n);
#endif
  int64_t best = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > x[best]) best = i;
  }
  return best;
}

at::Tensor argmax_rows(const at::Tensor& x) {
  check_rows("argmax_rows", "x", x, -1, at::kFloat);
  TORCH_CHECK(x.size(1) >= 1, "argmax_rows: rows must hold at least one value");
  const int64_t m = x.size(0), n = x.size(1), xs = x.stride(0);
  at::Tensor out = at::empty({m}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, m, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) op[r] = argmax_row(xp + r * xs, n);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def("add_rmsnorm_rows(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rmsnorm_rows(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def(
      "qk_norm_rope_rows_(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos, Tensor sin, Tensor? q_norm, "
      "Tensor? k_norm, float eps, int head_dim) -> ()");
  m.def("store_kv_rows_(Tensor k, Tensor v, Tensor(a!) k_dst, Tensor(b!) v_dst, Tensor rows) -> ()");
  m.def("silu_mul_rows(Tensor gate_up) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) {
  m.impl("add_rmsnorm_rows", &add_rmsnorm_rows);
  m.impl("rmsnorm_rows", &rmsnorm_rows);
  m.impl("qk_norm_rope_rows_", &qk_norm_rope_rows_);
  m.impl("store_kv_rows_", &store_kv_rows_);
  m.impl("silu_mul_rows", &silu_mul_rows);
  m.impl("argmax_rows", &argmax_rows);
}
