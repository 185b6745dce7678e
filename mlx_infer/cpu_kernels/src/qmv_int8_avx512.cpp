// The int8-activation products of qmv_int8.cpp in 512-bit vectors, for CPUs with AVX-512 VNNI.
//
// Each 512-bit vector holds two output features side by side, each half doing exactly what the 256-bit
// kernel does for one feature: the same integer sums in the same lanes, the same scale products, the
// same chain of multiply-adds over the block pairs and the same final sum. So a product's outputs are
// the same bits as the 256-bit builds' (with or without VNNI), and an answer does not depend on which
// of these CPUs computes it. What 512 bits buy is instructions: the nibble masks, the integer sums, the
// conversion and the multiply-adds each cover two features, and an x vector (broadcast to both halves)
// serves four features of a tile.
//
// A feature range of odd length leaves its last feature to the 256-bit kernel (int8_avx2: the same
// results), as do 4-bit weights against int16 x.

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "qmv_int8.h"
#include "qmv_int8_parts.h"

namespace mlx_infer {
namespace int8_avx512 {

namespace {

// The two features' sums: the low 256 bits feature 2j's, the high 256 bits feature 2j + 1's.
inline __m256 low_half(__m512 v) { return _mm512_castps512_ps256(v); }
inline __m256 high_half(__m512 v) { return _mm512_extractf32x8_ps(v, 1); }

// The same 32 bytes in both 256-bit halves.
inline __m512i both_halves(const void* p) {
  return _mm512_broadcast_i64x4(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
}

// Features [n0, n0 + 2 NP) by rows [m0, m0 + MB): feature pair j's accumulators and rows.
template <int MB, int NP>
struct PairTile : TileRows<2 * NP> {
  __m512 total[NP][MB];

  PairTile(const Int8Problem& p, int n0, size_t row_bytes) : TileRows<2 * NP>(p, n0, row_bytes, 32) {
    for (int j = 0; j < NP; ++j)
      for (int m = 0; m < MB; ++m) total[j][m] = _mm512_setzero_ps();
  }

  // 32 bytes of each feature of pair j at `offset` in their rows.
  __m512i weights(int j, size_t offset) const {
    const auto* a = reinterpret_cast<const __m256i*>(this->wr[2 * j] + offset);
    const auto* b = reinterpret_cast<const __m256i*>(this->wr[2 * j + 1] + offset);
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(a)), _mm256_loadu_si256(b), 1);
  }

  void store(const Int8Problem& p, int n0, int m0) const {
    for (int j = 0; j < NP; ++j) {
      for (int m = 0; m < MB; ++m) {
        float* out = p.out + static_cast<size_t>(m0 + m) * p.N + n0 + 2 * j;
        out[0] = hsum(low_half(total[j][m])) + bias_term(p, n0 + 2 * j, m0 + m);
        out[1] = hsum(high_half(total[j][m])) + bias_term(p, n0 + 2 * j + 1, m0 + m);
      }
    }
  }
};

// 4-bit weights against int8 x, as qmv_int8.cpp's tile4 per feature: per block pair q, the low nibbles
// meet x's even values, the high nibbles its odd ones (QuantizedX's layout), lanes 0-3 block 2q's sums
// and 4-7 block 2q + 1's in each half.
template <int MB, int NP>
void tile4(const Int8Problem& p, int n0, int m0) {
  const int pairs = p.K / 64;
  const int bpg = p.group / 32;
  PairTile<MB, NP> t(p, n0, p.K / 2);
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int q = 0; q < pairs; ++q) {
    t.prefetch(q);
    __m512i xe[MB], xo[MB];
    __m512 dx[MB];
    for (int m = 0; m < MB; ++m) {
      const int8_t* xq = p.xq + static_cast<size_t>(m0 + m) * p.K + static_cast<size_t>(q) * 64;
      xe[m] = both_halves(xq);
      xo[m] = both_halves(xq + 32);
      dx[m] = _mm512_broadcast_f32x8(_mm256_loadu_ps(p.dx_lanes + (static_cast<size_t>(m0 + m) * pairs + q) * 8));
    }
    for (int j = 0; j < NP; ++j) {
      const __m512i v = t.weights(j, static_cast<size_t>(q) * 32);
      const __m512i lo = _mm512_and_si512(v, low);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      const __m512 sw = _mm512_insertf32x8(_mm512_castps256_ps512(pair_scales(t.sr[2 * j], 2 * q, bpg)),
                                           pair_scales(t.sr[2 * j + 1], 2 * q, bpg), 1);
      for (int m = 0; m < MB; ++m) {
        const __m512i acc = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xe[m]), hi, xo[m]);
        t.total[j][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(sw, dx[m]), t.total[j][m]);
      }
    }
  }
  t.store(p, n0, m0);
}

