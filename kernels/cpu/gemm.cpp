// CPU GEMM: the oracle for both CUDA GEMMs. The loop order (i, p, j) keeps the inner
// loop contiguous over C and B so the compiler vectorizes it; transposed operands are
// read through strides.
#include <algorithm>
#include <vector>

#include "bf16_io.hpp"
#include "cpu.hpp"

namespace dpt::cpu {

void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* A, const float* B, float beta,
          float* C) {
  // op(B) as a contiguous k x n matrix, so the hot loop always streams rows.
  std::vector<float> bt;
  if (tb) {
    bt.resize(static_cast<size_t>(k * n));
    for (int64_t j = 0; j < n; ++j)
      for (int64_t p = 0; p < k; ++p) bt[p * n + j] = B[j * k + p];
    B = bt.data();
  }
  std::vector<float> row(static_cast<size_t>(n));
  for (int64_t i = 0; i < m; ++i) {
    std::fill(row.begin(), row.end(), 0.0f);
    for (int64_t p = 0; p < k; ++p) {
      const float a = ta ? A[p * m + i] : A[i * k + p];
      const float* b = B + p * n;
      for (int64_t j = 0; j < n; ++j) row[j] += a * b[j];
    }
    float* c = C + i * n;
    if (beta == 0.0f) {  // beta == 0 never reads C, which may hold garbage
      for (int64_t j = 0; j < n; ++j) c[j] = alpha * row[j];
    } else {
      for (int64_t j = 0; j < n; ++j) c[j] = alpha * row[j] + beta * c[j];
    }
  }
}

void gemm_bf16(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const uint16_t* A, const uint16_t* B,
               float beta, float* C) {
  const auto a = widen(A, m * k), b = widen(B, k * n);
  gemm(ta, tb, m, n, k, alpha, a.data(), b.data(), beta, C);
}

void gemm_bf16(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const uint16_t* A, const uint16_t* B,
               float beta, uint16_t* C) {
  std::vector<float> c = beta == 0.0f ? std::vector<float>(static_cast<size_t>(m * n)) : widen(C, m * n);
  gemm_bf16(ta, tb, m, n, k, alpha, A, B, beta, c.data());
  narrow(c, C);
}

void mlp_forward(int64_t rows, const float* x, const MlpLayers& layers) {
  const float* in = x;
  for (int l = 0; l < layers.count; ++l) {
    const MlpLayer& L = layers.layer[l];
    gemm(false, true, rows, L.out, L.in, 1.0f, in, L.W, 0.0f, L.y);
    bias_act_forward(L.y, L.b, L.act, rows, L.out, L.z, L.y);
    in = L.y;
  }
}

}  // namespace dpt::cpu
