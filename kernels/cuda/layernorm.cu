// layernorm.cu — the residual stream's ops: LayerNorm over the last axis and the residual
// add; twins of kernels/cpu/layernorm.cpp.
//
// The forward and the input gradient take a warp per row (the row's sums by warp_sum, in
// its fixed order). The parameters' gradients are column sums over the rows, in two
// deterministic stages: each chunk of rows sums its rows in order, then a thread per column
// adds the chunks in order.
//
// Rows of up to 32 x kMaxVectors 16-byte vectors (GPT-2's 768 or 1024 bf16 columns; 512
// floats) take the fused kernels: a lane holds its vectors of the row in registers (a warp
// takes two rows at once), so the forward reads x once (or the residual add's two terms,
// writing their sum beside the output: add_layer_norm_forward), and the backward reads x
// and dy once for dx and for its lane's running sums of the parameters' gradients (kept in
// shared memory), which the block's warps then add in warp order. dx may be added to a
// gradient already there (dx_add: the residual stream's, rounded once). Other rows take the
// general kernels (a pass each), as do the fused backward's where its shared memory does
// not fit a block.
#include <climits>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "check.hpp"
#include "common.cuh"
#include "cuda.hpp"
#include "loops.cuh"

namespace dpt::cuda {
namespace {

// Columns cols .. ldy - 1 of a row of y: the ones column (1, then 0s), none where ldy = cols.
template <typename T>
__device__ __forceinline__ void ones_column(T* yrow, int64_t cols, int64_t ldy, int lane) {
  for (int64_t c = cols + lane; c < ldy; c += 32) store(&yrow[c], c == cols ? 1.f : 0.f);
}

template <typename T>
__global__ void layer_norm_forward_kernel(const T* x, const float* gamma, const float* beta, int64_t rows, int64_t cols,
                                          float eps, T* y, int64_t ldy, float* mean, float* rstd) {
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
  for (int64_t c = lane; c < cols; c += 32) store(&y[r * ldy + c], (as_float(xr[c]) - m) * rs * gamma[c] + beta[c]);
  ones_column(y + r * ldy, cols, ldy, lane);
  if (lane == 0) {
    mean[r] = m;
    rstd[r] = rs;
  }
}

// dx = rstd (g - mean(g) - xhat mean(g xhat)), g = dy gamma, xhat = (x - mean) rstd.
template <typename T>
__global__ void layer_norm_dx_kernel(const T* x, const T* dy, const float* gamma, const float* mean, const float* rstd,
                                     int64_t rows, int64_t cols, T* dx, bool dx_add) {
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
    const float v = rs * (as_float(dy[r * cols + c]) * gamma[c] - mg - xhat * mgx);
    store(&dx[r * cols + c], dx_add ? as_float(dx[r * cols + c]) + v : v);
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

template <typename T, bool Vec>
__global__ void residual_add_kernel(const T* a, const T* b, int64_t n, T* y) {
  vec4_loop<Vec>(
      n,
      [&](int64_t q) {
        const float4 u = load_four(a + 4 * q), v = load_four(b + 4 * q);
        store_four(y + 4 * q, make_float4(u.x + v.x, u.y + v.y, u.z + v.z, u.w + v.w));
      },
      [&](int64_t i) { store(&y[i], as_float(a[i]) + as_float(b[i])); });
}

// ---- the fused kernels: a row in a warp's registers ------------------------------------

constexpr int kMaxVectors = 4;  // a lane's 16-byte vectors of a row

template <typename T>
struct alignas(16) Vec16 {
  static constexpr int kCount = 16 / sizeof(T);
  T v[kCount];
};

// The vectors a lane takes for rows of `cols` (1 .. kMaxVectors), 0 for the general kernels.
template <typename T>
int lane_vectors(int64_t cols, std::initializer_list<const void*> rows_of) {
  constexpr int E = Vec16<T>::kCount;
  if (cols % E != 0) return 0;
  for (const void* p : rows_of)
    if (p && reinterpret_cast<uintptr_t>(p) % 16 != 0) return 0;
  const int64_t p = (cols / E + 31) / 32;
  return p <= kMaxVectors ? static_cast<int>(p) : 0;
}

// Lane `lane`'s vectors of row r (those inside the row).
template <typename T, int P>
__device__ __forceinline__ void load_row(const T* base, int64_t r, int nvec, int lane, Vec16<T> (&v)[P]) {
  const auto* row = reinterpret_cast<const Vec16<T>*>(base) + r * nvec;
#pragma unroll
  for (int p = 0; p < P; ++p)
    if (lane + 32 * p < nvec) v[p] = row[lane + 32 * p];
}

// A lane's columns of a parameter vector (gamma or beta), E floats for each of its vectors,
// read in 16-byte pieces (cols is a multiple of E, so each piece is whole and aligned when
// the vector is: the caller checks).
template <int E, int P>
__device__ __forceinline__ void load_columns(const float* v, int nvec, int lane, float (&out)[P][E]) {
#pragma unroll
  for (int p = 0; p < P; ++p)
    if (lane + 32 * p < nvec)
#pragma unroll
      for (int q = 0; q < E / 4; ++q) {
        const float4 f = reinterpret_cast<const float4*>(v + (lane + 32 * p) * E)[q];
        out[p][4 * q] = f.x;
        out[p][4 * q + 1] = f.y;
        out[p][4 * q + 2] = f.z;
        out[p][4 * q + 3] = f.w;
      }
}

// Rows taken at once by a warp of the fused forward: two where a lane's vectors are few, so
// that each warp has two rows' loads in flight before its sums wait for them (the forward
// is bound by memory; one row a warp left an H100 at about 2.1 TB/s), one at four vectors
// (the registers).
template <int P>
constexpr int kForwardRows = P <= 3 ? 2 : 1;

// y = LayerNorm(x) by rows, or with Add, h = x + res (rounded to T, as add's kernel) and
// y = LayerNorm(h) of the rounded h: the residual add and the LayerNorm that reads its sum
// in one pass, with the bits of the two kernels. Warp w of block b takes rows
// (b kWarps + w) R .. + R - 1 at once; a row's sums are added in the same order for any R.
template <typename T, int P, bool Add>
__global__ void __launch_bounds__(kThreads)
    layer_norm_forward_fused_kernel(const T* x, const T* res, const float* gamma, const float* beta, int64_t rows,
                                    int cols, float eps, T* h, T* y, int ldy, float* mean, float* rstd) {
  constexpr int E = Vec16<T>::kCount, R = kForwardRows<P>;
  const int64_t r0 = (static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32) * R;
  const int lane = threadIdx.x % 32, nvec = cols / E;
  if (r0 >= rows) return;
  Vec16<T> xv[R][P];
#pragma unroll
  for (int k = 0; k < R; ++k)
    if (r0 + k < rows) load_row(x, r0 + k, nvec, lane, xv[k]);
  if constexpr (Add) {
    Vec16<T> rv[R][P];
#pragma unroll
    for (int k = 0; k < R; ++k)
      if (r0 + k < rows) load_row(res, r0 + k, nvec, lane, rv[k]);
#pragma unroll
    for (int k = 0; k < R; ++k) {
      if (r0 + k >= rows) continue;
      auto* hrow = reinterpret_cast<Vec16<T>*>(h) + (r0 + k) * nvec;
#pragma unroll
      for (int p = 0; p < P; ++p) {
        if (lane + 32 * p >= nvec) continue;
#pragma unroll
        for (int e = 0; e < E; ++e) store(&xv[k][p].v[e], as_float(xv[k][p].v[e]) + as_float(rv[k][p].v[e]));
        hrow[lane + 32 * p] = xv[k][p];
      }
    }
  }
  float g[P][E], b[P][E];
  load_columns(gamma, nvec, lane, g);
  load_columns(beta, nvec, lane, b);
#pragma unroll
  for (int k = 0; k < R; ++k) {
    const int64_t r = r0 + k;
    if (r >= rows) break;
    float s = 0.f;
#pragma unroll
    for (int p = 0; p < P; ++p)
      if (lane + 32 * p < nvec)
#pragma unroll
        for (int e = 0; e < E; ++e) s += as_float(xv[k][p].v[e]);
    const float m = warp_sum(s) / static_cast<float>(cols);
    float v = 0.f;
#pragma unroll
    for (int p = 0; p < P; ++p)
      if (lane + 32 * p < nvec)
#pragma unroll
        for (int e = 0; e < E; ++e) {
          const float d = as_float(xv[k][p].v[e]) - m;
          v += d * d;
        }
    const float rs = 1.f / sqrtf(warp_sum(v) / static_cast<float>(cols) + eps);
    auto* yrow = reinterpret_cast<Vec16<T>*>(y + r * ldy);
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int i = lane + 32 * p;
      if (i >= nvec) continue;
      Vec16<T> out;
#pragma unroll
      for (int e = 0; e < E; ++e) store(&out.v[e], (as_float(xv[k][p].v[e]) - m) * rs * g[p][e] + b[p][e]);
      yrow[i] = out;
    }
    // The ones column, a vector a lane (ldy - cols is a multiple of E: both are).
    for (int i = lane; i < (ldy - cols) / E; i += 32) {
      Vec16<T> pad;
#pragma unroll
      for (int e = 0; e < E; ++e) store(&pad.v[e], i == 0 && e == 0 ? 1.f : 0.f);
      reinterpret_cast<Vec16<T>*>(y + r * ldy + cols)[i] = pad;
    }
    if (lane == 0) {
      mean[r] = m;
      rstd[r] = rs;
    }
  }
}

// gamma for the fused backward, staged once a block in shared memory as float4s laid out
// lane by lane (the float4 q of lane l's vector p at (p * E / 4 + q) * 32 + l), so a warp
// reads its lanes' columns in 512 contiguous bytes. (Read from global memory a column at a
// time, lanes 32 bytes apart, the gamma loads alone took 8 L1 wavefronts each, 384 a row.)
template <int E, int P>
__device__ __forceinline__ void stage_gamma(const float* gamma, int nvec, float4* staged) {
  constexpr int Q = E / 4;
  for (int k = threadIdx.x; k < P * Q * 32; k += blockDim.x) {
    const int i = k % 32 + 32 * (k / (32 * Q)), q = k / 32 % Q;
    if (i < nvec) staged[k] = reinterpret_cast<const float4*>(gamma + i * E)[q];
  }
  __syncthreads();
}

// Lane `lane`'s E columns of its vector p, from stage_gamma's layout.
template <int E>
__device__ __forceinline__ void staged_columns(const float4* staged, int p, int lane, float (&out)[E]) {
#pragma unroll
  for (int q = 0; q < E / 4; ++q) {
    const float4 f = staged[(p * (E / 4) + q) * 32 + lane];
    out[4 * q] = f.x;
    out[4 * q + 1] = f.y;
    out[4 * q + 2] = f.z;
    out[4 * q + 3] = f.w;
  }
}

// Blocks of the fused backward an SM should hold (its registers: 64 a thread at 4 blocks):
// 4 (one wave of 32-row chunks at GPT-2's 16384 rows on an H100), 3 at four vectors a lane,
// whose shared memory (bf16: 68 KiB a block) allows no more.
template <int P>
constexpr int kBackwardBlocks = P <= 3 ? 4 : 3;

// float4s of one of the fused backward's shared regions: P vectors of E floats a lane, 32
// lanes, laid out as stage_gamma's.
template <int E, int P>
constexpr int kRegion = E / 4 * P * 32;

// The fused backward's dynamic shared memory: two regions a warp (its lanes' running sums
// of dy xhat and of dy), then gamma staged (one more).
template <typename T, int P>
constexpr size_t backward_fused_smem() {
  return (2 * kWarps + 1) * static_cast<size_t>(kRegion<Vec16<T>::kCount, P>) * sizeof(float4);
}

// Element j of f (j a constant once unrolled: f stays in registers).
__device__ __forceinline__ float& component(float4& f, int j) {
  return j == 0 ? f.x : j == 1 ? f.y : j == 2 ? f.z : f.w;
}
__device__ __forceinline__ void add_to(float4& a, float4 b) {
  a.x += b.x;
  a.y += b.y;
  a.z += b.z;
  a.w += b.w;
}
// Four values at p (aligned to four of them) as floats.
__device__ __forceinline__ float4 load_four(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float4 load_four(const uint16_t* p) {
  const uint2 v = *reinterpret_cast<const uint2*>(p);
  return make_float4(__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xffff0000u), __uint_as_float(v.y << 16),
                     __uint_as_float(v.y & 0xffff0000u));
}
// Four floats at p, which may be only 4-byte aligned (the caller's work space).
__device__ __forceinline__ void store_floats(float* p, float4 v) {
  p[0] = v.x;
  p[1] = v.y;
  p[2] = v.z;
  p[3] = v.w;
}

// The backward of a chunk of rows a block: warp w takes rows w, w + kWarps, ... of the
// chunk; dx as layer_norm_dx_kernel (added to what dx holds when dx_add), and the lane's
// sums of dy xhat and dy over its rows, in order. The sums live in shared memory, each
// lane's float4s its own (no barrier; a warp's accesses are conflict-free), not in 2 P E
// registers a lane, which held the kernel to 2 blocks an SM (126 registers). The warps'
// sums are then added in warp order into the chunk's part_gamma and part_beta rows. With
// part_dx, dx's column sums too (the gradient the LayerNorm finished, a residual
// projection's bias gradient: ColumnSums in autograd.hpp), into the chunk's part_dx row.
template <typename T, int P>
__global__ void __launch_bounds__(kThreads, kBackwardBlocks<P>)
    layer_norm_backward_fused_kernel(const T* x, const T* dy, const float* gamma, const float* mean, const float* rstd,
                                     int64_t rows, int cols, int64_t chunk_rows, T* dx, bool dx_add, float* part_gamma,
                                     float* part_beta, float* part_dx) {
  constexpr int E = Vec16<T>::kCount, Q = E / 4, N = kRegion<E, P>;
  extern __shared__ float4 smem[];  // backward_fused_smem's regions
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nvec = cols / E;
  float4* const sum_g = smem + 2 * warp * N;  // this warp's sums of dy xhat
  float4* const sum_b = sum_g + N;            // and of dy
  float4* const staged = smem + 2 * kWarps * N;
  const int64_t r_begin = static_cast<int64_t>(blockIdx.x) * chunk_rows;
  const int64_t r_end = rows - r_begin < chunk_rows ? rows : r_begin + chunk_rows;
  for (int k = lane; k < N; k += 32) sum_g[k] = sum_b[k] = make_float4(0.f, 0.f, 0.f, 0.f);
  stage_gamma<E, P>(gamma, nvec, staged);
  for (int64_t r = r_begin + warp; r < r_end; r += kWarps) {
    Vec16<T> xv[P], dv[P], old[P];
    load_row(x, r, nvec, lane, xv);
    load_row(dy, r, nvec, lane, dv);
    if (dx_add) load_row(dx, r, nvec, lane, old);  // with the others: one wait for all
    const float m = mean[r], rs = rstd[r];
    float s1 = 0.f, s2 = 0.f;
#pragma unroll
    for (int p = 0; p < P; ++p)
      if (lane + 32 * p < nvec) {
        float g_col[E];
        staged_columns(staged, p, lane, g_col);
#pragma unroll
        for (int q = 0; q < Q; ++q) {
          const int k = (p * Q + q) * 32 + lane;
          float4 sg = sum_g[k], sb = sum_b[k];
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int e = 4 * q + j;
            const float d = as_float(dv[p].v[e]), xhat = (as_float(xv[p].v[e]) - m) * rs, g = d * g_col[e];
            s1 += g;
            s2 += g * xhat;
            component(sg, j) += d * xhat;
            component(sb, j) += d;
          }
          sum_g[k] = sg;
          sum_b[k] = sb;
        }
      }
    if (!dx) continue;
    const float mg = warp_sum(s1) / static_cast<float>(cols), mgx = warp_sum(s2) / static_cast<float>(cols);
    auto* dxrow = reinterpret_cast<Vec16<T>*>(dx) + r * nvec;
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int i = lane + 32 * p;
      if (i >= nvec) continue;
      float g_col[E];
      staged_columns(staged, p, lane, g_col);
      Vec16<T> out;
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const float xhat = (as_float(xv[p].v[e]) - m) * rs;
        const float v = rs * (as_float(dv[p].v[e]) * g_col[e] - mg - xhat * mgx);
        store(&out.v[e], dx_add ? as_float(old[p].v[e]) + v : v);
      }
      dxrow[i] = out;
    }
  }
  __syncthreads();
  // The warps' sums in warp order, four columns (a float4 of every warp's regions) a thread.
  float* const gamma_row = part_gamma + blockIdx.x * static_cast<int64_t>(cols);
  float* const beta_row = part_beta + blockIdx.x * static_cast<int64_t>(cols);
  for (int k = threadIdx.x; k < N; k += blockDim.x) {
    const int i = k % 32 + 32 * (k / (32 * Q)), c = i * E + 4 * (k / 32 % Q);  // as stage_gamma
    if (i >= nvec) continue;
    float4 sg = smem[k], sb = smem[N + k];
    for (int w = 1; w < kWarps; ++w) {
      add_to(sg, smem[2 * w * N + k]);
      add_to(sb, smem[(2 * w + 1) * N + k]);
    }
    store_floats(gamma_row + c, sg);
    store_floats(beta_row + c, sb);
  }
  if (!part_dx || !dx) return;
  // dx's column sums over the chunk, each column in row order, from the rows the warps
  // wrote (visible to the block after the barrier above; still in L2).
  float* const dx_row = part_dx + blockIdx.x * static_cast<int64_t>(cols);
  for (int c = 4 * threadIdx.x; c < cols; c += 4 * blockDim.x) {
    float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
    for (int64_t r = r_begin; r < r_end; ++r) add_to(s, load_four(dx + r * cols + c));
    store_floats(dx_row + c, s);
  }
}

