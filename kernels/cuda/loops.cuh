// loops.cuh — the loops the kernels share, each written once:
// - vec4_loop, the memory-bound kernels' grid-stride loop over groups of four elements (one
//   16-byte float4 access, or 8 bytes of bf16) where the pointers allow it, then the
//   elements after the last whole group one at a time; four_in_flight, a grid-stride loop
//   with four loads in flight a thread; load_four and store_four, the groups' float or
//   bf16 access.
//   A thread visits its indices in increasing order, so a sum it keeps has a fixed order.
// - on_warp_row and warp_row_blocks: the kernels that give each row of a matrix a warp
//   (kWarps rows a block of kThreads), device side and launch side.
#pragma once
#include <cstdint>
#include <string>

#include <dptrain/error.hpp>

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

// f(r, lane, row) in each warp whose row r < rows exists: `row` is row r of the [rows,
// cols] matrix m, `lane` the thread's lane (0..31); the warps past the last row return.
template <typename T, typename F>
__device__ __forceinline__ void on_warp_row(T* m, int64_t rows, int64_t cols, F f) {
  const int64_t r = blockIdx.x * static_cast<int64_t>(kWarps) + threadIdx.x / 32;
  if (r >= rows) return;
  f(r, static_cast<int>(threadIdx.x % 32), m + r * cols);
}

// The grid of a kernel that gives each of `rows` rows a warp (blocks of kThreads).
inline unsigned warp_row_blocks(const char* who, int64_t rows) {
  const int64_t blocks = (rows + kWarps - 1) / kWarps;
  DPT_CHECK(blocks <= 0x7fffffff, std::string(who) + ": too many rows");
  return static_cast<unsigned>(blocks);
}

}  // namespace dpt::cuda
