// The CPU bf16 twins read bf16 arrays as floats and store floats rounded to bf16 through
// these two helpers (cast_bf16_f32 / cast_f32_bf16), so each store rounds once.
#pragma once
#include <cstdint>
#include <vector>

#include "../bf16.hpp"
#include "cpu.hpp"

namespace dpt::cpu {

inline std::vector<float> widen(const uint16_t* x, int64_t n) {
  std::vector<float> v(static_cast<size_t>(n));
  cast_bf16_f32(x, v.data(), n);
  return v;
}

inline void narrow(const std::vector<float>& v, uint16_t* out) {
  cast_f32_bf16(v.data(), out, static_cast<int64_t>(v.size()));
}

// One element stored as float or bf16, read as a float; and a float stored, rounded once
// to a bf16 one (as common.cuh's as_float and store): for kernels written once for both.
inline float as_float(float v) { return v; }
inline float as_float(uint16_t v) { return bf16_float(v); }
inline void store(float* p, float v) { *p = v; }
inline void store(uint16_t* p, float v) { *p = bf16_round(v); }

}  // namespace dpt::cpu