// Rows per stage-one chunk: 32 (a block of the fused kernel: 4 a warp, so that GPT-2's
// 16384 rows make 512 blocks, about one wave at 4 blocks an SM of an H100), more for a
// tall matrix, so that there are at most 1024 chunks (the partial sums' memory and the
// finish's reads stay small).
int64_t chunk_rows_for(int64_t rows) {
  const int64_t need = (rows + 1023) / 1024;
  return need > 32 ? need : 32;
}
int64_t chunks_for(int64_t rows) { return (rows + chunk_rows_for(rows) - 1) / chunk_rows_for(rows); }

unsigned row_blocks(int64_t rows, const char* who) {
  const int64_t blocks = (rows + kWarps - 1) / kWarps;
  DPT_CHECK(blocks <= 0x7fffffff, std::string(who) + ": too many rows");
  return static_cast<unsigned>(blocks);
}

template <typename T>
void add(const T* a, const T* b, int64_t n, T* y, cudaStream_t stream) {
  DPT_CHECK(n >= 0, "residual_add: negative size");
  if (n == 0) return;
  // Four elements an access where all three pointers allow it (y may be a or b: each
  // element is read before it is written, by the same thread).
  constexpr uintptr_t kFour = 4 * sizeof(T);
  if ((reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b) | reinterpret_cast<uintptr_t>(y)) % kFour == 0)
    residual_add_kernel<T, true><<<blocks_for(n / 4), kThreads, 0, stream>>>(a, b, n, y);
  else residual_add_kernel<T, false><<<blocks_for(n), kThreads, 0, stream>>>(a, b, n, y);
  DPT_CUDA_CHECK_LAUNCH();
}

