// Paged attention for MLX's CPU backend: reads K/V rows straight from the pool through the block
// tables, so no per-layer gather copies the context into a contiguous tensor first.
//
// All of a token's heads are computed together, so each pool slot (every KV head's row) is read once,
// front to back. A token's keys are always taken in chunks of kChunkKeys from its first visible key:
// each chunk's scores go to a per-thread buffer, then softmax in float32 and a weighted sum of the
// value rows, and the chunks' partial softmaxes are merged in order (flash-decoding). The chunks depend
// only on the token's own visible keys, so its output is the same bits whatever else the step holds
// and however the work is shared: with enough tokens to keep the threads busy each token is one task
// (its chunks in turn), with fewer (decoding a few sequences) each chunk is one.

#include "paged_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "kv_format.h"
#include "simd.h"
#include "strided.h"
#include "thread_pool.h"

namespace mx = mlx::core;

namespace mlx_infer {

namespace {

// The keys token t sees: [lo, hi] (empty when hi < lo).
struct KeyRange {
  int lo, hi;
};

KeyRange visible(const AttentionArgs& p, int t) {
  const int pos = p.positions[t];
  const int hi = std::min(pos, p.context_lens[p.token_seq[t]] - 1);
  const int lo = p.window > 0 ? std::max(0, pos - p.window + 1) : 0;
  return {lo, hi};
}

// Scores of keys k[0..KB) against query heads q[0..RB) (D a multiple of 8): each key's 8 values at a
// time are converted once and meet every head, and the KB x RB sums are reduced together (four keys'
// sums per head in three horizontal adds and one add), not one horizontal sum per dot product.
// Writes s[r * n + i] = (q_r . k_i) * row scale * `scale` for i < KB.
template <KVType K, int KB, int RB>
inline void score_keys(const float* const* q, const uint8_t* const* k, int D, float scale, float* s, int n) {
  __m256 acc[KB][RB];
  for (int i = 0; i < KB; ++i)
    for (int r = 0; r < RB; ++r) acc[i][r] = _mm256_setzero_ps();
  for (int d = 0; d < D; d += 8) {
    __m256 kv[KB];
    for (int i = 0; i < KB; ++i) kv[i] = load8<K>(k[i], d);
    for (int r = 0; r < RB; ++r) {
      const __m256 qv = _mm256_loadu_ps(q[r] + d);
      for (int i = 0; i < KB; ++i) acc[i][r] = _mm256_fmadd_ps(qv, kv[i], acc[i][r]);
    }
  }
  for (int r = 0; r < RB; ++r) {
    if constexpr (KB == 4) {
      const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[0][r], acc[1][r]), _mm256_hadd_ps(acc[2][r], acc[3][r]));
      const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
      const __m128 scales = _mm_setr_ps(row_scale<K>(k[0], D), row_scale<K>(k[1], D), row_scale<K>(k[2], D),
                                        row_scale<K>(k[3], D));
      _mm_storeu_ps(s + r * n, _mm_mul_ps(sums, _mm_mul_ps(scales, _mm_set1_ps(scale))));
    } else {
      for (int i = 0; i < KB; ++i) s[r * n + i] = hsum(acc[i][r]) * (row_scale<K>(k[i], D) * scale);
    }
  }
}

// Scores of the n keys `rows` (each at this KV head's row) against RB query heads: four keys a step.
template <KVType K, int RB>
void score_heads(const float* const* q, const uint8_t* const* rows, int n, int D, float scale, float* s) {
  int i = 0;
  for (; i + 4 <= n; i += 4) score_keys<K, 4, RB>(q, rows + i, D, scale, s + i, n);
  for (; i < n; ++i) score_keys<K, 1, RB>(q, rows + i, D, scale, s + i, n);
}

