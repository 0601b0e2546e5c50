// The feeders that need no thread of their own: synthetic blocks and the gather on the
// replica's thread; and the choice of a replica's kind.
#include "data/feeder.hpp"

#include <algorithm>
#include <mutex>
#include <thread>
#include <utility>

#include <dptrain/data/shuffle.hpp>
#include <dptrain/runtime/tensor.hpp>

#include "data/ahead_loader.hpp"

namespace dpt::data {
namespace {

// Synthetic data is made for several steps at once (a few launches for all of them
// instead of a few a step): the replica's part of steps [step0, step0 + steps). The next
// block is made ahead, on a stream of its own, while the steps of this one run.
class SyntheticFeeder : public Feeder {
 public:
  SyntheticFeeder(const SyntheticConfig& config, const ReplicaShare& share, const FeedOptions& options)
      : source_(config, share.device),
        side_(share.device),
        consumed_(share.device),
        batch_(share.batch),
        part_(share.part),
        end_(share.end),
        block_steps_(block_steps()),
        fills_next_inputs_(options.graph_inputs && block_steps_ == 1) {
    side_.precision = options.precision;  // the teacher computes as the replica would
    side_.gemm = options.gemm;
  }

  Batch inputs(int64_t first, int64_t count, const Batch& next_inputs) override {
    // The replica takes the same part of every step's batch: its micro-batches, contiguous.
    const int64_t step = first / batch_, at = first - step * batch_ - part_.first;
    if (at < 0 || at + count > part_.count) return source_.batch(first, count);  // not a step's shard
    const int64_t steps = block_steps_;
    const int64_t step0 = step / steps * steps;
    Block& b = current_;
    if (b.step0 != step0 || b.steps != steps) {
      Context& compute = context(side_.device());  // the replica's, current on its thread
      consumed_.record(compute);                   // the steps queued so far, which read b
      b.rows = Batch();                            // its memory serves the blocks after it
      b.step0 = -1;
      if (ahead_.step0 == step0 && ahead_.steps == steps) std::swap(b, ahead_);
      else make_block(b, step0, steps, Batch());  // not foreseen: the first block, a resumed run
      b.made->wait_in(compute);
      if ((step0 + steps) * batch_ < end_) make_block(ahead_, step0 + steps, steps, next_inputs);
    }
    const int64_t row = (step - step0) * part_.count + at;
    return {b.rows.x.rows(row, count), b.rows.y.rows(row, count)};
  }

  // Blocks of one step each, under a CUDA graph: each is made straight into the buffers
  // that its step's replay reads, where the replay before would otherwise copy it (32 MB
  // a step in the mlp workload).
  bool fills_next_inputs() const override { return fills_next_inputs_; }
  void synchronize() override { side_.synchronize(); }  // a block made ahead may be in the making

 private:
  struct Block {
    int64_t step0 = -1, steps = 0;
    Batch rows;
    std::unique_ptr<Event> made;  // on the side stream
  };

  int64_t block_steps() const {
    // Blocks begin at multiples of their length, so a resumed run makes the same blocks;
    // about 32 MiB of samples, at most 64 steps, at least one. A block costs the host its
    // launches and cuBLAS calls, which the step that makes it waits for: the seed workload's
    // eager loop took 0.0326 to 0.0398 ms a step with blocks of 16 steps, 0.0325 to 0.0337
    // with 64 (docs/performance-log.md).
    const int64_t row_bytes = 4 * (numel(source_.input_shape()) + std::max<int64_t>(1, numel(source_.target_shape())));
    const int64_t block_rows = (int64_t{32} << 20) / row_bytes;
    return std::clamp<int64_t>(block_rows / std::max<int64_t>(1, part_.count), 1, 64);
  }

