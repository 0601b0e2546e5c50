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

// buf is read and written only with momentum (it may be null without);
// shadow (may be null) gets bf16(p) of every updated element.
template <bool Vec>
static __global__ void sgd_step_kernel(float* p, const float* g, float* buf, int64_t n, SgdArgs a,
                                       const float* grad_scale, uint16_t* shadow, const float* step_values) {
  DPT_WAIT_PREVIOUS_GRID();
  const float scale = grad_scale ? *grad_scale : 1.f;
  if (!isfinite(scale)) return;  // non-finite gradients: the whole update is skipped
  if (step_values) a.lr = step_values[0];
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
static __global__ void adamw_step_kernel(float* p, const float* g, float* m, float* v, int64_t n, AdamArgs a,
                                         const float* grad_scale, uint16_t* shadow, const float* step_values) {
  DPT_WAIT_PREVIOUS_GRID();
  const float scale = grad_scale ? *grad_scale : 1.f;
  if (!isfinite(scale)) return;  // non-finite gradients: the whole update is skipped
  if (step_values) {
    a.lr = step_values[0];
    a.bias_correction1 = step_values[1];
    a.bias_correction2 = step_values[2];
  }
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

// std::min(1, c) as the CPU writes it: a NaN norm gives 1 there, and so here.
static __global__ void clip_coef_kernel(const float* norm_sq, float max_norm, float* out) {
  const float sq = *norm_sq;
  if (!isfinite(sq)) {
    *out = __int_as_float(0x7fc00000);  // NaN: tells the optimizer to skip the step
    return;
  }
  const float c = max_norm > 0.f ? max_norm / (sqrtf(sq) + 1e-6f) : 1.f;
  *out = c < 1.f ? c : 1.f;
}

static __global__ void optimizer_advance_kernel(int64_t* t, ScheduleArgs a, float beta1, float beta2, float* values) {
  advance_step_values(t, a, beta1, beta2, values);
}

// The record's first half; the search below fills in the index when the scale is not finite.
static __global__ void nonfinite_record_start_kernel(const float* scale, int32_t* out) {
  const float sc = *scale;
  out[0] = __float_as_int(sc);
  out[1] = isfinite(sc) ? -1 : INT_MAX;
}

// Exits at once on a finite scale (every step but a bad one), else finds the first
// non-finite gradient with atomicMin.
static __global__ void nonfinite_search_kernel(const float* scale, const float* g, int64_t n, int32_t* out) {
  if (isfinite(*scale)) return;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    if (!isfinite(g[i])) {
      atomicMin(out + 1, static_cast<int32_t>(i));
      return;  // the thread's later elements have larger indices
    }
}

}  // namespace

void sgd_step(float* p, const float* g, float* momentum_buf, int64_t n, const SgdArgs& a, const float* grad_scale,
              uint16_t* shadow, const float* step_values, cudaStream_t stream) {
  DPT_CHECK(n >= 0, "sgd_step: negative size");
  if (n == 0) return;
  DPT_CHECK(p != nullptr && g != nullptr, "sgd_step: null parameters or gradients");
  const bool mom = a.momentum != 0.f;
  DPT_CHECK(!mom || momentum_buf != nullptr, "sgd_step: momentum without a momentum buffer");
  const bool vec = aligned16(p) && aligned16(g) && (!mom || aligned16(momentum_buf)) && aligned(shadow, 8);
  if (vec)
    launch_after_previous(sgd_step_kernel<true>, blocks_for(n / 4), kThreads, stream, p, g, momentum_buf, n, a,
                          grad_scale, shadow, step_values);
  else
    launch_after_previous(sgd_step_kernel<false>, blocks_for(n), kThreads, stream, p, g, momentum_buf, n, a, grad_scale,
                          shadow, step_values);
}

void adamw_step(float* p, const float* g, float* m, float* v, int64_t n, const AdamArgs& a, const float* grad_scale,
                uint16_t* shadow, const float* step_values, cudaStream_t stream) {
  DPT_CHECK(n >= 0, "adamw_step: negative size");
  if (n == 0) return;
  DPT_CHECK(p != nullptr && g != nullptr && m != nullptr && v != nullptr, "adamw_step: null pointer");
  const bool vec = aligned16(p) && aligned16(g) && aligned16(m) && aligned16(v) && aligned(shadow, 8);
  if (vec)
    launch_after_previous(adamw_step_kernel<true>, blocks_for(n / 4), kThreads, stream, p, g, m, v, n, a, grad_scale,
                          shadow, step_values);
  else
    launch_after_previous(adamw_step_kernel<false>, blocks_for(n), kThreads, stream, p, g, m, v, n, a, grad_scale,
                          shadow, step_values);
}

void optimizer_advance(int64_t* t, const ScheduleArgs& a, float beta1, float beta2, float* values,
                       cudaStream_t stream) {
  DPT_CHECK(t != nullptr && values != nullptr, "optimizer_advance: null pointer");
  optimizer_advance_kernel<<<1, 1, 0, stream>>>(t, a, beta1, beta2, values);
  DPT_CUDA_CHECK_LAUNCH();
}

void nonfinite_record(const float* scale, const float* g, int64_t n, int32_t* out, cudaStream_t stream) {
  DPT_CHECK(scale != nullptr && out != nullptr && (n == 0 || g != nullptr), "nonfinite_record: null pointer");
  nonfinite_record_start_kernel<<<1, 1, 0, stream>>>(scale, out);
  DPT_CUDA_CHECK_LAUNCH();
  const int64_t searched = n < INT_MAX - 1 ? n : INT_MAX - 1;
  if (searched == 0) return;
  // A small grid: on a good step it only reads the scale and exits.
  const int blocks = static_cast<int>(std::min<int64_t>(132, (searched + kThreads - 1) / kThreads));
  nonfinite_search_kernel<<<blocks, kThreads, 0, stream>>>(scale, g, searched, out);
  DPT_CUDA_CHECK_LAUNCH();
}

void clip_coef(const float* norm_sq, float max_norm, float* out, cudaStream_t stream) {
  DPT_CHECK(norm_sq != nullptr && out != nullptr, "clip_coef: null pointer");
  clip_coef_kernel<<<1, 1, 0, stream>>>(norm_sq, max_norm, out);
  DPT_CUDA_CHECK_LAUNCH();
}

}  // namespace dpt::cuda
