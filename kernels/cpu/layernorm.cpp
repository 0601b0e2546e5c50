// The residual stream's ops on the CPU: LayerNorm over the last axis (as
// torch.nn.functional.layer_norm) and the residual add.
#include <cmath>

#include "../bf16.hpp"
#include "cpu.hpp"

namespace dpt::cpu {

namespace {

float load(float v) { return v; }
float load(uint16_t v) { return bf16_float(v); }
void put(float* p, float v) { *p = v; }
void put(uint16_t* p, float v) { *p = bf16_round(v); }

template <typename T>
void ln_forward(const T* x, const float* gamma, const float* beta, int64_t rows, int64_t cols, float eps, T* y,
                float* mean, float* rstd) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * cols;
    float s = 0.0f;
    for (int64_t c = 0; c < cols; ++c) s += load(xr[c]);
    const float m = s / static_cast<float>(cols);
    float v = 0.0f;  // two passes: the biased variance without cancellation
    for (int64_t c = 0; c < cols; ++c) {
      const float d = load(xr[c]) - m;
      v += d * d;
    }
    const float rs = 1.0f / std::sqrt(v / static_cast<float>(cols) + eps);
    for (int64_t c = 0; c < cols; ++c) put(&y[r * cols + c], (load(xr[c]) - m) * rs * gamma[c] + beta[c]);
    mean[r] = m;
    rstd[r] = rs;
  }
}

// dx = rstd (g - mean(g) - xhat mean(g xhat)) with g = dy gamma, xhat = (x - mean) rstd;
// dgamma = sum over rows of dy xhat, dbeta = sum of dy (each added to param_beta * old).
template <typename T>
void ln_backward(const T* x, const T* dy, const float* gamma, const float* mean, const float* rstd, int64_t rows,
                 int64_t cols, T* dx, float beta_gamma, float* dgamma, float beta_beta, float* dbeta) {
  for (int64_t r = 0; r < rows && dx; ++r) {
    float sg = 0.0f, sgx = 0.0f;
    for (int64_t c = 0; c < cols; ++c) {
      const float g = load(dy[r * cols + c]) * gamma[c];
      sg += g;
      sgx += g * ((load(x[r * cols + c]) - mean[r]) * rstd[r]);
    }
    const float mg = sg / static_cast<float>(cols), mgx = sgx / static_cast<float>(cols);
    for (int64_t c = 0; c < cols; ++c) {
      const float xhat = (load(x[r * cols + c]) - mean[r]) * rstd[r];
      put(&dx[r * cols + c], rstd[r] * (load(dy[r * cols + c]) * gamma[c] - mg - xhat * mgx));
    }
  }
  for (int64_t c = 0; c < cols; ++c) {
    float sg = 0.0f, sb = 0.0f;
    for (int64_t r = 0; r < rows; ++r) {
      const float d = load(dy[r * cols + c]);
      sg += d * ((load(x[r * cols + c]) - mean[r]) * rstd[r]);
      sb += d;
    }
    if (dgamma) dgamma[c] = beta_gamma != 0.0f ? beta_gamma * dgamma[c] + sg : sg;
    if (dbeta) dbeta[c] = beta_beta != 0.0f ? beta_beta * dbeta[c] + sb : sb;
  }
}

}  // namespace

void layer_norm_forward(const float* x, const float* gamma, const float* beta, int64_t rows, int64_t cols, float eps,
                        float* y, float* mean, float* rstd) {
  ln_forward(x, gamma, beta, rows, cols, eps, y, mean, rstd);
}
void layer_norm_forward_bf16(const uint16_t* x, const float* gamma, const float* beta, int64_t rows, int64_t cols,
                             float eps, uint16_t* y, float* mean, float* rstd) {
  ln_forward(x, gamma, beta, rows, cols, eps, y, mean, rstd);
}
void layer_norm_backward(const float* x, const float* dy, const float* gamma, const float* mean, const float* rstd,
                         int64_t rows, int64_t cols, float* dx, float beta_gamma, float* dgamma, float beta_beta,
                         float* dbeta) {
  ln_backward(x, dy, gamma, mean, rstd, rows, cols, dx, beta_gamma, dgamma, beta_beta, dbeta);
}
void layer_norm_backward_bf16(const uint16_t* x, const uint16_t* dy, const float* gamma, const float* mean,
                              const float* rstd, int64_t rows, int64_t cols, uint16_t* dx, float beta_gamma,
                              float* dgamma, float beta_beta, float* dbeta) {
  ln_backward(x, dy, gamma, mean, rstd, rows, cols, dx, beta_gamma, dgamma, beta_beta, dbeta);
}

void residual_add(const float* a, const float* b, int64_t n, float* y) {
  for (int64_t i = 0; i < n; ++i) y[i] = a[i] + b[i];
}
void residual_add_bf16(const uint16_t* a, const uint16_t* b, int64_t n, uint16_t* y) {
  for (int64_t i = 0; i < n; ++i) y[i] = bf16_round(bf16_float(a[i]) + bf16_float(b[i]));
}

}  // namespace dpt::cpu
