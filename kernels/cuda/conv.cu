// conv.cu — the convolution pieces dptrain does itself rather than through cuDNN, each
// where cuDNN's deterministic choice was measured slow on the cnn workload (README,
// "Measurements behind the code", has the figures):
// - the bias of a convolution, y[n][c][.] += b[c] (cudnnAddTensor took far longer than
//   the one read and one write of y that it is here);
// - its gradient, db[c] = sum over n and the image of dy (cudnnConvolutionBackwardBias,
//   slower still): per (n, c) row sums, then the rows of that [n, c] matrix summed in a
//   fixed order by bias_grad, so the result is deterministic;
// - the weight gradient of a convolution with few inputs per output (c*r*s small, the
//   first layer, where cuDNN's deterministic algorithm took far longer than its little
//   arithmetic warrants): im2col, one GEMM per image, and the per-image results summed in
//   a fixed order, a bounded number of images at a time.
#include <algorithm>
#include <cstdint>

#include "check.hpp"
#include "common.cuh"
#include "cuda.hpp"

namespace dpt::cuda {
namespace {

// The kernels here start up to this many blocks (more than kMaxBlocks): one thread an
// element up to about 2^28 elements, and the grid-stride loops beyond.
constexpr int64_t kConvMaxBlocks = 65535 * 16;

__global__ void channel_bias_add_kernel(float* y, const float* b, int64_t n, int64_t c, int64_t hw) {
  const int64_t total = n * c * hw;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    y[i] += b[(i / hw) % c];
}

// hw % 4 == 0 and y 16-byte aligned: four elements of one channel per thread.
__global__ void channel_bias_add_vec_kernel(float4* y, const float* b, int64_t n, int64_t c, int64_t hw4) {
  const int64_t total = n * c * hw4;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float add = b[(i / hw4) % c];
    float4 v = y[i];
    v.x += add, v.y += add, v.z += add, v.w += add;
    y[i] = v;
  }
}

// One warp per row of `len` floats (grid-stride over rows): lane-strided partial sums,
// then warp_sum's fixed tree.
__global__ void row_sums_kernel(const float* x, int64_t rows, int64_t len, float* out) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t row = blockIdx.x * static_cast<int64_t>(blockDim.x / 32) + threadIdx.x / 32; row < rows; row += warps) {
    const float* p = x + row * len;
    float s = 0.f;
    if (len % 4 == 0 && aligned16(p)) {
      const float4* p4 = reinterpret_cast<const float4*>(p);
      for (int64_t i = lane; i < len / 4; i += 32) {
        const float4 v = p4[i];
        s += (v.x + v.y) + (v.z + v.w);
      }
    } else {
      for (int64_t i = lane; i < len; i += 32) s += p[i];
    }
    s = warp_sum(s);
    if (lane == 0) out[row] = s;
  }
}

// col[n][(ci, kr, ks)][(p, q)] = x[n][ci][p*stride - pad + kr*dil][q*stride - pad + ks*dil],
// zero outside the image: one thread per element of col, consecutive threads along (p, q).
__global__ void im2col_kernel(const float* x, ConvShape s, int64_t P, int64_t Q, float* col) {
  const int64_t pq = P * Q, crs = s.c * s.r * s.s, total = s.n * crs * pq;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t q = i % Q, p = (i / Q) % P, j = (i / pq) % crs, n = i / (pq * crs);
    const int64_t ks = j % s.s, kr = (j / s.s) % s.r, ci = j / (s.s * s.r);
    const int64_t h = p * s.stride - s.pad + kr * s.dilation, w = q * s.stride - s.pad + ks * s.dilation;
    col[i] = (h >= 0 && h < s.h && w >= 0 && w < s.w) ? x[((n * s.c + ci) * s.h + h) * s.w + w] : 0.f;
  }
}

}  // namespace

void channel_bias_add(float* y, const float* b, int64_t n, int64_t c, int64_t hw, cudaStream_t stream) {
  DPT_CHECK(n >= 0 && c >= 0 && hw >= 0, "channel_bias_add: negative shape");
  if (n * c * hw == 0) return;
  DPT_CHECK(y != nullptr && b != nullptr, "channel_bias_add: null pointer");
  if (hw % 4 == 0 && aligned16(y))
    channel_bias_add_vec_kernel<<<blocks_for(n * c * hw / 4, kConvMaxBlocks), kThreads, 0, stream>>>(
        reinterpret_cast<float4*>(y), b, n, c, hw / 4);
  else channel_bias_add_kernel<<<blocks_for(n * c * hw, kConvMaxBlocks), kThreads, 0, stream>>>(y, b, n, c, hw);
  DPT_CUDA_CHECK_LAUNCH();
}

