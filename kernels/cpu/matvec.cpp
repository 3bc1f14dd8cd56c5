// Single-row float32 product y = x W^T (+ b) on the CPU, for batch-1 decode (kernels/cpu_matvec.py),
// plain or with the decoder's step before the projection folded in: add + RMSNorm (rmsnorm_matvec)
// or SiLU-and-mul (silu_mul_matvec), each a few hundred floats formed once before the threads start.
// The plain product also takes a bfloat16 row and weight: each weight element widened to float32 as it is
// read (exact), the same float32 sums as for a float32 weight, the result rounded to bfloat16 once, as
// torch's bfloat16 linear does; it reads half the bytes of the float32 product.
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
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define RS_X86 1
#endif

#include "bf16.h"
#include "chunk_shares.h"
#include "exp16.h"
#include "row_helpers.h"

namespace radixserve_cpu_panels {
void clear_helper_slots();  // panels.cpp: the inputs its helper jobs hold
}  // namespace radixserve_cpu_panels

namespace {

using RowsFn = void (*)(const float*, int64_t, const float*, float*, int64_t, int64_t, int64_t);
using Bf16RowsFn = void (*)(const uint16_t*, int64_t, const float*, float*, int64_t, int64_t, int64_t);

using radixserve_cpu_bf16::bf16_to_float;
using radixserve_cpu_bf16::keep;
using radixserve_cpu_bf16::put;
using radixserve_cpu_bf16::to_bf16;
using radixserve_cpu_bf16::widen;

// Rows [r0, r1) of W (row stride ld) times x: y[r] = sum_k W[r, k] x[k], accumulated in float32 (W float32,
// or bfloat16 widened element by element: the same sums over the widened values).
template <typename T>
float dot_portable(const T* row, const float* x, int64_t k) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    for (int j = 0; j < 8; ++j) acc[j] += widen(row[i + j]) * x[i + j];
  }
  float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
  for (; i < k; ++i) s += widen(row[i]) * x[i];
  return s;
}

template <typename T>
void rows_portable(const T* w, int64_t ld, const float* x, float* y, int64_t r0, int64_t r1, int64_t k) {
  for (int64_t r = r0; r < r1; ++r) y[r] = dot_portable(w + r * ld, x, k);
}

// Bytes ahead of the weight being read that the product asks to be brought into L2 (RS_CPU_PREFETCH_BYTES,
// default 1536, or 0 on an AMD CPU without AVX-512; 0 turns it off), for a float32 weight; a bfloat16 weight
// looks twice as far. The hardware
// prefetchers alone left a thread's stream at ~9.3-10 GB/s on a 2-vCPU Xeon guest whose memory gives one thread
// ~10.6; with these requests SmolLM2's batch-1 step at one thread went 59.2 -> 52.4 ms (bench/HISTORY.md, "CPU,
// twenty-sixth session"; 3072 bytes were no better than none there, in float32). In bfloat16 the same guest
// class wants more: a pass over SmolLM2's bfloat16 weights took 24.6 ms at 1536 bytes against 20.4 at 3072 or
// 6144 with one thread, 13.6 against 11.3 (6144) with two (thirty-second session). On AMD's AVX2-only cores
// (Zen 3 and before) the requests cost more than they bring: on a 2-vCPU Zen 3 guest a one-thread pass over
// SmolLM2's float32 weights took 32.0-54.1 ms without them against 37.1-63.6 with, slower in all ten
// alternating pairs, and the Engine's batch-1 decode at one thread ran 17.4-19.6 tok/s against 14.0-16.4
// (thirty-eighth session); there the default is none. Prefetches never fault, so the ones past the end of a
// band or of the weight are harmless.
int64_t default_prefetch_bytes() {
#ifdef RS_X86
  __builtin_cpu_init();
  if (__builtin_cpu_is("amd") && !__builtin_cpu_supports("avx512f")) return 0;
#endif
  return 1536;
}

// The distance for a stream no other compute thread of this process runs beside (outside an OpenMP region: a
// team of one, or a chunk of the row helpers' jobs) where use_alone_prefetch set one, else -1. A Zen 5 guest's
// one thread streamed SmolLM2's float32 weights 8-11 % faster without the requests (13.9 against 15.1-15.6 ms
// a pass; at two threads 4 % slower without them), so load-time calibration times a lone thread's pass both
// ways (layers/linear_calibration.calibrate_alone_prefetch; bench/HISTORY.md, fortieth session).
std::atomic<int64_t>& alone_prefetch() {
  static std::atomic<int64_t> bytes{-1};
  return bytes;
}

int64_t base_prefetch_bytes() {
  static const int64_t bytes = [] {
    const char* env = std::getenv("RS_CPU_PREFETCH_BYTES");
    const long long v = env != nullptr ? std::atoll(env) : default_prefetch_bytes();
    return static_cast<int64_t>(std::clamp<long long>(v, 0, 1 << 20));
  }();
  return bytes;
}

template <typename T>
int64_t prefetch_bytes() {
  int64_t bytes = base_prefetch_bytes();
  const int64_t alone = alone_prefetch().load(std::memory_order_relaxed);
  if (alone >= 0 && !at::in_parallel_region()) bytes = alone;
  return sizeof(T) == 2 ? 2 * bytes : bytes;
}

#ifdef RS_X86
// A request for the `lines` 64-byte lines from p into L2 (on AMD, into L1).
inline void prefetch_lines(const void* p, int64_t ahead, int lines) {
  const char* c = reinterpret_cast<const char*>(p) + ahead;
  for (int l = 0; l < lines; ++l) _mm_prefetch(c + 64 * l, _MM_HINT_T1);
}

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
//
// A bfloat16 weight takes the same accumulators and order, each group of 8 / 16 elements widened
// (zero-extended to 32 bits, shifted up 16) before its FMA; its stream is half as long, so half as many
// prefetch lines a step.
__attribute__((target("avx2,fma"))) inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

__attribute__((target("avx2,fma"))) inline __m256 load8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

