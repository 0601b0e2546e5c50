// The ahead-loader: the feeder (feeder.hpp) of one GPU replica on file data. A loader thread runs ahead of the
// steps: it knows the sequence of shards the replica will ask for (next(first)) and fills
// a ring of slots with them, each gathered (by several threads for large shards) into
// page-locked host memory and copied, chunk by chunk so that gathering and copying
// overlap, into the slot's device buffers on a copy stream of its own. A step's stream
// waits for its slot's copy on an event, never the host. A slot handed out is refilled
// only after the compute stream is past the work queued before the next call (an
// event), and its host buffers only after their last copy is done (the loader thread
// waits for that, not the step). Internal to the library.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include <dptrain/data/batch.hpp>
#include <dptrain/data/dataset.hpp>
#include <dptrain/data/input_stats.hpp>
#include <dptrain/data/shuffle.hpp>
#include <dptrain/runtime/context.hpp>
#include <dptrain/runtime/memory.hpp>

#include "common/worker_pool.hpp"
#include "data/feeder.hpp"

namespace dpt::data {

class AheadLoader : public Feeder {
 public:
  // The request expected after the one for samples from `first`; count 0: none.
  using NextShard = std::function<Samples(int64_t first)>;

  // At most `max_rows` rows a call, of `data` (which must outlive the loader), for
  // `device`, in the order of (seed, shuffle), gathered by up to `gather_threads` threads;
  // class labels checked against `classes` (data::check_labels) when it is > 0.
  AheadLoader(const Dataset& data, const Device& device, int64_t max_rows, uint64_t seed, bool shuffle, NextShard next,
              unsigned gather_threads, int64_t classes = 0);
  ~AheadLoader() override;
  AheadLoader(const AheadLoader&) = delete;
  AheadLoader& operator=(const AheadLoader&) = delete;

  // Samples [first, first + count) on the device, for work queued on `ctx` from now on
  // (ctx waits for their copy). The loader then goes on loading the requests next() names
  // after it; a call it did not foresee (the first, a resumed run) starts it afresh from
  // there, a little slower. The tensors are the loader's buffers: valid for the work
  // queued before the next call.
  Batch get(int64_t first, int64_t count, const Context& ctx);
  // The same for work queued on the device's current context.
  Batch inputs(int64_t first, int64_t count, const Batch& next_inputs) override;
  // What the loader has done so far: gathers done, copies whose time is known.
  InputStats stats() override;
  size_t slots() const { return slots_.size(); }

 private:
  enum class State { free, loading, ready, out };
  struct Slot {
    PinnedBuffer host_x, host_y;
    Tensor x, y;  // device buffers of max_rows rows
    std::unique_ptr<Event> copied, consumed;
    // Each chunk's copy between two events: the copy engine's time, without the gathers
    // it waits for between chunks. The first `timed` are copies not yet in the stats.
    std::vector<std::unique_ptr<Event>> chunk_start, chunk_end;
    size_t timed = 0;
    bool consumed_recorded = false;
    State state = State::free;
    int64_t first = -1, count = 0;
    std::exception_ptr error;
  };
  // Gathers samples [first, first + count) into slot s and queues their copy (after the
  // compute stream has consumed the slot's last batch).
  void load(Slot& s, int64_t first, int64_t count);
  void loader_main();
  // Rows a chunk: copied while the next chunk is gathered.
  int64_t chunk_rows() const;

  const Dataset& data_;
  Device device_;
  int64_t max_rows_, x_row_, y_row_;
  int64_t row_bytes_;  // a row's inputs and targets (4-byte floats, tokens or labels)
  bool int_inputs_;    // tokens (i32), else floats
  bool int_targets_;   // class labels or next tokens (i32), else floats
  bool labels_;        // class labels, which check_labels checks
  int64_t classes_;    // labels are checked against it when > 0
  NextShard next_;
  Context copy_ctx_;  // the copy stream
  // Large shards are gathered by several threads: one copies rows at a few GB/s, less than
  // a GPU's step of a large model reads.
  std::unique_ptr<WorkerPool> gatherers_;
  std::vector<std::atomic<int>> chunk_parts_;  // of each chunk, the parts gathered
  std::atomic<bool> failed_{false};            // a gatherer met an error: the others stop
  RowOrder order_;
  std::vector<int64_t> rows_;
  std::vector<Slot> slots_;
  std::mutex m_;
  std::condition_variable cv_;
  size_t fill_ = 0, take_ = 0;               // the slot the loader fills next, the slot the next call expects
  int64_t want_first_ = 0, want_count_ = 0;  // what the loader loads next (count 0: nothing)
  uint64_t generation_ = 0;                  // a call that started the loader afresh makes its loads in flight stale
  size_t out_ = SIZE_MAX;                    // the slot the last call handed out
  bool stop_ = false;
  std::mutex stats_m_;
  InputStats stats_;
  std::thread thread_;
};

}  // namespace dpt::data
