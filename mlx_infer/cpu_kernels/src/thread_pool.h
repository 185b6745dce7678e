// A fork-join pool for splitting one kernel call across the CPU's cores.
//
// MLX's CPU backend runs each primitive on its single stream thread, so a kernel that wants the
// other cores has to bring its own workers. Workers watch for the next job for kSpin after each one
// (a decode step's jobs come tens of microseconds apart), then sleep: measured on 2 cores, a worker
// spinning without end took the core MLX's own threads need between steps and a decode step got
// slower (57 -> 135 ms), while one sleeping after every job paid a wake-up per job.
#pragma once

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
