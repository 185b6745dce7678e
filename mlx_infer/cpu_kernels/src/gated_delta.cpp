// The gated delta rule's decode step as one primitive, in place in the state pool. As MLX ops it is a
// gather of the states, six elementwise or batched-matmul passes over [B, H, Dk, Dv] (decay, predict,
// error, outer-product update, read) and a scatter back: each a full trip through memory, for a state
// that is the largest thing a hybrid model touches per token after its weights. Here each (sequence,
// head) state matrix is read from its slot twice while it sits in cache (predict, then update + read)
// and written once, where it lies; the head's output goes to the row after its matrix.

#include "gated_delta.h"

#include <cstring>
#include <stdexcept>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "strided.h"
#include "thread_pool.h"

namespace mx = mlx::core;

namespace mlx_infer {

namespace {

struct StepArgs {
  float* pool;
  const int32_t* slots;
  const float *q, *k, *v, *decay, *beta;
  int H, Dk, Dv;
};

// Sequence b, head h: S' = decay * S; delta = beta * (v - k^T S'); S'' = S' + k delta^T; o = q^T S''.
void step_head(const StepArgs& p, int b, int h, std::vector<float>& delta) {
  const int Dk = p.Dk, Dv = p.Dv;
  const size_t head = static_cast<size_t>(Dk + 1) * Dv;
  float* S = p.pool + static_cast<size_t>(p.slots[b]) * p.H * head + static_cast<size_t>(h) * head;
  float* o = S + static_cast<size_t>(Dk) * Dv;
  const size_t bh = static_cast<size_t>(b) * p.H + h;
  const float* q = p.q + bh * Dk;
  const float* k = p.k + bh * Dk;
  const float* v = p.v + bh * Dv;
  const float decay = p.decay[bh], beta = p.beta[bh];

  delta.assign(Dv, 0.0f);
  for (int i = 0; i < Dk; ++i) {
    const float ki = k[i] * decay;
    const float* Si = S + static_cast<size_t>(i) * Dv;
    for (int j = 0; j < Dv; ++j) delta[j] += Si[j] * ki;
  }
  for (int j = 0; j < Dv; ++j) {
    delta[j] = (v[j] - delta[j]) * beta;
    o[j] = 0.0f;
  }
  for (int i = 0; i < Dk; ++i) {
    float* Si = S + static_cast<size_t>(i) * Dv;
    const float ki = k[i], qi = q[i];
    for (int j = 0; j < Dv; ++j) {
      const float s = Si[j] * decay + ki * delta[j];
      Si[j] = s;
      o[j] += s * qi;
    }
  }
}

class GatedDeltaStep : public mx::UnaryPrimitive {
 public:
  explicit GatedDeltaStep(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array& slots_pool = inputs[0];
    const bool donated = slots_pool.is_donatable() && slots_pool.flags().row_contiguous;
    if (donated) {
      out.copy_shared_buffer(slots_pool);
    } else {
      out.set_data(mx::allocator::malloc(out.nbytes()));
    }
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    const int B = inputs[2].shape(0), H = inputs[2].shape(1), Dk = inputs[2].shape(2), Dv = inputs[4].shape(2);
    encoder.dispatch([states = Input<float>(slots_pool), slots = Input<int32_t>(inputs[1]), q = Input<float>(inputs[2]),
                      k = Input<float>(inputs[3]), v = Input<float>(inputs[4]), decay = Input<float>(inputs[5]),
                      beta = Input<float>(inputs[6]), op = out.data<float>(), size = out.size(), donated, B, H, Dk,
                      Dv]() {
      if (!donated) {
        std::vector<float> scratch;
        std::memcpy(op, states.rows(scratch), size * sizeof(float));
      }
      std::vector<float> q_s, k_s, v_s, d_s, b_s;
      std::vector<int32_t> slot_s;
      const StepArgs p{op, slots.rows(slot_s), q.rows(q_s), k.rows(k_s), v.rows(v_s), decay.rows(d_s),
                       beta.rows(b_s), H, Dk, Dv};
      pool().for_range(B * H, 1, [&](int begin, int end) {
        std::vector<float> delta;
        for (int i = begin; i < end; ++i) step_head(p, i / H, i % H, delta);
      });
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("GatedDeltaStep is a CPU kernel");
  }

  const char* name() const override { return "NativeGatedDeltaStep"; }

  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

}  // namespace

mx::array gated_delta_step(const mx::array& pool, const mx::array& slots, const mx::array& q, const mx::array& k,
                           const mx::array& v, const mx::array& decay, const mx::array& beta) {
  if (q.ndim() != 3 || k.shape() != q.shape() || v.ndim() != 3 || v.shape(0) != q.shape(0) ||
      v.shape(1) != q.shape(1) || decay.ndim() != 2 || beta.shape() != decay.shape() ||
      decay.shape(0) != q.shape(0) || decay.shape(1) != q.shape(1) || slots.ndim() != 1 ||
      slots.shape(0) != q.shape(0)) {
    throw std::invalid_argument("gated_delta_step: q, k [B, H, Dk], v [B, H, Dv], decay, beta [B, H], slots [B]");
  }
  const int H = q.shape(1), Dk = q.shape(2), Dv = v.shape(2);
  if (pool.ndim() != 3 || pool.shape(1) != 1 || pool.shape(2) != H * (Dk + 1) * Dv) {
    throw std::invalid_argument("gated_delta_step: pool [S, 1, H * (Dk + 1) * Dv]");
  }
  for (const auto* a : {&pool, &q, &k, &v, &decay, &beta}) {
    if (a->dtype() != mx::float32) throw std::invalid_argument("gated_delta_step: float32 inputs");
  }
  const mx::Stream s = mx::default_stream(mx::Device::cpu);
  return mx::array(pool.shape(), mx::float32, std::make_shared<GatedDeltaStep>(s),
                   {pool, mx::astype(slots, mx::int32, s), q, k, v, decay, beta});
}

}  // namespace mlx_infer
