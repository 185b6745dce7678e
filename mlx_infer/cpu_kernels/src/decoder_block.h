#pragma once

#include <optional>
#include <vector>

#include "mlx/mlx.h"

namespace mlx_infer {

// The first half of a Llama-style block on T rows: RMSNorm(x) @ the fused q/k/v affine layer (+ bias),
// an RMSNorm over each q and k head where q_norm/k_norm are given (Qwen3, eps qk_eps), then half-split
// RoPE (tables cos/sin [T, 1, rope_dims / 2]) on the q and k heads.
// Returns [T, (n_heads + 2 n_kv_heads) * head_dim]: q heads, then k heads, then v heads.
mlx::core::array block_qkv(const mlx::core::array& x, const mlx::core::array& norm_weight, float eps,
                           const mlx::core::array& w, const mlx::core::array& scales, const mlx::core::array& biases,
                           int group_size, int bits, const std::optional<mlx::core::array>& bias,
                           const mlx::core::array& cos, const mlx::core::array& sin, int n_heads, int n_kv_heads,
                           int head_dim, int rope_dims, const std::optional<mlx::core::array>& q_norm,
                           const std::optional<mlx::core::array>& k_norm, float qk_eps);

// The rest of the block, once the K/V parts of qkv are in the pools (any KV type of kv_format.h):
// h = x + o_proj(attention of the q part, as paged_attention), then h + down_proj(silu(gate) * up) of RMSNorm(h), where gate/up is one
// fused affine layer (gate rows first). o_proj, gate_up, down_proj are (weight, scales, biases); quant
// holds (group_size, bits) of each in that order. Returns [T, D].
mlx::core::array block_out(const mlx::core::array& qkv, const mlx::core::array& key_pool,
                           const mlx::core::array& value_pool, const mlx::core::array& block_tables,
                           const mlx::core::array& context_lens, const mlx::core::array& positions,
                           const mlx::core::array& token_seq, int block_size, float scale, int window,
                           const mlx::core::array& x, const std::vector<mlx::core::array>& o_proj,
                           const mlx::core::array& norm_weight, float eps,
                           const std::vector<mlx::core::array>& gate_up,
                           const std::vector<mlx::core::array>& down_proj, const std::vector<int>& quant,
                           int n_heads, int n_kv_heads, int head_dim);

}  // namespace mlx_infer
