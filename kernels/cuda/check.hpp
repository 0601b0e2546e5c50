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

// The one template of every checked call (as ggml's CUDA_CHECK_GEN): `text` is the call as
// written (stringized by the named macro, before any macro in it expands), `status` its
// result, `ok` the library's success value and `describe` its text for a status.
#define DPT_STATUS_CHECK_(what, text, status, ok, describe)                                    \
  do {                                                                                         \
    const auto dpt_st_ = (status);                                                             \
    if (dpt_st_ != (ok)) ::dpt::cuda::fail(what, text, describe(dpt_st_), __FILE__, __LINE__); \
  } while (0)
#define DPT_STATUS_WARN_(text, status, ok, describe)                                                            \
  do {                                                                                                          \
    const auto dpt_st_ = (status);                                                                              \
    if (dpt_st_ != (ok)) ::dpt::report(::dpt::Severity::warning, std::string(text) + ": " + describe(dpt_st_)); \
  } while (0)

#define DPT_CUDA_CHECK(call) DPT_STATUS_CHECK_("CUDA", #call, call, cudaSuccess, cudaGetErrorString)
#define DPT_CUDA_WARN(call) DPT_STATUS_WARN_(#call, call, cudaSuccess, cudaGetErrorString)
#define DPT_CUBLAS_CHECK(call) DPT_STATUS_CHECK_("cuBLAS", #call, call, CUBLAS_STATUS_SUCCESS, cublasGetStatusString)
#if DPT_WITH_CUDNN
#define DPT_CUDNN_CHECK(call) DPT_STATUS_CHECK_("cuDNN", #call, call, CUDNN_STATUS_SUCCESS, cudnnGetErrorString)
#define DPT_CUDNN_WARN(call) DPT_STATUS_WARN_(#call, call, CUDNN_STATUS_SUCCESS, cudnnGetErrorString)
#endif

// After every kernel launch: catches bad launch configurations at once.
#define DPT_CUDA_CHECK_LAUNCH() DPT_CUDA_CHECK(cudaGetLastError())

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
