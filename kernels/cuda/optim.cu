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

// The same expressions, in the same order, as the CPU twin, each operation rounded on its
// own (the _rn intrinsics, which nvcc never contracts into a multiply-add, as the CPU
// build, -ffp-contract=off, does not): nvcc contracts a * b + c where it sees fit, and
// did so differently in the loops of one kernel and another (ulps apart in one element of
// ten thousand; the alternating update, H200, 2026-12-04), where every update kernel must
// give the same bits.
__device__ __forceinline__ void sgd_update(float& p, float g, float& buf, const SgdArgs& a, float scale) {
  float d = __fadd_rn(__fmul_rn(g, scale), __fmul_rn(a.weight_decay, p));
  if (a.momentum != 0.f) {
    buf = __fadd_rn(__fmul_rn(a.momentum, buf), __fmul_rn(1.f - a.dampening, d));
    d = a.nesterov ? __fadd_rn(d, __fmul_rn(a.momentum, buf)) : buf;
  }
  p = __fsub_rn(p, __fmul_rn(a.lr, d));
}

__device__ __forceinline__ void adamw_update(float& p, float g, float& m, float& v, const AdamArgs& a, float scale) {
  const float d = __fmul_rn(g, scale);
  p = __fsub_rn(p, __fmul_rn(__fmul_rn(a.lr, a.weight_decay), p));
  m = __fadd_rn(__fmul_rn(a.beta1, m), __fmul_rn(1.f - a.beta1, d));
  v = __fadd_rn(__fmul_rn(a.beta2, v), __fmul_rn(__fmul_rn(1.f - a.beta2, d), d));
  const float step = __fdiv_rn(__fmul_rn(a.lr, __fdiv_rn(m, a.bias_correction1)),
                               __fadd_rn(__fsqrt_rn(__fdiv_rn(v, a.bias_correction2)), a.eps));
  p = __fsub_rn(p, step);
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
  if (!step.t || !step.advance) return;
  __syncthreads();
  if (threadIdx.x != 0) return;
  __threadfence();
  if (atomicAdd(step.blocks_done, 1u) == gridDim.x - 1) {
    *step.t = s + 1;
    *step.blocks_done = 0;
  }
}

// One float4 of a buffer's update, in three parts: its state loaded, its update from the
// gradient float4, its state stored. sgd_loop and adamw_loop run them together; the fused
// checked update loads before its barrier and stores after it. shadow (may be null) gets
// bf16(p) of every updated element.
__device__ __forceinline__ void store_shadow4(uint16_t* shadow, int64_t i, float4 p) {
  if (shadow)
    reinterpret_cast<ushort4*>(shadow)[i] =
        make_ushort4(bf16_round(p.x), bf16_round(p.y), bf16_round(p.z), bf16_round(p.w));
}

// SGD's state: the parameters and, with momentum, its buffer (buf is read and written only
// with momentum; it may be null without).
struct SgdState4 {
  float4 p, buf;
};
__device__ __forceinline__ SgdState4 sgd_load4(const float* p, const float* buf, bool mom, int64_t i) {
  return {reinterpret_cast<const float4*>(p)[i],
          mom ? reinterpret_cast<const float4*>(buf)[i] : make_float4(0.f, 0.f, 0.f, 0.f)};
}
__device__ __forceinline__ void sgd_store4(SgdState4 s, float4 g, int64_t i, float* p, float* buf, const SgdArgs& a,
                                           float scale, uint16_t* shadow) {
  sgd_update(s.p.x, g.x, s.buf.x, a, scale);
  sgd_update(s.p.y, g.y, s.buf.y, a, scale);
  sgd_update(s.p.z, g.z, s.buf.z, a, scale);
  sgd_update(s.p.w, g.w, s.buf.w, a, scale);
  reinterpret_cast<float4*>(p)[i] = s.p;
  if (a.momentum != 0.f) reinterpret_cast<float4*>(buf)[i] = s.buf;
  store_shadow4(shadow, i, s.p);
}
__device__ __forceinline__ void sgd_one(int64_t i, float* p, const float* g, float* buf, const SgdArgs& a, float scale,
                                        uint16_t* shadow) {
  const bool mom = a.momentum != 0.f;
  float pv = p[i];
  float bv = mom ? buf[i] : 0.f;
  sgd_update(pv, g[i], bv, a, scale);
  p[i] = pv;
  if (mom) buf[i] = bv;
  if (shadow) shadow[i] = bf16_round(pv);
}

