// The per-element SGD and AdamW updates that every update kernel runs (optim.cu,
// optim_checked.cu), and the step counter they read and move on: the same expressions, in
// the same order, as the CPU twin (kernels/cpu/optim.cpp). Device code only; included by
// the .cu files alone.
#pragma once
#include <cstdint>

#include <dptrain/types.hpp>

#include "../bf16.hpp"
#include "../schedule.hpp"
#include "../shadow.hpp"
#include "common.cuh"
#include "loops.cuh"

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

// i: the element's index in the update (its weight decay: weight_decay_at).
__device__ __forceinline__ void adamw_update(float& p, float g, float& m, float& v, const AdamArgs& a, float scale,
                                             int64_t i) {
  const float d = __fmul_rn(g, scale);
  const float wd = !a.decay_chunks || a.decay_chunks[(a.first + i) >> 6] ? a.weight_decay : 0.f;
  p = __fsub_rn(p, __fmul_rn(__fmul_rn(a.lr, wd), p));
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

// The shadow an update of step `s` writes (read_step's count): rounded as the counter
// says, to nearest without one (as the CPU twin's).
__host__ __device__ __forceinline__ ShadowStore step_shadow(uint16_t* shadow, const StepCounterArgs& step, int64_t s) {
  return shadow_store(shadow, step.t ? step.rounding : ShadowRounding{}, s);
}

// One float4 of a buffer's update, in three parts: its state loaded, its update from the
// gradient float4, its state stored. sgd_loop and adamw_loop run them together; the fused
// checked update loads before its barrier and stores after it. shadow (its bits may be
// null) gets every updated element rounded to bf16.
__device__ __forceinline__ void store_shadow4(const ShadowStore& shadow, int64_t i, float4 p) {
  if (!shadow.bits) return;
  if (!shadow.stochastic) {
    store_four(shadow.bits + 4 * i, p);
    return;
  }
  const float v[4] = {p.x, p.y, p.z, p.w};
  uint16_t out[4];
  shadow.round4(4 * i, v, out);
  *reinterpret_cast<ushort4*>(shadow.bits + 4 * i) = make_ushort4(out[0], out[1], out[2], out[3]);
}

// A skipped step (non-finite gradients) under stochastic rounding: the shadow of the
// unchanged parameters again, with this step's random bits (the CPU twin's `skipped`), so
// that after step s's update the shadow is step s's rounding whether it applied or not.
template <bool Vec>
__device__ __forceinline__ void shadow_again(const float* p, int64_t n, const ShadowStore& shadow) {
  if (!shadow.stochastic || !shadow.bits) return;
  vec4_loop<Vec>(
      n, [&](int64_t q) { store_shadow4(shadow, q, load_four(p + 4 * q)); }, [&](int64_t i) { shadow.store(i, p[i]); });
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
                                           float scale, const ShadowStore& shadow) {
  sgd_update(s.p.x, g.x, s.buf.x, a, scale);
  sgd_update(s.p.y, g.y, s.buf.y, a, scale);
  sgd_update(s.p.z, g.z, s.buf.z, a, scale);
  sgd_update(s.p.w, g.w, s.buf.w, a, scale);
  reinterpret_cast<float4*>(p)[i] = s.p;
  if (a.momentum != 0.f) reinterpret_cast<float4*>(buf)[i] = s.buf;
  store_shadow4(shadow, i, s.p);
}
__device__ __forceinline__ void sgd_one(int64_t i, float* p, const float* g, float* buf, const SgdArgs& a, float scale,
                                        const ShadowStore& shadow) {
  const bool mom = a.momentum != 0.f;
  float pv = p[i];
  float bv = mom ? buf[i] : 0.f;
  sgd_update(pv, g[i], bv, a, scale);
  p[i] = pv;
  if (mom) buf[i] = bv;
  shadow.store(i, pv);
}

template <bool Vec>
__device__ __forceinline__ void sgd_loop(float* p, const float* g, float* buf, int64_t n, const SgdArgs& a, float scale,
                                         const ShadowStore& shadow) {
  const bool mom = a.momentum != 0.f;
  vec4_loop<Vec>(
      n, [&](int64_t q) { sgd_store4(sgd_load4(p, buf, mom, q), load_four(g + 4 * q), q, p, buf, a, scale, shadow); },
      [&](int64_t i) { sgd_one(i, p, g, buf, a, scale, shadow); });
}

struct AdamState4 {
  float4 p, m, v;
};
__device__ __forceinline__ AdamState4 adamw_load4(const float* p, const float* m, const float* v, int64_t i) {
  return {reinterpret_cast<const float4*>(p)[i], reinterpret_cast<const float4*>(m)[i],
          reinterpret_cast<const float4*>(v)[i]};
}
__device__ __forceinline__ void adamw_store4(AdamState4 s, float4 g, int64_t i, float* p, float* m, float* v,
                                             const AdamArgs& a, float scale, const ShadowStore& shadow) {
  adamw_update(s.p.x, g.x, s.m.x, s.v.x, a, scale, 4 * i);
  adamw_update(s.p.y, g.y, s.m.y, s.v.y, a, scale, 4 * i + 1);
  adamw_update(s.p.z, g.z, s.m.z, s.v.z, a, scale, 4 * i + 2);
  adamw_update(s.p.w, g.w, s.m.w, s.v.w, a, scale, 4 * i + 3);
  reinterpret_cast<float4*>(p)[i] = s.p;
  reinterpret_cast<float4*>(m)[i] = s.m;
  reinterpret_cast<float4*>(v)[i] = s.v;
  store_shadow4(shadow, i, s.p);
}
__device__ __forceinline__ void adamw_one(int64_t i, float* p, const float* g, float* m, float* v, const AdamArgs& a,
                                          float scale, const ShadowStore& shadow) {
  float pv = p[i], mv = m[i], vv = v[i];
  adamw_update(pv, g[i], mv, vv, a, scale, i);
  p[i] = pv;
  m[i] = mv;
  v[i] = vv;
  shadow.store(i, pv);
}

template <bool Vec>
__device__ __forceinline__ void adamw_loop(float* p, const float* g, float* m, float* v, int64_t n, const AdamArgs& a,
                                           float scale, const ShadowStore& shadow) {
  vec4_loop<Vec>(
      n, [&](int64_t q) { adamw_store4(adamw_load4(p, m, v, q), load_four(g + 4 * q), q, p, m, v, a, scale, shadow); },
      [&](int64_t i) { adamw_one(i, p, g, m, v, a, scale, shadow); });
}

}  // namespace
}  // namespace dpt::cuda
