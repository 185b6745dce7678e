// The passes of paged attention over one KV head's rows in 512-bit vectors (paged_attention_avx512.cpp,
// built with AVX-512 flags and chosen at run time): the same bits as paged_attention.cpp's 256-bit ones.
#pragma once

#include <cstdint>

#include "fetch_ahead.h"
#include "kv_format.h"

namespace mlx_infer {
namespace attention_avx512 {

// s[r][i] = (q_r . k_i) * k_i's row scale * scale for count (1-3) query rows q and the n key rows, fetching
// `ahead` as they go.
template <KVType K>
void score_heads(const float* const* q, int count, const uint8_t* const* rows, int n, int D, float scale,
                 float* const* s, Ahead& ahead);

// out[r][0..Dv) = sum_i w[r][i] * v_i[0..Dv) (int8 rows times their scale, found at scale_at) for count
// (1-3) query rows, fetching `ahead` as they go.
template <KVType K>
void value_heads(const uint8_t* const* v, const float* const* w, int count, int n, int Dv, int scale_at,
                 float* const* out, Ahead& ahead);

// row[0..n) = exp(row[i] - m), returning their sum, as paged_attention.cpp's exp_row computes them.
float exp_row(float* row, int n, float m);

}  // namespace attention_avx512
}  // namespace mlx_infer
