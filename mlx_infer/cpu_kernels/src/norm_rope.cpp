// RMSNorm and RoPE as one primitive each. On MLX's CPU backend these small elementwise chains are
// several graph nodes apiece (square, sum, size, a compiled tail; slices, a compiled rotation and a
// concatenation) and a decode step runs them ~120 times: the fixed cost per node, not the
// arithmetic, is what they cost. The work is a few thousand floats, so no thread pool.

#include "norm_rope.h"

#include <cmath>
#include <stdexcept>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "strided.h"

namespace mx = mlx::core;

namespace mlx_infer {

void rms_norm_rows(const float* x, const float* w, float* out, size_t rows, int D, float eps, bool offset) {
  for (size_t r = 0; r < rows; ++r) {
    const float* row = x + r * D;
    float sum = 0.0f;
    for (int d = 0; d < D; ++d) sum += row[d] * row[d];
    const float inv = 1.0f / std::sqrt(sum / D + eps);
    float* o = out + r * D;
    for (int d = 0; d < D; ++d) o[d] = row[d] * inv * (offset ? 1.0f + w[d] : w[d]);
  }
}

void rope_rows(const float* x, size_t x_stride, float* out, size_t out_stride, int T, int H, int D, int dims,
               const float* cos, const float* sin) {
  const int half = dims / 2;
  for (int t = 0; t < T; ++t) {
    const float* c = cos + static_cast<size_t>(t) * half;
    const float* s = sin + static_cast<size_t>(t) * half;
    for (int h = 0; h < H; ++h) {
      const float* in = x + t * x_stride + static_cast<size_t>(h) * D;
      float* o = out + t * out_stride + static_cast<size_t>(h) * D;
      for (int i = 0; i < half; ++i) {
        // The order of MLX's reference: x1 * cos - x2 * sin, x1 * sin + x2 * cos. Both halves are
        // read before either is written, so out may be x (in place).
        const float x1 = in[i];
        const float x2 = in[half + i];
        o[i] = x1 * c[i] - x2 * s[i];
        o[half + i] = x1 * s[i] + x2 * c[i];
      }
      if (o != in) {
        for (int i = dims; i < D; ++i) o[i] = in[i];
      }
    }
  }
}

namespace {

class RMSNorm : public mx::UnaryPrimitive {
 public:
  RMSNorm(mx::Stream stream, float eps, bool offset) : mx::UnaryPrimitive(stream), eps_(eps), offset_(offset) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    const int D = out.shape(-1);
    const size_t rows = out.size() / D;
    encoder.dispatch([x = Input<float>(inputs[0]), w = Input<float>(inputs[1]), op = out.data<float>(), D, rows,
                      eps = eps_, offset = offset_]() {
      std::vector<float> x_s, w_s;
      const float* xp = x.rows(x_s);
      const float* wp = w.rows(w_s);
      rms_norm_rows(xp, wp, op, rows, D, eps, offset);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("RMSNorm is a CPU kernel");
  }

  const char* name() const override { return "NativeRMSNorm"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const RMSNorm&>(other);
    return eps_ == o.eps_ && offset_ == o.offset_;
  }

 private:
  float eps_;
  bool offset_;
};

class RoPE : public mx::UnaryPrimitive {
 public:
  RoPE(mx::Stream stream, int dims) : mx::UnaryPrimitive(stream), dims_(dims) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    const int T = out.shape(0);
    const int H = out.shape(1);
    const int D = out.shape(2);
    encoder.dispatch([x = Input<float>(inputs[0]), c = Input<float>(inputs[1]), s = Input<float>(inputs[2]),
                      op = out.data<float>(), T, H, D, dims = dims_]() {
      std::vector<float> x_s, c_s, s_s;
      const float* xp = x.rows(x_s);
      const float* cp = c.rows(c_s);
      const float* sp = s.rows(s_s);
      rope_rows(xp, static_cast<size_t>(H) * D, op, static_cast<size_t>(H) * D, T, H, D, dims, cp, sp);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("RoPE is a CPU kernel");
  }

  const char* name() const override { return "NativeRoPE"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return dims_ == static_cast<const RoPE&>(other).dims_;
  }

 private:
  int dims_;
};

}  // namespace

mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps, bool offset) {
  if (x.dtype() != mx::float32 || weight.dtype() != mx::float32) {
    throw std::invalid_argument("rms_norm: x and weight must be float32");
  }
  if (x.ndim() < 1 || weight.ndim() != 1 || weight.shape(0) != x.shape(-1)) {
    throw std::invalid_argument("rms_norm: weight must be [D] for x [..., D]");
  }
  const mx::Stream s = mx::default_stream(mx::Device::cpu);
  return mx::array(x.shape(), mx::float32, std::make_shared<RMSNorm>(s, eps, offset), {x, weight});
}

mx::array rope(const mx::array& x, const mx::array& cos, const mx::array& sin, int dims) {
  if (x.dtype() != mx::float32 || cos.dtype() != mx::float32 || sin.dtype() != mx::float32) {
    throw std::invalid_argument("rope: x and the tables must be float32");
  }
  if (x.ndim() != 3 || dims % 2 != 0 || dims > x.shape(2) || cos.size() != static_cast<size_t>(x.shape(0)) * (dims / 2) ||
      sin.size() != cos.size()) {
    throw std::invalid_argument("rope: x must be [T, H, D] and the tables hold T x dims/2 values");
  }
  const mx::Stream s = mx::default_stream(mx::Device::cpu);
  return mx::array(x.shape(), mx::float32, std::make_shared<RoPE>(s, dims), {x, cos, sin});
}

}  // namespace mlx_infer
