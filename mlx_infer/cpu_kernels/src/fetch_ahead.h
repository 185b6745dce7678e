// Memory that attention's passes bring into L2 a few lines at a time while they compute: the next
// chunk's K/V rows. Issued all at once, a chunk's ~800 prefetches wait for the core's few line fill
// buffers and stall it (a third of a batch-16 decode step's attention in perf, with 512-bit passes);
// spread over the arithmetic of the chunk before, they overlap it.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

namespace mlx_infer {

// Plain data shared by the 256- and 512-bit passes (each has its own fetch_ahead, built with its flags).
struct Ahead {
  struct Run {
    const char *begin, *end;  // whole cache lines
  };
  const Run* runs = nullptr;
  int n = 0;
  int run = 0;  // the next line: runs[run].begin + offset
  size_t offset = 0;
};

namespace {

// The next `lines` lines of `ahead` into L2 (not L1, which holds the chunk being computed).
inline void fetch_ahead(Ahead& ahead, int lines) {
  for (; lines > 0 && ahead.run < ahead.n; --lines) {
    const Ahead::Run& run = ahead.runs[ahead.run];
    _mm_prefetch(run.begin + ahead.offset, _MM_HINT_T1);
    ahead.offset += 64;
    if (run.begin + ahead.offset >= run.end) ++ahead.run, ahead.offset = 0;
  }
}

// Lines a step of the passes fetches: a step of score_heads (4 keys against up to 3 query rows), of
// value_heads (a key's row meeting up to 3 query rows). At these rates a decode step over SmolLM2's
// heads (3 query rows a KV head, 64-value rows) has fetched the next chunk by the end of this one.
constexpr int kScoreStepLines = 8;
constexpr int kValueStepLines = 2;

}  // namespace
}  // namespace mlx_infer
