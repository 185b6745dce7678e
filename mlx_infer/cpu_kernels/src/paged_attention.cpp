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
//
// The passes over a KV head's rows (scores, weighted values) and the softmax's exponentials run in
// 512-bit vectors on CPUs with AVX-512 (paged_attention_avx512.cpp), in 256-bit ones here otherwise: the
// same operations in the same order, so the same bits, which set_attention_vectors lets a test check.
// As they go the passes fetch the K/V rows of the chunk their task computes next into L2
// (fetch_ahead.h), so only a task's first chunk waits for its own.

#include "paged_attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "attention_avx512.h"
#include "fetch_ahead.h"
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

// Scores of keys k[0..KB) against query rows q[0..RB) (D a multiple of 8): each key's 8 values at a
// time are converted once and meet every query row. Each dot product is summed in one fixed order, the
// per-key kernel's before keys were blocked: the 8-value chunks at d % 16 == 0 in one accumulator,
// those at d % 16 == 8 in a second, the two added, then the lanes as simd.h's hsum adds them,
// ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7)); the four keys' sums are reduced together in that order. So
// a key's score is the same bits whatever keys are beside it, and answers whose top tokens are close
// do not move with this kernel. The second accumulators would not fit the 16 registers beside the first, so the two sets
// are summed one after the other. Writes s[r][i0 + i] = (q_r . k_i) * row scale * `scale`.
template <KVType K, int KB, int RB>
inline void score_keys(const float* const* q, const uint8_t* const* k, int D, float scale, float* const* s, int i0) {
  __m256 acc[KB][RB];
  alignas(32) float first[KB][RB][8];
  for (int half = 0; half < 2; ++half) {
    for (int i = 0; i < KB; ++i)
      for (int r = 0; r < RB; ++r) acc[i][r] = _mm256_setzero_ps();
    for (int d = 8 * half; d < D; d += 16) {
      __m256 kv[KB];
      for (int i = 0; i < KB; ++i) kv[i] = load8<K>(k[i], d);
      for (int r = 0; r < RB; ++r) {
        const __m256 qv = _mm256_loadu_ps(q[r] + d);
        for (int i = 0; i < KB; ++i) acc[i][r] = _mm256_fmadd_ps(qv, kv[i], acc[i][r]);
      }
    }
    if (half == 0) {
      for (int i = 0; i < KB; ++i)
        for (int r = 0; r < RB; ++r) _mm256_store_ps(first[i][r], acc[i][r]);
    }
  }
  for (int r = 0; r < RB; ++r) {
    __m128 x[KB];  // per key: its two accumulators added, then its 256-bit halves
    for (int i = 0; i < KB; ++i) {
      const __m256 v = _mm256_add_ps(_mm256_load_ps(first[i][r]), acc[i][r]);
      x[i] = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    }
    if constexpr (KB == 4) {
      // Lanes (x0 + x2) and (x1 + x3) of each key, then their sum: hsum's order for four keys at once.
      const __m128 u01 = _mm_add_ps(_mm_unpacklo_ps(x[0], x[1]), _mm_unpackhi_ps(x[0], x[1]));
      const __m128 u23 = _mm_add_ps(_mm_unpacklo_ps(x[2], x[3]), _mm_unpackhi_ps(x[2], x[3]));
      const __m128 sums = _mm_add_ps(_mm_movelh_ps(u01, u23), _mm_movehl_ps(u23, u01));
      const __m128 rows = _mm_setr_ps(row_scale<K>(k[0], D), row_scale<K>(k[1], D), row_scale<K>(k[2], D),
                                      row_scale<K>(k[3], D));
      _mm_storeu_ps(s[r] + i0, _mm_mul_ps(_mm_mul_ps(sums, rows), _mm_set1_ps(scale)));
    } else {
      for (int i = 0; i < KB; ++i) {
        __m128 lo = _mm_add_ps(x[i], _mm_movehl_ps(x[i], x[i]));
        lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
        s[r][i0 + i] = _mm_cvtss_f32(lo) * row_scale<K>(k[i], D) * scale;
      }
    }
  }
}

