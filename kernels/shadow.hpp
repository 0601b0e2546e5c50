// The bf16 shadow an optimizer update writes (the copy of the fp32 masters that bf16
// compute reads), rounded to nearest or stochastically (ShadowRounding, types.hpp): the
// one piece of code that the CPU update (kernels/cpu/optim.cpp) and the CUDA updates
// (kernels/cuda/optim_update.cuh) round with, so that both write the same bits.
//
// The random bits of stochastic rounding: element j of the flat parameter buffer at
// optimizer step s (the counter's count before the update) draws the low 16 bits of
// Philox4x32-10 (seed, stream kRoundingStream + s), lane j % 4 of counter block j / 4 (the
// synthetic data's generator, kernels/philox.hpp). A pure function of (seed, s, j): no
// state to carry, and the same on every replica, rank and ZeRO partition, on the CPU and
// the GPU, and after a resume (the checkpoint keeps the step count). One Philox block
// serves a float4 of the update whose flat index is a multiple of 4.
#pragma once
#include <cstdint>

#include <dptrain/types.hpp>

#include "bf16.hpp"
#include "hd.hpp"
#include "philox.hpp"

namespace dpt {

// Far from the parameters' streams (their indices), the synthetic data's (from 2^20) and
// the epochs' permutations (2^40 + epoch).
constexpr uint64_t kRoundingStream = uint64_t{1} << 41;

// The shadow of an update's elements and how it rounds them; the update's step is `step`
// (shadow_store). bits null: no shadow.
struct ShadowStore {
  uint16_t* bits = nullptr;
  bool stochastic = false;
  uint64_t seed = 0;
  int64_t first = 0;  // the flat index of the update's element 0
  int64_t step = 0;

  // Element i of the update holding p, rounded.
  DPT_HD uint16_t round(int64_t i, float p) const {
    if (!stochastic) return bf16_round(p);
    const auto j = static_cast<uint64_t>(first + i);
    const philox::U4 r = philox::philox4x32(seed, kRoundingStream + static_cast<uint64_t>(step), j >> 2);
    return bf16_round_stochastic(p, philox::lane(r, static_cast<int>(j & 3)));
  }
  DPT_HD void store(int64_t i, float p) const {
    if (bits) bits[i] = round(i, p);
  }
  // Elements i .. i + 3 (i a multiple of 4), rounded into out: round()'s bits, from one
  // Philox block where first + i is a multiple of 4.
  DPT_HD void round4(int64_t i, const float* p, uint16_t* out) const {
    if (!stochastic || ((first + i) & 3) != 0) {
      for (int k = 0; k < 4; ++k) out[k] = round(i + k, p[k]);
      return;
    }
    const philox::U4 r =
        philox::philox4x32(seed, kRoundingStream + static_cast<uint64_t>(step), static_cast<uint64_t>(first + i) >> 2);
    out[0] = bf16_round_stochastic(p[0], r.x);
    out[1] = bf16_round_stochastic(p[1], r.y);
    out[2] = bf16_round_stochastic(p[2], r.z);
    out[3] = bf16_round_stochastic(p[3], r.w);
  }
};

// The shadow `bits` of an update at step `step` (the counter's count before it), rounded
// as `r` says.
DPT_HD ShadowStore shadow_store(uint16_t* bits, const ShadowRounding& r, int64_t step) {
  return {bits, r.mode == Bf16Rounding::stochastic, r.seed, r.first, step};
}

}  // namespace dpt
