// The int8-activation products of qmv_int8.cpp in 512-bit vectors, for CPUs with AVX-512 VNNI.
//
// Sixteen output features a vector, one a lane, each lane doing exactly what a lane of the 256-bit
// kernels (and features_one_by_one) does: the same exact integer dot product per block, the same
// scale products and the same chain of multiply-adds. So a product's outputs are the same bits as the
// 256-bit builds' (with or without VNNI), and an answer does not depend on which of these CPUs
// computes it. What 512 bits buy is instructions: each vpdpbusd covers four weights of sixteen
// features, a block's sixteen dot products are converted and scaled by one instruction each, and the
// weights are arranged once per block for all the rows.
//
// A feature range whose length is not a multiple of 16 leaves the rest to the 256-bit kernel
// (int8_avx2: the same results).
//
// With AMX (features_amx, where the compiler and the CPU have it and Linux lets the process use the
// tile registers), a decode step's 12 to 16 rows take their dot products from tile multiplies instead:
// per pair of blocks, one TDPBSUD a byte of x per block gives the exact int32 dot products of all the
// rows with 16 features (the same integers as vpdpbusd), and the float steps after them are unchanged,
// so the outputs are the same bits. What AMX saves is the per-row vpdpbusd chains and x broadcasts
// (measured on a 2-core Sapphire Rapids VM, 16 rows x 576 x 3072, int16 x: 4.3 ns a row and block of 16
// features against 5.7).

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "qmv_int8.h"
#include "qmv_int8_parts.h"

namespace mlx_infer {
namespace int8_avx512 {

namespace {

// Dwords j = 0..3 of 16 rows' 16 bytes, row(f) giving row f's: r[j] lane f holds row f's dword j. Rows
// 4L + a are loaded into 128-bit lane L of z[a], and a 4 x 4 transpose within each 128-bit lane puts them
// at lane 4L + a (qmv_int8.cpp's dwords8 in 512 bits).
template <class Row>
inline void dwords16(Row row, __m512i* r) {
  __m512i z[4];
  for (int a = 0; a < 4; ++a) {
    __m512i v = _mm512_castsi128_si512(row(a));
    v = _mm512_inserti32x4(v, row(a + 4), 1);
    v = _mm512_inserti32x4(v, row(a + 8), 2);
    z[a] = _mm512_inserti32x4(v, row(a + 12), 3);
  }
  const __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
  r[0] = _mm512_unpacklo_epi64(t0, t2);
  r[1] = _mm512_unpackhi_epi64(t0, t2);
  r[2] = _mm512_unpacklo_epi64(t1, t3);
  r[3] = _mm512_unpackhi_epi64(t1, t3);
}

// The 16 bytes at `at` in each of 16 weight rows, row_bytes apart from `base`.
inline void dwords16(const uint8_t* base, size_t row_bytes, size_t at, __m512i* r) {
  dwords16([&](int f) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(base + f * row_bytes + at)); }, r);
}

inline __m512i x_dword(const int8_t* x, int j) {
  int32_t v;
  std::memcpy(&v, x + 4 * j, 4);
  return _mm512_set1_epi32(v);
}

// Block b of 16 features as vpdpbusd operands, and their exact dot products with a row's quantized x
// (qmv_int8.cpp's Block8 in 512 bits).
template <int BITS>
struct Block16;

template <>
struct Block16<4> {
  __m512i lo[4], hi[4];  // dword j's even weights (low nibbles) and odd ones (high nibbles)

  // The block as the 8 rows of an AMX tile (lane f: feature f) in x's order (QuantizedX's octets):
  // dword j's low nibbles meet x's values 8j..8j + 3, its high ones 8j + 4..8j + 7.
  void tile_rows(__m512i* rows) const {
    for (int j = 0; j < 4; ++j) {
      rows[2 * j] = lo[j];
      rows[2 * j + 1] = hi[j];
    }
  }

