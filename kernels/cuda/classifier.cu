// classifier.cu — the language model's classifier: softmax cross-entropy of each row over
// its first `vocab` columns, and its gradient written over the logits in the same kernel;
// the twin of cpu/classifier.cpp. One block a row. Where the row fits the block's shared
// memory (GPT-2's 50304 columns, bf16 or fp32) it is read once into it, its max and then its
// sum of exp(x - max) are reduced over the block in a fixed order, and the gradient is
// written from there: one read and one write of the logits, at memory speed. Other rows
// take the general kernel: the threads' online softmax statistics
// (row_softmax.cuh) merged across the block in a fixed order, and a second read for the
// gradient. The row's loss goes to work[row], then the mean over the rows is added in row
// order by one block. No float atomics: the same inputs give the same bits on every run.
#include <cuda_pipeline.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "check.hpp"
#include "common.cuh"
#include "cuda.hpp"
#include "launch.hpp"
#include "row_softmax.cuh"

namespace dpt::cuda {
namespace {

// A vocabulary row (50257 columns, GPT-2's) is long: many loads in flight a row.
constexpr int kClassifierThreads = 1024;

// The row's statistics from each thread's, merged warp by warp and then the warps in
// order; every thread gets the result.
__device__ RowStats block_merge(RowStats st) {
  __shared__ RowStats warp_part[32];
  __shared__ RowStats total;
  st = warp_merge(st);
  if (threadIdx.x % 32 == 0) warp_part[threadIdx.x / 32] = st;
  __syncthreads();
  if (threadIdx.x == 0) {
    RowStats all = warp_part[0];
    for (unsigned w = 1; w < blockDim.x / 32; ++w) all = merge(all, warp_part[w]);
    total = all;
  }
  __syncthreads();
  return total;
}

// work[r] = logsumexp(row r over [0, vocab)) - row r [target r] (NaN for a target outside
// [0, vocab), so a bad one shows in the loss); with write_grad the row becomes its gradient
// for a seed of 1, (softmax - onehot) / rows, 0 in the padding columns.
template <typename T>
static __global__ void classifier_kernel(T* logits, const int32_t* targets, int64_t rows, int64_t cols, int64_t vocab,
                                         float* work, bool write_grad) {
  T* x = logits + blockIdx.x * cols;
  const int32_t target = targets[blockIdx.x];
  const bool valid = target >= 0 && target < vocab;
  // Read before block_merge's barriers, so before any thread overwrites the row.
  const float at_target = threadIdx.x == 0 && valid ? as_float(x[target]) : NAN;
  float m = -INFINITY, s = 0.f;
  for (int64_t c = threadIdx.x; c < vocab; c += blockDim.x) online_add(as_float(x[c]), m, s);
  const RowStats st = block_merge({m, s});
  if (threadIdx.x == 0) work[blockIdx.x] = st.max + logf(st.sum) - at_target;
  if (!write_grad) return;
  const float inv_sum = 1.f / st.sum, inv_rows = 1.f / static_cast<float>(rows);
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float p = c < vocab ? expf(as_float(x[c]) - st.max) * inv_sum : 0.f;
    store(x + c, (c == target ? p - 1.f : p) * inv_rows);
  }
}

// ---- the row in registers ---------------------------------------------------------------

// 16 bytes of a row: 8 bf16 or 4 floats.
template <typename T>
struct alignas(16) Vec16 {
  static constexpr int kCount = 16 / sizeof(T);
  T v[kCount];
};

// The block's max (every thread gets it); NaN is passed over here and shows in the sum.
__device__ float block_max(float v) {
  __shared__ float warp_part[32];
  __shared__ float total;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (threadIdx.x % 32 == 0) warp_part[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    float m = warp_part[0];
    for (unsigned w = 1; w < blockDim.x / 32; ++w) m = fmaxf(m, warp_part[w]);
    total = m;
  }
  __syncthreads();
  return total;
}

// The block's sum in a fixed order (warps, then the warps' sums in order); every thread gets it.
__device__ float block_total(float v) {
  __shared__ float total;
  v = block_sum(v);
  if (threadIdx.x == 0) total = v;
  __syncthreads();
  return total;
}

// exp(x - max) for the softmax. In bf16 the fast form, 2^(x log2(e) - max log2(e)): one FFMA
// and the hardware's ex2, where x - max, its scaling and ex2 took three instructions (the
// kernel's instructions count; a few ulps of fp32 apart, far below bf16's rounding of the
// gradient, while |max| stays below about 1e4: the rounding of max log2(e) grows with it,
// and logits of a million are a model that has diverged already). Its ftz form flushes
// results below 2^-126 to 0, where the plain form took three more instructions a value to
// keep them: such a term changes no sum of at least 1, and only a gradient already below
// the smallest normal bf16. In fp32 the exact one. Exactly 1 where x is max and both are 0.
template <typename T>
struct ShiftedExp;
template <>
struct ShiftedExp<uint16_t> {
  static constexpr float kLog2e = 1.4426950408889634f;
  float neg_max_log2e;
  __device__ explicit ShiftedExp(float max) : neg_max_log2e(-max * kLog2e) {}
  __device__ __forceinline__ float operator()(float x) const {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(fmaf(x, kLog2e, neg_max_log2e)));
    return y;
  }
};
template <>
struct ShiftedExp<float> {
  float max;
  __device__ explicit ShiftedExp(float m) : max(m) {}
  __device__ __forceinline__ float operator()(float x) const { return expf(x - max); }
};

