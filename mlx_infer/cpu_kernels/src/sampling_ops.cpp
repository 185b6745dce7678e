// The sampler's reductions over a step's logits, vectorized and split over the rows: greedy sampling's
// argmax, the reported log-probabilities, top-k/top-p/min-p truncation, temperature draws, and the
// penalties and logit biases applied at just the tokens they touch.
//
// MLX's CPU argmax compares one element at a time: ~0.9 ms for a batch-16 step's 16 x 49152 logits
// (SmolLM2), on one thread while the other core waits, ~3% of the step; this takes ~0.1 ms. Its
// logsumexp, take_along_axis and argpartition for the log-probabilities added 11 ms (k = 0) to 19 ms
// (k = 5) to a 33 ms batch-16 step; its full sort for top-p 0.9 made the step 190 ms, and its Gumbel noise
// for every logit at a temperature 8 ms.

#include "sampling_ops.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <utility>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "simd.h"
#include "strided.h"
#include "thread_pool.h"

namespace mx = mlx::core;

namespace mlx_infer {

namespace {

// The start of each op's eval_cpu here: the outputs allocated, they and the inputs registered with the
// stream's encoder, returned for the dispatch.
template <typename... Outputs>
mx::cpu::CommandEncoder& begin_eval(const mx::Stream& stream, const std::vector<mx::array>& inputs,
                                    Outputs&... outputs) {
  auto& encoder = mx::cpu::get_command_encoder(stream);
  for (const auto& a : inputs) encoder.set_input_array(a);
  for (mx::array* o : {&outputs...}) {
    o->set_data(mx::allocator::malloc(o->nbytes()));
    encoder.set_output_array(*o);
  }
  return encoder;
}

// Splits rows over the pool unless they are a decode step's few.
template <typename F>
void over_rows(int R, F&& rows) {
  if (R < 4) {
    rows(0, R);
    return;
  }
  pool().for_range(R, 1, rows);
}

// Eight lanes each keep the first index of their largest value (a strict > keeps the first of equal
// ones); the row's answer is the smallest index among the lanes holding the largest. A NaN anywhere
// makes the row's answer its first NaN, as mx.argmax and NumPy answer.
uint32_t argmax_row(const float* x, int V) {
  int i = 0;
  uint32_t best = 0;
  if (V >= 8) {
    __m256 vmax = _mm256_loadu_ps(x);
    __m256i vidx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 unordered = _mm256_cmp_ps(vmax, vmax, _CMP_UNORD_Q);
    __m256i at = vidx;
    for (i = 8; i + 8 <= V; i += 8) {
      at = _mm256_add_epi32(at, _mm256_set1_epi32(8));
      const __m256 v = _mm256_loadu_ps(x + i);
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      const __m256 greater = _mm256_cmp_ps(v, vmax, _CMP_GT_OQ);
      vmax = _mm256_blendv_ps(vmax, v, greater);
      vidx = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(vidx), _mm256_castsi256_ps(at), greater));
    }
    if (_mm256_movemask_ps(unordered) != 0) {
      for (int j = 0; j < i; ++j) {
        if (std::isnan(x[j])) return static_cast<uint32_t>(j);
      }
    }
    alignas(32) float values[8];
    alignas(32) int32_t indices[8];
    _mm256_store_ps(values, vmax);
    _mm256_store_si256(reinterpret_cast<__m256i*>(indices), vidx);
    float m = values[0];
    for (int l = 1; l < 8; ++l) m = values[l] > m ? values[l] : m;
    best = static_cast<uint32_t>(V);
    for (int l = 0; l < 8; ++l) {
      if (values[l] == m && static_cast<uint32_t>(indices[l]) < best) best = static_cast<uint32_t>(indices[l]);
    }
  }
  for (; i < V; ++i) {  // the tail (or a short row) one at a time, as MLX compares
    if (std::isnan(x[i])) return static_cast<uint32_t>(i);
    if (x[i] > x[best]) best = static_cast<uint32_t>(i);
  }
  return best;
}

