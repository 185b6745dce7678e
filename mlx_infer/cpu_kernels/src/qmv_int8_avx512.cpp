// The int8-activation products of qmv_int8.cpp in 512-bit vectors, for CPUs with AVX-512 VNNI.
//
// Same scheme, same inputs (QuantizedX's layouts), same result up to float32 summation order: see
// qmv_int8.cpp for the arithmetic. What changes is how many instructions a weight costs, which is what
// bounds these products on a CPU whose caches hold the weights: at batch 1 the 256-bit kernel spends
// about five instructions on 32 weights besides the two VNNI sums (nibble masks, the two scale
// broadcasts, the float conversion and multiply-add), at 16 rows a tile still about three per row.
// A 64-byte vector holds four blocks of 32 weights (blocks 2q..2q + 3), so every one of those
// instructions now covers twice the weights, and a block's weight scale comes from one permute of a
// 4-float load instead of two broadcasts and an insert.
//
// A product with K % 128 == 64 (SmolLM2's 576) ends with one 256-bit step on the last block pair,
// added into the low half of the accumulators: every row takes the same path whatever the row count,
// so a row's outputs still do not depend on the other rows.
//
// Weight groups of 32 or 64 values, or multiples of 128, give every 4 blocks' scales a fixed permute
// pattern; other group sizes stay with the 256-bit build (quantized_matvec.cpp: best_int8_for).

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "qmv_int8.h"
#include "qmv_int8_parts.h"

namespace mlx_infer {
namespace int8_avx512 {

namespace {

inline float hsum512(__m512 v) {
  const __m256 lo = _mm512_castps512_ps256(v);
  const __m256 hi = _mm512_extractf32x8_ps(v, 1);
  return hsum(_mm256_add_ps(lo, hi));
}

// The lane -> scale index pattern of four consecutive blocks 4j..4j + 3 (lanes 4i..4i + 3 hold
// block 4j + i's sums), and how many scales those blocks use from sr + 4j / bpg.
struct QuadScales {
  __m512i index;
  __mmask8 load;

  explicit QuadScales(int bpg) {
    alignas(64) int32_t lanes[16];
    for (int l = 0; l < 16; ++l) lanes[l] = bpg <= 2 ? (l / 4) / bpg : 0;
    index = _mm512_load_si512(lanes);
    load = static_cast<__mmask8>(bpg == 1 ? 0xF : bpg == 2 ? 0x3 : 0x1);
  }

  // Block scales of blocks b..b + 3 of weight row sr, each in its blocks' lanes.
  __m512 of(const float* sr, int b, int bpg) const {
    return _mm512_permutexvar_ps(index, _mm512_castps128_ps512(_mm_maskz_loadu_ps(load, sr + b / bpg)));
  }
};

// The accumulators of an NB-feature by MB-row output tile, over its rows (qmv_int8_parts.h's TileRows).
template <int MB, int NB>
struct Tile : TileRows<NB> {
  __m512 total[NB][MB];

  Tile(const Int8Problem& p, int n0, size_t row_bytes, int step) : TileRows<NB>(p, n0, row_bytes, step) {
    for (int r = 0; r < NB; ++r)
      for (int m = 0; m < MB; ++m) total[r][m] = _mm512_setzero_ps();
  }