template <typename T>
__attribute__((target("avx2,fma"))) void rows_avx2(
    const T* w, int64_t ld, const float* x, float* y, int64_t r0, int64_t r1, int64_t k) {
  const int64_t k32 = k - k % 32, kv = k - k % 8, ahead = prefetch_bytes<T>();
  for (int64_t r = r0; r < r1; ++r) {
    const T* w0 = w + r * ld;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i < k32; i += 32) {
      if (ahead) prefetch_lines(w0 + i, ahead, 2 * sizeof(T) / sizeof(float));
      a0 = _mm256_fmadd_ps(load8(w0 + i), _mm256_loadu_ps(x + i), a0);
      a1 = _mm256_fmadd_ps(load8(w0 + i + 8), _mm256_loadu_ps(x + i + 8), a1);
      a2 = _mm256_fmadd_ps(load8(w0 + i + 16), _mm256_loadu_ps(x + i + 16), a2);
      a3 = _mm256_fmadd_ps(load8(w0 + i + 24), _mm256_loadu_ps(x + i + 24), a3);
    }
    for (; i < kv; i += 8) a0 = _mm256_fmadd_ps(load8(w0 + i), _mm256_loadu_ps(x + i), a0);
    float s0 = hsum256(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; i < k; ++i) s0 += widen(w0[i]) * x[i];
    y[r] = s0;
  }
}

__attribute__((target("avx512f"))) inline __m512 widen16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// 16 lanes of a stored row from p: floats as they are, bfloat16 widened; `live` lanes only (the rest zero).
__attribute__((target("avx512f"))) inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

__attribute__((target("avx512f"))) inline __m512 load16(const uint16_t* p) {
  return widen16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

__attribute__((target("avx512f"))) inline __m512 load16(const float* p, __mmask16 live) {
  return _mm512_maskz_loadu_ps(live, p);
}

__attribute__((target("avx512f"))) inline __m512 load16(const uint16_t* p, __mmask16 live) {
  if (live == 0xFFFF) return load16(p);
  uint16_t part[16] = {};
  for (int i = 0; i < 16; ++i) {
    if (live >> i & 1) part[i] = p[i];
  }
  return load16(part);
}

template <typename T>
__attribute__((target("avx512f"))) void rows_avx512(
    const T* w, int64_t ld, const float* x, float* y, int64_t r0, int64_t r1, int64_t k) {
  const int64_t k64 = k - k % 64, kv = k - k % 16, ahead = prefetch_bytes<T>();
  const __mmask16 tail = static_cast<__mmask16>((1u << (k % 16)) - 1u);
  const __m512 xt = _mm512_maskz_loadu_ps(tail, x + kv);
  for (int64_t r = r0; r < r1; ++r) {
    const T* w0 = w + r * ld;
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i < k64; i += 64) {
      if (ahead) prefetch_lines(w0 + i, ahead, 4 * sizeof(T) / sizeof(float));
      a0 = _mm512_fmadd_ps(load16(w0 + i), _mm512_loadu_ps(x + i), a0);
      a1 = _mm512_fmadd_ps(load16(w0 + i + 16), _mm512_loadu_ps(x + i + 16), a1);
      a2 = _mm512_fmadd_ps(load16(w0 + i + 32), _mm512_loadu_ps(x + i + 32), a2);
      a3 = _mm512_fmadd_ps(load16(w0 + i + 48), _mm512_loadu_ps(x + i + 48), a3);
    }
    for (; i < kv; i += 16) a0 = _mm512_fmadd_ps(load16(w0 + i), _mm512_loadu_ps(x + i), a0);
    if (tail) a0 = _mm512_fmadd_ps(load16(w0 + kv, tail), xt, a0);
    y[r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
  }
}
#endif

struct Path {
  RowsFn fn;
  const char* name;
  Bf16RowsFn bf16;
};

// The paths this CPU can run, best first.
std::vector<Path> cpu_paths() {
  std::vector<Path> paths;
#ifdef RS_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) paths.push_back({rows_avx512<float>, "avx512", rows_avx512<uint16_t>});
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    paths.push_back({rows_avx2<float>, "avx2", rows_avx2<uint16_t>});
  }
#endif
  paths.push_back({rows_portable<float>, "portable", rows_portable<uint16_t>});
  return paths;
}

Path& path() {
  static Path chosen = cpu_paths().front();
  return chosen;
}

// The single-row products' loop (product() and its helpers' chunks, so the same bits on every thread): path()'s
// unless use_product_isa chose another. Load-time calibration times each loop this CPU has: on one Zen 4 guest
// the AVX2 loop streamed 6-8 % faster than the AVX-512 one at one and two threads, on another 4 % slower
// (bench/HISTORY.md, thirty-ninth session). Set while no product runs (at load).
std::optional<Path>& product_override() {
  static std::optional<Path> chosen;
  return chosen;
}

const Path& product_path() { return product_override() ? *product_override() : path(); }

// Rows per at::parallel_for grain: a band of at least this many rows is worth a thread (a multiple
// of 4, so only the last band has single rows).
constexpr int64_t kGrainRows = 64;

// [N, K] float32 (or, where bf16_ok, bfloat16) CPU weight with contiguous rows; returns K.
int64_t check_weight(const char* op, const at::Tensor& weight, bool bf16_ok = false) {
  const bool dtype_ok = weight.scalar_type() == at::kFloat || (bf16_ok && weight.scalar_type() == at::kBFloat16);
  TORCH_CHECK(weight.device().is_cpu() && dtype_ok, op, ": weight must be a ", bf16_ok ? "float32 or bfloat16" : "float32",
              " CPU tensor, got ", weight.scalar_type(), " on ", weight.device());
  TORCH_CHECK(weight.dim() == 2, op, ": weight must be 2-D [N, K], got ", weight.dim(), " dims");
  TORCH_CHECK(weight.stride(1) == 1 && weight.stride(0) >= weight.size(1),
              op, ": weight rows must be contiguous (stride(1) == 1), got strides ", weight.strides());
  return weight.size(1);
}

const char* dtype_name(at::ScalarType dtype) { return dtype == at::kBFloat16 ? "bfloat16" : "float32"; }

// A CPU tensor of `dtype` (float32 unless given) holding one row of `k` values (any leading dims of size 1).
void check_row(const char* op, const char* what, const at::Tensor& t, int64_t k, at::ScalarType dtype = at::kFloat) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype,
              op, ": ", what, " must be a ", dtype_name(dtype), " CPU tensor, got ", t.scalar_type(), " on ", t.device());
  TORCH_CHECK(t.dim() >= 1 && t.size(-1) == k, op, ": ", what, " must end in K=", k, " values, got shape ", t.sizes());
  TORCH_CHECK(t.numel() == k, op, ": ", what, " must hold one row of K=", k, " values, got shape ", t.sizes());
}

