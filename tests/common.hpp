// Helpers shared by the tests: relative error, random tensors, finite differences.
#pragma once
#include <cmath>
#include <functional>
#include <vector>

#include "../kernels/cpu/cpu.hpp"
#include "../runtime/autograd.hpp"
#include "../runtime/ops.hpp"
#include "../runtime/tensor.hpp"

namespace dpt::test {

// ||a - b|| / ||b||; NaN anywhere gives infinity, so NaN never passes.
inline double rel_error(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return INFINITY;
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) || std::isnan(b[i])) return INFINITY;
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

inline std::vector<float> randn(int64_t n, uint64_t seed, float std = 1.0f) {
  std::vector<float> v(static_cast<size_t>(n));
  cpu::normal(v.data(), n, seed, 7, 0, std);
  return v;
}

inline Tensor randn_tensor(const Shape& s, uint64_t seed, const Device& d, float std = 1.0f) {
  return Tensor::from_host(randn(numel(s), seed, std), s, d);
}

// Central differences of the scalar f() with respect to every element of the CPU
// tensor t (perturbed in place and restored).
inline std::vector<float> numeric_grad(const Tensor& t, const std::function<float()>& f, float eps = 1e-2f) {
  std::vector<float> g(static_cast<size_t>(t.numel()));
  float* p = t.f32();
  for (int64_t i = 0; i < t.numel(); ++i) {
    const float keep = p[i];
    p[i] = keep + eps;
    const double up = f();
    p[i] = keep - eps;
    const double down = f();
    p[i] = keep;
    g[static_cast<size_t>(i)] = static_cast<float>((up - down) / (2.0 * eps));
  }
  return g;
}

}  // namespace dpt::test
