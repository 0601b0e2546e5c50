// NVTX ranges, so an Nsight Systems timeline of dptrain reads at a glance (forward,
// backward, reduce, update per device). Header-only NVTX 3 from the CUDA toolkit; a
// no-op in CPU-only builds.
#pragma once

#if DPT_WITH_CUDA
#include <nvtx3/nvToolsExt.h>
#endif

namespace dpt {

class NvtxRange {
 public:
#if DPT_WITH_CUDA
  explicit NvtxRange(const char* name) { nvtxRangePushA(name); }
  ~NvtxRange() { nvtxRangePop(); }
#else
  explicit NvtxRange(const char*) {}
#endif
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;
};

}  // namespace dpt