// One product for the row helpers (row_helpers.h): chunks of kHelperRows rows of W v, each computed by the
// same rows function, so the same bits, as the threads' bands.
constexpr int64_t kHelperRows = 32;  // ~74 KB of a 576-wide float32 weight: a few microseconds a chunk

struct ProductJob {
  const void* w;
  int64_t ld, k;
  const float* v;
  float* y;
  int64_t n;
};

// A job's inputs, kept until its slot is refilled (row_helpers.h: a helper may still read them).
struct ProductSlot {
  at::Tensor weight;
  std::vector<float> v;
  ProductJob job{};
};

std::array<ProductSlot, radixserve_cpu_helpers::RowHelpers::kSlots>& product_slots() {
  static auto* slots = new std::array<ProductSlot, radixserve_cpu_helpers::RowHelpers::kSlots>();
  return *slots;
}

template <typename T>
void product_chunk(const void* job, int64_t c, float* out) {
  const ProductJob& j = *static_cast<const ProductJob*>(job);
  const int64_t r0 = c * kHelperRows, r1 = std::min(j.n, r0 + kHelperRows);
  const T* w = static_cast<const T*>(j.w) + r0 * j.ld;
  if constexpr (std::is_same_v<T, float>) {
    product_path().fn(w, j.ld, j.v, out, 0, r1 - r0, j.k);
  } else {
    product_path().bf16(w, j.ld, j.v, out, 0, r1 - r0, j.k);
  }
}

void product_commit(const void* job, int64_t c, const float* out) {
  const ProductJob& j = *static_cast<const ProductJob*>(job);
  const int64_t r0 = c * kHelperRows, r1 = std::min(j.n, r0 + kHelperRows);
  std::memcpy(j.y + r0, out, sizeof(float) * static_cast<size_t>(r1 - r0));
}

// y = W v over the compute threads: bands of whole 4-row blocks, each thread ceil(blocks / threads)
// of them, one contiguous stream; or, where the rank has row helpers (its OpenMP team cut to one thread
// while other processes want its cores), chunks shared with them. y (float32, shaped like `like`, last dim
// N) is new.
// `alone`: every row on the calling thread, no helpers (a team of one's stream: calibration times it).
at::Tensor product(const at::Tensor& weight, const float* vp, const at::Tensor& like, bool alone = false) {
  const int64_t n = weight.size(0), k = weight.size(1), ld = weight.stride(0);
  std::vector<int64_t> out_shape(like.sizes().begin(), like.sizes().end());
  out_shape.back() = n;
  at::Tensor y = at::empty(out_shape, like.options().dtype(at::kFloat));
  float* yp = y.data_ptr<float>();
  const bool bf16 = weight.scalar_type() == at::kBFloat16;
  const void* wp = bf16 ? static_cast<const void*>(weight.data_ptr<at::BFloat16>())
                        : static_cast<const void*>(weight.data_ptr<float>());
  const Path& path = product_path();
  auto rows = [&](int64_t r0, int64_t r1) {
    if (bf16) {
      path.bf16(static_cast<const uint16_t*>(wp), ld, vp, yp, r0, r1, k);
    } else {
      path.fn(static_cast<const float*>(wp), ld, vp, yp, r0, r1, k);
    }
  };
  if (alone) {
    rows(0, n);
    return y;
  }
  radixserve_cpu_helpers::RowHelpers& helpers = radixserve_cpu_helpers::RowHelpers::get();
  if (helpers.count() > 0 && n >= 2 * kHelperRows && !at::in_parallel_region()) {
    auto fill = [&](int s) -> const void* {
      ProductSlot& slot = product_slots()[s];
      slot.weight = weight;  // held until the slot is refilled: a late helper may still read it
      slot.v.assign(vp, vp + k);
      slot.job = {wp, ld, k, slot.v.data(), yp, n};
      return &slot.job;
    };
    radixserve_cpu_helpers::Work work;
    work.chunks = (n + kHelperRows - 1) / kHelperRows;
    work.buffer_floats = kHelperRows;
    work.compute = bf16 ? product_chunk<uint16_t> : product_chunk<float>;
    work.commit = product_commit;
    if (helpers.run(fill, work)) return y;
  }
  at::parallel_for(0, (n + 3) / 4, kGrainRows / 4, [&](int64_t b0, int64_t b1) { rows(b0 * 4, std::min(b1 * 4, n)); });
  return y;
}

// x W^T + b for one row; x, W and b all float32, or all bfloat16 (then summed in float32 over the widened
// values and rounded to bfloat16 once, after the bias).
at::Tensor matvec(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  const int64_t k = check_weight("matvec", weight, true), n = weight.size(0);
  const at::ScalarType dtype = weight.scalar_type();
  check_row("matvec", "x", x, k, dtype);
  if (bias.has_value()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == dtype && bias->dim() == 1 && bias->size(0) == n,
                "matvec: bias must be a ", dtype_name(dtype), " CPU vector of N=", n, ", got ", bias->scalar_type(),
                " ", bias->sizes());
  }
  const at::Tensor xc = x.to(at::kFloat).contiguous();
  at::Tensor y = product(weight, xc.data_ptr<float>(), x);
  if (bias.has_value()) {
    const at::Tensor bc = bias->to(at::kFloat).contiguous();
    const float* bp = bc.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    for (int64_t r = 0; r < n; ++r) yp[r] += bp[r];
  }
  return dtype == at::kFloat ? y : y.to(dtype);
}

// x W^T for one row on the calling thread alone, as a team of one computes it (no bias, no helpers): the
// stream calibrate_alone_prefetch times.
at::Tensor matvec_alone(const at::Tensor& x, const at::Tensor& weight) {
  const int64_t k = check_weight("matvec_alone", weight, true);
  const at::ScalarType dtype = weight.scalar_type();
  check_row("matvec_alone", "x", x, k, dtype);
  const at::Tensor xc = x.to(at::kFloat).contiguous();
  at::Tensor y = product(weight, xc.data_ptr<float>(), x, true);
  return dtype == at::kFloat ? y : y.to(dtype);
}

// The prologue's row v = w * (h * inv) from h = x (+ residual), each step kept as T (torch's bfloat16 RMSNorm
// rounds h, h * inv and the product); h is written to hp (the residual handed on).
template <typename T>
void rmsnorm_row(const T* xp, const T* rp, const T* wp, double eps, int64_t k, T* hp, float* v) {
  double squares = 0.0;
  for (int64_t i = 0; i < k; ++i) {
    if (rp != nullptr) put(hp + i, widen(xp[i]) + widen(rp[i]));
    else hp[i] = xp[i];
    const float h = widen(hp[i]);
    squares += static_cast<double>(h) * h;
  }
  const float inv = 1.0f / std::sqrt(static_cast<float>(squares / k) + static_cast<float>(eps));
  for (int64_t i = 0; i < k; ++i) v[i] = keep<T>(widen(wp[i]) * keep<T>(widen(hp[i]) * inv));
}