// out[r][d..d + 8 * DB) = sum_i w[r * n + i] * v_i[d..] for RB query heads: the outputs stay in
// registers over all n keys, each value vector converted once for every head.
template <KVType K, int RB, int DB>
inline void weigh_values(const uint8_t* const* v, const float* w, int n, int d, int scale_at, float* const* out) {
  __m256 acc[RB][DB];
  for (int r = 0; r < RB; ++r)
    for (int b = 0; b < DB; ++b) acc[r][b] = _mm256_setzero_ps();
  for (int i = 0; i < n; ++i) {
    __m256 vv[DB];
    for (int b = 0; b < DB; ++b) vv[b] = load8<K>(v[i], d + 8 * b);
    const float row = row_scale<K>(v[i], scale_at);
    for (int r = 0; r < RB; ++r) {
      const __m256 wv = _mm256_set1_ps(w[r * n + i] * row);
      for (int b = 0; b < DB; ++b) acc[r][b] = _mm256_fmadd_ps(vv[b], wv, acc[r][b]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int b = 0; b < DB; ++b) _mm256_storeu_ps(out[r] + d + 8 * b, acc[r][b]);
}

template <KVType K, int RB>
void value_heads(const uint8_t* const* v, const float* w, int n, int Dv, int scale_at, float* const* out) {
  int d = 0;
  for (; d + 16 <= Dv; d += 16) weigh_values<K, RB, 2>(v, w, n, d, scale_at, out);
  for (; d < Dv; d += 8) weigh_values<K, RB, 1>(v, w, n, d, scale_at, out);
}

// f(RB, r0) over the query heads of one KV head in groups of up to three (the registers of
// score_keys' 4 x 3 sums and weigh_values' 3 x 2 outputs).
template <typename F>
void head_groups(int rep, F&& f) {
  for (int r0 = 0; r0 < rep; r0 += 3) f(std::min(3, rep - r0), r0);
}

// All of token t's query heads over keys [lo, hi] (non-empty). A pool slot holds the n_kv heads'
// rows side by side; the keys' slots are looked up once through the block table and prefetched (the
// blocks are scattered, which the hardware prefetcher does not follow). Per KV head, its GQA query
// heads share every K/V row conversion (score_keys, weigh_values).
// Writes out[h] = sum_j exp(s_hj - max_h) v_j (unnormalized), max_h, and total_h = sum_j exp(s_hj - max_h).
// K is the pools' row type: half and int8 rows are converted as they are read, int8 scales applied to
// the dot product and the softmax weight.
template <KVType K>
void attend_keys(const AttentionArgs& p, int t, KeyRange keys, std::vector<float>& scores,
                 std::vector<const uint8_t*>& rows, float* out, float* max_score, float* total) {
  const int seq = p.token_seq[t];
  const int rep = p.H / p.n_kv;
  const int lo = keys.lo, n = keys.hi - keys.lo + 1;
  const size_t head_bytes = kv_head_bytes(K, p.D), v_head_bytes = kv_head_bytes(K, p.Dv_row);
  const size_t slot_bytes = static_cast<size_t>(p.n_kv) * head_bytes;  // one slot: every KV head
  const size_t v_slot_bytes = static_cast<size_t>(p.n_kv) * v_head_bytes;
  const float* q = p.q + static_cast<size_t>(t) * p.q_stride;
  const int32_t* table = p.block_tables + static_cast<size_t>(seq) * p.max_blocks;
  scores.resize(static_cast<size_t>(p.H) * n);
  rows.resize(3 * static_cast<size_t>(n));  // key rows and value rows of KV head 0, one KV head's rows
  const uint8_t** krows = rows.data();
  const uint8_t** vrows = krows + n;
  const uint8_t** head_rows = vrows + n;
  for (int i = 0; i < n; ++i) {
    const int j = lo + i;
    const size_t slot = static_cast<size_t>(table[j / p.block_size]) * p.block_size + j % p.block_size;
    krows[i] = p.keys + slot * slot_bytes;
    vrows[i] = p.values + slot * v_slot_bytes;
    for (size_t b = 0; b < slot_bytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(krows[i]) + b, _MM_HINT_T0);
  }
  for (int kv_head = 0; kv_head < p.n_kv; ++kv_head) {
    for (int i = 0; i < n; ++i) head_rows[i] = krows[i] + kv_head * head_bytes;
    head_groups(rep, [&](int group, int r0) {
      const int h0 = kv_head * rep + r0;
      const float* qs[3] = {q + static_cast<size_t>(h0) * p.D, q + static_cast<size_t>(h0 + 1) * p.D,
                            q + static_cast<size_t>(h0 + 2) * p.D};
      float* s = scores.data() + static_cast<size_t>(h0) * n;
      if (group == 3) score_heads<K, 3>(qs, head_rows, n, p.D, p.scale, s);
      if (group == 2) score_heads<K, 2>(qs, head_rows, n, p.D, p.scale, s);
      if (group == 1) score_heads<K, 1>(qs, head_rows, n, p.D, p.scale, s);
    });
  }
  for (int i = 0; i < n; ++i) {
    for (size_t b = 0; b < v_slot_bytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(vrows[i]) + b, _MM_HINT_T0);
  }
  for (int h = 0; h < p.H; ++h) {
    float* row = scores.data() + static_cast<size_t>(h) * n;
    if (p.softcap > 0.0f) {
      for (int i = 0; i < n; ++i) row[i] = std::tanh(row[i] / p.softcap) * p.softcap;
    }
    const float m = *std::max_element(row, row + n);
    const __m256 vmax = _mm256_set1_ps(m);
    __m256 vtotal = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + i), vmax));
      _mm256_storeu_ps(row + i, e);
      vtotal = _mm256_add_ps(vtotal, e);
    }
    float sum = hsum(vtotal);
    for (; i < n; ++i) {
      row[i] = std::exp(row[i] - m);
      sum += row[i];
    }
    max_score[h] = m;
    total[h] = sum;
  }
  for (int kv_head = 0; kv_head < p.n_kv; ++kv_head) {
    for (int i = 0; i < n; ++i) head_rows[i] = vrows[i] + kv_head * v_head_bytes;
    head_groups(rep, [&](int group, int r0) {
      const int h0 = kv_head * rep + r0;
      float* outs[3] = {out + static_cast<size_t>(h0) * p.Dv, out + static_cast<size_t>(h0 + 1) * p.Dv,
                        out + static_cast<size_t>(h0 + 2) * p.Dv};
      const float* w = scores.data() + static_cast<size_t>(h0) * n;
      if (group == 3) value_heads<K, 3>(head_rows, w, n, p.Dv, p.Dv_row, outs);
      if (group == 2) value_heads<K, 2>(head_rows, w, n, p.Dv, p.Dv_row, outs);
      if (group == 1) value_heads<K, 1>(head_rows, w, n, p.Dv, p.Dv_row, outs);
    });
  }
}

