#pragma once

#include <optional>

#include "mlx/mlx.h"

namespace mlx_infer {

// The gated delta rule (Gated DeltaNet) over B sequences of up to L tokens each, in place in the state
// pool; a decode step is the case L = 1.
// pool: [S, 1, H * (Dk + 1) * Dv] float32: sequence b's slot is row slots[b], each head's block a [Dk, Dv]
// state matrix then one row of Dv that receives the head's last output. q, k: [B, L, H, Dk] (L2-normalised,
// q scaled); v: [B, L, H, Dv]; decay: [B, L, H] (exp(g), the first token's times 0 for a sequence that
// starts from zeros); beta: [B, L, H]; lengths: [B] tokens of each sequence (the rest is padding), or
// none: all L. Token t of sequence b runs after token t - 1, from the state in its slot.
// Returns {the pool with those slots updated (its buffer reused when nothing else holds it, as kv_write's),
// the outputs [B, L, H, Dv] (0 on padding)}.
std::vector<mlx::core::array> gated_delta(const mlx::core::array& pool, const mlx::core::array& slots,
                                          const mlx::core::array& q, const mlx::core::array& k,
                                          const mlx::core::array& v, const mlx::core::array& decay,
                                          const mlx::core::array& beta,
                                          const std::optional<mlx::core::array>& lengths);

}  // namespace mlx_infer
