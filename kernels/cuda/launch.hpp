// Programmatic dependent launch (Hopper and newer) for the small kernels of a step.
//
// A kernel launched with launch_after_previous() may be put on the GPU while the kernel
// before it on the stream is still finishing. Its first statement is
// DPT_WAIT_PREVIOUS_GRID(), which waits until that kernel has finished and its writes are
// visible, and then lets the next kernel be scheduled in turn. So the result is that of a
// plain launch; what is gained is the launch latency between dependent kernels, which a
// step made of small dependent kernels (the seed workload's) pays once a kernel (README,
// Performance, has the measurements).
//
// A kernel launched so MUST start with DPT_WAIT_PREVIOUS_GRID(), or it races with the one
// before it. DPT_PDL (CMake) is 1 only when every CUDA architecture built is 9.0 or newer:
// otherwise the code that runs may lack the wait, and the launch stays a plain one.
#pragma once
#include <cuda_runtime.h>

#include <utility>

#include "check.hpp"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define DPT_WAIT_PREVIOUS_GRID() asm volatile("griddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;" ::: "memory")
#else
#define DPT_WAIT_PREVIOUS_GRID() \
  do {                           \
  } while (0)
#endif

#ifndef DPT_PDL
#define DPT_PDL 0
#endif

namespace dpt::cuda {

template <typename... Params, typename... Args>
void launch_after_previous(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = DPT_PDL ? 1 : 0;
  DPT_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

}  // namespace dpt::cuda