// Keys a chunk: boundaries at multiples of this from the first visible key. Small enough that a
// batch-1 decode at a few hundred keys splits across the threads; the merge adds ~1/kChunkKeys to
// the value pass.
constexpr int kChunkKeys = 64;

int chunks_of(KeyRange keys) { return keys.hi < keys.lo ? 0 : (keys.hi - keys.lo) / kChunkKeys + 1; }

// One chunk's partial result: out rows [H, Dv] (unnormalized), then maxima [H], then totals [H].
size_t partial_size(const AttentionArgs& p) { return static_cast<size_t>(p.H) * (p.Dv + 2); }

// Each worker's scratch for attend_keys: scores [H, n] and the chunk's row pointers.
struct Scratch {
  std::vector<float> scores;
  std::vector<const uint8_t*> rows;
};

void attend_chunk(const AttentionArgs& p, int t, KeyRange keys, int c, Scratch& scratch, float* at) {
  const KeyRange mine{keys.lo + c * kChunkKeys, std::min(keys.hi, keys.lo + (c + 1) * kChunkKeys - 1)};
  const size_t out_size = static_cast<size_t>(p.H) * p.Dv;
  float* max_score = at + out_size;
  float* total = max_score + p.H;
  switch (p.kv_type) {
    case KVType::f32: attend_keys<KVType::f32>(p, t, mine, scratch.scores, scratch.rows, at, max_score, total); break;
    case KVType::f16: attend_keys<KVType::f16>(p, t, mine, scratch.scores, scratch.rows, at, max_score, total); break;
    case KVType::bf16: attend_keys<KVType::bf16>(p, t, mine, scratch.scores, scratch.rows, at, max_score, total); break;
    case KVType::i8: attend_keys<KVType::i8>(p, t, mine, scratch.scores, scratch.rows, at, max_score, total); break;
  }
}

