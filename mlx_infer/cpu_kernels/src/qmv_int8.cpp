// Products of MLX affine 4/8-bit weights with activations quantized to int8, for every row count.
//
// The float kernel (quantized_matvec.cpp) unpacks every weight to a float and FMAs it: about five
// instructions per eight weights, which on these CPUs is slower than memory delivers the weights
// (4.5 G weights/s per core measured, where 10 GB/s of 4-bit words would be ~20 G). As llama.cpp
// does (Q8 activations for its Q4/Q8 weights), x is quantized per block of 32 values to int8 with
// one float scale, and each block's dot product is an exact integer sum of u8 x s8 products: one
// VNNI `vpdpbusd` (or `vpmaddubsw` + `vpmaddwd` without VNNI) per 32 weight-activation pairs, then
// one float multiply-add per two blocks. Per output feature n, weight group g and x block b:
//   y_n = sum_b s_{n,g(b)} * dx_b * (q_n,b . qx_b) + sum_g b_{n,g} * sum_{b in g} dx_b * sum(qx_b),
// which is exactly w . x^ (x^ = dx * qx, the quantized x), as llama.cpp's Q4_1 x Q8_1 is. The bias
// term must come from x^ too: the codes q are unsigned (0..15, 0..255), so with the exact sums of x
// the rounding error of x^ would meet uncentred weights q * s instead of w (SmolLM2, teacher-forced
// against float32 activations: mean KL 0.0186 -> 0.0041, top-1 89.8% -> 96.8% with x^'s sums).
//
// 8-bit weights (a model's more precise layers, such as SmolLM2's Q8_0 output head) meet x quantized
// to int16 instead: int8 x would add ~100 times their own rounding error, and the head, the last and
// most sensitive product, decides the tokens. Measured on SmolLM2 (400 teacher-forced decode steps
// against float32 activations; int8 x in the 4-bit layers), head with int8 x: mean KL 0.0041, top-1
// 96.8%; with float32 x: 0.0034, 97.2%, but the float kernel took the head from 3.0 to 7.7-9.3 ms a
// token (a batch-1 step is ~20 ms on the 2-vCPU VM); with int16 x: 0.0034, 97.2% at 2.7 ms, since
// vpmaddwd on widened weights costs no more than the sign tricks u8 x s8 needs without VNNI.
//
// The opt-in "int16" activations give the 4-bit weights int16 x as well (tile4x16): on SmolLM2, mean
// KL 0.0000 and top-1 100% against float32 activations, for ~8-12% slower decode than int8 x.
//
// The same kernel serves decode (a few rows) and prefill (hundreds): rows are taken in blocks of
// kRowBlock whose int8 x stays in L2 while a thread's feature tiles sweep across it, and every row's
// outputs come out of the same operations in the same order however many rows the call has. So a
// prompt's last position gets the same logits whether it was prefilled in one chunk, in several, after
// a prefix-cache hit or beside other requests, and prefill needs no BLAS.
//
// This file is compiled twice (CMakeLists.txt): with MLX_INFER_VNNI and -mavxvnni into namespace
// int8_vnni, and for plain AVX2 into int8_avx2; quantized_matvec.cpp picks one at run time.

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "qmv_int8.h"
#include "qmv_int8_parts.h"

namespace mlx_infer {
#ifdef MLX_INFER_VNNI
namespace int8_vnni {
#else
namespace int8_avx2 {
#endif

namespace {

// The 8 lanes of sum over 4 adjacent byte pairs of lo * xe + hi * xo, lo and hi 4-bit weights (0..15).
// Without VNNI the two products' 16-bit pair sums (u8 x s8, vpmaddubsw) are added before widening:
// each is at most 2 * 15 * 127 in magnitude, so neither they nor their sum saturate 16 bits.
inline __m256i dot_nibbles(__m256i lo, __m256i xe, __m256i hi, __m256i xo) {
#ifdef MLX_INFER_VNNI
  return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), lo, xe), hi, xo);
#else
  const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xe), _mm256_maddubs_epi16(hi, xo));
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#endif
}

