// DPT_HD marks a function that the CPU twins and the CUDA kernels share: host and device
// (inlined) under nvcc, plain inline elsewhere.
#pragma once

#if defined(__CUDACC__)
#define DPT_HD __host__ __device__ __forceinline__
#else
#define DPT_HD inline
#endif
