// Products of MLX affine 4/8-bit weights with activations quantized to int8 or int16, for every row count.
//
// The float kernel (quantized_matvec.cpp) unpacks every weight to a float and FMAs it: about five
// instructions per eight weights, which on these CPUs is slower than memory delivers the weights
// (4.5 G weights/s per core measured, where 10 GB/s of 4-bit words would be ~20 G). As llama.cpp
// does (Q8 activations for its Q4/Q8 weights), x is quantized per block of 32 values with one float
// scale, and each block's dot product is an exact integer sum of u8 x s8 products (VNNI `vpdpbusd`).
// Per output feature n, weight group g and x block b:
//   y_n = sum_b s_{n,g(b)} * dx_b * (q_n,b . qx_b) + sum_g b_{n,g} * sum_{b in g} dx_b * sum(qx_b),
// which is exactly w . x^ (x^ = dx * qx, the quantized x), as llama.cpp's Q4_1 x Q8_1 is. The bias
// term must come from x^ too: the codes q are unsigned (0..15, 0..255), so with the exact sums of x
// the rounding error of x^ would meet uncentred weights q * s instead of w (SmolLM2, teacher-forced
// against float32 activations: mean KL 0.0186 -> 0.0041, top-1 89.8% -> 96.8% with x^'s sums).
//
// x is int8 (127 levels) or int16 (127 * 257 levels, held as two signed bytes h, l with x = 256 h + l,
// so each is a vpdpbusd operand and q . x = 256 (q . h) + q . l, exact). 8-bit weights (a model's more
// precise layers, such as SmolLM2's Q8_0 output head) always meet int16 x: int8 x would add ~100 times
// their own rounding error, and the head, the last and most sensitive product, decides the tokens.
// 4-bit weights meet int8 x, or int16 x with the "int16" activations (twice the integer work; on
// SmolLM2 the same top token as float32 activations at every position measured).
//
// One output feature a vector lane: 8 features a 256-bit vector (16 in qmv_int8_avx512.cpp). A block's
// 16 (8-bit: 32) weight bytes of each feature are transposed so that lane f of operand j holds feature
// f's dword j, and one vpdpbusd against a broadcast x dword adds four products to every feature's sum.
// So a block's dot products come out whole, one integer per lane, and are converted, scaled and added
// by one instruction each for all the lanes; no horizontal sums. The transposition is done once per
// block for all the rows of the call, which is what makes a batch cheap: per row and block, 8 vpdpbusd
// (int16: 16) and four float operations for 8 or 16 features.
//
// The float arithmetic is the same in every lane, build and vector width, and in features_one_by_one
// (qmv_int8_parts.h), which takes features that do not fill a vector: per block the exact integer dot
// product is converted and multiply-added with s * dx, in block order, each group's bias term after its
// blocks. So a product is the same bits on every CPU these kernels run on, and a row's outputs do not
// depend on the other rows: the same kernel serves decode (a few rows) and prefill (hundreds; rows in
// blocks of kRowBlock whose x stays in L2), and a prompt's last position gets the same logits whether
// it was prefilled in one chunk, in several, after a prefix-cache hit or beside other requests.
//
// This file is compiled twice (CMakeLists.txt): with MLX_INFER_VNNI and -mavxvnni into namespace
// int8_vnni, and for plain AVX2 into int8_avx2; quantized_matvec.cpp picks one at run time.

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "qmv_int8.h"
#include "qmv_int8_parts.h"

namespace mlx_infer {
#ifdef MLX_INFER_VNNI
namespace int8_vnni {
#else
namespace int8_avx2 {
#endif

namespace {

// Dwords j = 0..3 of 8 rows' 16 bytes, row(f) giving row f's: r[j] lane f holds row f's dword j. Rows
// 4L + a are loaded into 128-bit lane L of z[a], and a 4 x 4 transpose within each 128-bit lane puts them
// at lane 4L + a.
template <class Row>
inline void dwords8(Row row, __m256i* r) {
  __m256i z[4];
  for (int a = 0; a < 4; ++a) z[a] = _mm256_inserti128_si256(_mm256_castsi128_si256(row(a)), row(a + 4), 1);
  const __m256i t0 = _mm256_unpacklo_epi32(z[0], z[1]), t1 = _mm256_unpackhi_epi32(z[0], z[1]);
  const __m256i t2 = _mm256_unpacklo_epi32(z[2], z[3]), t3 = _mm256_unpackhi_epi32(z[2], z[3]);
  r[0] = _mm256_unpacklo_epi64(t0, t2);
  r[1] = _mm256_unpackhi_epi64(t0, t2);
  r[2] = _mm256_unpacklo_epi64(t1, t3);
  r[3] = _mm256_unpackhi_epi64(t1, t3);
}

// The 16 bytes at `at` in each of 8 weight rows, row_bytes apart from `base`.
inline void dwords8(const uint8_t* base, size_t row_bytes, size_t at, __m256i* r) {
  dwords8([&](int f) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(base + f * row_bytes + at)); }, r);
}

inline __m256i x_dword(const int8_t* x, int j) {
  int32_t v;
  std::memcpy(&v, x + 4 * j, 4);
  return _mm256_set1_epi32(v);
}

// Per lane, the products of its 4 unsigned weight bytes u (any 0..255) with the 4 signed bytes s,
// added to acc: vpdpbusd, or without VNNI the same exact sum from 16-bit products (vpmaddubsw could
// saturate for 8-bit weights).
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {
#ifdef MLX_INFER_VNNI
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  const __m256i u_even = _mm256_and_si256(u, _mm256_set1_epi16(0x00FF)), u_odd = _mm256_srli_epi16(u, 8);
  const __m256i s_even = _mm256_srai_epi16(_mm256_slli_epi16(s, 8), 8), s_odd = _mm256_srai_epi16(s, 8);
  return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(u_even, s_even), _mm256_madd_epi16(u_odd, s_odd)));
#endif
}

