// What an input pipeline did: the host's gathers of rows into page-locked memory and the
// copies to the devices (file data on GPUs; all zero otherwise). A run's, summed over its
// replicas, is TrainResult::input.
#pragma once
#include <cstdint>

namespace dpt::data {

struct InputStats {
  int64_t loads = 0;      // shards gathered and copied
  uint64_t bytes = 0;     // bytes gathered (inputs and targets)
  double gather_s = 0.0;  // host seconds spent gathering them
  double copy_ms = 0.0;   // device milliseconds of the copies timed so far
  int64_t timed_copies = 0;
  double gather_gb_per_s() const { return gather_s > 0 ? static_cast<double>(bytes) / gather_s / 1e9 : 0.0; }
  InputStats& operator+=(const InputStats& o) {
    loads += o.loads, bytes += o.bytes, gather_s += o.gather_s, copy_ms += o.copy_ms, timed_copies += o.timed_copies;
    return *this;
  }
};

}  // namespace dpt::data
