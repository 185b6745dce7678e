#include "kv_write.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "strided.h"

namespace mx = mlx::core;

namespace mlx_infer {

namespace {

// The dtype's bytes moved as same-sized integers: a write copies, never converts.
template <typename T>
void write(const mx::array& pool, const mx::array& rows, const mx::array& slots, mx::array& out, bool donated,
           int column) {
  const size_t row_size = pool.size() / pool.shape(0);
  const size_t src_stride = rows.size() / rows.shape(0);
  T* dst = out.data<T>();
  if (!donated) {
    std::vector<T> scratch;
    std::memcpy(dst, Input<T>(pool).rows(scratch), pool.nbytes());
  }
  std::vector<T> row_scratch;
  std::vector<int32_t> slot_scratch;
  const T* src = Input<T>(rows).rows(row_scratch);
  const int32_t* at = Input<int32_t>(slots).rows(slot_scratch);
  for (size_t t = 0; t < slots.size(); ++t) {
    std::memcpy(dst + static_cast<size_t>(at[t]) * row_size, src + t * src_stride + column, row_size * sizeof(T));
  }
}

class KVWrite : public mx::UnaryPrimitive {
 public:
  KVWrite(mx::Stream stream, int column) : mx::UnaryPrimitive(stream), column_(column) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array& pool = inputs[0];
    const bool donated = pool.is_donatable() && pool.flags().row_contiguous;
    if (donated) {
      out.copy_shared_buffer(pool);
    } else {
      out.set_data(mx::allocator::malloc(out.nbytes()));
    }
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    encoder.dispatch([pool = mx::array::unsafe_weak_copy(pool), rows = mx::array::unsafe_weak_copy(inputs[1]),
                      slots = mx::array::unsafe_weak_copy(inputs[2]), out = mx::array::unsafe_weak_copy(out),
                      donated, column = column_]() mutable {
      if (out.itemsize() == 4) {
        write<uint32_t>(pool, rows, slots, out, donated, column);
      } else {
        write<uint16_t>(pool, rows, slots, out, donated, column);
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("KVWrite is a CPU kernel");
  }

  const char* name() const override { return "NativeKVWrite"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return column_ == static_cast<const KVWrite&>(other).column_;
  }

 private:
  int column_;
};

}  // namespace

mx::array kv_write(const mx::array& pool, const mx::array& rows, const mx::array& slots, int column) {
  if (pool.ndim() != 3 || rows.ndim() < 2 || slots.ndim() != 1 || slots.shape(0) != rows.shape(0)) {
    throw std::invalid_argument("kv_write: pool [slots, n_kv, D], rows [T, ...] and slots [T]");
  }
  const size_t row_size = static_cast<size_t>(pool.shape(1)) * pool.shape(2);
  const size_t width = rows.size() / std::max(1, rows.shape(0));
  if (column < 0 || column + row_size > width || (rows.ndim() == 3 && (rows.shape(1) != pool.shape(1) ||
                                                                       rows.shape(2) != pool.shape(2)))) {
    throw std::invalid_argument("kv_write: each row of rows must hold n_kv * D values from column on");
  }
  if (rows.dtype() != pool.dtype() || (pool.itemsize() != 4 && pool.itemsize() != 2)) {
    throw std::invalid_argument("kv_write: rows and pool must share one 2- or 4-byte dtype");
  }
  const mx::Stream s = mx::default_stream(mx::Device::cpu);
  return mx::array(pool.shape(), pool.dtype(), std::make_shared<KVWrite>(s, column),
                   {pool, rows, mx::astype(slots, mx::int32, s)});
}

}  // namespace mlx_infer