template <bool Vec>
__device__ __forceinline__ void sgd_loop(float* p, const float* g, float* buf, int64_t n, const SgdArgs& a, float scale,
                                         uint16_t* shadow) {
  const bool mom = a.momentum != 0.f;
  const int64_t tid = global_tid(), stride = grid_stride();
  int64_t done = 0;
  if constexpr (Vec) {
    const float4* g4 = reinterpret_cast<const float4*>(g);
    const int64_t n4 = n / 4;
    for (int64_t i = tid; i < n4; i += stride)
      sgd_store4(sgd_load4(p, buf, mom, i), g4[i], i, p, buf, a, scale, shadow);
    done = 4 * n4;
  }
  for (int64_t i = done + tid; i < n; i += stride) sgd_one(i, p, g, buf, a, scale, shadow);
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

struct AdamState4 {
  float4 p, m, v;
};
__device__ __forceinline__ AdamState4 adamw_load4(const float* p, const float* m, const float* v, int64_t i) {
  return {reinterpret_cast<const float4*>(p)[i], reinterpret_cast<const float4*>(m)[i],
          reinterpret_cast<const float4*>(v)[i]};
}
__device__ __forceinline__ void adamw_store4(AdamState4 s, float4 g, int64_t i, float* p, float* m, float* v,
                                             const AdamArgs& a, float scale, uint16_t* shadow) {
  adamw_update(s.p.x, g.x, s.m.x, s.v.x, a, scale);
  adamw_update(s.p.y, g.y, s.m.y, s.v.y, a, scale);
  adamw_update(s.p.z, g.z, s.m.z, s.v.z, a, scale);
  adamw_update(s.p.w, g.w, s.m.w, s.v.w, a, scale);
  reinterpret_cast<float4*>(p)[i] = s.p;
  reinterpret_cast<float4*>(m)[i] = s.m;
  reinterpret_cast<float4*>(v)[i] = s.v;
  store_shadow4(shadow, i, s.p);
}
__device__ __forceinline__ void adamw_one(int64_t i, float* p, const float* g, float* m, float* v, const AdamArgs& a,
                                          float scale, uint16_t* shadow) {
  float pv = p[i], mv = m[i], vv = v[i];
  adamw_update(pv, g[i], mv, vv, a, scale);
  p[i] = pv;
  m[i] = mv;
  v[i] = vv;
  if (shadow) shadow[i] = bf16_round(pv);
}

template <bool Vec>
__device__ __forceinline__ void adamw_loop(float* p, const float* g, float* m, float* v, int64_t n, const AdamArgs& a,
                                           float scale, uint16_t* shadow) {
  const int64_t tid = global_tid(), stride = grid_stride();
  int64_t done = 0;
  if constexpr (Vec) {
    const float4* g4 = reinterpret_cast<const float4*>(g);
    const int64_t n4 = n / 4;
    for (int64_t i = tid; i < n4; i += stride)
      adamw_store4(adamw_load4(p, m, v, i), g4[i], i, p, m, v, a, scale, shadow);
    done = 4 * n4;
  }
  for (int64_t i = done + tid; i < n; i += stride) adamw_one(i, p, g, m, v, a, scale, shadow);
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

// The check and the update in one launch, for small buffers (at most kFusedMax elements,
// 16-byte aligned) whose check grid fits on the GPU at once (the launcher makes sure, and
// launches it cooperatively). The check runs as check_gradients_kernel runs it, with the
// same grid and each thread's terms in the same order; every block waits until the last
// one has written its part (a grid-wide barrier: the blocks spin on `released`, the spare
// word of the step counter, until it holds this step's epoch, count + 1), adds the parts
// as check_gradients' last block does (the same scale bit for bit; block 0 writes it and
// the record) and updates its elements with the update kernels' own expressions (the same
// parameters bit for bit). One kernel less a step than check_gradients + the update.
//
// Hold: that grid gives a thread at most kHeld float4s (kFusedMax elements over
// kReduceWork blocks), so a thread loads its gradients and their optimizer state together
// before the check and keeps them in registers; after the barrier only the arithmetic and
// the stores remain, where a second pass over the buffers waits for memory again (the
// seed model's update, traced in a graph: 11.8 -> 9.7 us of the step). Twice the
// registers, so half the blocks fit at once: larger buffers take the second pass.
constexpr int64_t kFusedMax = int64_t{1} << 22;
constexpr int kHeld = 4;
static_assert(kFusedMax <= kReduceWork * kThreads * 4 * kHeld,
              "a thread of the fused grid holds at most kHeld float4s");

// Where the speculative update keeps what it overwrites: buffer k (the parameters, then
// the optimizer's state in the update's order) at data + k * stride, stride a multiple of
// 4 so that each starts 16-byte aligned.
struct Backup {
  float* data;
  int64_t stride;
  __device__ float* at(int k) const { return data + k * stride; }
  __device__ void put4(int k, int64_t i, float4 v) const { reinterpret_cast<float4*>(at(k))[i] = v; }
};

// An update's parts for the fused kernel: load(i) the state of float4 i, store(...) its
// update from the gradient float4, one(i, ...) a scalar element (the last n % 4); loop(...)
// the whole buffer's, as the update kernel runs it. For the speculative update's backup:
// save and save1 a float4's state and a scalar element's into it; backed(i) a float4's
// state from it and put(...) that state back in place (the bf16 shadow made again from the
// parameters), restore1(i) a scalar element's.
struct SgdUpdate {
  float *p, *buf;
  SgdArgs a;
  uint16_t* shadow;
  using State = SgdState4;
  __device__ void set_values(const float* values) { a.lr = values[0]; }
  __device__ State load(int64_t i) const { return sgd_load4(p, buf, a.momentum != 0.f, i); }
  __device__ void store(State s, float4 g, int64_t i, float scale) const {
    sgd_store4(s, g, i, p, buf, a, scale, shadow);
  }
  __device__ void one(int64_t i, const float* g, float scale) const { sgd_one(i, p, g, buf, a, scale, shadow); }
  __device__ void loop(const float* g, int64_t n, float scale) const { sgd_loop<true>(p, g, buf, n, a, scale, shadow); }
  // The speculative update's backup (Backup: the parameters, then the momentum buffer).
  __device__ void save(const State& s, const Backup& b, int64_t i) const {
    b.put4(0, i, s.p);
    if (a.momentum != 0.f) b.put4(1, i, s.buf);
  }
  __device__ void save1(const Backup& b, int64_t i) const {
    b.at(0)[i] = p[i];
    if (a.momentum != 0.f) b.at(1)[i] = buf[i];
  }
  __device__ State backed(const Backup& b, int64_t i) const {
    return sgd_load4(b.at(0), b.at(1), a.momentum != 0.f, i);
  }
  __device__ void put(const State& s, int64_t i) const {
    reinterpret_cast<float4*>(p)[i] = s.p;
    if (a.momentum != 0.f) reinterpret_cast<float4*>(buf)[i] = s.buf;
    store_shadow4(shadow, i, s.p);
  }
  __device__ void restore1(const Backup& b, int64_t i) const {
    p[i] = b.at(0)[i];
    if (a.momentum != 0.f) buf[i] = b.at(1)[i];
    if (shadow) shadow[i] = bf16_round(p[i]);
  }
  // The alternating update's: a scalar element updated from copy `from` into this one,
  // and one copied from `from` unchanged (the shadow made again).
  __device__ void one_from(const SgdUpdate& from, int64_t i, const float* g, float scale) const {
    const bool mom = a.momentum != 0.f;
    float pv = from.p[i];
    float bv = mom ? from.buf[i] : 0.f;
    sgd_update(pv, g[i], bv, a, scale);
    p[i] = pv;
    if (mom) buf[i] = bv;
    if (shadow) shadow[i] = bf16_round(pv);
  }
  __device__ void copy1(const SgdUpdate& from, int64_t i) const {
    p[i] = from.p[i];
    if (a.momentum != 0.f) buf[i] = from.buf[i];
    if (shadow) shadow[i] = bf16_round(p[i]);
  }
};
struct AdamUpdate {
  float *p, *m, *v;
  AdamArgs a;
  uint16_t* shadow;
  using State = AdamState4;
  __device__ void set_values(const float* values) {
    a.lr = values[0];
    a.bias_correction1 = values[1];
    a.bias_correction2 = values[2];
  }
  __device__ State load(int64_t i) const { return adamw_load4(p, m, v, i); }
  __device__ void store(State s, float4 g, int64_t i, float scale) const {
    adamw_store4(s, g, i, p, m, v, a, scale, shadow);
  }
  __device__ void one(int64_t i, const float* g, float scale) const { adamw_one(i, p, g, m, v, a, scale, shadow); }
  __device__ void loop(const float* g, int64_t n, float scale) const {
    adamw_loop<true>(p, g, m, v, n, a, scale, shadow);
  }
  __device__ void save(const State& s, const Backup& b, int64_t i) const {
    b.put4(0, i, s.p);
    b.put4(1, i, s.m);
    b.put4(2, i, s.v);
  }
  __device__ void save1(const Backup& b, int64_t i) const {
    b.at(0)[i] = p[i];
    b.at(1)[i] = m[i];
    b.at(2)[i] = v[i];
  }
  __device__ State backed(const Backup& b, int64_t i) const { return adamw_load4(b.at(0), b.at(1), b.at(2), i); }
  __device__ void put(const State& s, int64_t i) const {
    reinterpret_cast<float4*>(p)[i] = s.p;
    reinterpret_cast<float4*>(m)[i] = s.m;
    reinterpret_cast<float4*>(v)[i] = s.v;
    store_shadow4(shadow, i, s.p);
  }
  __device__ void restore1(const Backup& b, int64_t i) const {
    p[i] = b.at(0)[i];
    m[i] = b.at(1)[i];
    v[i] = b.at(2)[i];
    if (shadow) shadow[i] = bf16_round(p[i]);
  }
  __device__ void one_from(const AdamUpdate& from, int64_t i, const float* g, float scale) const {
    float pv = from.p[i], mv = from.m[i], vv = from.v[i];
    adamw_update(pv, g[i], mv, vv, a, scale);
    p[i] = pv;
    m[i] = mv;
    v[i] = vv;
    if (shadow) shadow[i] = bf16_round(pv);
  }
  __device__ void copy1(const AdamUpdate& from, int64_t i) const {
    p[i] = from.p[i];
    m[i] = from.m[i];
    v[i] = from.v[i];
    if (shadow) shadow[i] = bf16_round(p[i]);
  }
};

template <class Update, bool Hold>
static __global__ void checked_update_kernel(const float* g, int64_t n, float max_norm, float* part,
                                             long long* bad_part, unsigned* counter, float* scale, CheckRingArgs ring,
                                             StepCounterArgs step, Update update, float lr, float bc1, float bc2) {
  const float4* g4 = reinterpret_cast<const float4*>(g);
  const int64_t n4 = n / 4, tid = global_tid(), stride = grid_stride();
  float4 held_g[kHeld];
  typename Update::State held[kHeld];
  // Holding, the optimizer's state is loaded before the wait for the kernel before this one
  // (the one that makes the gradients), beside its end: only this update writes the
  // parameters and their state, and by the time this kernel starts, every kernel before
  // that one has finished (each waits for its own predecessor before it lets the next
  // start), the last update among them. (The seed model's update, traced in a graph:
  // 8.8 -> 8.0 us of the step.)
  if constexpr (Hold) {
#pragma unroll
    for (int k = 0; k < kHeld; ++k)
      if (tid + k * stride < n4) held[k] = update.load(tid + k * stride);
  }
  float values[3] = {lr, bc1, bc2};
  const int64_t t = read_step(step, values);  // before the wait, as the held state (above)
  update.set_values(values);
  const int64_t count = blockIdx.x == 0 && threadIdx.x == 0 ? ring_count(ring) : 0;  // write_check's
  DPT_WAIT_PREVIOUS_GRID();
  unsigned* released = step.blocks_done + 1;
  const auto epoch = static_cast<unsigned>(t + 1);
  float s = 0.f;
  long long bad = LLONG_MAX;
  if constexpr (Hold) {  // check_terms' terms, from the float4s held (increasing index), then the scalar tail
#pragma unroll
    for (int k = 0; k < kHeld; ++k)
      if (tid + k * stride < n4) held_g[k] = g4[tid + k * stride];
#pragma unroll
    for (int k = 0; k < kHeld; ++k)
      if (tid + k * stride < n4) check_take4(held_g[k], tid + k * stride, s, bad);
    for (int64_t i = 4 * n4 + tid; i < n; i += stride) check_take1(g[i], i, s, bad);
  } else {
    check_terms<true>(g, n, s, bad);
  }
  // The barrier: the last block to write its part releases the others at once; then every
  // block adds the parts itself (the same bits in each), so none waits for another's sum.
  if (check_block_part(s, bad, part, bad_part, counter)) atomicExch(released, epoch);
  if (threadIdx.x == 0)
    while (*reinterpret_cast<volatile unsigned*>(released) != epoch) {
    }
  __syncthreads();
  double total;
  long long first;
  check_total(part, bad_part, total, first);
  __shared__ float block_scale;
  if (threadIdx.x == 0) {
    block_scale = scale_from_norm_sq(static_cast<float>(total), max_norm);
    if (blockIdx.x == 0) write_check(static_cast<float>(total), first, max_norm, scale, ring, count);
  }
  __syncthreads();
  const float sc = block_scale;
  if (isfinite(sc)) {  // else the whole update is skipped
    if constexpr (Hold) {
#pragma unroll
      for (int k = 0; k < kHeld; ++k)
        if (tid + k * stride < n4) update.store(held[k], held_g[k], tid + k * stride, sc);
      for (int64_t i = 4 * n4 + tid; i < n; i += stride) update.one(i, g, sc);
    } else {
      update.loop(g, n, sc);
    }
  }
  count_step(step, t);
}

// The end of the updates that do not wait for the check (speculative, alternating): the
// last block to write its part of the check adds the parts (check_gradients' sum, bit for
// bit), writes the scale and the record and moves the step counter on (every block has
// read it, before its part). True in every thread of that block where the norm is not
// finite, so the step must be undone; false in every other block.
__device__ bool last_block_finds_skip(float s, long long bad, float* part, long long* bad_part, unsigned* counter,
                                      float* scale, const CheckRingArgs& ring, int64_t count,
                                      const StepCounterArgs& step, int64_t t) {
  if (!check_block_part(s, bad, part, bad_part, counter)) return false;  // every block's stores are visible to the last
  double total;
  long long first;
  check_total(part, bad_part, total, first);
  __shared__ bool skipped;
  if (threadIdx.x == 0) {
    write_check(static_cast<float>(total), first, 0.f, scale, ring, count);
    skipped = !isfinite(scale_from_norm_sq(static_cast<float>(total), 0.f));
    if (step.t && step.advance) *step.t = t + 1;
  }
  __syncthreads();
  return skipped;
}

// The undoing, by the one block: the state of each of the n4 float4s from load(i), put
// back by `to` (the shadow made again from the parameters). Four float4s in flight a
// thread: the stores of one round would otherwise keep the next round's loads waiting
// (the buffers might overlap, for all the compiler knows).
template <class Update, class Load>
__device__ void put_back4(const Update& to, int64_t n4, Load load) {
  constexpr int kRound = 4;
  for (int64_t i = threadIdx.x; i < n4; i += kRound * blockDim.x) {
    typename Update::State back[kRound];
#pragma unroll
    for (int k = 0; k < kRound; ++k)
      if (i + k * blockDim.x < n4) back[k] = load(i + k * blockDim.x);
#pragma unroll
    for (int k = 0; k < kRound; ++k)
      if (i + k * blockDim.x < n4) to.put(back[k], i + k * blockDim.x);
  }
}

// Without clipping the check's scale is 1 or NaN (skip the step), so the update need not
// wait for it: each block updates its elements as if the gradients were finite (scale 1:
// the update kernels' bits), having first copied what it overwrites into a backup, and
// the last block to write its part of the check adds the parts (check_gradients' sum, bit
// for bit), writes the scale and the record, moves the step counter on and, where the
// norm is not finite, puts the backup back, the bf16 shadow too: the step is skipped as
// the other kernels skip it. No grid-wide barrier (most of what the check added to the
// seed model's update: docs/performance-log.md) and no cooperative launch: any grid fits. The
// backup is the optimizer's own buffer, which no other kernel touches once made (launch.hpp
// says why it may be written before the wait for the kernel ahead). At most kFusedMax
// elements, whose grid gives a thread at most kHeld float4s to hold. A skipped step pays
// for the restoring by the one block (not measured: at a block's memory speed, of the
// order of a millisecond for 4M elements of AdamW, 48 MB read and written); skips are rare.
// `one` is 1, an argument so that the update's expressions compile as in the kernels
// that read their scale.
template <class Update>
static __global__ void speculative_update_kernel(const float* g, int64_t n, float* part, long long* bad_part,
                                                 unsigned* counter, float* scale, CheckRingArgs ring,
                                                 StepCounterArgs step, Update update, float lr, float bc1, float bc2,
                                                 Backup backup, float one) {
  const float4* g4 = reinterpret_cast<const float4*>(g);
  const int64_t n4 = n / 4, tid = global_tid(), stride = grid_stride();
  typename Update::State held[kHeld];
#pragma unroll
  for (int k = 0; k < kHeld; ++k)
    if (tid + k * stride < n4) {
      held[k] = update.load(tid + k * stride);
      update.save(held[k], backup, tid + k * stride);
    }
  for (int64_t i = 4 * n4 + tid; i < n; i += stride) update.save1(backup, i);
  float values[3] = {lr, bc1, bc2};
  const int64_t t = read_step(step, values);  // before the wait, as the held state (checked_update_kernel)
  update.set_values(values);
  const int64_t count = threadIdx.x == 0 ? ring_count(ring) : 0;  // the last block's thread 0 writes the record
  DPT_WAIT_PREVIOUS_GRID();
  float s = 0.f;
  long long bad = LLONG_MAX;
  float4 held_g[kHeld];
#pragma unroll
  for (int k = 0; k < kHeld; ++k)
    if (tid + k * stride < n4) held_g[k] = g4[tid + k * stride];
#pragma unroll
  for (int k = 0; k < kHeld; ++k)
    if (tid + k * stride < n4) {
      check_take4(held_g[k], tid + k * stride, s, bad);  // check_terms' order
      update.store(held[k], held_g[k], tid + k * stride, one);
    }
  for (int64_t i = 4 * n4 + tid; i < n; i += stride) {
    check_take1(g[i], i, s, bad);
    update.one(i, g, one);
  }
  if (!last_block_finds_skip(s, bad, part, bad_part, counter, scale, ring, count, step, t)) return;
  put_back4(update, n4, [&](int64_t i) { return update.backed(backup, i); });
  for (int64_t i = 4 * n4 + threadIdx.x; i < n; i += blockDim.x) update.restore1(backup, i);
}

// Without clipping, for buffers of any size: the update from the current copy of the
// parameters and optimizer state into a second copy (twin buffers), so that the gradients
// are read once, by the update, which adds the check's terms as it goes (check_terms'
// grid and order: check_gradients' sum bit for bit), where the two-launch form reads them
// twice (mlp: 168 MB, 47 us a step on the H200). The last block to write its part of the
// check writes the scale and the record and moves the step counter on; where the norm is
// not finite it copies the current copy into the other unchanged (the shadow made again
// from its parameters), so either way the other copy holds the state after the step and
// the caller swaps the two after every step. `first` and `second` are the two copies as
// the caller sees them when it queues the update, `first` current at a counter of
// `first_parity`'s parity: a CUDA graph's replays alternate by the counter on the device.
// A skipped step pays for the copy by the one block (not measured: one SM moving the whole
// state, for the mlp's 42M parameters 0.4 GB with SGD and 1 GB with AdamW, so several to
// tens of milliseconds); skips are rare. `one` is 1, an
// argument so that the update's expressions compile as in the kernels that read their
// scale.
template <class Update>
static __global__ void alternating_update_kernel(const float* g, int64_t n, float* part, long long* bad_part,
                                                 unsigned* counter, float* scale, CheckRingArgs ring,
                                                 StepCounterArgs step, Update first, Update second,
                                                 int64_t first_parity, float lr, float bc1, float bc2, float one) {
  DPT_WAIT_PREVIOUS_GRID();
  float values[3] = {lr, bc1, bc2};
  const int64_t t = read_step(step, values);
  const bool from_first = (t & 1) == first_parity;
  Update from = from_first ? first : second;
  Update to = from_first ? second : first;
  to.set_values(values);
  const float4* g4 = reinterpret_cast<const float4*>(g);
  const int64_t n4 = n / 4, stride = grid_stride();
  float s = 0.f;
  long long bad = LLONG_MAX;
  int64_t i = global_tid();
  for (; i + 3 * stride < n4; i += 4 * stride) {  // four float4s in flight a thread, as check_terms
    float4 gv[4];
    typename Update::State st[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      gv[k] = g4[i + k * stride];
      st[k] = from.load(i + k * stride);
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      check_take4(gv[k], i + k * stride, s, bad);
      to.store(st[k], gv[k], i + k * stride, one);
    }
  }
  for (; i < n4; i += stride) {
    const float4 gv = g4[i];
    check_take4(gv, i, s, bad);
    to.store(from.load(i), gv, i, one);
  }
  for (int64_t j = 4 * n4 + global_tid(); j < n; j += stride) {
    check_take1(g[j], j, s, bad);
    to.one_from(from, j, g, one);
  }
  if (!last_block_finds_skip(s, bad, part, bad_part, counter, scale, ring, ring_count(ring), step, t)) return;
  put_back4(to, n4, [&](int64_t i) { return from.load(i); });
  for (int64_t j = 4 * n4 + threadIdx.x; j < n; j += blockDim.x) to.copy1(from, j);
}

// ZeRO: the check from the shards' parts, summed and min'd over the devices.
static __global__ void finish_check_kernel(const float* sum, const int64_t* first, float max_norm, float* scale,
                                           CheckRingArgs ring) {
  write_check(*sum, *first, max_norm, scale, ring, ring_count(ring));
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
// elements) and its grid fits on the device at once (every block waits for the last one;
// holding the buffers in registers where it fits so), else false: the caller checks and
// updates in two launches.
template <class Update>
bool launch_checked_update(bool aligned, const float* g, int64_t n, float max_norm, float* scale, float* work,
                           unsigned* counter, const CheckRingArgs& ring, const StepCounterArgs& step,
                           const Update& update, const float* values, float* backup, cudaStream_t stream) {
  if (!aligned || n == 0 || n > kFusedMax) return false;
  long long* bad_part = reinterpret_cast<long long*>(work + kReduceWork);
  if (backup && max_norm == 0.f) {
    launch_after_previous(speculative_update_kernel<Update>, reduce_blocks(n, 16), kThreads, stream, g, n, work,
                          bad_part, counter, scale, ring, step, update, values[0], values[1], values[2],
                          Backup{backup, (n + 3) / 4 * 4}, 1.f);
    return true;
  }
  if (!step.t) return false;  // the barrier's epoch is the step count
  // Per device, the blocks of each kernel that fit at once (0: not asked yet).
  static std::atomic<int64_t> fits_holding[64], fits_passing[64];
  int device = 0;
  DPT_CUDA_CHECK(cudaGetDevice(&device));
  if (device < 0 || device >= 64) return false;
  const auto fits = [&](std::atomic<int64_t>& known, auto kernel) {
    int64_t most = known.load(std::memory_order_relaxed);
    if (most == 0) {
      most = blocks_at_once(kernel);
      known.store(most, std::memory_order_relaxed);
    }
    return most;
  };
  const unsigned blocks = reduce_blocks(n, 16);  // check_gradients' grid: the same sums
  const bool hold = blocks <= fits(fits_holding[device], checked_update_kernel<Update, true>);
  if (!hold && blocks > fits(fits_passing[device], checked_update_kernel<Update, false>)) return false;
  launch_after_previous_as(/*cooperative=*/true,
                           hold ? checked_update_kernel<Update, true> : checked_update_kernel<Update, false>, blocks,
                           kThreads, stream, g, n, max_norm, work, bad_part, counter, scale, ring, step, update,
                           values[0], values[1], values[2]);
  return true;
}
}  // namespace

int64_t speculative_backup_floats(int64_t n, int buffers, float max_norm) {
  return max_norm == 0.f && n > 0 && n <= kFusedMax ? buffers * ((n + 3) / 4 * 4) : 0;
}

void checked_sgd_step(float* p, const float* g, float* momentum_buf, int64_t n, const SgdArgs& a, uint16_t* shadow,
                      const StepCounterArgs& step, float max_norm, float* scale, float* work, unsigned* counter,
                      const CheckRingArgs& ring, float* backup, cudaStream_t stream) {
  const bool mom = a.momentum != 0.f;
  const bool vec = aligned16(p) && aligned16(g) && (!mom || aligned16(momentum_buf)) && aligned(shadow, 8);
  const float values[3] = {a.lr, 1.f, 1.f};
  const SgdUpdate u{p, momentum_buf, a, shadow};
  if (launch_checked_update(vec, g, n, max_norm, scale, work, counter, ring, step, u, values, backup, stream)) return;
  check_gradients(g, n, max_norm, scale, work, counter, ring, stream);
  sgd_step(p, g, momentum_buf, n, a, scale, shadow, step, stream);
}

void checked_adamw_step(float* p, const float* g, float* m, float* v, int64_t n, const AdamArgs& a, uint16_t* shadow,
                        const StepCounterArgs& step, float max_norm, float* scale, float* work, unsigned* counter,
                        const CheckRingArgs& ring, float* backup, cudaStream_t stream) {
  const bool vec = aligned16(p) && aligned16(g) && aligned16(m) && aligned16(v) && aligned(shadow, 8);
  const float values[3] = {a.lr, a.bias_correction1, a.bias_correction2};
  const AdamUpdate u{p, m, v, a, shadow};
  if (launch_checked_update(vec, g, n, max_norm, scale, work, counter, ring, step, u, values, backup, stream)) return;
  check_gradients(g, n, max_norm, scale, work, counter, ring, stream);
  adamw_step(p, g, m, v, n, a, scale, shadow, step, stream);
}

namespace {
template <class Update>
void launch_alternating(const float* g, int64_t n, float* scale, float* work, unsigned* counter,
                        const CheckRingArgs& ring, const StepCounterArgs& step, const Update& first,
                        const Update& second, int64_t first_parity, const float* values, cudaStream_t stream) {
  launch_after_previous(alternating_update_kernel<Update>, reduce_blocks(n, 16), kThreads, stream, g, n, work,
                        reinterpret_cast<long long*>(work + kReduceWork), counter, scale, ring, step, first, second,
                        first_parity, values[0], values[1], values[2], 1.f);
}
}  // namespace

void alternating_sgd_step(const float* g, int64_t n, float* const p[2], float* const momentum_buf[2], const SgdArgs& a,
                          uint16_t* shadow, const StepCounterArgs& step, int64_t first_parity, float* scale,
                          float* work, unsigned* counter, const CheckRingArgs& ring, cudaStream_t stream) {
  const bool mom = a.momentum != 0.f;
  DPT_CHECK(n > 0 && step.t != nullptr && g != nullptr && p[0] != nullptr && p[1] != nullptr &&
                (!mom || (momentum_buf[0] != nullptr && momentum_buf[1] != nullptr)),
            "alternating_sgd_step: null pointer or no step counter");
  DPT_CHECK(aligned16(g) && aligned16(p[0]) && aligned16(p[1]) &&
                (!mom || (aligned16(momentum_buf[0]) && aligned16(momentum_buf[1]))) && aligned(shadow, 8),
            "alternating_sgd_step: buffers not 16-byte aligned");
  const float values[3] = {a.lr, 1.f, 1.f};
  launch_alternating(g, n, scale, work, counter, ring, step, SgdUpdate{p[0], momentum_buf[0], a, shadow},
                     SgdUpdate{p[1], momentum_buf[1], a, shadow}, first_parity, values, stream);
}

void alternating_adamw_step(const float* g, int64_t n, float* const p[2], float* const m[2], float* const v[2],
                            const AdamArgs& a, uint16_t* shadow, const StepCounterArgs& step, int64_t first_parity,
                            float* scale, float* work, unsigned* counter, const CheckRingArgs& ring,
                            cudaStream_t stream) {
  for (int c = 0; c < 2; ++c)
    DPT_CHECK(
        p[c] != nullptr && m[c] != nullptr && v[c] != nullptr && aligned16(p[c]) && aligned16(m[c]) && aligned16(v[c]),
        "alternating_adamw_step: null or unaligned buffers");
  DPT_CHECK(n > 0 && step.t != nullptr && g != nullptr && aligned16(g) && aligned(shadow, 8),
            "alternating_adamw_step: no gradients, step counter or aligned shadow");
  const float values[3] = {a.lr, a.bias_correction1, a.bias_correction2};
  launch_alternating(g, n, scale, work, counter, ring, step, AdamUpdate{p[0], m[0], v[0], a, shadow},
                     AdamUpdate{p[1], m[1], v[1], a, shadow}, first_parity, values, stream);
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
