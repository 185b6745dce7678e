// Paged attention for MLX's CPU backend: reads K/V rows straight from the pool through the block
// tables, so no per-layer gather copies the context into a contiguous tensor first.
//
// One task per token, split evenly over the thread pool: all its heads are computed together, so
// each pool slot (every KV head's row) is read once, front to back. Scores go to a per-thread buffer,
// then softmax in float32 and a weighted sum of the value rows. Where there are too few tokens to keep
// the threads busy (decoding a few sequences), each token's keys are split into chunks whose partial
// softmaxes are merged afterwards (flash-decoding).

#include "paged_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
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

// All of token t's query heads over keys [lo, hi] (non-empty). A pool slot holds the n_kv heads'
// rows side by side, so walking the keys reads each slot's K (then V) as one contiguous run, and
// blocks of block_size slots as one longer run: per-KV-head tasks read a third of every slot each
// (SmolLM2), a strided pattern that reached ~7 GB/s where the machine streams 16. The GQA query heads
// of a KV head share each K/V row load, and keys are walked block by block (no division per key).
// Writes out[h] = sum_j exp(s_hj - max_h) v_j (unnormalized), max_h, and total_h = sum_j exp(s_hj - max_h).
void attend_keys(const AttentionArgs& p, int t, KeyRange keys, std::vector<float>& scores, float* out,
                 float* max_score, float* total) {
  const int seq = p.token_seq[t];
  const int rep = p.H / p.n_kv;
  const int lo = keys.lo, hi = keys.hi;
  const size_t row_size = static_cast<size_t>(p.n_kv) * p.D;  // one slot: every KV head
  const float* q = p.q + static_cast<size_t>(t) * p.q_stride;
  std::fill(out, out + static_cast<size_t>(p.H) * p.D, 0.0f);
  const int32_t* table = p.block_tables + static_cast<size_t>(seq) * p.max_blocks;
  const int n = hi - lo + 1;
  scores.resize(static_cast<size_t>(p.H) * n);
  auto row_of = [&](const float* pool, int j) {  // for the prefetch; the walk steps through blocks
    const size_t slot = static_cast<size_t>(table[j / p.block_size]) * p.block_size + j % p.block_size;
    return pool + slot * row_size;
  };
  // Calls f(i, row) for the i-th key of the range, row pointing at its slot in `pool`. Blocks are
  // scattered, which the hardware prefetcher does not follow: the slot kPrefetch keys ahead is
  // requested explicitly.
  constexpr int kPrefetch = 2;
  auto for_each_key = [&](const float* pool, auto&& f) {
    for (int j = lo; j <= hi;) {
      const int block = j / p.block_size;
      const int end = std::min(hi + 1, (block + 1) * p.block_size);
      const float* base = pool + static_cast<size_t>(table[block]) * p.block_size * row_size;
      for (; j < end; ++j) {
        if (j + kPrefetch <= hi) {
          const char* ahead = reinterpret_cast<const char*>(row_of(pool, j + kPrefetch));
          for (size_t b = 0; b < row_size * 4; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
        }
        f(j - lo, base + static_cast<size_t>(j % p.block_size) * row_size);
      }
    }
  };
  // Query head h = kv_head * rep + r reads KV head kv_head's row.
  for_each_key(p.keys, [&](int i, const float* k) {
    for (int kv_head = 0, h = 0; kv_head < p.n_kv; ++kv_head) {
      const float* k_head = k + static_cast<size_t>(kv_head) * p.D;
      for (int r = 0; r < rep; ++r, ++h) {
        float s = dot(q + static_cast<size_t>(h) * p.D, k_head, p.D) * p.scale;
        if (p.softcap > 0.0f) s = std::tanh(s / p.softcap) * p.softcap;
        scores[static_cast<size_t>(h) * n + i] = s;
      }
    }
  });
  for (int h = 0; h < p.H; ++h) {
    float* row = scores.data() + static_cast<size_t>(h) * n;
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
  for_each_key(p.values, [&](int i, const float* v) {
    for (int kv_head = 0, h = 0; kv_head < p.n_kv; ++kv_head) {
      const float* v_head = v + static_cast<size_t>(kv_head) * p.D;
      for (int r = 0; r < rep; ++r, ++h) {
        add_scaled(out + static_cast<size_t>(h) * p.D, v_head, scores[static_cast<size_t>(h) * n + i], p.D);
      }
    }
  });
}

// Token t's output rows [H, D].
float* token_rows(const AttentionArgs& p, int t) { return p.out + static_cast<size_t>(t) * p.H * p.D; }

// Each token as one task, its output normalized in place.
void attend_whole(const AttentionArgs& p, ThreadPool& threads) {
  threads.for_range(p.T, 1, [&](int begin, int end) {
    std::vector<float> scores, max_score(p.H), total(p.H);
    for (int t = begin; t < end; ++t) {
      float* out = token_rows(p, t);
      const KeyRange keys = visible(p, t);
      if (keys.hi < keys.lo) {
        std::fill(out, out + static_cast<size_t>(p.H) * p.D, 0.0f);
        continue;
      }
      attend_keys(p, t, keys, scores, out, max_score.data(), total.data());
      for (int h = 0; h < p.H; ++h) {
        const float inv = 1.0f / total[h];
        for (int d = 0; d < p.D; ++d) out[static_cast<size_t>(h) * p.D + d] *= inv;
      }
    }
  });
}

// Each token's keys split into `splits` chunks computed as separate tasks, then merged as in
// flash-decoding: out = sum_c exp(max_c - max) out_c / sum_c exp(max_c - max) total_c. An empty
// chunk keeps zero rows, maxima of -inf and totals of 0, so it weighs nothing in the merge.
void attend_split(const AttentionArgs& p, ThreadPool& threads, int splits) {
  const size_t out_size = static_cast<size_t>(p.H) * p.D;
  const size_t stride = out_size + 2 * static_cast<size_t>(p.H);  // a chunk's out rows, then its maxima and totals
  const int items = p.T * splits;
  std::vector<float> partial(static_cast<size_t>(items) * stride, 0.0f);
  for (int i = 0; i < items; ++i) {
    float* max_score = partial.data() + static_cast<size_t>(i) * stride + out_size;
    std::fill(max_score, max_score + p.H, -INFINITY);
  }
  threads.for_range(items, 1, [&](int begin, int end) {
    std::vector<float> scores;
    for (int i = begin; i < end; ++i) {
      const int t = i / splits, c = i % splits;
      const KeyRange keys = visible(p, t);
      const int chunk = (keys.hi - keys.lo + splits) / splits;  // ceil(n / splits), n = hi - lo + 1
      const KeyRange mine{keys.lo + c * chunk, std::min(keys.hi, keys.lo + (c + 1) * chunk - 1)};
      if (mine.hi < mine.lo) continue;
      float* at = partial.data() + static_cast<size_t>(i) * stride;
      attend_keys(p, t, mine, scores, at, at + out_size, at + out_size + p.H);
    }
  });
  for (int t = 0; t < p.T; ++t) {
    float* out = token_rows(p, t);
    std::fill(out, out + out_size, 0.0f);
    const float* first = partial.data() + static_cast<size_t>(t) * splits * stride;
    for (int h = 0; h < p.H; ++h) {
      float m = -INFINITY;
      for (int c = 0; c < splits; ++c) m = std::max(m, first[c * stride + out_size + h]);
      if (m == -INFINITY) continue;  // no visible keys: zeros
      float total = 0.0f;
      float* row = out + static_cast<size_t>(h) * p.D;
      for (int c = 0; c < splits; ++c) {
        const float* chunk = first + c * stride;
        const float w = std::exp(chunk[out_size + h] - m);
        total += w * chunk[out_size + p.H + h];
        add_scaled(row, chunk + static_cast<size_t>(h) * p.D, w, p.D);
      }
      for (int d = 0; d < p.D; ++d) row[d] /= total;  // >= 1: the chunk holding the maximum adds >= 1
    }
  }
}

}  // namespace

void attend_all(const AttentionArgs& p) {
  ThreadPool& threads = pool();
  // A decode step of a few sequences has fewer tokens than the threads can share evenly (batch 1:
  // one token on 2 threads): then each token's keys are split into chunks of at least kMinChunk keys.
  constexpr int kTasksPerThread = 4, kMinChunk = 64;
  const int want = kTasksPerThread * threads.size();
  int splits = 1;
  if (p.T < want) {
    int longest = 0;
    for (int t = 0; t < p.T; ++t) {
      const KeyRange keys = visible(p, t);
      longest = std::max(longest, keys.hi - keys.lo + 1);
    }
    splits = std::max(1, std::min((want + p.T - 1) / p.T, longest / kMinChunk));
  }
  if (splits == 1) {
    attend_whole(p, threads);
  } else {
    attend_split(p, threads, splits);
  }
}

namespace {

class PagedAttention : public mx::UnaryPrimitive {
 public:
  PagedAttention(mx::Stream stream, int block_size, float scale, int window, float softcap)
      : mx::UnaryPrimitive(stream), block_size_(block_size), scale_(scale), window_(window), softcap_(softcap) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    const mx::array& q = inputs[0];
    AttentionArgs p{nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, out.data<float>(),
                    q.shape(0), q.shape(1), q.shape(2), inputs[1].shape(1), inputs[3].shape(1), block_size_, window_,
                    scale_, softcap_, static_cast<size_t>(q.shape(1)) * q.shape(2)};
    encoder.dispatch([p, in = AttentionInputs(inputs)]() { in.attend(p); });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("PagedAttention is a CPU kernel");
  }

  const char* name() const override { return "PagedAttention"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const PagedAttention&>(other);
    return block_size_ == o.block_size_ && scale_ == o.scale_ && window_ == o.window_ && softcap_ == o.softcap_;
  }

 private:
  int block_size_;
  float scale_;
  int window_;
  float softcap_;
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
    float softcap) {
  if (q.ndim() != 3 || key_pool.ndim() != 3 || value_pool.shape() != key_pool.shape()) {
    throw std::invalid_argument("paged_attention: q must be [T, H, D] and the pools [slots, n_kv, D]");
  }
  if (q.dtype() != mx::float32 || key_pool.dtype() != mx::float32 || value_pool.dtype() != mx::float32) {
    throw std::invalid_argument("paged_attention: q and the pools must be float32");
  }
  if (q.shape(2) != key_pool.shape(2) || q.shape(2) % 8 != 0 || q.shape(1) % key_pool.shape(1) != 0) {
    throw std::invalid_argument("paged_attention: head_dim must match and be a multiple of 8; H a multiple of n_kv");
  }
  const mx::Stream s = mx::default_stream(mx::Device::cpu);
  auto i32 = [&](const mx::array& a) { return mx::astype(a, mx::int32, s); };
  return mx::array(
      q.shape(), mx::float32, std::make_shared<PagedAttention>(s, block_size, scale, window, softcap),
      {q, key_pool, value_pool, i32(block_tables), i32(context_lens), i32(positions), i32(token_seq)});
}

}  // namespace mlx_infer