  Block16(const uint8_t* base, size_t row_bytes, int b) {
    __m512i r[4];
    dwords16(base, row_bytes, static_cast<size_t>(b) * 16, r);
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int j = 0; j < 4; ++j) {
      lo[j] = _mm512_and_si512(r[j], low);
      hi[j] = _mm512_and_si512(_mm512_srli_epi16(r[j], 4), low);
    }
  }

  // Against int8 x (or one byte of an int16 x) in octets.
  __m512i dot_bytes(const int8_t* x) const {
    __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) {
      even = _mm512_dpbusd_epi32(even, lo[j], x_dword(x, 2 * j));
      odd = _mm512_dpbusd_epi32(odd, hi[j], x_dword(x, 2 * j + 1));
    }
    return _mm512_add_epi32(even, odd);
  }

  template <bool X16>
  __m512i dot(const Int8Problem& p, size_t x_at) const {
    if constexpr (X16) {
      return _mm512_add_epi32(_mm512_slli_epi32(dot_bytes(p.xq + x_at), 8), dot_bytes(p.xl + x_at));
    } else {
      return dot_bytes(p.xq + x_at);
    }
  }
};

// 8-bit weights against x = 256 * xh + xl (QuantizedX's split16): dword j of a row's 32 bytes holds
// weights 4j..4j + 3, and w . x = 256 * (w . xh) + w . xl.
template <>
struct Block16<8> {
  __m512i w[8];

  void tile_rows(__m512i* rows) const {
    for (int j = 0; j < 8; ++j) rows[j] = w[j];
  }

  Block16(const uint8_t* base, size_t row_bytes, int b) {
    dwords16(base, row_bytes, static_cast<size_t>(b) * 32, w);
    dwords16(base, row_bytes, static_cast<size_t>(b) * 32 + 16, w + 4);
  }

  template <bool X16>  // always int16 x
  __m512i dot(const Int8Problem& p, size_t x_at) const {
    __m512i high = _mm512_setzero_si512(), low = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      high = _mm512_dpbusd_epi32(high, w[j], x_dword(p.xq + x_at, j));
      low = _mm512_dpbusd_epi32(low, w[j], x_dword(p.xl + x_at, j));
    }
    return _mm512_add_epi32(_mm512_slli_epi32(high, 8), low);
  }
};

// One row's dot products with a 64-byte span of each of the 16 weight rows, the other way round from
// Block16: each row's span meets x as it lies, and the per-dword partial sums partial(f) (16 lanes) are
// added within groups of four lanes and transposed, so that out[q] lane f = the sum of partial(f)'s lanes
// 4q..4q + 3. A single row cannot amortize Block16's transposition (about 44 instructions a block); this
// takes about 11 a block. The sums are exact integers, so the same as Block16's. Each feature's sums are
// computed as the reduction takes them, two at a time: all sixteen computed first spilled to the stack
// (one row's 4-bit product ~10% slower, an 8-bit one ~20%).
template <class Partial>
inline void reduce_quads(Partial partial, __m512i (&out)[4]) {
  auto pair = [&](int i) {  // lane k: features 2i, 2i + 1, two partial sums each
    const __m512i a = partial(2 * i), b = partial(2 * i + 1);
    return _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
  };
  __m512i quads[4];
#pragma GCC unroll 4
  for (int q = 0; q < 4; ++q) {  // 128-bit lane k of quads[q]: features 4q..4q + 3, whole
    const __m512i a = pair(2 * q), b = pair(2 * q + 1);
    quads[q] = _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
  }
  const __m512i p0 = _mm512_shuffle_i32x4(quads[0], quads[1], 0x44), p1 = _mm512_shuffle_i32x4(quads[0], quads[1], 0xEE);
  const __m512i p2 = _mm512_shuffle_i32x4(quads[2], quads[3], 0x44), p3 = _mm512_shuffle_i32x4(quads[2], quads[3], 0xEE);
  out[0] = _mm512_shuffle_i32x4(p0, p2, 0x88);
  out[1] = _mm512_shuffle_i32x4(p0, p2, 0xDD);
  out[2] = _mm512_shuffle_i32x4(p1, p3, 0x88);
  out[3] = _mm512_shuffle_i32x4(p1, p3, 0xDD);
}

