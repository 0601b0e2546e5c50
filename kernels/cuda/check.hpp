// Checked CUDA, cuBLAS, cuDNN and NCCL calls: a failure throws dpt::Error naming the call,
// the device, file:line and the library's own text for the code. Destructors use the
// DPT_*_WARN variants, which print instead of throwing.
#pragma once
#include <string>

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#if DPT_WITH_CUDNN
#include <cudnn.h>
#endif

#include <dptrain/error.hpp>

namespace dpt::cuda {

inline std::string current_device_name() {
  int d = -1;
  if (cudaGetDevice(&d) != cudaSuccess) return "cuda:?";
  return "cuda:" + std::to_string(d);
}

[[noreturn]] inline void fail(const char* what, const char* call, const std::string& text, const char* file, int line) {
  throw ::dpt::Error(std::string(what) + " failed on " + current_device_name() + ": " + call + ": " + text + " (" +
                     file + ":" + std::to_string(line) + ")");
}

}  // namespace dpt::cuda

#define DPT_CUDA_CHECK(call)                                                                                         \
  do {                                                                                                               \
    cudaError_t dpt_err_ = (call);                                                                                   \
    if (dpt_err_ != cudaSuccess) ::dpt::cuda::fail("CUDA", #call, cudaGetErrorString(dpt_err_), __FILE__, __LINE__); \
  } while (0)

#define DPT_CUBLAS_CHECK(call)                                                                \
  do {                                                                                        \
    cublasStatus_t dpt_st_ = (call);                                                          \
    if (dpt_st_ != CUBLAS_STATUS_SUCCESS)                                                     \
      ::dpt::cuda::fail("cuBLAS", #call, cublasGetStatusString(dpt_st_), __FILE__, __LINE__); \
  } while (0)

#if DPT_WITH_CUDNN
#define DPT_CUDNN_CHECK(call)                                                              \
  do {                                                                                     \
    cudnnStatus_t dpt_st_ = (call);                                                        \
    if (dpt_st_ != CUDNN_STATUS_SUCCESS)                                                   \
      ::dpt::cuda::fail("cuDNN", #call, cudnnGetErrorString(dpt_st_), __FILE__, __LINE__); \
  } while (0)

#define DPT_CUDNN_WARN(call)                                                                             \
  do {                                                                                                   \
    cudnnStatus_t dpt_st_ = (call);                                                                      \
    if (dpt_st_ != CUDNN_STATUS_SUCCESS)                                                                 \
      ::dpt::report(::dpt::Severity::warning, std::string(#call) + ": " + cudnnGetErrorString(dpt_st_)); \
  } while (0)
#endif

// After every kernel launch: catches bad launch configurations at once.
#define DPT_CUDA_CHECK_LAUNCH() DPT_CUDA_CHECK(cudaGetLastError())

#define DPT_CUDA_WARN(call)                                                                              \
  do {                                                                                                   \
    cudaError_t dpt_err_ = (call);                                                                       \
    if (dpt_err_ != cudaSuccess)                                                                         \
      ::dpt::report(::dpt::Severity::warning, std::string(#call) + ": " + cudaGetErrorString(dpt_err_)); \
  } while (0)

namespace dpt::cuda {
// Makes `index` the calling thread's current device. cudaSetDevice is a driver call under
// a lock even when nothing changes (7% of the seed training loop's host time on the H200,
// where every op made one); cudaGetDevice reads the thread's state, so the set is made
// only on a change, and a device someone else made current is still seen.
inline void set_device(int index) {
  int now = -1;
  if (cudaGetDevice(&now) == cudaSuccess && now == index) return;
  DPT_CUDA_CHECK(cudaSetDevice(index));
}
}  // namespace dpt::cuda
