// Causal attention of a prefill (extend) batch on the CPU, float32, each request's keys and values read
// straight from the pool through its slots (no gathered, transposed or head-repeated copy):
//
//   out = extend_attention_rows(q, k_pool, v_pool, slots, seq_lens, q_lens, scale)
//
// q [T, kv_heads, group, D] (T = sum(q_lens); its token rows may be strided, a view of the QKV projection's
// output), k_pool / v_pool [slots, kv_heads, D] with contiguous [kv_heads, D] rows, slots [bs, >= seq_len]
// int64, seq_lens and q_lens [bs] int64. Request b's new tokens are its last q_lens[b] positions; new token i
// sits at position seq_len - q_len + i and attends to keys 0 .. that position. out [T, kv_heads * group * D]
// (query head h * group + j attends with KV head h, HF's order).
//
// torch's SDPA on the CPU (flash attention for CPU) ran a 256-token SmolLM2 prompt at ~43 GFLOP/s on one
// thread (1.7 ms a layer), and its batched products reach ~110 GFLOP/s at a head's K = 64; the work
// here is organised so that neither K nor V is copied: a task is one request's KV head and a block of its
// new tokens, whose query rows (token, group member) are the 16 lanes of a vector. Scores come out keys by
// rows (S^T): for each of D steps a vector of Q^T (the block's queries, packed once, pre-scaled) times a
// broadcast of each key's element, read in place from the pool; the online softmax works lane-wise (each
// lane its own row's running max and sum), and the output accumulates as O^T [D, rows], each value
// element broadcast from the pool times the vector of the rows' weights.
//
// Keys go in blocks of 64 at absolute positions (0-63, 64-127, ...), and lanes never mix, so a query row's
// result is the same sequence of operations whatever other rows share its task: the same bits alone or
// batched, chunked or not. A row's blocks past its own position are entirely masked and leave it unchanged
// (max unchanged, correction exp(0) = 1, weights exactly 0). The portable path (any CPU) attends one query
// row at a time, two-pass softmax; it is the reference for tests and the fallback, not a fast path (callers
// use this op only on AVX-512 and AVX2, kernels/cpu_matvec.py's extend_attention()). AVX2 takes the same
// steps on 8-lane vectors (below).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define RS_X86 1
#endif

#include "exp16.h"

namespace radixserve_cpu_paths {
bool avx512();  // matvec.cpp: whether the library's chosen path is AVX-512 (use_matvec_isa switches it)
bool avx2();    // ... or AVX2 + FMA
}  // namespace radixserve_cpu_paths