// Token t's output rows [H, Dv] from its `chunks` partial results (consecutive at `first`), merged in
// order: out = sum_c exp(max_c - max) out_c / (sum_c exp(max_c - max) total_c + exp(sink - max)), the
// max taken over the sink too. No visible keys: zeros (a sink has no value).
void merge(const AttentionArgs& p, int t, const float* first, int chunks) {
  const size_t out_size = static_cast<size_t>(p.H) * p.Dv, stride = partial_size(p);
  float* out = p.out + static_cast<size_t>(t) * out_size;
  std::fill(out, out + out_size, 0.0f);
  if (chunks == 0) return;
  for (int h = 0; h < p.H; ++h) {
    float m = p.sinks ? p.sinks[h] : -INFINITY;
    for (int c = 0; c < chunks; ++c) m = std::max(m, first[c * stride + out_size + h]);
    float total = p.sinks ? std::exp(p.sinks[h] - m) : 0.0f;
    float* row = out + static_cast<size_t>(h) * p.Dv;
    for (int c = 0; c < chunks; ++c) {
      const float* chunk = first + c * stride;
      const float w = std::exp(chunk[out_size + h] - m);
      total += w * chunk[out_size + p.H + h];
      add_scaled(row, chunk + static_cast<size_t>(h) * p.Dv, w, p.Dv);
    }
    for (int d = 0; d < p.Dv; ++d) row[d] /= total;  // >= 1: the term holding the maximum adds >= 1
  }
}

// Each token one task: its chunks in turn into a per-thread buffer, then merged.
void attend_by_token(const AttentionArgs& p, ThreadPool& threads) {
  threads.for_range(p.T, 1, [&](int begin, int end) {
    Scratch scratch;
    std::vector<float> partial;
    for (int t = begin; t < end; ++t) {
      const KeyRange keys = visible(p, t);
      const int chunks = chunks_of(keys);
      partial.resize(chunks * partial_size(p));
      for (int c = 0; c < chunks; ++c) attend_chunk(p, t, keys, c, scratch, partial.data() + c * partial_size(p));
      merge(p, t, partial.data(), chunks);
    }
  });
}

// Each chunk of each token one task, then each token's chunks merged.
void attend_by_chunk(const AttentionArgs& p, ThreadPool& threads) {
  std::vector<int> first(p.T + 1, 0);  // token t's chunks are items [first[t], first[t + 1])
  for (int t = 0; t < p.T; ++t) first[t + 1] = first[t] + chunks_of(visible(p, t));
  std::vector<float> partial(first[p.T] * partial_size(p));
  threads.for_range(first[p.T], 1, [&](int begin, int end) {
    Scratch scratch;
    for (int i = begin; i < end; ++i) {
      const int t = static_cast<int>(std::upper_bound(first.begin(), first.end(), i) - first.begin()) - 1;
      attend_chunk(p, t, visible(p, t), i - first[t], scratch, partial.data() + i * partial_size(p));
    }
  });
  for (int t = 0; t < p.T; ++t) merge(p, t, partial.data() + first[t] * partial_size(p), first[t + 1] - first[t]);
}

}  // namespace

void attend_all(const AttentionArgs& args) {
  AttentionArgs p = args;
  if (p.Dv == 0) p.Dv = p.D;  // values as wide as the keys, in a pool of their own shape
  if (p.Dv_row == 0) p.Dv_row = p.Dv;
  ThreadPool& threads = pool();
  // A decode step of a few sequences has fewer tokens than the threads can share evenly (batch 1:
  // one token on 2 threads): then chunks are the tasks. Either way a token's result is the same.
  constexpr int kTasksPerThread = 4;
  if (p.T < kTasksPerThread * threads.size()) {
    attend_by_chunk(p, threads);
  } else {
    attend_by_token(p, threads);
  }
}