template <typename T>
const T* row_data(const at::Tensor& t) {
  return reinterpret_cast<const T*>(t.data_ptr());
}

// (W rmsnorm(x + residual), x + residual): RMSNorm's float32 steps (layers/layernorm.py), h * rsqrt(mean(h^2)
// + eps) then times the norm's weight, on one row before the product. Without a residual the norm is of x
// and the second output a copy of x. All operands float32, or all bfloat16 (then rounded where torch's
// bfloat16 norm rounds, the product's float32 sums rounded to bfloat16 once).
std::tuple<at::Tensor, at::Tensor> rmsnorm_matvec(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                                  const at::Tensor& norm_weight, double eps, const at::Tensor& weight) {
  const int64_t k = check_weight("rmsnorm_matvec", weight, true);
  const at::ScalarType dtype = weight.scalar_type();
  check_row("rmsnorm_matvec", "x", x, k, dtype);
  check_row("rmsnorm_matvec", "norm_weight", norm_weight, k, dtype);
  if (residual.has_value()) {
    check_row("rmsnorm_matvec", "residual", *residual, k, dtype);
    TORCH_CHECK(residual->sizes() == x.sizes(), "rmsnorm_matvec: residual must be shaped like x ", x.sizes(),
                ", got ", residual->sizes());
  }
  at::Tensor h = at::empty(x.sizes(), x.options());
  const at::Tensor xc = x.contiguous(), nw = norm_weight.contiguous();
  const at::Tensor rc = residual.has_value() ? residual->contiguous() : at::Tensor();
  std::vector<float> v(k);
  if (dtype == at::kFloat) {
    rmsnorm_row<float>(row_data<float>(xc), rc.defined() ? row_data<float>(rc) : nullptr, row_data<float>(nw), eps,
                       k, h.data_ptr<float>(), v.data());
    return {product(weight, v.data(), x), h};
  }
  rmsnorm_row<uint16_t>(row_data<uint16_t>(xc), rc.defined() ? row_data<uint16_t>(rc) : nullptr,
                        row_data<uint16_t>(nw), eps, k, reinterpret_cast<uint16_t*>(h.data_ptr()), v.data());
  return {product(weight, v.data(), x).to(dtype), h};
}

// W (silu(gate) * up) for one row gate_up = [gate | up] of 2K values: the SwiGLU activation before
// the down projection, silu(g) = g / (1 + exp(-g)). float32, or bfloat16 with silu(g) and its product with
// up each rounded to bfloat16 (as torch's F.silu(gate) * up), the product's sums rounded once.
template <typename T>
void silu_mul_row(const T* gp, int64_t k, float* v) {
  for (int64_t i = 0; i < k; ++i) {
    const float g = widen(gp[i]);
    v[i] = keep<T>(keep<T>(g / (1.0f + std::exp(-g))) * widen(gp[k + i]));
  }
}

at::Tensor silu_mul_matvec(const at::Tensor& gate_up, const at::Tensor& weight) {
  const int64_t k = check_weight("silu_mul_matvec", weight, true);
  const at::ScalarType dtype = weight.scalar_type();
  check_row("silu_mul_matvec", "gate_up", gate_up, 2 * k, dtype);
  const at::Tensor gu = gate_up.contiguous();
  std::vector<float> v(k);
  if (dtype == at::kFloat) {
    silu_mul_row(row_data<float>(gu), k, v.data());
    return product(weight, v.data(), gate_up);
  }
  silu_mul_row(row_data<uint16_t>(gu), k, v.data());
  return product(weight, v.data(), gate_up).to(dtype);
}

std::string matvec_isa() { return path().name; }

// One decode query row's attention over L cached positions, for batch-1 decode on the CPU, where torch's
// SDPA spends ~70 us a layer on dispatch and threading for a few hundred thousand FLOPs: q [kv_heads, group,
// D] (query head h * group + j attends with KV head h, HF's order), k and v [L, kv_heads, D] with any stride
// over L (a span of the pool) and contiguous [kv_heads, D] rows. Per query head: the scores through the
// products' own row kernel, softmax with the maximum subtracted, the weights' sum, then the weighted values
// divided by it. One thread: the work is smaller than a parallel region's start-up.
void softmax_weights(float* p, int64_t len, float scale, float* total);
template <typename T>
void add_scaled_rows(float* o, const T* v, int64_t vs, const float* p, int64_t len, int64_t d);

// Keys and values as stored: float32, or bfloat16 (its bits; widened exactly as read, the sums float32).
bool attention_dtype_ok(const at::Tensor& t) {
  return t.device().is_cpu() && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16);
}

template <typename T>
const T* kv_data(const at::Tensor& t) {
  return reinterpret_cast<const T*>(t.data_ptr());
}

template <typename T>
void attend_row(const float* qp, const T* kp, int64_t ks, const T* vp, int64_t vs, float* op, int64_t heads,
                int64_t group, int64_t d, int64_t len, float scale) {
  std::vector<float> p(len);
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t j = 0; j < group; ++j) {
      float* o = op + (h * group + j) * d;
      if constexpr (std::is_same_v<T, float>) {
        path().fn(kp + h * d, ks, qp + (h * group + j) * d, p.data(), 0, len, d);  // scores
      } else {
        path().bf16(kp + h * d, ks, qp + (h * group + j) * d, p.data(), 0, len, d);
      }
      float total;
      softmax_weights(p.data(), len, scale, &total);
      add_scaled_rows(o, vp + h * d, vs, p.data(), len, d);
      const float inv = 1.0f / total;
      for (int64_t i = 0; i < d; ++i) o[i] *= inv;
    }
  }
}

