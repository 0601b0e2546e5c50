// Fused optimizer updates over a flat parameter buffer, with PyTorch's semantics
// (torch.optim.SGD and torch.optim.AdamW), so results can be compared with it.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "../bf16.hpp"
#include "../hd.hpp"
#include "cpu.hpp"

namespace dpt::cpu {

void sgd_step(float* p, const float* g, float* buf, int64_t n, const SgdArgs& args, const float* grad_scale,
              uint16_t* shadow, const float* step_values) {
  const float scale = grad_scale ? *grad_scale : 1.0f;
  if (!std::isfinite(scale)) return;  // non-finite gradients: the whole update is skipped
  SgdArgs a = args;
  if (step_values) a.lr = step_values[0];
  for (int64_t i = 0; i < n; ++i) {
    float d = g[i] * scale + a.weight_decay * p[i];
    if (a.momentum != 0.0f) {
      // buf starts at zero, so the first step leaves buf = (1 - dampening) * d.
      buf[i] = a.momentum * buf[i] + (1.0f - a.dampening) * d;
      d = a.nesterov ? d + a.momentum * buf[i] : buf[i];
    }
    p[i] -= a.lr * d;
    if (shadow) shadow[i] = bf16_round(p[i]);
  }
}

void adamw_step(float* p, const float* g, float* m, float* v, int64_t n, const AdamArgs& args, const float* grad_scale,
                uint16_t* shadow, const float* step_values) {
  const float scale = grad_scale ? *grad_scale : 1.0f;
  if (!std::isfinite(scale)) return;  // non-finite gradients: the whole update is skipped
  AdamArgs a = args;
  if (step_values) {
    a.lr = step_values[0];
    a.bias_correction1 = step_values[1];
    a.bias_correction2 = step_values[2];
  }
  for (int64_t i = 0; i < n; ++i) {
    const float d = g[i] * scale;
    p[i] -= a.lr * a.weight_decay * p[i];
    m[i] = a.beta1 * m[i] + (1.0f - a.beta1) * d;
    v[i] = a.beta2 * v[i] + (1.0f - a.beta2) * d * d;
    p[i] -= a.lr * (m[i] / a.bias_correction1) / (std::sqrt(v[i] / a.bias_correction2) + a.eps);
    if (shadow) shadow[i] = bf16_round(p[i]);
  }
}

void clip_coef(const float* norm_sq, float max_norm, float* out) {
  if (!std::isfinite(*norm_sq)) {
    *out = std::numeric_limits<float>::quiet_NaN();  // tells the optimizer to skip the step
    return;
  }
  *out = max_norm > 0.0f ? std::min(1.0f, max_norm / (std::sqrt(*norm_sq) + 1e-6f)) : 1.0f;
}

void optimizer_advance(int64_t* t, const ScheduleArgs& a, float beta1, float beta2, float* values) {
  advance_step_values(t, a, beta1, beta2, values);
}

void nonfinite_record(const float* scale, const float* g, int64_t n, int32_t* out) {
  std::memcpy(out, scale, 4);
  out[1] = -1;
  if (std::isfinite(*scale)) return;
  out[1] = std::numeric_limits<int32_t>::max();
  const int64_t searched = std::min<int64_t>(n, std::numeric_limits<int32_t>::max() - 1);
  for (int64_t i = 0; i < searched; ++i)
    if (!std::isfinite(g[i])) {
      out[1] = static_cast<int32_t>(i);
      return;
    }
}

}  // namespace dpt::cpu
