// row_softmax.cuh — what the kernels that take a softmax over rows share (loss.cu's
// cross-entropy, classifier.cu's fused classifier): the online softmax statistics of a row
// and their merge across a warp, and the mean of per-row values in a fixed order.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "common.cuh"

namespace dpt::cuda {

// One pass over a row (online softmax, Milakov & Gimelshein 2018): each thread keeps the
// running max of its columns and the sum of exp(x - max), rescaled when the max grows; the
// threads then merge pairwise. -inf terms contribute 0 explicitly, since exp(-inf - -inf)
// would be NaN; a row of only -inf still ends as log(0) - -inf = NaN, as on the CPU, and a
// NaN anywhere makes the sum NaN, as on the CPU.
struct RowStats {
  float max, sum;
};

// s (a sum taken against max m) rescaled to the max `to` >= m. While m is still -inf, s
// is 0, or NaN if a NaN came first: it passes through as it is, the NaN included.
__device__ __forceinline__ float scaled(float s, float m, float to) { return m == -INFINITY ? s : s * expf(m - to); }

__device__ __forceinline__ void online_add(float v, float& m, float& s) {
  if (v > m) {
    s = scaled(s, m, v) + 1.f;
    m = v;
  } else if (v != -INFINITY) {
    s += expf(v - m);
  }
}

// Two threads' statistics as one.
__device__ __forceinline__ RowStats merge(RowStats a, RowStats b) {
  const float m = fmaxf(a.max, b.max);
  return {m, scaled(a.sum, a.max, m) + scaled(b.sum, b.max, m)};
}

// Butterfly merge over the warp: the two terms of the sum swap between partners, and
// float addition is commutative, so all lanes end with the same bits.
__device__ __forceinline__ RowStats warp_merge(RowStats st) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    st = merge(st, {__shfl_xor_sync(0xffffffffu, st.max, o), __shfl_xor_sync(0xffffffffu, st.sum, o)});
  return st;
}

// Stage two of a mean (or sum) over rows: *out = scale * sum(part[0 .. count)), one block,
// in double, in a fixed order.
static __global__ void finish_sum_kernel(const float* part, int64_t count, double scale, float* out) {
  double s = 0;
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) s += part[i];
  s = block_sum(s);
  if (threadIdx.x == 0) *out = static_cast<float>(s * scale);
}

static inline void finish_sum(const float* part, int64_t count, double scale, float* out, cudaStream_t stream) {
  finish_sum_kernel<<<1, kFinishThreads, 0, stream>>>(part, count, scale, out);
}

}  // namespace dpt::cuda