// The blocks of a row_dots span: 64 bytes of a weight row.
template <int BITS>
constexpr int kSpanBlocks = BITS == 4 ? 4 : 2;

// Row m's exact dot products with 64 bytes of each of the 16 weight rows from block b: blocks b..b + 3
// of 4-bit weights (dots[k] for block b + k) or b, b + 1 of 8-bit ones (dots[0], dots[1]). A row's last
// span may hold fewer blocks (`blocks`): the bytes past them are read as zeros (masked loads) and their
// dots are not used.
template <int BITS, bool X16>
inline void row_dots(const Int8Problem& p, const uint8_t* base, size_t row_bytes, int m, int b, int blocks,
                     __m512i* dots) {
  const bool whole = blocks == kSpanBlocks<BITS>;
  // The first `valid` of 64 bytes at `at` (x: 32 bytes a block; a weight row: BITS * 4), the rest zeros.
  auto load = [&](const void* at, int valid) {
    if (whole || valid >= 64) return _mm512_loadu_si512(at);
    if (valid <= 0) return _mm512_setzero_si512();
    return _mm512_maskz_loadu_epi8((__mmask64{1} << valid) - 1, at);
  };
  auto load_x = [&](const int8_t* x, int half) { return load(x + 64 * half, 32 * blocks - 64 * half); };
  const size_t x_at = static_cast<size_t>(m) * p.K + static_cast<size_t>(b) * 32;
  __m512i xh[2], xl[2];  // 4-bit: x's even and odd dwords of the four blocks; 8-bit: x's two blocks
  if constexpr (BITS == 4) {
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    for (int i = 0; i < (X16 ? 2 : 1); ++i) {
      const int8_t* x = (i == 0 ? p.xq : p.xl) + x_at;
      const __m512i a = load_x(x, 0), c = load_x(x, 1);
      (i == 0 ? xh : xl)[0] = _mm512_permutex2var_epi32(a, even, c);
      (i == 0 ? xh : xl)[1] = _mm512_permutex2var_epi32(a, odd, c);
    }
  } else {
    xh[0] = load_x(p.xq + x_at, 0);
    xl[0] = load_x(p.xl + x_at, 0);
  }
  const __m512i low = _mm512_set1_epi8(0x0F);
  // Feature f's 16 partial sums (lane l: dword l of its span).
  auto partial = [&](int f) {
    const uint8_t* row = base + f * row_bytes + static_cast<size_t>(b) * BITS * 4;
    const __m512i v = load(row, BITS * 4 * blocks);
    if constexpr (BITS == 4) {
      const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      const __m512i h = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xh[0]), hi, xh[1]);
      if constexpr (X16) {
        const __m512i l = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xl[0]), hi, xl[1]);
        return _mm512_add_epi32(_mm512_slli_epi32(h, 8), l);
      } else {
        return h;
      }
    } else {
      return _mm512_add_epi32(_mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), v, xh[0]), 8),
                              _mm512_dpbusd_epi32(_mm512_setzero_si512(), v, xl[0]));
    }
  };
  __m512i quads[4];
  reduce_quads(partial, quads);
  if constexpr (BITS == 4) {
    for (int k = 0; k < 4; ++k) dots[k] = quads[k];
  } else {  // a block is 8 dwords: two quads
    dots[0] = _mm512_add_epi32(quads[0], quads[1]);
    dots[1] = _mm512_add_epi32(quads[2], quads[3]);
  }
}

#ifdef MLX_INFER_HAVE_AMX
// The rows AMX takes (features_amx): a tile holds up to 16; below 12 the vpdpbusd path was as fast.
constexpr int kAmxMinRows = 12;
constexpr int kAmxMaxRows = 16;

// Tiles 0/1: blocks b and b + 1's int32 dot products with x's high bytes (int16 x; int8 x's only
// bytes), 2/3 the same with the low bytes; 4/5 64 bytes of each row's x high/low bytes (blocks b and
// b + 1); 6/7 blocks b and b + 1's weights as 16 rows of K/4 (tile_rows), each with the other block's
// 8 rows zero, so that one tile of x against each gives one block's dot products.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void configure_tiles(int rows) {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = static_cast<uint8_t>(t >= 6 ? 16 : rows);
    c.colsb[t] = 64;
  }
  _tile_loadconfig(&c);
}

