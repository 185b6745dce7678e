#pragma once

#include "mlx/mlx.h"

namespace mlx_infer {

// One decode step of the gated delta rule (Gated DeltaNet) for B sequences, each reading its state matrix
// straight out of the slot pool. pool: [S, 1, H * Dk * Dv] float32, sequence b's state in row slots[b];
// q, k: [B, H, Dk] (L2-normalised, q scaled); v: [B, H, Dv]; decay: [B, H] (exp(g), times 0 for a sequence
// that starts from zeros); beta: [B, H]. Returns [B, H * Dk * Dv + H * Dv]: each sequence's new state, then
// its output (the write into the pool is kv_write's, which copies the leading H * Dk * Dv values).
mlx::core::array gated_delta_step(const mlx::core::array& pool, const mlx::core::array& slots,
                                  const mlx::core::array& q, const mlx::core::array& k, const mlx::core::array& v,
                                  const mlx::core::array& decay, const mlx::core::array& beta);

}  // namespace mlx_infer