// q, k and v all float32, or all bfloat16 (then q widened, the same float32 steps, the output rounded once).
at::Tensor decode_attention_row(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  TORCH_CHECK(attention_dtype_ok(q) && k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type() &&
                  k.device().is_cpu() && v.device().is_cpu(),
              "decode_attention_row: q, k and v must be CPU tensors, all float32 or all bfloat16");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && k.size(0) >= 1,
              "decode_attention_row: q must be [kv_heads, group, D] and k, v [L >= 1, kv_heads, D], got ",
              q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  const int64_t heads = q.size(0), group = q.size(1), d = q.size(2), len = k.size(0);
  TORCH_CHECK(k.size(1) == heads && k.size(2) == d, "decode_attention_row: k ", k.sizes(), " does not match q ",
              q.sizes());
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k.stride(1) == d && v.stride(1) == d,
              "decode_attention_row: k and v need contiguous [kv_heads, D] rows");
  const at::Tensor qc = q.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({heads * group * d}, qc.options());
  const float* qp = qc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (k.scalar_type() == at::kFloat) {
    attend_row(qp, kv_data<float>(k), k.stride(0), kv_data<float>(v), v.stride(0), op, heads, group, d, len,
               static_cast<float>(scale));
    return out;
  }
  attend_row(qp, kv_data<uint16_t>(k), k.stride(0), kv_data<uint16_t>(v), v.stride(0), op, heads, group, d, len,
             static_cast<float>(scale));
  return out.to(q.scalar_type());
}

// Decode attention of a batch, one query row per request, each request's keys and values read straight
// from the pool through its slots (no gathered or padded copy): q [bs, kv_heads, group, D]; k_pool and
// v_pool [slots, kv_heads, D] with contiguous [kv_heads, D] rows; slots [bs, >= max(seq_lens)] int64 with
// contiguous rows; seq_lens [bs] int64, each >= 1. Per request: every query head's score against each key
// row as it is read, softmax per query head (softmax_weights), then the weighted value rows. Requests are
// spread over torch's compute threads.
template <typename T>
void gather_scores(const T* k, int64_t ks, const int64_t* sl, int64_t len, const float* q, int64_t rows,
                   int64_t group, int64_t d, float* p);
template <typename T>
void gather_add_rows(float* o, const T* v, int64_t vs, const int64_t* sl, const float* p, int64_t len,
                     int64_t rows, int64_t group, int64_t d);

// The request's output row as stored: float32 as it is, bfloat16 rounded to nearest even (as torch's .to rounds).
inline void store_row(float* dst, const float* o, int64_t n) {
  if (dst != o) std::memcpy(dst, o, n * sizeof(float));
}

inline void store_row(uint16_t* dst, const float* o, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_bf16(o[i]);
}

template <typename T>
void attend_rows(const T* qp, int64_t qs, const T* kp, int64_t ks, const T* vp, int64_t vs, const int64_t* sp,
                 int64_t s0, const int64_t* lp, T* op, int64_t bs, int64_t heads, int64_t group, int64_t d, float sc) {
  // One request per task, all its heads together: each key and value row ([kv_heads, D], contiguous) is read
  // once, front to back, so a request whose rows are one run (the dense blocks) is one sequential stream.
  // A bfloat16 request's query row is widened into a float32 copy and its output summed in float32, then
  // rounded once as it is stored.
  // The threads share the requests (chunk_shares.h): a request's cost is its length, and lengths differ.
  constexpr bool wide = std::is_same_v<T, float>;
  const int64_t teams = std::min<int64_t>(at::get_num_threads(), bs);
  radixserve_cpu_shares::ChunkShares shares(bs, teams);
  at::parallel_for(0, teams, 1, [&](int64_t t0, int64_t t1) {
    const int64_t q_rows = heads * group;
    std::vector<float> p, totals(q_rows), q_wide(wide ? 0 : q_rows * d), o_wide(wide ? 0 : q_rows * d);
    for (int64_t t = t0; t < t1; ++t) {  // one index, or all of them where the region runs on this thread alone
      for (int64_t b = shares.next(t); b >= 0; b = shares.next(t)) {
        const int64_t len = lp[b];
        const int64_t* sl = sp + b * s0;
        const float* q;
        float* o;
        if constexpr (wide) {
          q = qp + b * qs;
          o = op + b * q_rows * d;
        } else {
          for (int64_t i = 0; i < q_rows * d; ++i) q_wide[i] = widen(qp[b * qs + i]);
          q = q_wide.data();
          o = o_wide.data();
        }
        p.resize(q_rows * len);
        gather_scores(kp, ks, sl, len, q, heads, group, d, p.data());
        for (int64_t r = 0; r < q_rows; ++r) softmax_weights(p.data() + r * len, len, sc, &totals[r]);
        gather_add_rows(o, vp, vs, sl, p.data(), len, heads, group, d);
        for (int64_t r = 0; r < q_rows; ++r) {
          const float inv = 1.0f / totals[r];
          for (int64_t i = 0; i < d; ++i) o[r * d + i] *= inv;
        }
        store_row(op + b * q_rows * d, o, q_rows * d);
      }
    }
  });
}

