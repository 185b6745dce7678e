// What the 256-bit (qmv_int8.cpp) and 512-bit (qmv_int8_avx512.cpp) int8 kernels share. Internal
// linkage throughout: each build compiles these with its own target flags.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "qmv_int8.h"
#include "simd.h"

namespace mlx_infer {
namespace {

// How far ahead (in tiles of the same product) the weights, scales and biases are prefetched. The
// hardware prefetchers alone left these small products (a few hundred KB each, in three streams)
// waiting on memory: on the 2-vCPU AMD EPYC VM, SmolLM2's 120 layer products and 8-bit head called
// in turn, as in a decode step (115 MB), went from 12.7-15.3 to 7.4-10.2 ms (medians of 30, two
// runs each); 4 tiles ahead was no better than 2.
constexpr int kPrefetchTiles = 2;

// Rows taken together: their int8 x (kRowBlock * K bytes, 36-96 KB for SmolLM2) stays in L2 while the
// caller's features sweep across it; a decode step's few rows are one block.
constexpr int kRowBlock = 64;

// The weight scales of the block pair starting at block b for feature row `sw` of group scales:
// lanes 0-3 block b's, lanes 4-7 block b + 1's (the lanes of a pair's VNNI sums).
inline __m256 pair_scales(const float* sw, int b, int blocks_per_group) {
  return _mm256_set_m128(_mm_set1_ps(sw[(b + 1) / blocks_per_group]), _mm_set1_ps(sw[b / blocks_per_group]));
}

// The weight and scale rows of an NB-feature output tile and where its weight prefetches point; both
// builds' tiles add their accumulators. Constructing it prefetches the scales and biases of the tile
// kPrefetchTiles ahead; prefetch(i) the weights that tile's step i will read, `step_bytes` of each row
// a step (beyond the end of the arrays is harmless: no faults).
template <int NB>
struct TileRows {
  const uint8_t* wr[NB];
  const float* sr[NB];
  const char* ahead;  // the first weight byte of the tile kPrefetchTiles ahead
  int step_bytes;

  TileRows(const Int8Problem& p, int n0, size_t row_bytes, int step) : step_bytes(step) {
    const int groups = p.K / p.group;
    for (int r = 0; r < NB; ++r) {
      wr[r] = reinterpret_cast<const uint8_t*>(p.w) + static_cast<size_t>(n0 + r) * row_bytes;
      sr[r] = p.scales + static_cast<size_t>(n0 + r) * groups;
    }
    ahead = reinterpret_cast<const char*>(wr[0]) + kPrefetchTiles * NB * row_bytes;
    const size_t at = static_cast<size_t>(n0 + kPrefetchTiles * NB) * groups;
    for (size_t b = 0; b < NB * groups * sizeof(float); b += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(p.scales + at) + b, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(p.biases + at) + b, _MM_HINT_T0);
    }
  }

  // Over the tile's steps its NB contiguous rows are read at NB * step_bytes a step: the same share of
  // the tile ahead is requested.
  void prefetch(int i) const {
    for (int b = 0; b < NB * step_bytes; b += 64) {
      _mm_prefetch(ahead + static_cast<size_t>(i) * NB * step_bytes + b, _MM_HINT_T0);
    }
  }
};

// sum_g b_{n,g} * xsum_{m,g}: eight groups a step, the tail masked.
inline float bias_term(const Int8Problem& p, int n, int m) {
  const int groups = p.K / p.group;
  const float* b = p.biases + static_cast<size_t>(n) * groups;
  const float* xs = p.xsum + static_cast<size_t>(m) * groups;
  __m256 sum = _mm256_setzero_ps();
  int g = 0;
  for (; g + 8 <= groups; g += 8) sum = _mm256_fmadd_ps(_mm256_loadu_ps(b + g), _mm256_loadu_ps(xs + g), sum);
  if (g < groups) {
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(groups - g), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    sum = _mm256_fmadd_ps(_mm256_maskload_ps(b + g, mask), _mm256_maskload_ps(xs + g, mask), sum);
  }
  return hsum(sum);
}

}  // namespace
}  // namespace mlx_infer
