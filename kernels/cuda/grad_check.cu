// grad_check.cu — the gradient check before an update (check_gradients: the clipping scale
// from ||g||^2, or NaN when a gradient is not finite, and its record in the host's ring),
// its ZeRO form in two halves (shard_check on each shard, finish_check on their sums), and
// clip_coef; twins of kernels/cpu/optim.cpp.
#include <climits>
#include <cstdint>

#include "check.hpp"
#include "common.cuh"
#include "cuda.hpp"
#include "grad_check.cuh"

namespace dpt::cuda {
namespace {

static __global__ void clip_coef_kernel(const float* norm_sq, float max_norm, float* out) {
  *out = scale_from_norm_sq(*norm_sq, max_norm);
}

template <bool Vec>
static __global__ void check_gradients_kernel(const float* g, int64_t n, float max_norm, float* part,
                                              long long* bad_part, unsigned* counter, float* scale, CheckRingArgs ring,
                                              int64_t base, float* sum_out, int64_t* first_out) {
  DPT_WAIT_PREVIOUS_GRID();
  float s = 0.f;
  long long bad = LLONG_MAX;
  check_terms<Vec>(g, n, s, bad);
  check_finish(s, bad, max_norm, part, bad_part, counter, scale, ring, base, sum_out, first_out);
}

// ZeRO: the check from the shards' parts, summed and min'd over the devices.
static __global__ void finish_check_kernel(const float* sum, const int64_t* first, float max_norm, float* scale,
                                           CheckRingArgs ring) {
  write_check(*sum, *first, max_norm, scale, ring, ring_count(ring));
}

}  // namespace

void check_gradients(const float* g, int64_t n, float max_norm, float* scale, float* work, unsigned* counter,
                     const CheckRingArgs& ring, cudaStream_t stream) {
  DPT_CHECK(n >= 0, "check_gradients: negative size");
  DPT_CHECK(scale != nullptr && work != nullptr && counter != nullptr && (n == 0 || g != nullptr),
            "check_gradients: null pointer");
  DPT_CHECK(!ring.records || (ring.slots > 0 && ring.count != nullptr), "check_gradients: a ring without slots");
  const unsigned blocks = reduce_blocks(n, 16);  // as sum_squares
  long long* bad_part = reinterpret_cast<long long*>(work + kReduceWork);
  launch_after_previous(aligned16(g) ? check_gradients_kernel<true> : check_gradients_kernel<false>, blocks, kThreads,
                        stream, g, n, max_norm, work, bad_part, counter, scale, ring, int64_t{0},
                        static_cast<float*>(nullptr), static_cast<int64_t*>(nullptr));
}

void shard_check(const float* g, int64_t n, int64_t base, float* sum, int64_t* first, float* work, unsigned* counter,
                 cudaStream_t stream) {
  DPT_CHECK(
      n >= 0 && sum != nullptr && first != nullptr && work != nullptr && counter != nullptr && (n == 0 || g != nullptr),
      "shard_check: bad arguments");
  const unsigned blocks = reduce_blocks(n, 16);
  long long* bad_part = reinterpret_cast<long long*>(work + kReduceWork);
  launch_after_previous(aligned16(g) ? check_gradients_kernel<true> : check_gradients_kernel<false>, blocks, kThreads,
                        stream, g, n, 0.f, work, bad_part, counter, static_cast<float*>(nullptr), CheckRingArgs{}, base,
                        sum, first);
}

void finish_check(const float* sum, const int64_t* first, float max_norm, float* scale, const CheckRingArgs& ring,
                  cudaStream_t stream) {
  DPT_CHECK(sum != nullptr && first != nullptr && scale != nullptr, "finish_check: null pointer");
  finish_check_kernel<<<1, 1, 0, stream>>>(sum, first, max_norm, scale, ring);
  DPT_CUDA_CHECK_LAUNCH();
}

void clip_coef(const float* norm_sq, float max_norm, float* out, cudaStream_t stream) {
  DPT_CHECK(norm_sq != nullptr && out != nullptr, "clip_coef: null pointer");
  clip_coef_kernel<<<1, 1, 0, stream>>>(norm_sq, max_norm, out);
  DPT_CUDA_CHECK_LAUNCH();
}

}  // namespace dpt::cuda