// The fused forward for P vectors a lane (Add: res and h given).
template <typename T, int P, bool Add>
void forward_fused(const T* x, const T* res, const float* gamma, const float* beta, int64_t rows, int64_t cols,
                   float eps, T* h, T* y, int64_t ldy, float* mean, float* rstd, cudaStream_t stream) {
  const unsigned blocks = row_blocks((rows + kForwardRows<P> - 1) / kForwardRows<P>, "layer_norm_forward");
  layer_norm_forward_fused_kernel<T, P, Add><<<blocks, kThreads, 0, stream>>>(
      x, res, gamma, beta, rows, static_cast<int>(cols), eps, h, y, static_cast<int>(ldy), mean, rstd);
}

template <typename T, bool Add>
void forward_fused(int p, const T* x, const T* res, const float* gamma, const float* beta, int64_t rows, int64_t cols,
                   float eps, T* h, T* y, int64_t ldy, float* mean, float* rstd, cudaStream_t stream) {
  if (p == 1) forward_fused<T, 1, Add>(x, res, gamma, beta, rows, cols, eps, h, y, ldy, mean, rstd, stream);
  if (p == 2) forward_fused<T, 2, Add>(x, res, gamma, beta, rows, cols, eps, h, y, ldy, mean, rstd, stream);
  if (p == 3) forward_fused<T, 3, Add>(x, res, gamma, beta, rows, cols, eps, h, y, ldy, mean, rstd, stream);
  if (p == 4) forward_fused<T, 4, Add>(x, res, gamma, beta, rows, cols, eps, h, y, ldy, mean, rstd, stream);
}

