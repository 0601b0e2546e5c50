// CPU GEMM: the oracle for both CUDA GEMMs. The loop order (i, p, j) keeps the inner
// loop contiguous over C and B so the compiler vectorizes it; transposed operands are
// read through strides.
#include <algorithm>
#include <vector>

#include "cpu.hpp"

namespace dpt::cpu {

void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* A,
          const float* B, float beta, float* C) {
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

}  // namespace dpt::cpu
