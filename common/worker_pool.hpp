// Worker threads alive as long as their owner (DataParallel: one a replica; the
// ahead-loader: its gathering threads): each job is handed to every thread at once,
// without starting threads in the hot loop.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

namespace dpt {

class WorkerPool {
 public:
  explicit WorkerPool(size_t n);
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;
  // Runs job(i) on worker i for every i at once and waits for all; rethrows the first
  // error (by worker index).
  void run(const std::function<void(size_t)>& job) {
    start(job);
    wait();
  }
  // The same in two halves, so that the caller works while the workers do: start returns
  // at once (job must live until wait, which every start must be followed by). Only
  // workers [0, n) run it when n is given.
  void start(const std::function<void(size_t)>& job, size_t n = SIZE_MAX);
  void wait();
  size_t size() const { return workers_.size(); }

 private:
  struct Worker;
  std::vector<std::unique_ptr<Worker>> workers_;
  const std::function<void(size_t)>* job_ = nullptr;
  size_t running_ = 0;  // workers [0, running_) have the job
};

}  // namespace dpt
