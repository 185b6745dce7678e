// Llama-style decoder blocks as one primitive: one block (NativeLayer's call), or a model's whole stack
// of them a step (run_layers), whose output feeds the next block inside the op.
//
// Op by op, a block is ~20 MLX graph nodes (norms, products, splits, reshapes, RoPE, KV writes,
// attention, residual adds, the gate); on MLX's CPU backend each node costs microseconds of
// scheduling and each thread-pool product a wake-up, so at decode, where the whole block reads
// ~3.5 MB of weights in ~0.4 ms, that fixed cost was as large as the work. Here the block's work runs
// in the kernels the single ops use (same arithmetic, same order), called back to back:
//   RMSNorm -> fused q/k/v product (+ bias) -> RoPE on q and k, one [T, (H + 2 n_kv) D] buffer;
//   its K and V parts stored into their pools (kv_write's store_kv_rows);
//   attention of the q part -> o_proj -> + x -> RMSNorm -> gate/up -> SiLU gate -> down -> + h.
//
// The weights are bound once (NativeLayer, row-contiguous and computed): a step's op takes only the
// step's arrays as inputs, so the per-op costs that grow with the inputs (MLX's bookkeeping of each
// input's buffer, the views the task reads) are paid for 8 arrays rather than 24.
//
// The pools are the engine's KV memory, written in place: the op holds them as members, not inputs, and
// its pool outputs are the same buffers. (Writing in place only where nothing else held a pool, as MLX
// donates, does not work for a multi-output op: as an input, each of its outputs holds the pool; as a
// member, MLX's CPU eval keeps the previous step's pool outputs' buffers until that step's task has
// run, so the check failed whenever the host ran ahead, and every layer then copied both pools every
// step.) So a pool array is a handle, not a value: an earlier array of a pool reads the rows written
// since, as the pages the KV manager gives back (kv/pages.py) are dropped in place. Not being inputs,
// the pools are brought to a settled state when the op is built: computed, or being computed by a task
// on this op's stream (ahead of it in the stream's order).

#include "decoder_block.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "buffer.h"
#include "kv_format.h"
#include "kv_write.h"
#include "norm_rope.h"
#include "paged_attention.h"
#include "quantized_matvec.h"
#include "simd.h"
#include "strided.h"
#include "thread_pool.h"

namespace mx = mlx::core;

namespace mlx_infer {

struct LayerShape {
  int H, n_kv, D;
  int width() const { return (H + 2 * n_kv) * D; }
};

// The weights as the kernels read them: every array row-contiguous and computed, held here.
struct LayerWeights {
  std::vector<mx::array> arrays;
  const float *norm, *bias, *q_norm, *k_norm, *post_norm;
  AffineView qkv, o, gate_up, down;
  float eps, qk_eps, post_eps, scale;
  int window, rope_dims, hidden, intermediate;
  LayerShape shape;

  // The pointer to a's data once it is kept in `arrays` row-contiguous and computed.
  template <typename T>
  const T* keep(const mx::array& a) {
    mx::array kept = a.flags().row_contiguous ? a : mx::contiguous(a);
    mx::eval({kept});
    arrays.push_back(kept);
    return kept.data<T>();
  }

  AffineView keep_affine(const std::vector<mx::array>& layer, int group, int bits) {
    const bool half = layer[1].dtype() == mx::float16;
    return {keep<uint32_t>(layer[0]), {keep<void>(layer[1]), half}, {keep<void>(layer[2]), half}, layer[0].shape(0),
            group, bits};
  }
};

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

// The inputs of a step's op, in order.
enum Inputs : int { kX, kCos, kSin, kSlots, kTables, kLens, kPositions, kSeqs };

// A layer's buffers for T tokens, carved from one CountedBuffer a step (buffer.h): `normed` [T, D],
// `qkv` [T, W], `heads` [T, H * D], `tmp` [T, max(D, 2 I)], `act` [T, I].
struct LayerScratch {
  float *normed, *qkv, *heads, *tmp, *act;