  void store(const Int8Problem& p, int n0, int m0) const {
    for (int r = 0; r < NB; ++r) {
      for (int m = 0; m < MB; ++m) {
        p.out[static_cast<size_t>(m0 + m) * p.N + n0 + r] = hsum512(total[r][m]) + bias_term(p, n0 + r, m0 + m);
      }
    }
  }
};

// 4-bit weights against int8 x. Per 128 weights (64 bytes: blocks 2q..2q + 3 as two of
// qmv_int8.cpp's 32-byte pairs) the low nibbles meet the pairs' even x values, the high nibbles their
// odd ones: one 64-byte load each, x being stored in that order (QuantizedX's `quads`).
template <int MB, int NB>
void tile4(const Int8Problem& p, int n0, int m0, const QuadScales& quad) {
  const int pairs = p.K / 64;
  const int bpg = p.group / 32;
  Tile<MB, NB> t(p, n0, p.K / 2, 64);
  const __m512i low = _mm512_set1_epi8(0x0F);
  int q = 0;
  for (; q + 2 <= pairs; q += 2) {
    t.prefetch(q / 2);
    __m512i xe[MB], xo[MB];
    for (int m = 0; m < MB; ++m) {
      const int8_t* xq = p.xq + static_cast<size_t>(m0 + m) * p.K + static_cast<size_t>(q) * 64;
      xe[m] = _mm512_loadu_si512(xq);
      xo[m] = _mm512_loadu_si512(xq + 64);
    }
    for (int r = 0; r < NB; ++r) {
      const __m512i v = _mm512_loadu_si512(t.wr[r] + static_cast<size_t>(q) * 32);
      const __m512i lo = _mm512_and_si512(v, low);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      const __m512 sw = quad.of(t.sr[r], 2 * q, bpg);
      for (int m = 0; m < MB; ++m) {
        const __m512i acc = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xe[m]), hi, xo[m]);
        const __m512 dx = _mm512_loadu_ps(p.dx_lanes + (static_cast<size_t>(m0 + m) * pairs + q) * 8);
        t.total[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(sw, dx), t.total[r][m]);
      }
    }
  }
  if (q < pairs) {  // the last block pair, in 256 bits, into the low half
    const __m256i low256 = _mm256_set1_epi8(0x0F);
    for (int r = 0; r < NB; ++r) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.wr[r] + static_cast<size_t>(q) * 32));
      const __m256i lo = _mm256_and_si256(v, low256);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low256);
      const __m256 sw = pair_scales(t.sr[r], 2 * q, bpg);
      for (int m = 0; m < MB; ++m) {
        const int8_t* xq = p.xq + static_cast<size_t>(m0 + m) * p.K + static_cast<size_t>(q) * 64;
        const __m256i xe = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
        const __m256i xo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32));
        const __m256i acc = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, xe), hi, xo);
        const __m256 dx = _mm256_loadu_ps(p.dx_lanes + (static_cast<size_t>(m0 + m) * pairs + q) * 8);
        const __m256 part = _mm256_mul_ps(_mm256_cvtepi32_ps(acc), _mm256_mul_ps(sw, dx));
        t.total[r][m] = _mm512_add_ps(t.total[r][m], _mm512_zextps256_ps512(part));
      }
    }
  }
  t.store(p, n0, m0);
}

// 8-bit weights u (0..255) against int16 x split in int8 halves (XLayout::halves: v = 256 hi + lo).
// Per block pair (64 weight bytes, lanes 0-7 block 2q's sums, 8-15 block 2q + 1's), u . v = 256 (u . hi)
// + u . lo: two VNNI sums, the first shifted before the second accumulates into it. A lane's sum is
// exact in int32 (4 products each, |sum| < 2^26); its float conversion rounds above 2^24 (a relative
// 6e-8). Per 64 weights and row: two vpdpbusd, a shift and the float scaling, where widening the
// weights for vpmaddwd took a multiply-add per 32 and a broadcast scale per block.
template <int MB, int NB>
void tile8(const Int8Problem& p, int n0, int m0) {
  const int pairs = p.K / 64;
  const int bpg = p.group / 32;
  Tile<MB, NB> t(p, n0, p.K, 64);
  for (int q = 0; q < pairs; ++q) {
    t.prefetch(q);
    __m512i hi[MB], lo[MB];
    for (int m = 0; m < MB; ++m) {
      const size_t at = static_cast<size_t>(m0 + m) * p.K + static_cast<size_t>(q) * 64;
      hi[m] = _mm512_loadu_si512(p.xq_hi + at);
      lo[m] = _mm512_loadu_si512(p.xq + at);
    }
    for (int r = 0; r < NB; ++r) {
      const __m512i w = _mm512_loadu_si512(t.wr[r] + static_cast<size_t>(q) * 64);
      const __m512 sw = _mm512_insertf32x8(_mm512_set1_ps(t.sr[r][2 * q / bpg]),
                                           _mm256_set1_ps(t.sr[r][(2 * q + 1) / bpg]), 1);
      for (int m = 0; m < MB; ++m) {
        const __m512i high = _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w, hi[m]), 8);
        const __m512i acc = _mm512_dpbusd_epi32(high, w, lo[m]);
        const __m512 dx = _mm512_loadu_ps(p.dx_lanes + (static_cast<size_t>(m0 + m) * pairs + q) * 16);
        t.total[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(sw, dx), t.total[r][m]);
      }
    }
  }
  t.store(p, n0, m0);
}

