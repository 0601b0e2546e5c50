#include <dptrain/parallel/shard_plan.hpp>

#include <algorithm>
#include <string>

#include <dptrain/error.hpp>

namespace dpt {

std::vector<int64_t> split_evenly(int64_t n, size_t parts) {
  DPT_CHECK(n >= 0 && parts > 0, "split_evenly: nothing to split into");
  std::vector<int64_t> sizes(parts, 0);
  const int64_t p = static_cast<int64_t>(parts), base = n / p, extra = n % p;
  for (int64_t i = 0; i < p; ++i) sizes[static_cast<size_t>(i)] = base + (i < extra ? 1 : 0);
  return sizes;
}

namespace {
// The ranges of `sizes` laid end to end from `first`.
std::vector<SampleRange> ranges(int64_t first, const std::vector<int64_t>& sizes) {
  std::vector<SampleRange> out;
  for (int64_t s : sizes) {
    out.push_back({first, s});
    first += s;
  }
  return out;
}
}  // namespace

ShardPlan::ShardPlan(int64_t batch, int ranks, int rank, size_t replicas, int micro_batches)
    : batch_(batch), micro_batches_(micro_batches) {
  if (batch < 1) throw UsageError("a batch must hold at least one sample, got " + std::to_string(batch));
  DPT_CHECK(ranks >= 1 && rank >= 0 && rank < ranks && replicas >= 1 && micro_batches >= 1,
            "ShardPlan: no process, replica or micro-batch to train on");
  // More micro-batches than a replica has samples would only train empty ones (and a
  // hostile count would allocate without end).
  const int64_t workers = static_cast<int64_t>(ranks) * static_cast<int64_t>(replicas);
  const int64_t largest = batch / workers + (batch % workers != 0);
  if (micro_batches > largest)
    throw UsageError("{} must be <= " + std::to_string(largest) + ", the most samples a replica gets of a batch of " +
                         std::to_string(batch) + " over " + std::to_string(workers) + " replica(s), got " +
                         std::to_string(micro_batches),
                     {{"DataParallelOptions", "grad_accum"}});
  // A step keeps a loss and a weight per micro-batch and replica: a billion micro-batches
  // took 32 GB of host memory, which failed on one machine and ran for minutes on another.
  if (micro_batches > kMaxGradAccum)
    throw UsageError("{} must be <= " + std::to_string(kMaxGradAccum) + " micro-batches a step, got " +
                         std::to_string(micro_batches),
                     {{"DataParallelOptions", "grad_accum"}});
  rank_part_ = ranges(0, split_evenly(batch, static_cast<size_t>(ranks)))[static_cast<size_t>(rank)];
  replica_ = ranges(rank_part_.first, split_evenly(rank_part_.count, replicas));
  idle_ = batch < workers ? workers - batch : 0;
}

std::vector<SampleRange> zero_partitions(int64_t total, size_t n) {
  DPT_CHECK(total >= 0 && n >= 1, "zero_partitions: a buffer and at least one device");
  const auto devices = static_cast<int64_t>(n);
  const int64_t size = ((total + devices - 1) / devices + 3) / 4 * 4;
  std::vector<SampleRange> out;
  for (int64_t k = 0; k < devices; ++k) {
    const int64_t begin = std::min(total, k * size), end = std::min(total, (k + 1) * size);
    out.push_back({begin, end - begin});
  }
  return out;
}

SampleRange ShardPlan::micro(size_t r, int k) const {
  DPT_CHECK(r < replica_.size() && k >= 0 && k < micro_batches_, "ShardPlan::micro: no such micro-batch");
  // Replica r's part split evenly (split_evenly's sizes, laid end to end), computed rather
  // than stored: a step of a billion micro-batches of one sample holds no billion ranges.
  const SampleRange part = replica_[r];
  const int64_t base = part.count / micro_batches_, extra = part.count % micro_batches_;
  return {part.first + k * base + std::min<int64_t>(k, extra), base + (k < extra ? 1 : 0)};
}

double ShardPlan::weight(size_t r, int k) const {
  return static_cast<double>(micro(r, k).count) / static_cast<double>(batch_);
}

}  // namespace dpt