namespace {

// Query rows a task holds (lanes): three vectors of 16.
constexpr int64_t kRows = 48;
// Keys per softmax block, and per scores tile.
constexpr int64_t kBlock = 64;
constexpr int64_t kKeys = 8;

struct Geometry {
  int64_t heads, group, d;
  const float *q, *k, *v;
  int64_t qs, ks, vs;  // strides of q's token rows, and of the pools' slot rows
  float* out;
  int64_t os;  // out's token stride
  float scale;
};

// One task: request b's KV head h, its new tokens [t0, t1) (offsets into the request's new tokens), whose
// first new token is q's token row `first`, at position prefix + t.
struct Task {
  int64_t first, prefix, t0, t1, head;
  const int64_t* slots;
};

void portable_task(const Geometry& g, const Task& task) {
  std::vector<float> p;
  for (int64_t t = task.t0; t < task.t1; ++t) {
    const int64_t len = task.prefix + t + 1;
    p.resize(len);
    for (int64_t j = 0; j < g.group; ++j) {
      const int64_t head = task.head * g.group + j;
      const float* q = g.q + (task.first + t) * g.qs + head * g.d;
      float m = -INFINITY;
      for (int64_t s = 0; s < len; ++s) {
        const float* k = g.k + task.slots[s] * g.ks + task.head * g.d;
        float acc = 0.0f;
        for (int64_t i = 0; i < g.d; ++i) acc += q[i] * k[i];
        p[s] = acc * g.scale;
        m = std::max(m, p[s]);
      }
      float total = 0.0f;
      for (int64_t s = 0; s < len; ++s) total += (p[s] = std::exp(p[s] - m));
      float* o = g.out + (task.first + t) * g.os + head * g.d;
      std::fill(o, o + g.d, 0.0f);
      for (int64_t s = 0; s < len; ++s) {
        const float* v = g.v + task.slots[s] * g.vs + task.head * g.d;
        for (int64_t i = 0; i < g.d; ++i) o[i] += p[s] * v[i];
      }
      for (int64_t i = 0; i < g.d; ++i) o[i] /= total;
    }
  }
}

#ifdef RS_X86
using radixserve_cpu_vec::exp16;

// Scores of kKeys keys (rows `keys[0..7]` of the pool, this head's D values each) against NR vectors of
// query rows: s[j * NR + r] = sum_i qt[i][r] * key_j[i] (qt: [D][NR * 16], scaled).
template <int NR>
__attribute__((target("avx512f"))) inline void scores_tile(const float* qt, int64_t d, const float* const* keys,
                                                          __m512* s) {
  __m512 acc[kKeys][NR];
  for (int j = 0; j < kKeys; ++j)
    for (int r = 0; r < NR; ++r) acc[j][r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; ++i) {
    __m512 qv[NR];
    for (int r = 0; r < NR; ++r) qv[r] = _mm512_loadu_ps(qt + i * NR * 16 + r * 16);
    for (int j = 0; j < kKeys; ++j) {
      const __m512 kb = _mm512_set1_ps(keys[j][i]);
      for (int r = 0; r < NR; ++r) acc[j][r] = _mm512_fmadd_ps(qv[r], kb, acc[j][r]);
    }
  }
  for (int j = 0; j < kKeys; ++j)
    for (int r = 0; r < NR; ++r) s[j * NR + r] = acc[j][r];
}

// ot[i][r] += sum_j p[j][r] * value_j[i] for 8 of the D values (i0 .. i0 + 7), over n keys.
template <int NR>
__attribute__((target("avx512f"))) inline void values_tile(float* ot, int64_t i0, const __m512* p,
                                                          const float* const* values, int64_t n) {
  __m512 acc[8][NR];
  for (int i = 0; i < 8; ++i)
    for (int r = 0; r < NR; ++r) acc[i][r] = _mm512_loadu_ps(ot + (i0 + i) * NR * 16 + r * 16);
  for (int64_t j = 0; j < n; ++j) {
    const float* v = values[j] + i0;
    for (int i = 0; i < 8; ++i) {
      const __m512 vb = _mm512_set1_ps(v[i]);
      for (int r = 0; r < NR; ++r) acc[i][r] = _mm512_fmadd_ps(p[j * NR + r], vb, acc[i][r]);
    }
  }
  for (int i = 0; i < 8; ++i)
    for (int r = 0; r < NR; ++r) _mm512_storeu_ps(ot + (i0 + i) * NR * 16 + r * 16, acc[i][r]);
}

template <int NR>
__attribute__((target("avx512f"))) void avx512_rows(const Geometry& g, const Task& task, int64_t t0, int64_t t1,
                                                    std::vector<float>& buffer) {
  const int64_t d = g.d, group = g.group, lanes = NR * 16;
  const int64_t rows = (t1 - t0) * group;
  buffer.assign(static_cast<size_t>(2 * d * lanes), 0.0f);
  float* qt = buffer.data();  // [D][lanes], scaled queries; padding lanes stay 0
  float* ot = qt + d * lanes;  // [D][lanes]
  alignas(64) float pos[kRows];
  for (int64_t r = 0; r < lanes; ++r) {
    if (r < rows) {
      const int64_t t = t0 + r / group, j = r % group;
      const float* q = g.q + (task.first + t) * g.qs + (task.head * group + j) * d;
      for (int64_t i = 0; i < d; ++i) qt[i * lanes + r] = q[i] * g.scale;
      pos[r] = static_cast<float>(task.prefix + t);
    } else {
      pos[r] = static_cast<float>(task.prefix + t1 - 1);  // padding: sees what the last row sees
    }
  }
  __m512 rowpos[NR], m[NR], l[NR];
  for (int r = 0; r < NR; ++r) {
    rowpos[r] = _mm512_loadu_ps(pos + r * 16);
    m[r] = _mm512_set1_ps(-INFINITY);
    l[r] = _mm512_setzero_ps();
  }
  const int64_t lowest = task.prefix + t0, end = task.prefix + t1;  // keys [0, end)
  const float* keys[kBlock];
  const float* values[kBlock];
  alignas(64) __m512 s[kBlock * NR];
  for (int64_t b0 = 0; b0 < end; b0 += kBlock) {
    const int64_t n = std::min(kBlock, end - b0);
    const int64_t chunks = (n + kKeys - 1) / kKeys;
    for (int64_t j = 0; j < chunks * kKeys; ++j) {
      const int64_t slot = task.slots[b0 + std::min(j, n - 1)];  // past n: a real row, masked below
      keys[j] = g.k + slot * g.ks + task.head * d;
      values[j] = g.v + slot * g.vs + task.head * d;
    }
    for (int64_t c = 0; c < chunks; ++c) scores_tile<NR>(qt, d, keys + c * kKeys, s + c * kKeys * NR);
    // Mask keys past each row's position (only where some row's position is below the block's last key).
    __m512 block_max[NR];
    for (int r = 0; r < NR; ++r) block_max[r] = _mm512_set1_ps(-INFINITY);
    const bool masked = b0 + chunks * kKeys - 1 > lowest;
    for (int64_t j = 0; j < chunks * kKeys; ++j) {
      const __m512 kpos = _mm512_set1_ps(static_cast<float>(j < n ? b0 + j : INFINITY));
      for (int r = 0; r < NR; ++r) {
        __m512& x = s[j * NR + r];
        if (masked) x = _mm512_mask_mov_ps(x, _mm512_cmp_ps_mask(kpos, rowpos[r], _CMP_GT_OQ), _mm512_set1_ps(-INFINITY));
        block_max[r] = _mm512_max_ps(block_max[r], x);
      }
    }
    __m512 alpha[NR], total[NR];
    bool rescale = false;
    for (int r = 0; r < NR; ++r) {
      const __m512 m_new = _mm512_max_ps(m[r], block_max[r]);
      // The first block holds key 0, which every row sees, so m_new is finite; a row that sees nothing here
      // keeps m and gets exp(0) = 1.
      alpha[r] = exp16(_mm512_sub_ps(m[r], m_new));
      rescale |= b0 > 0;
      m[r] = m_new;
      total[r] = _mm512_setzero_ps();
    }
    for (int64_t j = 0; j < chunks * kKeys; ++j) {
      for (int r = 0; r < NR; ++r) {
        __m512& x = s[j * NR + r];
        const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
        x = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(x, m[r])));
        total[r] = _mm512_add_ps(total[r], x);
      }
    }
    for (int r = 0; r < NR; ++r) l[r] = _mm512_add_ps(_mm512_mul_ps(l[r], alpha[r]), total[r]);
    if (rescale) {
      for (int64_t i = 0; i < d; ++i)
        for (int r = 0; r < NR; ++r)
          _mm512_storeu_ps(ot + i * lanes + r * 16, _mm512_mul_ps(_mm512_loadu_ps(ot + i * lanes + r * 16), alpha[r]));
    }
    for (int64_t i0 = 0; i0 < d; i0 += 8) values_tile<NR>(ot, i0, s, values, n);
  }
  alignas(64) float inv[kRows];
  for (int r = 0; r < NR; ++r) _mm512_storeu_ps(inv + r * 16, _mm512_div_ps(_mm512_set1_ps(1.0f), l[r]));
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = t0 + r / group, j = r % group;
    float* o = g.out + (task.first + t) * g.os + (task.head * group + j) * d;
    for (int64_t i = 0; i < d; ++i) o[i] = ot[i * lanes + r] * inv[r];
  }
}

