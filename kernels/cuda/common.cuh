// common.cuh — what the CUDA kernel files share, device helpers and their launch side,
// each defined once so that it has one meaning everywhere:
// - warp_sum and block_sum, the sums in their fixed order, and reduce_blocks, the grid of a
//   two-stage reduction as a function of the problem alone. Bit-for-bit determinism (the
//   same inputs give the same bits on any GPU and any run) rests on adding the same floats
//   in the same order, so that order is written down here once.
// - The launch geometry of the one-dimensional kernels: kThreads a block, and blocks_for,
//   the grid of a grid-stride loop.
// - aligned and aligned16: whether a pointer allows the vector (16-byte) accesses.
// - as_float and store: elements stored as float or bf16, read as floats and each store
//   rounded once (bf16.hpp), as the CPU twins do.
// - act_forward and act_derivative, the activations; visit_act, their one list; and
//   dispatch_act, which turns the Act a launcher is given into the instantiation of its kernel for that activation.
// - Programmatic dependent launch (launch.hpp): launch_after_previous, DPT_WAIT_PREVIOUS_GRID;
//   launches in thread-block clusters: launch_after_previous_in_clusters.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include <dptrain/error.hpp>
#include <dptrain/types.hpp>

#include "../bf16.hpp"
#include "../gelu.hpp"
#include "../hd.hpp"
#include "cuda.hpp"
#include "launch.hpp"

namespace dpt::cuda {

// ---- launch geometry --------------------------------------------------------------------

// Threads a block of the one-dimensional kernels (grid-stride loops; a warp a row).
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// Grid-stride loops: enough blocks to fill any current GPU, few enough to amortise the
// per-thread setup over many elements.
constexpr int64_t kMaxBlocks = 8192;

// A grid-stride loop's first index and stride.
__device__ __forceinline__ int64_t global_tid() { return blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; }
__device__ __forceinline__ int64_t grid_stride() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

// Blocks of kThreads for `items` work items: at least one, at most max_blocks (the
// grid-stride loop covers the rest).
inline unsigned blocks_for(int64_t items, int64_t max_blocks = kMaxBlocks) {
  const int64_t b = (items + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 1 ? 1 : b < max_blocks ? b : max_blocks);
}

// ---- 16-byte accesses -------------------------------------------------------------------

// Whether p allows accesses of `bytes` bytes at a time (a null pointer does).
DPT_HD bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }
DPT_HD bool aligned16(const void* p) { return aligned(p, 16); }

// ---- float and bf16 elements ------------------------------------------------------------

__device__ __forceinline__ float as_float(float v) { return v; }
__device__ __forceinline__ float as_float(uint16_t v) { return bf16_float(v); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(uint16_t* p, float v) { *p = bf16_round(v); }

// ---- activations ------------------------------------------------------------------------

constexpr float kInvSqrt2 = 0.70710678118654752f;
constexpr float kInvSqrt2Pi = 0.39894228040143268f;

template <Act A>
__device__ __forceinline__ float act_forward(float v) {
  if constexpr (A == Act::relu) return v > 0.f ? v : 0.f;
  if constexpr (A == Act::gelu) return 0.5f * v * erfcf(-v * kInvSqrt2);  // erfc: no cancellation for z << 0
  if constexpr (A == Act::tanh) return tanhf(v);
  if constexpr (A == Act::gelu_tanh) return gelu_tanh_forward(v);
  return v;
}

// act'(.) from what the forward saved: y for relu/tanh/none, the pre-activation z for the
// GELUs (act_saves_input).
template <Act A>
__device__ __forceinline__ float act_derivative(float s) {
  if constexpr (A == Act::relu) return s > 0.f ? 1.f : 0.f;
  if constexpr (A == Act::gelu) return 0.5f * erfcf(-s * kInvSqrt2) + s * expf(-0.5f * s * s) * kInvSqrt2Pi;
  if constexpr (A == Act::tanh) return 1.f - s * s;
  if constexpr (A == Act::gelu_tanh) return gelu_tanh_derivative(s);
  return 1.f;
}

// Returns f(std::integral_constant<Act, A>{}) for the A that act names, so that f can
// instantiate a kernel or a function for it (decltype(a)::value), and unknown() for an act
// outside the enum: the one list of the activations, for the host's dispatch_act and the
// device's run-time forms below. (Host and device: nvcc checks where f and unknown may run
// only where visit_act is instantiated, with each side's own callables.)
#pragma nv_exec_check_disable
template <typename F, typename Unknown>
DPT_HD decltype(auto) visit_act(Act act, F&& f, Unknown&& unknown) {
  switch (act) {
    case Act::none:
      return f(std::integral_constant<Act, Act::none>{});
    case Act::relu:
      return f(std::integral_constant<Act, Act::relu>{});
    case Act::gelu:
      return f(std::integral_constant<Act, Act::gelu>{});
    case Act::tanh:
      return f(std::integral_constant<Act, Act::tanh>{});
    case Act::gelu_tanh:
      return f(std::integral_constant<Act, Act::gelu_tanh>{});
  }
  return unknown();
}

// The activations for an act known only at run time (kernels that take it per layer); an
// act outside the enum is the identity.
__device__ __forceinline__ float act_forward(Act act, float v) {
  return visit_act(
      act, [v](auto a) { return act_forward<decltype(a)::value>(v); }, [v] { return v; });
}
__device__ __forceinline__ float act_derivative(Act act, float s) {
  return visit_act(
      act, [s](auto a) { return act_derivative<decltype(a)::value>(s); }, [] { return 1.f; });
}

// One instantiation per activation, and no switch in any kernel's loop: f(a) for the
// activation act names (visit_act); an act outside the enum throws, naming `who`.
template <typename F>
decltype(auto) dispatch_act(Act act, const char* who, F&& f) {
  using Result = decltype(f(std::integral_constant<Act, Act::none>{}));
  return visit_act(act, f, [who]() -> Result { throw ::dpt::Error(std::string(who) + ": unknown activation"); });
}

// ---- reductions in a fixed order --------------------------------------------------------

// Butterfly reductions: float addition is commutative, so every lane ends with the same
// bits.
template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum over the block, valid in thread 0. blockDim.x must be a multiple of 32, <= 1024.
template <typename T>
__device__ T block_sum(T v) {
  __shared__ T warp_part[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  v = warp_sum(v);
  if (lane == 0) warp_part[warp] = v;
  __syncthreads();
  T t = 0;
  if (warp == 0) {
    t = lane < static_cast<int>(blockDim.x / 32) ? warp_part[lane] : T(0);
    t = warp_sum(t);
  }
  return t;
}

// The one block that adds a reduction's partials (stage two).
constexpr int kFinishThreads = 1024;

// Stage-one blocks of a reduction over n items, about items_per_thread a thread, at most
// kReduceWork blocks. A function of the problem alone, so the order of the additions never
// depends on the device.
inline unsigned reduce_blocks(int64_t n, int64_t items_per_thread) {
  const int64_t per_block = static_cast<int64_t>(kThreads) * items_per_thread;
  const int64_t b = (n + per_block - 1) / per_block;
  return static_cast<unsigned>(b < 1 ? 1 : b < kReduceWork ? b : kReduceWork);
}

}  // namespace dpt::cuda
