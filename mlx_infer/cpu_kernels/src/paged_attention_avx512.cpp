// attend_group's two passes over one KV head's rows (paged_attention.cpp) in 512-bit vectors, for CPUs
// with AVX-512, giving the same bits as the 256-bit passes there.
//
// Scores: a key's 16 lanes hold the 256-bit kernel's two accumulators side by side (the values at
// d % 16 < 8 in the low half, d % 16 >= 8 in the high one), each lane the same chain of multiply-adds
// over d, and the lanes are then added pairwise exactly as there (halves, then hsum's order). What
// changes is how many keys share an instruction: the reduction is a transpose of sums (each shuffle
// level halves the lanes of every key), so 16 keys' scores are one vector at the end, where the
// 256-bit kernel reduces four keys a row in 128-bit steps. A query row is one vector of 16 values.
// Values: each output lane is the same chain of multiply-adds over the keys as in 256 bits, a vector
// covering 16 of a row's values, so a 64-value row takes one pass over the keys instead of four.
// The softmax's exponentials: exp8's operations lane for lane, 16 lanes at a time, whose halves are
// added to the 256-bit kernel's eight running sums in turn.
//
// Only KVType is taken from kv_format.h: its inline helpers compiled here with AVX-512 could be the copy
// the 256-bit code links to, so this file has its own loads (simd.h's helpers, hsum here, are each
// file's own).

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "attention_avx512.h"

namespace mlx_infer {
namespace attention_avx512 {

namespace {

// Sixteen values of a head row from value i, as floats.
template <KVType K>
inline __m512 load16(const uint8_t* head, int i) {
  if constexpr (K == KVType::f32) {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(head) + i);
  } else if constexpr (K == KVType::f16) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(head + 2 * i)));
  } else if constexpr (K == KVType::bf16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(head + 2 * i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(head + i))));
  }
}

// Eight values of a head row from value i in the low lanes (a row's last eight when D % 16 == 8); the
// high lanes are zero, and the callers mask them out.
template <KVType K>
inline __m512 load8_low(const uint8_t* head, int i) {
  if constexpr (K == KVType::f32) {
    return _mm512_maskz_loadu_ps(0xff, reinterpret_cast<const float*>(head) + i);
  } else if constexpr (K == KVType::f16) {
    return _mm512_cvtph_ps(_mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(head + 2 * i))));
  } else if constexpr (K == KVType::bf16) {
    const __m256i h = _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(head + 2 * i)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(head + i))));
  }
}

// The factor a row's values are multiplied by: its scale for int8, 1 otherwise (kv_format.h).
template <KVType K>
inline float row_scale(const uint8_t* head, int D) {
  if constexpr (K == KVType::i8) {
    float s;
    std::memcpy(&s, head + D, sizeof s);
    return s;
  } else {
    return 1.0f;
  }
}

// acc[i][r] = the 16 lanes of q_r . k_i (lane l sums the values at d % 16 == l in order of d).
template <KVType K, int RB>
inline void dot4(const float* const* q, const uint8_t* const* k, int D, __m512 (&acc)[4][RB]) {
  for (int i = 0; i < 4; ++i)
    for (int r = 0; r < RB; ++r) acc[i][r] = _mm512_setzero_ps();
  int d = 0;
  for (; d + 16 <= D; d += 16) {
    __m512 kv[4];
    for (int i = 0; i < 4; ++i) kv[i] = load16<K>(k[i], d);
    for (int r = 0; r < RB; ++r) {
      const __m512 qv = _mm512_loadu_ps(q[r] + d);
      for (int i = 0; i < 4; ++i) acc[i][r] = _mm512_fmadd_ps(qv, kv[i], acc[i][r]);
    }
  }
  if (d < D) {  // the last eight values meet the low lanes only, as in the 256-bit kernel's first sum
    __m512 kv[4];
    for (int i = 0; i < 4; ++i) kv[i] = load8_low<K>(k[i], d);
    for (int r = 0; r < RB; ++r) {
      const __m512 qv = _mm512_maskz_loadu_ps(0xff, q[r] + d);
      for (int i = 0; i < 4; ++i) acc[i][r] = _mm512_mask3_fmadd_ps(qv, kv[i], acc[i][r], 0xff);
    }
  }
}

