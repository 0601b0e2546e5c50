// optim.cu — fused SGD and AdamW updates over a flat parameter buffer, and the gradient
// clipping coefficient; twins of kernels/cpu optim.cpp (PyTorch's semantics).
//
// One pass reads each parameter, gradient and state once and writes them once, float4 at a
// time when every buffer is 16-byte aligned (the last n % 4 elements go scalar). The
// gradient scale stays on the device (clip_coef writes it), so clipping needs no host
// round trip. With a bf16 shadow (bf16 training) the same pass also writes the updated
// parameters rounded to bf16, so the copy that the GEMMs read costs no pass of its own.
//
// The checked and alternating updates are in optim_checked.cu, the gradient check in
// grad_check.cu.
#include <cstdint>

#include "check.hpp"
#include "common.cuh"
#include "cuda.hpp"
#include "optim_update.cuh"

namespace dpt::cuda {
namespace {

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

}  // namespace dpt::cuda
