// optim.cu — fused SGD and AdamW updates over a flat parameter buffer, and the gradient
// clipping coefficient; twins of kernels/cpu optim.cpp (PyTorch's semantics).
//
// One pass reads each parameter, gradient and state once and writes them once, float4 at a
// time when every buffer is 16-byte aligned (the last n % 4 elements go scalar). The
// gradient scale stays on the device (clip_coef writes it), so clipping needs no host
// round trip. With a bf16 shadow (bf16 training) the same pass also writes the updated
// parameters rounded to bf16, so the copy that the GEMMs read costs no pass of its own.
#include <algorithm>
#include <climits>
#include <cstdint>

#include "../bf16.hpp"
#include "../hd.hpp"
#include "check.hpp"
#include "common.cuh"
#include "cuda.hpp"

namespace dpt::cuda {
namespace {

// The same expressions, in the same order, as the CPU twin.
__device__ __forceinline__ void sgd_update(float& p, float g, float& buf, const SgdArgs& a, float scale) {
  float d = g * scale + a.weight_decay * p;
  if (a.momentum != 0.f) {
    buf = a.momentum * buf + (1.f - a.dampening) * d;
    d = a.nesterov ? d + a.momentum * buf : buf;
  }
  p -= a.lr * d;
}

__device__ __forceinline__ void adamw_update(float& p, float g, float& m, float& v, const AdamArgs& a, float scale) {
  const float d = g * scale;
  p -= a.lr * a.weight_decay * p;
  m = a.beta1 * m + (1.f - a.beta1) * d;
  v = a.beta2 * v + (1.f - a.beta2) * d * d;
  p -= a.lr * (m / a.bias_correction1) / (sqrtf(v / a.bias_correction2) + a.eps);
}

// With a step counter: the step's values from it (every thread reads it), `s` its count.
__device__ __forceinline__ int64_t read_step(const StepCounterArgs& step, float* values) {
  if (!step.t) return 0;
  const int64_t s = *step.t;
  step_values_at(s, step.schedule, step.beta1, step.beta2, values);
  return s;
}

// The last block to finish moves the counter on (once every thread has read it) and
// leaves the block count at 0 for the next step.
__device__ __forceinline__ void count_step(const StepCounterArgs& step, int64_t s) {
  if (!step.t) return;
  __syncthreads();
  if (threadIdx.x != 0) return;
  __threadfence();
  if (atomicAdd(step.blocks_done, 1u) == gridDim.x - 1) {
    *step.t = s + 1;
    *step.blocks_done = 0;
  }
}

// buf is read and written only with momentum (it may be null without);
// shadow (may be null) gets bf16(p) of every updated element.
template <bool Vec>
__device__ __forceinline__ void sgd_loop(float* p, const float* g, float* buf, int64_t n, const SgdArgs& a, float scale,
                                         uint16_t* shadow) {
  const bool mom = a.momentum != 0.f;
  const int64_t tid = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t done = 0;
  if constexpr (Vec) {
    float4* p4 = reinterpret_cast<float4*>(p);
    const float4* g4 = reinterpret_cast<const float4*>(g);
    float4* b4 = reinterpret_cast<float4*>(buf);
    const int64_t n4 = n / 4;
    for (int64_t i = tid; i < n4; i += stride) {
      float4 pv = p4[i];
      const float4 gv = g4[i];
      float4 bv = mom ? b4[i] : make_float4(0.f, 0.f, 0.f, 0.f);
      sgd_update(pv.x, gv.x, bv.x, a, scale);
      sgd_update(pv.y, gv.y, bv.y, a, scale);
      sgd_update(pv.z, gv.z, bv.z, a, scale);
      sgd_update(pv.w, gv.w, bv.w, a, scale);
      p4[i] = pv;
      if (mom) b4[i] = bv;
      if (shadow)
        reinterpret_cast<ushort4*>(shadow)[i] =
            make_ushort4(bf16_round(pv.x), bf16_round(pv.y), bf16_round(pv.z), bf16_round(pv.w));
    }
    done = 4 * n4;
  }
  for (int64_t i = done + tid; i < n; i += stride) {
    float pv = p[i];
    float bv = mom ? buf[i] : 0.f;
    sgd_update(pv, g[i], bv, a, scale);
    p[i] = pv;
    if (mom) buf[i] = bv;
    if (shadow) shadow[i] = bf16_round(pv);
  }
}

template <bool Vec>
static __global__ void sgd_step_kernel(float* p, const float* g, float* buf, int64_t n, SgdArgs a,
                                       const float* grad_scale, uint16_t* shadow, StepCounterArgs step) {
  DPT_WAIT_PREVIOUS_GRID();
  float values[3] = {a.lr, 1.f, 1.f};
  const int64_t s = read_step(step, values);
  a.lr = values[0];
  const float scale = grad_scale ? *grad_scale : 1.f;
  if (isfinite(scale)) sgd_loop<Vec>(p, g, buf, n, a, scale, shadow);  // else the whole update is skipped
  count_step(step, s);
}

template <bool Vec>
__device__ __forceinline__ void adamw_loop(float* p, const float* g, float* m, float* v, int64_t n, const AdamArgs& a,
                                           float scale, uint16_t* shadow) {
  const int64_t tid = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t done = 0;
  if constexpr (Vec) {
    float4* p4 = reinterpret_cast<float4*>(p);
    const float4* g4 = reinterpret_cast<const float4*>(g);
    float4* m4 = reinterpret_cast<float4*>(m);
    float4* v4 = reinterpret_cast<float4*>(v);
    const int64_t n4 = n / 4;
    for (int64_t i = tid; i < n4; i += stride) {
      float4 pv = p4[i], mv = m4[i], vv = v4[i];
      const float4 gv = g4[i];
      adamw_update(pv.x, gv.x, mv.x, vv.x, a, scale);
      adamw_update(pv.y, gv.y, mv.y, vv.y, a, scale);
      adamw_update(pv.z, gv.z, mv.z, vv.z, a, scale);
      adamw_update(pv.w, gv.w, mv.w, vv.w, a, scale);
      p4[i] = pv;
      m4[i] = mv;
      v4[i] = vv;
      if (shadow)
        reinterpret_cast<ushort4*>(shadow)[i] =
            make_ushort4(bf16_round(pv.x), bf16_round(pv.y), bf16_round(pv.z), bf16_round(pv.w));
    }
    done = 4 * n4;
  }
  for (int64_t i = done + tid; i < n; i += stride) {
    float pv = p[i], mv = m[i], vv = v[i];
    adamw_update(pv, g[i], mv, vv, a, scale);
    p[i] = pv;
    m[i] = mv;
    v[i] = vv;
    if (shadow) shadow[i] = bf16_round(pv);
  }
}

template <bool Vec>
static __global__ void adamw_step_kernel(float* p, const float* g, float* m, float* v, int64_t n, AdamArgs a,
                                         const float* grad_scale, uint16_t* shadow, StepCounterArgs step) {
  DPT_WAIT_PREVIOUS_GRID();
  float values[3] = {a.lr, a.bias_correction1, a.bias_correction2};
  const int64_t s = read_step(step, values);
  a.lr = values[0];
  a.bias_correction1 = values[1];
  a.bias_correction2 = values[2];
  const float scale = grad_scale ? *grad_scale : 1.f;
  if (isfinite(scale)) adamw_loop<Vec>(p, g, m, v, n, a, scale, shadow);  // else the whole update is skipped
  count_step(step, s);
}

static __global__ void clip_coef_kernel(const float* norm_sq, float max_norm, float* out) {
  *out = scale_from_norm_sq(*norm_sq, max_norm);
}

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

// The scale from the squared norm and, with a ring, the check's record. One 16-byte store
// (a record is 16-byte aligned), without a system-wide fence on the step's critical path:
// it reaches host memory as one transfer, so the host, which reads the tag first, sees the
// record whole (an assumption about the hardware that CUDA does not document; a torn read
// would pair a new tag with the old scale).
__device__ void write_check(float sum, long long first, float max_norm, float* scale, const CheckRingArgs& ring) {
  const float sc = scale_from_norm_sq(sum, max_norm);
  *scale = sc;
  if (!ring.records) return;
  CheckRecord rec;
  CheckRecord* slot = next_check_record(ring, sc, first, &rec);
  *reinterpret_cast<int4*>(slot) = *reinterpret_cast<const int4*>(&rec);
}

// One pass over the gradients: each block's sum of squares (as sum_squares' partials) and
// its first non-finite index; the last block to finish (the counter says which) adds the
// sums in block order, in double, writes the scale and, with a ring, the check's record,
// and leaves the counter at 0.
template <bool Vec>
static __global__ void check_gradients_kernel(const float* g, int64_t n, float max_norm, float* part,
                                              long long* bad_part, unsigned* counter, float* scale, CheckRingArgs ring,
                                              int64_t base, float* sum_out, int64_t* first_out) {
  float s = 0.f;
  long long bad = LLONG_MAX;  // a thread's elements come in increasing order: its first is its least
  int64_t done = 0;
  if constexpr (Vec) {
    const float4* g4 = reinterpret_cast<const float4*>(g);
    for (int64_t i = global_tid(); i < n / 4; i += grid_stride()) {
      const float4 a = g4[i];
      s += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w;
      if (bad == LLONG_MAX && !(isfinite(a.x) && isfinite(a.y) && isfinite(a.z) && isfinite(a.w)))
        bad = 4 * i + (!isfinite(a.x) ? 0 : !isfinite(a.y) ? 1 : !isfinite(a.z) ? 2 : 3);
    }
    done = n / 4 * 4;
  }
  for (int64_t i = done + global_tid(); i < n; i += grid_stride()) {
    s += g[i] * g[i];
    if (bad == LLONG_MAX && !isfinite(g[i])) bad = i;
  }
  s = block_sum(s);
  bad = block_min(bad);
  __shared__ bool last;
  if (threadIdx.x == 0) {
    part[blockIdx.x] = s;
    bad_part[blockIdx.x] = bad;
    __threadfence();  // the partials are visible to every block before the count says so
    last = atomicAdd(counter, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();  // acquire: the other blocks' partials are read after their count
  double total = 0;
  long long first = LLONG_MAX;
  for (unsigned b = threadIdx.x; b < gridDim.x; b += blockDim.x) {
    total += __ldcg(part + b);
    first = min(first, __ldcg(bad_part + b));
  }
  total = block_sum(total);
  first = block_min(first);
  if (threadIdx.x != 0) return;
  *counter = 0;
  if (sum_out) {  // a shard's part: its sum and first bad index (of the whole buffer)
    *sum_out = static_cast<float>(total);
    *first_out = first == LLONG_MAX ? LLONG_MAX : base + first;
    return;
  }
  write_check(static_cast<float>(total), first, max_norm, scale, ring);
}

// ZeRO: the check from the shards' parts, summed and min'd over the devices.
static __global__ void finish_check_kernel(const float* sum, const int64_t* first, float max_norm, float* scale,
                                           CheckRingArgs ring) {
  write_check(*sum, *first, max_norm, scale, ring);
}

}  // namespace

// An empty update (an empty ZeRO shard) is still launched with a counter: one block moves
// it on.
void sgd_step(float* p, const float* g, float* momentum_buf, int64_t n, const SgdArgs& a, const float* grad_scale,
              uint16_t* shadow, const StepCounterArgs& step, cudaStream_t stream) {
  DPT_CHECK(n >= 0, "sgd_step: negative size");
  if (n == 0 && !step.t) return;
  const bool mom = a.momentum != 0.f;
  DPT_CHECK(n == 0 || (p != nullptr && g != nullptr && (!mom || momentum_buf != nullptr)),
            "sgd_step: null parameters, gradients or momentum buffer");
  DPT_CHECK(!step.t || step.blocks_done != nullptr, "sgd_step: a step counter without its block count");
  const bool vec = aligned16(p) && aligned16(g) && (!mom || aligned16(momentum_buf)) && aligned(shadow, 8);
  if (vec)
    launch_after_previous(sgd_step_kernel<true>, blocks_for(n / 4), kThreads, stream, p, g, momentum_buf, n, a,
                          grad_scale, shadow, step);
  else
    launch_after_previous(sgd_step_kernel<false>, blocks_for(n), kThreads, stream, p, g, momentum_buf, n, a, grad_scale,
                          shadow, step);
}

void adamw_step(float* p, const float* g, float* m, float* v, int64_t n, const AdamArgs& a, const float* grad_scale,
                uint16_t* shadow, const StepCounterArgs& step, cudaStream_t stream) {
  DPT_CHECK(n >= 0, "adamw_step: negative size");
  if (n == 0 && !step.t) return;
  DPT_CHECK(n == 0 || (p != nullptr && g != nullptr && m != nullptr && v != nullptr), "adamw_step: null pointer");
  DPT_CHECK(!step.t || step.blocks_done != nullptr, "adamw_step: a step counter without its block count");
  const bool vec = aligned16(p) && aligned16(g) && aligned16(m) && aligned16(v) && aligned(shadow, 8);
  if (vec)
    launch_after_previous(adamw_step_kernel<true>, blocks_for(n / 4), kThreads, stream, p, g, m, v, n, a, grad_scale,
                          shadow, step);
  else
    launch_after_previous(adamw_step_kernel<false>, blocks_for(n), kThreads, stream, p, g, m, v, n, a, grad_scale,
                          shadow, step);
}

void check_gradients(const float* g, int64_t n, float max_norm, float* scale, float* work, unsigned* counter,
                     const CheckRingArgs& ring, cudaStream_t stream) {
  DPT_CHECK(n >= 0, "check_gradients: negative size");
  DPT_CHECK(scale != nullptr && work != nullptr && counter != nullptr && (n == 0 || g != nullptr),
            "check_gradients: null pointer");
  DPT_CHECK(!ring.records || (ring.slots > 0 && ring.count != nullptr), "check_gradients: a ring without slots");
  const unsigned blocks = reduce_blocks(n, 16);  // as sum_squares
  long long* bad_part = reinterpret_cast<long long*>(work + kReduceWork);
  if (aligned16(g))
    check_gradients_kernel<true>
        <<<blocks, kThreads, 0, stream>>>(g, n, max_norm, work, bad_part, counter, scale, ring, 0, nullptr, nullptr);
  else
    check_gradients_kernel<false>
        <<<blocks, kThreads, 0, stream>>>(g, n, max_norm, work, bad_part, counter, scale, ring, 0, nullptr, nullptr);
  DPT_CUDA_CHECK_LAUNCH();
}

void shard_check(const float* g, int64_t n, int64_t base, float* sum, int64_t* first, float* work, unsigned* counter,
                 cudaStream_t stream) {
  DPT_CHECK(
      n >= 0 && sum != nullptr && first != nullptr && work != nullptr && counter != nullptr && (n == 0 || g != nullptr),
      "shard_check: bad arguments");
  const unsigned blocks = reduce_blocks(n, 16);
  long long* bad_part = reinterpret_cast<long long*>(work + kReduceWork);
  if (aligned16(g))
    check_gradients_kernel<true>
        <<<blocks, kThreads, 0, stream>>>(g, n, 0.f, work, bad_part, counter, nullptr, {}, base, sum, first);
  else
    check_gradients_kernel<false>
        <<<blocks, kThreads, 0, stream>>>(g, n, 0.f, work, bad_part, counter, nullptr, {}, base, sum, first);
  DPT_CUDA_CHECK_LAUNCH();
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
