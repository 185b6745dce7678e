#include "thread_pool.h"

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
  while (pending_.load(std::memory_order_acquire) != 0) {
    std::this_thread::yield();
  }
}

void ThreadPool::worker_loop(int index) {
  uint64_t seen = 0;
  while (true) {
    const std::function<void(int)>* task;
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