// y = LayerNorm(x), or with res, h = x + res and y = LayerNorm(h): fused where a lane holds
// its part of a row (then in one pass), else the general kernels (the add first). y's rows
// are ldy apart, with the ones column after the values where ldy > cols.
template <typename T>
void forward(const T* x, const T* res, const float* gamma, const float* beta, int64_t rows, int64_t cols, float eps,
             T* h, T* y, int64_t ldy, float* mean, float* rstd, cudaStream_t stream) {
  DPT_CHECK(rows >= 0 && cols > 0 && ldy >= cols && ldy <= INT_MAX, "layer_norm_forward: bad shape");
  if (rows == 0) return;
  // The LayerNorm's kernel follows from its own rows (h's, or x's) alone: a sum made apart
  // (a term not 16-byte aligned) is normalized with the bits layer_norm(h) gives, which a
  // recomputation rebuilds.
  const int p = ldy % Vec16<T>::kCount == 0 ? lane_vectors<T>(cols, {res ? h : x, y, gamma, beta}) : 0;
  if (res && (p == 0 || lane_vectors<T>(cols, {x, res}) == 0)) {
    add(x, res, rows * cols, h, stream);
    x = h;
    res = nullptr;
  }
  if (p > 0) {
    if (res) forward_fused<T, true>(p, x, res, gamma, beta, rows, cols, eps, h, y, ldy, mean, rstd, stream);
    else forward_fused<T, false>(p, x, res, gamma, beta, rows, cols, eps, h, y, ldy, mean, rstd, stream);
  } else {
    layer_norm_forward_kernel<T><<<row_blocks(rows, "layer_norm_forward"), kThreads, 0, stream>>>(
        x, gamma, beta, rows, cols, eps, y, ldy, mean, rstd);
  }
  DPT_CUDA_CHECK_LAUNCH();
}

