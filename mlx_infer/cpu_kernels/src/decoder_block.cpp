// A Llama-style decoder block as two primitives (plus the two KV writes between them).
//
// Op by op, a block is ~20 MLX graph nodes (norms, products, splits, reshapes, RoPE, KV writes,
// attention, residual adds, the gate); on MLX's CPU backend each node costs microseconds of
// scheduling and each thread-pool product a wake-up, so at decode, where the whole block reads
// ~3.5 MB of weights in ~0.4 ms, that fixed cost was as large as the work. Here the block's work runs
// in the kernels the single ops use (same arithmetic, same order), called back to back:
//   block_qkv: RMSNorm -> fused q/k/v product (+ bias) -> RoPE on q and k, one [T, (H + 2 n_kv) D] array;
//   kv_write(column) x 2: the K and V parts into their pools (donated, so in place);
//   block_out: attention of the q part -> o_proj -> + x -> RMSNorm -> gate/up -> SiLU gate -> down -> + h.
// The KV writes stay ops of their own so each pool is the sole input its write takes over (a
// multi-output primitive's outputs share their inputs, so none of them could be donated).

#include "decoder_block.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "buffer.h"
#include "kv_format.h"
#include "norm_rope.h"
#include "paged_attention.h"
#include "quantized_matvec.h"
#include "simd.h"
#include "strided.h"
#include "thread_pool.h"

namespace mx = mlx::core;

namespace mlx_infer {

namespace {

// act[t, i] = silu(gate_up[t, i]) * gate_up[t, I + i], as MLX's compiled gate computes it
// (x * sigmoid(x), sigmoid = 1 / (1 + exp(-x))), eight at a time with exp8.
void silu_gate(const float* gate_up, int T, int I, float* act) {
  const auto rows = [&](int t0, int t1) {
    for (int t = t0; t < t1; ++t) {
      const float* g = gate_up + static_cast<size_t>(t) * 2 * I;
      const float* u = g + I;
      float* o = act + static_cast<size_t>(t) * I;
      int i = 0;
      for (; i + 8 <= I; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        const __m256 sig = _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_add_ps(_mm256_set1_ps(1.0f), e));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(gv, sig), _mm256_loadu_ps(u + i)));
      }
      for (; i < I; ++i) o[i] = g[i] * (1.0f / (1.0f + std::exp(-g[i]))) * u[i];
    }
  };
  if (T < 8) {
    rows(0, T);
    return;
  }
  pool().for_range(T, 1, rows);
}

struct Shape {
  int H, n_kv, D;
  int width() const { return (H + 2 * n_kv) * D; }
};