  // The floats each part takes for T tokens of the widest of `layers`, each part a whole number of
  // cache lines.
  static std::array<size_t, 5> sizes(const std::vector<std::shared_ptr<const LayerWeights>>& layers, int T) {
    std::array<size_t, 5> most{};
    for (const auto& lw : layers) {
      const size_t Dm = lw->hidden, I = lw->intermediate, HD = static_cast<size_t>(lw->shape.H) * lw->shape.D;
      const std::array<size_t, 5> here{Dm, static_cast<size_t>(lw->shape.width()), HD, std::max(Dm, 2 * I), I};
      for (size_t i = 0; i < here.size(); ++i) most[i] = std::max(most[i], (T * here[i] + 15) / 16 * 16);
    }
    return most;
  }

  LayerScratch(float* at, const std::array<size_t, 5>& sizes) {
    float** parts[] = {&normed, &qkv, &heads, &tmp, &act};
    for (size_t i = 0; i < sizes.size(); ++i) {
      *parts[i] = at;
      at += sizes[i];
    }
  }
};

// qkv [T, W] = RoPE(q/k norms(RMSNorm(x) @ w + bias)): q heads, then k heads, then v heads.
void qkv_rows(const float* x, int T, int Dm, const float* norm, float eps, const AffineView& w, const float* bias,
              const float* q_norm, const float* k_norm, float qk_eps, const float* cos, const float* sin, LayerShape shape,
              int rope_dims, float* normed, float* qkv) {
  rms_norm_rows(x, norm, normed, T, Dm, eps, false);
  const int W = shape.width();
  affine_product(normed, T, Dm, w, qkv);
  if (bias) {
    for (int t = 0; t < T; ++t) {
      for (int i = 0; i < W; ++i) qkv[static_cast<size_t>(t) * W + i] += bias[i];
    }
  }
  float* k = qkv + static_cast<size_t>(shape.H) * shape.D;
  if (q_norm) {  // Qwen3: RMSNorm over each q and k head, before RoPE
    for (int t = 0; t < T; ++t) {
      float* q_row = qkv + static_cast<size_t>(t) * W;
      rms_norm_rows(q_row, q_norm, q_row, shape.H, shape.D, qk_eps, false);
      float* k_row = k + static_cast<size_t>(t) * W;
      rms_norm_rows(k_row, k_norm, k_row, shape.n_kv, shape.D, qk_eps, false);
    }
  }
  rope_rows(qkv, W, qkv, W, T, shape.H, shape.D, rope_dims, cos, sin);
  rope_rows(k, W, k, W, T, shape.n_kv, shape.D, rope_dims, cos, sin);
}

// out [T, Dm] = h + down(silu(gate) * up)(RMSNorm(h)), h = x + o_proj(attention as attn describes it).
void out_rows(AttentionArgs attn, const float* x, int T, int Dm, int I, const AffineView& o, const float* norm,
              float eps, const AffineView& gate_up, const AffineView& down, const LayerScratch& scratch, float* out) {
  const size_t HD = static_cast<size_t>(attn.H) * attn.D;
  attn.out = scratch.heads;
  attend_all(attn);
  // h = x + o_proj(heads), written straight into the output, which then receives h + mlp(h).
  float* tmp = scratch.tmp;
  affine_product(scratch.heads, T, static_cast<int>(HD), o, tmp);
  const size_t n = static_cast<size_t>(T) * Dm;
  for (size_t i = 0; i < n; ++i) out[i] = x[i] + tmp[i];
  rms_norm_rows(out, norm, scratch.normed, T, Dm, eps, false);
  affine_product(scratch.normed, T, Dm, gate_up, tmp);
  silu_gate(tmp, T, I, scratch.act);
  affine_product(scratch.act, T, I, down, tmp);
  for (size_t i = 0; i < n; ++i) out[i] += tmp[i];
}

// The step's arrays as the layers read them (strided ones copied into rows once).
struct StepRows {
  std::vector<float> x_s, c_s, s_s;
  std::vector<int32_t> slot_s, t_s, l_s, p_s, q_s;
  const float *x, *cos, *sin;
  const int32_t *slots, *tables, *lens, *positions, *seqs;

