// The input pipeline of one GPU replica on file data: while step s computes, a loader
// thread gathers step s+1's rows (the replica's own shard, in the epoch's order) into
// page-locked host memory and queues their copy to the device on a copy stream of its own;
// the step's stream waits for that copy on an event, never the host. Two slots, used in
// turn: slot k's device buffers are refilled only after the compute stream is past the
// step that read them (an event), and its host buffers only after their last copy is done
// (the loader thread waits for that, not the step). Internal to the library.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include <dptrain/data/batch.hpp>
#include <dptrain/data/dataset.hpp>
#include <dptrain/data/shuffle.hpp>
#include <dptrain/parallel/shard_plan.hpp>
#include <dptrain/runtime/context.hpp>
#include <dptrain/runtime/memory.hpp>
#include <dptrain/train/trainer.hpp>

#include "../parallel/worker_pool.hpp"

namespace dpt {

// The samples replica `replica` asks for after samples from `first` (global: step * batch
// + its micro-batch's offset): its next micro-batch of the step (empty ones ask for
// nothing), else its first of the next step.
SampleRange next_shard(const ShardPlan& plan, size_t replica, int64_t first);

class ShardLoader {
 public:
  // At most `max_rows` rows a call, of `data` (which must outlive the loader), for
  // `device`, in the order of (seed, shuffle).
  ShardLoader(const data::Dataset& data, const Device& device, int64_t max_rows, uint64_t seed, bool shuffle);
  ~ShardLoader();
  ShardLoader(const ShardLoader&) = delete;
  ShardLoader& operator=(const ShardLoader&) = delete;

  // Samples [first, first + count) on the device, for work queued on `ctx` from now on
  // (ctx waits for their copy). The next call is expected for samples [next_first,
  // next_first + next_count) (none: 0), whose rows are loaded now, in the background;
  // another call is served, a little slower, all the same. The tensors are the loader's buffers: valid
  // until the call after next.
  data::Batch get(int64_t first, int64_t count, int64_t next_first, int64_t next_count, const Context& ctx);
  // What the loader has done so far: gathers done, copies whose time is known.
  InputStats stats();

 private:
  struct Slot {
    PinnedBuffer host_x, host_y;
    Tensor x, y;  // device buffers of max_rows rows
    std::unique_ptr<Event> copy_start, copied, consumed;
    bool timing = false;  // copy_start..copied is a copy not yet added to the stats
    int64_t first = -1, count = 0;
    bool loaded = false, consumed_recorded = false;
    std::exception_ptr error;
  };
  // Gathers samples [first, first + count) into slot s and queues their copy (after the
  // compute stream has consumed the slot's last batch).
  void load(Slot& s, int64_t first, int64_t count);
  void loader_main();

  const data::Dataset& data_;
  Device device_;
  int64_t max_rows_, x_row_, y_row_;
  bool labels_;
  Context copy_ctx_;  // the copy stream
  // Large shards are gathered by several threads: one copies rows at a few GB/s, less than
  // a GPU's step of a large model reads.
  std::unique_ptr<WorkerPool> gatherers_;
  data::RowOrder order_;
  std::vector<int64_t> rows_;
  Slot slots_[2];
  int last_ = -1;  // the slot the last call handed out
  std::mutex m_;
  std::condition_variable cv_;
  Slot* job_ = nullptr;  // the slot the loader thread is to fill
  int64_t job_first_ = 0, job_count_ = 0;
  bool busy_ = false, stop_ = false;
  std::mutex stats_m_;
  InputStats stats_;
  std::thread thread_;
};

}  // namespace dpt
