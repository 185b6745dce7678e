// The int8-activation matrix-vector kernel (qmv_int8.cpp), shared by its two builds.
#pragma once

#include <cstddef>
#include <cstdint>

namespace mlx_infer {

// One product: M rows of x quantized by quantize_activations, N features of affine 4/8-bit weights.
struct Int8Problem {
  const int8_t* xq;       // [M, K]; for 4-bit weights, each 64 values reordered (see quantize_activations)
  const float* dx;        // [M, K / 32] scale of each block of 32 values
  const float* dx_lanes;  // [M, K / 64, 8]: dx of blocks 2q, 2q + 1, each repeated 4 times (4-bit kernel)
  const int32_t* qsum;    // [M, K / 32] sum of each block's int8 values
  const float* xsum;      // [M, K / group] exact float sum of x over each weight group
  const uint32_t* w;
  const float* scales;
  const float* biases;
  float* out;
  int M, N, K, group, bits;
};

inline float bias_term(const Int8Problem& p, int n, int m) {
  const int groups = p.K / p.group;
  const float* b = p.biases + static_cast<size_t>(n) * groups;
  const float* xs = p.xsum + static_cast<size_t>(m) * groups;
  float sum = 0.0f;
  for (int g = 0; g < groups; ++g) sum += b[g] * xs[g];
  return sum;
}

// Output features [n0, n1) of every row, written to p.out.
namespace int8_avx2 {
void features(const Int8Problem& p, int n0, int n1);
}
namespace int8_vnni {
void features(const Int8Problem& p, int n0, int n1);
}

}  // namespace mlx_infer
