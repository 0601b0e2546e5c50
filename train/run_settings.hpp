// The run settings a checkpoint records (the fields train_schema() marks recorded, under
// their names) read back on resume. Internal to the library.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <dptrain/train/checkpoint.hpp>
#include <dptrain/train/trainer.hpp>

namespace dpt {

// A field's value as this run records it (Trainer::setting_text).
using SettingText = std::function<std::string(const OptionField<TrainConfig>&)>;

// Metadata `key` of checkpoint `c` (read from `path`); UsageError when it has none.
std::string metadata(const ckpt::Checkpoint& c, const std::string& path, const std::string& key);
// The same read whole as an integer in [lo, hi] ("12abc" is no step count).
int64_t metadata_int(const ckpt::Checkpoint& c, const std::string& path, const std::string& key, int64_t lo,
                     int64_t hi);

// Throws UsageError naming the field of the first setting that a resumed run must share
// with its checkpoint (the model, the data, the batch, ...) and does not.
void check_fixed_settings(const ckpt::Checkpoint& c, const std::string& path, const SettingText& ours);

// The settings a resumed run may change (the learning rate, the schedule, the optimizer's
// hyper-parameters), each checked in its field's range where the file has it (older
// checkpoints may not), and those that changed: "lr 0.05 -> 0.01".
std::vector<std::string> changed_settings(const ckpt::Checkpoint& c, const std::string& path, const SettingText& ours);

}  // namespace dpt
