// Which steps' gradients were not finite, learned without waiting for the steps: the
// master's gradient check writes each step's record into a ring of kLag slots of host
// memory that the device writes in place (DataParallel::set_check_ring), and the host
// reads a record when the ring comes round to its slot (after kLag - 1 more steps were
// queued; waiting then, for that record alone, only if the device is that far behind the
// host) or at once in
// drain() (at log points, saves and the end of a run). No copy or event is queued a step.
// Every rank reads the same steps at the same points, so all stop at the same step.
// Internal to the library.
#pragma once
#include <cstdint>
#include <vector>

#include <dptrain/parallel/data_parallel.hpp>
#include <dptrain/runtime/memory.hpp>
#include <dptrain/runtime/tensor.hpp>

namespace dpt {

class NonFiniteWatch {
 public:
  static constexpr int kLag = 8;  // a bad step is known at most this many steps later
  struct Finding {
    int64_t step;   // 0-based
    int32_t index;  // of the first non-finite gradient value; INT32_MAX: only the norm overflowed
  };

  // Gives dp its ring, for as long as the watch lives.
  explicit NonFiniteWatch(DataParallel& dp);
  ~NonFiniteWatch();
  NonFiniteWatch(const NonFiniteWatch&) = delete;
  NonFiniteWatch& operator=(const NonFiniteWatch&) = delete;
  // Step `step` was queued (its check is the next record): reads the records whose slots
  // the next step's record needs.
  void after_step(int64_t step);
  // Reads every record not yet read (waits for their steps).
  void drain();
  // The bad steps read and not yet taken, in step order.
  std::vector<Finding> take();

 private:
  void read_next();
  std::vector<Finding> found_;
  DataParallel& dp_;
  PinnedBuffer host_;  // kLag CheckRecords
  Tensor count_;       // the device's count of records written
  std::vector<int64_t> step_of_;
  int64_t queued_ = 0, read_ = 0;  // records
};

}  // namespace dpt
