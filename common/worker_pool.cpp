#include "common/worker_pool.hpp"

#include <algorithm>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>

namespace dpt {

struct WorkerPool::Worker {
  std::thread thread;
  std::mutex mu;
  std::condition_variable cv;
  std::function<void()> job;
  bool busy = false, stop = false;
  std::exception_ptr error;
};

WorkerPool::WorkerPool(size_t n) {
  for (size_t i = 0; i < n; ++i) {
    auto w = std::make_unique<Worker>();
    Worker* self = w.get();
    w->thread = std::thread([self] {
      std::unique_lock<std::mutex> lock(self->mu);
      while (true) {
        self->cv.wait(lock, [self] { return self->busy || self->stop; });
        if (self->stop) return;
        lock.unlock();
        try {
          self->job();
        } catch (...) {
          self->error = std::current_exception();
        }
        lock.lock();
        self->busy = false;
        self->cv.notify_all();
      }
    });
    workers_.push_back(std::move(w));
  }
}

WorkerPool::~WorkerPool() {
  for (auto& w : workers_) {
    {
      std::lock_guard<std::mutex> lock(w->mu);
      w->stop = true;
    }
    w->cv.notify_all();
    w->thread.join();
  }
}

void WorkerPool::start(const std::function<void(size_t)>& job, size_t n) {
  job_ = &job;
  running_ = std::min(n, workers_.size());
  for (size_t i = 0; i < running_; ++i) {
    Worker& w = *workers_[i];
    std::lock_guard<std::mutex> lock(w.mu);
    w.job = [this, i] { (*job_)(i); };
    w.error = nullptr;
    w.busy = true;
    w.cv.notify_all();
  }
}

void WorkerPool::wait() {
  std::exception_ptr first;
  for (size_t i = 0; i < running_; ++i) {
    const auto& w = workers_[i];
    std::unique_lock<std::mutex> lock(w->mu);
    w->cv.wait(lock, [&w] { return !w->busy; });
    // Taken, not shared: the error's last owner is the thread that handles it.
    if (w->error && !first) first = w->error;
    w->error = nullptr;
  }
  job_ = nullptr;
  if (first) std::rethrow_exception(first);
}

}  // namespace dpt
