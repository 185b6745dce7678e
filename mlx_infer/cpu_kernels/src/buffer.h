// Scratch memory a kernel writes in full before reading: not zeroed, unlike std::vector's, whose
// zeroing of a decode step's per-layer scratch (norms, heads, products) showed as 2-3% of a batch-16
// step in memset alone.
#pragma once

#include <cstddef>
#include <memory>

namespace mlx_infer {

template <typename T>
struct Buffer {
  std::unique_ptr<T[]> data;
  explicit Buffer(size_t n) : data(n ? new T[n] : nullptr) {}
  T* get() const { return data.get(); }
};

}  // namespace mlx_infer
