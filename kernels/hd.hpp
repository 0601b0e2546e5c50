// DPT_HD marks a function that the CPU twins and the CUDA kernels share: host and device
// (inlined) under nvcc, plain inline elsewhere.
#pragma once

#if defined(__CUDACC__)
#define DPT_HD __host__ __device__ __forceinline__
#else
#define DPT_HD inline
#endif

#include <cmath>
#include <cstdint>

#include <dptrain/types.hpp>

namespace dpt {

// The learning rate of `a` at step `step` (0-based), in double as both sides compute it.
DPT_HD float schedule_lr(const ScheduleArgs& a, int64_t step) {
  if (a.kind != 0 && step < a.warmup) return a.base_lr * static_cast<float>(step + 1) / static_cast<float>(a.warmup);
  if (a.kind == 2) {
    const double span = static_cast<double>(a.total - a.warmup > 1 ? a.total - a.warmup : 1);
    const double r = static_cast<double>(step - a.warmup) / span;
    const double t = r < 1.0 ? r : 1.0;
    return static_cast<float>(0.5 * a.base_lr * (1.0 + cos(3.14159265358979323846 * t)));
  }
  return a.base_lr;
}

// One optimizer step's values from its counter: values = {lr at step t, 1 - beta1^(t+1),
// 1 - beta2^(t+1)}, then t + 1.
DPT_HD void advance_step_values(int64_t* t, const ScheduleArgs& a, float beta1, float beta2, float* values) {
  const int64_t s = *t;
  values[0] = schedule_lr(a, s);
  values[1] = 1.0f - powf(beta1, static_cast<float>(s + 1));
  values[2] = 1.0f - powf(beta2, static_cast<float>(s + 1));
  *t = s + 1;
}

}  // namespace dpt
