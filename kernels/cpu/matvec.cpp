// Single-row float32 product y = x W^T (+ b) on the CPU, for batch-1 decode (kernels/cpu_matvec.py),
// plain or with the decoder's step before the projection folded in: add + RMSNorm (rmsnorm_matvec)
// or SiLU-and-mul (silu_mul_matvec), each a few hundred floats formed once before the threads start.
//
// W stays in its natural [N, K] row-major layout (no packed copy); each of the process's compute
// threads (at::parallel_for) streams one contiguous band of rows, one row after the other, so the weight
// is read once, front to back, in one sequential stream per thread.
// x (K floats) stays in L1. One path per instruction set, chosen at run time: AVX-512F, AVX2+FMA,
// and a portable loop; the build needs no -march flag, so one build runs on any x86-64 (or other) CPU.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define RS_X86 1
#endif

namespace {

using RowsFn = void (*)(const float*, int64_t, const float*, float*, int64_t, int64_t, int64_t);

// Rows [r0, r1) of W (row stride ld) times x: y[r] = sum_k W[r, k] x[k], accumulated in float32.
void rows_portable(const float* w, int64_t ld, const float* x, float* y, int64_t r0, int64_t r1, int64_t k) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* row = w + r * ld;
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) {
      for (int j = 0; j < 8; ++j) acc[j] += row[i + j] * x[i + j];
    }
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; i < k; ++i) s += row[i] * x[i];
    y[r] = s;
  }
}

#ifdef RS_X86
__attribute__((target("avx2,fma"))) inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One row at a time, front to back: the band a thread owns is then one sequential stream (the rows are
// contiguous), which the hardware prefetchers follow best. Four rows at a time against the same slice of x
// made four interleaved streams of a few dozen lines each and read 15-40 % slower on a 2-vCPU AMD EPYC
// (Zen 4) guest (bench/HISTORY.md, "CPU, twenty-second session"). Four accumulators per row hide the FMA
// latency; they are added pairwise at the end.
__attribute__((target("avx2,fma"))) void rows_avx2(
    const float* w, int64_t ld, const float* x, float* y, int64_t r0, int64_t r1, int64_t k) {
  const int64_t k32 = k - k % 32, kv = k - k % 8;
  for (int64_t r = r0; r < r1; ++r) {
    const float* w0 = w + r * ld;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i < k32; i += 32) {
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + i), _mm256_loadu_ps(x + i), a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + i + 8), _mm256_loadu_ps(x + i + 8), a1);
      a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + i + 16), _mm256_loadu_ps(x + i + 16), a2);
      a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + i + 24), _mm256_loadu_ps(x + i + 24), a3);
    }
    for (; i < kv; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + i), _mm256_loadu_ps(x + i), a0);
    float s0 = hsum256(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; i < k; ++i) s0 += w0[i] * x[i];
    y[r] = s0;
  }
}

__attribute__((target("avx512f"))) void rows_avx512(
    const float* w, int64_t ld, const float* x, float* y, int64_t r0, int64_t r1, int64_t k) {
  const int64_t k64 = k - k % 64, kv = k - k % 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (k % 16)) - 1u);
  const __m512 xt = _mm512_maskz_loadu_ps(tail, x + kv);
  for (int64_t r = r0; r < r1; ++r) {
    const float* w0 = w + r * ld;
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i < k64; i += 64) {
      a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w0 + i), _mm512_loadu_ps(x + i), a0);
      a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w0 + i + 16), _mm512_loadu_ps(x + i + 16), a1);
      a2 = _mm512_fmadd_ps(_mm512_loadu_ps(w0 + i + 32), _mm512_loadu_ps(x + i + 32), a2);
      a3 = _mm512_fmadd_ps(_mm512_loadu_ps(w0 + i + 48), _mm512_loadu_ps(x + i + 48), a3);
    }
    for (; i < kv; i += 16) a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w0 + i), _mm512_loadu_ps(x + i), a0);
    if (tail) a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, w0 + kv), xt, a0);
    y[r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
  }
}
#endif

struct Path {
  RowsFn fn;
  const char* name;
};

// The paths this CPU can run, best first.
std::vector<Path> cpu_paths() {
  std::vector<Path> paths;
#ifdef RS_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) paths.push_back({rows_avx512, "avx512"});
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) paths.push_back({rows_avx2, "avx2"});
#endif
  paths.push_back({rows_portable, "portable"});
  return paths;
}

Path& path() {
  static Path chosen = cpu_paths().front();
  return chosen;
}

// Rows per at::parallel_for grain: a band of at least this many rows is worth a thread (a multiple
// of 4, so only the last band has single rows).
constexpr int64_t kGrainRows = 64;

// [N, K] float32 CPU weight with contiguous rows; returns K.
int64_t check_weight(const char* op, const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat,
              op, ": weight must be a float32 CPU tensor, got ", weight.scalar_type(), " on ", weight.device());
  TORCH_CHECK(weight.dim() == 2, op, ": weight must be 2-D [N, K], got ", weight.dim(), " dims");
  TORCH_CHECK(weight.stride(1) == 1 && weight.stride(0) >= weight.size(1),
              op, ": weight rows must be contiguous (stride(1) == 1), got strides ", weight.strides());
  return weight.size(1);
}

// A float32 CPU tensor holding one row of `k` values (any leading dims of size 1).
void check_row(const char* op, const char* what, const at::Tensor& t, int64_t k) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat,
              op, ": ", what, " must be a float32 CPU tensor, got ", t.scalar_type(), " on ", t.device());
  TORCH_CHECK(t.dim() >= 1 && t.size(-1) == k, op, ": ", what, " must end in K=", k, " values, got shape ", t.sizes());
  TORCH_CHECK(t.numel() == k, op, ": ", what, " must hold one row of K=", k, " values, got shape ", t.sizes());
}