__attribute__((target("avx512f"))) void avx512_task(const Geometry& g, const Task& task, std::vector<float>& buffer) {
  // Up to kRows query rows at a time: whole tokens of the group.
  const int64_t tokens = std::max<int64_t>(1, kRows / g.group);
  for (int64_t t0 = task.t0; t0 < task.t1; t0 += tokens) {
    const int64_t t1 = std::min(task.t1, t0 + tokens);
    const int64_t rows = (t1 - t0) * g.group;
    if (rows > kRows) {  // a group wider than kRows: one token, its group in slices
      portable_task(g, Task{task.first, task.prefix, t0, t1, task.head, task.slots});
      continue;
    }
    if (rows <= 16) avx512_rows<1>(g, task, t0, t1, buffer);
    else if (rows <= 32) avx512_rows<2>(g, task, t0, t1, buffer);
    else avx512_rows<3>(g, task, t0, t1, buffer);
  }
}

// The same steps on 8-lane vectors (AVX2 + FMA), sized for its 16 registers: up to 24 query rows (three
// vectors) a sub-task, scores tiles of 4 keys, value tiles of 4 D values. Keys still go in blocks of 64 at
// absolute positions and lanes never mix, so a row's bits are the same alone, batched or chunked here too.
using radixserve_cpu_vec::exp8;

