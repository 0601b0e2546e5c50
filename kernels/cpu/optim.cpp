// Fused optimizer updates over a flat parameter buffer, with PyTorch's semantics
// (torch.optim.SGD and torch.optim.AdamW), so results can be compared with it.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "../bf16.hpp"
#include "../grad_check.hpp"
#include "../schedule.hpp"
#include "../shadow.hpp"
#include "cpu.hpp"

namespace dpt::cpu {

namespace {
// The step's values from the counter, which moves on by one (the step applied or not),
// and the shadow the update writes, rounded at the step (nearest without a counter).
ShadowStore take_step(const StepCounterArgs* step, float* values, uint16_t* shadow) {
  if (!step) return shadow_store(shadow, ShadowRounding{}, 0);
  const int64_t s = *step->t;
  step_values_at(s, step->schedule, step->beta1, step->beta2, values);
  if (step->advance) *step->t += 1;
  return shadow_store(shadow, step->rounding, s);
}

// The gradients' scale (1 without one), and whether the update applies: where the scale
// is not finite (non-finite gradients) the whole update is skipped. A skipped step leaves
// the parameters; stochastic rounding writes their shadow again with this step's random
// bits, as the GPU's updates that undo a step do, so that after the update of step s the
// shadow is always step s's rounding of the parameters (what a resume makes again:
// Optimizer::refresh_shadow).
bool applies(const float* grad_scale, const float* p, int64_t n, const ShadowStore& shadow, float& scale) {
  scale = grad_scale ? *grad_scale : 1.0f;
  if (std::isfinite(scale)) return true;
  if (shadow.stochastic && shadow.bits)
    for (int64_t i = 0; i < n; ++i) shadow.store(i, p[i]);
  return false;
}
}  // namespace

void sgd_step(float* p, const float* g, float* buf, int64_t n, const SgdArgs& args, const float* grad_scale,
              uint16_t* shadow, const StepCounterArgs* step) {
  SgdArgs a = args;
  float values[3] = {a.lr, 1.0f, 1.0f};
  const ShadowStore sh = take_step(step, values, shadow);
  a.lr = values[0];
  float scale = 1.0f;
  if (!applies(grad_scale, p, n, sh, scale)) return;
  for (int64_t i = 0; i < n; ++i) {
    float d = g[i] * scale + a.weight_decay * p[i];
    if (a.momentum != 0.0f) {
      // buf starts at zero, so the first step leaves buf = (1 - dampening) * d.
      buf[i] = a.momentum * buf[i] + (1.0f - a.dampening) * d;
      d = a.nesterov ? d + a.momentum * buf[i] : buf[i];
    }
    p[i] -= a.lr * d;
    sh.store(i, p[i]);
  }
}

void adamw_step(float* p, const float* g, float* m, float* v, int64_t n, const AdamArgs& args, const float* grad_scale,
                uint16_t* shadow, const StepCounterArgs* step) {
  AdamArgs a = args;
  float values[3] = {a.lr, a.bias_correction1, a.bias_correction2};
  const ShadowStore sh = take_step(step, values, shadow);
  a.lr = values[0];
  a.bias_correction1 = values[1];
  a.bias_correction2 = values[2];
  float scale = 1.0f;
  if (!applies(grad_scale, p, n, sh, scale)) return;
  for (int64_t i = 0; i < n; ++i) {
    const float d = g[i] * scale;
    p[i] -= a.lr * weight_decay_at(a, i) * p[i];
    m[i] = a.beta1 * m[i] + (1.0f - a.beta1) * d;
    v[i] = a.beta2 * v[i] + (1.0f - a.beta2) * d * d;
    p[i] -= a.lr * (m[i] / a.bias_correction1) / (std::sqrt(v[i] / a.bias_correction2) + a.eps);
    sh.store(i, p[i]);
  }
}

void refresh_shadow(const float* p, uint16_t* shadow, int64_t n, const StepCounterArgs& step) {
  const int64_t taken = *step.t;
  // No update has written the shadow yet: it is the masters' cast, as the module made it.
  const ShadowStore sh =
      shadow_store(shadow, taken > 0 ? step.rounding : ShadowRounding{Bf16Rounding::nearest, 0, 0}, taken - 1);
  for (int64_t i = 0; i < n; ++i) sh.store(i, p[i]);
}

void clip_coef(const float* norm_sq, float max_norm, float* out) { *out = scale_from_norm_sq(*norm_sq, max_norm); }

void shard_check(const float* g, int64_t n, int64_t base, float* sum, int64_t* first) {
  double sq = 0.0;
  int64_t first_bad = INT64_MAX;
  for (int64_t i = 0; i < n; ++i) {
    sq += static_cast<double>(g[i]) * g[i];
    if (first_bad == INT64_MAX && !std::isfinite(g[i])) first_bad = base + i;
  }
  *sum = static_cast<float>(sq);
  *first = first_bad;
}

void finish_check(const float* sum, const int64_t* first, float max_norm, float* scale, const CheckRingArgs* ring) {
  *scale = scale_from_norm_sq(*sum, max_norm);
  if (!ring) return;
  CheckRecord rec;
  CheckRecord* slot = next_check_record(*ring, *ring->count, *scale, *first, &rec);
  *slot = rec;
}

void check_gradients(const float* g, int64_t n, float max_norm, float* scale, const CheckRingArgs* ring) {
  float sum = 0.0f;
  int64_t first = 0;
  shard_check(g, n, 0, &sum, &first);  // the whole buffer is one shard
  finish_check(&sum, &first, max_norm, scale, ring);
}

}  // namespace dpt::cpu
