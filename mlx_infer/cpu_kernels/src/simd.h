// The few AVX2 helpers the kernels share (build.py compiles these only for CPUs with AVX2 + FMA).
#pragma once

#include <immintrin.h>

#include <algorithm>

namespace mlx_infer {
// Internal linkage: the int8 kernels are built several times with different target flags (CMakeLists),
// and one shared inline copy compiled with AVX-512 could be the one every build links to.
namespace {

// The largest of x[0..n), n > 0, eight lanes at a time: a max is exact in any order, and the scalar
// loop's chain of dependent maxima cost a tenth of a decode step's attention.
inline float max_of(const float* x, int n) {
  int i = 0;
  float m = x[0];
  if (n >= 8) {
    __m256 v = _mm256_loadu_ps(x);
    for (i = 8; i + 8 <= n; i += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(x + i));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    m = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  }
  for (; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v);
  __m128 hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

// Dot product of two float vectors whose length is a multiple of 8.
inline float dot(const float* a, const float* b, int n) {
  __m256 acc0 = _mm256_setzero_ps();
  __m256 acc1 = _mm256_setzero_ps();
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i < n; i += 8) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  }
  return hsum(_mm256_add_ps(acc0, acc1));
}

// y += b * x over a length that is a multiple of 8.
inline void add_scaled(float* y, const float* x, float b, int n) {
  const __m256 vb = _mm256_set1_ps(b);
  for (int i = 0; i < n; i += 8) {
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(_mm256_loadu_ps(x + i), vb, _mm256_loadu_ps(y + i)));
  }
}

// exp of 8 floats (Cephes' single-precision exp: x = n ln2 + r, |r| <= ln2 / 2, a degree-5 polynomial
// in r, then scaled by 2^n; relative error ~2e-7). Inputs are clamped to [-87.3, 88.7], so very
// negative ones give ~1e-38 rather than 0.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.7f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // r = x - n ln2, with ln2 split in two so that n * ln2_hi is exact.
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(pow2n));
}

}  // namespace
}  // namespace mlx_infer
