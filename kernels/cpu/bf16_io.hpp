// The CPU bf16 twins read bf16 arrays as floats and store floats rounded to bf16 through
// these two helpers (cast_bf16_f32 / cast_f32_bf16), so each store rounds once.
#pragma once
#include <cstdint>
#include <vector>

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

}  // namespace dpt::cpu
