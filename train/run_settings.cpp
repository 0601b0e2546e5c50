#include "run_settings.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <limits>

#include <dptrain/runtime/memory.hpp>
#include "model_state.hpp"

namespace dpt {

std::string metadata(const ckpt::Checkpoint& c, const std::string& path, const std::string& key) {
  const auto it = c.metadata.find(key);
  if (it == c.metadata.end()) throw UsageError("checkpoint '" + path + "' has no '" + key + "' in its metadata");
  return it->second;
}

int64_t metadata_int(const ckpt::Checkpoint& c, const std::string& path, const std::string& key, int64_t lo,
                     int64_t hi) {
  const std::string text = metadata(c, path, key);
  int64_t v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (text.empty() || ec != std::errc() || end != text.data() + text.size() || v < lo || v > hi)
    throw UsageError("checkpoint '" + path + "': metadata '" + key + "' must be a whole number in [" +
                     std::to_string(lo) + ", " + std::to_string(hi) + "], got " + ckpt::printable(text));
  return v;
}

void check_fixed_settings(const ckpt::Checkpoint& c, const std::string& path, const SettingText& ours) {
  // The samples follow from the data (its rows): the data is named first when both differ.
  std::vector<const OptionField<TrainConfig>*> fixed;
  for (const OptionField<TrainConfig>& f : train_schema())
    if (f.fixed && f.id.name != "samples") fixed.push_back(&f);
  fixed.push_back(find_field(train_schema(), "samples"));
  for (const OptionField<TrainConfig>* field : fixed) {
    const OptionField<TrainConfig>& f = *field;
    const std::string now = ours(f);
    if (f.id.name == "data") {  // the same data, in the same order: else the position in it means nothing
      const auto it = c.metadata.find("data");
      const std::string made_on = it == c.metadata.end() ? "synthetic" : it->second;  // older checkpoints
      if (made_on != now)
        throw UsageError("checkpoint '" + path + "' was made on other data ({}): " + ckpt::printable(made_on) +
                             ", this run has '" + now + "'",
                         {f.id});
      continue;
    }
    // A key newer than the file (seq, say, which came with GPTs) holds its default there.
    const bool newer = is_newer_checkpoint_key(f.id.name) && !c.metadata.count(f.id.name);
    const std::string was = newer ? f.get(TrainConfig{}) : metadata(c, path, f.id.name);
    if (was == now) continue;
    // samples 0 is the endless stream of synthetic samples, which no flag spells.
    const bool samples = f.id.name == "samples";
    const std::string shown_now = samples && now == "0" ? "an endless stream" : now;
    if (samples && was == "0")
      throw UsageError("checkpoint '" + path + "' was made with an endless stream of samples, this run has " +
                       shown_now);
    throw UsageError(
        "checkpoint '" + path + "' was made with {} " + ckpt::printable(was) + ", this run has " + shown_now, {f.id});
  }
}

namespace {
std::string range_text(const OptionRange& r) {
  return (r.lo_open ? "(" : "[") + option_text::of(r.lo) + ", " + option_text::of(r.hi) + (r.hi_open ? ")" : "]");
}

// "lr 0.05 -> 0.01" when the file's setting `was` differs from this run's; throws UsageError
// when `was` is not a value of the field.
std::string compare(const OptionField<TrainConfig>& f, const std::string& path, const std::string& was,
                    const std::string& now) {
  const std::string& key = f.id.name;
  const std::string where = "checkpoint '" + path + "': metadata '" + key + "' ";
  if (f.kind == OptionKind::real) {
    char* end = nullptr;
    const float v = std::strtof(was.c_str(), &end);
    if (was.empty() || end != was.c_str() + was.size() || !std::isfinite(v) || !f.range->holds(v))
      throw UsageError(where + "must be a number in " + range_text(*f.range) + ", got " + ckpt::printable(was));
    const float ours = std::strtof(now.c_str(), nullptr);
    return v == ours ? "" : key + " " + format_float(v) + " -> " + format_float(ours);
  }
  if (f.kind == OptionKind::integer) {
    const int64_t hi = f.type == "int" ? std::numeric_limits<int>::max() : std::numeric_limits<int64_t>::max();
    const auto lo = static_cast<int64_t>(f.range ? f.range->lo : 0);
    ckpt::Checkpoint one;
    one.metadata[key] = was;
    const int64_t v = metadata_int(one, path, key, lo, hi);
    return std::to_string(v) == now ? "" : key + " " + std::to_string(v) + " -> " + now;
  }
  if (f.kind == OptionKind::boolean) {
    if (was != "true" && was != "false") throw UsageError(where + "must be true or false, got " + ckpt::printable(was));
  } else if (std::find(f.choices.begin(), f.choices.end(), was) == f.choices.end()) {
    throw UsageError(where + ckpt::printable(was) + " is no " + key);
  }
  return was == now ? "" : key + " " + was + " -> " + now;
}
}  // namespace

std::vector<std::string> changed_settings(const ckpt::Checkpoint& c, const std::string& path, const SettingText& ours) {
  std::vector<std::string> changed;
  for (const OptionField<TrainConfig>& f : train_schema()) {
    if (!f.recorded || f.fixed) continue;
    const auto it = c.metadata.find(f.id.name);
    if (it == c.metadata.end()) continue;  // older checkpoints may not have it
    if (std::string line = compare(f, path, it->second, ours(f)); !line.empty()) changed.push_back(std::move(line));
  }
  return changed;
}

}  // namespace dpt
