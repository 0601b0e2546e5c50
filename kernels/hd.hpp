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
#include <cstring>

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

// An update's values after s steps: {lr at step s, 1 - beta1^(s+1), 1 - beta2^(s+1)}.
DPT_HD void step_values_at(int64_t s, const ScheduleArgs& a, float beta1, float beta2, float* values) {
  values[0] = schedule_lr(a, s);
  values[1] = 1.0f - powf(beta1, static_cast<float>(s + 1));
  values[2] = 1.0f - powf(beta2, static_cast<float>(s + 1));
}

// The sample that row i of a RowMap is.
DPT_HD int64_t row_sample(const RowMap& m, int64_t i) {
  const int64_t s = m.first + (i / m.per_group) * m.group_stride + i % m.per_group;
  return m.samples > 0 ? s % m.samples : s;
}

// isfinite on either side.
DPT_HD bool finite(float x) {
#if defined(__CUDA_ARCH__)
  return isfinite(x);
#else
  return std::isfinite(x);
#endif
}

// The gradient scale from ||g||^2: min(1, max_norm / (||g|| + 1e-6)), 1 when max_norm <= 0
// (no clipping), NaN when ||g||^2 is not finite (the optimizer skips the step).
DPT_HD float scale_from_norm_sq(float sq, float max_norm) {
  if (!finite(sq)) return NAN;
  const float c = max_norm > 0.0f ? max_norm / (sqrtf(sq) + 1e-6f) : 1.0f;
  return c < 1.0f ? c : 1.0f;
}

// The ring's next record (CheckRecord) into *rec, from the scale and the first non-finite
// index found (INT64_MAX: none); counts it, and returns the slot the caller stores it in.
// `count` is the ring's count (*ring.count), read by the caller: an update kernel reads it
// before its dependent-launch wait.
DPT_HD CheckRecord* next_check_record(const CheckRingArgs& ring, int64_t count, float scale, int64_t first_bad,
                                      CheckRecord* rec) {
#if defined(__CUDA_ARCH__)
  rec->scale_bits = __float_as_int(scale);
#else
  std::memcpy(&rec->scale_bits, &scale, 4);
#endif
  rec->index = finite(scale) ? -1 : first_bad < INT32_MAX ? static_cast<int32_t>(first_bad) : INT32_MAX;
  CheckRecord* slot = ring.records + (count % ring.slots);
  rec->tag = count + 1;
  *ring.count = rec->tag;
  return slot;
}

}  // namespace dpt
