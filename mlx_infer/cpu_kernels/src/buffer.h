// Scratch memory a kernel writes in full before reading: not zeroed, unlike std::vector's, whose
// zeroing of a decode step's per-layer scratch (norms, heads, products) showed as 2-3% of a batch-16
// step in memset alone.
//
// Buffer comes from the C++ heap. CountedBuffer comes from MLX's allocator, so that it counts in MLX's
// active and peak memory (what `mlx-infer plan` is checked against), aligned to a cache line within it
// (MLX's own buffers are aligned to 8 bytes). It is for the few large buffers a step holds: every scratch
// buffer taken from MLX's allocator (~660 a batch-1 SmolLM2 step) made the step 2-3% slower.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "mlx/allocator.h"

namespace mlx_infer {

template <typename T>
struct Buffer {
  std::unique_ptr<T[]> data;
  explicit Buffer(size_t n) : data(n ? new T[n] : nullptr) {}
  T* get() const { return data.get(); }
};

template <typename T>
class CountedBuffer {
 public:
  explicit CountedBuffer(size_t n)
      : buffer_(n ? mlx::core::allocator::allocator().malloc(n * sizeof(T) + kAlign) : mlx::core::allocator::Buffer{nullptr}),
        data_(n ? aligned(buffer_.raw_ptr()) : nullptr) {}
  ~CountedBuffer() {
    if (buffer_.ptr() != nullptr) mlx::core::allocator::allocator().free(buffer_);
  }
  CountedBuffer(const CountedBuffer&) = delete;
  CountedBuffer& operator=(const CountedBuffer&) = delete;

  T* get() const { return data_; }

 private:
  static constexpr uintptr_t kAlign = 64;
  static T* aligned(void* p) {
    return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(p) + kAlign - 1) & ~(kAlign - 1));
  }

  mlx::core::allocator::Buffer buffer_;
  T* data_;
};

}  // namespace mlx_infer
