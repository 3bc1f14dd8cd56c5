// A decoder layer's row-wise steps for a batch of float32 rows on the CPU (decode batches and prefill
// chunks), each one op where torch takes several: at batch 16 the elementwise ops between the products
// were ~30 torch calls a layer, whose dispatch, allocations and Python glue ran on one thread while the
// other compute thread waited (a third of a SmolLM2 decode step on a 2-vCPU host).
//
//   add_rmsnorm_rows(x, residual, w, eps) -> (norm(x + residual), x + residual)
//   rmsnorm_rows(x, w, eps)               -> norm(x)
//   qk_norm_rope_rows_(q, k, positions, cos, sin, q_norm?, k_norm?, eps, head_dim)
//                                           per-head RMSNorm (Qwen3) then neox RoPE of q and k, in place
//   store_kv_rows_(k, v, k_dst, v_dst, rows) k_dst[rows[i]] = k[i], v_dst[rows[i]] = v[i]
//   silu_mul_rows(gate_up)                -> silu(gate) * up for rows [gate | up]
//
// The arithmetic is layers/layernorm.py's and layers/rotary.py's, step for step: RMSNorm is
// w * (h * (1 / sqrt(mean(h^2) + eps))) with the squares summed in double (as the single-row
// rmsnorm_matvec in matvec.cpp), and the rotation is x1 * cos - x2 * sin, x2 * cos + x1 * sin with each
// product rounded before the sum (the library builds with -ffp-contract=off, so no multiply-add is fused:
// the bits are torch's). SiLU is g / (1 + exp(-g)) then times up, as torch orders it; its exp is exp16.h's
// on AVX-512 (the attention's softmax's too: within 2 ulp of torch's Sleef exp), std::exp elsewhere (the
// path follows use_matvec_isa). Rows go to the compute
// threads in bands; a decode batch's few rows are one band.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define RS_X86 1
#endif

#include "exp16.h"

namespace radixserve_cpu_paths {
bool avx512();  // matvec.cpp: whether the products' chosen path is AVX-512 (use_matvec_isa switches it)
}  // namespace radixserve_cpu_paths

namespace {

// Rows per thread band: a batch-16 decode step's rows go to two threads (the other compute thread is
// spinning at the barrier the products left it at, so it starts at once).
constexpr int64_t kGrain = 8;

void check_rows(const char* op, const char* what, const at::Tensor& t, int64_t k) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, op, ": ", what,
              " must be a float32 CPU tensor, got ", t.scalar_type(), " on ", t.device());
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1 && (k < 0 || t.size(1) == k), op, ": ", what,
              " must be [rows, K] with contiguous rows", k >= 0 ? " and K = " + std::to_string(k) : "", ", got ",
              t.sizes(), " with strides ", t.strides());
}

void check_vector(const char* op, const char* what, const at::Tensor& t, int64_t k) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 1 && t.size(0) == k &&
                  t.stride(0) == 1,
              op, ": ", what, " must be a contiguous float32 CPU vector of ", k, " values, got ", t.scalar_type(), " ",
              t.sizes());
}

#ifdef RS_X86
// sum(h^2) in double, 16 floats a step (each product is exact in double, so only the sums round).
__attribute__((target("avx512f"))) double squares_avx512(const float* h, int64_t k) {
  __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    const __m512 x = _mm512_loadu_ps(h + i);
    const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    const __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    a0 = _mm512_fmadd_pd(lo, lo, a0);
    a1 = _mm512_fmadd_pd(hi, hi, a1);
  }
  double s = _mm512_reduce_add_pd(_mm512_add_pd(a0, a1));
  for (; i < k; ++i) s += static_cast<double>(h[i]) * h[i];
  return s;
}
#endif

double squares(const float* h, int64_t k) {
#ifdef RS_X86
  if (radixserve_cpu_paths::avx512()) return squares_avx512(h, k);
#endif
  double s = 0.0;
  for (int64_t i = 0; i < k; ++i) s += static_cast<double>(h[i]) * h[i];
  return s;
}

