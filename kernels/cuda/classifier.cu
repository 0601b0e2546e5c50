// classifier.cu — the language model's classifier: softmax cross-entropy of each row over
// its first `vocab` columns, and its gradient written over the logits in the same kernel;
// the twin of cpu/classifier.cpp. One block a row: the threads' online softmax statistics
// (row_softmax.cuh) merged across the block in a fixed order, then a second read of the row
// for the gradient; rows of whole 16-byte vectors (GPT-2's 50304 columns) take a kernel that
// reads a vector at a time with the second read from L2 (classifier_stream_kernel). The
// row's loss goes to work[row], then the mean over the rows is added in row order by one
// block. No float atomics: the same inputs give the same bits on every run.
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

// ---- rows of whole 16-byte vectors ---------------------------------------------------

// 16 bytes of a row: 8 bf16 or 4 floats.
template <typename T>
struct alignas(16) Vec16 {
  static constexpr int kCount = 16 / sizeof(T);
  T v[kCount];
};

// exp(v) for the softmax: in bf16 the fast form (a few ulps of fp32, far below bf16's
// rounding of the gradient), in fp32 the exact one. It keeps the kernel at memory speed.
__device__ __forceinline__ float softmax_exp(float v, uint16_t) { return __expf(v); }
__device__ __forceinline__ float softmax_exp(float v, float) { return expf(v); }

// classifier_kernel's work a vector at a time, by blocks that each take rows in turn: the
// online statistics take a vector's max first (one rescale a vector, not one an element),
// and the second pass, the gradient's, reads the row again from L2, where it still is: the
// grid is kStreamBlocksPerSm blocks an SM, so the rows in flight (each 100 KB for GPT-2 in
// bf16) fit the cache, and the logits cross memory once each way. Needs cols a multiple of
// the vector's count and the logits 16-byte aligned. Each row is one block's, in a fixed
// order: the same bits on every run, whatever the grid.
constexpr int kStreamThreads = 512, kStreamBlocksPerSm = 2, kInFlight = 4;

// The online statistics (m, s) after vector x, whose first element is column c0: one
// rescale to the vector's max, then its terms.
template <typename T>
__device__ __forceinline__ void online_add_vector(const Vec16<T>& x, int64_t c0, int64_t vocab, float& m, float& s) {
  constexpr int E = Vec16<T>::kCount;
  float top = -INFINITY;
#pragma unroll
  for (int e = 0; e < E; ++e)
    if (c0 + e < vocab) top = fmaxf(top, as_float(x.v[e]));
  if (const float to = fmaxf(m, top); to != -INFINITY) {
    s = scaled(s, m, to);
    m = to;
#pragma unroll
    for (int e = 0; e < E; ++e)
      if (c0 + e < vocab) s += softmax_exp(as_float(x.v[e]) - m, T{});
  } else {
#pragma unroll
    for (int e = 0; e < E; ++e)  // only -inf so far: a NaN still has to show in the sum
      if (c0 + e < vocab && isnan(as_float(x.v[e]))) s = NAN;
  }
}

// use(x, i) for the block's thread's vectors i of a row in order, kInFlight loads in flight
// before their uses.
template <typename T, typename Use>
__device__ __forceinline__ void for_row_vectors(const Vec16<T>* row, int64_t nvec, Use use) {
  for (int64_t i0 = threadIdx.x; i0 < nvec; i0 += kInFlight * blockDim.x) {
    Vec16<T> xs[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u)
      if (const int64_t i = i0 + u * blockDim.x; i < nvec) xs[u] = row[i];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u)
      if (const int64_t i = i0 + u * blockDim.x; i < nvec) use(xs[u], i);
  }
}

template <typename T>
static __global__ void __launch_bounds__(kStreamThreads)
    classifier_stream_kernel(T* logits, const int32_t* targets, int64_t rows, int64_t cols, int64_t vocab, float* work,
                             bool write_grad) {
  constexpr int E = Vec16<T>::kCount;
  const int64_t nvec = cols / E;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    auto* row = reinterpret_cast<Vec16<T>*>(logits + r * cols);
    const int32_t target = targets[r];
    const bool valid = target >= 0 && target < vocab;
    const float at_target = threadIdx.x == 0 && valid ? as_float(logits[r * cols + target]) : NAN;
    float m = -INFINITY, s = 0.f;
    for_row_vectors(row, nvec, [&](const Vec16<T>& x, int64_t i) { online_add_vector(x, i * E, vocab, m, s); });
    const RowStats st = block_merge({m, s});
    if (threadIdx.x == 0) work[r] = st.max + logf(st.sum) - at_target;
    if (write_grad) {
      const float inv_sum = 1.f / st.sum, inv_rows = 1.f / static_cast<float>(rows);
      for_row_vectors(row, nvec, [&](const Vec16<T>& x, int64_t i) {
        Vec16<T> g;
#pragma unroll
        for (int e = 0; e < E; ++e) {
          const int64_t c = i * E + e;
          const float p = c < vocab ? softmax_exp(as_float(x.v[e]) - st.max, T{}) * inv_sum : 0.f;
          store(&g.v[e], (c == target ? p - 1.f : p) * inv_rows);
        }
        row[i] = g;
      });
    }
    __syncthreads();  // block_merge's shared memory is reused by the next row
  }
}

// Whether the rows can be read in whole vectors.
template <typename T>
bool whole_vectors(const T* logits, int64_t cols) {
  return cols % Vec16<T>::kCount == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0;
}

// The stream kernel's grid: kStreamBlocksPerSm blocks an SM of the current device, at most a row each.
unsigned stream_blocks(int64_t rows) {
  static int sms[64] = {};
  int dev = 0;
  DPT_CUDA_CHECK(cudaGetDevice(&dev));
  int& n = sms[dev < 64 ? dev : 0];
  if (n == 0) DPT_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
  const int64_t blocks = static_cast<int64_t>(n) * kStreamBlocksPerSm;
  return static_cast<unsigned>(rows < blocks ? rows : blocks);
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
  if (whole_vectors(logits, cols))
    classifier_stream_kernel<<<stream_blocks(rows), kStreamThreads, 0, stream>>>(logits, targets, rows, cols, vocab,
                                                                                 work, write_grad);
  else
    classifier_kernel<<<static_cast<unsigned>(rows), kClassifierThreads, 0, stream>>>(logits, targets, rows, cols,
                                                                                      vocab, work, write_grad);
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
