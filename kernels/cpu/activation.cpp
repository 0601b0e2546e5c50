// Bias + activation forward, activation backward and the bias gradient on the CPU.
#include <cmath>

#include "../gelu.hpp"
#include "bf16_io.hpp"
#include "cpu.hpp"

namespace dpt::cpu {

namespace {
float activate(Act act, float z) {
  switch (act) {
    case Act::relu:
      return z > 0.0f ? z : 0.0f;
    case Act::gelu:
      return 0.5f * z * std::erfc(-z * 0.70710678118654752f);  // erfc: no cancellation for z << 0
    case Act::tanh:
      return std::tanh(z);
    case Act::gelu_tanh:
      return gelu_tanh_forward(z);
    case Act::none:
      break;
  }
  return z;
}

// Derivative from what the forward saved: the output y (relu, tanh, none) or z (the GELUs).
float derivative(Act act, float saved) {
  switch (act) {
    case Act::relu:
      return saved > 0.0f ? 1.0f : 0.0f;
    case Act::gelu:
      return 0.5f * std::erfc(-saved * 0.70710678118654752f) +
             saved * std::exp(-0.5f * saved * saved) * 0.3989422804014327f;
    case Act::tanh:
      return 1.0f - saved * saved;
    case Act::gelu_tanh:
      return gelu_tanh_derivative(saved);
    case Act::none:
      break;
  }
  return 1.0f;
}
}  // namespace

void bias_act_forward(const float* x, const float* bias, Act act, int64_t rows, int64_t cols, float* z, float* y) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) {
      const int64_t e = i * cols + j;
      const float v = x[e] + (bias ? bias[j] : 0.0f);
      if (z) z[e] = v;
      y[e] = activate(act, v);
    }
}

void act_backward(const float* dy, const float* saved, Act act, int64_t n, float* dx) {
  for (int64_t i = 0; i < n; ++i) dx[i] = dy[i] * derivative(act, saved[i]);
}

void act_backward_transposed(const float* dy, const float* saved, Act act, int64_t rows, int64_t cols, float* dx,
                             float* dxt) {
  act_backward(dy, saved, act, rows * cols, dx);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dxt[c * rows + r] = dx[r * cols + c];
}

void bias_grad(const float* dy, int64_t rows, int64_t cols, float beta, float* db) {
  for (int64_t j = 0; j < cols; ++j) {
    float s = 0.0f;
    for (int64_t i = 0; i < rows; ++i) s += dy[i * cols + j];
    db[j] = beta == 0.0f ? s : beta * db[j] + s;
  }
}

void act_bias_backward(const float* dy, const float* saved, Act act, int64_t rows, int64_t cols, float* dz, float beta,
                       float* db) {
  if (act != Act::none) act_backward(dy, saved, act, rows * cols, dz);
  bias_grad(act != Act::none ? dz : dy, rows, cols, beta, db);
}

void bias_act_forward_bf16(const float* x, const uint16_t* bias, Act act, int64_t rows, int64_t cols, uint16_t* z,
                           uint16_t* y) {
  const int64_t n = rows * cols;
  std::vector<float> zf(z ? static_cast<size_t>(n) : 0), yf(static_cast<size_t>(n));
  const auto b = bias ? widen(bias, cols) : std::vector<float>();
  bias_act_forward(x, bias ? b.data() : nullptr, act, rows, cols, z ? zf.data() : nullptr, yf.data());
  if (z) narrow(zf, z);
  narrow(yf, y);
}

void act_forward_bf16(const uint16_t* x, Act act, int64_t n, uint16_t* y) {
  auto v = widen(x, n);
  bias_act_forward(v.data(), nullptr, act, 1, n, nullptr, v.data());
  narrow(v, y);
}

void act_backward_bf16(const uint16_t* dy, const uint16_t* saved, Act act, int64_t n, uint16_t* dx) {
  auto g = widen(dy, n);
  const auto s = widen(saved, n);
  act_backward(g.data(), s.data(), act, n, g.data());
  narrow(g, dx);
}

void act_bias_backward_bf16(const uint16_t* dy, const uint16_t* saved, Act act, int64_t rows, int64_t cols,
                            uint16_t* dz, float beta, float* db) {
  if (act != Act::none) act_backward_bf16(dy, saved, act, rows * cols, dz);
  const auto g = widen(act != Act::none ? dz : dy, rows * cols);
  bias_grad(g.data(), rows, cols, beta, db);
}

void ones_column_split(const float* t, int64_t out, int64_t in, int64_t ld, float beta_w, float* dW, float beta_b,
                       float* db) {
  for (int64_t o = 0; o < out; ++o) {
    const float* row = t + o * ld;
    for (int64_t c = 0; dW && c < in; ++c) {
      float& w = dW[o * in + c];
      w = beta_w != 0.0f ? beta_w * w + row[c] : row[c];
    }
    if (db) db[o] = beta_b != 0.0f ? beta_b * db[o] + row[in] : row[in];
  }
}

}  // namespace dpt::cpu