// o = w * (h * inv), inv = 1 / sqrt(mean(h^2) + eps), over k values.
inline void norm_row(const float* h, const float* w, float eps, int64_t k, float* o) {
  const double sum = squares(h, k);
  const float inv = 1.0f / std::sqrt(static_cast<float>(sum / k) + eps);
  for (int64_t i = 0; i < k; ++i) o[i] = w[i] * (h[i] * inv);
}

std::tuple<at::Tensor, at::Tensor> add_rmsnorm_rows(const at::Tensor& x, const at::Tensor& residual,
                                                    const at::Tensor& weight, double eps) {
  check_rows("add_rmsnorm_rows", "x", x, -1);
  const int64_t m = x.size(0), k = x.size(1);
  check_rows("add_rmsnorm_rows", "residual", residual, k);
  TORCH_CHECK(residual.size(0) == m, "add_rmsnorm_rows: residual has ", residual.size(0), " rows, x ", m);
  check_vector("add_rmsnorm_rows", "weight", weight, k);
  at::Tensor normed = at::empty({m, k}, x.options()), sum = at::empty({m, k}, x.options());
  const float *xp = x.data_ptr<float>(), *rp = residual.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float *np = normed.data_ptr<float>(), *sp = sum.data_ptr<float>();
  const int64_t xs = x.stride(0), rs = residual.stride(0);
  const float e = static_cast<float>(eps);
  at::parallel_for(0, m, kGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* h = sp + r * k;
      for (int64_t i = 0; i < k; ++i) h[i] = xp[r * xs + i] + rp[r * rs + i];
      norm_row(h, wp, e, k, np + r * k);
    }
  });
  return {normed, sum};
}

at::Tensor rmsnorm_rows(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows("rmsnorm_rows", "x", x, -1);
  const int64_t m = x.size(0), k = x.size(1);
  check_vector("rmsnorm_rows", "weight", weight, k);
  at::Tensor normed = at::empty({m, k}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* np = normed.data_ptr<float>();
  const int64_t xs = x.stride(0);
  const float e = static_cast<float>(eps);
  at::parallel_for(0, m, kGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) norm_row(xp + r * xs, wp, e, k, np + r * k);
  });
  return normed;
}

// One head of head_dim values in place: RMSNorm by `norm` (nullptr: none), then the first 2 * half values
// rotated as neox pairs (i, i + half) by the position's cos / sin rows.
inline void head_norm_rope(float* x, const float* norm, float eps, int64_t head_dim, const float* c,
                           const float* s, int64_t half, float* scratch) {
  if (norm != nullptr) {
    norm_row(x, norm, eps, head_dim, scratch);
    std::memcpy(x, scratch, head_dim * sizeof(float));
  }
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    const float a = x1 * c[i], b = x2 * s[i], e = x2 * c[i], f = x1 * s[i];
    x[i] = a - b;
    x[i + half] = e + f;
  }
}

void qk_norm_rope_rows_(at::Tensor& q, at::Tensor& k, const at::Tensor& positions, const at::Tensor& cos,
                        const at::Tensor& sin, const c10::optional<at::Tensor>& q_norm,
                        const c10::optional<at::Tensor>& k_norm, double eps, int64_t head_dim) {
  check_rows("qk_norm_rope_rows_", "q", q, -1);
  check_rows("qk_norm_rope_rows_", "k", k, -1);
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
  if (q_norm.has_value()) check_vector("qk_norm_rope_rows_", "q_norm", *q_norm, head_dim);
  if (k_norm.has_value()) check_vector("qk_norm_rope_rows_", "k_norm", *k_norm, head_dim);
  const at::Tensor pos = positions.contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t r = 0; r < m; ++r) {
    TORCH_CHECK(pp[r] >= 0 && pp[r] < table, "qk_norm_rope_rows_: position ", pp[r], " of row ", r,
                " is outside the rotary table's ", table);
  }
  float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>();
  const int64_t qs = q.stride(0), ks = k.stride(0), q_heads = q.size(1) / head_dim, kv_heads = k.size(1) / head_dim;
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  const float* qn = q_norm.has_value() ? q_norm->data_ptr<float>() : nullptr;
  const float* kn = k_norm.has_value() ? k_norm->data_ptr<float>() : nullptr;
  const float e = static_cast<float>(eps);
  at::parallel_for(0, m, kGrain, [&](int64_t r0, int64_t r1) {
    std::vector<float> scratch(head_dim);
    for (int64_t r = r0; r < r1; ++r) {
      const float *c = cp + pp[r] * half, *s = sp + pp[r] * half;
      for (int64_t h = 0; h < q_heads; ++h) {
        head_norm_rope(qp + r * qs + h * head_dim, qn, e, head_dim, c, s, half, scratch.data());
      }
      for (int64_t h = 0; h < kv_heads; ++h) {
        head_norm_rope(kp + r * ks + h * head_dim, kn, e, head_dim, c, s, half, scratch.data());
      }
    }
  });
}

