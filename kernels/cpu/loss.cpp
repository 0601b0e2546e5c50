// MSE and softmax cross-entropy on the CPU; sums in double so the oracle is the
// accurate side of every comparison.
#include <cmath>

#include "bf16_io.hpp"
#include "cpu.hpp"

namespace dpt::cpu {

void mse_forward(const float* y, const float* t, int64_t n, float* loss, float* dy) {
  double s = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(y[i]) - t[i];
    s += d * d;
  }
  *loss = static_cast<float>(s / static_cast<double>(n));
  if (dy) mse_backward(y, t, n, nullptr, 1.0f, dy);
}

void mse_backward(const float* y, const float* t, int64_t n, const float* dloss, float scale, float* dy) {
  const float s = 2.0f * scale * (dloss ? *dloss : 1.0f) / static_cast<float>(n);
  for (int64_t i = 0; i < n; ++i) dy[i] = s * (y[i] - t[i]);
}

namespace {
// log(sum(exp(row))) with the row's maximum taken out first, so it cannot overflow.
double logsumexp(const float* row, int64_t cols) {
  float mx = row[0];
  for (int64_t j = 1; j < cols; ++j) mx = std::fmax(mx, row[j]);
  double s = 0.0;
  for (int64_t j = 0; j < cols; ++j) s += std::exp(static_cast<double>(row[j]) - mx);
  return mx + std::log(s);
}
}  // namespace

// A label outside [0, cols) gives NaN (as on a GPU), so a bad label shows in the loss
// instead of reading out of bounds.
void cross_entropy_forward(const float* logits, const int32_t* labels, int64_t rows, int64_t cols, float* loss) {
  double s = 0.0;
  for (int64_t i = 0; i < rows; ++i) {
    const float* row = logits + i * cols;
    s += labels[i] >= 0 && labels[i] < cols ? logsumexp(row, cols) - row[labels[i]] : std::nan("");
  }
  *loss = static_cast<float>(s / static_cast<double>(rows));
}

void cross_entropy_backward(const float* logits, const int32_t* labels, int64_t rows, int64_t cols, const float* dloss,
                            float* dlogits) {
  const double scale = static_cast<double>(*dloss) / static_cast<double>(rows);
  for (int64_t i = 0; i < rows; ++i) {
    const float* row = logits + i * cols;
    const double lse = logsumexp(row, cols);
    for (int64_t j = 0; j < cols; ++j) {
      const double p = std::exp(static_cast<double>(row[j]) - lse);
      dlogits[i * cols + j] = static_cast<float>(scale * (p - (j == labels[i] ? 1.0 : 0.0)));
    }
  }
}

void mse_forward_bf16(const uint16_t* y, const float* t, int64_t n, float* loss, uint16_t* dy) {
  const auto v = widen(y, n);
  mse_forward(v.data(), t, n, loss, nullptr);
  if (dy) mse_backward_bf16(y, t, n, nullptr, 1.0f, dy);
}

void mse_backward_bf16(const uint16_t* y, const float* t, int64_t n, const float* dloss, float scale, uint16_t* dy) {
  const auto v = widen(y, n);
  std::vector<float> g(static_cast<size_t>(n));
  mse_backward(v.data(), t, n, dloss, scale, g.data());
  narrow(g, dy);
}

void accuracy(const float* logits, const int32_t* labels, int64_t rows, int64_t cols, float* out) {
  int64_t right = 0;
  for (int64_t i = 0; i < rows; ++i) {
    const float* row = logits + i * cols;
    int64_t best = -1;
    for (int64_t c = 0; c < cols; ++c)
      if (!std::isnan(row[c]) && (best < 0 || row[c] > row[best])) best = c;
    right += best >= 0 && best == labels[i];
  }
  *out = static_cast<float>(static_cast<double>(right) / static_cast<double>(rows));
}
void accuracy_bf16(const uint16_t* logits, const int32_t* labels, int64_t rows, int64_t cols, float* out) {
  const auto v = widen(logits, rows * cols);
  accuracy(v.data(), labels, rows, cols, out);
}
void cross_entropy_forward_bf16(const uint16_t* logits, const int32_t* labels, int64_t rows, int64_t cols,
                                float* loss) {
  const auto v = widen(logits, rows * cols);
  cross_entropy_forward(v.data(), labels, rows, cols, loss);
}

void cross_entropy_backward_bf16(const uint16_t* logits, const int32_t* labels, int64_t rows, int64_t cols,
                                 const float* dloss, uint16_t* dlogits) {
  auto v = widen(logits, rows * cols);
  cross_entropy_backward(v.data(), labels, rows, cols, dloss, v.data());
  narrow(v, dlogits);
}

}  // namespace dpt::cpu
