// The residual stream's ops on the CPU: LayerNorm over the last axis (as
// torch.nn.functional.layer_norm) and the residual add.
#include <cmath>

#include "bf16_io.hpp"
#include "cpu.hpp"

namespace dpt::cpu {

namespace {

// y's rows are ldy apart; columns cols .. ldy - 1 get the ones column (1, then 0s).
template <typename T>
void ln_forward(const T* x, const float* gamma, const float* beta, int64_t rows, int64_t cols, float eps, T* y,
                int64_t ldy, float* mean, float* rstd) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * cols;
    float s = 0.0f;
    for (int64_t c = 0; c < cols; ++c) s += as_float(xr[c]);
    const float m = s / static_cast<float>(cols);
    float v = 0.0f;  // two passes: the biased variance without cancellation
    for (int64_t c = 0; c < cols; ++c) {
      const float d = as_float(xr[c]) - m;
      v += d * d;
    }
    const float rs = 1.0f / std::sqrt(v / static_cast<float>(cols) + eps);
    for (int64_t c = 0; c < cols; ++c) store(&y[r * ldy + c], (as_float(xr[c]) - m) * rs * gamma[c] + beta[c]);
    for (int64_t c = cols; c < ldy; ++c) store(&y[r * ldy + c], c == cols ? 1.0f : 0.0f);
    mean[r] = m;
    rstd[r] = rs;
  }
}

// dx = rstd (g - mean(g) - xhat mean(g xhat)) with g = dy gamma, xhat = (x - mean) rstd;
// dgamma = sum over rows of dy xhat, dbeta = sum of dy (each added to param_beta * old).
template <typename T>
void ln_backward(const T* x, const T* dy, const float* gamma, const float* mean, const float* rstd, int64_t rows,
                 int64_t cols, T* dx, bool dx_add, float beta_gamma, float* dgamma, float beta_beta, float* dbeta,
                 float* dx_sums) {
  for (int64_t r = 0; r < rows && dx; ++r) {
    float sg = 0.0f, sgx = 0.0f;
    for (int64_t c = 0; c < cols; ++c) {
      const float g = as_float(dy[r * cols + c]) * gamma[c];
      sg += g;
      sgx += g * ((as_float(x[r * cols + c]) - mean[r]) * rstd[r]);
    }
    const float mg = sg / static_cast<float>(cols), mgx = sgx / static_cast<float>(cols);
    for (int64_t c = 0; c < cols; ++c) {
      const float xhat = (as_float(x[r * cols + c]) - mean[r]) * rstd[r];
      const float v = rstd[r] * (as_float(dy[r * cols + c]) * gamma[c] - mg - xhat * mgx);
      store(&dx[r * cols + c], dx_add ? as_float(dx[r * cols + c]) + v : v);
    }
  }
  for (int64_t c = 0; c < cols; ++c) {
    float sg = 0.0f, sb = 0.0f;
    for (int64_t r = 0; r < rows; ++r) {
      const float d = as_float(dy[r * cols + c]);
      sg += d * ((as_float(x[r * cols + c]) - mean[r]) * rstd[r]);
      sb += d;
    }
    if (dgamma) dgamma[c] = beta_gamma != 0.0f ? beta_gamma * dgamma[c] + sg : sg;
    if (dbeta) dbeta[c] = beta_beta != 0.0f ? beta_beta * dbeta[c] + sb : sb;
  }
  for (int64_t c = 0; c < cols && dx && dx_sums; ++c) {
    float s = 0.0f;
    for (int64_t r = 0; r < rows; ++r) s += as_float(dx[r * cols + c]);
    dx_sums[c] = s;
  }
}

template <typename T>
void add(const T* a, const T* b, int64_t n, T* y) {
  for (int64_t i = 0; i < n; ++i) store(&y[i], as_float(a[i]) + as_float(b[i]));
}

}  // namespace

void layer_norm_forward(const float* x, const float* gamma, const float* beta, int64_t rows, int64_t cols, float eps,
                        float* y, float* mean, float* rstd) {
  ln_forward(x, gamma, beta, rows, cols, eps, y, cols, mean, rstd);
}
void layer_norm_forward_bf16(const uint16_t* x, const float* gamma, const float* beta, int64_t rows, int64_t cols,
                             float eps, uint16_t* y, int64_t ldy, float* mean, float* rstd) {
  ln_forward(x, gamma, beta, rows, cols, eps, y, ldy, mean, rstd);
}
void layer_norm_backward(const float* x, const float* dy, const float* gamma, const float* mean, const float* rstd,
                         int64_t rows, int64_t cols, float* dx, bool dx_add, float beta_gamma, float* dgamma,
                         float beta_beta, float* dbeta, float* dx_sums) {
  ln_backward(x, dy, gamma, mean, rstd, rows, cols, dx, dx_add, beta_gamma, dgamma, beta_beta, dbeta, dx_sums);
}
void layer_norm_backward_bf16(const uint16_t* x, const uint16_t* dy, const float* gamma, const float* mean,
                              const float* rstd, int64_t rows, int64_t cols, uint16_t* dx, bool dx_add,
                              float beta_gamma, float* dgamma, float beta_beta, float* dbeta, float* dx_sums) {
  ln_backward(x, dy, gamma, mean, rstd, rows, cols, dx, dx_add, beta_gamma, dgamma, beta_beta, dbeta, dx_sums);
}

void residual_add(const float* a, const float* b, int64_t n, float* y) { add(a, b, n, y); }
void residual_add_bf16(const uint16_t* a, const uint16_t* b, int64_t n, uint16_t* y) { add(a, b, n, y); }

}  // namespace dpt::cpu