void store_kv_rows_(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_dst, at::Tensor& v_dst,
                    const at::Tensor& rows) {
  check_rows("store_kv_rows_", "k", k, -1);
  const int64_t m = k.size(0), width = k.size(1);
  check_rows("store_kv_rows_", "v", v, width);
  TORCH_CHECK(v.size(0) == m, "store_kv_rows_: k has ", m, " rows, v ", v.size(0));
  for (const at::Tensor* dst : {&k_dst, &v_dst}) {
    TORCH_CHECK(dst->device().is_cpu() && dst->scalar_type() == at::kFloat && dst->is_contiguous() &&
                    dst->dim() >= 2 && dst->numel() % width == 0 && dst->numel() / dst->size(0) == width,
                "store_kv_rows_: k_dst and v_dst must be contiguous float32 CPU tensors of rows of ", width,
                " values, got ", dst->scalar_type(), " ", dst->sizes());
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
  const float *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  float *kd = k_dst.data_ptr<float>(), *vd = v_dst.data_ptr<float>();
  const int64_t ks = k.stride(0), vs = v.stride(0);
  const size_t bytes = width * sizeof(float);
  at::parallel_for(0, m, 4 * kGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      std::memcpy(kd + ip[r] * width, kp + r * ks, bytes);
      std::memcpy(vd + ip[r] * width, vp + r * vs, bytes);
    }
  });
}

#ifdef RS_X86
__attribute__((target("avx512f"))) void silu_mul_row_avx512(const float* g, const float* u, float* o, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1u);
    const __m512 gv = _mm512_maskz_loadu_ps(mask, g + i), uv = _mm512_maskz_loadu_ps(mask, u + i);
    const __m512 e = radixserve_cpu_vec::exp16(_mm512_sub_ps(zero, gv));
    _mm512_mask_storeu_ps(o + i, mask, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e)), uv));
  }
}

#endif

void silu_mul_row(const float* g, const float* u, float* o, int64_t n) {
#ifdef RS_X86
  if (radixserve_cpu_paths::avx512()) return silu_mul_row_avx512(g, u, o, n);
#endif
  for (int64_t i = 0; i < n; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

at::Tensor silu_mul_rows(const at::Tensor& gate_up) {
  check_rows("silu_mul_rows", "gate_up", gate_up, -1);
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_mul_rows: gate_up rows must be [gate | up], an even ",
              "number of values, got ", gate_up.size(1));
  const int64_t m = gate_up.size(0), n = gate_up.size(1) / 2, gs = gate_up.stride(0);
  at::Tensor out = at::empty({m, n}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, m, kGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) silu_mul_row(gp + r * gs, gp + r * gs + n, op + r * n, n);
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
}

TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) {
  m.impl("add_rmsnorm_rows", &add_rmsnorm_rows);
  m.impl("rmsnorm_rows", &rmsnorm_rows);
  m.impl("qk_norm_rope_rows_", &qk_norm_rope_rows_);
  m.impl("store_kv_rows_", &store_kv_rows_);
  m.impl("silu_mul_rows", &silu_mul_rows);
}