constexpr int64_t kRows8 = 24;
constexpr int64_t kKeys8 = 4;

template <int NR>
__attribute__((target("avx2,fma"))) inline void scores_tile8(const float* qt, int64_t d, const float* const* keys,
                                                           __m256* s) {
  __m256 acc[kKeys8][NR];
  for (int j = 0; j < kKeys8; ++j)
    for (int r = 0; r < NR; ++r) acc[j][r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; ++i) {
    __m256 qv[NR];
    for (int r = 0; r < NR; ++r) qv[r] = _mm256_loadu_ps(qt + i * NR * 8 + r * 8);
    for (int j = 0; j < kKeys8; ++j) {
      const __m256 kb = _mm256_set1_ps(keys[j][i]);
      for (int r = 0; r < NR; ++r) acc[j][r] = _mm256_fmadd_ps(qv[r], kb, acc[j][r]);
    }
  }
  for (int j = 0; j < kKeys8; ++j)
    for (int r = 0; r < NR; ++r) s[j * NR + r] = acc[j][r];
}

template <int NR>
__attribute__((target("avx2,fma"))) inline void values_tile8(float* ot, int64_t i0, const __m256* p,
                                                           const float* const* values, int64_t n) {
  __m256 acc[4][NR];
  for (int i = 0; i < 4; ++i)
    for (int r = 0; r < NR; ++r) acc[i][r] = _mm256_loadu_ps(ot + (i0 + i) * NR * 8 + r * 8);
  for (int64_t j = 0; j < n; ++j) {
    const float* v = values[j] + i0;
    for (int i = 0; i < 4; ++i) {
      const __m256 vb = _mm256_set1_ps(v[i]);
      for (int r = 0; r < NR; ++r) acc[i][r] = _mm256_fmadd_ps(p[j * NR + r], vb, acc[i][r]);
    }
  }
  for (int i = 0; i < 4; ++i)
    for (int r = 0; r < NR; ++r) _mm256_storeu_ps(ot + (i0 + i) * NR * 8 + r * 8, acc[i][r]);
}