// E finite values into a vector, rounded as store() rounds them: bf16 two at a time by the
// hardware's round to nearest even (bf16_round's bits for any finite value).
template <int E>
__device__ __forceinline__ void store_finite(Vec16<float>& g, const float (&p)[E]) {
#pragma unroll
  for (int e = 0; e < E; ++e) g.v[e] = p[e];
}
template <int E>
__device__ __forceinline__ void store_finite(Vec16<uint16_t>& g, const float (&p)[E]) {
#pragma unroll
  for (int e = 0; e < E; e += 2) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    uint32_t d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(p[e + 1]), "f"(p[e]));  // p[e] in the low half
    g.v[e] = static_cast<uint16_t>(d & 0xffffu);
    g.v[e + 1] = static_cast<uint16_t>(d >> 16);
#else
    g.v[e] = bf16_round(p[e]);
    g.v[e + 1] = bf16_round(p[e + 1]);
#endif
  }
}

// classifier_kernel's work with the row held in shared memory (dynamic, cols elements): read
// once, written once. Thread t takes the row's 16-byte vectors t, t + blockDim.x, ... A
// thread needs few registers (32), so where two rows fit an SM's shared memory (GPT-2's
// 50304 bf16 columns: 2 x 98 KiB of 228) two blocks share it and one block's loads overlap
// the other's reductions. (The row held in registers instead, 7 vectors a thread, took 64
// registers and so one block an SM: 0.17 ms slower a GPT-2 step at B 16 on an H100, and
// streaming the row twice from L2 slower still: docs/performance-log.md.) Needs cols a
// multiple of the vector's count and the logits 16-byte aligned. The sum is of exp(x - max)
// over the row's max: a different (equally exact) order of operations from the online form,
// so the bits differ from the general kernel's, not from run to run. Its instructions count
// too (ncu once found 81% of the SM's issue slots busy), so the vectors wholly inside the
// vocabulary skip the column checks, and a row whose max and sum are finite (every gradient
// then finite) rounds its gradients two at a time in hardware: bf16_round's bits, in one
// instruction instead of six a value.
template <typename T>
static __global__ void __launch_bounds__(kClassifierThreads, 2)
    classifier_shared_kernel(T* logits, const int32_t* targets, int64_t rows, int64_t cols, int64_t vocab, float* work,
                             bool write_grad) {
  constexpr int E = Vec16<T>::kCount;
  extern __shared__ __align__(16) unsigned char held_bytes[];  // one declaration for every T
  auto* held = reinterpret_cast<Vec16<T>*>(held_bytes);
  auto* row = reinterpret_cast<Vec16<T>*>(logits + blockIdx.x * cols);
  const int nvec = static_cast<int>(cols / E), nvocab = static_cast<int>(vocab);
  const int whole = nvocab / E;  // vectors [0, whole) lie inside the vocabulary
  const int32_t target = targets[blockIdx.x];
  const bool valid = target >= 0 && target < vocab;
  const float at_target = threadIdx.x == 0 && valid ? as_float(logits[blockIdx.x * cols + target]) : NAN;
  // The row comes into shared memory by asynchronous copies, which need no registers: all of
  // a thread's loads are in flight at once. (Loaded into registers and stored to shared
  // memory, each load was waited for before the next was issued: 1.36 ms a GPT-2 step at
  // B 16 on an H100, against 1.15 ms so.) Each thread reads back only the vectors it copied.
  for (int i = static_cast<int>(threadIdx.x); i < nvec; i += kClassifierThreads)
    __pipeline_memcpy_async(&held[i], &row[i], sizeof(Vec16<T>));
  __pipeline_commit();
  __pipeline_wait_prior(0);
  float m = -INFINITY;
  for (int i = static_cast<int>(threadIdx.x); i < nvec; i += kClassifierThreads) {
    const Vec16<T> x = held[i];
    if (i < whole) {
#pragma unroll
      for (int e = 0; e < E; ++e) m = fmaxf(m, as_float(x.v[e]));
    } else {
#pragma unroll
      for (int e = 0; e < E; ++e)
        if (i * E + e < nvocab) m = fmaxf(m, as_float(x.v[e]));
    }
  }
  const float max = block_max(m);
  const ShiftedExp<T> shifted_exp(max);
  float s = 0.f;
  for (int i = static_cast<int>(threadIdx.x); i < nvec; i += kClassifierThreads) {
    const Vec16<T> x = held[i];
    if (i < whole) {
#pragma unroll
      for (int e = 0; e < E; ++e) s += shifted_exp(as_float(x.v[e]));
    } else {
#pragma unroll
      for (int e = 0; e < E; ++e)
        if (i * E + e < nvocab) s += shifted_exp(as_float(x.v[e]));
    }
  }
  const float sum = block_total(s);
  if (threadIdx.x == 0) work[blockIdx.x] = max + logf(sum) - at_target;
  if (!write_grad) return;
  const float inv_sum = 1.f / sum, inv_rows = 1.f / static_cast<float>(rows), scale = inv_sum * inv_rows;
  // The target's vector and those past the vocabulary take the general form (as does every
  // vector of a row with a NaN or an infinity, whose gradients bf16_round must round).
  const int plain_end = isfinite(max) && isfinite(sum) ? whole : 0;
  const int target_vec = valid ? target / E : -1;
  for (int i = static_cast<int>(threadIdx.x); i < nvec; i += kClassifierThreads) {
    const Vec16<T> x = held[i];
    Vec16<T> g;
    if (i < plain_end && i != target_vec) {
      float p[E];
#pragma unroll
      for (int e = 0; e < E; ++e) p[e] = shifted_exp(as_float(x.v[e])) * scale;
      store_finite(g, p);
    } else {
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const int c = i * E + e;
        const float p = c < nvocab ? shifted_exp(as_float(x.v[e])) * inv_sum : 0.f;
        store(&g.v[e], (c == target ? p - 1.f : p) * inv_rows);
      }
    }
    row[i] = g;
  }
}