// One byte plane of the configured rows of x (at `x`, `stride` bytes a row) into tile X, against both
// blocks' weights (tiles 6 and 7): their int32 dot products via tiles C0 and C1 into out[0] and out[1].
// A macro: GCC's tile intrinsics paste their tile numbers into the assembly as written.
#define MLX_INFER_AMX_PLANE(C0, C1, X, x, stride, out) \
  do {                                                  \
    _tile_zero(C0);                                     \
    _tile_zero(C1);                                     \
    _tile_loadd(X, x, stride);                          \
    _tile_dpbsud(C0, X, 6);                             \
    _tile_dpbsud(C1, X, 7);                             \
    _tile_stored(C0, (out)[0], 64);                     \
    _tile_stored(C1, (out)[1], 64);                     \
  } while (false)

// The exact dot products of the configured rows from m0 with blocks b and b + 1 (K is a multiple of 64:
// blocks come in pairs) of the 16 features at `base`: high[k][r] and low[k][r] for block b + k and row
// m0 + r, lane f feature f.
template <int BITS, bool X16>
void amx_pair(const Int8Problem& p, const uint8_t* base, size_t row_bytes, int b, int m0,
              int32_t (*high)[16][16], int32_t (*low)[16][16]) {
  alignas(64) __m512i w_rows[2][16];
  for (int j = 0; j < 8; ++j) w_rows[0][8 + j] = w_rows[1][j] = _mm512_setzero_si512();
  Block16<BITS>(base, row_bytes, b).tile_rows(w_rows[0]);
  Block16<BITS>(base, row_bytes, b + 1).tile_rows(w_rows[1] + 8);
  _tile_loadd(6, w_rows[0], 64);
  _tile_loadd(7, w_rows[1], 64);
  const size_t x_at = static_cast<size_t>(m0) * p.K + static_cast<size_t>(b) * 32;
  MLX_INFER_AMX_PLANE(0, 1, 4, p.xq + x_at, p.K, high);
  if constexpr (X16) MLX_INFER_AMX_PLANE(2, 3, 5, p.xl + x_at, p.K, low);
}
#undef MLX_INFER_AMX_PLANE
#endif

// Columns g0.. of 16 rows of `groups` scales or biases (rows first_row..first_row + 15), one row a lane, as
// float32: out[j][f] = row f's column g0 + j for j < param_columns(params) (4 float32 columns or 8 float16
// ones: 16 bytes of each row); columns past the rows' end are not written.
inline void columns16(const GroupParams& params, size_t first_row, int groups, int g0, float (*out)[16]) {
  const int left = groups - g0;
  if (params.half) {
    const uint16_t* rows = static_cast<const uint16_t*>(params.data) + first_row * groups + g0;
    const __mmask8 mask = left >= 8 ? 0xFF : static_cast<__mmask8>((1u << left) - 1);  // no reads past a row
    __m512i r[4];
    dwords16([&](int f) { return _mm_maskz_loadu_epi16(mask, rows + static_cast<size_t>(f) * groups); }, r);
    for (int j = 0; j < 4; ++j) {  // dword j of a row: its columns 2j (low half) and 2j + 1
      _mm512_store_ps(out[2 * j], _mm512_cvtph_ps(_mm512_cvtepi32_epi16(r[j])));
      _mm512_store_ps(out[2 * j + 1], _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(r[j], 16))));
    }
    return;
  }
  const float* rows = static_cast<const float*>(params.data) + first_row * groups;
  if (left >= 4) {
    __m512i r[4];
    dwords16(reinterpret_cast<const uint8_t*>(rows), groups * sizeof(float), g0 * sizeof(float), r);
    for (int j = 0; j < 4; ++j) _mm512_store_si512(reinterpret_cast<__m512i*>(out[j]), r[j]);
    return;
  }
  for (int j = 0; j < left; ++j) {
    for (int f = 0; f < 16; ++f) out[j][f] = rows[static_cast<size_t>(f) * groups + g0 + j];
  }
}

