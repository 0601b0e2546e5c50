// bf16 values as uint16_t (the upper half of an IEEE float) and the two conversions every
// kernel uses, on the host and on the device alike: so the CPU twins and the CUDA kernels
// round each bf16 store the same way (to nearest, ties to even; a NaN stays a quiet NaN),
// and the stochastic rounding of the optimizers' bf16 copy (kernels/shadow.hpp).
#pragma once
#include <cstdint>
#include <cstring>

#include "hd.hpp"

namespace dpt {

// The bits of a 4-byte value read as another 4-byte type (std::bit_cast, which device code
// lacks): memcpy, which both compilers turn into a register move.
template <typename To, typename From>
DPT_HD To bit_copy(From v) {
  static_assert(sizeof(To) == sizeof(From), "bit_copy: types of one size");
  To r;
  std::memcpy(&r, &v, sizeof(r));
  return r;
}

DPT_HD uint32_t float_bits(float f) { return bit_copy<uint32_t>(f); }
DPT_HD float bits_float(uint32_t b) { return bit_copy<float>(b); }

// f rounded to bf16: to nearest, ties to even; a NaN keeps its sign and top payload bits
// and becomes quiet.
DPT_HD uint16_t bf16_round(float f) {
  const uint32_t b = float_bits(f);
  if ((b & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((b >> 16) | 0x40u);
  return static_cast<uint16_t>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

// f rounded to bf16 stochastically by 16 random bits `r` (llm.c's stochastic_rounding):
// r added below the 16 bits that are kept, then truncated, so f rounds away from zero
// with probability (its dropped bits) / 2^16, which is its distance to the bf16 value
// toward zero over the gap between the two: unbiased over uniform r. NaN and Inf as
// bf16_round (a finite f above the largest bf16 may round up to Inf, as it may to nearest).
DPT_HD uint16_t bf16_round_stochastic(float f, uint32_t r) {
  const uint32_t b = float_bits(f);
  if ((b & 0x7f800000u) == 0x7f800000u) return bf16_round(f);
  return static_cast<uint16_t>((b + (r & 0xffffu)) >> 16);
}

// The float a bf16 value stands for (exact).
DPT_HD float bf16_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

}  // namespace dpt