// y = W v over the compute threads: bands of whole 4-row blocks, each thread ceil(blocks / threads)
// of them, one contiguous stream; y (shaped like `like`, last dim N) is new.
at::Tensor product(const at::Tensor& weight, const float* vp, const at::Tensor& like) {
  const int64_t n = weight.size(0), k = weight.size(1), ld = weight.stride(0);
  std::vector<int64_t> out_shape(like.sizes().begin(), like.sizes().end());
  out_shape.back() = n;
  at::Tensor y = at::empty(out_shape, like.options());
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const RowsFn fn = path().fn;
  at::parallel_for(0, (n + 3) / 4, kGrainRows / 4, [&](int64_t b0, int64_t b1) {
    fn(wp, ld, vp, yp, b0 * 4, std::min(b1 * 4, n), k);
  });
  return y;
}

at::Tensor matvec(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  const int64_t k = check_weight("matvec", weight), n = weight.size(0);
  check_row("matvec", "x", x, k);
  if (bias.has_value()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->size(0) == n,
                "matvec: bias must be a float32 CPU vector of N=", n, ", got ", bias->scalar_type(), " ", bias->sizes());
  }
  const at::Tensor xc = x.contiguous();
  at::Tensor y = product(weight, xc.data_ptr<float>(), x);
  if (bias.has_value()) {
    const at::Tensor bc = bias->contiguous();
    const float* bp = bc.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    for (int64_t r = 0; r < n; ++r) yp[r] += bp[r];
  }
  return y;
}

// (W rmsnorm(x + residual), x + residual): RMSNorm's float32 steps (layers/layernorm.py), h * rsqrt(mean(h^2)
// + eps) then times the norm's weight, on one row before the product. Without a residual the norm is of x
// and the second output a copy of x.
std::tuple<at::Tensor, at::Tensor> rmsnorm_matvec(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                                  const at::Tensor& norm_weight, double eps, const at::Tensor& weight) {
  const int64_t k = check_weight("rmsnorm_matvec", weight);
  check_row("rmsnorm_matvec", "x", x, k);
  check_row("rmsnorm_matvec", "norm_weight", norm_weight, k);
  at::Tensor h;
  if (residual.has_value()) {
    check_row("rmsnorm_matvec", "residual", *residual, k);
    TORCH_CHECK(residual->sizes() == x.sizes(), "rmsnorm_matvec: residual must be shaped like x ", x.sizes(),
                ", got ", residual->sizes());
    h = at::empty(x.sizes(), x.options());
    const at::Tensor xc = x.contiguous(), rc = residual->contiguous();
    const float *xp = xc.data_ptr<float>(), *rp = rc.data_ptr<float>();
    float* hp = h.data_ptr<float>();
    for (int64_t i = 0; i < k; ++i) hp[i] = xp[i] + rp[i];
  } else {
    h = x.clone(at::MemoryFormat::Contiguous);
  }
  const at::Tensor nw = norm_weight.contiguous();
  const float* hp = h.data_ptr<float>();
  const float* wp = nw.data_ptr<float>();
  double squares = 0.0;
  for (int64_t i = 0; i < k; ++i) squares += static_cast<double>(hp[i]) * hp[i];
  const float inv = 1.0f / std::sqrt(static_cast<float>(squares / k) + static_cast<float>(eps));
  std::vector<float> v(k);
  for (int64_t i = 0; i < k; ++i) v[i] = wp[i] * (hp[i] * inv);
  return {product(weight, v.data(), x), h};
}

// W (silu(gate) * up) for one row gate_up = [gate | up] of 2K values: the SwiGLU activation before
// the down projection, silu(g) = g / (1 + exp(-g)).
at::Tensor silu_mul_matvec(const at::Tensor& gate_up, const at::Tensor& weight) {
  const int64_t k = check_weight("silu_mul_matvec", weight);
  check_row("silu_mul_matvec", "gate_up", gate_up, 2 * k);
  const at::Tensor gu = gate_up.contiguous();
  const float* gp = gu.data_ptr<float>();
  std::vector<float> v(k);
  for (int64_t i = 0; i < k; ++i) v[i] = gp[i] / (1.0f + std::exp(-gp[i])) * gp[k + i];
  return product(weight, v.data(), gate_up);
}

std::string matvec_isa() { return path().name; }

// Makes every later product use `isa` (tests and benchmarks: each path on one CPU); returns the one before.
std::string use_matvec_isa(const std::string& isa) {
  std::string names;
  for (const Path& p : cpu_paths()) {
    if (isa == p.name) {
      std::string before = path().name;
      path() = p;
      return before;
    }
    names += names.empty() ? p.name : std::string(", ") + p.name;
  }
  TORCH_CHECK(false, "matvec: this CPU has no '", isa, "' path (it has: ", names, ")");
}

}  // namespace

TORCH_LIBRARY(radixserve_cpu, m) {
  m.def("matvec(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def("rmsnorm_matvec(Tensor x, Tensor? residual, Tensor norm_weight, float eps, Tensor weight) -> (Tensor, Tensor)");
  m.def("silu_mul_matvec(Tensor gate_up, Tensor weight) -> Tensor");
  m.def("matvec_isa() -> str", &matvec_isa);
  m.def("use_matvec_isa(str isa) -> str", &use_matvec_isa);
}

TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) {
  m.impl("matvec", &matvec);
  m.impl("rmsnorm_matvec", &rmsnorm_matvec);
  m.impl("silu_mul_matvec", &silu_mul_matvec);
}
