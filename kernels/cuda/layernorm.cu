// layernorm.cu — the residual stream's ops: LayerNorm over the last axis and the residual
// add; twins of kernels/cpu/layernorm.cpp.
//
// The forward and the input gradient take a warp per row (the row's sums by warp_sum, in
// its fixed order). The parameters' gradients are column sums over the rows, in two
// deterministic stages: a thread per column adds a chunk of rows in order, then a thread
// per column adds the chunks in order.
#include <cstdint>
#include <string>

#include "check.hpp"
#include "common.cuh"
#include "cuda.hpp"

namespace dpt::cuda {
namespace {

template <typename T>
__global__ void layer_norm_forward_kernel(const T* x, const float* gamma, const float* beta, int64_t rows, int64_t cols,
                                          float eps, T* y, float* mean, float* rstd) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  const T* xr = x + r * cols;
  float s = 0.f;
  for (int64_t c = lane; c < cols; c += 32) s += as_float(xr[c]);
  const float m = warp_sum(s) / static_cast<float>(cols);
  float v = 0.f;  // two passes: the biased variance without cancellation
  for (int64_t c = lane; c < cols; c += 32) {
    const float d = as_float(xr[c]) - m;
    v += d * d;
  }
  const float rs = 1.f / sqrtf(warp_sum(v) / static_cast<float>(cols) + eps);
  for (int64_t c = lane; c < cols; c += 32) store(&y[r * cols + c], (as_float(xr[c]) - m) * rs * gamma[c] + beta[c]);
  if (lane == 0) {
    mean[r] = m;
    rstd[r] = rs;
  }
}

// dx = rstd (g - mean(g) - xhat mean(g xhat)), g = dy gamma, xhat = (x - mean) rstd.
template <typename T>
__global__ void layer_norm_dx_kernel(const T* x, const T* dy, const float* gamma, const float* mean, const float* rstd,
                                     int64_t rows, int64_t cols, T* dx) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  const float m = mean[r], rs = rstd[r];
  float sg = 0.f, sgx = 0.f;
  for (int64_t c = lane; c < cols; c += 32) {
    const float g = as_float(dy[r * cols + c]) * gamma[c];
    sg += g;
    sgx += g * ((as_float(x[r * cols + c]) - m) * rs);
  }
  const float mg = warp_sum(sg) / static_cast<float>(cols), mgx = warp_sum(sgx) / static_cast<float>(cols);
  for (int64_t c = lane; c < cols; c += 32) {
    const float xhat = (as_float(x[r * cols + c]) - m) * rs;
    store(&dx[r * cols + c], rs * (as_float(dy[r * cols + c]) * gamma[c] - mg - xhat * mgx));
  }
}

// Stage one: chunk blockIdx.y's sums over its rows (in order) of dy xhat and dy, per column.
template <typename T>
__global__ void layer_norm_param_part_kernel(const T* x, const T* dy, const float* mean, const float* rstd,
                                             int64_t rows, int64_t cols, int64_t chunk_rows, float* part_gamma,
                                             float* part_beta) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * chunk_rows;
  const int64_t r1 = rows - r0 < chunk_rows ? rows : r0 + chunk_rows;
  float sg = 0.f, sb = 0.f;
  for (int64_t r = r0; r < r1; ++r) {
    const float d = as_float(dy[r * cols + c]);
    sg += d * ((as_float(x[r * cols + c]) - mean[r]) * rstd[r]);
    sb += d;
  }
  part_gamma[blockIdx.y * cols + c] = sg;
  part_beta[blockIdx.y * cols + c] = sb;
}

// Stage two: the chunks' sums in order; beta 0 never reads the gradient; null: not wanted.
__global__ void layer_norm_param_finish_kernel(const float* part_gamma, const float* part_beta, int64_t chunks,
                                               int64_t cols, float beta_gamma, float* dgamma, float beta_beta,
                                               float* dbeta) {
  for (int64_t c = global_tid(); c < cols; c += grid_stride()) {
    float sg = 0.f, sb = 0.f;
    for (int64_t k = 0; k < chunks; ++k) {
      sg += part_gamma[k * cols + c];
      sb += part_beta[k * cols + c];
    }
    if (dgamma) dgamma[c] = beta_gamma != 0.f ? beta_gamma * dgamma[c] + sg : sg;
    if (dbeta) dbeta[c] = beta_beta != 0.f ? beta_beta * dbeta[c] + sb : sb;
  }
}

template <typename T>
__global__ void residual_add_kernel(const T* a, const T* b, int64_t n, T* y) {
  for (int64_t i = global_tid(); i < n; i += grid_stride()) store(&y[i], as_float(a[i]) + as_float(b[i]));
}

// Rows per stage-one chunk: 256, more where the chunks would pass the grid's y limit.
int64_t chunk_rows_for(int64_t rows) {
  const int64_t need = (rows + 65534) / 65535;
  return need > 256 ? need : 256;
}
int64_t chunks_for(int64_t rows) { return (rows + chunk_rows_for(rows) - 1) / chunk_rows_for(rows); }