// Scores of the n keys `rows` (each at this KV head's row) against RB query rows: four keys a step.
template <KVType K, int RB>
void score_heads(const float* const* q, const uint8_t* const* rows, int n, int D, float scale, float* const* s,
                 Ahead& ahead) {
  int i = 0;
  for (; i + 4 <= n; i += 4) {
    score_keys<K, 4, RB>(q, rows + i, D, scale, s, i);
    fetch_ahead(ahead, kScoreStepLines);
  }
  for (; i < n; ++i) score_keys<K, 1, RB>(q, rows + i, D, scale, s, i);
}

// out[r][d..d + 8 * DB) = sum_i w[r][i] * v_i[d..] for RB query rows: the outputs stay in registers
// over all n keys, each value vector converted once for every row.
template <KVType K, int RB, int DB>
inline void weigh_values(const uint8_t* const* v, const float* const* w, int n, int d, int scale_at,
                         float* const* out, Ahead& ahead) {
  __m256 acc[RB][DB];
  for (int r = 0; r < RB; ++r)
    for (int b = 0; b < DB; ++b) acc[r][b] = _mm256_setzero_ps();
  for (int i = 0; i < n; ++i) {
    __m256 vv[DB];
    for (int b = 0; b < DB; ++b) vv[b] = load8<K>(v[i], d + 8 * b);
    const float row = row_scale<K>(v[i], scale_at);
    for (int r = 0; r < RB; ++r) {
      const __m256 wv = _mm256_set1_ps(w[r][i] * row);
      for (int b = 0; b < DB; ++b) acc[r][b] = _mm256_fmadd_ps(vv[b], wv, acc[r][b]);
    }
    fetch_ahead(ahead, kValueStepLines);
  }
  for (int r = 0; r < RB; ++r)
    for (int b = 0; b < DB; ++b) _mm256_storeu_ps(out[r] + d + 8 * b, acc[r][b]);
}

template <KVType K, int RB>
void value_heads(const uint8_t* const* v, const float* const* w, int n, int Dv, int scale_at, float* const* out,
                 Ahead& ahead) {
  int d = 0;
  for (; d + 16 <= Dv; d += 16) weigh_values<K, RB, 2>(v, w, n, d, scale_at, out, ahead);
  for (; d < Dv; d += 8) weigh_values<K, RB, 1>(v, w, n, d, scale_at, out, ahead);
}

// Whether the CPU (and the compiler that built this) has the AVX-512 of paged_attention_avx512.cpp.
bool has_avx512() {
#ifdef MLX_INFER_HAVE_AVX512
  __builtin_cpu_init();  // called from a static initializer, which may run before libgcc's
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#else
  return false;
#endif
}

// The vector width of the passes (bits), the widest this CPU has unless set_attention_vectors chose.
std::atomic<int> g_vector_bits{has_avx512() ? 512 : 256};

// Scores of `count` (1-3) query rows against the n key rows of one KV head (score_heads), in 512-bit
// vectors when `wide`: the same bits either way.
template <KVType K>
void score_rows(bool wide, const float* const* q, int count, const uint8_t* const* rows, int n, int D, float scale,
                float* const* s, Ahead& ahead) {
#ifdef MLX_INFER_HAVE_AVX512
  if (wide) return attention_avx512::score_heads<K>(q, count, rows, n, D, scale, s, ahead);
#endif
  if (count == 3) score_heads<K, 3>(q, rows, n, D, scale, s, ahead);
  if (count == 2) score_heads<K, 2>(q, rows, n, D, scale, s, ahead);
  if (count == 1) score_heads<K, 1>(q, rows, n, D, scale, s, ahead);
}

// The weighted sums of the n value rows of one KV head for `count` (1-3) query rows (value_heads), in
// 512-bit vectors when `wide`: the same bits either way.
template <KVType K>
void value_rows(bool wide, const uint8_t* const* v, const float* const* w, int count, int n, int Dv, int scale_at,
                float* const* out, Ahead& ahead) {
#ifdef MLX_INFER_HAVE_AVX512
  if (wide) return attention_avx512::value_heads<K>(v, w, count, n, Dv, scale_at, out, ahead);
#endif
  if (count == 3) value_heads<K, 3>(v, w, n, Dv, scale_at, out, ahead);
  if (count == 2) value_heads<K, 2>(v, w, n, Dv, scale_at, out, ahead);
  if (count == 1) value_heads<K, 1>(v, w, n, Dv, scale_at, out, ahead);
}

