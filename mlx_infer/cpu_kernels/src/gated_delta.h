#pragma once

#include "mlx/mlx.h"

namespace mlx_infer {

// One decode step of the gated delta rule (Gated DeltaNet) for B sequences, in place in the state pool.
// pool: [S, 1, H * (Dk + 1) * Dv] float32: sequence b's slot is row slots[b], each head's block a [Dk, Dv]
// state matrix then one row of Dv that receives the head's output. q, k: [B, H, Dk] (L2-normalised, q
// scaled); v: [B, H, Dv]; decay: [B, H] (exp(g), times 0 for a sequence that starts from zeros); beta: [B, H].
// Returns the pool with those slots updated (its buffer reused when nothing else holds it, as kv_write's).
mlx::core::array gated_delta_step(const mlx::core::array& pool, const mlx::core::array& slots,
                                  const mlx::core::array& q, const mlx::core::array& k, const mlx::core::array& v,
                                  const mlx::core::array& decay, const mlx::core::array& beta);

}  // namespace mlx_infer
