#pragma once

#include <vector>

#include "mlx/mlx.h"

namespace mlx_infer {

// The index of each row's largest value of float32 x [R, V] as uint32 [R], as mx.argmax(x, axis=-1)
// gives it: the first of equal maxima, the first NaN where a row has one, 0 for a row of -inf.
mlx::core::array argmax_rows(const mlx::core::array& x);

// The log-probabilities the sampler reports, from float32 logits [R, V] and the chosen tokens [R]
// (int32): {chosen [R] float32, top_ids [R, k] int32, top_logprobs [R, k] float32}, log_softmax(x) =
// x - (max + log(sum(exp(x - max)))), the top k in descending order (equal values: the lower id first;
// NaNs are never among them), 0 <= k <= V.
std::vector<mlx::core::array> logprobs(const mlx::core::array& logits, const mlx::core::array& tokens, int k);

// A token of each row of float32 logits [R, V] drawn from softmax(logits / t) at its temperature t (0:
// the argmax) by inverting the CDF at its uniform u in [0, 1): uint32 [R].
mlx::core::array draw_rows(const mlx::core::array& logits, const mlx::core::array& temperatures,
                           const mlx::core::array& uniforms);

// Top-k, then top-p, then min-p of each row of float32 logits [R, V] (top_k [R] int32, 0: off; top_p [R]
// float32, 1: off; min_p [R] float32, 0: off): the kept logits, -inf elsewhere, as sampling.py's
// _truncate keeps them.
mlx::core::array truncate_top(const mlx::core::array& logits, const mlx::core::array& top_k,
                              const mlx::core::array& top_p, const mlx::core::array& min_p);

// Float32 logits [R, V] with each row's repetition/frequency/presence penalties and logit biases applied
// at the tokens it lists: row r's are ids[starts[r]:starts[r + 1]] (distinct), entries [N, 3] holding
// each one's count in the output, whether it was seen (prompt or output: 1, else 0) and its bias;
// params [R, 3] the row's repetition, frequency and presence penalties; pending [R] int32 a token each
// row's output holds that the host has not read (-1: none), counted as one more.
mlx::core::array adjust_logits(const mlx::core::array& logits, const mlx::core::array& starts,
                               const mlx::core::array& ids, const mlx::core::array& entries,
                               const mlx::core::array& params, const mlx::core::array& pending);

}  // namespace mlx_infer