// Four keys' 16 lanes to each key's x = low 128 + high 128 bits of (low 256 + high 256), key i in
// 128-bit lane i: the 256-bit kernel's two accumulators added, then its halves.
inline __m512 fold4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Four fold4 results (keys 4g + i of z[g]) to the 16 keys' sums in order, each (x0 + x2) + (x1 + x3),
// hsum's order.
inline __m512 sum16(const __m512 (&z)[4]) {
  const __m512 z01 = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_ps(z[0], z[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 z23 = _mm512_add_ps(_mm512_shuffle_ps(z[2], z[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_ps(z[2], z[3], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(z01, z23, _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_ps(z01, z23, _MM_SHUFFLE(3, 1, 3, 1)));
  // Lane 4i + g holds key 4g + i.
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, sums);
}

// Scores of keys k[0..n) (1 <= n <= 16) against RB query rows: s[r][i] = (q_r . k_i) * row scale * scale.
// Four keys a step; a last step short of four repeats its last key, whose extra scores are not stored.
template <KVType K, int RB>
void score16(const float* const* q, const uint8_t* const* k, int n, int D, float scale, float* const* s,
             Ahead& ahead) {
  __m512 z[RB][4];
  for (int g = 0; g < 4; ++g) {
    if (4 * g >= n) {
      for (int r = 0; r < RB; ++r) z[r][g] = _mm512_setzero_ps();
      continue;
    }
    const uint8_t* keys[4];
    for (int i = 0; i < 4; ++i) keys[i] = k[std::min(4 * g + i, n - 1)];
    __m512 acc[4][RB];
    dot4<K, RB>(q, keys, D, acc);
    fetch_ahead(ahead, kScoreStepLines);
    for (int r = 0; r < RB; ++r) z[r][g] = fold4(acc[0][r], acc[1][r], acc[2][r], acc[3][r]);
  }
  __m512 factor = _mm512_set1_ps(1.0f);
  if constexpr (K == KVType::i8) {
    alignas(64) float rows[16] = {};
    for (int i = 0; i < n; ++i) rows[i] = row_scale<K>(k[i], D);
    factor = _mm512_load_ps(rows);
  }
  const __mmask16 stored = static_cast<__mmask16>((1u << n) - 1);
  for (int r = 0; r < RB; ++r) {
    __m512 v = sum16(z[r]);
    if constexpr (K == KVType::i8) v = _mm512_mul_ps(v, factor);
    _mm512_mask_storeu_ps(s[r], stored, _mm512_mul_ps(v, _mm512_set1_ps(scale)));
  }
}

template <KVType K, int RB>
void score_rows(const float* const* q, const uint8_t* const* rows, int n, int D, float scale, float* const* s,
                Ahead& ahead) {
  for (int i = 0; i < n; i += 16) {
    float* at[RB];
    for (int r = 0; r < RB; ++r) at[r] = s[r] + i;
    score16<K, RB>(q, rows + i, std::min(16, n - i), D, scale, at, ahead);
  }
}

// out[r][d..d + 16 * DB) = sum_i w[r][i] * v_i[d..] for RB query rows (Low8: only out[r][d..d + 8), the
// rows' last eight values).
template <KVType K, int RB, int DB, bool Low8 = false>
inline void weigh_values(const uint8_t* const* v, const float* const* w, int n, int d, int scale_at,
                         float* const* out, Ahead& ahead) {
  __m512 acc[RB][DB];
  for (int r = 0; r < RB; ++r)
    for (int b = 0; b < DB; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int i = 0; i < n; ++i) {
    __m512 vv[DB];
    for (int b = 0; b < DB; ++b) vv[b] = Low8 ? load8_low<K>(v[i], d) : load16<K>(v[i], d + 16 * b);
    const float row = row_scale<K>(v[i], scale_at);
    for (int r = 0; r < RB; ++r) {
      const __m512 wv = _mm512_set1_ps(w[r][i] * row);
      for (int b = 0; b < DB; ++b) acc[r][b] = _mm512_fmadd_ps(vv[b], wv, acc[r][b]);
    }
    fetch_ahead(ahead, kValueStepLines);
  }
  for (int r = 0; r < RB; ++r)
    for (int b = 0; b < DB; ++b) _mm512_mask_storeu_ps(out[r] + d + 16 * b, Low8 ? 0xff : 0xffff, acc[r][b]);
}

template <KVType K, int RB>
void value_rows(const uint8_t* const* v, const float* const* w, int n, int Dv, int scale_at, float* const* out,
                Ahead& ahead) {
  int d = 0;
  for (; d + 64 <= Dv; d += 64) weigh_values<K, RB, 4>(v, w, n, d, scale_at, out, ahead);
  for (; d + 16 <= Dv; d += 16) weigh_values<K, RB, 1>(v, w, n, d, scale_at, out, ahead);
  if (d < Dv) weigh_values<K, RB, 1, true>(v, w, n, d, scale_at, out, ahead);
}

// exp8 (simd.h) of 16 floats: the same operations lane for lane, so the same bits.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i pow2n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(pow2n));
}

}  // namespace

float exp_row(float* row, int n, float m) {
  const __m512 vmax = _mm512_set1_ps(m);
  __m256 total = _mm256_setzero_ps();
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(row + i), vmax));
    _mm512_storeu_ps(row + i, e);
    total = _mm256_add_ps(_mm256_add_ps(total, _mm512_castps512_ps256(e)), _mm512_extractf32x8_ps(e, 1));
  }
  if (i + 8 <= n) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(0xff, row + i), vmax));
    _mm512_mask_storeu_ps(row + i, 0xff, e);
    total = _mm256_add_ps(total, _mm512_castps512_ps256(e));
    i += 8;
  }
  float sum = hsum(total);
  for (; i < n; ++i) {
    row[i] = std::exp(row[i] - m);
    sum += row[i];
  }
  return sum;
}

