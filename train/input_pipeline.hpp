// The Trainer's side of the input pipeline (data/feeder.hpp): the data sets its config's
// files make, and each replica's share of the steps, from the replicator's ShardPlan, which
// data/ does not know. Internal to the library.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <dptrain/parallel/shard_plan.hpp>
#include <dptrain/runtime/device.hpp>
#include <dptrain/train/trainer.hpp>

#include "data/feeder.hpp"

namespace dpt {

// Training rows and validation rows (null where none are asked for).
using DataPair = std::pair<std::shared_ptr<const data::Dataset>, std::shared_ptr<const data::Dataset>>;

// The rows of TrainConfig::data, and the validation rows that the config asks for.
DataPair load_files(const TrainConfig& cfg);

// The first file of val_data's that data names too ("" if none): its rows would be trained
// on and validated on alike.
std::string file_in_both(const TrainConfig& cfg);

// The samples replica `replica` asks for after samples from `first` (global: step * batch
// + its micro-batch's offset): its next micro-batch of the step (empty ones ask for
// nothing), else its first of the next step.
SampleRange next_shard(const ShardPlan& plan, size_t replica, int64_t first);

// Every replica's share of a run of `steps` steps of `plan`, on `devices` (one a replica).
std::vector<data::ReplicaShare> replica_shares(const ShardPlan& plan, const std::vector<Device>& devices,
                                               int64_t steps);

}  // namespace dpt
