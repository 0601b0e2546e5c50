// DPT_HD marks a function that the CPU twins and the CUDA kernels share: host and device
// (inlined) under nvcc, plain inline elsewhere; and the few helpers such functions need
// on both sides. What they compute lives in headers named for it (schedule.hpp,
// grad_check.hpp, bf16.hpp, philox.hpp).
#pragma once

#if defined(__CUDACC__)
#define DPT_HD __host__ __device__ __forceinline__
#else
#define DPT_HD inline
#endif

#include <cmath>
#include <cstdint>

namespace dpt {

// isfinite on either side.
DPT_HD bool finite(float x) {
#if defined(__CUDA_ARCH__)
  return isfinite(x);
#else
  return std::isfinite(x);
#endif
}

}  // namespace dpt