// The partial sums of the fused kernel: gamma's, beta's and (where not null) dx's.
struct BackwardParts {
  float *gamma, *beta, *dx;
};

// The fused kernel for P vectors a lane: dx (when wanted) and the chunks' partial sums;
// false (nothing launched) where its shared memory does not fit a block on this device.
template <typename T, int P>
bool backward_fused(const T* x, const T* dy, const float* gamma, const float* mean, const float* rstd, int64_t rows,
                    int64_t cols, T* dx, bool dx_add, BackwardParts part, cudaStream_t stream) {
  constexpr size_t smem = backward_fused_smem<T, P>();
  const auto kernel = layer_norm_backward_fused_kernel<T, P>;
  if (!allow_optin_smem(kernel, smem)) return false;
  kernel<<<static_cast<unsigned>(chunks_for(rows)), kThreads, smem, stream>>>(
      x, dy, gamma, mean, rstd, rows, static_cast<int>(cols), chunk_rows_for(rows), dx, dx_add, part.gamma, part.beta,
      part.dx);
  DPT_CUDA_CHECK_LAUNCH();
  return true;
}

template <typename T>
bool backward_fused(int p, const T* x, const T* dy, const float* gamma, const float* mean, const float* rstd,
                    int64_t rows, int64_t cols, T* dx, bool dx_add, BackwardParts part, cudaStream_t stream) {
  if (p == 1) return backward_fused<T, 1>(x, dy, gamma, mean, rstd, rows, cols, dx, dx_add, part, stream);
  if (p == 2) return backward_fused<T, 2>(x, dy, gamma, mean, rstd, rows, cols, dx, dx_add, part, stream);
  if (p == 3) return backward_fused<T, 3>(x, dy, gamma, mean, rstd, rows, cols, dx, dx_add, part, stream);
  if (p == 4) return backward_fused<T, 4>(x, dy, gamma, mean, rstd, rows, cols, dx, dx_add, part, stream);
  return false;
}