at::Tensor decode_attention_rows(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                 const at::Tensor& slots, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(attention_dtype_ok(q) && k_pool.scalar_type() == q.scalar_type() &&
                  v_pool.scalar_type() == q.scalar_type() && k_pool.device().is_cpu() && v_pool.device().is_cpu(),
              "decode_attention_rows: q, k_pool and v_pool must be CPU tensors, all float32 or all bfloat16");
  TORCH_CHECK(q.dim() == 4 && k_pool.dim() == 3 && v_pool.sizes() == k_pool.sizes(),
              "decode_attention_rows: q must be [bs, kv_heads, group, D] and k_pool, v_pool [slots, kv_heads, D], got ",
              q.sizes(), ", ", k_pool.sizes(), ", ", v_pool.sizes());
  const int64_t bs = q.size(0), heads = q.size(1), group = q.size(2), d = q.size(3);
  TORCH_CHECK(k_pool.size(1) == heads && k_pool.size(2) == d, "decode_attention_rows: k_pool ", k_pool.sizes(),
              " does not match q ", q.sizes());
  TORCH_CHECK(k_pool.stride(2) == 1 && v_pool.stride(2) == 1 && k_pool.stride(1) == d && v_pool.stride(1) == d,
              "decode_attention_rows: k_pool and v_pool need contiguous [kv_heads, D] rows");
  TORCH_CHECK(slots.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong && slots.dim() == 2 &&
                  seq_lens.dim() == 1 && slots.size(0) == bs && seq_lens.size(0) == bs && slots.stride(1) == 1 &&
                  slots.device().is_cpu() && seq_lens.device().is_cpu(),
              "decode_attention_rows: slots must be int64 [bs, len] with contiguous rows and seq_lens int64 [bs], got ",
              slots.scalar_type(), " ", slots.sizes(), ", ", seq_lens.scalar_type(), " ", seq_lens.sizes());
  // A request's query heads must be one packed run; the requests themselves may be strided (q a view of
  // the projection's output, whose rows also hold k and v).
  const bool packed = q.stride(3) == 1 && (group == 1 || q.stride(2) == d) && (heads == 1 || q.stride(1) == group * d);
  const at::Tensor qc = packed ? q : q.contiguous(), lens = seq_lens.contiguous();
  const int64_t qs = qc.stride(0);
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t pool_slots = k_pool.size(0);
  const int64_t *sp = slots.data_ptr<int64_t>(), s0 = slots.stride(0);
  for (int64_t b = 0; b < bs; ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= slots.size(1), "decode_attention_rows: seq_lens[", b, "] = ", lp[b],
                " is outside [1, ", slots.size(1), "]");
    for (int64_t t = 0; t < lp[b]; ++t) {
      TORCH_CHECK(sp[b * s0 + t] >= 0 && sp[b * s0 + t] < pool_slots, "decode_attention_rows: slot ",
                  sp[b * s0 + t], " of request ", b, " is outside the pool's ", pool_slots);
    }
  }
  at::Tensor out = at::empty({bs, heads * group * d}, qc.options());
  const float sc = static_cast<float>(scale);
  if (q.scalar_type() == at::kFloat) {
    attend_rows(qc.data_ptr<float>(), qs, kv_data<float>(k_pool), k_pool.stride(0), kv_data<float>(v_pool),
                v_pool.stride(0), sp, s0, lp, out.data_ptr<float>(), bs, heads, group, d, sc);
    return out;
  }
  attend_rows(kv_data<uint16_t>(qc), qs, kv_data<uint16_t>(k_pool), k_pool.stride(0), kv_data<uint16_t>(v_pool),
              v_pool.stride(0), sp, s0, lp, reinterpret_cast<uint16_t*>(out.data_ptr()), bs, heads, group, d, sc);
  return out;
}

#ifdef RS_X86
using radixserve_cpu_vec::exp16;

__attribute__((target("avx512f"))) void softmax_weights_avx512(float* p, int64_t len, float scale, float* total) {
  // The scaled scores' maximum on 16 lanes: max_ps(x, m) keeps m where x is NaN, as std::max(m, x) does (the
  // scalar loop's one dependent compare per score was most of this function's time).
  __m512 mx = _mm512_set1_ps(-INFINITY);
  const __m512 sv = _mm512_set1_ps(scale);
  for (int64_t t = 0; t < len; t += 16) {
    const __mmask16 live = len - t >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (len - t)) - 1u);
    const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(live, p + t), sv);
    _mm512_mask_storeu_ps(p + t, live, x);
    mx = _mm512_mask_max_ps(mx, live, x, mx);
  }
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, mx);
  float m = -INFINITY;
  for (int i = 0; i < 16; ++i) m = std::max(m, lanes[i]);
  const __m512 mv = _mm512_set1_ps(m);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t t = 0; t < len; t += 16) {
    const __mmask16 live = len - t >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (len - t)) - 1u);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, p + t), mv));
    _mm512_mask_storeu_ps(p + t, live, e);
    acc = _mm512_mask_add_ps(acc, live, acc, e);
  }
  *total = _mm512_reduce_add_ps(acc);
}

template <typename T>
__attribute__((target("avx512f"))) void add_scaled_rows_avx512(
    float* o, const T* v, int64_t vs, const float* p, int64_t len, int64_t d) {
  for (int64_t i = 0; i < d; i += 16) {
    const __mmask16 live = d - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (d - i)) - 1u);
    __m512 a = _mm512_setzero_ps();
    for (int64_t t = 0; t < len; ++t) a = _mm512_fmadd_ps(_mm512_set1_ps(p[t]), load16(v + t * vs + i, live), a);
    _mm512_mask_storeu_ps(o + i, live, a);
  }
}

// gather_scores / gather_add_rows on 16 lanes, for D a multiple of 16.
template <typename T>
__attribute__((target("avx512f"))) void gather_scores_avx512(const T* k, int64_t ks, const int64_t* sl, int64_t len,
                                                            const float* q, int64_t rows, int64_t group, int64_t d,
                                                            float* p) {
  const int64_t d64 = d - d % 64;
  for (int64_t t = 0; t < len; ++t) {
    const T* row = k + sl[t] * ks;
    for (int64_t h = 0; h < rows; ++h) {
      const T* kh = row + h * d;
      for (int64_t j = 0; j < group; ++j) {
        const float* qj = q + (h * group + j) * d;
        // rows_avx512's accumulators and order (a lone request's scores come from it: the same bits).
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
        int64_t i = 0;
        for (; i < d64; i += 64) {
          a0 = _mm512_fmadd_ps(load16(kh + i), _mm512_loadu_ps(qj + i), a0);
          a1 = _mm512_fmadd_ps(load16(kh + i + 16), _mm512_loadu_ps(qj + i + 16), a1);
          a2 = _mm512_fmadd_ps(load16(kh + i + 32), _mm512_loadu_ps(qj + i + 32), a2);
          a3 = _mm512_fmadd_ps(load16(kh + i + 48), _mm512_loadu_ps(qj + i + 48), a3);
        }
        for (; i < d; i += 16) a0 = _mm512_fmadd_ps(load16(kh + i), _mm512_loadu_ps(qj + i), a0);
        p[(h * group + j) * len + t] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
      }
    }
  }
}

template <typename T>
__attribute__((target("avx512f"))) void gather_add_rows_avx512(float* o, const T* v, int64_t vs, const int64_t* sl,
                                                              const float* p, int64_t len, int64_t rows, int64_t group,
                                                              int64_t d) {
  std::fill(o, o + rows * group * d, 0.0f);
  for (int64_t t = 0; t < len; ++t) {
    const T* row = v + sl[t] * vs;
    for (int64_t h = 0; h < rows; ++h) {
      for (int64_t i = 0; i < d; i += 16) {
        const __m512 x = load16(row + h * d + i);
        for (int64_t j = 0; j < group; ++j) {
          float* oj = o + (h * group + j) * d + i;
          _mm512_storeu_ps(oj, _mm512_fmadd_ps(_mm512_set1_ps(p[(h * group + j) * len + t]), x, _mm512_loadu_ps(oj)));
        }
      }
    }
  }
}