  explicit StepRows(const std::vector<Input<float>>& f, const std::vector<Input<int32_t>>& i)
      : x(f[0].rows(x_s)), cos(f[1].rows(c_s)), sin(f[2].rows(s_s)), slots(i[0].rows(slot_s)),
        tables(i[1].rows(t_s)), lens(i[2].rows(l_s)), positions(i[3].rows(p_s)), seqs(i[4].rows(q_s)) {}
};

// The step's float inputs (x, cos, sin) and int32 ones (slots, tables, lens, positions, seqs), in order.
std::pair<std::vector<Input<float>>, std::vector<Input<int32_t>>> step_inputs(const std::vector<mx::array>& inputs) {
  return {{Input<float>(inputs[kX]), Input<float>(inputs[kCos]), Input<float>(inputs[kSin])},
          {Input<int32_t>(inputs[kSlots]), Input<int32_t>(inputs[kTables]), Input<int32_t>(inputs[kLens]),
           Input<int32_t>(inputs[kPositions]), Input<int32_t>(inputs[kSeqs])}};
}

// Attention's arguments for one layer of a step, on its pools (the outputs sharing their buffers).
AttentionArgs attention_args(const LayerWeights& lw, const std::vector<mx::array>& inputs, int block_size,
                             const mx::array& keys, const mx::array& values) {
  const LayerShape sh = lw.shape;
  return {nullptr, keys.data<uint8_t>(), values.data<uint8_t>(), nullptr, nullptr, nullptr, nullptr, nullptr,
          nullptr, inputs[kX].shape(0), sh.H, sh.D, sh.n_kv, inputs[kTables].shape(1), block_size, lw.window,
          lw.scale, 0.0f, static_cast<size_t>(sh.width()), kv_type(keys)};
}

// One layer of a step: out [T, D] = the block of x, its K/V rows written into attn's pools.
void layer_step(const LayerWeights& lw, AttentionArgs attn, const StepRows& in, const LayerScratch& scratch,
                const float* x, float* out) {
  const LayerShape sh = lw.shape;
  const int T = attn.T, W = sh.width();
  float* qkv = scratch.qkv;
  qkv_rows(x, T, lw.hidden, lw.norm, lw.eps, lw.qkv, lw.bias, lw.q_norm, lw.k_norm, lw.qk_eps, in.cos, in.sin, sh,
           lw.rope_dims, scratch.normed, qkv);
  const size_t k_column = static_cast<size_t>(sh.H) * sh.D;
  const size_t v_column = k_column + static_cast<size_t>(sh.n_kv) * sh.D;
  store_kv_rows(qkv + k_column, W, in.slots, T, attn.kv_type, sh.n_kv, sh.D, const_cast<uint8_t*>(attn.keys));
  store_kv_rows(qkv + v_column, W, in.slots, T, attn.kv_type, sh.n_kv, sh.D, const_cast<uint8_t*>(attn.values));
  attn.q = qkv;
  attn.block_tables = in.tables;
  attn.context_lens = in.lens;
  attn.positions = in.positions;
  attn.token_seq = in.seqs;
  out_rows(attn, x, T, lw.hidden, lw.intermediate, lw.o, lw.post_norm, lw.post_eps, lw.gate_up, lw.down, scratch,
           out);
}

// Blocks one after another as one primitive: outputs [out, key pool 0, value pool 0, key pool 1, ...], each
// pool written in place (see the top). One layer is the stack of one; a whole model's stack is one op a step
// rather than one a layer, whose scheduling (on the host thread) and dispatch were each paid 30 times.
class LayerStack : public mx::Primitive {
 public:
  LayerStack(mx::Stream stream, std::vector<std::shared_ptr<const LayerWeights>> weights, int block_size,
             std::vector<mx::array> key_pools, std::vector<mx::array> value_pools)
      : mx::Primitive(stream), weights_(std::move(weights)), block_size_(block_size),
        key_pools_(std::move(key_pools)), value_pools_(std::move(value_pools)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    mx::array& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    std::vector<AttentionArgs> attn;
    attn.reserve(weights_.size());
    for (size_t i = 0; i < weights_.size(); ++i) {
      outputs[1 + 2 * i].copy_shared_buffer(key_pools_[i]);  // written in place (see the top)
      outputs[2 + 2 * i].copy_shared_buffer(value_pools_[i]);
      attn.push_back(attention_args(*weights_[i], inputs, block_size_, outputs[1 + 2 * i], outputs[2 + 2 * i]));
    }
    for (auto& o : outputs) encoder.set_output_array(o);
    auto [floats, ints] = step_inputs(inputs);
    encoder.dispatch([attn = std::move(attn), weights = weights_, floats = std::move(floats), ints = std::move(ints),
                      op = out.data<float>(), size = out.size()]() {
      const StepRows in(floats, ints);
      // One buffer a step for every layer's scratch, and for the two outputs the layers between the first
      // and the last write in turn.
      const size_t layers = weights.size(), lines = (size + 15) / 16 * 16;
      const std::array<size_t, 5> parts = LayerScratch::sizes(weights, attn[0].T);
      const size_t used = std::accumulate(parts.begin(), parts.end(), size_t{0});
      const CountedBuffer<float> step(used + std::min<size_t>(layers - 1, 2) * lines);
      const LayerScratch scratch(step.get(), parts);
      float* between[2] = {step.get() + used, step.get() + used + lines};
      const float* x = in.x;
      for (size_t i = 0; i < layers; ++i) {
        float* y = i + 1 == layers ? op : between[i % 2];
        layer_step(*weights[i], attn[i], in, scratch, x, y);
        x = y;
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("NativeDecoderStack is a CPU kernel");
  }

  const char* name() const override { return "NativeDecoderStack"; }

 private:
  std::vector<std::shared_ptr<const LayerWeights>> weights_;
  int block_size_;
  std::vector<mx::array> key_pools_, value_pools_;
};

void check_f32(const mx::array& a, const char* what) {
  if (a.dtype() != mx::float32) throw std::invalid_argument(std::string("NativeLayer: ") + what + " must be float32");
}

// Brings a pool to where an op on stream s may use it with no input edge: computed, or scheduled by a
// task on s (which runs before anything enqueued on s later); else computes it and waits.
void settle(const mx::array& pool, const mx::Stream& s) {
  if (pool.is_available()) return;
  if (pool.status() == mx::array::Status::evaluated && pool.event().valid() && pool.event().stream() == s) return;
  mx::array held = pool;
  if (held.status() == mx::array::Status::unscheduled) mx::eval({held});
  held.wait();
}

// Checks a step's arrays against one layer, and brings its pools to a settled state on stream s.
void check_step(const LayerWeights& lw, const mx::array& x, const mx::array& key_pool, const mx::array& value_pool,
                const mx::array& cos, const mx::array& sin, const mx::array& slot_mapping,
                const mx::array& block_tables, const mx::array& context_lens, const mx::array& positions,
                const mx::array& token_seq, const mx::Stream& s) {
  const LayerShape shape = lw.shape;
  check_f32(x, "x");
  check_f32(cos, "cos");
  check_f32(sin, "sin");
  if (x.ndim() != 2 || x.shape(1) != lw.hidden) throw std::invalid_argument("NativeLayer: x must be [T, D]");
  const int T = x.shape(0);
  if (cos.size() != static_cast<size_t>(T) * (lw.rope_dims / 2) || sin.size() != cos.size()) {
    throw std::invalid_argument("NativeLayer: the RoPE tables must be [T, 1, rope_dims / 2]");
  }
  if (key_pool.ndim() != 3 || key_pool.shape(1) != shape.n_kv || kv_head_dim(key_pool) != shape.D ||
      value_pool.shape() != key_pool.shape() || value_pool.dtype() != key_pool.dtype() ||
      key_pool.id() == value_pool.id()) {
    throw std::invalid_argument("NativeLayer: the K and V pools must be two [slots, n_kv, head_dim] arrays of one dtype");
  }
  if (slot_mapping.ndim() != 1 || slot_mapping.shape(0) != T || token_seq.size() != static_cast<size_t>(T) ||
      positions.size() != static_cast<size_t>(T) || block_tables.ndim() != 2 ||
      context_lens.size() != static_cast<size_t>(block_tables.shape(0))) {
    throw std::invalid_argument("NativeLayer: slot_mapping, positions, token_seq [T], block_tables [B, blocks], context_lens [B]");
  }
  settle(key_pool, s);
  settle(value_pool, s);
  if (!key_pool.flags().row_contiguous || !value_pool.flags().row_contiguous) {
    throw std::invalid_argument("NativeLayer: the K and V pools must be row-contiguous (written in place)");
  }
}

}  // namespace

NativeLayer::NativeLayer(const mx::array& norm_weight, float eps, const std::vector<mx::array>& qkv, int group_size,
                         int bits, const std::optional<mx::array>& bias, int n_heads, int n_kv_heads, int head_dim,
                         int rope_dims, const std::optional<mx::array>& q_norm, const std::optional<mx::array>& k_norm,
                         float qk_eps, float scale, int window, const std::vector<mx::array>& o_proj,
                         const mx::array& post_norm_weight, float post_eps, const std::vector<mx::array>& gate_up,
                         const std::vector<mx::array>& down_proj, const std::vector<int>& quant) {
  const LayerShape shape{n_heads, n_kv_heads, head_dim};
  check_f32(norm_weight, "the norm weight");
  check_f32(post_norm_weight, "the post-attention norm weight");
  if (norm_weight.ndim() != 1 || post_norm_weight.shape() != norm_weight.shape()) {
    throw std::invalid_argument("NativeLayer: the norm weights must be [D]");
  }
  const int Dm = norm_weight.shape(0);
  if (qkv.size() != 3 || o_proj.size() != 3 || gate_up.size() != 3 || down_proj.size() != 3 || quant.size() != 6) {
    throw std::invalid_argument("NativeLayer: each layer is (weight, scales, biases), quant 3 x (group, bits)");
  }
  check_affine(qkv[0], qkv[1], qkv[2], Dm, group_size, bits);
  if (qkv[0].shape(0) != shape.width() || n_kv_heads <= 0 || n_heads % n_kv_heads != 0 || head_dim % 8 != 0 ||
      rope_dims % 2 != 0 || rope_dims > head_dim) {
    throw std::invalid_argument("NativeLayer: the q/k/v rows, head counts and RoPE dimensions do not match");
  }
  check_affine(o_proj[0], o_proj[1], o_proj[2], n_heads * head_dim, quant[0], quant[1]);
  check_affine(gate_up[0], gate_up[1], gate_up[2], Dm, quant[2], quant[3]);
  const int I = gate_up[0].shape(0) / 2;
  check_affine(down_proj[0], down_proj[1], down_proj[2], I, quant[4], quant[5]);
  if (o_proj[0].shape(0) != Dm || down_proj[0].shape(0) != Dm || gate_up[0].shape(0) != 2 * I) {
    throw std::invalid_argument("NativeLayer: o_proj, gate/up and down_proj shapes do not match the hidden size");
  }
  if (bias) {
    check_f32(*bias, "the q/k/v bias");
    if (bias->ndim() != 1 || bias->shape(0) != shape.width()) throw std::invalid_argument("NativeLayer: bias shape");
  }
  if (q_norm.has_value() != k_norm.has_value()) throw std::invalid_argument("NativeLayer: q_norm needs k_norm");
  if (q_norm) {
    check_f32(*q_norm, "q_norm");
    check_f32(*k_norm, "k_norm");
    if (q_norm->ndim() != 1 || q_norm->shape(0) != head_dim || k_norm->shape() != q_norm->shape()) {
      throw std::invalid_argument("NativeLayer: q_norm and k_norm must be [head_dim]");
    }
  }
  auto w = std::make_shared<LayerWeights>();
  w->norm = w->keep<float>(norm_weight);
  w->qkv = w->keep_affine(qkv, group_size, bits);
  w->bias = bias ? w->keep<float>(*bias) : nullptr;
  w->q_norm = q_norm ? w->keep<float>(*q_norm) : nullptr;
  w->k_norm = k_norm ? w->keep<float>(*k_norm) : nullptr;
  w->o = w->keep_affine(o_proj, quant[0], quant[1]);
  w->post_norm = w->keep<float>(post_norm_weight);
  w->gate_up = w->keep_affine(gate_up, quant[2], quant[3]);
  w->down = w->keep_affine(down_proj, quant[4], quant[5]);
  w->eps = eps;
  w->qk_eps = qk_eps;
  w->post_eps = post_eps;
  w->scale = scale;
  w->window = window;
  w->rope_dims = rope_dims;
  w->hidden = Dm;
  w->intermediate = I;
  w->shape = shape;
  weights_ = std::move(w);
}

std::vector<mx::array> run_layers(const std::vector<const NativeLayer*>& layers, const mx::array& x,
                                  const std::vector<mx::array>& key_pools, const std::vector<mx::array>& value_pools,
                                  const mx::array& cos, const mx::array& sin, const mx::array& slot_mapping,
                                  const mx::array& block_tables, const mx::array& context_lens,
                                  const mx::array& positions, const mx::array& token_seq, int block_size) {
  if (layers.empty() || key_pools.size() != layers.size() || value_pools.size() != layers.size()) {
    throw std::invalid_argument("run_layers: at least one layer, and one key pool and one value pool a layer");
  }
  const mx::Stream s = mx::default_stream(mx::Device::cpu);
  std::vector<std::shared_ptr<const LayerWeights>> weights;
  std::vector<mx::Shape> shapes{x.shape()};
  std::vector<mx::Dtype> dtypes{mx::float32};
  for (size_t i = 0; i < layers.size(); ++i) {
    weights.push_back(layers[i]->weights());
    check_step(*weights.back(), x, key_pools[i], value_pools[i], cos, sin, slot_mapping, block_tables, context_lens,
               positions, token_seq, s);
    for (const mx::array& pool : {key_pools[i], value_pools[i]}) {
      shapes.push_back(pool.shape());
      dtypes.push_back(pool.dtype());
    }
  }
  auto i32 = [&](const mx::array& a) { return mx::astype(a, mx::int32, s); };
  return mx::array::make_arrays(
      std::move(shapes), dtypes, std::make_shared<LayerStack>(s, std::move(weights), block_size, key_pools, value_pools),
      {x, cos, sin, i32(slot_mapping), i32(block_tables), i32(context_lens), i32(positions), i32(token_seq)});
}

std::vector<mx::array> NativeLayer::operator()(const mx::array& x, const mx::array& key_pool,
                                                const mx::array& value_pool, const mx::array& cos,
                                                const mx::array& sin, const mx::array& slot_mapping,
                                                const mx::array& block_tables, const mx::array& context_lens,
                                                const mx::array& positions, const mx::array& token_seq,
                                                int block_size) const {
  return run_layers({this}, x, {key_pool}, {value_pool}, cos, sin, slot_mapping, block_tables, context_lens,
                    positions, token_seq, block_size);
}

}  // namespace mlx_infer
