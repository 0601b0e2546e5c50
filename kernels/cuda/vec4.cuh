// vec4.cuh — the loop of the memory-bound kernels, written once: a grid-stride loop over
// groups of four elements (one 16-byte float4 access, or 8 bytes of bf16) where the
// pointers allow it, then the elements after the last whole group one at a time; the same
// with four loads in flight a thread; and the four-element loads and stores, float or bf16.
// A thread visits its indices in increasing order, so a sum it keeps has a fixed order.
#pragma once
#include <cstdint>

#include "../bf16.hpp"
#include "common.cuh"

namespace dpt::cuda {

// Four consecutive elements in one access: a float4, or for bf16 a ushort4 (8 bytes),
// read as floats and stored rounded once (as_float and store, four at a time).
__device__ __forceinline__ float4 load_four(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float4 load_four(const uint16_t* p) {
  const ushort4 v = *reinterpret_cast<const ushort4*>(p);
  return make_float4(bf16_float(v.x), bf16_float(v.y), bf16_float(v.z), bf16_float(v.w));
}
__device__ __forceinline__ void store_four(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }
__device__ __forceinline__ void store_four(uint16_t* p, float4 v) {
  *reinterpret_cast<ushort4*>(p) = make_ushort4(bf16_round(v.x), bf16_round(v.y), bf16_round(v.z), bf16_round(v.w));
}

// four(q) for every group q < n / 4 when Vec (elements 4q .. 4q + 3), then one(i) for
// every element i from 4 * (n / 4) (from 0 without Vec), each loop grid-strided.
template <bool Vec, typename Four, typename One>
__device__ __forceinline__ void vec4_loop(int64_t n, Four four, One one) {
  const int64_t tid = global_tid(), stride = grid_stride();
  int64_t done = 0;
  if constexpr (Vec) {
    for (int64_t q = tid; q < n / 4; q += stride) four(q);
    done = n / 4 * 4;
  }
  for (int64_t i = done + tid; i < n; i += stride) one(i);
}

// use(load(i), i) for every i < n, grid-strided, with four loads in flight a thread before
// their uses (one memory latency for four loads, where a loop of one load each waits four
// times); each thread still uses its indices in increasing order.
template <typename Load, typename Use>
__device__ __forceinline__ void four_in_flight(int64_t n, Load load, Use use) {
  const int64_t stride = grid_stride();
  int64_t i = global_tid();
  for (; i + 3 * stride < n; i += 4 * stride) {
    decltype(load(i)) v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) v[u] = load(i + u * stride);
#pragma unroll
    for (int u = 0; u < 4; ++u) use(v[u], i + u * stride);
  }
  for (; i < n; i += stride) use(load(i), i);
}

}  // namespace dpt::cuda