// The same four on 8 lanes (AVX2 + FMA), for D a multiple of 8 where a row's lanes are read; the softmax's
// tail takes its lanes from a padded copy, so no read passes the end.
using radixserve_cpu_vec::exp8;

__attribute__((target("avx2,fma"))) inline __m256 lanes_below(int64_t n) {
  return _mm256_cmp_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_ps(static_cast<float>(n)), _CMP_LT_OQ);
}

__attribute__((target("avx2,fma"))) void softmax_weights_avx2(float* p, int64_t len, float scale, float* total) {
  const __m256 sv = _mm256_set1_ps(scale);
  const int64_t lv = len - len % 8;
  __m256 mx = _mm256_set1_ps(-INFINITY);
  for (int64_t t = 0; t < lv; t += 8) {
    const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(p + t), sv);
    _mm256_storeu_ps(p + t, x);
    mx = _mm256_max_ps(x, mx);  // keeps mx where x is NaN, as std::max(m, x) does
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mx);
  float m = -INFINITY;
  for (int i = 0; i < 8; ++i) m = std::max(m, lanes[i]);
  for (int64_t t = lv; t < len; ++t) m = std::max(m, p[t] *= scale);
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t t = 0; t < lv; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + t), mv));
    _mm256_storeu_ps(p + t, e);
    acc = _mm256_add_ps(acc, e);
  }
  if (lv < len) {
    alignas(32) float part[8] = {};
    std::copy(p + lv, p + len, part);
    const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_load_ps(part), mv)), lanes_below(len - lv));
    _mm256_store_ps(part, e);
    std::copy(part, part + (len - lv), p + lv);
    acc = _mm256_add_ps(acc, e);
  }
  *total = hsum256(acc);
}

template <typename T>
__attribute__((target("avx2,fma"))) void add_scaled_rows_avx2(
    float* o, const T* v, int64_t vs, const float* p, int64_t len, int64_t d) {
  for (int64_t i = 0; i < d; i += 8) {
    __m256 a = _mm256_setzero_ps();
    for (int64_t t = 0; t < len; ++t) a = _mm256_fmadd_ps(_mm256_set1_ps(p[t]), load8(v + t * vs + i), a);
    _mm256_storeu_ps(o + i, a);
  }
}

template <typename T>
__attribute__((target("avx2,fma"))) void gather_scores_avx2(const T* k, int64_t ks, const int64_t* sl, int64_t len,
                                                          const float* q, int64_t rows, int64_t group, int64_t d,
                                                          float* p) {
  const int64_t d32 = d - d % 32;
  for (int64_t t = 0; t < len; ++t) {
    const T* row = k + sl[t] * ks;
    for (int64_t h = 0; h < rows; ++h) {
      const T* kh = row + h * d;
      for (int64_t j = 0; j < group; ++j) {
        const float* qj = q + (h * group + j) * d;
        // rows_avx2's accumulators and order (a lone request's scores come from it: the same bits).
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i < d32; i += 32) {
          a0 = _mm256_fmadd_ps(load8(kh + i), _mm256_loadu_ps(qj + i), a0);
          a1 = _mm256_fmadd_ps(load8(kh + i + 8), _mm256_loadu_ps(qj + i + 8), a1);
          a2 = _mm256_fmadd_ps(load8(kh + i + 16), _mm256_loadu_ps(qj + i + 16), a2);
          a3 = _mm256_fmadd_ps(load8(kh + i + 24), _mm256_loadu_ps(qj + i + 24), a3);
        }
        for (; i < d; i += 8) a0 = _mm256_fmadd_ps(load8(kh + i), _mm256_loadu_ps(qj + i), a0);
        p[(h * group + j) * len + t] = hsum256(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
      }
    }
  }
}

template <typename T>
__attribute__((target("avx2,fma"))) void gather_add_rows_avx2(float* o, const T* v, int64_t vs, const int64_t* sl,
                                                            const float* p, int64_t len, int64_t rows, int64_t group,
                                                            int64_t d) {
  std::fill(o, o + rows * group * d, 0.0f);
  for (int64_t t = 0; t < len; ++t) {
    const T* row = v + sl[t] * vs;
    for (int64_t h = 0; h < rows; ++h) {
      for (int64_t i = 0; i < d; i += 8) {
        const __m256 x = load8(row + h * d + i);
        for (int64_t j = 0; j < group; ++j) {
          float* oj = o + (h * group + j) * d + i;
          _mm256_storeu_ps(oj, _mm256_fmadd_ps(_mm256_set1_ps(p[(h * group + j) * len + t]), x, _mm256_loadu_ps(oj)));
        }
      }
    }
  }
}
#endif

bool use_avx512() { return std::string(path().name) == "avx512"; }
bool use_avx2() { return std::string(path().name) == "avx2"; }

void softmax_weights(float* p, int64_t len, float scale, float* total) {
#ifdef RS_X86
  if (use_avx512()) return softmax_weights_avx512(p, len, scale, total);
  if (use_avx2()) return softmax_weights_avx2(p, len, scale, total);
#endif
  float m = -INFINITY;
  for (int64_t t = 0; t < len; ++t) m = std::max(m, p[t] *= scale);
  float sum = 0.0f;
  for (int64_t t = 0; t < len; ++t) sum += (p[t] = std::exp(p[t] - m));
  *total = sum;
}

template <typename T>
void add_scaled_rows(float* o, const T* v, int64_t vs, const float* p, int64_t len, int64_t d) {
#ifdef RS_X86
  if (use_avx512()) return add_scaled_rows_avx512(o, v, vs, p, len, d);
  if (use_avx2() && d % 8 == 0) return add_scaled_rows_avx2(o, v, vs, p, len, d);
#endif
  std::fill(o, o + d, 0.0f);
  for (int64_t t = 0; t < len; ++t) {
    for (int64_t i = 0; i < d; ++i) o[i] += p[t] * widen(v[t * vs + i]);
  }
}

template <typename T>
void gather_scores(const T* k, int64_t ks, const int64_t* sl, int64_t len, const float* q, int64_t rows,
                   int64_t group, int64_t d, float* p) {
#ifdef RS_X86
  if (use_avx512() && d % 16 == 0) return gather_scores_avx512(k, ks, sl, len, q, rows, group, d, p);
  if (use_avx2() && d % 8 == 0) return gather_scores_avx2(k, ks, sl, len, q, rows, group, d, p);
#endif
  for (int64_t t = 0; t < len; ++t) {
    const T* row = k + sl[t] * ks;
    for (int64_t r = 0; r < rows * group; ++r) p[r * len + t] = dot_portable(row + (r / group) * d, q + r * d, d);
  }
}

