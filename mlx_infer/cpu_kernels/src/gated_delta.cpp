// The gated delta rule as one primitive, in place in the state pool, for a decode step (one token per
// sequence) and for multi-token rows (chunked prefill, speculative verification) alike.
//
// As MLX ops a decode step is a gather of the states, six elementwise or batched-matmul passes over
// [B, H, Dk, Dv] and a scatter back, each a full trip through memory; prefill as MLX ops is the chunked
// form (matrix products and a triangular solve per 64 tokens). Here the work is split by (sequence, head,
// block of value columns): the delta rule's update touches column j only through its own error delta_j,
// so a [Dk, W] column block evolves on its own. Each block runs its sequence's tokens one after another
// while it sits in L1 (Dk x 32 floats is 16 KiB at Dk = 128), two passes per token (predict, then update +
// read) with the W accumulators in registers, and is written once, where it lies.

#include "gated_delta.h"

#include <cstring>
#include <memory>
#include <optional>
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

constexpr int kBlock = 32;  // value columns per task: 4 AVX2 registers

struct Args {
  float* pool;
  float* out;
  const int32_t *slots, *lengths;
  const float *q, *k, *v, *decay, *beta;
  int L, H, Dk, Dv;
};

// One token on columns [j0, j0 + W) of state S ([Dk, Dv]): S' = decay * S; delta = beta * (v - k^T S');
// S'' = S' + k delta^T; o = q^T S''. Any W; kBlock has its AVX2 form below.
template <int W>
void token_columns(float* S, int Dk, int Dv, int j0, const float* q, const float* k, const float* v, float decay,
                   float beta, float* o) {
  float acc[W] = {};
  for (int i = 0; i < Dk; ++i) {
    const float* Si = S + static_cast<size_t>(i) * Dv + j0;
    const float ki = k[i];
    for (int w = 0; w < W; ++w) acc[w] += Si[w] * ki;
  }
  float delta[W], read[W] = {};
  for (int w = 0; w < W; ++w) delta[w] = (v[j0 + w] - acc[w] * decay) * beta;
  for (int i = 0; i < Dk; ++i) {
    float* Si = S + static_cast<size_t>(i) * Dv + j0;
    const float ki = k[i], qi = q[i];
    for (int w = 0; w < W; ++w) {
      const float s = Si[w] * decay + ki * delta[w];
      Si[w] = s;
      read[w] += s * qi;
    }
  }
  for (int w = 0; w < W; ++w) o[j0 + w] = read[w];
}

// 32 columns in four registers. The prediction's sums run as two chains (even and odd rows) so that the
// FMA latency does not bound the loop; the update's rows are independent but for the read's sums.
template <>
void token_columns<kBlock>(float* S, int Dk, int Dv, int j0, const float* q, const float* k, const float* v,
                           float decay, float beta, float* o) {
  __m256 acc[8] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  int i = 0;
  for (; i + 2 <= Dk; i += 2) {
    const float* Si = S + static_cast<size_t>(i) * Dv + j0;
    const __m256 k0 = _mm256_set1_ps(k[i]), k1 = _mm256_set1_ps(k[i + 1]);
    for (int w = 0; w < 4; ++w) {
      acc[w] = _mm256_fmadd_ps(_mm256_loadu_ps(Si + 8 * w), k0, acc[w]);
      acc[4 + w] = _mm256_fmadd_ps(_mm256_loadu_ps(Si + Dv + 8 * w), k1, acc[4 + w]);
    }
  }
  if (i < Dk) {
    const float* Si = S + static_cast<size_t>(i) * Dv + j0;
    const __m256 k0 = _mm256_set1_ps(k[i]);
    for (int w = 0; w < 4; ++w) acc[w] = _mm256_fmadd_ps(_mm256_loadu_ps(Si + 8 * w), k0, acc[w]);
  }
  const __m256 vdecay = _mm256_set1_ps(decay), vbeta = _mm256_set1_ps(beta);
  __m256 delta[4], read[4];
  for (int w = 0; w < 4; ++w) {
    const __m256 predicted = _mm256_mul_ps(_mm256_add_ps(acc[w], acc[4 + w]), vdecay);
    delta[w] = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(v + j0 + 8 * w), predicted), vbeta);
    read[w] = _mm256_setzero_ps();
  }
  for (i = 0; i < Dk; ++i) {
    float* Si = S + static_cast<size_t>(i) * Dv + j0;
    const __m256 ki = _mm256_set1_ps(k[i]), qi = _mm256_set1_ps(q[i]);
    for (int w = 0; w < 4; ++w) {
      const __m256 s = _mm256_fmadd_ps(ki, delta[w], _mm256_mul_ps(_mm256_loadu_ps(Si + 8 * w), vdecay));
      _mm256_storeu_ps(Si + 8 * w, s);
      read[w] = _mm256_fmadd_ps(s, qi, read[w]);
    }
  }
  for (int w = 0; w < 4; ++w) _mm256_storeu_ps(o + j0 + 8 * w, read[w]);
}