// 8-bit weights u (0..255) widened to 16 bits against int16 x, as qmv_int8.cpp's tile8 per feature: per
// block, the first 16 weights meet x's first 16 values and the last 16 its last, two vpmaddwd added.
template <int MB, int NP>
void tile8(const Int8Problem& p, int n0, int m0) {
  const int blocks = p.K / 32;
  const int bpg = p.group / 32;
  PairTile<MB, NP> t(p, n0, p.K);
  for (int b = 0; b < blocks; ++b) {
    t.prefetch(b);
    __m512i x0[MB], x1[MB];
    __m512 dx[MB];
    for (int m = 0; m < MB; ++m) {
      const int16_t* x = p.xq16 + static_cast<size_t>(m0 + m) * p.K + static_cast<size_t>(b) * 32;
      x0[m] = both_halves(x);
      x1[m] = both_halves(x + 16);
      dx[m] = _mm512_set1_ps(p.dx[static_cast<size_t>(m0 + m) * blocks + b]);
    }
    for (int j = 0; j < NP; ++j) {
      const __m512i v = t.weights(j, static_cast<size_t>(b) * 32);
      // Each half's first 16 bytes widened, then each half's last 16 (the 256-bit kernel's w0 and w1).
      const __m512i w0 = _mm512_cvtepu8_epi16(_mm256_inserti128_si256(
          _mm512_castsi512_si256(v), _mm512_extracti32x4_epi32(v, 2), 1));
      const __m512i w1 = _mm512_cvtepu8_epi16(_mm256_inserti128_si256(
          _mm256_castsi128_si256(_mm512_extracti32x4_epi32(v, 1)), _mm512_extracti32x4_epi32(v, 3), 1));
      const __m512 s = _mm512_insertf32x8(_mm512_set1_ps(t.sr[2 * j][b / bpg]),
                                          _mm256_set1_ps(t.sr[2 * j + 1][b / bpg]), 1);
      for (int m = 0; m < MB; ++m) {
        const __m512i dot = _mm512_add_epi32(_mm512_madd_epi16(w0, x0[m]), _mm512_madd_epi16(w1, x1[m]));
        t.total[j][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s, dx[m]), t.total[j][m]);
      }
    }
  }
  t.store(p, n0, m0);
}

template <int BITS, int MB, int NP>
void pair_tile(const Int8Problem& p, int n, int m0) {
  if constexpr (BITS == 4) {
    tile4<MB, NP>(p, n, m0);
  } else {
    tile8<MB, NP>(p, n, m0);
  }
}

// Rows [m0, m1) of features [n, n + 2 NP): four rows a tile, the last one to three rows in one tile, so
// a feature's weights are unpacked once for up to four rows.
template <int BITS, int NP>
void rows(const Int8Problem& p, int n, int m0, int m1) {
  int m = m0;
  for (; m + 4 <= m1; m += 4) pair_tile<BITS, 4, NP>(p, n, m);
  switch (m1 - m) {
    case 3: pair_tile<BITS, 3, NP>(p, n, m); break;
    case 2: pair_tile<BITS, 2, NP>(p, n, m); break;
    case 1: pair_tile<BITS, 1, NP>(p, n, m); break;
    default: break;
  }
}

// Features [n, n1) (an even count) for five or six rows in one tile of one pair (12 accumulators and
// x vectors): a verification of four or five proposed tokens reads the weights in one pass, where a
// tile of four rows and one of the rest would read them twice.
template <int BITS, int MB>
void rows_in_one(const Int8Problem& p, int n, int n1, int m0) {
  for (; n < n1; n += 2) pair_tile<BITS, MB, 1>(p, n, m0);
}

// Features two pairs at a time (8 accumulators at 4 rows, with 8 x vectors and 4 scale vectors within
// the 32 registers); an odd last feature to the 256-bit kernel.
template <int BITS>
void feature_range(const Int8Problem& p, int n0, int n1) {
  const int even_end = n0 + (n1 - n0) / 2 * 2;
  for (int m0 = 0; m0 < p.M; m0 += kRowBlock) {
    const int m1 = std::min(p.M, m0 + kRowBlock);
    if (m1 - m0 == 5) {
      rows_in_one<BITS, 5>(p, n0, even_end, m0);
    } else if (m1 - m0 == 6) {
      rows_in_one<BITS, 6>(p, n0, even_end, m0);
    } else {
      int n = n0;
      for (; n + 4 <= even_end; n += 4) rows<BITS, 2>(p, n, m0, m1);
      for (; n < even_end; n += 2) rows<BITS, 1>(p, n, m0, m1);
    }
  }
  if (even_end < n1) int8_avx2::features(p, even_end, n1);
}

}  // namespace

void features(const Int8Problem& p, int n0, int n1) {
  if (p.bits == 8) {
    feature_range<8>(p, n0, n1);
  } else if (p.x16) {
    int8_avx2::features(p, n0, n1);
  } else {
    feature_range<4>(p, n0, n1);
  }
}

}  // namespace int8_avx512
}  // namespace mlx_infer