template <typename T>
void gather_add_rows(float* o, const T* v, int64_t vs, const int64_t* sl, const float* p, int64_t len,
                     int64_t rows, int64_t group, int64_t d) {
#ifdef RS_X86
  if (use_avx512() && d % 16 == 0) return gather_add_rows_avx512(o, v, vs, sl, p, len, rows, group, d);
  if (use_avx2() && d % 8 == 0) return gather_add_rows_avx2(o, v, vs, sl, p, len, rows, group, d);
#endif
  std::fill(o, o + rows * group * d, 0.0f);
  for (int64_t t = 0; t < len; ++t) {
    const T* row = v + sl[t] * vs;
    for (int64_t r = 0; r < rows * group; ++r) {
      const T* vh = row + (r / group) * d;
      for (int64_t i = 0; i < d; ++i) o[r * d + i] += p[r * len + t] * widen(vh[i]);
    }
  }
}

// The path of this CPU named `isa`; an error naming the ones it has where there is none.
Path named_path(const std::string& isa) {
  std::string names;
  for (const Path& p : cpu_paths()) {
    if (isa == p.name) return p;
    names += names.empty() ? p.name : std::string(", ") + p.name;
  }
  TORCH_CHECK(false, "matvec: this CPU has no '", isa, "' path (it has: ", names, ")");
}

// Makes every later product and vector step use `isa` (tests and benchmarks: each path on one CPU), the
// single-row products' own choice (use_product_isa) dropped; returns the one before.
std::string use_matvec_isa(const std::string& isa) {
  const Path chosen = named_path(isa);
  std::string before = path().name;
  path() = chosen;
  product_override().reset();
  return before;
}

// Makes the single-row products (only) use `isa`, "" for path()'s; returns the one they used before.
std::string use_product_isa(const std::string& isa) {
  std::string before = product_path().name;
  if (isa.empty()) {
    product_override().reset();
  } else {
    product_override() = named_path(isa);
  }
  return before;
}

std::string product_isa() { return product_path().name; }

// Sets the prefetch distance of a lone stream (prefetch_bytes: bytes for a float32 weight, -1 for the base
// distance, RS_CPU_PREFETCH_BYTES or the CPU's default); returns the one before. The arithmetic is the same
// either way: only when the weight's lines are asked for changes.
int64_t use_alone_prefetch(int64_t bytes) {
  TORCH_CHECK(bytes >= -1 && bytes <= (1 << 20), "use_alone_prefetch: bytes must be -1 to 1 MiB, got ", bytes);
  return alone_prefetch().exchange(bytes);
}

// [the base distance (RS_CPU_PREFETCH_BYTES or the CPU's default), the lone stream's (-1: the base)].
std::vector<int64_t> prefetch_setting() { return {base_prefetch_bytes(), alone_prefetch().load()}; }

std::vector<std::string> matvec_isas() {
  std::vector<std::string> names;
  for (const Path& p : cpu_paths()) names.emplace_back(p.name);
  return names;
}

// Starts `count` row helpers for the single-row products (ending those before; 0: none); returns their
// kernel thread ids, which the caller places and counts as the rank's own. `delay_us` (tests) makes each
// helper sleep that long after claiming every chunk, as one the kernel preempted would.
std::vector<int64_t> set_row_helpers(int64_t count, int64_t delay_us) {
  TORCH_CHECK(count >= 0 && count <= 1024, "set_row_helpers: count must be in [0, 1024], got ", count);
  TORCH_CHECK(delay_us >= 0 && delay_us <= 1000000, "set_row_helpers: delay_us must be in [0, 1e6], got ", delay_us);
  return radixserve_cpu_helpers::RowHelpers::get().resize(static_cast<int>(count), delay_us, [] {
    for (ProductSlot& slot : product_slots()) slot = ProductSlot{};  // the weights held for late helpers
    radixserve_cpu_panels::clear_helper_slots();
  });
}

// [chunks computed by helpers, chunks taken over from a thread that claimed them, CPU nanoseconds the
// helpers spent inside products] since the process began.
std::vector<int64_t> row_helper_stats() {
  const radixserve_cpu_helpers::RowHelpers& helpers = radixserve_cpu_helpers::RowHelpers::get();
  const auto [helped, taken] = helpers.stats();
  return {helped, taken, helpers.busy_ns()};
}

}  // namespace

// rows.cpp's vector paths follow the products' choice (use_matvec_isa switches both).
namespace radixserve_cpu_paths {
bool avx512() { return use_avx512(); }
bool avx2() { return use_avx2(); }
}  // namespace radixserve_cpu_paths

TORCH_LIBRARY(radixserve_cpu, m) {
  m.def("matvec(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def("rmsnorm_matvec(Tensor x, Tensor? residual, Tensor norm_weight, float eps, Tensor weight) -> (Tensor, Tensor)");
  m.def("silu_mul_matvec(Tensor gate_up, Tensor weight) -> Tensor");
  m.def("decode_attention_row(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
  m.def("decode_attention_rows(Tensor q, Tensor k_pool, Tensor v_pool, Tensor slots, Tensor seq_lens, float scale) -> Tensor");
  m.def("matvec_isa() -> str", &matvec_isa);
  m.def("use_matvec_isa(str isa) -> str", &use_matvec_isa);
  m.def("use_product_isa(str isa) -> str", &use_product_isa);
  m.def("matvec_isas() -> str[]", &matvec_isas);
  m.def("product_isa() -> str", &product_isa);
  m.def("use_alone_prefetch(int bytes) -> int", &use_alone_prefetch);
  m.def("matvec_alone(Tensor x, Tensor weight) -> Tensor");
  m.def("prefetch_setting() -> int[]", &prefetch_setting);
  m.def("set_row_helpers(int count, int delay_us=0) -> int[]", &set_row_helpers);
  m.def("row_helper_stats() -> int[]", &row_helper_stats);
}

TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) {
  m.impl("matvec", &matvec);
  m.impl("matvec_alone", &matvec_alone);
  m.impl("rmsnorm_matvec", &rmsnorm_matvec);
  m.impl("silu_mul_matvec", &silu_mul_matvec);
  m.impl("decode_attention_row", &decode_attention_row);
  m.impl("decode_attention_rows", &decode_attention_rows);
}
