// The Trainer's side of the input pipeline (data/feeder.hpp): each replica's share of the
// steps, from the replicator's ShardPlan, which data/ does not know. Internal to the library.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include <dptrain/parallel/shard_plan.hpp>
#include <dptrain/runtime/device.hpp>

#include "data/feeder.hpp"

namespace dpt {

// The samples replica `replica` asks for after samples from `first` (global: step * batch
// + its micro-batch's offset): its next micro-batch of the step (empty ones ask for
// nothing), else its first of the next step.
SampleRange next_shard(const ShardPlan& plan, size_t replica, int64_t first);

// Every replica's share of a run of `steps` steps of `plan`, on `devices` (one a replica).
std::vector<data::ReplicaShare> replica_shares(const ShardPlan& plan, const std::vector<Device>& devices,
                                               int64_t steps);

}  // namespace dpt
