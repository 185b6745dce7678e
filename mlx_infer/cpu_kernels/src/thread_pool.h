// A fork-join pool for splitting one kernel call across the CPU's cores.
//
// MLX's CPU backend runs each primitive on its single stream thread, so a kernel that wants the
// other cores has to bring its own workers. Workers watch for the next job for kSpin after each one
// (a decode step's jobs come tens of microseconds apart), then sleep: measured on 2 cores, a worker
// spinning without end took the core MLX's own threads need between steps and a decode step got
// slower (57 -> 135 ms), while one sleeping after every job paid a wake-up per job.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace mlx_infer {

class ThreadPool {
 public:
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // for_range's chunks a thread unless the caller asks for others.
  static constexpr int kChunksPerThread = 4;
  // The most rows (tokens) a decode step of a batch has: the products and attention of a step that small
  // take one range a thread (a range's first chunk waits for memory; the ones after it are prefetched).
  static constexpr int kDecodeRows = 16;

  // f(begin, end) over chunks covering [0, n), each a multiple of `align` long (8 output features
  // keep each thread's writes on their own cache lines) but the last. The calling thread and the
  // workers that join in time take the chunks in turn, chunks_per_thread of them each when all run.
  // Why chunks taken in turn rather than one fixed share per thread: with as many busy threads as
  // cores (MLX's own, Python building the next step), a worker is often descheduled or still waking
  // when a job starts, and the others then spun until it came back.
  template <class F>
  void for_range(int n, int align, F&& f, int chunks_per_thread = kChunksPerThread) {
    const int parts = size();
    if (parts == 1 || n <= align) {
      if (n > 0) f(0, n);
      return;
    }
    const int chunk = ((n + parts * chunks_per_thread - 1) / (parts * chunks_per_thread) + align - 1) / align * align;
    const int chunks = (n + chunk - 1) / chunk;
    std::atomic<int> next{0};
    help([&] {
      for (int c = next.fetch_add(1, std::memory_order_relaxed); c < chunks;
           c = next.fetch_add(1, std::memory_order_relaxed)) {
        f(c * chunk, std::min(n, (c + 1) * chunk));
      }
    });
  }

 private:
  // Runs task on the calling thread and on every worker that picks the job up before the caller's
  // own call returns; then waits for just those. So task must leave nothing undone when any one
  // call of it returns (for_range's: until no chunk is left), and may run on one thread or several.
  // Callers on different threads (two MLX CPU streams) take turns.
  void help(const std::function<void()>& task);
  void worker_loop();

  static constexpr std::chrono::microseconds kSpin{200};
  // state_: the job's generation in the high 32 bits, kClosed once the caller's call has returned
  // (no worker may join after it), and the number of workers inside the job in the low bits.
  static constexpr uint64_t kClosed = uint64_t{1} << 31;
  static constexpr uint64_t kActive = kClosed - 1;

  std::vector<std::thread> workers_;
  std::mutex help_mutex_;  // one job at a time
  std::mutex mutex_;
  std::condition_variable wake_;
  const std::function<void()>* task_ = nullptr;
  std::atomic<uint64_t> state_{kClosed};
  bool stop_ = false;
};

// The process-wide pool, sized by MLX_INFER_CPU_THREADS or the number of cores.
ThreadPool& pool();

}  // namespace mlx_infer