class BlockQKV : public mx::UnaryPrimitive {
 public:
  BlockQKV(mx::Stream stream, float eps, int group, int bits, Shape shape, int rope_dims, bool has_bias,
           bool has_qk_norm, float qk_eps)
      : mx::UnaryPrimitive(stream), eps_(eps), group_(group), bits_(bits), shape_(shape), rope_dims_(rope_dims),
        has_bias_(has_bias), has_qk_norm_(has_qk_norm), qk_eps_(qk_eps) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    const int T = inputs[0].shape(0);
    const int Dm = inputs[0].shape(1);
    std::optional<Input<float>> bias, q_norm, k_norm;
    if (has_bias_) bias.emplace(inputs[7]);
    if (has_qk_norm_) {
      q_norm.emplace(inputs[inputs.size() - 2]);
      k_norm.emplace(inputs[inputs.size() - 1]);
    }
    encoder.dispatch([x = Input<float>(inputs[0]), norm = Input<float>(inputs[1]),
                      w = AffineWeights(inputs[2], inputs[3], inputs[4], group_, bits_), cos = Input<float>(inputs[5]),
                      sin = Input<float>(inputs[6]), bias, q_norm, k_norm, op = out.data<float>(), T, Dm,
                      eps = eps_, qk_eps = qk_eps_, shape = shape_, dims = rope_dims_]() {
      std::vector<float> x_s, n_s, c_s, s_s, b_s, qn_s, kn_s;
      AffineWeights::Scratch w_s;
      const Buffer<float> normed(static_cast<size_t>(T) * Dm);
      rms_norm_rows(x.rows(x_s), norm.rows(n_s), normed.get(), T, Dm, eps, false);
      const int W = shape.width();
      affine_product(normed.get(), T, Dm, w.view(w_s), op);
      if (bias) {
        const float* b = bias->rows(b_s);
        for (int t = 0; t < T; ++t) {
          for (int i = 0; i < W; ++i) op[static_cast<size_t>(t) * W + i] += b[i];
        }
      }
      float* k = op + static_cast<size_t>(shape.H) * shape.D;
      if (q_norm) {  // Qwen3: RMSNorm over each q and k head, before RoPE
        const float* qn = q_norm->rows(qn_s);
        const float* kn = k_norm->rows(kn_s);
        for (int t = 0; t < T; ++t) {
          float* q_row = op + static_cast<size_t>(t) * W;
          rms_norm_rows(q_row, qn, q_row, shape.H, shape.D, qk_eps, false);
          rms_norm_rows(k + static_cast<size_t>(t) * W, kn, k + static_cast<size_t>(t) * W, shape.n_kv, shape.D,
                        qk_eps, false);
        }
      }
      const float* c = cos.rows(c_s);
      const float* s = sin.rows(s_s);
      rope_rows(op, W, op, W, T, shape.H, shape.D, dims, c, s);
      rope_rows(k, W, k, W, T, shape.n_kv, shape.D, dims, c, s);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("BlockQKV is a CPU kernel");
  }

  const char* name() const override { return "NativeBlockQKV"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const BlockQKV&>(other);
    return eps_ == o.eps_ && group_ == o.group_ && bits_ == o.bits_ && shape_.H == o.shape_.H &&
           shape_.n_kv == o.shape_.n_kv && shape_.D == o.shape_.D && rope_dims_ == o.rope_dims_ &&
           has_bias_ == o.has_bias_ && has_qk_norm_ == o.has_qk_norm_ && qk_eps_ == o.qk_eps_;
  }

 private:
  float eps_;
  int group_, bits_;
  Shape shape_;
  int rope_dims_;
  bool has_bias_;
  bool has_qk_norm_;
  float qk_eps_;
};

class BlockOut : public mx::UnaryPrimitive {
 public:
  BlockOut(mx::Stream stream, float eps, std::vector<int> quant, Shape shape, int block_size, float scale,
           int window)
      : mx::UnaryPrimitive(stream), eps_(eps), quant_(std::move(quant)), shape_(shape), block_size_(block_size),
        scale_(scale), window_(window) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    const int T = inputs[7].shape(0);
    const int Dm = inputs[7].shape(1);
    const int I = inputs[15].shape(1) * (32 / quant_[5]);  // down_proj's input features
    AttentionArgs attn{nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, T,
                       shape_.H, shape_.D, shape_.n_kv, inputs[3].shape(1), block_size_, window_, scale_, 0.0f,
                       static_cast<size_t>(shape_.width()), kv_type(inputs[1])};
    encoder.dispatch([attn, attention = AttentionInputs(inputs), x = Input<float>(inputs[7]),
                      o = AffineWeights(inputs[8], inputs[9], inputs[10], quant_[0], quant_[1]),
                      norm = Input<float>(inputs[11]),
                      gate_up = AffineWeights(inputs[12], inputs[13], inputs[14], quant_[2], quant_[3]),
                      down = AffineWeights(inputs[15], inputs[16], inputs[17], quant_[4], quant_[5]),
                      op = out.data<float>(), T, Dm, I, eps = eps_]() mutable {
      std::vector<float> x_s, n_s;
      AffineWeights::Scratch w_s;
      const size_t HD = static_cast<size_t>(attn.H) * attn.D;
      const Buffer<float> heads(T * HD);
      attn.out = heads.get();
      attention.attend(attn);
      // h = x + o_proj(heads), written straight into the output, which then receives h + mlp(h).
      const Buffer<float> tmp(static_cast<size_t>(T) * std::max(Dm, 2 * I));
      affine_product(heads.get(), T, static_cast<int>(HD), o.view(w_s), tmp.get());
      const float* xp = x.rows(x_s);
      const size_t n = static_cast<size_t>(T) * Dm;
      for (size_t i = 0; i < n; ++i) op[i] = xp[i] + tmp.get()[i];
      const Buffer<float> normed(n);
      rms_norm_rows(op, norm.rows(n_s), normed.get(), T, Dm, eps, false);
      affine_product(normed.get(), T, Dm, gate_up.view(w_s), tmp.get());
      const Buffer<float> act(static_cast<size_t>(T) * I);
      silu_gate(tmp.get(), T, I, act.get());
      affine_product(act.get(), T, I, down.view(w_s), tmp.get());
      for (size_t i = 0; i < n; ++i) op[i] += tmp.get()[i];
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("BlockOut is a CPU kernel");
  }

  const char* name() const override { return "NativeBlockOut"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const BlockOut&>(other);
    return eps_ == o.eps_ && quant_ == o.quant_ && shape_.H == o.shape_.H && shape_.n_kv == o.shape_.n_kv &&
           shape_.D == o.shape_.D && block_size_ == o.block_size_ && scale_ == o.scale_ && window_ == o.window_;
  }

 private:
  float eps_;
  std::vector<int> quant_;  // group, bits of o_proj, gate/up, down_proj
  Shape shape_;
  int block_size_;
  float scale_;
  int window_;
};

void check_f32(const mx::array& a, const char* what) {
  if (a.dtype() != mx::float32) throw std::invalid_argument(std::string("decoder block: ") + what + " must be float32");
}

}  // namespace

mx::array block_qkv(const mx::array& x, const mx::array& norm_weight, float eps, const mx::array& w,
                    const mx::array& scales, const mx::array& biases, int group_size, int bits,
                    const std::optional<mx::array>& bias, const mx::array& cos, const mx::array& sin, int n_heads,
                    int n_kv_heads, int head_dim, int rope_dims, const std::optional<mx::array>& q_norm,
                    const std::optional<mx::array>& k_norm, float qk_eps) {
  check_f32(x, "x");
  check_f32(norm_weight, "the norm weight");
  check_f32(cos, "cos");
  check_f32(sin, "sin");
  if (x.ndim() != 2 || norm_weight.ndim() != 1 || norm_weight.shape(0) != x.shape(1)) {
    throw std::invalid_argument("block_qkv: x must be [T, D] and the norm weight [D]");
  }
  const Shape shape{n_heads, n_kv_heads, head_dim};
  check_affine(w, scales, biases, x.shape(1), group_size, bits);
  if (w.shape(0) != shape.width() || n_heads % n_kv_heads != 0 || rope_dims % 2 != 0 || rope_dims > head_dim ||
      cos.size() != static_cast<size_t>(x.shape(0)) * (rope_dims / 2) || sin.size() != cos.size()) {
    throw std::invalid_argument("block_qkv: the q/k/v rows, head counts and RoPE tables do not match");
  }
  std::vector<mx::array> inputs{x, norm_weight, w, scales, biases, cos, sin};
  if (bias) {
    check_f32(*bias, "the q/k/v bias");
    if (bias->ndim() != 1 || bias->shape(0) != shape.width()) throw std::invalid_argument("block_qkv: bias shape");
    inputs.push_back(*bias);
  }
  if (q_norm.has_value() != k_norm.has_value()) throw std::invalid_argument("block_qkv: q_norm needs k_norm");
  if (q_norm) {
    check_f32(*q_norm, "q_norm");
    check_f32(*k_norm, "k_norm");
    if (q_norm->ndim() != 1 || q_norm->shape(0) != head_dim || k_norm->shape() != q_norm->shape()) {
      throw std::invalid_argument("block_qkv: q_norm and k_norm must be [head_dim]");
    }
    inputs.push_back(*q_norm);
    inputs.push_back(*k_norm);
  }
  const mx::Stream s = mx::default_stream(mx::Device::cpu);
  return mx::array({x.shape(0), shape.width()}, mx::float32,
                   std::make_shared<BlockQKV>(s, eps, group_size, bits, shape, rope_dims, bias.has_value(),
                                              q_norm.has_value(), qk_eps),
                   std::move(inputs));
}

mx::array block_out(const mx::array& qkv, const mx::array& key_pool, const mx::array& value_pool,
                    const mx::array& block_tables, const mx::array& context_lens, const mx::array& positions,
                    const mx::array& token_seq, int block_size, float scale, int window, const mx::array& x,
                    const std::vector<mx::array>& o_proj, const mx::array& norm_weight, float eps,
                    const std::vector<mx::array>& gate_up, const std::vector<mx::array>& down_proj,
                    const std::vector<int>& quant, int n_heads, int n_kv_heads, int head_dim) {
  const Shape shape{n_heads, n_kv_heads, head_dim};
  check_f32(qkv, "qkv");
  check_f32(x, "x");
  check_f32(norm_weight, "the norm weight");
  if (o_proj.size() != 3 || gate_up.size() != 3 || down_proj.size() != 3 || quant.size() != 6) {
    throw std::invalid_argument("block_out: each layer is (weight, scales, biases), quant 3 x (group, bits)");
  }
  if (qkv.ndim() != 2 || qkv.shape(1) != shape.width() || x.ndim() != 2 || x.shape(0) != qkv.shape(0) ||
      key_pool.ndim() != 3 || key_pool.shape(1) != n_kv_heads || kv_head_dim(key_pool) != head_dim ||
      value_pool.shape() != key_pool.shape() || value_pool.dtype() != key_pool.dtype() || head_dim % 8 != 0 || n_heads % n_kv_heads != 0 ||
      norm_weight.ndim() != 1 || norm_weight.shape(0) != x.shape(1)) {
    throw std::invalid_argument("block_out: qkv [T, (H + 2 n_kv) D], pools [slots, n_kv, D] and x [T, D] do not match");
  }
  const int Dm = x.shape(1);
  check_affine(o_proj[0], o_proj[1], o_proj[2], n_heads * head_dim, quant[0], quant[1]);
  check_affine(gate_up[0], gate_up[1], gate_up[2], Dm, quant[2], quant[3]);
  const int I = gate_up[0].shape(0) / 2;
  check_affine(down_proj[0], down_proj[1], down_proj[2], I, quant[4], quant[5]);
  if (o_proj[0].shape(0) != Dm || down_proj[0].shape(0) != Dm || gate_up[0].shape(0) != 2 * I) {
    throw std::invalid_argument("block_out: o_proj, gate/up and down_proj shapes do not match the hidden size");
  }
  const mx::Stream s = mx::default_stream(mx::Device::cpu);
  auto i32 = [&](const mx::array& a) { return mx::astype(a, mx::int32, s); };
  return mx::array(x.shape(), mx::float32,
                   std::make_shared<BlockOut>(s, eps, quant, shape, block_size, scale, window),
                   {qkv, key_pool, value_pool, i32(block_tables), i32(context_lens), i32(positions), i32(token_seq), x,
                    o_proj[0], o_proj[1], o_proj[2], norm_weight, gate_up[0], gate_up[1], gate_up[2], down_proj[0],
                    down_proj[1], down_proj[2]});
}

}  // namespace mlx_infer
