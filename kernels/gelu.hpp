// The tanh approximation of GELU (Act::gelu_tanh), as PyTorch computes it
// (F.gelu(x, approximate='tanh'), aten's GeluKernel): 0.5 z (1 + tanh(u)) with
// u = sqrt(2/pi) (z + 0.044715 z^3). One definition for the CPU twin and the CUDA kernels.
#pragma once
#include <cmath>

#include "hd.hpp"

namespace dpt {

inline constexpr float kGeluTanhBeta = 0.79788456080286536f;  // sqrt(2 / pi)
inline constexpr float kGeluTanhKappa = 0.044715f;

DPT_HD float gelu_tanh_forward(float z) {
  return 0.5f * z * (1.0f + tanhf(kGeluTanhBeta * (z + kGeluTanhKappa * z * z * z)));
}

// d/dz of the above: 0.5 (1 + t) + 0.5 z (1 - t^2) u'(z), t = tanh(u).
DPT_HD float gelu_tanh_derivative(float z) {
  const float t = tanhf(kGeluTanhBeta * (z + kGeluTanhKappa * z * z * z));
  return 0.5f * (1.0f + t) + 0.5f * z * (1.0f - t * t) * kGeluTanhBeta * (1.0f + 3.0f * kGeluTanhKappa * z * z);
}

}  // namespace dpt
