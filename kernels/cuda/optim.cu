// optim.cu — fused SGD and AdamW updates over a flat parameter buffer, and the gradient
// clipping coefficient; twins of kernels/cpu optim.cpp (PyTorch's semantics).
//
// One pass reads each parameter, gradient and state once and writes them once, float4 at a
// time when every buffer is 16-byte aligned (the last n % 4 elements go scalar). The
// gradient scale stays on the device (clip_coef writes it), so clipping needs no host
// round trip. With a bf16 shadow (bf16 training) the same pass also writes the updated
// parameters rounded to bf16, so the copy that the GEMMs read costs no pass of its own.
#include <algorithm>
#include <atomic>
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

// The check's terms, in the one order that every kernel of it keeps: a thread adds its
// float4s' squares in increasing index (each float4's four in lane order), then its
// scalar tail, and notes its first non-finite index (its elements come in increasing
// order, so its first is its least).
__device__ __forceinline__ void check_take4(float4 a, int64_t i, float& s, long long& bad) {
  s += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w;
  if (bad == LLONG_MAX && !(isfinite(a.x) && isfinite(a.y) && isfinite(a.z) && isfinite(a.w)))
    bad = 4 * i + (!isfinite(a.x) ? 0 : !isfinite(a.y) ? 1 : !isfinite(a.z) ? 2 : 3);
}
__device__ __forceinline__ void check_take1(float v, int64_t i, float& s, long long& bad) {
  s += v * v;
  if (bad == LLONG_MAX && !isfinite(v)) bad = i;
}

// The check's second half, from each thread's terms: each block's sum of squares (as
// sum_squares' partials) and first non-finite index; the last block to finish (the counter
// says which) adds the sums in block order, in double, writes the scale and, with a ring,
// the check's record, and leaves the counter at 0. Returns true in that block's thread 0
// once it has written. The additions' order depends on n and the grid alone
// (reduce_blocks), so every kernel that checks with that grid finds the same bits.
__device__ bool check_finish(float s, long long bad, float max_norm, float* part, long long* bad_part,
                             unsigned* counter, float* scale, const CheckRingArgs& ring, int64_t base, float* sum_out,
                             int64_t* first_out) {
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
  if (!last) return false;
  __threadfence();  // acquire: the other blocks' partials are read after their count
  double total = 0;
  long long first = LLONG_MAX;
  for (unsigned b = threadIdx.x; b < gridDim.x; b += blockDim.x) {
    total += __ldcg(part + b);
    first = min(first, __ldcg(bad_part + b));
  }
  total = block_sum(total);
  first = block_min(first);
  if (threadIdx.x != 0) return false;
  *counter = 0;
  if (sum_out) {  // a shard's part: its sum and first bad index (of the whole buffer)
    *sum_out = static_cast<float>(total);
    *first_out = first == LLONG_MAX ? LLONG_MAX : base + first;
    return true;
  }
  write_check(static_cast<float>(total), first, max_norm, scale, ring);
  return true;
}

// One pass over the gradients in check_take's order, then check_finish. Four loads in
// flight a thread (one memory latency for four float4s, where a loop of one load each
// waited four times).
template <bool Vec>
__device__ bool check_pass(const float* g, int64_t n, float max_norm, float* part, long long* bad_part,
                           unsigned* counter, float* scale, const CheckRingArgs& ring, int64_t base, float* sum_out,
                           int64_t* first_out) {
  float s = 0.f;
  long long bad = LLONG_MAX;
  int64_t done = 0;
  const int64_t stride = grid_stride();
  if constexpr (Vec) {
    const float4* g4 = reinterpret_cast<const float4*>(g);
    const int64_t n4 = n / 4;
    int64_t i = global_tid();
    for (; i + 3 * stride < n4; i += 4 * stride) {
      float4 a[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) a[k] = g4[i + k * stride];
#pragma unroll
      for (int k = 0; k < 4; ++k) check_take4(a[k], i + k * stride, s, bad);
    }
    for (; i < n4; i += stride) check_take4(g4[i], i, s, bad);
    done = n4 * 4;
  }
  for (int64_t i = done + global_tid(); i < n; i += stride) check_take1(g[i], i, s, bad);
  return check_finish(s, bad, max_norm, part, bad_part, counter, scale, ring, base, sum_out, first_out);
}

template <bool Vec>
static __global__ void check_gradients_kernel(const float* g, int64_t n, float max_norm, float* part,
                                              long long* bad_part, unsigned* counter, float* scale, CheckRingArgs ring,
                                              int64_t base, float* sum_out, int64_t* first_out) {
  DPT_WAIT_PREVIOUS_GRID();
  check_pass<Vec>(g, n, max_norm, part, bad_part, counter, scale, ring, base, sum_out, first_out);
}

// The check and the update in one launch, for small buffers (at most kFusedMax elements,
// 16-byte aligned) whose check grid fits on the GPU at once (the launcher makes sure, and
// launches it cooperatively). The check's pass runs as check_gradients_kernel runs it,
// with the same grid (the same scale bit for bit); then every block waits until the last
// one has written the scale (a grid-wide barrier: the blocks spin on `released`, the spare
// word of the step counter, until it holds this step's epoch, count + 1) and updates its
// share with the update kernels' own loop (the same parameters bit for bit). One kernel
// less a step than check_gradients + the update.
constexpr int64_t kFusedMax = int64_t{1} << 22;