template <int NR>
__attribute__((target("avx2,fma"))) void avx2_rows(const Geometry& g, const Task& task, int64_t t0, int64_t t1,
                                                  std::vector<float>& buffer) {
  const int64_t d = g.d, group = g.group, lanes = NR * 8;
  const int64_t rows = (t1 - t0) * group;
  buffer.assign(static_cast<size_t>(2 * d * lanes), 0.0f);
  float* qt = buffer.data();  // [D][lanes], scaled queries; padding lanes stay 0
  float* ot = qt + d * lanes;  // [D][lanes]
  alignas(32) float pos[kRows8];
  for (int64_t r = 0; r < lanes; ++r) {
    if (r < rows) {
      const int64_t t = t0 + r / group, j = r % group;
      const float* q = g.q + (task.first + t) * g.qs + (task.head * group + j) * d;
      for (int64_t i = 0; i < d; ++i) qt[i * lanes + r] = q[i] * g.scale;
      pos[r] = static_cast<float>(task.prefix + t);
    } else {
      pos[r] = static_cast<float>(task.prefix + t1 - 1);  // padding: sees what the last row sees
    }
  }
  const __m256 neg_inf = _mm256_set1_ps(-INFINITY);
  __m256 rowpos[NR], m[NR], l[NR];
  for (int r = 0; r < NR; ++r) {
    rowpos[r] = _mm256_loadu_ps(pos + r * 8);
    m[r] = neg_inf;
    l[r] = _mm256_setzero_ps();
  }
  const int64_t lowest = task.prefix + t0, end = task.prefix + t1;  // keys [0, end)
  const float* keys[kBlock];
  const float* values[kBlock];
  alignas(32) __m256 s[kBlock * NR];
  for (int64_t b0 = 0; b0 < end; b0 += kBlock) {
    const int64_t n = std::min(kBlock, end - b0);
    const int64_t chunks = (n + kKeys8 - 1) / kKeys8;
    for (int64_t j = 0; j < chunks * kKeys8; ++j) {
      const int64_t slot = task.slots[b0 + std::min(j, n - 1)];  // past n: a real row, masked below
      keys[j] = g.k + slot * g.ks + task.head * d;
      values[j] = g.v + slot * g.vs + task.head * d;
    }
    for (int64_t c = 0; c < chunks; ++c) scores_tile8<NR>(qt, d, keys + c * kKeys8, s + c * kKeys8 * NR);
    __m256 block_max[NR];
    for (int r = 0; r < NR; ++r) block_max[r] = neg_inf;
    const bool masked = b0 + chunks * kKeys8 - 1 > lowest;
    for (int64_t j = 0; j < chunks * kKeys8; ++j) {
      const __m256 kpos = _mm256_set1_ps(static_cast<float>(j < n ? b0 + j : INFINITY));
      for (int r = 0; r < NR; ++r) {
        __m256& x = s[j * NR + r];
        if (masked) x = _mm256_blendv_ps(x, neg_inf, _mm256_cmp_ps(kpos, rowpos[r], _CMP_GT_OQ));
        block_max[r] = _mm256_max_ps(block_max[r], x);
      }
    }
    __m256 alpha[NR], total[NR];
    const bool rescale = b0 > 0;
    for (int r = 0; r < NR; ++r) {
      const __m256 m_new = _mm256_max_ps(m[r], block_max[r]);
      alpha[r] = exp8(_mm256_sub_ps(m[r], m_new));
      m[r] = m_new;
      total[r] = _mm256_setzero_ps();
    }
    for (int64_t j = 0; j < chunks * kKeys8; ++j) {
      for (int r = 0; r < NR; ++r) {
        __m256& x = s[j * NR + r];
        const __m256 live = _mm256_cmp_ps(x, neg_inf, _CMP_NEQ_OQ);
        x = _mm256_and_ps(exp8(_mm256_sub_ps(x, m[r])), live);
        total[r] = _mm256_add_ps(total[r], x);
      }
    }
    for (int r = 0; r < NR; ++r) l[r] = _mm256_add_ps(_mm256_mul_ps(l[r], alpha[r]), total[r]);
    if (rescale) {
      for (int64_t i = 0; i < d; ++i)
        for (int r = 0; r < NR; ++r)
          _mm256_storeu_ps(ot + i * lanes + r * 8, _mm256_mul_ps(_mm256_loadu_ps(ot + i * lanes + r * 8), alpha[r]));
    }
    for (int64_t i0 = 0; i0 < d; i0 += 4) values_tile8<NR>(ot, i0, s, values, n);
  }
  alignas(32) float inv[kRows8];
  for (int r = 0; r < NR; ++r) _mm256_storeu_ps(inv + r * 8, _mm256_div_ps(_mm256_set1_ps(1.0f), l[r]));
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = t0 + r / group, j = r % group;
    float* o = g.out + (task.first + t) * g.os + (task.head * group + j) * d;
    for (int64_t i = 0; i < d; ++i) o[i] = ot[i * lanes + r] * inv[r];
  }
}

