// Which steps' gradients were not finite, learned without waiting for the steps: each
// step's check (DataParallel::record_nonfinite) lands in a slot of a ring of pinned host
// memory, and a slot is read kLag steps later, when the ring comes round to it (waiting
// then only if the device is that far behind the host), or at once by drain() (at log
// points, saves and the end of a run). Every rank reads the same steps at the same
// points, so all stop at the same step. Internal to the library.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include <dptrain/parallel/data_parallel.hpp>
#include <dptrain/runtime/context.hpp>
#include <dptrain/runtime/memory.hpp>

namespace dpt {

class NonFiniteWatch {
 public:
  static constexpr int kLag = 8;  // a bad step is known at most this many steps later
  struct Finding {
    int64_t step;   // 0-based
    int32_t index;  // of the first non-finite gradient value; INT32_MAX: only the norm overflowed
  };

  explicit NonFiniteWatch(const Device& master);
  // Queues step `step`'s check; returns what is known of the step kLag before it.
  std::vector<Finding> after_step(DataParallel& dp, int64_t step);
  // What is known of every step checked and not yet read (waits for them).
  std::vector<Finding> drain();

 private:
  struct Slot {
    int64_t step = -1;  // -1: empty
    std::unique_ptr<Event> done;
  };
  void read(Slot& s, std::vector<Finding>& out);
  PinnedBuffer host_;  // two int32 a slot
  std::vector<Slot> slots_;
};

}  // namespace dpt
