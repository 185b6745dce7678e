// The int8-activation product kernel (qmv_int8.cpp), shared by its two builds.
#pragma once

#include <cstddef>
#include <cstdint>

namespace mlx_infer {

// One product: M rows of x quantized by QuantizedX (quantized_matvec.cpp), N features of affine 4/8-bit
// weights. x is quantized per block of 32 values with one float scale dx: to int8 for 4-bit weights,
// to int16 for 8-bit ones (see qmv_int8.cpp).
struct Int8Problem {
  const int8_t* xq;       // 4-bit weights: [M, K] int8, each 64 values reordered (see QuantizedX)
  const int16_t* xq16;    // 8-bit weights: [M, K] int16
  const float* dx;        // [M, K / 32] scale of each block of 32 values
  const float* dx_lanes;  // [M, K / 64, 8]: dx of blocks 2q, 2q + 1, each repeated 4 times (4-bit kernels)
  const float* xsum;      // [M, K / group] sum of the quantized x over each weight group: sum_b dx_b * sum(qx_b)
  const uint32_t* w;
  const float* scales;
  const float* biases;
  float* out;
  int M, N, K, group, bits;
  bool x16;  // 4-bit weights: x in xq16 (int16, QuantizedX's x16 layout) instead of xq
};

// Output features [n0, n1) of every row, written to p.out. A row's outputs do not depend on M, on the
// other rows or on [n0, n1): the same operations in the same order whatever the tiling.
namespace int8_avx2 {
void features(const Int8Problem& p, int n0, int n1);
}
namespace int8_vnni {
void features(const Int8Problem& p, int n0, int n1);
}
// 512-bit vectors (qmv_int8_avx512.cpp): two features a vector, each computed as the 256-bit builds do.
namespace int8_avx512 {
void features(const Int8Problem& p, int n0, int n1);
}

}  // namespace mlx_infer
