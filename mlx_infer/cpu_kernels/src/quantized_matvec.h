#pragma once

#include "mlx/mlx.h"

namespace mlx_infer {

// x [M, K] float32 @ dequantize(w, scales, biases).T for MLX affine 4- or 8-bit weights
// (w [N, K * bits / 32] uint32, scales/biases [N, K / group_size] float32) -> [M, N] float32.
mlx::core::array affine_qmv(
    const mlx::core::array& x,
    const mlx::core::array& w,
    const mlx::core::array& scales,
    const mlx::core::array& biases,
    int group_size,
    int bits);

}  // namespace mlx_infer