// Features [n0, n0 + 16) for rows [m0, m1), one feature a lane (qmv_int8.cpp's lanes8 in 512 bits).
template <int BITS, bool X16, bool AMX>
void lanes16(const Int8Problem& p, int n0, int m0, int m1) {
  const int groups = p.K / p.group, bpg = p.group / 32, blocks = p.K / 32;
  const size_t row_bytes = static_cast<size_t>(p.K) * BITS / 8;
  const uint8_t* base = reinterpret_cast<const uint8_t*>(p.w) + static_cast<size_t>(n0) * row_bytes;
  const TilePrefetch<16> ahead(p, n0, row_bytes, BITS * 4);
  alignas(64) float totals[kRowBlock][16];
  for (int m = m0; m < m1; ++m) _mm512_store_ps(totals[m - m0], _mm512_setzero_ps());
  const int per_load = param_columns(p.scales);
  alignas(64) float scale_columns[8][16], bias_columns[8][16];
#ifdef MLX_INFER_HAVE_AMX
  alignas(64) int32_t pair_high[2][16][16], pair_low[2][16][16];
#endif
  for (int g = 0; g < groups; ++g) {
    if (g % per_load == 0) {
      columns16(p.scales, n0, groups, g, scale_columns);
      columns16(p.biases, n0, groups, g, bias_columns);
    }
    const __m512 s = _mm512_load_ps(scale_columns[g % per_load]), bias = _mm512_load_ps(bias_columns[g % per_load]);
    for (int b = g * bpg; b < (g + 1) * bpg; ++b) {
      ahead.prefetch(b);
      const bool group_ends = b == (g + 1) * bpg - 1;
      auto add = [&](int m, __m512i dot) {
        const __m512 sd = _mm512_mul_ps(s, _mm512_set1_ps(p.dx[static_cast<size_t>(m) * blocks + b]));
        __m512 total = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), sd, _mm512_load_ps(totals[m - m0]));
        if (group_ends) total = _mm512_fmadd_ps(bias, _mm512_set1_ps(p.xsum[static_cast<size_t>(m) * groups + g]), total);
        _mm512_store_ps(totals[m - m0], total);
      };
#ifdef MLX_INFER_HAVE_AMX
      if constexpr (AMX) {  // the caller's rows fit a tile
        if (b % 2 == 0) amx_pair<BITS, X16>(p, base, row_bytes, b, m0, pair_high, pair_low);
        for (int m = m0; m < m1; ++m) {
          const __m512i h = _mm512_load_si512(pair_high[b % 2][m - m0]);
          add(m, X16 ? _mm512_add_epi32(_mm512_slli_epi32(h, 8), _mm512_load_si512(pair_low[b % 2][m - m0])) : h);
        }
        continue;
      }
#endif
      const Block16<BITS> block(base, row_bytes, b);
      for (int m = m0; m < m1; ++m) {
        add(m, block.template dot<X16>(p, static_cast<size_t>(m) * p.K + static_cast<size_t>(b) * 32));
      }
    }
  }
  for (int m = m0; m < m1; ++m) _mm512_storeu_ps(p.out + static_cast<size_t>(m) * p.N + n0, _mm512_load_ps(totals[m - m0]));
}

