#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "mlx/mlx.h"

namespace mlx_infer {

struct LayerWeights;

// A Llama-style decoder block with its weights bound once; a call builds the step's op, which returns
// (out [T, D], key_pool, value_pool):
//   RMSNorm(x) @ the fused q/k/v affine layer (qkv = (w, scales, biases), group_size, bits; + bias),
//   Qwen3's RMSNorm over each q and k head where q_norm/k_norm are given (eps qk_eps), half-split RoPE
//   (tables cos/sin [T, 1, rope_dims / 2]) on q and k;
//   the k and v heads written into the pools (any KV type of kv_format.h) at slot_mapping[t], as kv_write;
//   h = x + o_proj(attention of the q heads, as paged_attention), out = h + down_proj(silu(gate) * up) of
//   RMSNorm(h) (post_norm_weight, post_eps), gate/up one fused affine layer (gate rows first).
// o_proj, gate_up, down_proj are (weight, scales, biases); quant holds (group_size, bits) of each in that
// order. The returned pools are the given ones with this step's rows written in place: the same buffers
// (a pool array is a handle on the engine's KV memory, not a value; see decoder_block.cpp).
class NativeLayer {
 public:
  NativeLayer(const mlx::core::array& norm_weight, float eps, const std::vector<mlx::core::array>& qkv,
              int group_size, int bits, const std::optional<mlx::core::array>& bias, int n_heads, int n_kv_heads,
              int head_dim, int rope_dims, const std::optional<mlx::core::array>& q_norm,
              const std::optional<mlx::core::array>& k_norm, float qk_eps, float scale, int window,
              const std::vector<mlx::core::array>& o_proj, const mlx::core::array& post_norm_weight, float post_eps,
              const std::vector<mlx::core::array>& gate_up, const std::vector<mlx::core::array>& down_proj,
              const std::vector<int>& quant);

  std::vector<mlx::core::array> operator()(const mlx::core::array& x, const mlx::core::array& key_pool,
                                           const mlx::core::array& value_pool, const mlx::core::array& cos,
                                           const mlx::core::array& sin, const mlx::core::array& slot_mapping,
                                           const mlx::core::array& block_tables, const mlx::core::array& context_lens,
                                           const mlx::core::array& positions, const mlx::core::array& token_seq,
                                           int block_size) const;

 const std::shared_ptr<const LayerWeights>& weights() const { return weights_; }

 private:
  std::shared_ptr<const LayerWeights> weights_;
};

// layers[i] on the output of layers[i - 1] (the first on x), each with its own pools and the step's
// shared tables: [out, key pool 0, value pool 0, key pool 1, ...], one op for a whole stack of blocks.
std::vector<mlx::core::array> run_layers(const std::vector<const NativeLayer*>& layers, const mlx::core::array& x,
                                         const std::vector<mlx::core::array>& key_pools,
                                         const std::vector<mlx::core::array>& value_pools,
                                         const mlx::core::array& cos, const mlx::core::array& sin,
                                         const mlx::core::array& slot_mapping, const mlx::core::array& block_tables,
                                         const mlx::core::array& context_lens, const mlx::core::array& positions,
                                         const mlx::core::array& token_seq, int block_size);

}  // namespace mlx_infer
