// Inputs as the kernels index them: plain row-major memory.
//
// Flags and strides of a primitive's inputs are known when its eval_cpu runs (the producers have
// allocated their outputs), their values only when the dispatched task runs. So eval_cpu records
// the layout, and the task reads the data in place when it is row-contiguous, or gathers it into
// scratch memory first (a strided view: a slice of a fused projection, a transpose).
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "mlx/array.h"

namespace mlx_infer {

template <typename T>
struct Input {
  const T* data;
  bool contiguous;
  mlx::core::Shape shape;
  mlx::core::Strides strides;
  size_t size;

  explicit Input(const mlx::core::array& a)
      : data(a.data<T>()), contiguous(a.flags().row_contiguous), shape(a.shape()), strides(a.strides()),
        size(a.size()) {}

  // The elements in row-major order: in place, or copied into `scratch`.
  const T* rows(std::vector<T>& scratch) const {
    if (contiguous) return data;
    scratch.resize(size);
    const int nd = static_cast<int>(shape.size());
    std::vector<int> index(nd, 0);
    for (size_t i = 0; i < size; ++i) {
      int64_t offset = 0;
      for (int d = 0; d < nd; ++d) offset += static_cast<int64_t>(index[d]) * strides[d];
      scratch[i] = data[offset];
      for (int d = nd - 1; d >= 0; --d) {
        if (++index[d] < shape[d]) break;
        index[d] = 0;
      }
    }
    return scratch.data();
  }
};

// An input of any dtype as bytes, row-major: in place, or gathered element by element into `scratch`.
struct RawInput {
  const uint8_t* data;
  size_t itemsize;
  bool contiguous;
  mlx::core::Shape shape;
  mlx::core::Strides strides;
  size_t size;

  explicit RawInput(const mlx::core::array& a)
      : data(a.data<uint8_t>()), itemsize(a.itemsize()), contiguous(a.flags().row_contiguous), shape(a.shape()),
        strides(a.strides()), size(a.size()) {}

  const uint8_t* rows(std::vector<uint8_t>& scratch) const {
    if (contiguous) return data;
    scratch.resize(size * itemsize);
    const int nd = static_cast<int>(shape.size());
    std::vector<int> index(nd, 0);
    for (size_t i = 0; i < size; ++i) {
      int64_t offset = 0;
      for (int d = 0; d < nd; ++d) offset += static_cast<int64_t>(index[d]) * strides[d];
      std::memcpy(scratch.data() + i * itemsize, data + offset * static_cast<int64_t>(itemsize), itemsize);
      for (int d = nd - 1; d >= 0; --d) {
        if (++index[d] < shape[d]) break;
        index[d] = 0;
      }
    }
    return scratch.data();
  }
};

}  // namespace mlx_infer
