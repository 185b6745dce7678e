// Greedy sampling's argmax over a step's logits, vectorized and split over the rows.
//
// MLX's CPU argmax compares one element at a time: ~0.9 ms for a batch-16 step's 16 x 49152 logits
// (SmolLM2), on one thread while the other core waits, ~3% of the step; this takes ~0.1 ms.

#include "argmax.h"

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "strided.h"
#include "thread_pool.h"

namespace mx = mlx::core;

namespace mlx_infer {

namespace {

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
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(inputs[0]);
    encoder.set_output_array(out);
    const int R = inputs[0].shape(0);
    const int V = inputs[0].shape(1);
    encoder.dispatch([x = Input<float>(inputs[0]), op = out.data<uint32_t>(), R, V]() {
      std::vector<float> x_s;
      const float* xp = x.rows(x_s);
      const auto rows = [&](int r0, int r1) {
        for (int r = r0; r < r1; ++r) op[r] = argmax_row(xp + static_cast<size_t>(r) * V, V);
      };
      if (R < 4) {  // a decode step of a few rows: not worth waking the pool for
        rows(0, R);
        return;
      }
      pool().for_range(R, 1, rows);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("ArgmaxRows is a CPU kernel");
  }

  const char* name() const override { return "NativeArgmaxRows"; }

  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

}  // namespace

mx::array argmax_rows(const mx::array& x) {
  if (x.dtype() != mx::float32 || x.ndim() != 2 || x.shape(1) == 0) {
    throw std::invalid_argument("argmax_rows: x must be float32 [rows, V] with V > 0");
  }
  return mx::array({x.shape(0)}, mx::uint32, std::make_shared<ArgmaxRows>(mx::default_stream(mx::Device::cpu)), {x});
}

}  // namespace mlx_infer