  // Queues block (step0, steps) on the side stream, after the compute work `consumed_`
  // marks (the steps that read the memory it may reuse); into `offered` (the next step's
  // graph inputs) where they hold this block exactly and are not the block before's (a
  // step that did not move the counter's parity is offered those again).
  void make_block(Block& b, int64_t step0, int64_t steps, const Batch& offered) {
    ContextGuard guard(side_);
    consumed_.wait_in(side_);
    b.rows = Batch();
    b.step0 = -1;
    Batch into = steps == 1 ? offered : Batch();
    if (into.x.defined()) {
      auto holds = [&](const Tensor& t, Shape row, DType dtype) {
        row.insert(row.begin(), part_.count);
        return t.defined() && t.shape() == row && t.dtype() == dtype;
      };
      const DType labels = source_.task() == Task::classification ? DType::i32 : DType::f32;
      const Batch& current = current_.rows;
      if (!holds(into.x, source_.input_shape(), DType::f32) || !holds(into.y, source_.target_shape(), labels) ||
          (current.x.defined() && (current.x.data() == into.x.data() || current.y.data() == into.y.data())))
        into = Batch();
    }
    b.rows = source_.rows({step0 * batch_ + part_.first, part_.count, batch_, 0}, steps * part_.count, into);
    if (!b.made) b.made = std::make_unique<Event>(side_.device());
    b.made->record(side_);
    b.step0 = step0;
    b.steps = steps;
  }

  Synthetic source_;  // on the replica's device
  Context side_;      // the stream blocks are made on
  Event consumed_;    // the compute stream when a block was taken
  int64_t batch_;
  Samples part_;
  int64_t end_;
  int64_t block_steps_;
  bool fills_next_inputs_;
  Block current_, ahead_;
};

// Rows gathered on the replica's thread when it asks (a CPU replica: the gather is the copy).
class GatherFeeder : public Feeder {
 public:
  GatherFeeder(const Dataset& rows, const ReplicaShare& share, const FeedOptions& options,
               std::shared_ptr<std::mutex> one_at_a_time)
      : data_(rows),
        device_(share.device),
        classes_(options.classes),
        order_(rows.rows(), options.seed, options.shuffle),
        one_at_a_time_(std::move(one_at_a_time)) {}

  Batch inputs(int64_t first, int64_t count, const Batch&) override {
    // Global samples to rows of this epoch's order (a batch may reach into the next epoch).
    order_.rows(first, count, picked_);
    Batch b = data_.empty_batch(count, device_);
    if (data_.concurrent_gathers()) {
      data_.gather(picked_, b, classes_);
    } else {  // a data set of the program's: one replica's thread at a time
      std::lock_guard<std::mutex> lk(*one_at_a_time_);
      data_.gather(picked_, b, classes_);
    }
    return b;
  }

 private:
  const Dataset& data_;
  Device device_;
  int64_t classes_;
  RowOrder order_;
  std::vector<int64_t> picked_;  // the rows it gathers this step
  std::shared_ptr<std::mutex> one_at_a_time_;
};

}  // namespace

std::vector<std::unique_ptr<Feeder>> make_feeders(const Dataset* rows, const SyntheticConfig& synthetic,
                                                  const std::vector<ReplicaShare>& shares, const FeedOptions& options) {
  std::vector<std::unique_ptr<Feeder>> feeders;
  if (!rows) {
    for (const ReplicaShare& s : shares) feeders.push_back(std::make_unique<SyntheticFeeder>(synthetic, s, options));
    return feeders;
  }
  // GPU replicas load their next shards while the steps compute, each loader with its
  // share of three quarters of the host's cores (at most 12 gathering threads: on the
  // H200's host more read no faster).
  const auto gpus = static_cast<unsigned>(
      std::count_if(shares.begin(), shares.end(), [](const ReplicaShare& s) { return s.device.is_cuda(); }));
  const unsigned threads = std::clamp(std::thread::hardware_concurrency() * 3 / 4 / std::max(1u, gpus), 1u, 12u);
  const auto one_at_a_time = std::make_shared<std::mutex>();
  for (const ReplicaShare& s : shares) {
    if (s.device.is_cuda() && s.max_rows > 0)
      feeders.push_back(std::make_unique<AheadLoader>(*rows, s.device, s.max_rows, options.seed, options.shuffle,
                                                      s.next, threads, options.classes));
    else feeders.push_back(std::make_unique<GatherFeeder>(*rows, s, options, one_at_a_time));
  }
  return feeders;
}

}  // namespace dpt::data
