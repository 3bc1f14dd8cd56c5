// exp on 16 float lanes for the CPU library's AVX-512 paths (matvec.cpp's softmax, rows.cpp's SiLU).
#pragma once

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

namespace radixserve_cpu_vec {

// exp on 16 lanes, within ~2 ulp of expf: x = n ln2 + r (ln2 in two parts, so r is exact enough),
// exp(r) by Cephes' expf polynomial, times 2^n (scalef). Arguments are clamped to [-103.97, 88.72]: below,
// 0's neighbourhood as expf gives; above, +inf after the scaling, as expf overflows.
__attribute__((target("avx512f"))) inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-103.97208f)), _mm512_set1_ps(88.72284f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

}  // namespace radixserve_cpu_vec
#endif
