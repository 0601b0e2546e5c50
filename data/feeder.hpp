// The input pipeline: one Feeder a replica, which the Trainer asks for each of the
// replica's requests in a step (its micro-batches) and which knows how the rows are made.
// Its kinds (make_feeders chooses):
//   synthetic  - a replica's part of several steps made at once on a stream of its own,
//                the next block made ahead while this one's steps run (feeder.cpp);
//   gather     - file or program rows gathered on the replica's thread (a CPU replica);
//   ahead      - file rows on a GPU, gathered into page-locked memory and copied by a
//                loader thread a few requests ahead (ahead_loader.hpp).
// Token data (tokens.hpp: windows of T+1 tokens, i32) is a Dataset like any other: the
// gather and ahead kinds carry its i32 inputs and targets. data/ sits below parallel/: a
// feeder knows the replicator's split of a batch only as a ReplicaShare, which the
// Trainer makes from its ShardPlan. Internal to the library.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include <dptrain/data/batch.hpp>
#include <dptrain/data/dataset.hpp>
#include <dptrain/data/input_stats.hpp>
#include <dptrain/data/synthetic.hpp>
#include <dptrain/runtime/context.hpp>
#include <dptrain/runtime/device.hpp>

namespace dpt::data {

// Global samples [first, first + count) (step s of batch B holds s * B .. (s + 1) * B - 1).
struct Samples {
  int64_t first = 0;
  int64_t count = 0;
  bool operator==(const Samples&) const = default;
};

// One replica's share of every step's batch, as the replicator splits it.
struct ReplicaShare {
  Device device;
  int64_t batch = 0;     // the global batch
  Samples part;          // its part of each step (counted from the step's first sample): its micro-batches, in turn
  int64_t max_rows = 0;  // its largest request (its first micro-batch)
  int64_t end = 0;       // the run's end: no sample from here on is asked for
  // The request that follows the one for samples from `first` (count 0: none known).
  std::function<Samples(int64_t first)> next;
};

class Feeder {
 public:
  virtual ~Feeder() = default;
  // The replica's samples [first, first + count), on its device, for the work queued on
  // its current context from now on (which waits for them on the device, not the host);
  // valid for the work queued before the next call. `next_inputs`: where the replica's
  // next step will read its inputs (a CUDA graph's, DataParallel::next_step_inputs), or
  // empty; a feeder that fills_next_inputs() makes that step's samples there when it can.
  virtual Batch inputs(int64_t first, int64_t count, const Batch& next_inputs) = 0;
  // Whether it makes a step's samples straight into the next_inputs it is given (so that
  // no copy need move them there).
  virtual bool fills_next_inputs() const { return false; }
  virtual InputStats stats() { return {}; }
  // Waits for the work it queued on streams of its own (before the program ends).
  virtual void synchronize() {}
};

struct FeedOptions {
  uint64_t seed = 1;
  bool shuffle = true;                    // file rows: each epoch in a permutation of (seed, epoch)
  int64_t classes = 0;                    // labels are checked against it when > 0 (check_labels)
  bool graph_inputs = false;              // the steps run as a CUDA graph, which offers its inputs to fill
  Precision precision = Precision::fp32;  // synthetic data's teacher computes as the replicas do
  GemmImpl gemm = GemmImpl::cublas;
};

// One feeder a share: synthetic data of `synthetic` where `rows` is null, else the rows of
// `rows` (which must outlive the feeders).
std::vector<std::unique_ptr<Feeder>> make_feeders(const Dataset* rows, const SyntheticConfig& synthetic,
                                                  const std::vector<ReplicaShare>& shares, const FeedOptions& options);

}  // namespace dpt::data