namespace {

class PagedAttention : public mx::UnaryPrimitive {
 public:
  PagedAttention(mx::Stream stream, int block_size, float scale, int window, float softcap, bool sinks,
                 int value_dim)
      : mx::UnaryPrimitive(stream), block_size_(block_size), scale_(scale), window_(window), softcap_(softcap),
        sinks_(sinks), value_dim_(value_dim) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    const mx::array& q = inputs[0];
    AttentionArgs p{nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, out.data<float>(),
                    q.shape(0), q.shape(1), q.shape(2), inputs[1].shape(1), inputs[3].shape(1), block_size_, window_,
                    scale_, softcap_, static_cast<size_t>(q.shape(1)) * q.shape(2), kv_type(inputs[1]),
                    value_dim_, kv_head_dim(inputs[2])};
    // The sinks ride as an eighth input; decoder_block's inputs have other arrays from there on.
    std::optional<Input<float>> sinks;
    if (sinks_) sinks.emplace(inputs[7]);
    encoder.dispatch([p, in = AttentionInputs(inputs), sinks]() mutable {
      std::vector<float> s_s;
      if (sinks) p.sinks = sinks->rows(s_s);
      in.attend(p);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("PagedAttention is a CPU kernel");
  }

  const char* name() const override { return "PagedAttention"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const PagedAttention&>(other);
    return block_size_ == o.block_size_ && scale_ == o.scale_ && window_ == o.window_ && softcap_ == o.softcap_ &&
           sinks_ == o.sinks_ && value_dim_ == o.value_dim_;
  }

 private:
  int block_size_;
  float scale_;
  int window_;
  float softcap_;
  bool sinks_;
  int value_dim_;
};

}  // namespace

mx::array paged_attention(
    const mx::array& q,
    const mx::array& key_pool,
    const mx::array& value_pool,
    const mx::array& block_tables,
    const mx::array& context_lens,
    const mx::array& positions,
    const mx::array& token_seq,
    int block_size,
    float scale,
    int window,
    float softcap,
    const std::optional<mx::array>& sinks,
    int value_dim) {
  if (q.ndim() != 3 || key_pool.ndim() != 3 || value_pool.ndim() != 3 || value_pool.shape(0) != key_pool.shape(0) ||
      value_pool.shape(1) != key_pool.shape(1)) {
    throw std::invalid_argument("paged_attention: q must be [T, H, D] and the pools [slots, n_kv, D]");
  }
  if (value_dim == 0 ? value_pool.shape() != key_pool.shape()
                     : value_dim % 8 != 0 || value_dim > kv_head_dim(value_pool)) {
    throw std::invalid_argument("paged_attention: value_dim must be a multiple of 8 within the value rows");
  }
  if (q.dtype() != mx::float32 || value_pool.dtype() != key_pool.dtype()) {
    throw std::invalid_argument("paged_attention: q must be float32 and the pools of one dtype");
  }
  if (q.shape(2) != kv_head_dim(key_pool) || q.shape(2) % 8 != 0 || q.shape(1) % key_pool.shape(1) != 0) {
    throw std::invalid_argument("paged_attention: head_dim must match and be a multiple of 8; H a multiple of n_kv");
  }
  if (sinks && (sinks->ndim() != 1 || sinks->shape(0) != q.shape(1))) {
    throw std::invalid_argument("paged_attention: sinks must be [H], one per query head");
  }
  const mx::Stream s = mx::default_stream(mx::Device::cpu);
  auto i32 = [&](const mx::array& a) { return mx::astype(a, mx::int32, s); };
  std::vector<mx::array> inputs{q, key_pool, value_pool, i32(block_tables), i32(context_lens), i32(positions),
                                i32(token_seq)};
  if (sinks) inputs.push_back(mx::astype(*sinks, mx::float32, s));
  return mx::array(
      {q.shape(0), q.shape(1), value_dim > 0 ? value_dim : q.shape(2)}, mx::float32,
      std::make_shared<PagedAttention>(s, block_size, scale, window, softcap, sinks.has_value(), value_dim),
      inputs);
}

}  // namespace mlx_infer
