#include "kv_write.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "kv_format.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "strided.h"

namespace mx = mlx::core;

namespace mlx_infer {

namespace {

// The pool's current contents into `dst` when the write could not take its buffer over.
template <typename T>
void copy_pool(const mx::array& pool, uint8_t* dst) {
  std::vector<T> scratch;
  std::memcpy(dst, Input<T>(pool).rows(scratch), pool.nbytes());
}

// Rows of the pool's own dtype: the bytes moved as same-sized integers, a write copies.
template <typename T>
void copy_rows(const mx::array& rows, const int32_t* at, size_t n, size_t row_size, int column, uint8_t* dst) {
  std::vector<T> scratch;
  const T* src = Input<T>(rows).rows(scratch);
  const size_t src_stride = rows.size() / rows.shape(0);
  T* out = reinterpret_cast<T*>(dst);
  for (size_t t = 0; t < n; ++t) {
    std::memcpy(out + static_cast<size_t>(at[t]) * row_size, src + t * src_stride + column, row_size * sizeof(T));
  }
}

template <KVType K>
void store_rows(const float* src, size_t src_stride, const int32_t* at, size_t n, int n_kv, int D, uint8_t* dst) {
  const size_t head_bytes = kv_head_bytes(K, D);
  for (size_t t = 0; t < n; ++t) {
    uint8_t* slot = dst + static_cast<size_t>(at[t]) * n_kv * head_bytes;
    const float* row = src + t * src_stride;
    for (int h = 0; h < n_kv; ++h) store_row<K>(row + static_cast<size_t>(h) * D, slot + h * head_bytes, D);
  }
}

}  // namespace

void store_kv_rows(const float* rows, size_t row_stride, const int32_t* slots, size_t n, KVType type, int n_kv,
                   int D, uint8_t* pool) {
  switch (type) {
    case KVType::f32: store_rows<KVType::f32>(rows, row_stride, slots, n, n_kv, D, pool); break;
    case KVType::f16: store_rows<KVType::f16>(rows, row_stride, slots, n, n_kv, D, pool); break;
    case KVType::bf16: store_rows<KVType::bf16>(rows, row_stride, slots, n, n_kv, D, pool); break;
    case KVType::i8: store_rows<KVType::i8>(rows, row_stride, slots, n, n_kv, D, pool); break;
  }
}

namespace {

void write(const mx::array& pool, const mx::array& rows, const mx::array& slots, mx::array& out, bool donated,
           int column) {
  uint8_t* dst = out.data<uint8_t>();
  if (!donated) {
    if (pool.itemsize() == 4) copy_pool<uint32_t>(pool, dst);
    else if (pool.itemsize() == 2) copy_pool<uint16_t>(pool, dst);
    else copy_pool<uint8_t>(pool, dst);
  }
  std::vector<int32_t> slot_scratch;
  const int32_t* at = Input<int32_t>(slots).rows(slot_scratch);
  const size_t n = slots.size();
  const KVType type = kv_type(pool);
  const int n_kv = pool.shape(1), D = kv_head_dim(pool);
  if (rows.dtype() == pool.dtype()) {
    const size_t row_size = static_cast<size_t>(n_kv) * D;
    if (pool.itemsize() == 4) copy_rows<uint32_t>(rows, at, n, row_size, column, dst);
    else copy_rows<uint16_t>(rows, at, n, row_size, column, dst);
    return;
  }
  std::vector<float> scratch;  // float32 rows stored as the pool's type
  store_kv_rows(Input<float>(rows).rows(scratch) + column, rows.size() / rows.shape(0), at, n, type, n_kv, D, dst);
}

class KVWrite : public mx::UnaryPrimitive {
 public:
  KVWrite(mx::Stream stream, int column, bool in_place)
      : mx::UnaryPrimitive(stream), column_(column), in_place_(in_place) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array& pool = inputs[0];
    const bool donated = pool.flags().row_contiguous && (in_place_ || pool.is_donatable());
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
                      donated, column = column_]() mutable { write(pool, rows, slots, out, donated, column); });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("KVWrite is a CPU kernel");
  }

  const char* name() const override { return "NativeKVWrite"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const KVWrite&>(other);
    return column_ == o.column_ && in_place_ == o.in_place_;
  }

 private:
  int column_;
  bool in_place_;
};

}  // namespace

mx::array kv_write(const mx::array& pool, const mx::array& rows, const mx::array& slots, int column, bool in_place) {
  if (pool.ndim() != 3 || rows.ndim() < 2 || slots.ndim() != 1 || slots.shape(0) != rows.shape(0)) {
    throw std::invalid_argument("kv_write: pool [slots, n_kv, D], rows [T, ...] and slots [T]");
  }
  const KVType type = kv_type(pool);
  const int D = kv_head_dim(pool);
  const size_t row_size = static_cast<size_t>(pool.shape(1)) * D;
  const size_t width = rows.size() / std::max(1, rows.shape(0));
  if (column < 0 || column + row_size > width ||
      (rows.ndim() == 3 && (rows.shape(1) != pool.shape(1) || rows.shape(2) != D))) {
    throw std::invalid_argument("kv_write: each row of rows must hold n_kv * D values from column on");
  }
  const bool copies = rows.dtype() == pool.dtype() && type != KVType::i8;
  if (!copies && rows.dtype() != mx::float32) {
    throw std::invalid_argument("kv_write: rows must be float32 or the pool's own float dtype");
  }
  if (!copies && D % 8 != 0) throw std::invalid_argument("kv_write: converting rows needs D a multiple of 8");
  const mx::Stream s = mx::default_stream(mx::Device::cpu);
  return mx::array(pool.shape(), pool.dtype(), std::make_shared<KVWrite>(s, column, in_place),
                   {pool, rows, mx::astype(slots, mx::int32, s)});
}

}  // namespace mlx_infer
