// How a global batch is shared out: over the processes of a multi-process (DDP) job, then
// over the replicas of each process, then over the micro-batches of each replica (gradient
// accumulation). Every split is into contiguous ranges whose sizes differ by at most one,
// the first ones larger (10 over 3: 4, 3, 3), so any number of devices trains on exactly
// the samples one device would, each gradient weighted by its share of the batch.
// Built once per batch size; the replicator, the benchmarks and the data sources read it.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace dpt {

// The most micro-batches a step may have (DataParallelOptions::grad_accum): a step keeps a
// loss and a weight per micro-batch and replica.
inline constexpr int kMaxGradAccum = 65536;

// Samples [first, first + count) of a batch, counted from the batch's first sample.
struct SampleRange {
  int64_t first = 0;
  int64_t count = 0;
  bool operator==(const SampleRange&) const = default;
};

// n split into `parts` contiguous sizes differing by at most one, the first ones larger;
// zeros when n < parts.
std::vector<int64_t> split_evenly(int64_t n, size_t parts);

// ZeRO's partitions of a flat buffer of `total` floats over `n` devices (elements, not
// samples, as [first, first + count)): contiguous, in device order, each ceil(total / n)
// rounded up to a multiple of 4 floats (16-byte access), the last ones shorter or empty.
std::vector<SampleRange> zero_partitions(int64_t total, size_t n);
inline std::vector<SampleRange> zero_shards(int64_t total, size_t n) {
  return zero_partitions(total, n);
}  // the former name

class ShardPlan {
 public:
  ShardPlan() = default;
  // This process is `rank` of `ranks` (1 without DDP) and holds `replicas` replicas, each
  // training `micro_batches` micro-batches a step. Throws UsageError for a batch < 1.
  ShardPlan(int64_t batch, int ranks, int rank, size_t replicas, int micro_batches);

  int64_t batch() const { return batch_; }
  size_t replicas() const { return replica_.size(); }
  int micro_batches() const { return micro_batches_; }
  // This process's part of the batch.
  SampleRange rank_part() const { return rank_part_; }
  // Replica r's part of the batch (within this process's part).
  SampleRange replica_part(size_t r) const { return replica_.at(r); }
  // Replica r's micro-batch k, and the weight of its gradient: its share of the batch.
  SampleRange micro(size_t r, int k) const;
  double weight(size_t r, int k) const;
  // Replicas of the whole job (every process's) that the batch leaves without a sample.
  int64_t idle_replicas() const { return idle_; }

 private:
  int64_t batch_ = 0;
  int micro_batches_ = 1;
  SampleRange rank_part_;
  std::vector<SampleRange> replica_;
  int64_t idle_ = 0;
};

}  // namespace dpt
