#pragma once

#include "mlx/mlx.h"

namespace mlx_infer {

// The index of each row's largest value of float32 x [R, V] as uint32 [R], as mx.argmax(x, axis=-1)
// gives it: the first of equal maxima, the first NaN where a row has one, 0 for a row of -inf.
mlx::core::array argmax_rows(const mlx::core::array& x);

}  // namespace mlx_infer