// Features [n0, n0 + 16) for row m alone (a decode step of one sequence): its dot products a span at a
// time (row_dots), then per block exactly lanes16's float steps, the running totals in a register. Kept
// apart from lanes16 so that neither loop is compiled around the other's registers: one loop for both
// spilled the totals and weights to the stack and ran at half this speed.
template <int BITS, bool X16>
void row16(const Int8Problem& p, int n0, int m) {
  const int groups = p.K / p.group, bpg = p.group / 32, blocks = p.K / 32;
  const size_t row_bytes = static_cast<size_t>(p.K) * BITS / 8;
  const uint8_t* base = reinterpret_cast<const uint8_t*>(p.w) + static_cast<size_t>(n0) * row_bytes;
  // Two tiles ahead into L2, not one into L1: one row's product streams its weights faster than one tile
  // ahead into L1 keeps up with (a cold 49152 x 576 8-bit head on two threads: ~22 GB/s that way, ~30 this
  // way; SmolLM2's 4-bit layers, once this loop had stopped spilling: decode batch 1 0.98, median of 14).
  const TilePrefetch<16, 2 * kPrefetchFeatures, 2> ahead(p, n0, row_bytes, BITS * 4);
  const int per_load = param_columns(p.scales);
  const float* dx = p.dx + static_cast<size_t>(m) * blocks;
  const float* xsum = p.xsum + static_cast<size_t>(m) * groups;
  alignas(64) float scale_columns[8][16], bias_columns[8][16];
  __m512 total = _mm512_setzero_ps();
  // Block b is block `in_group` of group g, whose scales and biases are column `column` of the loaded ones
  // (counted, not divided: a division a block cost as much as its arithmetic).
  int g = 0, in_group = 0, column = 0;
  for (int b0 = 0; b0 < blocks; b0 += kSpanBlocks<BITS>) {
    const int span = std::min(kSpanBlocks<BITS>, blocks - b0);
    __m512i dots[kSpanBlocks<BITS>];
    row_dots<BITS, X16>(p, base, row_bytes, m, b0, span, dots);
    for (int k = 0; k < span; ++k) {
      const int b = b0 + k;
      ahead.prefetch(b);
      if (in_group == 0 && column == 0) {
        columns16(p.scales, n0, groups, g, scale_columns);
        columns16(p.biases, n0, groups, g, bias_columns);
      }
      const __m512 sd = _mm512_mul_ps(_mm512_load_ps(scale_columns[column]), _mm512_set1_ps(dx[b]));
      total = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[k]), sd, total);
      if (++in_group == bpg) {
        total = _mm512_fmadd_ps(_mm512_load_ps(bias_columns[column]), _mm512_set1_ps(xsum[g]), total);
        in_group = 0;
        ++g;
        if (++column == per_load) column = 0;
      }
    }
  }
  _mm512_storeu_ps(p.out + static_cast<size_t>(m) * p.N + n0, total);
}

template <int BITS, bool X16>
void lane_features(const Int8Problem& p, int n0, int n1, bool amx) {
  const int n_end = n0 + (n1 - n0) / 16 * 16;
#ifdef MLX_INFER_HAVE_AMX
  if (amx && p.M >= kAmxMinRows && p.M <= kAmxMaxRows && n0 < n_end) {
    configure_tiles(p.M);  // per thread: each call configures the tiles it uses and releases them
    for (int n = n0; n < n_end; n += 16) lanes16<BITS, X16, true>(p, n, 0, p.M);
    _tile_release();
    if (n_end < n1) int8_avx2::features(p, n_end, n1);
    return;
  }
#else
  (void)amx;
#endif
  for (int m0 = 0; m0 < p.M; m0 += kRowBlock) {
    const int m1 = std::min(p.M, m0 + kRowBlock);
    for (int n = n0; n < n_end; n += 16) {
      if (m1 - m0 == 1) {
        row16<BITS, X16>(p, n, m0);
      } else {
        lanes16<BITS, X16, false>(p, n, m0, m1);
      }
    }
  }
  if (n_end < n1) int8_avx2::features(p, n_end, n1);
}

void dispatch(const Int8Problem& p, int n0, int n1, bool amx) {
  if (p.bits == 8) {
    lane_features<8, true>(p, n0, n1, amx);
  } else if (p.x16) {
    lane_features<4, true>(p, n0, n1, amx);
  } else {
    lane_features<4, false>(p, n0, n1, amx);
  }
}

}  // namespace

void features(const Int8Problem& p, int n0, int n1) { dispatch(p, n0, n1, false); }

#ifdef MLX_INFER_HAVE_AMX
void features_amx(const Int8Problem& p, int n0, int n1) { dispatch(p, n0, n1, true); }
#endif

}  // namespace int8_avx512
}  // namespace mlx_infer