template <KVType K>
void score_heads(const float* const* q, int count, const uint8_t* const* rows, int n, int D, float scale,
                 float* const* s, Ahead& ahead) {
  if (count == 3) score_rows<K, 3>(q, rows, n, D, scale, s, ahead);
  if (count == 2) score_rows<K, 2>(q, rows, n, D, scale, s, ahead);
  if (count == 1) score_rows<K, 1>(q, rows, n, D, scale, s, ahead);
}

template <KVType K>
void value_heads(const uint8_t* const* v, const float* const* w, int count, int n, int Dv, int scale_at,
                 float* const* out, Ahead& ahead) {
  if (count == 3) value_rows<K, 3>(v, w, n, Dv, scale_at, out, ahead);
  if (count == 2) value_rows<K, 2>(v, w, n, Dv, scale_at, out, ahead);
  if (count == 1) value_rows<K, 1>(v, w, n, Dv, scale_at, out, ahead);
}

#define MLX_INFER_ATTENTION_PASSES(K)                                                                           \
  template void score_heads<K>(const float* const*, int, const uint8_t* const*, int, int, float, float* const*, \
                               Ahead&);                                                                       \
  template void value_heads<K>(const uint8_t* const*, const float* const*, int, int, int, int, float* const*,   \
                               Ahead&);
MLX_INFER_ATTENTION_PASSES(KVType::f32)
MLX_INFER_ATTENTION_PASSES(KVType::f16)
MLX_INFER_ATTENTION_PASSES(KVType::bf16)
MLX_INFER_ATTENTION_PASSES(KVType::i8)
#undef MLX_INFER_ATTENTION_PASSES

}  // namespace attention_avx512
}  // namespace mlx_infer