template <typename T>
bool backward(const T* x, const T* dy, const float* gamma, const float* mean, const float* rstd, int64_t rows,
              int64_t cols, T* dx, bool dx_add, float beta_gamma, float* dgamma, float beta_beta, float* dbeta,
              float* work, float* dx_part, cudaStream_t stream) {
  DPT_CHECK(rows >= 0 && cols > 0, "layer_norm_backward: bad shape");
  const int64_t chunks = chunks_for(rows);
  DPT_CHECK(chunks == 0 || work != nullptr, "layer_norm_backward: null work space");
  const BackwardParts part{work, work + chunks * cols, dx ? dx_part : nullptr};
  // The fused kernel always makes the partial sums (cheap beside its reads), wanted or not.
  const int p = rows > 0 ? lane_vectors<T>(cols, {x, dy, dx, gamma}) : 0;
  const bool fused = backward_fused(p, x, dy, gamma, mean, rstd, rows, cols, dx, dx_add, part, stream);
  if (!fused) {
    if (dx && rows > 0) {
      layer_norm_dx_kernel<T><<<row_blocks(rows, "layer_norm_backward"), kThreads, 0, stream>>>(
          x, dy, gamma, mean, rstd, rows, cols, dx, dx_add);
      DPT_CUDA_CHECK_LAUNCH();
    }
    if (!dgamma && !dbeta) return false;
    if (chunks > 0) {
      const dim3 grid(static_cast<unsigned>((cols + kThreads - 1) / kThreads), static_cast<unsigned>(chunks));
      layer_norm_param_part_kernel<T>
          <<<grid, kThreads, 0, stream>>>(x, dy, mean, rstd, rows, cols, chunk_rows_for(rows), part.gamma, part.beta);
      DPT_CUDA_CHECK_LAUNCH();
    }
  }
  column_sums_finish({part.gamma, beta_gamma, dgamma}, {part.beta, beta_beta, dbeta}, chunks, cols, stream);
  return fused && part.dx && rows > 0;
}

}  // namespace

