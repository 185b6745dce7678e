#pragma once

#include <optional>
#include <vector>

#include "mlx/mlx.h"
#include "kv_format.h"
#include "strided.h"

namespace mlx_infer {

// One attention call as plain memory: q rows [T] of q_stride floats, each starting with its [H, D]
// heads (a row of a fused q/k/v product, or [T, H, D] itself); out [T, H, Dv]; pools [slots, n_kv] rows of
// kv_type (kv_format.h: D values, int8 ones followed by their scale). Values are the first Dv of the
// value pool's Dv_row values a row (0: Dv = Dv_row = D; MLA reads them out of the key rows).
struct AttentionArgs {
  const float* q;
  const uint8_t* keys;
  const uint8_t* values;
  const int32_t* block_tables;
  const int32_t* context_lens;
  const int32_t* positions;
  const int32_t* token_seq;
  const float* sinks;  // [H] logits joining each softmax's denominator (gpt-oss), or nullptr
  float* out;
  int T, H, D, n_kv, max_blocks, block_size, window;
  float scale, softcap;
  size_t q_stride;
  KVType kv_type;
  int Dv = 0, Dv_row = 0;
};

// The vector width (bits) of attention's passes over the K/V rows: 512 where the CPU has AVX-512, else
// 256; both give the same bits, and set_attention_vectors(256) lets a test compare them.
void set_attention_vectors(int bits);
int attention_vectors();

// The kernel behind paged_attention (same semantics, below), split over the thread pool.
void attend_all(const AttentionArgs& args);

// The seven arrays attention reads (queries, K and V pools, block tables, context lengths, positions,
// token sequences), held by a dispatched task; attend() points args at them (row-major copies in
// scratch where strided) and runs attend_all.
struct AttentionInputs {
  Input<float> q;
  RawInput keys, values;
  Input<int32_t> tables, lens, positions, seqs;

  explicit AttentionInputs(const std::vector<mlx::core::array>& inputs)
      : q(inputs[0]), keys(inputs[1]), values(inputs[2]), tables(inputs[3]), lens(inputs[4]),
        positions(inputs[5]), seqs(inputs[6]) {}

  void attend(AttentionArgs args) const {
    std::vector<float> q_s;
    std::vector<uint8_t> k_s, v_s;
    std::vector<int32_t> t_s, l_s, p_s, s_s;
    args.q = q.rows(q_s);
    args.keys = keys.rows(k_s);
    args.values = values.rows(v_s);
    args.block_tables = tables.rows(t_s);
    args.context_lens = lens.rows(l_s);
    args.positions = positions.rows(p_s);
    args.token_seq = seqs.rows(s_s);
    attend_all(args);
  }
};

// Attention of float32 ragged queries q [T, H, D] over paged K/V pools [slots, n_kv_heads, D] of float32,
// float16 or bfloat16, or int8 pools [slots, n_kv_heads, D + 4] (kv_format.h), read where they lie.
// Token t belongs to sequence token_seq[t] at position positions[t] and sees keys
// j <= positions[t], j < context_lens[seq] (and j > positions[t] - window when window > 0), read
// from slot block_tables[seq, j / block_size] * block_size + j % block_size. softcap > 0 applies
// tanh soft-capping to the scores. sinks ([H] float32, optional): a logit per query head added to
// each softmax's denominator with no value (gpt-oss), so a head's weights may sum to less than one.
// value_dim > 0: the values are the first value_dim of each value row (which may be the key pool itself,
// MLA's latent rows). Returns [T, H, value_dim or D] float32.
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
    float softcap,
    const std::optional<mlx::core::array>& sinks,
    int value_dim = 0);

}  // namespace mlx_infer
