// The gradient check that clipping and the finite check share, on the host and on the
// device: the scale from the gradients' squared norm, and the record a check writes into
// its ring (CheckRecord, CheckRingArgs in include/dptrain/types.hpp).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include <dptrain/types.hpp>
#include "hd.hpp"

namespace dpt {

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
