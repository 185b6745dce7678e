#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mlx/mlx.h"
#include "qmv_int8.h"
#include "strided.h"

namespace mlx_infer {

// x [M, K] float32 @ dequantize(w, scales, biases).T for MLX affine 4- or 8-bit weights
// (w [N, K * bits / 32] uint32, scales/biases [N, K / group_size] float32 or float16, the same dtype)
// -> [M, N] float32.
mlx::core::array affine_qmv(
    const mlx::core::array& x,
    const mlx::core::array& w,
    const mlx::core::array& scales,
    const mlx::core::array& biases,
    int group_size,
    int bits);

// Rows ids of an affine 4/8-bit table (as affine_qmv's w/scales/biases), dequantized as MLX's dequantize
// computes them: [*ids.shape, K] float32 (an id outside [0, rows) gives zeros).
mlx::core::array embed_rows(const mlx::core::array& ids, const mlx::core::array& w, const mlx::core::array& scales,
                            const mlx::core::array& biases, int group_size, int bits);

// Throws std::invalid_argument unless w/scales/biases are an affine layer the kernels compute for
// inputs of K features.
void check_affine(const mlx::core::array& w, const mlx::core::array& scales, const mlx::core::array& biases, int K,
                  int group_size, int bits);

// What products multiply: "int8" quantizes x per block of 32 to int8 for 4-bit weights (int16 for 8-bit
// ones) and uses integer dot products for any number of rows (qmv_int8.cpp; 512-bit vectors where the
// CPU has AVX-512 VNNI, else AVX-VNNI where it has that), "int16" the same with int16 x for 4-bit weights
// too; either with "-256" in 256-bit vectors, with "-avx2" without VNNI. "float32" unpacks the weights to
// float (exact; the BLAS for 8 rows and more). Products the integer kernels do not fit (K not a multiple
// of 64) stay float32. Throws std::invalid_argument for anything else. activations() names the one in
// use: "float32", "int16", "int8-avx512", "int8-vnni" or "int8-avx2".
void set_activations(const std::string& kind);
std::string activations();

// An affine layer's arrays as plain row-major memory (what affine_product reads).
struct AffineView {
  const uint32_t* w;
  GroupParams scales, biases;
  int rows;  // output features N
  int group;
  int bits;
};

// An affine layer's inputs as recorded in eval_cpu; view() reads them in the dispatched task (in place,
// or gathered into the scratch of a strided input).
struct AffineWeights {
  struct Scratch {
    std::vector<uint32_t> w;
    std::vector<uint8_t> s, b;
  };
  AffineWeights(const mlx::core::array& w, const mlx::core::array& scales, const mlx::core::array& biases,
                int group_size, int bits);
  AffineView view(Scratch& scratch) const;

  Input<uint32_t> w;
  RawInput scales, biases;
  bool half;  // float16 scales and biases
  int rows, group, bits;
};

// out [M, N] = x [M, K] @ dequantize(w).T, row-major, split over the thread pool: the kernel behind
// affine_qmv, for the fused block ops to call directly.
void affine_product(const float* x, int M, int K, const AffineView& w, float* out);

}  // namespace mlx_infer