// The accumulators of an NB-feature by MB-row output tile, over its rows (TileRows). Every step reads
// 32 bytes of each weight row.
template <int MB, int NB>
struct Tile : TileRows<NB> {
  __m256 total[NB][MB];

  Tile(const Int8Problem& p, int n0, size_t row_bytes) : TileRows<NB>(p, n0, row_bytes, 32) {
    for (int r = 0; r < NB; ++r)
      for (int m = 0; m < MB; ++m) total[r][m] = _mm256_setzero_ps();
  }

  void store(const Int8Problem& p, int n0, int m0) const {
    for (int r = 0; r < NB; ++r) {
      for (int m = 0; m < MB; ++m) {
        p.out[static_cast<size_t>(m0 + m) * p.N + n0 + r] = hsum(total[r][m]) + bias_term(p, n0 + r, m0 + m);
      }
    }
  }
};

template <int MB, int NB>
void tile4(const Int8Problem& p, int n0, int m0) {
  const int pairs = p.K / 64;
  const int bpg = p.group / 32;
  Tile<MB, NB> t(p, n0, p.K / 2);
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int q = 0; q < pairs; ++q) {
    t.prefetch(q);
    __m256i xe[MB], xo[MB];
    for (int m = 0; m < MB; ++m) {
      const int8_t* xq = p.xq + static_cast<size_t>(m0 + m) * p.K + static_cast<size_t>(q) * 64;
      xe[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
      xo[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32));
    }
    for (int r = 0; r < NB; ++r) {
      // 32 bytes = blocks 2q and 2q + 1; low nibbles are their even weights, high nibbles the odd.
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.wr[r] + static_cast<size_t>(q) * 32));
      const __m256i lo = _mm256_and_si256(v, low);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      const __m256 sw = pair_scales(t.sr[r], 2 * q, bpg);
      for (int m = 0; m < MB; ++m) {
        const __m256i acc = dot_nibbles(lo, xe[m], hi, xo[m]);
        const __m256 dx = _mm256_loadu_ps(p.dx_lanes + (static_cast<size_t>(m0 + m) * pairs + q) * 8);
        t.total[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_mul_ps(sw, dx), t.total[r][m]);
      }
    }
  }
  t.store(p, n0, m0);
}

// 4-bit weights against int16 x (QuantizedX's int16 layout): 16-bit lane l of the 32 bytes holds
// weights 4l..4l + 3 (lanes 0-7 block 2q, 8-15 block 2q + 1), so shifting by 0/4/8/12 and masking
// gives four vectors of one weight per lane, and the 32-bit sums of vpmaddwd keep lanes 0-3 block
// 2q's and 4-7 block 2q + 1's, as in tile4. Four vpmaddwd per 64 weights, exact in 32-bit lanes
// (8 products of at most 15 * 32767 per lane, also exact as floats: under 2^24).
template <int MB, int NB>
void tile4x16(const Int8Problem& p, int n0, int m0) {
  const int pairs = p.K / 64;
  const int bpg = p.group / 32;
  Tile<MB, NB> t(p, n0, p.K / 2);
  const __m256i low = _mm256_set1_epi16(0x0F);
  for (int q = 0; q < pairs; ++q) {
    t.prefetch(q);
    __m256i xv[MB][4];
    for (int m = 0; m < MB; ++m) {
      const int16_t* x = p.xq16 + static_cast<size_t>(m0 + m) * p.K + static_cast<size_t>(q) * 64;
      for (int j = 0; j < 4; ++j) xv[m][j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16 * j));
    }
    for (int r = 0; r < NB; ++r) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.wr[r] + static_cast<size_t>(q) * 32));
      const __m256i w[4] = {_mm256_and_si256(v, low), _mm256_and_si256(_mm256_srli_epi16(v, 4), low),
                            _mm256_and_si256(_mm256_srli_epi16(v, 8), low), _mm256_srli_epi16(v, 12)};
      const __m256 sw = pair_scales(t.sr[r], 2 * q, bpg);
      for (int m = 0; m < MB; ++m) {
        const __m256i acc = _mm256_add_epi32(
            _mm256_add_epi32(_mm256_madd_epi16(w[0], xv[m][0]), _mm256_madd_epi16(w[1], xv[m][1])),
            _mm256_add_epi32(_mm256_madd_epi16(w[2], xv[m][2]), _mm256_madd_epi16(w[3], xv[m][3])));
        const __m256 dx = _mm256_loadu_ps(p.dx_lanes + (static_cast<size_t>(m0 + m) * pairs + q) * 8);
        t.total[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_mul_ps(sw, dx), t.total[r][m]);
      }
    }
  }
  t.store(p, n0, m0);
}

