// Paged attention for MLX's CPU backend: reads K/V rows straight from the pool through the block
// tables, so no per-layer gather copies the context into a contiguous tensor first.
//
// One task per (token, KV head), split evenly over the thread pool: the GQA query heads of a KV
// head are computed together, so each K/V row is read once. Scores go to a per-thread buffer, then
// softmax in float32 and a weighted sum of the value rows.

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

// Token t's query heads that share KV head `kv_head`, over that head's visible keys: each K/V row is
// loaded once for the whole group. Keys are walked block by block (no division per key).
void attend(const AttentionArgs& p, int t, int kv_head, std::vector<float>& scores) {
  const int seq = p.token_seq[t];
  const int pos = p.positions[t];
  const int rep = p.H / p.n_kv;
  const int hi = std::min(pos, p.context_lens[seq] - 1);
  const int lo = p.window > 0 ? std::max(0, pos - p.window + 1) : 0;
  const size_t first_head = static_cast<size_t>(t) * p.H + static_cast<size_t>(kv_head) * rep;
  float* out = p.out + first_head * p.D;
  const float* q = p.q + static_cast<size_t>(t) * p.q_stride + static_cast<size_t>(kv_head) * rep * p.D;
  std::fill(out, out + static_cast<size_t>(rep) * p.D, 0.0f);
  if (hi < lo) return;
  const int32_t* table = p.block_tables + static_cast<size_t>(seq) * p.max_blocks;
  const int n = hi - lo + 1;
  scores.resize(static_cast<size_t>(rep) * n);
  auto row_of = [&](const float* pool, int j) {
    const size_t slot = static_cast<size_t>(table[j / p.block_size]) * p.block_size + j % p.block_size;
    return pool + (slot * p.n_kv + kv_head) * p.D;
  };
  // Calls f(i, row) for the i-th visible key, row pointing at its (kv_head) vector in `pool`. The
  // rows of one head are strided (n_kv heads per slot) and blocks scattered, which the hardware
  // prefetcher does not follow: the row kPrefetch keys ahead is requested explicitly.
  constexpr int kPrefetch = 8;
  auto for_each_key = [&](const float* pool, auto&& f) {
    for (int j = lo; j <= hi;) {
      const int block = j / p.block_size;
      const int end = std::min(hi + 1, (block + 1) * p.block_size);
      const size_t base = static_cast<size_t>(table[block]) * p.block_size;
      for (; j < end; ++j) {
        if (j + kPrefetch <= hi) {
          const char* ahead = reinterpret_cast<const char*>(row_of(pool, j + kPrefetch));
          for (int b = 0; b < p.D * 4; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
        }
        const size_t slot = base + j % p.block_size;
        f(j - lo, pool + (slot * p.n_kv + kv_head) * p.D);
      }
    }
  };
  for_each_key(p.keys, [&](int i, const float* k) {
    for (int r = 0; r < rep; ++r) {
      float s = dot(q + static_cast<size_t>(r) * p.D, k, p.D) * p.scale;
      if (p.softcap > 0.0f) s = std::tanh(s / p.softcap) * p.softcap;
      scores[static_cast<size_t>(r) * n + i] = s;
    }
  });
  std::vector<float> inv_total(rep);
  for (int r = 0; r < rep; ++r) {
    float* row = scores.data() + static_cast<size_t>(r) * n;
    const float max_score = *std::max_element(row, row + n);
    float total = 0.0f;
    for (int i = 0; i < n; ++i) {
      row[i] = std::exp(row[i] - max_score);
      total += row[i];
    }
    inv_total[r] = 1.0f / total;
  }
  for_each_key(p.values, [&](int i, const float* v) {
    for (int r = 0; r < rep; ++r) {
      scale_add(out + static_cast<size_t>(r) * p.D, 1.0f, v, scores[static_cast<size_t>(r) * n + i], p.D);
    }
  });
  for (int r = 0; r < rep; ++r) {
    for (int d = 0; d < p.D; ++d) out[static_cast<size_t>(r) * p.D + d] *= inv_total[r];
  }
}

}  // namespace

void attend_all(const AttentionArgs& p) {
  ThreadPool& threads = pool();
  const int tasks = p.T * p.n_kv;
  const int parts = threads.size();
  threads.run([&](int part) {
    std::vector<float> scores;
    const int per = (tasks + parts - 1) / parts;
    const int end = std::min(tasks, (part + 1) * per);
    for (int i = part * per; i < end; ++i) attend(p, i / p.n_kv, i % p.n_kv, scores);
  });
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