void channel_bias_grad(const float* dy, int64_t n, int64_t c, int64_t hw, float beta, float* db, float* work,
                       cudaStream_t stream) {
  DPT_CHECK(n >= 0 && c >= 0 && hw >= 0, "channel_bias_grad: negative shape");
  if (c == 0) return;
  DPT_CHECK(dy != nullptr && db != nullptr && work != nullptr, "channel_bias_grad: null pointer");
  const int64_t rows = n * c;
  if (rows > 0 && hw > 0) {
    const int64_t blocks = std::min<int64_t>((rows + kWarps - 1) / kWarps, kConvMaxBlocks);
    row_sums_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(dy, rows, hw, work);
    DPT_CUDA_CHECK_LAUNCH();
  } else if (rows > 0) {
    DPT_CUDA_CHECK(cudaMemsetAsync(work, 0, static_cast<size_t>(rows) * sizeof(float), stream));
  }
  bias_grad(work, n, c, beta, db, stream);  // over [n, c]: the columns' sums, in row order
}

namespace {
// im2col's buffer and the per-image products for this many images at a time: bounded, so
// a large image costs chunks of GEMMs rather than a workspace of gigabytes.
constexpr size_t kWgradWorkCap = size_t(32) << 20;

int64_t wgrad_images_per_chunk(const ConvShape& s) {
  const size_t per_image = static_cast<size_t>(s.c * s.r * s.s * (s.p() * s.q() + s.k)) * sizeof(float);
  const auto fit = static_cast<int64_t>(kWgradWorkCap / std::max<size_t>(per_image, 1));
  return std::max<int64_t>(1, std::min(fit, s.n));
}
}  // namespace

size_t conv_wgrad_gemm_work_bytes(const ConvShape& s) {
  return static_cast<size_t>(wgrad_images_per_chunk(s) * s.c * s.r * s.s * (s.p() * s.q() + s.k)) * sizeof(float);
}

void conv_wgrad_gemm(cublasHandle_t handle, Precision precision, const ConvShape& s, const float* x, const float* dy,
                     float beta, float* dw, float* work, cudaStream_t stream) {
  const int64_t P = s.p(), Q = s.q(), crs = s.c * s.r * s.s;
  DPT_CHECK(s.n >= 1 && crs >= 1 && s.k >= 1 && P >= 1 && Q >= 1, "conv_wgrad_gemm: empty shape");
  DPT_CHECK(x != nullptr && dy != nullptr && dw != nullptr && work != nullptr, "conv_wgrad_gemm: null pointer");
  const int64_t chunk = wgrad_images_per_chunk(s);
  float* col = work;                              // [chunk][crs][P*Q]
  float* per_image = work + chunk * crs * P * Q;  // [chunk][k][crs]
  for (int64_t n0 = 0; n0 < s.n; n0 += chunk) {
    ConvShape part = s;
    part.n = std::min(chunk, s.n - n0);
    im2col_kernel<<<blocks_for(part.n * crs * P * Q, kConvMaxBlocks), kThreads, 0, stream>>>(x + n0 * s.c * s.h * s.w,
                                                                                             part, P, Q, col);
    DPT_CUDA_CHECK_LAUNCH();
    // per_image[i] = dy[i] [k, PQ] . col[i]^T [PQ, crs]; bf16 runs as TF32, as in cuDNN's passes.
    gemm_cublas_strided_batched(handle, precision == Precision::fp32 ? Precision::fp32 : Precision::tf32, false, true,
                                s.k, crs, P * Q, 1.0f, dy + n0 * s.k * P * Q, s.k * P * Q, col, crs * P * Q, 0.0f,
                                per_image, s.k * crs, part.n);
    // The images' sum in order, onto beta dw for the first chunk and onto the sum so far after.
    bias_grad(per_image, part.n, s.k * crs, n0 == 0 ? beta : 1.0f, dw, stream);
  }
}

}  // namespace dpt::cuda
