// The learning-rate schedule as an update computes it, on the host and on the device: the
// formula behind optim::Schedule (include/dptrain/optim/schedule.hpp), which the CPU and CUDA
// updates evaluate from their step counter (StepCounterArgs), so that a CUDA graph's
// replays follow the schedule without the host.
#pragma once
#include <cmath>
#include <cstdint>

#include <dptrain/types.hpp>
#include "hd.hpp"

namespace dpt {

// The learning rate of `a` at step `step` (0-based), in double as both sides compute it.
DPT_HD float schedule_lr(const ScheduleArgs& a, int64_t step) {
  if (a.kind != 0 && step < a.warmup) return a.base_lr * static_cast<float>(step + 1) / static_cast<float>(a.warmup);
  if (a.kind == 2) {
    const double span = static_cast<double>(a.total - a.warmup > 1 ? a.total - a.warmup : 1);
    const double r = static_cast<double>(step - a.warmup) / span;
    const double t = r < 1.0 ? r : 1.0;
    // final + (base - final) (1 + cos) / 2, in that order: with final 0 the formula PyTorch's
    // CosineAnnealingLR computes, bit for bit as before.
    return static_cast<float>(a.final_lr + 0.5 * (a.base_lr - a.final_lr) * (1.0 + cos(3.14159265358979323846 * t)));
  }
  return a.base_lr;
}

// An update's values after s steps: {lr at step s, 1 - beta1^(s+1), 1 - beta2^(s+1)}.
DPT_HD void step_values_at(int64_t s, const ScheduleArgs& a, float beta1, float beta2, float* values) {
  values[0] = schedule_lr(a, s);
  values[1] = 1.0f - powf(beta1, static_cast<float>(s + 1));
  values[2] = 1.0f - powf(beta2, static_cast<float>(s + 1));
}

}  // namespace dpt