// 8-bit weights u (0..255) widened to 16 bits against int16 x: two vpmaddwd per block, exact in
// 32-bit lanes (|u * x| < 2^23), the same code in both builds.
template <int MB, int NB>
void tile8(const Int8Problem& p, int n0, int m0) {
  const int blocks = p.K / 32;
  const int bpg = p.group / 32;
  Tile<MB, NB> t(p, n0, p.K);
  for (int b = 0; b < blocks; ++b) {
    t.prefetch(b);
    for (int r = 0; r < NB; ++r) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.wr[r] + static_cast<size_t>(b) * 32));
      const __m256i w0 = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(v));
      const __m256i w1 = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(v, 1));
      const float s = t.sr[r][b / bpg];
      for (int m = 0; m < MB; ++m) {
        const size_t at = static_cast<size_t>(m0 + m) * blocks + b;
        const int16_t* x = p.xq16 + static_cast<size_t>(m0 + m) * p.K + static_cast<size_t>(b) * 32;
        const __m256i dot =
            _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))),
                             _mm256_madd_epi16(w1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16))));
        t.total[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(s * p.dx[at]), t.total[r][m]);
      }
    }
  }
  t.store(p, n0, m0);
}

// BITS: 4 (4-bit weights, int8 x), 16 (4-bit weights, int16 x) or 8 (8-bit weights, int16 x).
template <int BITS, int MB, int NB>
void tile(const Int8Problem& p, int n, int m0) {
  if constexpr (BITS == 4) {
    tile4<MB, NB>(p, n, m0);
  } else if constexpr (BITS == 16) {
    tile4x16<MB, NB>(p, n, m0);
  } else {
    tile8<MB, NB>(p, n, m0);
  }
}

// Features [n, n + NB) for rows [m0, m1): each feature's weights come from memory once and from L1 for
// the other rows.
template <int BITS, int NB>
void rows(const Int8Problem& p, int n, int m0, int m1) {
  int m = m0;
  for (; m + 4 <= m1; m += 4) tile<BITS, 4, NB>(p, n, m);
  for (; m < m1; ++m) tile<BITS, 1, NB>(p, n, m);
}

// Four features a tile for one to three rows (four independent accumulator chains), two for 4-row
// blocks. The tiles only group operations: a row's output is computed the same way in any of them.
template <int BITS>
void feature_range(const Int8Problem& p, int n0, int n1) {
  for (int m0 = 0; m0 < p.M; m0 += kRowBlock) {
    const int m1 = std::min(p.M, m0 + kRowBlock);
    constexpr int kFew = 4;
    const int nb = m1 - m0 < kFew ? 4 : 2;
    int n = n0;
    if (nb == 4) {
      for (; n + 4 <= n1; n += 4) rows<BITS, 4>(p, n, m0, m1);
    } else {
      for (; n + 2 <= n1; n += 2) rows<BITS, 2>(p, n, m0, m1);
    }
    for (; n < n1; ++n) rows<BITS, 1>(p, n, m0, m1);
  }
}

}  // namespace

void features(const Int8Problem& p, int n0, int n1) {
  if (p.bits == 8) {
    feature_range<8>(p, n0, n1);
  } else if (p.x16) {
    feature_range<16>(p, n0, n1);
  } else {
    feature_range<4>(p, n0, n1);
  }
}

}  // namespace int8_*
}  // namespace mlx_infer
