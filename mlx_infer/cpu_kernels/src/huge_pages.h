// Weights copied onto transparent huge pages (huge_pages.cpp).
#pragma once

#include <cstddef>
#include <utility>
#include <vector>

#include "mlx/mlx.h"

namespace mlx_infer {

// The arrays copied into one new buffer, each at a multiple of 64 bytes, whose 2 MiB-aligned windows
// are marked for transparent huge pages before the copy first touches them: the buffer (a uint8 array)
// and each array's byte offset in it.
std::pair<mlx::core::array, std::vector<size_t>> pack_on_huge_pages(const std::vector<mlx::core::array>& arrays);

// How many bytes of an array's buffer lie on huge pages now (AnonHugePages of its windows; Linux only).
size_t huge_page_bytes(const mlx::core::array& a);

}  // namespace mlx_infer