int64_t layer_norm_backward_work(int64_t rows, int64_t cols) { return 2 * chunks_for(rows) * cols; }
int64_t layer_norm_backward_chunks(int64_t rows) { return chunks_for(rows); }

void layer_norm_forward(const float* x, const float* gamma, const float* beta, int64_t rows, int64_t cols, float eps,
                        float* y, float* mean, float* rstd, cudaStream_t stream) {
  forward<float>(x, nullptr, gamma, beta, rows, cols, eps, nullptr, y, cols, mean, rstd, stream);
}
void layer_norm_forward_bf16(const uint16_t* x, const float* gamma, const float* beta, int64_t rows, int64_t cols,
                             float eps, uint16_t* y, int64_t ldy, float* mean, float* rstd, cudaStream_t stream) {
  forward<uint16_t>(x, nullptr, gamma, beta, rows, cols, eps, nullptr, y, ldy, mean, rstd, stream);
}
void add_layer_norm_forward(const float* a, const float* b, const float* gamma, const float* beta, int64_t rows,
                            int64_t cols, float eps, float* h, float* y, float* mean, float* rstd,
                            cudaStream_t stream) {
  forward(a, b, gamma, beta, rows, cols, eps, h, y, cols, mean, rstd, stream);
}
void add_layer_norm_forward_bf16(const uint16_t* a, const uint16_t* b, const float* gamma, const float* beta,
                                 int64_t rows, int64_t cols, float eps, uint16_t* h, uint16_t* y, int64_t ldy,
                                 float* mean, float* rstd, cudaStream_t stream) {
  forward(a, b, gamma, beta, rows, cols, eps, h, y, ldy, mean, rstd, stream);
}
bool layer_norm_backward(const float* x, const float* dy, const float* gamma, const float* mean, const float* rstd,
                         int64_t rows, int64_t cols, float* dx, bool dx_add, float beta_gamma, float* dgamma,
                         float beta_beta, float* dbeta, float* work, float* dx_part, cudaStream_t stream) {
  return backward(x, dy, gamma, mean, rstd, rows, cols, dx, dx_add, beta_gamma, dgamma, beta_beta, dbeta, work, dx_part,
                  stream);
}
bool layer_norm_backward_bf16(const uint16_t* x, const uint16_t* dy, const float* gamma, const float* mean,
                              const float* rstd, int64_t rows, int64_t cols, uint16_t* dx, bool dx_add,
                              float beta_gamma, float* dgamma, float beta_beta, float* dbeta, float* work,
                              float* dx_part, cudaStream_t stream) {
  return backward(x, dy, gamma, mean, rstd, rows, cols, dx, dx_add, beta_gamma, dgamma, beta_beta, dbeta, work, dx_part,
                  stream);
}
void residual_add(const float* a, const float* b, int64_t n, float* y, cudaStream_t stream) { add(a, b, n, y, stream); }
void residual_add_bf16(const uint16_t* a, const uint16_t* b, int64_t n, uint16_t* y, cudaStream_t stream) {
  add(a, b, n, y, stream);
}

}  // namespace dpt::cuda
