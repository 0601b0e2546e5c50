// optim.cu — fused SGD and AdamW updates over a flat parameter buffer, and the gradient
// clipping coefficient; twins of kernels/cpu optim.cpp (PyTorch's semantics).
//
// One pass reads each parameter, gradient and state once and writes them once, float4 at a
// time when every buffer is 16-byte aligned (the last n % 4 elements go scalar). The
// gradient scale stays on the device (clip_coef writes it), so clipping needs no host
// round trip. With a bf16 shadow (bf16 training) the same pass also writes the updated
// parameters rounded to bf16 (to nearest, or stochastically: kernels/shadow.hpp), so the
// copy that the GEMMs read costs no pass of its own.
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
  const ShadowStore sh = step_shadow(shadow, step, s);
  const float scale = grad_scale ? *grad_scale : 1.f;
  if (isfinite(scale)) sgd_loop<Vec>(p, g, buf, n, a, scale, sh);
  else shadow_again<Vec>(p, n, sh);  // the whole update is skipped
  count_step(step, s);
}

// Four blocks an SM (60 registers, not 90): the update is bound by memory, and with two
// blocks an SM (25% occupancy) an H100 reached 83% of its DRAM bandwidth on GPT-2's.
template <bool Vec>
static __global__ void __launch_bounds__(kThreads, 4)
    adamw_step_kernel(float* p, const float* g, float* m, float* v, int64_t n, AdamArgs a, const float* grad_scale,
                      uint16_t* shadow, StepCounterArgs step) {
  DPT_WAIT_PREVIOUS_GRID();
  float values[3] = {a.lr, a.bias_correction1, a.bias_correction2};
  const int64_t s = read_step(step, values);
  a.lr = values[0];
  a.bias_correction1 = values[1];
  a.bias_correction2 = values[2];
  const ShadowStore sh = step_shadow(shadow, step, s);
  const float scale = grad_scale ? *grad_scale : 1.f;
  if (isfinite(scale)) adamw_loop<Vec>(p, g, m, v, n, a, scale, sh);
  else shadow_again<Vec>(p, n, sh);  // the whole update is skipped
  count_step(step, s);
}

// The shadow as the counter's last update rounded it (step *t - 1; to nearest before the
// first step). The counter is only read.
template <bool Vec>
static __global__ void refresh_shadow_kernel(const float* p, uint16_t* shadow, int64_t n, StepCounterArgs step) {
  DPT_WAIT_PREVIOUS_GRID();
  const int64_t taken = *step.t;
  const ShadowStore sh = shadow_store(shadow, taken > 0 ? step.rounding : ShadowRounding{}, taken - 1);
  vec4_loop<Vec>(
      n, [&](int64_t q) { store_shadow4(sh, q, load_four(p + 4 * q)); }, [&](int64_t i) { sh.store(i, p[i]); });
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

void refresh_shadow(const float* p, uint16_t* shadow, int64_t n, const StepCounterArgs& step, cudaStream_t stream) {
  DPT_CHECK(n >= 0 && step.t != nullptr, "refresh_shadow: a negative size or no step counter");
  if (n == 0) return;
  DPT_CHECK(p != nullptr && shadow != nullptr, "refresh_shadow: null parameters or shadow");
  if (aligned16(p) && aligned(shadow, 8))
    launch_after_previous(refresh_shadow_kernel<true>, blocks_for(n / 4), kThreads, stream, p, shadow, n, step);
  else launch_after_previous(refresh_shadow_kernel<false>, blocks_for(n), kThreads, stream, p, shadow, n, step);
}

}  // namespace dpt::cuda
