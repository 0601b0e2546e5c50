// The gradient check's device parts, which check_gradients (grad_check.cu) and the checked
// updates (optim_checked.cu) share, so that both find the same sum bit for bit: each
// thread's terms in one order, the blocks' parts, their total, and the scale and record
// written from it. Device code only; included by the .cu files alone.
#pragma once
#include <climits>
#include <cstdint>

#include <dptrain/types.hpp>

#include "../grad_check.hpp"
#include "common.cuh"
#include "loops.cuh"

namespace dpt::cuda {
namespace {

// The smallest value over the block, valid in thread 0 (as block_sum).
__device__ long long block_min(long long v) {
  __shared__ long long warp_part[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int o = 16; o > 0; o /= 2) v = min(v, __shfl_down_sync(0xffffffffu, v, o));
  if (lane == 0) warp_part[warp] = v;
  __syncthreads();
  long long m = LLONG_MAX;
  if (warp == 0) {
    m = lane < static_cast<int>(blockDim.x / 32) ? warp_part[lane] : LLONG_MAX;
    for (int o = 16; o > 0; o /= 2) m = min(m, __shfl_down_sync(0xffffffffu, m, o));
  }
  return m;
}

// The ring's count of records written (0 without a ring). The update kernels read it, as
// the step counter, before their dependent-launch wait: only the kernels that check write
// it, one a step, and by the time an update starts, every kernel before the one ahead of
// it has finished, the last step's check among them (checked_update_kernel says why).
__device__ __forceinline__ int64_t ring_count(const CheckRingArgs& ring) { return ring.records ? *ring.count : 0; }

// The scale from the squared norm and, with a ring, the check's record. One 16-byte store
// (a record is 16-byte aligned), without a system-wide fence on the step's critical path:
// it reaches host memory as one transfer, so the host, which reads the tag first, sees the
// record whole (an assumption about the hardware that CUDA does not document; a torn read
// would pair a new tag with the old scale).
// `count` is the ring's count, read by the caller (ring_count).
__device__ void write_check(float sum, long long first, float max_norm, float* scale, const CheckRingArgs& ring,
                            int64_t count) {
  const float sc = scale_from_norm_sq(sum, max_norm);
  *scale = sc;
  if (!ring.records) return;
  CheckRecord rec;
  CheckRecord* slot = next_check_record(ring, count, sc, first, &rec);
  *reinterpret_cast<int4*>(slot) = *reinterpret_cast<const int4*>(&rec);
}

// The check's terms, in the one order that every kernel of it keeps: a thread adds its
// float4s' squares in increasing index (each float4's four in lane order), then its
// scalar tail, and notes its first non-finite index (its elements come in increasing
// order, so its first is its least).
__device__ __forceinline__ void check_take4(float4 a, int64_t i, float& s, long long& bad) {
  // Rounded operation by operation, as the updates (sgd_update says why): every kernel
  // that checks adds the same bits.
  const float q = __fadd_rn(__fadd_rn(__fadd_rn(__fmul_rn(a.x, a.x), __fmul_rn(a.y, a.y)), __fmul_rn(a.z, a.z)),
                            __fmul_rn(a.w, a.w));
  s = __fadd_rn(s, q);
  if (bad == LLONG_MAX && !(isfinite(a.x) && isfinite(a.y) && isfinite(a.z) && isfinite(a.w)))
    bad = 4 * i + (!isfinite(a.x) ? 0 : !isfinite(a.y) ? 1 : !isfinite(a.z) ? 2 : 3);
}
__device__ __forceinline__ void check_take1(float v, int64_t i, float& s, long long& bad) {
  s = __fadd_rn(s, __fmul_rn(v, v));
  if (bad == LLONG_MAX && !isfinite(v)) bad = i;
}

// A block's part of the check, from its threads' terms: its sum of squares (added as
// sum_squares' partials are, whose terms may be contracted: the two are not held to the
// same bits) and first non-finite index, in part and bad_part; true in thread 0 of the
// last block to write them (the counter says which; it is left at 0).
__device__ bool check_block_part(float s, long long bad, float* part, long long* bad_part, unsigned* counter) {
  s = block_sum(s);
  bad = block_min(bad);
  __shared__ bool last;
  if (threadIdx.x == 0) {
    part[blockIdx.x] = s;
    bad_part[blockIdx.x] = bad;
    __threadfence();  // the partials are visible to every block before the count says so
    last = atomicAdd(counter, 1u) == gridDim.x - 1;
    if (last) *counter = 0;
  }
  __syncthreads();
  return last;
}

// The blocks' parts added in block order, in double, and their first non-finite index;
// valid in thread 0. The additions' order depends on n and the grid alone
// (reduce_blocks), so every kernel that checks with that grid finds the same bits.
__device__ void check_total(const float* part, const long long* bad_part, double& total, long long& first) {
  __threadfence();  // acquire: the blocks' parts are read after their count
  total = 0;
  first = LLONG_MAX;
  for (unsigned b = threadIdx.x; b < gridDim.x; b += blockDim.x) {
    total += __ldcg(part + b);
    first = min(first, __ldcg(bad_part + b));
  }
  total = block_sum(total);
  first = block_min(first);
}

// The check's second half: the last block adds the parts, writes the scale and, with a
// ring, the check's record (or, for a shard's part, its sum and first bad index of the
// whole buffer).
__device__ void check_finish(float s, long long bad, float max_norm, float* part, long long* bad_part,
                             unsigned* counter, float* scale, const CheckRingArgs& ring, int64_t base, float* sum_out,
                             int64_t* first_out) {
  if (!check_block_part(s, bad, part, bad_part, counter)) return;
  double total;
  long long first;
  check_total(part, bad_part, total, first);
  if (threadIdx.x != 0) return;
  if (sum_out) {
    *sum_out = static_cast<float>(total);
    *first_out = first == LLONG_MAX ? LLONG_MAX : base + first;
    return;
  }
  write_check(static_cast<float>(total), first, max_norm, scale, ring, ring_count(ring));
}

// A thread's terms of the check, in check_take's order. Four loads in flight a thread (one
// memory latency for four float4s, where a loop of one load each waited four times).
template <bool Vec>
__device__ void check_terms(const float* g, int64_t n, float& s, long long& bad) {
  int64_t done = 0;
  if constexpr (Vec) {
    four_in_flight(
        n / 4, [&](int64_t q) { return load_four(g + 4 * q); },
        [&](float4 a, int64_t q) { check_take4(a, q, s, bad); });
    done = n / 4 * 4;
  }
  for (int64_t i = done + global_tid(); i < n; i += grid_stride()) check_take1(g[i], i, s, bad);
}

}  // namespace
}  // namespace dpt::cuda
