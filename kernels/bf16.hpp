// bf16 values as uint16_t (the upper half of an IEEE float) and the two conversions every
// kernel uses, on the host and on the device alike: so the CPU twins and the CUDA kernels
// round each bf16 store the same way (to nearest, ties to even; a NaN stays a quiet NaN).
#pragma once
#include <cstdint>
#include <cstring>

#include "hd.hpp"

namespace dpt {

DPT_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
#endif
}

DPT_HD float bits_float(uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(b);
#else
  float f;
  std::memcpy(&f, &b, 4);
  return f;
#endif
}

// f rounded to bf16: to nearest, ties to even; a NaN keeps its sign and top payload bits
// and becomes quiet.
DPT_HD uint16_t bf16_round(float f) {
  const uint32_t b = float_bits(f);
  if ((b & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((b >> 16) | 0x40u);
  return static_cast<uint16_t>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

// The float a bf16 value stands for (exact).
DPT_HD float bf16_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

}  // namespace dpt