class ArgmaxRows : public mx::UnaryPrimitive {
 public:
  explicit ArgmaxRows(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    auto& encoder = begin_eval(stream(), inputs, out);
    const int R = inputs[0].shape(0);
    const int V = inputs[0].shape(1);
    encoder.dispatch([x = Input<float>(inputs[0]), op = out.data<uint32_t>(), R, V]() {
      std::vector<float> x_s;
      const float* xp = x.rows(x_s);
      over_rows(R, [&](int r0, int r1) {
        for (int r = r0; r < r1; ++r) op[r] = argmax_row(xp + static_cast<size_t>(r) * V, V);
      });
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("ArgmaxRows is a CPU kernel");
  }

  const char* name() const override { return "NativeArgmaxRows"; }

  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

// sum(exp(x - m)) over a row, exp8's exponentials eight at a time (a NaN makes it NaN).
float sum_exp(const float* x, int V, float m) {
  const __m256 vm = _mm256_set1_ps(m);
  __m256 total = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= V; i += 8) total = _mm256_add_ps(total, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm)));
  float sum = hsum(total);
  for (; i < V; ++i) sum += std::exp(x[i] - m);
  return sum;
}

// log(sum(exp(x - max))) + max over a row.
float log_sum_exp(const float* x, int V) {
  const float m = max_of(x, V);
  if (std::isinf(m)) return m;  // every logit -inf (or one +inf): as log(sum(exp)) would say
  return m + std::log(sum_exp(x, V, m));
}

// The k largest values of a row (k >= 1) into ids/values, descending, equal values by the lower id:
// a value enters only when larger than the k-th so far, the row scanned eight at a time against it.
void top_k(const float* x, int V, int k, int32_t* ids, float* values) {
  int count = 0;
  const auto offer = [&](int i) {
    const float v = x[i];
    if (std::isnan(v) || (count == k && !(v > values[k - 1]))) return;
    int at = count < k ? count++ : k - 1;
    for (; at > 0 && v > values[at - 1]; --at) {  // after the equal ones: they have lower ids
      values[at] = values[at - 1];
      ids[at] = ids[at - 1];
    }
    values[at] = v;
    ids[at] = i;
  };
  int i = 0;
  for (; i < V && count < k; ++i) offer(i);
  for (; i + 8 <= V; i += 8) {
    const __m256 above = _mm256_cmp_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(values[k - 1]), _CMP_GT_OQ);
    for (int mask = _mm256_movemask_ps(above); mask != 0; mask &= mask - 1) offer(i + __builtin_ctz(mask));
  }
  for (; i < V; ++i) offer(i);
  for (int j = count; j < k; ++j) {  // a row with fewer than k values that are not NaN
    ids[j] = 0;
    values[j] = -INFINITY;
  }
}

// Min-p's test of a token kept so far: its probability at least min_p times the top token's, which
// for softmax weights is x - max >= log(min_p) (the denominator cancels; no exponential per token).
inline bool passes_min_p(float x, float m, float log_min_p) { return x - m >= log_min_p; }

