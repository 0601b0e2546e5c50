// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3"): a
// counter-based generator, so element i of a stream is a pure function of (seed, i).
// The same code runs on the host and on the device; integer and uniform outputs are
// bitwise equal on both, normals equal up to the last bits of logf/sincosf.
#pragma once
#include <cmath>
#include <cstdint>

#include <dptrain/types.hpp>
#include "hd.hpp"

namespace dpt::philox {

struct U4 {
  uint32_t x, y, z, w;
};

DPT_HD uint32_t mulhilo(uint32_t a, uint32_t b, uint32_t* hi) {
  uint64_t p = static_cast<uint64_t>(a) * b;
  *hi = static_cast<uint32_t>(p >> 32);
  return static_cast<uint32_t>(p);
}

// Four 32-bit outputs for counter block `block` of stream (seed, stream).
DPT_HD U4 philox4x32(uint64_t seed, uint64_t stream, uint64_t block) {
  U4 c{static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32), static_cast<uint32_t>(stream),
       static_cast<uint32_t>(stream >> 32)};
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
  for (int r = 0; r < 10; ++r) {
    uint32_t hi0, hi1;
    uint32_t lo0 = mulhilo(0xD2511F53u, c.x, &hi0);
    uint32_t lo1 = mulhilo(0xCD9E8D57u, c.z, &hi1);
    c = U4{hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0};
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c;
}

DPT_HD uint32_t lane(const U4& u, int i) { return i == 0 ? u.x : i == 1 ? u.y : i == 2 ? u.z : u.w; }

// Uniform in (0, 1], exactly representable, identical on host and device.
DPT_HD float to_unit(uint32_t x) { return static_cast<float>((x >> 8) + 1u) * (1.0f / 16777216.0f); }

// Element i of the uniform stream (seed, stream), in [lo, hi). The rounding is pinned on
// the device: nvcc would contract lo + (hi - lo) * u into one FMA, which the host
// compiler does not, and the two must agree bit for bit.
DPT_HD float uniform(uint64_t seed, uint64_t stream, uint64_t i, float lo, float hi) {
  U4 u = philox4x32(seed, stream, i >> 2);
  const float unit = 1.0f - to_unit(lane(u, static_cast<int>(i & 3)));
#if defined(__CUDA_ARCH__)
  return __fadd_rn(lo, __fmul_rn(hi - lo, unit));
#else
  return lo + (hi - lo) * unit;
#endif
}

// Box-Muller: two standard normals from two uniforms in (0, 1]. The angle's cosine and
// sine are sincospi's on the device (no range reduction: a third of the fill's time in
// sinf and cosf), and the same in double, rounded, on the host: equal up to a last bit.
DPT_HD void box_muller(uint32_t a, uint32_t b, float* out) {
  const float r = sqrtf(-2.0f * logf(to_unit(a))), u = to_unit(b);
  float s, c;
#if defined(__CUDA_ARCH__)
  sincospif(2.0f * u, &s, &c);
#else
  const double t = 6.283185307179586 * static_cast<double>(u);
  s = static_cast<float>(std::sin(t));
  c = static_cast<float>(std::cos(t));
#endif
  out[0] = r * c;
  out[1] = r * s;
}

// Element i of the standard-normal stream (seed, stream): Box-Muller on lanes (0,1)
// and (2,3) of block i/4.
DPT_HD float normal(uint64_t seed, uint64_t stream, uint64_t i) {
  U4 u = philox4x32(seed, stream, i >> 2);
  const int l = static_cast<int>(i & 3);
  float v[2];
  box_muller(l < 2 ? u.x : u.z, l < 2 ? u.y : u.w, v);
  return v[l & 1];
}

// Elements 4k .. 4k + 3 of the same stream, from one Philox block: what normal() gives
// each of them, for a quarter of the generator's work.
DPT_HD void normal4(uint64_t seed, uint64_t stream, uint64_t k, float* out) {
  U4 u = philox4x32(seed, stream, k);
  box_muller(u.x, u.y, out);
  box_muller(u.z, u.w, out + 2);
}

// Element i of the stream of tokens uniform in [0, vocab) (synthetic language-model data):
// uniform()'s float in [0, vocab), truncated, and kept below vocab (a float drawn just
// below vocab may round up to it). Identical on host and device, as uniform() is.
DPT_HD int32_t uniform_token(uint64_t seed, uint64_t stream, uint64_t i, int64_t vocab) {
  const auto token = static_cast<int64_t>(uniform(seed, stream, i, 0.0f, static_cast<float>(vocab)));
  return static_cast<int32_t>(token < vocab - 1 ? token : vocab - 1);
}

}  // namespace dpt::philox

namespace dpt {

// The sample that row i of a RowMap is (synthetic data: whose counter the generator takes).
DPT_HD int64_t row_sample(const RowMap& m, int64_t i) {
  const int64_t s = m.first + (i / m.per_group) * m.group_stride + i % m.per_group;
  return m.samples > 0 ? s % m.samples : s;
}

}  // namespace dpt