// Sequence b, head h, columns [j0, j0 + W): every token in order, then the last output into the row
// after the matrix; padding rows' outputs are zeros.
template <int W>
void run_columns(const Args& p, int b, int h, int j0) {
  const int H = p.H, Dk = p.Dk, Dv = p.Dv;
  const size_t head = static_cast<size_t>(Dk + 1) * Dv;
  float* S = p.pool + static_cast<size_t>(p.slots[b]) * H * head + static_cast<size_t>(h) * head;
  const int n = p.lengths ? p.lengths[b] : p.L;
  for (int t = 0; t < p.L; ++t) {
    const size_t row = (static_cast<size_t>(b) * p.L + t) * H + h;
    float* o = p.out + row * Dv;
    if (t >= n) {
      std::memset(o + j0, 0, W * sizeof(float));
      continue;
    }
    token_columns<W>(S, Dk, Dv, j0, p.q + row * Dk, p.k + row * Dk, p.v + row * Dv, p.decay[row], p.beta[row], o);
    if (t == n - 1) std::memcpy(S + static_cast<size_t>(Dk) * Dv + j0, o + j0, W * sizeof(float));
  }
}

// Task `task` of (b, h, column block): full blocks of kBlock columns, the remainder in blocks of 8 and 1.
void run_task(const Args& p, int task, int blocks) {
  const int bh = task / blocks, block = task % blocks;
  const int b = bh / p.H, h = bh % p.H;
  int j0 = block * kBlock;
  if (j0 + kBlock <= p.Dv) return run_columns<kBlock>(p, b, h, j0);
  for (; j0 + 8 <= p.Dv; j0 += 8) run_columns<8>(p, b, h, j0);
  for (; j0 < p.Dv; ++j0) run_columns<1>(p, b, h, j0);
}

// The outputs' buffer, filled by GatedDelta and handed to GatedDeltaOutputs. Why two primitives rather
// than one with two outputs: MLX gives each output of a multi-output primitive its own copy of the
// inputs, so the pool would be held twice and never donated, and every call would copy the whole pool
// (measured: 75 ms a token for 64 slots of Qwen3.5's 2 MiB states).
struct Pending {
  std::optional<mx::allocator::Data> data;  // freed here if nothing takes it
};

