// The int8-activation product kernel (qmv_int8.cpp), shared by its two builds.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

namespace mlx_infer {

// An affine layer's per-group scales or biases, [N, groups] row-major: float32, or float16 as GGUF
// Q4_0/Q4_1/Q8_0 and half-precision MLX checkpoints store them, kept so because a step reads them with
// every weight group: at group 32, 2 bytes each against 4 is a sixth of a 4-bit layer's bytes. The
// kernels widen them to float32 as they read them (exact), so the arithmetic is the same either way.
struct GroupParams {
  const void* data;
  bool half;

  size_t itemsize() const { return half ? 2 : 4; }
  const uint8_t* bytes() const { return static_cast<const uint8_t*>(data); }
  float at(size_t i) const {
    return half ? _cvtsh_ss(static_cast<const uint16_t*>(data)[i]) : static_cast<const float*>(data)[i];
  }
};

// One product: M rows of x quantized by QuantizedX (quantized_matvec.cpp), N features of affine 4/8-bit
// weights. x is quantized per block of 32 values with one float scale dx: to int8 for 4-bit weights,
// to int16 for 8-bit ones (see qmv_int8.cpp).
struct Int8Problem {
  const int8_t* xq;       // int8 x [M, K], or the bytes h of an int16 x = 256 h + l (QuantizedX's layouts:
                          // for 4-bit weights each 8 values as their even then odd ones)
  const int8_t* xl;       // int16 x: [M, K] l, its low byte as a signed one
  const float* dx;        // [M, K / 32] scale of each block of 32 values
  const float* xsum;      // [M, K / group] sum of the quantized x over each weight group: sum_b dx_b * sum(qx_b)
  const uint32_t* w;
  GroupParams scales, biases;
  float* out;
  int M, N, K, group, bits;
  bool x16;  // x is int16 (xq and xl; always for 8-bit weights)
};

// Output features [n0, n1) of every row, written to p.out. A row's outputs do not depend on M, on the
// other rows or on [n0, n1): the same operations in the same order whatever the tiling.
namespace int8_avx2 {
void features(const Int8Problem& p, int n0, int n1);
}
namespace int8_vnni {
void features(const Int8Problem& p, int n0, int n1);
}
// 512-bit vectors (qmv_int8_avx512.cpp): sixteen features a vector, each computed as the 256-bit builds do.
namespace int8_avx512 {
void features(const Int8Problem& p, int n0, int n1);
// The same with AMX tile multiplies for 12-16 rows (MLX_INFER_HAVE_AMX builds; the caller checks that the
// CPU has AMX and that the process may use it: amx_usable in quantized_matvec.cpp).
void features_amx(const Int8Problem& p, int n0, int n1);
}

}  // namespace mlx_infer
