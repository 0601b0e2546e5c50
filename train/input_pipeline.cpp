#include "input_pipeline.hpp"

#include <string>

#include <dptrain/error.hpp>

namespace dpt {

SampleRange next_shard(const ShardPlan& plan, size_t replica, int64_t first) {
  const int64_t batch = plan.batch(), step_first = first - first % batch, offset = first % batch;
  const int k_total = plan.micro_batches();
  int k = 0;
  while (k < k_total && plan.micro(replica, k).first != offset) ++k;
  DPT_CHECK(k < k_total, "next_shard: sample " + std::to_string(first) + " starts no micro-batch of replica " +
                             std::to_string(replica));
  int next = k + 1;
  while (next < k_total && plan.micro(replica, next).count == 0) ++next;
  if (next < k_total) return {step_first + plan.micro(replica, next).first, plan.micro(replica, next).count};
  return {step_first + batch + plan.micro(replica, 0).first, plan.micro(replica, 0).count};
}

std::vector<data::ReplicaShare> replica_shares(const ShardPlan& plan, const std::vector<Device>& devices,
                                               int64_t steps) {
  const int64_t end = steps * plan.batch();  // nothing to make after the run
  std::vector<data::ReplicaShare> shares;
  for (size_t r = 0; r < devices.size(); ++r) {
    const SampleRange part = plan.replica_part(r);
    auto next = [plan, r, end](int64_t first) {
      const SampleRange n = next_shard(plan, r, first);
      return n.first < end ? data::Samples{n.first, n.count} : data::Samples{};
    };
    // The first micro-batches are the largest.
    shares.push_back({devices[r], plan.batch(), {part.first, part.count}, plan.micro(r, 0).count, end, next});
  }
  return shares;
}

}  // namespace dpt
