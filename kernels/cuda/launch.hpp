// Programmatic dependent launch (Hopper and newer) for the small kernels of a step, and
// launches in thread-block clusters.
//
// A kernel launched with launch_after_previous() may be put on the GPU while the kernel
// before it on the stream is still finishing. Its first statement is
// DPT_WAIT_PREVIOUS_GRID(), which waits until that kernel has finished and its writes are
// visible, and then lets the next kernel be scheduled in turn. So the result is that of a
// plain launch; what is gained is the launch latency between dependent kernels, which a
// step made of small dependent kernels (the seed workload's) pays once a kernel (README,
// "Measurements behind the code", has the figures).
//
// A kernel launched so MUST start with DPT_WAIT_PREVIOUS_GRID(), or it races with the one
// before it. Only reads of memory that no kernel since the one two back can write may come
// before the wait (checked_update_kernel's optimizer state), and writes of memory that no
// kernel since the one two back can read or write (speculative_update_kernel's backup,
// which its optimizer owns and made with a memset, a plain operation, before its first
// use): a kernel lets the next start only after its own wait (or, not launched so, when
// it ends), so the one two back has finished by then. DPT_SM90 (CMake) is 1 only when every CUDA architecture built
// is 9.0 or newer: otherwise the code that runs may lack the wait, and the launch stays a plain one.
//
// launch_after_previous_in_clusters also groups the blocks into thread-block clusters
// (9.0 and newer: blocks of a cluster run at once and read each other's shared memory);
// callers use clusters only when DPT_SM90 is 1.
//
// allow_optin_smem lets a kernel's blocks have more than 48 KiB of dynamic shared memory.
#pragma once
#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <utility>

#include "check.hpp"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define DPT_WAIT_PREVIOUS_GRID() asm volatile("griddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;" ::: "memory")
#else
#define DPT_WAIT_PREVIOUS_GRID() \
  do {                           \
  } while (0)
#endif

#ifndef DPT_SM90
#define DPT_SM90 0
#endif

namespace dpt::cuda {

// `cooperative`: a kernel whose blocks wait for each other (a grid-wide barrier) is launched
// so that all of them are on the GPU at once, or not at all (an error), also beside other
// processes' kernels (MPS). `cluster` (grid a multiple of it): blocks in clusters of that
// shape, none when 1 x 1 x 1. `smem`: bytes of dynamic shared memory a block.
template <typename... Params, typename... Args>
void launch_kernel_ex(bool cooperative, dim3 cluster, void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                      cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attrs[3] = {};
  unsigned count = 0;
  if (DPT_SM90) {
    attrs[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[count++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cooperative) {
    attrs[count].id = cudaLaunchAttributeCooperative;
    attrs[count++].val.cooperative = 1;
  }
  if (cluster.x * cluster.y * cluster.z > 1) {
#if DPT_SM90  // else only the throw: code after it would be unreachable (a warning, an error with -Werror)
    DPT_CHECK(grid.x % cluster.x == 0 && grid.y % cluster.y == 0 && grid.z % cluster.z == 0,
              "a grid of whole thread-block clusters");
    attrs[count].id = cudaLaunchAttributeClusterDimension;
    attrs[count].val.clusterDim.x = cluster.x;
    attrs[count].val.clusterDim.y = cluster.y;
    attrs[count++].val.clusterDim.z = cluster.z;
#else
    throw ::dpt::Error("thread-block clusters need every CUDA architecture built to be 9.0 or newer");
#endif
  }
  cfg.attrs = attrs;
  cfg.numAttrs = count;
  DPT_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

template <typename... Params, typename... Args>
void launch_after_previous_as(bool cooperative, void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream,
                              Args&&... args) {
  launch_kernel_ex(cooperative, dim3(1, 1, 1), kernel, grid, block, 0, stream, std::forward<Args>(args)...);
}

template <typename... Params, typename... Args>
void launch_after_previous_in_clusters(dim3 cluster, void (*kernel)(Params...), dim3 grid, dim3 block,
                                       cudaStream_t stream, Args&&... args) {
  launch_kernel_ex(false, cluster, kernel, grid, block, 0, stream, std::forward<Args>(args)...);
}

template <typename... Params, typename... Args>
void launch_after_previous(void (*kernel)(Params...), dim3 grid, dim3 block, cudaStream_t stream, Args&&... args) {
  launch_after_previous_as(false, kernel, grid, block, stream, std::forward<Args>(args)...);
}

// With `smem` bytes of dynamic shared memory a block (past 48 KiB the kernel must have
// been allowed them: cudaFuncAttributeMaxDynamicSharedMemorySize).
template <typename... Params, typename... Args>
void launch_after_previous_smem(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                                Args&&... args) {
  launch_kernel_ex(false, dim3(1, 1, 1), kernel, grid, block, smem, stream, std::forward<Args>(args)...);
}

// Whether a block of `kernel` may have `bytes` of dynamic shared memory on the current
// device. Past 48 KiB a kernel must be allowed more (cudaFuncAttributeMaxDynamicSharedMemorySize,
// a setting of the kernel on each device): here it is allowed all it can have there (the
// device's opt-in limit less the kernel's static shared memory) on its first ask, once a
// kernel and device, so that host threads launching it with different sizes never set it
// against each other. Where this is false the caller takes another kernel.
inline bool allow_optin_smem(const void* kernel, size_t bytes) {
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, size_t> allowed;  // (kernel, device) -> bytes
  int device = 0;
  DPT_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mu);
  auto it = allowed.find({kernel, device});
  if (it == allowed.end()) {
    int optin = 0;
    cudaFuncAttributes attr{};
    DPT_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    DPT_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
    const size_t limit = static_cast<size_t>(optin),
                 most = limit > attr.sharedSizeBytes ? limit - attr.sharedSizeBytes : 0;
    DPT_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(most)));
    it = allowed.emplace(std::make_pair(kernel, device), most).first;
  }
  return bytes <= it->second;
}

template <typename... Params>
bool allow_optin_smem(void (*kernel)(Params...), size_t bytes) {
  return allow_optin_smem(reinterpret_cast<const void*>(kernel), bytes);
}

}  // namespace dpt::cuda
