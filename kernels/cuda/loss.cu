// loss.cu — mean squared error and softmax cross-entropy, forward and backward; twins of
// kernels/cpu loss.cpp.
//
// The forwards reduce to one scalar on the device, deterministically: a grid whose size
// depends only on the problem writes one partial per block into `work`, then a single
// block adds the partials in a fixed order (in double) and writes the scalar. Same
// inputs, same bits, on any GPU and any run; no float atomics.
//
// The bf16 twins read bf16 predictions or logits as floats, compute the same expressions
// and round each stored gradient once (bf16.hpp); losses stay fp32.
#include <cmath>
#include <cstdint>
#include <string>

#include "../bf16.hpp"
#include "check.hpp"
#include "common.cuh"
#include "cuda.hpp"
#include "loops.cuh"
#include "row_softmax.cuh"

namespace dpt::cuda {
namespace {

// ---- mse --------------------------------------------------------------------------------

// Each block's partial s goes to part[block]; the last block to finish (the counter says
// which) adds the partials in block order, in double, writes their mean over n to *loss
// and leaves the counter at 0.
__device__ void finish_mean_in_last_block(float s, int64_t n, float* part, unsigned* counter, float* loss) {
  s = block_sum(s);
  __shared__ bool last;
  if (threadIdx.x == 0) {
    part[blockIdx.x] = s;
    __threadfence();  // the partial is visible to every block before the count says so
    last = atomicAdd(counter, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();  // acquire: the other blocks' partials are read after their count
  double total = 0;
  for (unsigned b = threadIdx.x; b < gridDim.x; b += blockDim.x) total += __ldcg(part + b);
  total = block_sum(total);
  if (threadIdx.x == 0) {
    *loss = static_cast<float>(total / static_cast<double>(n));
    *counter = 0;
  }
}

// Predictions and gradients are float or bf16 (as_float and store, load_four and
// store_four); targets are float.

// sum((y - t)^2) / n in one kernel, and dy = 2 (y - t) / n alongside when dy is not null
// (the gradient for a seed of 1, so a training step needs no separate backward pass).
// Each block writes its partial to part[block]; the last block to finish (the counter
// says which) adds the partials in block order, in double, and leaves the counter at 0.
// Four elements an access over [0, 4 * (n / 4)) when Vec; the rest one at a time.
template <typename T, bool Vec>
static __global__ void mse_kernel(const T* y, const float* t, int64_t n, T* dy, float* part, unsigned* counter,
                                  float* loss) {
  DPT_WAIT_PREVIOUS_GRID();
  const int64_t tid = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const float g = 2.f / static_cast<float>(n);
  float s = 0.f;
  int64_t done = 0;
  if constexpr (Vec) {
    const int64_t n4 = n / 4;
    const float4* t4 = reinterpret_cast<const float4*>(t);
#pragma unroll 4  // several iterations' loads in flight (the sum stays in order)
    for (int64_t i = tid; i < n4; i += stride) {
      const float4 a = load_four(y + 4 * i);
      const float4 b = t4[i];
      const float d0 = a.x - b.x, d1 = a.y - b.y, d2 = a.z - b.z, d3 = a.w - b.w;
      s += d0 * d0 + d1 * d1 + d2 * d2 + d3 * d3;
      if (dy) store_four(dy + 4 * i, make_float4(g * d0, g * d1, g * d2, g * d3));
    }
    done = 4 * n4;
  }
  for (int64_t i = done + tid; i < n; i += stride) {
    const float d = as_float(y[i]) - t[i];
    s += d * d;
    if (dy) store(dy + i, g * d);
  }
  finish_mean_in_last_block(s, n, part, counter, loss);
}

// dy = scale * (*dloss when given) * 2 (y - t) / n.
template <typename T>
static __global__ void mse_backward_kernel(const T* y, const float* t, int64_t n, const float* dloss, float scale,
                                           T* dy) {
  const float g = 2.f * scale * (dloss ? *dloss : 1.f) / static_cast<float>(n);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    store(dy + i, g * (as_float(y[i]) - t[i]));
}

template <typename T>
void mse_forward_launch(const char* who, const T* y, const float* t, int64_t n, float* loss, T* dy, float* work,
                        unsigned* counter, cudaStream_t stream) {
  DPT_CHECK(n >= 0, std::string(who) + ": negative size");
  DPT_CHECK(loss != nullptr && work != nullptr && counter != nullptr && (n == 0 || (y != nullptr && t != nullptr)),
            std::string(who) + ": null pointer");
  if (n == 0) {  // the mean of nothing is NaN (0/0), as on the CPU
    finish_sum(work, 0, NAN, loss, stream);
    DPT_CUDA_CHECK_LAUNCH();
    return;
  }
  // About 4 elements a thread (one float4: for the seed workload's 64 x 1000 loss, 63 blocks
  // whose loads are all in flight at once, instead of 16 blocks each looping).
  const unsigned blocks = reduce_blocks(n, 4);
  if (aligned(y, 4 * sizeof(T)) && aligned16(t) && (!dy || aligned(dy, 4 * sizeof(T))))
    launch_after_previous(mse_kernel<T, true>, blocks, kThreads, stream, y, t, n, dy, work, counter, loss);
  else launch_after_previous(mse_kernel<T, false>, blocks, kThreads, stream, y, t, n, dy, work, counter, loss);
}

template <typename T>
void mse_backward_launch(const char* who, const T* y, const float* t, int64_t n, const float* dloss, float scale, T* dy,
                         cudaStream_t stream) {
  DPT_CHECK(n >= 0, std::string(who) + ": negative size");
  if (n == 0) return;
  DPT_CHECK(y != nullptr && t != nullptr && dy != nullptr, std::string(who) + ": null pointer");
  mse_backward_kernel<<<blocks_for(n), kThreads, 0, stream>>>(y, t, n, dloss, scale, dy);
  DPT_CUDA_CHECK_LAUNCH();
}

// ---- cross-entropy ----------------------------------------------------------------------

// One warp per row, one pass over it (row_softmax.cuh).
template <typename T>
__device__ __forceinline__ RowStats row_stats(const T* x, int64_t cols, int lane) {
  float m = -INFINITY, s = 0.f;
  int64_t c = lane;
  // Four loads in flight before the (branchy) updates, which stay in column order.
  for (; c + 96 < cols; c += 128) {
    const float v0 = as_float(x[c]), v1 = as_float(x[c + 32]), v2 = as_float(x[c + 64]), v3 = as_float(x[c + 96]);
    online_add(v0, m, s);
    online_add(v1, m, s);
    online_add(v2, m, s);
    online_add(v3, m, s);
  }
  for (; c < cols; c += 32) online_add(as_float(x[c]), m, s);
  return warp_merge({m, s});
}

// work[r] = logsumexp(row r) - row r [label r]. A label outside [0, cols) gives NaN, so a
// bad label shows in the loss instead of reading out of bounds.
template <typename T>
static __global__ void cross_entropy_rows_kernel(const T* logits, const int32_t* labels, int64_t rows, int64_t cols,
                                                 float* work) {
  on_warp_row(logits, rows, cols, [&](int64_t r, int lane, const T* x) {
    const RowStats st = row_stats(x, cols, lane);
    if (lane == 0) {
      const int32_t label = labels[r];
      work[r] = label >= 0 && label < cols ? logf(st.sum) + st.max - as_float(x[label]) : NAN;
    }
  });
}

// dlogits = (*dloss / rows) (softmax(row) - onehot(label)). dlogits may be logits: each
// element is read by the lane that then overwrites it, after the row's stats are known.
template <typename T>
static __global__ void cross_entropy_backward_kernel(const T* logits, const int32_t* labels, int64_t rows, int64_t cols,
                                                     const float* dloss, T* dlogits) {
  on_warp_row(logits, rows, cols, [&](int64_t r, int lane, const T* x) {
    T* dx = dlogits + r * cols;
    const RowStats st = row_stats(x, cols, lane);
    const float g = *dloss / static_cast<float>(rows);
    const float inv_sum = 1.f / st.sum;
    const int64_t label = labels[r];
#pragma unroll 4
    for (int64_t c = lane; c < cols; c += 32) {
      const float p = expf(as_float(x[c]) - st.max) * inv_sum;
      store(dx + c, g * (c == label ? p - 1.f : p));
    }
  });
}

// work[r] = 1 when row r's largest logit (the first of equal ones; NaNs never win) is at
// its label, else 0. A warp a row: each lane keeps the best of its columns, then the
// lanes merge, the larger value winning and the lower column breaking ties, so the
// result is the CPU's scan from the left.
template <typename T>
static __global__ void accuracy_rows_kernel(const T* logits, const int32_t* labels, int64_t rows, int64_t cols,
                                            float* work) {
  on_warp_row(logits, rows, cols, [&](int64_t r, int lane, const T* x) {
    float best = 0.f;
    int64_t at = -1;
    for (int64_t c = lane; c < cols; c += 32) {
      const float v = as_float(x[c]);
      if (!isnan(v) && (at < 0 || v > best)) best = v, at = c;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ob = __shfl_xor_sync(0xffffffffu, best, o);
      const int64_t oa = __shfl_xor_sync(0xffffffffu, at, o);
      if (oa >= 0 && (at < 0 || ob > best || (ob == best && oa < at))) best = ob, at = oa;
    }
    if (lane == 0) work[r] = at >= 0 && at == labels[r] ? 1.f : 0.f;
  });
}

template <typename T>
void accuracy_launch(const char* who, const T* logits, const int32_t* labels, int64_t rows, int64_t cols, float* out,
                     float* work, cudaStream_t stream) {
  DPT_CHECK(rows > 0 && cols > 0, std::string(who) + ": bad shape (rows and cols must be > 0)");
  DPT_CHECK(logits != nullptr && labels != nullptr && out != nullptr && work != nullptr,
            std::string(who) + ": null pointer");
  accuracy_rows_kernel<<<warp_row_blocks(who, rows), kThreads, 0, stream>>>(logits, labels, rows, cols, work);
  DPT_CUDA_CHECK_LAUNCH();
  finish_sum(work, rows, 1.0 / static_cast<double>(rows), out, stream);  // counts: exact in any order
  DPT_CUDA_CHECK_LAUNCH();
}

template <typename T>
void cross_entropy_forward_launch(const char* who, const T* logits, const int32_t* labels, int64_t rows, int64_t cols,
                                  float* loss, float* work, cudaStream_t stream) {
  DPT_CHECK(rows >= 0 && cols > 0, std::string(who) + ": bad shape (cols must be > 0)");
  DPT_CHECK(loss != nullptr && work != nullptr && (rows == 0 || (logits != nullptr && labels != nullptr)),
            std::string(who) + ": null pointer");
  if (rows == 0) {  // the mean over no rows is NaN (0/0), as on the CPU
    finish_sum(work, 0, NAN, loss, stream);
    DPT_CUDA_CHECK_LAUNCH();
    return;
  }
  cross_entropy_rows_kernel<<<warp_row_blocks(who, rows), kThreads, 0, stream>>>(logits, labels, rows, cols, work);
  DPT_CUDA_CHECK_LAUNCH();
  finish_sum(work, rows, 1.0 / static_cast<double>(rows), loss, stream);
  DPT_CUDA_CHECK_LAUNCH();
}

template <typename T>
void cross_entropy_backward_launch(const char* who, const T* logits, const int32_t* labels, int64_t rows, int64_t cols,
                                   const float* dloss, T* dlogits, cudaStream_t stream) {
  DPT_CHECK(rows >= 0 && cols >= 0, std::string(who) + ": negative shape");
  if (rows == 0 || cols == 0) return;
  DPT_CHECK(logits != nullptr && labels != nullptr && dloss != nullptr && dlogits != nullptr,
            std::string(who) + ": null pointer");
  cross_entropy_backward_kernel<<<warp_row_blocks(who, rows), kThreads, 0, stream>>>(logits, labels, rows, cols, dloss,
                                                                                     dlogits);
  DPT_CUDA_CHECK_LAUNCH();
}

}  // namespace

// The public entries, each twice: fp32 (T float, the plain name) and bf16 (T uint16_t, the
// name with _bf16), each running its one launcher under its own name (for the messages).
#define DPT_LOSS_ENTRIES(T, SUFFIX)                                                                                   \
  void mse_forward##SUFFIX(const T* y, const float* t, int64_t n, float* loss, T* dy, float* work, unsigned* counter, \
                           cudaStream_t stream) {                                                                     \
    mse_forward_launch("mse_forward" #SUFFIX, y, t, n, loss, dy, work, counter, stream);                              \
  }                                                                                                                   \
  void mse_backward##SUFFIX(const T* y, const float* t, int64_t n, const float* dloss, float scale, T* dy,            \
                            cudaStream_t stream) {                                                                    \
    mse_backward_launch("mse_backward" #SUFFIX, y, t, n, dloss, scale, dy, stream);                                   \
  }                                                                                                                   \
  void cross_entropy_forward##SUFFIX(const T* logits, const int32_t* labels, int64_t rows, int64_t cols, float* loss, \
                                     float* work, cudaStream_t stream) {                                              \
    cross_entropy_forward_launch("cross_entropy_forward" #SUFFIX, logits, labels, rows, cols, loss, work, stream);    \
  }                                                                                                                   \
  void cross_entropy_backward##SUFFIX(const T* logits, const int32_t* labels, int64_t rows, int64_t cols,             \
                                      const float* dloss, T* dlogits, cudaStream_t stream) {                          \
    cross_entropy_backward_launch("cross_entropy_backward" #SUFFIX, logits, labels, rows, cols, dloss, dlogits,       \
                                  stream);                                                                            \
  }                                                                                                                   \
  void accuracy##SUFFIX(const T* logits, const int32_t* labels, int64_t rows, int64_t cols, float* out, float* work,  \
                        cudaStream_t stream) {                                                                        \
    accuracy_launch("accuracy" #SUFFIX, logits, labels, rows, cols, out, work, stream);                               \
  }
DPT_LOSS_ENTRIES(float, )
DPT_LOSS_ENTRIES(uint16_t, _bf16)
#undef DPT_LOSS_ENTRIES

}  // namespace dpt::cuda