// row[0..n) = exp(row[i] - m), returning their sum: eight values at a time, each lane's sum added as
// hsum adds them, then the last n % 8 one by one.
float exp_row(float* row, int n, float m) {
  const __m256 vmax = _mm256_set1_ps(m);
  __m256 total = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + i), vmax));
    _mm256_storeu_ps(row + i, e);
    total = _mm256_add_ps(total, e);
  }
  float sum = hsum(total);
  for (; i < n; ++i) {
    row[i] = std::exp(row[i] - m);
    sum += row[i];
  }
  return sum;
}

// exp_row in 512-bit vectors when `wide`: the same bits either way.
float exponentiate(bool wide, float* row, int n, float m) {
#ifdef MLX_INFER_HAVE_AVX512
  if (wide) return attention_avx512::exp_row(row, n, m);
#endif
  return exp_row(row, n, m);
}

// Each worker's scratch for attend_group: scores [tokens, H, keys], the chunk's row pointers and the
// tokens taking part.
struct Scratch {
  std::vector<float> scores;
  std::vector<const uint8_t*> rows;
  std::vector<int> tokens;
  std::vector<Ahead::Run> ahead;  // the next chunk's rows, fetched during this one
};

// Where key j of the sequence whose block table is `table` lies in the pools.
size_t slot_of(const AttentionArgs& p, const int32_t* table, int j) {
  return static_cast<size_t>(table[j / p.block_size]) * p.block_size + j % p.block_size;
}

// Query rows of one KV head, taken three at a time (the registers of score_keys' 4 x 3 sums and
// weigh_values' 3 x 2 outputs): f(count, first) over [0, rows).
template <typename F>
void in_threes(int rows, F&& f) {
  for (int r0 = 0; r0 < rows; r0 += 3) f(std::min(3, rows - r0), r0);
}