struct SgdUpdate {
  float *p, *buf;
  SgdArgs a;
  uint16_t* shadow;
  __device__ void run(const float* g, int64_t n, const float* values, float scale) const {
    SgdArgs b = a;
    b.lr = values[0];
    sgd_loop<true>(p, g, buf, n, b, scale, shadow);
  }
};
struct AdamUpdate {
  float *p, *m, *v;
  AdamArgs a;
  uint16_t* shadow;
  __device__ void run(const float* g, int64_t n, const float* values, float scale) const {
    AdamArgs b = a;
    b.lr = values[0];
    b.bias_correction1 = values[1];
    b.bias_correction2 = values[2];
    adamw_loop<true>(p, g, m, v, n, b, scale, shadow);
  }
};

template <class Update>
static __global__ void checked_update_kernel(const float* g, int64_t n, float max_norm, float* part,
                                             long long* bad_part, unsigned* counter, float* scale, CheckRingArgs ring,
                                             StepCounterArgs step, Update update, float lr, float bc1, float bc2) {
  DPT_WAIT_PREVIOUS_GRID();
  float values[3] = {lr, bc1, bc2};
  const int64_t t = read_step(step, values);
  unsigned* released = step.blocks_done + 1;
  const auto epoch = static_cast<unsigned>(t + 1);
  if (check_pass<true>(g, n, max_norm, part, bad_part, counter, scale, ring, 0, nullptr, nullptr)) {
    __threadfence();  // the scale and the record before the release
    atomicExch(released, epoch);
  }
  if (threadIdx.x == 0) {
    while (*reinterpret_cast<volatile unsigned*>(released) != epoch) {
    }
    __threadfence();  // acquire: the scale is read after the release
  }
  __syncthreads();
  const float sc = __ldcg(scale);
  if (isfinite(sc)) update.run(g, n, values, sc);  // else the whole update is skipped
  count_step(step, t);
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

namespace {
// How many blocks of `kernel` (kThreads each) fit on the current device at once.
template <typename Kernel>
int64_t blocks_at_once(Kernel kernel) {
  int device = 0, sms = 0, per_sm = 0;
  DPT_CUDA_CHECK(cudaGetDevice(&device));
  DPT_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  DPT_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0));
  return static_cast<int64_t>(sms) * per_sm;
}

// The fused launch, when the buffers allow it (16-byte aligned, at most kFusedMax
// elements) and its grid fits on the device at once (every block waits for the last one),
// else false: the caller checks and updates in two launches.
template <class Update>
bool launch_checked_update(bool aligned, const float* g, int64_t n, float max_norm, float* scale, float* work,
                           unsigned* counter, const CheckRingArgs& ring, const StepCounterArgs& step,
                           const Update& update, const float* values, cudaStream_t stream) {
  if (!aligned || !step.t || n == 0 || n > kFusedMax) return false;  // the barrier's epoch is the step count
  static std::atomic<int64_t> fits[64];                              // per device: blocks at once (0: not asked yet)
  int device = 0;
  DPT_CUDA_CHECK(cudaGetDevice(&device));
  if (device < 0 || device >= 64) return false;
  int64_t most = fits[device].load(std::memory_order_relaxed);
  if (most == 0) {
    most = blocks_at_once(checked_update_kernel<Update>);
    fits[device].store(most, std::memory_order_relaxed);
  }
  const unsigned blocks = reduce_blocks(n, 16);  // check_gradients' grid: the same sums
  if (blocks > most) return false;
  long long* bad_part = reinterpret_cast<long long*>(work + kReduceWork);
  launch_after_previous_as(/*cooperative=*/true, checked_update_kernel<Update>, blocks, kThreads, stream, g, n,
                           max_norm, work, bad_part, counter, scale, ring, step, update, values[0], values[1],
                           values[2]);
  return true;
}
}  // namespace

void checked_sgd_step(float* p, const float* g, float* momentum_buf, int64_t n, const SgdArgs& a, uint16_t* shadow,
                      const StepCounterArgs& step, float max_norm, float* scale, float* work, unsigned* counter,
                      const CheckRingArgs& ring, cudaStream_t stream) {
  const bool mom = a.momentum != 0.f;
  const bool vec = aligned16(p) && aligned16(g) && (!mom || aligned16(momentum_buf)) && aligned(shadow, 8);
  const float values[3] = {a.lr, 1.f, 1.f};
  const SgdUpdate u{p, momentum_buf, a, shadow};
  if (launch_checked_update(vec, g, n, max_norm, scale, work, counter, ring, step, u, values, stream)) return;
  check_gradients(g, n, max_norm, scale, work, counter, ring, stream);
  sgd_step(p, g, momentum_buf, n, a, scale, shadow, step, stream);
}

void checked_adamw_step(float* p, const float* g, float* m, float* v, int64_t n, const AdamArgs& a, uint16_t* shadow,
                        const StepCounterArgs& step, float max_norm, float* scale, float* work, unsigned* counter,
                        const CheckRingArgs& ring, cudaStream_t stream) {
  const bool vec = aligned16(p) && aligned16(g) && aligned16(m) && aligned16(v) && aligned(shadow, 8);
  const float values[3] = {a.lr, a.bias_correction1, a.bias_correction2};
  const AdamUpdate u{p, m, v, a, shadow};
  if (launch_checked_update(vec, g, n, max_norm, scale, work, counter, ring, step, u, values, stream)) return;
  check_gradients(g, n, max_norm, scale, work, counter, ring, stream);
  adamw_step(p, g, m, v, n, a, scale, shadow, step, stream);
}

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