class GatedDelta : public mx::UnaryPrimitive {
 public:
  GatedDelta(mx::Stream stream, bool ragged, std::shared_ptr<Pending> pending, size_t out_bytes)
      : mx::UnaryPrimitive(stream), ragged_(ragged), pending_(std::move(pending)), out_bytes_(out_bytes) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& pool_out) override {
    const mx::array& slots_pool = inputs[0];
    const bool donated = slots_pool.is_donatable() && slots_pool.flags().row_contiguous;
    if (donated) {
      pool_out.copy_shared_buffer(slots_pool);
    } else {
      pool_out.set_data(mx::allocator::malloc(pool_out.nbytes()));
    }
    pending_->data.emplace(mx::allocator::malloc(out_bytes_));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(pool_out);
    const mx::array& q = inputs[2];
    const int B = q.shape(0), L = q.shape(1), H = q.shape(2), Dk = q.shape(3), Dv = inputs[4].shape(3);
    std::optional<Input<int32_t>> lengths;
    if (ragged_) lengths.emplace(inputs[7]);
    encoder.dispatch([states = Input<float>(slots_pool), slots = Input<int32_t>(inputs[1]), q = Input<float>(q),
                      k = Input<float>(inputs[3]), v = Input<float>(inputs[4]), decay = Input<float>(inputs[5]),
                      beta = Input<float>(inputs[6]), lengths, pp = pool_out.data<float>(),
                      op = static_cast<float*>(pending_->data->buffer().raw_ptr()), size = pool_out.size(),
                      donated, B, L, H, Dk, Dv]() {
      if (!donated) {
        std::vector<float> scratch;
        std::memcpy(pp, states.rows(scratch), size * sizeof(float));
      }
      std::vector<float> q_s, k_s, v_s, d_s, b_s;
      std::vector<int32_t> slot_s, len_s;
      const Args p{pp,          op,          slots.rows(slot_s), lengths ? lengths->rows(len_s) : nullptr,
                   q.rows(q_s), k.rows(k_s), v.rows(v_s),        decay.rows(d_s),
                   beta.rows(b_s), L,        H,                  Dk,
                   Dv};
      const int blocks = (Dv + kBlock - 1) / kBlock;
      pool().for_range(B * H * blocks, 1, [&](int begin, int end) {
        for (int i = begin; i < end; ++i) run_task(p, i, blocks);
      });
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("GatedDelta is a CPU kernel");
  }

  const char* name() const override { return "NativeGatedDelta"; }

 private:
  bool ragged_;
  std::shared_ptr<Pending> pending_;
  size_t out_bytes_;
};

// The outputs GatedDelta wrote (its output, the updated pool, is this one's input: it runs after, on the
// same stream, and its buffer is written by the time anything reading this one runs).
class GatedDeltaOutputs : public mx::UnaryPrimitive {
 public:
  GatedDeltaOutputs(mx::Stream stream, std::shared_ptr<Pending> pending)
      : mx::UnaryPrimitive(stream), pending_(std::move(pending)) {}

  void eval_cpu(const std::vector<mx::array>&, mx::array& out) override {
    out.set_data(std::move(*pending_->data));
    pending_->data.reset();
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("GatedDeltaOutputs is a CPU kernel");
  }

  const char* name() const override { return "NativeGatedDeltaOutputs"; }

 private:
  std::shared_ptr<Pending> pending_;
};

}  // namespace

std::vector<mx::array> gated_delta(const mx::array& pool, const mx::array& slots, const mx::array& q,
                                   const mx::array& k, const mx::array& v, const mx::array& decay,
                                   const mx::array& beta, const std::optional<mx::array>& lengths) {
  if (q.ndim() != 4 || k.shape() != q.shape() || v.ndim() != 4 || v.shape(0) != q.shape(0) ||
      v.shape(1) != q.shape(1) || v.shape(2) != q.shape(2) || decay.ndim() != 3 || beta.shape() != decay.shape() ||
      decay.shape(0) != q.shape(0) || decay.shape(1) != q.shape(1) || decay.shape(2) != q.shape(2) ||
      slots.ndim() != 1 || slots.shape(0) != q.shape(0) ||
      (lengths && (lengths->ndim() != 1 || lengths->shape(0) != q.shape(0)))) {
    throw std::invalid_argument(
        "gated_delta: q, k [B, L, H, Dk], v [B, L, H, Dv], decay, beta [B, L, H], slots, lengths [B]");
  }
  const int H = q.shape(2), Dk = q.shape(3), Dv = v.shape(3);
  if (pool.ndim() != 3 || pool.shape(1) != 1 || pool.shape(2) != H * (Dk + 1) * Dv) {
    throw std::invalid_argument("gated_delta: pool [S, 1, H * (Dk + 1) * Dv]");
  }
  for (const auto* a : {&pool, &q, &k, &v, &decay, &beta}) {
    if (a->dtype() != mx::float32) throw std::invalid_argument("gated_delta: float32 inputs");
  }
  const mx::Stream s = mx::default_stream(mx::Device::cpu);
  std::vector<mx::array> inputs{pool, mx::astype(slots, mx::int32, s), q, k, v, decay, beta};
  if (lengths) inputs.push_back(mx::astype(*lengths, mx::int32, s));
  auto pending = std::make_shared<Pending>();
  mx::array updated(pool.shape(), mx::float32,
                    std::make_shared<GatedDelta>(s, lengths.has_value(), pending, v.nbytes()), inputs);
  mx::array out(v.shape(), mx::float32, std::make_shared<GatedDeltaOutputs>(s, pending), {updated});
  return {updated, out};
}

}  // namespace mlx_infer