template <int BITS, int MB, int NB>
void rows_tile(const Int8Problem& p, int n, int m0, const QuadScales& quad) {
  if constexpr (BITS == 4) {
    tile4<MB, NB>(p, n, m0, quad);
  } else {
    tile8<MB, NB>(p, n, m0);
  }
}

// Rows [m0, m1) of features [n, n + NB): four rows a tile, the last one to three rows in one tile, so
// a feature's weights are unpacked once for up to four rows.
template <int BITS, int NB>
void rows(const Int8Problem& p, int n, int m0, int m1, const QuadScales& quad) {
  int m = m0;
  for (; m + 4 <= m1; m += 4) rows_tile<BITS, 4, NB>(p, n, m, quad);
  switch (m1 - m) {
    case 3: rows_tile<BITS, 3, NB>(p, n, m, quad); break;
    case 2: rows_tile<BITS, 2, NB>(p, n, m, quad); break;
    case 1: rows_tile<BITS, 1, NB>(p, n, m, quad); break;
    default: break;
  }
}

// Features [n, n1) for five or six rows in one tile of two features (10-12 accumulators and as many
// x vectors): a verification of four or five proposed tokens reads the weights in one pass, where a
// tile of four rows and one of the rest would read them twice.
template <int BITS, int MB>
void rows_in_one(const Int8Problem& p, int n, int n1, int m0, const QuadScales& quad) {
  for (; n + 2 <= n1; n += 2) rows_tile<BITS, MB, 2>(p, n, m0, quad);
  for (; n < n1; ++n) rows_tile<BITS, MB, 1>(p, n, m0, quad);
}

// Features four at a time (16 accumulators at 4 rows, within the 32 vector registers with the x and
// weight vectors), five or six rows at once two features at a time.
template <int BITS>
void feature_range(const Int8Problem& p, int n0, int n1) {
  const QuadScales quad(p.group / 32);
  constexpr int kFeatures = 4;
  for (int m0 = 0; m0 < p.M; m0 += kRowBlock) {
    const int m1 = std::min(p.M, m0 + kRowBlock);
    if (m1 - m0 == 5) {
      rows_in_one<BITS, 5>(p, n0, n1, m0, quad);
      continue;
    }
    if (m1 - m0 == 6) {
      rows_in_one<BITS, 6>(p, n0, n1, m0, quad);
      continue;
    }
    int n = n0;
    for (; n + kFeatures <= n1; n += kFeatures) rows<BITS, kFeatures>(p, n, m0, m1, quad);
    for (; n < n1; ++n) rows<BITS, 1>(p, n, m0, m1, quad);
  }
}

}  // namespace

bool handles(int group) {
  const int bpg = group / 32;
  return bpg == 1 || bpg == 2 || bpg % 4 == 0;
}

void features(const Int8Problem& p, int n0, int n1) {
  if (p.bits == 8) {
    feature_range<8>(p, n0, n1);
  } else {
    feature_range<4>(p, n0, n1);
  }
}

}  // namespace int8_avx512
}  // namespace mlx_infer