__attribute__((target("avx2,fma"))) void avx2_task(const Geometry& g, const Task& task, std::vector<float>& buffer) {
  const int64_t tokens = std::max<int64_t>(1, kRows8 / g.group);
  for (int64_t t0 = task.t0; t0 < task.t1; t0 += tokens) {
    const int64_t t1 = std::min(task.t1, t0 + tokens);
    const int64_t rows = (t1 - t0) * g.group;
    if (rows > kRows8) {  // a group wider than kRows8: the portable loop
      portable_task(g, Task{task.first, task.prefix, t0, t1, task.head, task.slots});
      continue;
    }
    if (rows <= 8) avx2_rows<1>(g, task, t0, t1, buffer);
    else if (rows <= 16) avx2_rows<2>(g, task, t0, t1, buffer);
    else avx2_rows<3>(g, task, t0, t1, buffer);
  }
}
#endif

at::Tensor extend_attention_rows(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                 const at::Tensor& slots, const at::Tensor& seq_lens, const at::Tensor& q_lens,
                                 double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_pool.scalar_type() == at::kFloat && v_pool.scalar_type() == at::kFloat &&
                  q.device().is_cpu() && k_pool.device().is_cpu() && v_pool.device().is_cpu(),
              "extend_attention_rows: q, k_pool and v_pool must be float32 CPU tensors");
  TORCH_CHECK(q.dim() == 4 && k_pool.dim() == 3 && v_pool.sizes() == k_pool.sizes(),
              "extend_attention_rows: q must be [T, kv_heads, group, D] and k_pool, v_pool [slots, kv_heads, D], got ",
              q.sizes(), ", ", k_pool.sizes(), ", ", v_pool.sizes());
  const int64_t tokens = q.size(0), heads = q.size(1), group = q.size(2), d = q.size(3);
  TORCH_CHECK(k_pool.size(1) == heads && k_pool.size(2) == d, "extend_attention_rows: k_pool ", k_pool.sizes(),
              " does not match q ", q.sizes());
  TORCH_CHECK(k_pool.stride(2) == 1 && v_pool.stride(2) == 1 && k_pool.stride(1) == d && v_pool.stride(1) == d,
              "extend_attention_rows: k_pool and v_pool need contiguous [kv_heads, D] rows");
  TORCH_CHECK(slots.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  q_lens.scalar_type() == at::kLong && slots.dim() == 2 && seq_lens.dim() == 1 && q_lens.dim() == 1 &&
                  seq_lens.size(0) == slots.size(0) && q_lens.size(0) == slots.size(0) && slots.stride(1) == 1 &&
                  slots.device().is_cpu() && seq_lens.device().is_cpu() && q_lens.device().is_cpu(),
              "extend_attention_rows: slots must be int64 [bs, len] with contiguous rows, seq_lens and q_lens int64 [bs], got ",
              slots.sizes(), ", ", seq_lens.sizes(), ", ", q_lens.sizes());
  const bool packed = q.stride(3) == 1 && (group == 1 || q.stride(2) == d) && (heads == 1 || q.stride(1) == group * d);
  const at::Tensor qc = packed ? q : q.contiguous(), lens = seq_lens.contiguous(), news = q_lens.contiguous();
  const int64_t bs = slots.size(0), pool_slots = k_pool.size(0);
  const int64_t *lp = lens.data_ptr<int64_t>(), *np = news.data_ptr<int64_t>(), *sp = slots.data_ptr<int64_t>();
  const int64_t s0 = slots.stride(0);
  int64_t total = 0;
  for (int64_t b = 0; b < bs; ++b) {
    TORCH_CHECK(np[b] >= 1 && np[b] <= lp[b] && lp[b] <= slots.size(1), "extend_attention_rows: request ", b,
                " has q_len ", np[b], " and seq_len ", lp[b], " (need 1 <= q_len <= seq_len <= ", slots.size(1), ")");
    for (int64_t t = 0; t < lp[b]; ++t) {
      TORCH_CHECK(sp[b * s0 + t] >= 0 && sp[b * s0 + t] < pool_slots, "extend_attention_rows: slot ",
                  sp[b * s0 + t], " of request ", b, " is outside the pool's ", pool_slots);
    }
    total += np[b];
  }
  TORCH_CHECK(total == tokens, "extend_attention_rows: q has ", tokens, " token rows but q_lens sum to ", total);
  at::Tensor out = at::empty({tokens, heads * group * d}, q.options());
  const Geometry g{heads, group, d, qc.data_ptr<float>(), k_pool.data_ptr<float>(), v_pool.data_ptr<float>(),
                   qc.stride(0), k_pool.stride(0), v_pool.stride(0), out.data_ptr<float>(), out.stride(0),
                   static_cast<float>(scale)};
  // Tasks of up to 16 tokens a KV head. A block's cost grows with its position, so the blocks are dealt in
  // "zig-zag" order (first, last, second, second last, ...): the threads' contiguous shares of the list
  // then cost about the same.
  const int64_t per_task = 16;
  std::vector<Task> blocks, tasks;
  int64_t first = 0;
  for (int64_t b = 0; b < bs; ++b) {
    const int64_t prefix = lp[b] - np[b];
    for (int64_t t0 = 0; t0 < np[b]; t0 += per_task) {
      for (int64_t h = 0; h < heads; ++h) {
        blocks.push_back(Task{first, prefix, t0, std::min(np[b], t0 + per_task), h, sp + b * s0});
      }
    }
    first += np[b];
  }
  std::stable_sort(blocks.begin(), blocks.end(),
                   [](const Task& a, const Task& b) { return a.prefix + a.t1 < b.prefix + b.t1; });
  for (size_t lo = 0, hi = blocks.size(); lo < hi;) {
    tasks.push_back(blocks[--hi]);
    if (lo < hi) tasks.push_back(blocks[lo++]);
  }
#ifdef RS_X86
  const bool vector512 = radixserve_cpu_paths::avx512() && d % 8 == 0;
  const bool vector2 = !vector512 && radixserve_cpu_paths::avx2() && d % 8 == 0;
#endif
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> buffer;
    for (int64_t i = i0; i < i1; ++i) {
#ifdef RS_X86
      if (vector512) {
        avx512_task(g, tasks[i], buffer);
        continue;
      }
      if (vector2) {
        avx2_task(g, tasks[i], buffer);
        continue;
      }
#endif
      portable_task(g, tasks[i]);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve_cpu, m) {
  m.def(
      "extend_attention_rows(Tensor q, Tensor k_pool, Tensor v_pool, Tensor slots, Tensor seq_lens, Tensor q_lens, "
      "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixserve_cpu, CPU, m) { m.impl("extend_attention_rows", &extend_attention_rows); }
