// gemm_cublas.cu — the GEMM through cuBLAS, same contract as cpu::gemm and gemm_native.
//
// cuBLAS is column-major. A row-major matrix read as column-major is its transpose, so the
// row-major C = op(A) op(B) is computed as the column-major C^T = op(B)^T op(A)^T: swap the
// operands and m with n, keep each operand's own transpose flag and leading dimension.
#include <climits>

#include "check.hpp"
#include "cuda.hpp"

namespace dpt::cuda {

namespace {

cublasComputeType_t compute_type(Precision p) {
  switch (p) {
    case Precision::fp32: return CUBLAS_COMPUTE_32F;
    case Precision::tf32: return CUBLAS_COMPUTE_32F_FAST_TF32;
    case Precision::bf16: return CUBLAS_COMPUTE_32F_FAST_16BF;
  }
  throw ::dpt::Error("gemm_cublas: unknown precision " + std::to_string(static_cast<int>(p)));
}

}  // namespace

void gemm_cublas(cublasHandle_t handle, Precision precision, bool ta, bool tb, int64_t m,
                 int64_t n, int64_t k, float alpha, const float* A, const float* B, float beta,
                 float* C) {
  DPT_CHECK(handle != nullptr, "gemm_cublas: null cuBLAS handle");
  DPT_CHECK(m >= 0 && n >= 0 && k >= 0, "gemm_cublas: negative size");
  DPT_CHECK(m <= INT_MAX && n <= INT_MAX && k <= INT_MAX,
            "gemm_cublas: a dimension does not fit cuBLAS's int");
  if (m == 0 || n == 0) return;
  // alpha and beta live on the host here; a handle left in device pointer mode would read
  // them as device addresses.
  cublasPointerMode_t mode;
  DPT_CUBLAS_CHECK(cublasGetPointerMode(handle, &mode));
  DPT_CHECK(mode == CUBLAS_POINTER_MODE_HOST, "gemm_cublas: handle is not in host pointer mode");
  const int M = static_cast<int>(m), N = static_cast<int>(n), K = static_cast<int>(k);
  // cuBLAS asks for a leading dimension >= 1 even when the operand is empty (k == 0).
  const int lda = ta ? M : (K > 0 ? K : 1);
  const int ldb = tb ? (K > 0 ? K : 1) : N;
  DPT_CUBLAS_CHECK(cublasGemmEx(handle, tb ? CUBLAS_OP_T : CUBLAS_OP_N,
                                ta ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K, &alpha, B, CUDA_R_32F,
                                ldb, A, CUDA_R_32F, lda, &beta, C, CUDA_R_32F, N,
                                compute_type(precision), CUBLAS_GEMM_DEFAULT));
}

}  // namespace dpt::cuda
