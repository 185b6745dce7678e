#pragma once

#include <cstddef>
#include <cstdint>

#include "mlx/mlx.h"
#include "kv_format.h"

namespace mlx_infer {

// The pool [slots, n_kv, D] with rows [T, n_kv, D] written at slots[t]: one op, updating the pool in
// place when nothing else holds it (as MLX's scatter does), where MLX's own indexed assignment is a
// squeeze, a broadcast, a reshape and a scatter. (One pool per op: the outputs of a multi-output
// primitive share their inputs, so neither could take over its pool's buffer.) in_place: always in
// place, the pool being the engine's memory (a handle, as decoder_block.cpp's pools): whether nothing
// else held it depended on timing, as MLX keeps the buffers of the ops that read the pool last step
// (attention) until their tasks have run, so with the host ahead the write copied the whole pool.
// rows is [T, n_kv, D], or [T, W] whose row t holds the n_kv * D values from `column` on (the K or V part of
// a fused q/k/v product: no slice op in between). Rows of the pool's float dtype are copied; float32 rows
// are rounded to a half pool or quantized into an int8 one (see kv_format.h) as they are written.
mlx::core::array kv_write(const mlx::core::array& pool, const mlx::core::array& rows, const mlx::core::array& slots,
                          int column = 0, bool in_place = false);

// The kernel behind kv_write's float32 rows: row t (rows + t * row_stride, n_kv heads of D values) stored as
// the pool's type at slot slots[t] of the row-major pool memory (rounded to half, or quantized to int8).
void store_kv_rows(const float* rows, size_t row_stride, const int32_t* slots, size_t n, KVType type, int n_kv,
                   int D, uint8_t* pool);

}  // namespace mlx_infer