// Block b of 8 features as VNNI operands, and their exact dot products with a row's quantized x.
template <int BITS>
struct Block8;

// 4-bit weights: dword j of a row's 16 bytes holds weights 8j..8j + 7, its low nibbles the even ones
// and its high nibbles the odd ones: the octets of x.
template <>
struct Block8<4> {
  __m256i lo[4], hi[4];

  Block8(const uint8_t* base, size_t row_bytes, int b) {
    __m256i r[4];
    dwords8(base, row_bytes, static_cast<size_t>(b) * 16, r);
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int j = 0; j < 4; ++j) {
      lo[j] = _mm256_and_si256(r[j], low);
      hi[j] = _mm256_and_si256(_mm256_srli_epi16(r[j], 4), low);
    }
  }

  // Against int8 x (or one byte of an int16 x) in octets.
  __m256i dot_bytes(const int8_t* x) const {
#ifdef MLX_INFER_VNNI
    __m256i even = _mm256_setzero_si256(), odd = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      even = dpbusd(even, lo[j], x_dword(x, 2 * j));
      odd = dpbusd(odd, hi[j], x_dword(x, 2 * j + 1));
    }
    return _mm256_add_epi32(even, odd);
#else
    // 16-bit pair sums of u8 x s8 (each at most 2 * 15 * 128 in magnitude: an int16 x's low bytes reach
    // -128) added eight at a time: at most 30720, no saturation; then widened.
    __m256i pairs = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(lo[j], x_dword(x, 2 * j)));
      pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(hi[j], x_dword(x, 2 * j + 1)));
    }
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#endif
  }

  template <bool X16>
  __m256i dot(const Int8Problem& p, size_t x_at) const {
    if constexpr (X16) {
      return _mm256_add_epi32(_mm256_slli_epi32(dot_bytes(p.xq + x_at), 8), dot_bytes(p.xl + x_at));
    } else {
      return dot_bytes(p.xq + x_at);
    }
  }
};

// 8-bit weights against x = 256 * xh + xl (QuantizedX's split16): dword j of a row's 32 bytes holds
// weights 4j..4j + 3, and w . x = 256 * (w . xh) + w . xl.
template <>
struct Block8<8> {
  __m256i w[8];

  Block8(const uint8_t* base, size_t row_bytes, int b) {
    dwords8(base, row_bytes, static_cast<size_t>(b) * 32, w);
    dwords8(base, row_bytes, static_cast<size_t>(b) * 32 + 16, w + 4);
  }

  template <bool X16>  // always int16 x
  __m256i dot(const Int8Problem& p, size_t x_at) const {
    __m256i high = _mm256_setzero_si256(), low = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      high = dpbusd(high, w[j], x_dword(p.xq + x_at, j));
      low = dpbusd(low, w[j], x_dword(p.xl + x_at, j));
    }
    return _mm256_add_epi32(_mm256_slli_epi32(high, 8), low);
  }
};

