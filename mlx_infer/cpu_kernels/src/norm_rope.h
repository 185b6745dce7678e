#pragma once

#include "mlx/mlx.h"

namespace mlx_infer {

// x [..., D] * rsqrt(mean(x^2) + eps) * (offset ? 1 + weight : weight), all float32.
mlx::core::array rms_norm(const mlx::core::array& x, const mlx::core::array& weight, float eps, bool offset);

// Half-split (non-traditional) RoPE of x [T, H, D] float32 on its first `dims` features, with the
// step's tables cos/sin [T, 1, dims / 2]; features past `dims` pass through.
mlx::core::array rope(const mlx::core::array& x, const mlx::core::array& cos, const mlx::core::array& sin, int dims);


// The kernels behind the two ops, on plain row-major memory, for the fused block ops to call: rms_norm
// over `rows` rows of D floats; RoPE of T rows of H heads of D floats (rows `x_stride` / `out_stride`
// floats apart; out may be x).
void rms_norm_rows(const float* x, const float* w, float* out, size_t rows, int D, float eps, bool offset);
void rope_rows(const float* x, size_t x_stride, float* out, size_t out_stride, int T, int H, int D, int dims,
               const float* cos, const float* sin);

}  // namespace mlx_infer
