#include "thread_pool.h"

#include <immintrin.h>

#include <chrono>
#include <cstdlib>

namespace mlx_infer {

ThreadPool::ThreadPool(int num_threads) {
  for (int i = 1; i < num_threads; ++i) {
    workers_.emplace_back([this, i] { worker_loop(i); });
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
    generation_.fetch_add(1);
  }
  wake_.notify_all();
  for (auto& w : workers_) w.join();
}

void ThreadPool::run(const std::function<void(int)>& task) {
  if (workers_.empty()) {
    task(0);
    return;
  }
  std::lock_guard<std::mutex> one_job(run_mutex_);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    task_ = &task;
    pending_.store(static_cast<int>(workers_.size()));
    generation_.fetch_add(1, std::memory_order_release);
  }
  wake_.notify_all();
  task(0);
  // pause, not yield: with nothing else runnable, yield returns at once and the loop would take the
  // execution units of a hyper-thread sibling that may be the very worker being waited for.
  while (pending_.load(std::memory_order_acquire) != 0) _mm_pause();
}

void ThreadPool::worker_loop(int index) {
  uint64_t seen = 0;
  while (true) {
    const std::function<void(int)>* task;
    // The kernels of one decode step come tens of microseconds apart: a worker that slept after each
    // job paid a futex wake-up (often longer than its share of the job) every time. So it watches for
    // the next job for a while, then sleeps until notified (no spinning between steps).
    const auto spin_until = std::chrono::steady_clock::now() + kSpin;
    while (generation_.load(std::memory_order_acquire) == seen && std::chrono::steady_clock::now() < spin_until) {
      for (int i = 0; i < 16; ++i) _mm_pause();
    }
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return generation_.load() != seen; });
      if (stop_) return;
      seen = generation_.load();
      task = task_;
    }
    (*task)(index);
    pending_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

ThreadPool& pool() {
  // Never destroyed: joining workers from a static destructor at exit could race with an MLX stream
  // thread still running a kernel.
  static ThreadPool* instance = new ThreadPool([] {
    if (const char* env = std::getenv("MLX_INFER_CPU_THREADS")) {
      int n = std::atoi(env);
      if (n > 0) return n;
    }
    unsigned hw = std::thread::hardware_concurrency();
    return hw == 0 ? 1 : static_cast<int>(hw);
  }());
  return *instance;
}

}  // namespace mlx_infer
