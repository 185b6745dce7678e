#pragma once

#include "mlx/mlx.h"

namespace mlx_infer {

// x [..., D] * rsqrt(mean(x^2) + eps) * (offset ? 1 + weight : weight), all float32.
mlx::core::array rms_norm(const mlx::core::array& x, const mlx::core::array& weight, float eps, bool offset);

// Half-split (non-traditional) RoPE of x [T, H, D] float32 on its first `dims` features, with the
// step's tables cos/sin [T, 1, dims / 2]; features past `dims` pass through.
mlx::core::array rope(const mlx::core::array& x, const mlx::core::array& cos, const mlx::core::array& sin, int dims);

}  // namespace mlx_infer
