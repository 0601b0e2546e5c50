#include <dptrain/optim/schedule.hpp>

#include "kernels/schedule.hpp"

namespace dpt::optim {

ScheduleArgs Schedule::args() const {
  return {kind == Kind::constant ? 0 : kind == Kind::warmup ? 1 : 2, base_lr, warmup, total, final_lr};
}

float Schedule::at(int64_t step) const { return schedule_lr(args(), step); }

Schedule::Kind parse_schedule(const std::string& name) { return kScheduleNames.parse(name); }

}  // namespace dpt::optim
