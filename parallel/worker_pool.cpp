#include "worker_pool.hpp"

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

void WorkerPool::run(const std::function<void(size_t)>& job) {
  for (size_t i = 0; i < workers_.size(); ++i) {
    Worker& w = *workers_[i];
    std::lock_guard<std::mutex> lock(w.mu);
    w.job = [&job, i] { job(i); };
    w.error = nullptr;
    w.busy = true;
    w.cv.notify_all();
  }
  std::exception_ptr first;
  for (auto& w : workers_) {
    std::unique_lock<std::mutex> lock(w->mu);
    w->cv.wait(lock, [&w] { return !w->busy; });
    if (w->error && !first) first = w->error;
  }
  if (first) std::rethrow_exception(first);
}

}  // namespace dpt