// Whether the row goes to shared memory (classifier_shared_kernel): in whole vectors, and
// within a block's shared memory on this device (allow_optin_smem raises the kernel's limit
// once a device).
template <typename T>
bool row_in_shared(const T* logits, int64_t cols) {
  if (cols % Vec16<T>::kCount != 0 || reinterpret_cast<uintptr_t>(logits) % 16 != 0) return false;
  return allow_optin_smem(classifier_shared_kernel<T>, static_cast<size_t>(cols) * sizeof(T));
}

// g *= scale * *dloss (dloss may be null).
template <typename T>
static __global__ void grad_scale_kernel(T* g, int64_t n, const float* dloss, float scale) {
  const float f = scale * (dloss ? *dloss : 1.f);
  for (int64_t i = global_tid(); i < n; i += grid_stride()) store(g + i, as_float(g[i]) * f);
}

template <typename T>
void forward_launch(const char* who, T* logits, const int32_t* targets, int64_t rows, int64_t cols, int64_t vocab,
                    float* loss, bool write_grad, float* work, cudaStream_t stream) {
  DPT_CHECK(rows > 0 && vocab > 0 && vocab <= cols, std::string(who) + ": bad shape");
  DPT_CHECK(rows <= 0x7fffffff, std::string(who) + ": too many rows");
  DPT_CHECK(logits && targets && loss && work, std::string(who) + ": null pointer");
  const auto blocks = static_cast<unsigned>(rows);
  if (row_in_shared(logits, cols)) {
    classifier_shared_kernel<T><<<blocks, kClassifierThreads, static_cast<size_t>(cols) * sizeof(T), stream>>>(
        logits, targets, rows, cols, vocab, work, write_grad);
  } else {
    classifier_kernel<<<blocks, kClassifierThreads, 0, stream>>>(logits, targets, rows, cols, vocab, work, write_grad);
  }
  DPT_CUDA_CHECK_LAUNCH();
  finish_sum(work, rows, 1.0 / static_cast<double>(rows), loss, stream);
  DPT_CUDA_CHECK_LAUNCH();
}

template <typename T>
void scale_launch(const char* who, T* g, int64_t n, const float* dloss, float scale, cudaStream_t stream) {
  DPT_CHECK(n >= 0, std::string(who) + ": negative size");
  if (n == 0) return;
  DPT_CHECK(g != nullptr, std::string(who) + ": null pointer");
  grad_scale_kernel<<<blocks_for(n), kThreads, 0, stream>>>(g, n, dloss, scale);
  DPT_CUDA_CHECK_LAUNCH();
}

}  // namespace

void classifier_forward(float* logits, const int32_t* targets, int64_t rows, int64_t cols, int64_t vocab, float* loss,
                        bool write_grad, float* work, cudaStream_t stream) {
  forward_launch("classifier_forward", logits, targets, rows, cols, vocab, loss, write_grad, work, stream);
}
void classifier_forward_bf16(uint16_t* logits, const int32_t* targets, int64_t rows, int64_t cols, int64_t vocab,
                             float* loss, bool write_grad, float* work, cudaStream_t stream) {
  forward_launch("classifier_forward_bf16", logits, targets, rows, cols, vocab, loss, write_grad, work, stream);
}
void classifier_grad_scale(float* g, int64_t n, const float* dloss, float scale, cudaStream_t stream) {
  scale_launch("classifier_grad_scale", g, n, dloss, scale, stream);
}
void classifier_grad_scale_bf16(uint16_t* g, int64_t n, const float* dloss, float scale, cudaStream_t stream) {
  scale_launch("classifier_grad_scale_bf16", g, n, dloss, scale, stream);
}

}  // namespace dpt::cuda
