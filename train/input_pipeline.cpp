#include "input_pipeline.hpp"

#include <filesystem>
#include <string>

#include <dptrain/data/tokens.hpp>
#include <dptrain/error.hpp>
#include <dptrain/layers/model_spec.hpp>

#include "common/text.hpp"
#include "field_error.hpp"

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

data::DataSplit open_data_file(const std::string& path, const std::string& targets, const char* field,
                               const char* targets_field, bool need_targets) {
  auto ends_with = [&](const std::string& tail) {
    return path.size() >= tail.size() && path.compare(path.size() - tail.size(), tail.size(), tail) == 0;
  };
  if (ends_with(".safetensors")) {
    if (!targets.empty()) bad(targets_field, "'" + targets + "': a safetensors data file holds its own targets (y)");
    return data::ArrayDataset::from_safetensors(path);
  }
  if (!ends_with(".npy"))
    bad(field, "'" + path + "' is neither a .npy nor a .safetensors file" +
                   (ends_with(".bin") ? " (token shards train a GPT: --model gpt2 or gpt:...)" : ""));
  if (targets.empty() && need_targets)
    bad(targets_field, "is needed with a .npy data file (the targets: a .npy file of rows or labels)");
  return {data::ArrayDataset::from_npy(path, targets), std::nullopt};
}

namespace {

// A GPT's TrainConfig::data or val_data: a list of patterns (comma-separated).
std::vector<std::string> patterns(const std::string& list) {
  std::vector<std::string> out = split(list, ',');
  std::erase(out, std::string());
  return out;
}

// A GPT's token files, for training and (where given) validation.
DataPair load_token_files(const TrainConfig& cfg) {
  if (!cfg.targets.empty() || !cfg.val_targets.empty())
    bad(cfg.targets.empty() ? "val_targets" : "targets",
        "is for array data; a token file's targets are its next tokens");
  if (cfg.val_fraction > 0)
    bad("val_fraction", "is for array data; give a GPT's validation tokens with {}", {"val_data"});
  const int64_t T = cfg.seq > 0 ? cfg.seq : nn::parse_gpt_spec(cfg.model).context;
  std::shared_ptr<const data::Dataset> val;
  if (!cfg.val_data.empty())
    val = std::make_shared<data::TokenDataset>(data::expand_data_patterns(patterns(cfg.val_data)), T);
  return {std::make_shared<data::TokenDataset>(data::expand_data_patterns(patterns(cfg.data)), T), val};
}

}  // namespace

std::string file_in_both(const TrainConfig& cfg) {
  auto files = [&](const std::string& list) {  // an array file is one path
    return nn::is_gpt_spec(cfg.model) ? data::expand_data_patterns(patterns(list)) : std::vector<std::string>{list};
  };
  const std::vector<std::string> trained = files(cfg.data);
  for (const std::string& v : files(cfg.val_data))
    for (const std::string& t : trained) {
      std::error_code ec;
      if (std::filesystem::equivalent(v, t, ec) && !ec) return v;
    }
  return "";
}

DataPair load_files(const TrainConfig& cfg) {
  if (nn::is_gpt_spec(cfg.model)) return load_token_files(cfg);
  data::DataSplit main = open_data_file(cfg.data, cfg.targets, "data", "targets", true);
  std::optional<data::ArrayDataset> val = std::move(main.val);
  const int sources = (val ? 1 : 0) + (cfg.val_data.empty() ? 0 : 1) + (cfg.val_fraction > 0 ? 1 : 0);
  if (sources > 1)
    bad("val_data", "and {} (and a data file's x_val) are other sources of validation rows: give one",
        {"val_fraction"});
  if (!cfg.val_data.empty()) {
    data::DataSplit v = open_data_file(cfg.val_data, cfg.val_targets, "val_data", "val_targets", true);
    if (v.val) bad("val_data", "'" + cfg.val_data + "' holds validation rows of its own (x_val)");
    val = std::move(v.train);
  } else if (!cfg.val_targets.empty()) {
    bad("val_targets", "needs {} (the validation inputs)", {"val_data"});
  }
  if (cfg.val_fraction > 0) {
    data::DataSplit split = main.train.split(cfg.val_fraction);
    main.train = std::move(split.train);
    val = std::move(split.val);
  }
  std::shared_ptr<const data::Dataset> v;
  if (val) v = std::make_shared<data::ArrayDataset>(std::move(*val));
  return {std::make_shared<data::ArrayDataset>(std::move(main.train)), v};
}

}  // namespace dpt
