// The learning-rate schedule: the rate as a function of the step, which the updates compute
// on the device (the formula: kernels/schedule.hpp, shared by the CPU and CUDA updates).
#pragma once
#include <cstdint>
#include <string>

#include <dptrain/enum_names.hpp>
#include <dptrain/types.hpp>

namespace dpt::optim {

// Learning rate as a function of the step (0-based): constant; linear warm-up from 0
// over `warmup` steps then constant; or warm-up then cosine decay to final_lr at `total`.
struct Schedule {
  enum class Kind { constant, warmup, cosine };
  Kind kind = Kind::constant;
  float base_lr = 0.01f;
  int64_t warmup = 0;
  int64_t total = 1;
  float final_lr = 0.0f;
  float at(int64_t step) const;  // on the host, as the device computes it
  ScheduleArgs args() const;     // what the device computes it from
  // A constant rate.
  static Schedule constant_lr(float lr) { return {Kind::constant, lr, 0, 1}; }
};
inline constexpr auto kScheduleNames = enum_names<Schedule::Kind>(
    "schedule",
    {{Schedule::Kind::constant, "constant"}, {Schedule::Kind::warmup, "warmup"}, {Schedule::Kind::cosine, "cosine"}});
Schedule::Kind parse_schedule(const std::string& name);  // UsageError when unknown

}  // namespace dpt::optim