// One chunk of keys for a group of g tokens of one sequence that share their first visible key: token
// j sees the chunk's first n[j] keys (0: none, it takes no part). The keys' slots are looked up once
// through the block table; the passes fetch `ahead` (the next chunk's rows) into L2 as they go, and
// unless this chunk's rows were so `fetched` they are prefetched here (the blocks are scattered, which
// the hardware prefetcher does not follow). Each K/V row is read from memory once for the whole group:
// a verification's k + 1 tokens, or a prefill's, attend over the same keys. Per KV head, the GQA query
// heads of every token share each K/V row conversion (score_keys, weigh_values).
// A token's results are the same bits as if it were alone: its scores are computed key by key in a
// fixed order, its softmax runs over its own n[j] keys, and the keys past them weigh 0 in the values.
// Writes, at at[j], out[h] = sum_i exp(s_hi - max_h) v_i (unnormalized), max_h, and total_h =
// sum_i exp(s_hi - max_h). K is the pools' row type: half and int8 rows are converted as they are read,
// int8 scales applied to the dot product and the softmax weight.
template <KVType K>
void attend_group(const AttentionArgs& p, int t0, int g, int first_key, const int* n, bool fetched, Ahead& ahead,
                  Scratch& scratch, float* const* at) {
  const int seq = p.token_seq[t0];
  const int rep = p.H / p.n_kv;
  const int keys = *std::max_element(n, n + g);
  const bool wide = g_vector_bits.load(std::memory_order_relaxed) == 512;
  const size_t head_bytes = kv_head_bytes(K, p.D), v_head_bytes = kv_head_bytes(K, p.Dv_row);
  const size_t slot_bytes = static_cast<size_t>(p.n_kv) * head_bytes;  // one slot: every KV head
  const size_t v_slot_bytes = static_cast<size_t>(p.n_kv) * v_head_bytes;
  const int32_t* table = p.block_tables + static_cast<size_t>(seq) * p.max_blocks;
  scratch.scores.resize(static_cast<size_t>(g) * p.H * keys);
  scratch.rows.resize(3 * static_cast<size_t>(keys));  // key and value rows of KV head 0, one KV head's rows
  const uint8_t** krows = scratch.rows.data();
  const uint8_t** vrows = krows + keys;
  const uint8_t** head_rows = vrows + keys;
  for (int i = 0; i < keys;) {  // a block at a time, its slots consecutive: a division a block, not a key
    const int j = first_key + i;
    size_t slot = slot_of(p, table, j);
    for (const int end = std::min(keys, i + p.block_size - j % p.block_size); i < end; ++i, ++slot) {
      krows[i] = p.keys + slot * slot_bytes;
      vrows[i] = p.values + slot * v_slot_bytes;
      if (fetched) continue;
      // Into L2: it takes more lines in flight than L1 would, and a chunk's rows fit it.
      const char* row = reinterpret_cast<const char*>(krows[i]);
      for (size_t b = 0; b < slot_bytes; b += 64) _mm_prefetch(row + b, _MM_HINT_T1);
    }
  }
  // The query rows of KV head kv: (token j, head kv * rep + r) for the tokens taking part.
  std::vector<int>& tokens = scratch.tokens;
  tokens.clear();
  for (int j = 0; j < g; ++j) {
    if (n[j] > 0) tokens.push_back(j);
  }
  const int rows = static_cast<int>(tokens.size()) * rep;
  auto score_row = [&](int j, int h) { return scratch.scores.data() + (static_cast<size_t>(j) * p.H + h) * keys; };
  auto query = [&](int row, int kv) {
    const int j = tokens[row / rep], h = kv * rep + row % rep;
    return std::make_pair(j, h);
  };
  for (int kv = 0; kv < p.n_kv; ++kv) {
    for (int i = 0; i < keys; ++i) head_rows[i] = krows[i] + kv * head_bytes;
    in_threes(rows, [&](int count, int r0) {
      const float* qs[3];
      float* ss[3];
      for (int r = 0; r < count; ++r) {
        const auto [j, h] = query(r0 + r, kv);
        qs[r] = p.q + static_cast<size_t>(t0 + j) * p.q_stride + static_cast<size_t>(h) * p.D;
        ss[r] = score_row(j, h);
      }
      score_rows<K>(wide, qs, count, head_rows, keys, p.D, p.scale, ss, ahead);
    });
  }
  for (int i = 0; i < keys && !fetched; ++i) {
    for (size_t b = 0; b < v_slot_bytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(vrows[i]) + b, _MM_HINT_T1);
  }
  const size_t out_size = static_cast<size_t>(p.H) * p.Dv;
  for (const int j : tokens) {
    float* max_score = at[j] + out_size;
    float* total = max_score + p.H;
    for (int h = 0; h < p.H; ++h) {
      float* row = score_row(j, h);
      const int mine = n[j];
      if (p.softcap > 0.0f) {
        for (int i = 0; i < mine; ++i) row[i] = std::tanh(row[i] / p.softcap) * p.softcap;
      }
      const float m = max_of(row, mine);
      total[h] = exponentiate(wide, row, mine, m);
      std::fill(row + mine, row + keys, 0.0f);  // keys this token does not see
      max_score[h] = m;
    }
  }
  for (int kv = 0; kv < p.n_kv; ++kv) {
    for (int i = 0; i < keys; ++i) head_rows[i] = vrows[i] + kv * v_head_bytes;
    in_threes(rows, [&](int count, int r0) {
      const float* ws[3];
      float* outs[3];
      for (int r = 0; r < count; ++r) {
        const auto [j, h] = query(r0 + r, kv);
        ws[r] = score_row(j, h);
        outs[r] = at[j] + static_cast<size_t>(h) * p.Dv;
      }
      value_rows<K>(wide, head_rows, ws, count, keys, p.Dv, p.Dv_row, outs, ahead);
    });
  }
  fetch_ahead(ahead, std::numeric_limits<int>::max());  // what the steps left (a chunk of few keys)
}

// Keys a chunk: boundaries at multiples of this from the first visible key. Small enough that a
// batch-1 decode at a few hundred keys splits across the threads; the merge adds ~1/kChunkKeys to
// the value pass.
constexpr int kChunkKeys = 64;

int chunks_of(KeyRange keys) { return keys.hi < keys.lo ? 0 : (keys.hi - keys.lo) / kChunkKeys + 1; }

// One chunk's partial result: out rows [H, Dv] (unnormalized), then maxima [H], then totals [H].
size_t partial_size(const AttentionArgs& p) { return static_cast<size_t>(p.H) * (p.Dv + 2); }

// Tokens [t0, t0 + g) attended together (attend_group): consecutive tokens of one sequence with the
// same first visible key, so chunk c of keys is the same keys for each, cut at each token's last one.
struct Group {
  int t0, g;
  int lo;      // their first visible key
  int chunks;  // the most any of them has
};

// At most this many tokens a group: a prefill's groups still spread over the threads.
constexpr int kGroupTokens = 8;

