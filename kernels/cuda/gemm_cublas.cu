// gemm_cublas.cu — the GEMM through cuBLAS, same contract as cpu::gemm and gemm_native.
//
// cuBLAS is column-major. A row-major matrix read as column-major is its transpose, so the
// row-major C = op(A) op(B) is computed as the column-major C^T = op(B)^T op(A)^T: swap the
// operands and m with n, keep each operand's own transpose flag and leading dimension.
// The bf16 entries run the same call with bf16 operands (cublasGemmEx: A/B CUDA_R_16BF,
// C CUDA_R_16BF or CUDA_R_32F, CUBLAS_COMPUTE_32F).
#include <climits>
#include <string>

#include "check.hpp"
#include "cuda.hpp"

namespace dpt::cuda {

cublasComputeType_t compute_type(Precision p) {
  switch (p) {
    case Precision::fp32:
      return CUBLAS_COMPUTE_32F;
    case Precision::tf32:
      return CUBLAS_COMPUTE_32F_FAST_TF32;
    case Precision::bf16:
      return CUBLAS_COMPUTE_32F_FAST_16BF;
  }
  throw ::dpt::Error("cuBLAS: unknown precision " + std::to_string(static_cast<int>(p)));
}

namespace {

// The shared body: operands of type ab, C of type c, computed in `compute`.
void gemm_ex(cublasHandle_t handle, const char* who, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
             const void* A, const void* B, cudaDataType_t ab, float beta, void* C, cudaDataType_t c,
             cublasComputeType_t compute) {
  DPT_CHECK(handle != nullptr, std::string(who) + ": null cuBLAS handle");
  DPT_CHECK(m >= 0 && n >= 0 && k >= 0, std::string(who) + ": negative size");
  DPT_CHECK(m <= INT_MAX && n <= INT_MAX && k <= INT_MAX, std::string(who) + ": a dimension does not fit cuBLAS's int");
  if (m == 0 || n == 0) return;
  // alpha and beta live on the host here; a handle left in device pointer mode would read
  // them as device addresses.
  cublasPointerMode_t mode;
  DPT_CUBLAS_CHECK(cublasGetPointerMode(handle, &mode));
  DPT_CHECK(mode == CUBLAS_POINTER_MODE_HOST, std::string(who) + ": handle is not in host pointer mode");
  const int M = static_cast<int>(m), N = static_cast<int>(n), K = static_cast<int>(k);
  // cuBLAS asks for a leading dimension >= 1 even when the operand is empty (k == 0).
  const int lda = ta ? M : (K > 0 ? K : 1);
  const int ldb = tb ? (K > 0 ? K : 1) : N;
  DPT_CUBLAS_CHECK(cublasGemmEx(handle, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, N, M, K, &alpha,
                                B, ab, ldb, A, ab, lda, &beta, C, c, N, compute, CUBLAS_GEMM_DEFAULT));
}

}  // namespace

void gemm_cublas_strided_batched(cublasHandle_t handle, Precision precision, bool ta, bool tb, int64_t m, int64_t n,
                                 int64_t k, float alpha, const float* A, int64_t stride_a, const float* B,
                                 int64_t stride_b, float beta, float* C, int64_t stride_c, int64_t batch) {
  DPT_CHECK(handle != nullptr, "gemm_cublas_strided_batched: null cuBLAS handle");
  DPT_CHECK(m >= 1 && n >= 1 && k >= 1 && batch >= 0, "gemm_cublas_strided_batched: empty or negative size");
  DPT_CHECK(m <= INT_MAX && n <= INT_MAX && k <= INT_MAX && batch <= INT_MAX,
            "gemm_cublas_strided_batched: a dimension does not fit cuBLAS's int");
  if (batch == 0) return;
  cublasPointerMode_t mode;
  DPT_CUBLAS_CHECK(cublasGetPointerMode(handle, &mode));
  DPT_CHECK(mode == CUBLAS_POINTER_MODE_HOST, "gemm_cublas_strided_batched: handle is not in host pointer mode");
  const int M = static_cast<int>(m), N = static_cast<int>(n), K = static_cast<int>(k);
  // Row-major as gemm_ex: the column-major C^T = op(B)^T op(A)^T.
  DPT_CUBLAS_CHECK(cublasGemmStridedBatchedEx(handle, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, N,
                                              M, K, &alpha, B, CUDA_R_32F, tb ? K : N, stride_b, A, CUDA_R_32F,
                                              ta ? M : K, stride_a, &beta, C, CUDA_R_32F, N, stride_c,
                                              static_cast<int>(batch), compute_type(precision), CUBLAS_GEMM_DEFAULT));
}

void gemm_cublas(cublasHandle_t handle, Precision precision, bool ta, bool tb, int64_t m, int64_t n, int64_t k,
                 float alpha, const float* A, const float* B, float beta, float* C) {
  gemm_ex(handle, "gemm_cublas", ta, tb, m, n, k, alpha, A, B, CUDA_R_32F, beta, C, CUDA_R_32F,
          compute_type(precision));
}

void gemm_bf16(cublasHandle_t handle, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const uint16_t* A,
               const uint16_t* B, float beta, float* C) {
  gemm_ex(handle, "gemm_bf16", ta, tb, m, n, k, alpha, A, B, CUDA_R_16BF, beta, C, CUDA_R_32F, CUBLAS_COMPUTE_32F);
}

void gemm_bf16(cublasHandle_t handle, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const uint16_t* A,
               const uint16_t* B, float beta, uint16_t* C) {
  gemm_ex(handle, "gemm_bf16", ta, tb, m, n, k, alpha, A, B, CUDA_R_16BF, beta, C, CUDA_R_16BF, CUBLAS_COMPUTE_32F);
}

}  // namespace dpt::cuda
