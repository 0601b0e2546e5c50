// common.cuh — the device helpers that the kernel files share, each defined once so that it
// has one meaning everywhere:
// - warp_sum and block_sum, the sums in their fixed order. Bit-for-bit determinism (the
//   same inputs give the same bits on any GPU and any run) rests on adding the same floats
//   in the same order, so every deterministic reduction adds through these two.
#pragma once
#include <cuda_runtime.h>

namespace dpt::cuda {

// ---- reductions in a fixed order --------------------------------------------------------

// Butterfly reductions: float addition is commutative, so every lane ends with the same
// bits.
template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum over the block, valid in thread 0. blockDim.x must be a multiple of 32, <= 1024.
template <typename T>
__device__ T block_sum(T v) {
  __shared__ T warp_part[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  v = warp_sum(v);
  if (lane == 0) warp_part[warp] = v;
  __syncthreads();
  T t = 0;
  if (warp == 0) {
    t = lane < static_cast<int>(blockDim.x / 32) ? warp_part[lane] : T(0);
    t = warp_sum(t);
  }
  return t;
}

}  // namespace dpt::cuda