// Top-k, then top-p, then min-p of one row (sampling.py's _truncate): out = x where kept, -inf
// elsewhere. Tokens rank by descending logit, equal ones by the lower id; top-k keeps the first k (k =
// 0: all); top-p (p < 1) keeps those whose probability mass ranked before them, under the softmax of
// the top-k ones, is below p (so the first always stays); min-p (> 0) keeps those of the rest whose
// probability is at least min_p times the top one's. Only the tokens that can be kept are ranked: the
// top k, or for top-p alone those above a logit cut lowered until they hold p of the mass.
void truncate_row(const float* x, int V, int k, float p, float min_p, float* out) {
  const bool cuts_k = k > 0 && k < V;
  const float m = max_of(x, V);
  const float log_min_p = min_p > 0.0f ? std::log(min_p) : -INFINITY;
  if (!cuts_k && !(p < 1.0f)) {  // min-p alone, or nothing
    for (int i = 0; i < V; ++i) out[i] = passes_min_p(x[i], m, log_min_p) ? x[i] : -INFINITY;
    return;
  }
  std::vector<std::pair<float, int>> ranked;  // (logit, id), descending, ties by id
  const auto by_rank = [](const std::pair<float, int>& a, const std::pair<float, int>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  if (cuts_k) {
    std::vector<int32_t> ids(k);
    std::vector<float> values(k);
    top_k(x, V, k, ids.data(), values.data());
    for (int j = 0; j < k; ++j) ranked.emplace_back(values[j], ids[j]);
  }
  if (p < 1.0f) {
    float total = 0.0f;  // the softmax's denominator over the tokens top-k keeps
    if (!cuts_k) {
      total = sum_exp(x, V, m);
      for (float cut = m - 8.0f;; cut -= 8.0f) {  // e^-8 of the top token's weight a step
        ranked.clear();
        float mass = 0.0f;
        for (int i = 0; i < V; ++i) {
          if (x[i] >= cut) {
            ranked.emplace_back(x[i], i);
            mass += std::exp(x[i] - m);
          }
        }
        // A margin over p: the walk below sums in its own order, and must end within the candidates.
        if (mass > 1.001f * p * total || static_cast<int>(ranked.size()) == V || !(cut > -INFINITY)) break;
      }
    } else {
      for (const auto& [v, id] : ranked) total += std::exp(v - m);
    }
    std::sort(ranked.begin(), ranked.end(), by_rank);
    float before = 0.0f;  // the mass ranked before the next token
    size_t keep = 0;
    for (; keep < ranked.size() && before < p; ++keep) before += std::exp(ranked[keep].first - m) / total;
    ranked.resize(keep);
  }
  std::fill(out, out + V, -INFINITY);
  for (const auto& [v, id] : ranked) {
    if (passes_min_p(v, m, log_min_p)) out[id] = v;
  }
}

class TruncateTop : public mx::UnaryPrimitive {
 public:
  explicit TruncateTop(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    auto& encoder = begin_eval(stream(), inputs, out);
    const int R = inputs[0].shape(0);
    const int V = inputs[0].shape(1);
    encoder.dispatch([x = Input<float>(inputs[0]), top_k = Input<int32_t>(inputs[1]), top_p = Input<float>(inputs[2]),
                      min_p = Input<float>(inputs[3]), op = out.data<float>(), R, V]() {
      std::vector<float> x_s, p_s, mp_s;
      std::vector<int32_t> k_s;
      const float* xp = x.rows(x_s);
      const int32_t* kp = top_k.rows(k_s);
      const float* pp = top_p.rows(p_s);
      const float* mpp = min_p.rows(mp_s);
      over_rows(R, [&](int r0, int r1) {
        for (int r = r0; r < r1; ++r) {
          const size_t at = static_cast<size_t>(r) * V;
          truncate_row(xp + at, V, kp[r], pp[r], mpp[r], op + at);
        }
      });
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("TruncateTop is a CPU kernel");
  }

  const char* name() const override { return "NativeTruncateTop"; }

  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

// Row r's logits with its penalties and biases applied at the tokens it lists (sampling.py's dense
// _apply_penalties computes the same at those tokens and leaves the others as they are): a seen token
// (in the prompt or the output) divided by the repetition penalty where positive, multiplied where not;
// a token the output holds `count` times lowered by frequency * count, then by presence; then its bias.
// `pending` (-1: none) is one more output token the host has not read yet: the previous step's sample,
// still on its way while this step is built.
void adjust_row(float* row, int V, const int32_t* ids, const float* entries, int n, const float* params,
                int32_t pending) {
  const float repetition = params[0], frequency = params[1], presence = params[2];
  const auto adjust = [&](int32_t id, float count, float seen, float bias) {
    if (id < 0 || id >= V) return;  // sampling.py lists none: no write outside the row
    float v = row[id];
    if (seen != 0.0f && repetition != 1.0f) v = v > 0.0f ? v / repetition : v * repetition;
    if (count > 0.0f) v = (v - frequency * count) - presence;
    row[id] = v + bias;
  };
  bool pending_listed = false;
  for (int j = 0; j < n; ++j) {
    const bool is_pending = ids[j] == pending;
    pending_listed |= is_pending;
    adjust(ids[j], entries[3 * j] + (is_pending ? 1.0f : 0.0f), is_pending ? 1.0f : entries[3 * j + 1],
           entries[3 * j + 2]);
  }
  if (pending >= 0 && !pending_listed) adjust(pending, 1.0f, 1.0f, 0.0f);
}

class AdjustLogits : public mx::UnaryPrimitive {
 public:
  explicit AdjustLogits(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    auto& encoder = begin_eval(stream(), inputs, out);
    const int R = inputs[0].shape(0);
    const int V = inputs[0].shape(1);
    encoder.dispatch([x = Input<float>(inputs[0]), starts = Input<int32_t>(inputs[1]), ids = Input<int32_t>(inputs[2]),
                      entries = Input<float>(inputs[3]), params = Input<float>(inputs[4]),
                      pending = Input<int32_t>(inputs[5]), op = out.data<float>(), R, V]() {
      std::vector<float> x_s, e_s, p_s;
      std::vector<int32_t> s_s, i_s, n_s;
      const float* xp = x.rows(x_s);
      const int32_t* sp = starts.rows(s_s);
      const int32_t* ip = ids.rows(i_s);
      const float* ep = entries.rows(e_s);
      const float* pp = params.rows(p_s);
      const int32_t* np = pending.rows(n_s);
      std::copy(xp, xp + static_cast<size_t>(R) * V, op);
      for (int r = 0; r < R; ++r) {
        adjust_row(op + static_cast<size_t>(r) * V, V, ip + sp[r], ep + 3 * static_cast<size_t>(sp[r]), sp[r + 1] - sp[r],
                   pp + 3 * r, np[r]);
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("AdjustLogits is a CPU kernel");
  }

  const char* name() const override { return "NativeAdjustLogits"; }

  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

// A draw from softmax(x / t) by inverting its CDF at u in [0, 1): the first token whose cumulative
// weight exceeds u times the total (weights exp((x - max) / t), summed in double in id order; -inf
// logits weigh 0). t = 0: the argmax. One uniform a row instead of a Gumbel noise per logit.
uint32_t draw_row(const float* x, int V, float t, float u, std::vector<float>& weights) {
  if (t == 0.0f) return argmax_row(x, V);
  const float m = max_of(x, V);
  weights.resize(V);
  const __m256 vm = _mm256_set1_ps(m), inv = _mm256_set1_ps(1.0f / t);
  int i = 0;
  for (; i + 8 <= V; i += 8) {
    _mm256_storeu_ps(weights.data() + i, exp8(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm), inv)));
  }
  for (; i < V; ++i) weights[i] = std::exp((x[i] - m) / t);
  double total = 0.0;
  for (int j = 0; j < V; ++j) total += x[j] == -INFINITY ? 0.0 : weights[j];  // exp8 clamps: -inf is not 0
  const double target = static_cast<double>(u) * total;
  double acc = 0.0;
  uint32_t last = 0;
  for (int j = 0; j < V; ++j) {
    if (x[j] == -INFINITY) continue;
    acc += weights[j];
    last = static_cast<uint32_t>(j);
    if (acc > target) return last;
  }
  return last;  // u * total rounded up to the total: the last token that weighs anything
}

class DrawRows : public mx::UnaryPrimitive {
 public:
  explicit DrawRows(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    auto& encoder = begin_eval(stream(), inputs, out);
    const int R = inputs[0].shape(0);
    const int V = inputs[0].shape(1);
    encoder.dispatch([x = Input<float>(inputs[0]), temps = Input<float>(inputs[1]), uniforms = Input<float>(inputs[2]),
                      op = out.data<uint32_t>(), R, V]() {
      std::vector<float> x_s, t_s, u_s;
      const float* xp = x.rows(x_s);
      const float* tp = temps.rows(t_s);
      const float* up = uniforms.rows(u_s);
      over_rows(R, [&](int r0, int r1) {
        std::vector<float> weights;
        for (int r = r0; r < r1; ++r) op[r] = draw_row(xp + static_cast<size_t>(r) * V, V, tp[r], up[r], weights);
      });
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("DrawRows is a CPU kernel");
  }

  const char* name() const override { return "NativeDrawRows"; }

  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

class LogProbs : public mx::Primitive {
 public:
  LogProbs(mx::Stream stream, int k) : mx::Primitive(stream), k_(k) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& encoder = begin_eval(stream(), inputs, outputs[0], outputs[1], outputs[2]);
    const int R = inputs[0].shape(0);
    const int V = inputs[0].shape(1);
    encoder.dispatch([x = Input<float>(inputs[0]), tokens = Input<int32_t>(inputs[1]),
                      chosen = outputs[0].data<float>(), ids = outputs[1].data<int32_t>(),
                      top = outputs[2].data<float>(), R, V, k = k_]() {
      std::vector<float> x_s;
      std::vector<int32_t> t_s;
      const float* xp = x.rows(x_s);
      const int32_t* tp = tokens.rows(t_s);
      over_rows(R, [&](int r0, int r1) {
        for (int r = r0; r < r1; ++r) {
          const float* row = xp + static_cast<size_t>(r) * V;
          const float lse = log_sum_exp(row, V);
          chosen[r] = row[tp[r]] - lse;
          if (k == 0) continue;
          int32_t* row_ids = ids + static_cast<size_t>(r) * k;
          float* row_top = top + static_cast<size_t>(r) * k;
          top_k(row, V, k, row_ids, row_top);
          for (int j = 0; j < k; ++j) row_top[j] -= lse;
        }
      });
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("LogProbs is a CPU kernel");
  }

  const char* name() const override { return "NativeLogProbs"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return k_ == static_cast<const LogProbs&>(other).k_;
  }

 private:
  int k_;
};

}  // namespace

std::vector<mx::array> logprobs(const mx::array& logits, const mx::array& tokens, int k) {
  if (logits.dtype() != mx::float32 || logits.ndim() != 2 || logits.shape(1) == 0 || tokens.ndim() != 1 ||
      tokens.shape(0) != logits.shape(0) || k < 0 || k > logits.shape(1)) {
    throw std::invalid_argument("logprobs: logits must be float32 [R, V > 0], tokens [R] and 0 <= k <= V");
  }
  const int R = logits.shape(0);
  const mx::Stream s = mx::default_stream(mx::Device::cpu);
  return mx::array::make_arrays({{R}, {R, k}, {R, k}}, {mx::float32, mx::int32, mx::float32},
                                std::make_shared<LogProbs>(s, k), {logits, mx::astype(tokens, mx::int32, s)});
}

mx::array truncate_top(const mx::array& logits, const mx::array& top_k, const mx::array& top_p,
                       const mx::array& min_p) {
  const auto rows = [&](const mx::array& a) { return a.ndim() == 1 && a.shape(0) == logits.shape(0); };
  if (logits.dtype() != mx::float32 || logits.ndim() != 2 || logits.shape(1) == 0 || !rows(top_k) || !rows(top_p) ||
      !rows(min_p)) {
    throw std::invalid_argument("truncate_top: logits must be float32 [R, V > 0], top_k, top_p and min_p [R]");
  }
  const mx::Stream s = mx::default_stream(mx::Device::cpu);
  return mx::array(logits.shape(), mx::float32, std::make_shared<TruncateTop>(s),
                   {logits, mx::astype(top_k, mx::int32, s), mx::astype(top_p, mx::float32, s),
                    mx::astype(min_p, mx::float32, s)});
}

mx::array adjust_logits(const mx::array& logits, const mx::array& starts, const mx::array& ids,
                        const mx::array& entries, const mx::array& params, const mx::array& pending) {
  if (logits.dtype() != mx::float32 || logits.ndim() != 2 || starts.ndim() != 1 ||
      starts.shape(0) != logits.shape(0) + 1 || ids.ndim() != 1 || entries.ndim() != 2 || entries.shape(1) != 3 ||
      entries.shape(0) != ids.shape(0) || params.ndim() != 2 || params.shape(0) != logits.shape(0) ||
      params.shape(1) != 3 || pending.ndim() != 1 || pending.shape(0) != logits.shape(0)) {
    throw std::invalid_argument(
        "adjust_logits: logits must be float32 [R, V], starts [R + 1], ids [N], entries [N, 3], params [R, 3] and "
        "pending [R]");
  }
  const mx::Stream s = mx::default_stream(mx::Device::cpu);
  return mx::array(logits.shape(), mx::float32, std::make_shared<AdjustLogits>(s),
                   {logits, mx::astype(starts, mx::int32, s), mx::astype(ids, mx::int32, s),
                    mx::astype(entries, mx::float32, s), mx::astype(params, mx::float32, s),
                    mx::astype(pending, mx::int32, s)});
}

mx::array draw_rows(const mx::array& logits, const mx::array& temperatures, const mx::array& uniforms) {
  if (logits.dtype() != mx::float32 || logits.ndim() != 2 || temperatures.ndim() != 1 || uniforms.ndim() != 1 ||
      temperatures.shape(0) != logits.shape(0) || uniforms.shape(0) != logits.shape(0) || logits.shape(1) == 0) {
    throw std::invalid_argument("draw_rows: logits must be float32 [R, V > 0], temperatures and uniforms [R]");
  }
  const mx::Stream s = mx::default_stream(mx::Device::cpu);
  return mx::array({logits.shape(0)}, mx::uint32, std::make_shared<DrawRows>(s),
                   {logits, mx::astype(temperatures, mx::float32, s), mx::astype(uniforms, mx::float32, s)});
}

mx::array argmax_rows(const mx::array& x) {
  if (x.dtype() != mx::float32 || x.ndim() != 2 || x.shape(1) == 0) {
    throw std::invalid_argument("argmax_rows: x must be float32 [rows, V] with V > 0");
  }
  return mx::array({x.shape(0)}, mx::uint32, std::make_shared<ArgmaxRows>(mx::default_stream(mx::Device::cpu)), {x});
}

}  // namespace mlx_infer