unsigned row_blocks(int64_t rows, const char* who) {
  const int64_t blocks = (rows + kWarps - 1) / kWarps;
  DPT_CHECK(blocks <= 0x7fffffff, std::string(who) + ": too many rows");
  return static_cast<unsigned>(blocks);
}

template <typename T>
void forward(const T* x, const float* gamma, const float* beta, int64_t rows, int64_t cols, float eps, T* y,
             float* mean, float* rstd, cudaStream_t stream) {
  DPT_CHECK(rows >= 0 && cols > 0, "layer_norm_forward: bad shape");
  if (rows == 0) return;
  layer_norm_forward_kernel<T>
      <<<row_blocks(rows, "layer_norm_forward"), kThreads, 0, stream>>>(x, gamma, beta, rows, cols, eps, y, mean, rstd);
  DPT_CUDA_CHECK_LAUNCH();
}

template <typename T>
void backward(const T* x, const T* dy, const float* gamma, const float* mean, const float* rstd, int64_t rows,
              int64_t cols, T* dx, float beta_gamma, float* dgamma, float beta_beta, float* dbeta, float* work,
              cudaStream_t stream) {
  DPT_CHECK(rows >= 0 && cols > 0, "layer_norm_backward: bad shape");
  if (dx && rows > 0) {
    layer_norm_dx_kernel<T>
        <<<row_blocks(rows, "layer_norm_backward"), kThreads, 0, stream>>>(x, dy, gamma, mean, rstd, rows, cols, dx);
    DPT_CUDA_CHECK_LAUNCH();
  }
  if (!dgamma && !dbeta) return;
  const int64_t chunks = chunks_for(rows);
  DPT_CHECK(chunks == 0 || work != nullptr, "layer_norm_backward: null work space");
  float *part_gamma = work, *part_beta = work + chunks * cols;
  if (chunks > 0) {
    const dim3 grid(static_cast<unsigned>((cols + kThreads - 1) / kThreads), static_cast<unsigned>(chunks));
    layer_norm_param_part_kernel<T>
        <<<grid, kThreads, 0, stream>>>(x, dy, mean, rstd, rows, cols, chunk_rows_for(rows), part_gamma, part_beta);
    DPT_CUDA_CHECK_LAUNCH();
  }
  layer_norm_param_finish_kernel<<<blocks_for(cols), kThreads, 0, stream>>>(part_gamma, part_beta, chunks, cols,
                                                                            beta_gamma, dgamma, beta_beta, dbeta);
  DPT_CUDA_CHECK_LAUNCH();
}

template <typename T>
void add(const T* a, const T* b, int64_t n, T* y, cudaStream_t stream) {
  DPT_CHECK(n >= 0, "residual_add: negative size");
  if (n == 0) return;
  residual_add_kernel<T><<<blocks_for(n), kThreads, 0, stream>>>(a, b, n, y);
  DPT_CUDA_CHECK_LAUNCH();
}

}  // namespace

int64_t layer_norm_backward_work(int64_t rows, int64_t cols) { return 2 * chunks_for(rows) * cols; }

void layer_norm_forward(const float* x, const float* gamma, const float* beta, int64_t rows, int64_t cols, float eps,
                        float* y, float* mean, float* rstd, cudaStream_t stream) {
  forward(x, gamma, beta, rows, cols, eps, y, mean, rstd, stream);
}
void layer_norm_forward_bf16(const uint16_t* x, const float* gamma, const float* beta, int64_t rows, int64_t cols,
                             float eps, uint16_t* y, float* mean, float* rstd, cudaStream_t stream) {
  forward(x, gamma, beta, rows, cols, eps, y, mean, rstd, stream);
}
void layer_norm_backward(const float* x, const float* dy, const float* gamma, const float* mean, const float* rstd,
                         int64_t rows, int64_t cols, float* dx, float beta_gamma, float* dgamma, float beta_beta,
                         float* dbeta, float* work, cudaStream_t stream) {
  backward(x, dy, gamma, mean, rstd, rows, cols, dx, beta_gamma, dgamma, beta_beta, dbeta, work, stream);
}
void layer_norm_backward_bf16(const uint16_t* x, const uint16_t* dy, const float* gamma, const float* mean,
                              const float* rstd, int64_t rows, int64_t cols, uint16_t* dx, float beta_gamma,
                              float* dgamma, float beta_beta, float* dbeta, float* work, cudaStream_t stream) {
  backward(x, dy, gamma, mean, rstd, rows, cols, dx, beta_gamma, dgamma, beta_beta, dbeta, work, stream);
}
void residual_add(const float* a, const float* b, int64_t n, float* y, cudaStream_t stream) { add(a, b, n, y, stream); }
void residual_add_bf16(const uint16_t* a, const uint16_t* b, int64_t n, uint16_t* y, cudaStream_t stream) {
  add(a, b, n, y, stream);
}

}  // namespace dpt::cuda