std::vector<Group> groups_of(const AttentionArgs& p) {
  std::vector<Group> groups;
  for (int t = 0; t < p.T;) {
    const KeyRange first = visible(p, t);
    Group group{t, 0, first.lo, 0};
    while (t < p.T && group.g < kGroupTokens && p.token_seq[t] == p.token_seq[group.t0] &&
           visible(p, t).lo == first.lo) {
      group.chunks = std::max(group.chunks, chunks_of(visible(p, t)));
      ++group.g, ++t;
    }
    groups.push_back(group);
  }
  return groups;
}

// How many of chunk c's keys each token of a group sees (n[j]), and the most of them.
int keys_of_chunk(const AttentionArgs& p, const Group& group, int c, int* n) {
  const int first_key = group.lo + c * kChunkKeys;
  for (int j = 0; j < group.g; ++j) {
    const KeyRange keys = visible(p, group.t0 + j);
    n[j] = std::max(0, std::min(keys.hi, first_key + kChunkKeys - 1) - first_key + 1);
  }
  return *std::max_element(n, n + group.g);
}

// The K rows, then the V rows (every KV head's) of the sequence's keys [first, first + n) as runs of
// memory to fetch: a block's slots are contiguous in each pool.
Ahead rows_to_fetch(const AttentionArgs& p, int seq, int first, int n, std::vector<Ahead::Run>& runs) {
  const int32_t* table = p.block_tables + static_cast<size_t>(seq) * p.max_blocks;
  const std::pair<const uint8_t*, size_t> pools[] = {{p.keys, p.n_kv * kv_head_bytes(p.kv_type, p.D)},
                                                      {p.values, p.n_kv * kv_head_bytes(p.kv_type, p.Dv_row)}};
  runs.clear();
  for (const auto& [pool, slot_bytes] : pools) {
    for (int j = first; j < first + n;) {
      const int count = std::min(first + n - j, p.block_size - j % p.block_size);
      const char* begin = reinterpret_cast<const char*>(pool + slot_of(p, table, j) * slot_bytes);
      const char* line = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(begin) & ~uintptr_t{63});
      runs.push_back({line, begin + count * slot_bytes});
      j += count;
    }
  }
  return {runs.data(), static_cast<int>(runs.size())};
}

// Chunk c of a group (group null: no chunk), as a task names the one it computes next.
struct ChunkRef {
  const Group* group = nullptr;
  int c = 0;
};

// The rows of chunk `next` to fetch.
Ahead rows_of_chunk(const AttentionArgs& p, ChunkRef next, std::vector<Ahead::Run>& runs) {
  if (next.group == nullptr) return {};
  int n[kGroupTokens];
  const int keys = keys_of_chunk(p, *next.group, next.c, n);
  return rows_to_fetch(p, p.token_seq[next.group->t0], next.group->lo + next.c * kChunkKeys, keys, runs);
}

