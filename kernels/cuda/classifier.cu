// classifier.cu — the language model's classifier: softmax cross-entropy of each row over
// its first `vocab` columns, and its gradient written over the logits in the same kernel;
// the twin of cpu/classifier.cpp. One block a row: the threads' online softmax statistics
// (row_softmax.cuh) merge across the block in a fixed order, the row's loss goes to
// work[row], then the mean over the rows is added in row order by one block. No float
// atomics: the same inputs give the same bits on every run.
#include <cmath>
#include <cstdint>
#include <string>

#include "check.hpp"
#include "common.cuh"
#include "cuda.hpp"
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
  classifier_kernel<<<static_cast<unsigned>(rows), kClassifierThreads, 0, stream>>>(logits, targets, rows, cols, vocab,
                                                                                    work, write_grad);
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
