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

  // Runs task(i) for i in [0, size()), index 0 on the calling thread; returns when all are done.
  // Callers on different threads (two MLX CPU streams) take turns.
  void run(const std::function<void(int)>& task);

  // f(begin, end) for each thread's contiguous share of [0, n), shares rounded up to a multiple of
  // `align` (8 output features keep each thread's writes on their own cache lines); empty shares
  // are skipped.
  template <class F>
  void for_range(int n, int align, F&& f) {
    const int parts = size();
    run([&](int part) {
      const int per = ((n + parts - 1) / parts + align - 1) / align * align;
      const int begin = std::min(n, part * per);
      const int end = std::min(n, begin + per);
      if (begin < end) f(begin, end);
    });
  }

 private:
  void worker_loop(int index);

  static constexpr std::chrono::microseconds kSpin{200};

  std::vector<std::thread> workers_;
  std::mutex run_mutex_;  // one job at a time
  std::mutex mutex_;
  std::condition_variable wake_;
  const std::function<void(int)>* task_ = nullptr;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  bool stop_ = false;
};

// The process-wide pool, sized by MLX_INFER_CPU_THREADS or the number of cores.
ThreadPool& pool();

}  // namespace mlx_infer
