#include "thread_pool.h"

#include <immintrin.h>

#include <chrono>
#include <cstdlib>

namespace mlx_infer {

ThreadPool::ThreadPool(int num_threads) {
  for (int i = 1; i < num_threads; ++i) {
    workers_.emplace_back([this] { worker_loop(); });
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& w : workers_) w.join();
}

void ThreadPool::help(const std::function<void()>& task) {
  std::lock_guard<std::mutex> one_job(help_mutex_);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    task_ = &task;
    // The previous job is closed with no worker inside (its caller waited for that): open the next.
    state_.store(((state_.load(std::memory_order_relaxed) >> 32) + 1) << 32, std::memory_order_release);
  }
  wake_.notify_all();
  task();
  // No chunk is left: close the job to latecomers and wait for the workers inside it. pause, not
  // yield: with nothing else runnable, yield returns at once and the loop would take the execution
  // units of a hyper-thread sibling that may be the very worker being waited for.
  state_.fetch_or(kClosed, std::memory_order_acq_rel);
  while ((state_.load(std::memory_order_acquire) & kActive) != 0) _mm_pause();
}

void ThreadPool::worker_loop() {
  uint64_t seen = state_.load() >> 32;
  const auto has_new_job = [&] { return (state_.load(std::memory_order_acquire) >> 32) != seen; };
  while (true) {
    // The kernels of one decode step come tens of microseconds apart: a worker that slept after each
    // job paid a futex wake-up (often longer than its share of the job) every time. So it watches for
    // the next job for a while, then sleeps until notified (no spinning between steps).
    const auto spin_until = std::chrono::steady_clock::now() + kSpin;
    while (!has_new_job() && std::chrono::steady_clock::now() < spin_until) {
      for (int i = 0; i < 16; ++i) _mm_pause();
    }
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return stop_ || has_new_job(); });
      if (stop_) return;
    }
    // Join the job unless its caller has closed it; the job, and so task_, stay put while we are in.
    uint64_t s = state_.load(std::memory_order_acquire);
    while (!(s & kClosed) && !state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel)) {
    }
    seen = s >> 32;
    if (s & kClosed) continue;
    (*task_)();
    state_.fetch_sub(1, std::memory_order_acq_rel);
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
