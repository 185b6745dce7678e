#pragma once

#include "mlx/mlx.h"

namespace mlx_infer {

// Attention of ragged queries q [T, H, D] over paged K/V pools [slots, n_kv_heads, D], all float32.
// Token t belongs to sequence token_seq[t] at position positions[t] and sees keys
// j <= positions[t], j < context_lens[seq] (and j > positions[t] - window when window > 0), read
// from slot block_tables[seq, j / block_size] * block_size + j % block_size. softcap > 0 applies
// tanh soft-capping to the scores. Returns [T, H, D] float32.
mlx::core::array paged_attention(
    const mlx::core::array& q,
    const mlx::core::array& key_pool,
    const mlx::core::array& value_pool,
    const mlx::core::array& block_tables,
    const mlx::core::array& context_lens,
    const mlx::core::array& positions,
    const mlx::core::array& token_seq,
    int block_size,
    float scale,
    int window,
    float softcap);

}  // namespace mlx_infer