// Chunk c of a group: each token's own keys of it, its partial result at at[j]. The rows of the chunk
// the task computes next are fetched meanwhile; `fetched`: chunk c's were, by the chunk just before.
void attend_chunk(const AttentionArgs& p, const Group& group, int c, bool fetched, ChunkRef next,
                  Scratch& scratch, float* const* at) {
  const int first_key = group.lo + c * kChunkKeys;
  int n[kGroupTokens];
  keys_of_chunk(p, group, c, n);
  Ahead ahead = rows_of_chunk(p, next, scratch.ahead);
  switch (p.kv_type) {
    case KVType::f32:
      attend_group<KVType::f32>(p, group.t0, group.g, first_key, n, fetched, ahead, scratch, at);
      break;
    case KVType::f16:
      attend_group<KVType::f16>(p, group.t0, group.g, first_key, n, fetched, ahead, scratch, at);
      break;
    case KVType::bf16:
      attend_group<KVType::bf16>(p, group.t0, group.g, first_key, n, fetched, ahead, scratch, at);
      break;
    case KVType::i8:
      attend_group<KVType::i8>(p, group.t0, group.g, first_key, n, fetched, ahead, scratch, at);
      break;
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

// The partial results of tokens [t0, t1): token t's chunks at first[t - t0], ..., consecutive, each
// partial_size floats; first[t1 - t0] counts them all.
std::vector<int> first_chunks(const AttentionArgs& p, int t0, int t1) {
  std::vector<int> first(t1 - t0 + 1, 0);
  for (int t = t0; t < t1; ++t) first[t - t0 + 1] = first[t - t0] + chunks_of(visible(p, t));
  return first;
}

// Chunk c of a group, its tokens' partial results in `partial` (laid out by `first`, from the group's
// first token): a token without a chunk c gets no place (attend_group skips it). `fetched`, `next`: as
// attend_chunk's.
void attend_group_chunk(const AttentionArgs& p, const Group& group, int c, bool fetched, ChunkRef next,
                        const int* first, float* partial, Scratch& scratch) {
  float* at[kGroupTokens];
  for (int j = 0; j < group.g; ++j) {
    const bool has = first[j] + c < first[j + 1];
    at[j] = has ? partial + static_cast<size_t>(first[j] + c) * partial_size(p) : nullptr;
  }
  attend_chunk(p, group, c, fetched, next, scratch, at);
}

// Each group one task: its chunks in turn into the task's own buffer, then its tokens merged.
void attend_by_group(const AttentionArgs& p, ThreadPool& threads) {
  const std::vector<Group> groups = groups_of(p);
  threads.for_range(static_cast<int>(groups.size()), 1, [&](int begin, int end) {
    Scratch scratch;
    std::vector<float> partial;
    for (int i = begin; i < end; ++i) {
      const Group& group = groups[i];
      const std::vector<int> first = first_chunks(p, group.t0, group.t0 + group.g);
      partial.resize(static_cast<size_t>(first.back()) * partial_size(p));
      for (int c = 0; c < group.chunks; ++c) {
        const ChunkRef next = c + 1 < group.chunks ? ChunkRef{&group, c + 1}
                              : i + 1 < end        ? ChunkRef{&groups[i + 1], 0}
                                                   : ChunkRef{};
        attend_group_chunk(p, group, c, i > begin || c > 0, next, first.data(), partial.data(), scratch);
      }
      for (int j = 0; j < group.g; ++j) {
        merge(p, group.t0 + j, partial.data() + static_cast<size_t>(first[j]) * partial_size(p), first[j + 1] - first[j]);
      }
    }
    // A decode step's tokens: one range a thread, as attend_by_chunk's (a range's first chunk waits for
    // memory); a prefill's keep four (a late worker costs more there).
  }, p.T <= ThreadPool::kDecodeRows ? 1 : ThreadPool::kChunksPerThread);
}

// Each chunk of each group one task (a decode step of a few sequences), then each token's chunks merged.
void attend_by_chunk(const AttentionArgs& p, ThreadPool& threads) {
  const std::vector<Group> groups = groups_of(p);
  const std::vector<int> first = first_chunks(p, 0, p.T);
  std::vector<int> items(groups.size() + 1, 0);  // group i's chunks are items [items[i], items[i + 1])
  for (size_t i = 0; i < groups.size(); ++i) items[i + 1] = items[i] + groups[i].chunks;
  std::vector<float> partial(static_cast<size_t>(first[p.T]) * partial_size(p));
  threads.for_range(items.back(), 1, [&](int begin, int end) {
    Scratch scratch;
    auto chunk = [&](int item) {
      const size_t i = std::upper_bound(items.begin(), items.end(), item) - items.begin() - 1;
      return ChunkRef{&groups[i], item - items[i]};
    };
    for (int item = begin; item < end; ++item) {
      const ChunkRef at = chunk(item);
      const ChunkRef next = item + 1 < end ? chunk(item + 1) : ChunkRef{};
      attend_group_chunk(p, *at.group, at.c, item > begin, next, first.data() + at.group->t0, partial.data(),
                         scratch);
    }
    // One range a thread: a range's first chunk waits for memory (the chunks after it were fetched during
    // the one before), and at batch 1 with four ranges a thread half the chunks were first ones (decode
    // steps' K/V are cold, the weights having passed through the caches since).
  }, 1);
  for (int t = 0; t < p.T; ++t) {
    merge(p, t, partial.data() + static_cast<size_t>(first[t]) * partial_size(p), first[t + 1] - first[t]);
  }
}

}  // namespace

void set_attention_vectors(int bits) {
  if (bits != 256 && !(bits == 512 && has_avx512())) {
    throw std::invalid_argument("attention vectors must be 256 bits, or 512 where the CPU has AVX-512");
  }
  g_vector_bits.store(bits);
}

int attention_vectors() { return g_vector_bits.load(); }

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
    attend_by_group(p, threads);
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