// Columns g0.. of 8 rows of `groups` scales or biases (rows first_row..first_row + 7), one row a lane, as
// float32: out[j][f] = row f's column g0 + j for j < param_columns(params) (4 float32 columns or 8 float16
// ones: 16 bytes of each row); columns past the rows' end are not written.
inline void columns8(const GroupParams& params, size_t first_row, int groups, int g0, float (*out)[8]) {
  const int left = groups - g0;
  if (params.half) {
    const uint16_t* rows = static_cast<const uint16_t*>(params.data) + first_row * groups + g0;
    __m256i r[4];
    dwords8([&](int f) {
      const uint16_t* row = rows + static_cast<size_t>(f) * groups;
      if (left >= 8) return _mm_loadu_si128(reinterpret_cast<const __m128i*>(row));
      alignas(16) uint16_t tail[8] = {};  // no reads past a row
      std::memcpy(tail, row, static_cast<size_t>(left) * sizeof(uint16_t));
      return _mm_load_si128(reinterpret_cast<const __m128i*>(tail));
    }, r);
    // Per 128-bit lane, each dword's low halves (columns 2j), then its high halves (2j + 1).
    const __m256i halves = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                            0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    for (int j = 0; j < 4; ++j) {
      const __m256i v = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(r[j], halves), _MM_SHUFFLE(3, 1, 2, 0));
      _mm256_store_ps(out[2 * j], _mm256_cvtph_ps(_mm256_castsi256_si128(v)));
      _mm256_store_ps(out[2 * j + 1], _mm256_cvtph_ps(_mm256_extracti128_si256(v, 1)));
    }
    return;
  }
  const float* rows = static_cast<const float*>(params.data) + first_row * groups;
  if (left >= 4) {
    __m256i r[4];
    dwords8(reinterpret_cast<const uint8_t*>(rows), groups * sizeof(float), g0 * sizeof(float), r);
    for (int j = 0; j < 4; ++j) _mm256_store_si256(reinterpret_cast<__m256i*>(out[j]), r[j]);
    return;
  }
  for (int j = 0; j < left; ++j) {
    for (int f = 0; f < 8; ++f) out[j][f] = rows[static_cast<size_t>(f) * groups + g0 + j];
  }
}

// Features [n0, n0 + 8) for rows [m0, m1), one feature a lane: features_one_by_one's operations. The
// block's weights are arranged once for all the rows; each row's running totals wait in `totals`.
template <int BITS, bool X16>
void lanes8(const Int8Problem& p, int n0, int m0, int m1) {
  const int groups = p.K / p.group, bpg = p.group / 32, blocks = p.K / 32;
  const size_t row_bytes = static_cast<size_t>(p.K) * BITS / 8;
  const uint8_t* base = reinterpret_cast<const uint8_t*>(p.w) + static_cast<size_t>(n0) * row_bytes;
  const TilePrefetch<8> ahead(p, n0, row_bytes, BITS * 4);
  alignas(32) float totals[kRowBlock][8];
  for (int m = m0; m < m1; ++m) _mm256_store_ps(totals[m - m0], _mm256_setzero_ps());
  const int per_load = param_columns(p.scales);
  alignas(64) float scale_columns[8][8], bias_columns[8][8];
  for (int g = 0; g < groups; ++g) {
    if (g % per_load == 0) {
      columns8(p.scales, n0, groups, g, scale_columns);
      columns8(p.biases, n0, groups, g, bias_columns);
    }
    const __m256 s = _mm256_load_ps(scale_columns[g % per_load]), bias = _mm256_load_ps(bias_columns[g % per_load]);
    for (int b = g * bpg; b < (g + 1) * bpg; ++b) {
      ahead.prefetch(b);
      const Block8<BITS> block(base, row_bytes, b);
      const bool group_ends = b == (g + 1) * bpg - 1;
      for (int m = m0; m < m1; ++m) {
        const __m256i dot = block.template dot<X16>(p, static_cast<size_t>(m) * p.K + static_cast<size_t>(b) * 32);
        const __m256 sd = _mm256_mul_ps(s, _mm256_set1_ps(p.dx[static_cast<size_t>(m) * blocks + b]));
        __m256 total = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), sd, _mm256_load_ps(totals[m - m0]));
        if (group_ends) total = _mm256_fmadd_ps(bias, _mm256_set1_ps(p.xsum[static_cast<size_t>(m) * groups + g]), total);
        _mm256_store_ps(totals[m - m0], total);
      }
    }
  }
  for (int m = m0; m < m1; ++m) _mm256_storeu_ps(p.out + static_cast<size_t>(m) * p.N + n0, _mm256_load_ps(totals[m - m0]));
}

template <int BITS, bool X16>
void lane_features(const Int8Problem& p, int n0, int n1) {
  const int n_end = n0 + (n1 - n0) / 8 * 8;
  for (int m0 = 0; m0 < p.M; m0 += kRowBlock) {
    const int m1 = std::min(p.M, m0 + kRowBlock);
    for (int n = n0; n < n_end; n += 8) lanes8<BITS, X16>(p, n, m0, m1);
  }
  features_one_by_one(p, n_end, n1);
}

}  // namespace

void features(const Int8Problem& p, int n0, int n1) {
  if (p.bits == 8) {
    lane_features<8, true>(p, n0, n1);
  } else if (p.x16) {
    lane_features<4, true>(p, n0, n1);
  } else {
    lane_features<4, false>(p, n0, n1);
  }
}

}  // namespace int8_*
}  // namespace mlx_infer
