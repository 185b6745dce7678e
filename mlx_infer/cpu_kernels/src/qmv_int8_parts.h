// What the 256-bit (qmv_int8.cpp) and 512-bit (qmv_int8_avx512.cpp) int8 kernels share. Internal
// linkage throughout: each build compiles these with its own target flags.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "qmv_int8.h"
#include "simd.h"

namespace mlx_infer {
namespace {

// The columns of scales or biases the vector kernels' columnsN widen from one 16-byte load of each row.
inline int param_columns(const GroupParams& params) { return params.half ? 8 : 4; }

// How far ahead (in output features of the same product) the weights, scales and biases are prefetched.
// The hardware prefetchers alone left these small products (a few hundred KB each, in three streams)
// waiting on memory: on the 2-vCPU AMD EPYC VM, SmolLM2's 120 layer products and 8-bit head called in
// turn, as in a decode step (115 MB), went from 12.7-15.3 to 7.4-10.2 ms (medians of 30, two runs each)
// with two tiles of 2-4 features ahead. 16 is one tile of the 512-bit kernel: two (24 KB of weights for K = 1536)
// had its lines evicted from L1 before use, and a single-row 576 x 1536 product took 67 us instead of
// 40 (one thread, Sapphire Rapids VM).
constexpr int kPrefetchFeatures = 16;

// Rows taken together: their quantized x (kRowBlock * K bytes, twice that as int16; 36-192 KB for SmolLM2)
// stays in L2 while the caller's features sweep across it; a decode step's few rows are one block.
constexpr int kRowBlock = 64;

// Prefetches, while an NB-feature tile is computed, the tile AHEAD features ahead: its scales and biases
// when constructed, and with prefetch(i) the weights step i of this tile's steps would read of it,
// `step_bytes` of each row a step (beyond the end of the arrays is harmless: no faults), with
// __builtin_prefetch's LOCALITY (3: into L1, as _MM_HINT_T0; 2: into L2, as _MM_HINT_T1).
template <int NB, int AHEAD = kPrefetchFeatures, int LOCALITY = 3>
struct TilePrefetch {
  const char* ahead;  // the first weight byte of the tile AHEAD features ahead
  int step_bytes;

  TilePrefetch(const Int8Problem& p, int n0, size_t row_bytes, int step) : step_bytes(step) {
    const int groups = p.K / p.group;
    ahead = reinterpret_cast<const char*>(p.w) + static_cast<size_t>(n0 + AHEAD) * row_bytes;
    const size_t at = static_cast<size_t>(n0 + AHEAD) * groups * p.scales.itemsize();
    for (size_t b = 0; b < NB * groups * p.scales.itemsize(); b += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(p.scales.bytes() + at + b), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(p.biases.bytes() + at + b), _MM_HINT_T0);
    }
  }

  // Over the tile's steps its NB contiguous rows are read at NB * step_bytes a step: the same share of
  // the tile ahead is requested.
  void prefetch(int i) const {
    for (int b = 0; b < NB * step_bytes; b += 64) {
      __builtin_prefetch(ahead + static_cast<size_t>(i) * NB * step_bytes + b, 0, LOCALITY);
    }
  }
};

// The integer dot product of block b of feature n's weights with row m's quantized x, exact: for
// 4-bit weights against int8 x in octets (within each 8 values, the even ones then the odd ones), for
// 8-bit weights against int16 x split in signed bytes, x = 256 * xh + xl.
inline int32_t block_dot(const Int8Problem& p, int n, int m, int b) {
  const size_t x_at = static_cast<size_t>(m) * p.K + static_cast<size_t>(b) * 32;
  int32_t sum = 0;
  if (p.bits == 4) {
    const uint8_t* w = reinterpret_cast<const uint8_t*>(p.w) + static_cast<size_t>(n) * (p.K / 2) + b * 16;
    auto x = [&](int at) { return p.x16 ? 256 * p.xq[x_at + at] + p.xl[x_at + at] : p.xq[x_at + at]; };
    for (int d = 0; d < 4; ++d) {
      for (int i = 0; i < 4; ++i) {
        const int byte = w[4 * d + i];  // weights 8d + 2i (low nibble) and 8d + 2i + 1 (high)
        sum += (byte & 0x0F) * x(8 * d + i) + (byte >> 4) * x(8 * d + 4 + i);
      }
    }
  } else {
    const uint8_t* w = reinterpret_cast<const uint8_t*>(p.w) + static_cast<size_t>(n) * p.K + b * 32;
    for (int k = 0; k < 32; ++k) sum += w[k] * (256 * p.xq[x_at + k] + p.xl[x_at + k]);
  }
  return sum;
}

// Features [n0, n1) of every row one at a time: what each lane of the vector kernels computes, in the
// same operations in the same order, so any feature may be left to it.
//   total = 0; per group g: per block b of g: total = fma(float(dot_b), s_g * dx_b, total);
//              then total = fma(bias_g, xsum_g, total)
inline void features_one_by_one(const Int8Problem& p, int n0, int n1) {
  const int groups = p.K / p.group, bpg = p.group / 32, blocks = p.K / 32;
  for (int n = n0; n < n1; ++n) {
    for (int m = 0; m < p.M; ++m) {
      float total = 0.0f;
      for (int g = 0; g < groups; ++g) {
        const float s = p.scales.at(static_cast<size_t>(n) * groups + g);
        for (int b = g * bpg; b < (g + 1) * bpg; ++b) {
          const float sd = s * p.dx[static_cast<size_t>(m) * blocks + b];
          total = std::fma(static_cast<float>(block_dot(p, n, m, b)), sd, total);
        }
        total = std::fma(p.biases.at(static_cast<size_t>(n) * groups + g), p.xsum[static_cast<size_t>(m) * groups + g], total);
      }
      p.out[static_cast<size_t>(m) * p.N + n] = total;
    }
  }
}

}  // namespace
}  // namespace mlx_infer
