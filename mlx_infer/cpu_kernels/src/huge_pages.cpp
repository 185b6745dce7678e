// Weights on transparent huge pages. A decode step streams every weight once, and with 4 KiB pages
// each 4 KiB of them costs a TLB miss and stops the hardware prefetcher at its edge: on the 2-vCPU Zen 4
// VM a cold 49152 x 576 8-bit head on two threads read 16.3 GB/s from 4 KiB pages and 20.1 from 2 MiB
// ones. Linux gives anonymous memory huge pages only where madvise(MADV_HUGEPAGE) asked for them when
// its THP mode is `madvise` (a common default), and MLX's buffers do not ask; a layer's arrays (0.2-1 MB
// for SmolLM2) are too small to fill a 2 MiB page alone anyway. So the weights are copied, many arrays a
// buffer, into memory advised before its first touch, and the callers make the layers' arrays views into
// it (loading/huge_pages.py). Where malloc hands out memory the process touched before (it serves
// allocations below its moving mmap threshold from freed memory), the copy lands on 4 KiB pages: those
// windows are then collapsed (MADV_COLLAPSE: ~0.3 ms a MiB here, ~0.1 ms for a 32 MiB buffer whose pages
// are huge already).
#include "huge_pages.h"

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <string>

#ifdef __linux__
#include <sys/mman.h>
#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25  // Linux 6.1; older kernels refuse it (EINVAL), which leaves the pages as they are
#endif
#endif

namespace mx = mlx::core;

namespace mlx_infer {

namespace {

constexpr uintptr_t kHugePage = uintptr_t{2} << 20;
constexpr size_t kAlign = 64;  // each array on its own cache lines, as MLX's buffers start

// The 2 MiB-aligned windows wholly inside [begin, begin + bytes).
std::pair<uintptr_t, uintptr_t> windows(const void* begin, size_t bytes) {
  const auto b = reinterpret_cast<uintptr_t>(begin);
  const uintptr_t lo = (b + kHugePage - 1) & ~(kHugePage - 1), hi = (b + bytes) & ~(kHugePage - 1);
  return {lo, hi > lo ? hi : lo};
}

}  // namespace

std::pair<mx::array, std::vector<size_t>> pack_on_huge_pages(const std::vector<mx::array>& arrays) {
  std::vector<mx::array> rows = arrays;
  mx::eval(rows);  // an array's layout is known once it is computed
  std::vector<size_t> offsets;
  size_t total = 0;
  for (mx::array& a : rows) {
    if (!a.flags().row_contiguous) {
      a = mx::contiguous(a);
      a.eval();
    }
    offsets.push_back(total);
    total += (a.nbytes() + kAlign - 1) / kAlign * kAlign;
  }
  mx::allocator::Data data = mx::allocator::malloc(total);
  auto* base = static_cast<uint8_t*>(data.buffer().raw_ptr());
  if (base == nullptr) throw std::runtime_error("pack_on_huge_pages: out of memory");
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  // A buffer this large is fresh memory from mmap, not yet touched: advised now, its windows are faulted
  // in as huge pages by the copy (where the kernel has them; else 4 KiB pages, as before).
  const auto [lo, hi] = windows(base, total);
  if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
#endif
  for (size_t i = 0; i < rows.size(); ++i) {
    const size_t end = offsets[i] + rows[i].nbytes(), next = i + 1 < rows.size() ? offsets[i + 1] : total;
    std::memcpy(base + offsets[i], rows[i].data<uint8_t>(), rows[i].nbytes());
    std::memset(base + end, 0, next - end);  // the padding to the next array
  }
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_COLLAPSE);  // the windows touched before
#endif
  return {mx::array(std::move(data), {static_cast<int>(total)}, mx::uint8), offsets};
}

size_t huge_page_bytes(const mx::array& a) {
#ifdef __linux__
  // /proc/self/smaps: the mappings overlapping the array's buffer, each with its AnonHugePages.
  const auto begin = reinterpret_cast<uintptr_t>(a.data<uint8_t>()), end = begin + a.nbytes();
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool inside = false;
  size_t kib = 0;
  while (std::getline(smaps, line)) {
    uintptr_t lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2 && line.find(':') > line.find(' ')) {
      inside = lo < end && hi > begin;
    } else if (inside && line.rfind("AnonHugePages:", 0) == 0) {
      kib += std::stoul(line.substr(14));
    }
  }
  return kib * 1024;
#else
  (void)a;
  return 0;
#endif
}

}  // namespace mlx_infer
