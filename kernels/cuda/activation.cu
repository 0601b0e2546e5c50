// activation.cu — fused bias + activation forward, the activation's backward, and the bias
// gradient; twins of kernels/cpu activation.cpp.
//
// All three are memory-bound: float4 accesses where the shapes and pointers allow it,
// scalar ones otherwise, one instantiation per activation so the inner loop has no switch.
// bias_grad is deterministic (no atomics): each block owns 32 columns and reduces them
// in a fixed order.
//
// The bf16 twins compute the same float expressions and round each store once (bf16.hpp);
// their vector loops move 8 bf16 values (16 bytes) at a time.
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include "../bf16.hpp"
#include "check.hpp"
#include "common.cuh"
#include "cuda.hpp"

namespace dpt::cuda {
namespace {

// ---- bias_act_forward -------------------------------------------------------------------

// Four stored values (float or bf16) as floats, and four floats stored, each rounded once.
__device__ __forceinline__ float4 as_float4(float4 v) { return v; }
__device__ __forceinline__ float4 as_float4(ushort4 v) {
  return make_float4(bf16_float(v.x), bf16_float(v.y), bf16_float(v.z), bf16_float(v.w));
}
__device__ __forceinline__ void store4(float4* p, float4 v) { *p = v; }
__device__ __forceinline__ void store4(ushort4* p, float4 v) {
  *p = make_ushort4(bf16_round(v.x), bf16_round(v.y), bf16_round(v.z), bf16_round(v.w));
}

// y (and z, may be null) = act(x + bias) over the n elements of rows x cols: x the fp32
// GEMM result, the bias (may be null), z and y stored as T (float, or bf16 for the bf16
// twin). x may be y (each element is read before it is written).
template <Act A, typename T>
static __global__ void bias_act_forward_kernel(const float* x, const T* bias, int64_t n, int64_t cols, T* z, T* y) {
  for (int64_t i = global_tid(); i < n; i += grid_stride()) {
    const float v = bias ? x[i] + as_float(bias[i % cols]) : x[i];
    if (z) store(&z[i], v);
    store(&y[i], act_forward<A>(v));
  }
}

// The same four at a time (T4: float4 or ushort4): n4 = n / 4 vectors, cols4 = cols / 4 per row.
template <Act A, typename T4>
static __global__ void bias_act_forward_vec_kernel(const float4* x, const T4* bias, int64_t n4, int64_t cols4, T4* z,
                                                   T4* y) {
  for (int64_t i = global_tid(); i < n4; i += grid_stride()) {
    float4 v = x[i];
    if (bias) {
      const float4 b = as_float4(bias[i % cols4]);
      v.x += b.x;
      v.y += b.y;
      v.z += b.z;
      v.w += b.w;
    }
    if (z) store4(&z[i], v);
    store4(&y[i], make_float4(act_forward<A>(v.x), act_forward<A>(v.y), act_forward<A>(v.z), act_forward<A>(v.w)));
  }
}

template <Act A, typename T, typename T4>
void bias_act_forward_launch(const float* x, const T* bias, int64_t rows, int64_t cols, T* z, T* y,
                             cudaStream_t stream) {
  const int64_t n = rows * cols;
  constexpr size_t kVecBytes = sizeof(T4);
  if (cols % 4 == 0 && aligned16(x) && aligned(y, kVecBytes) && (!z || aligned(z, kVecBytes)) &&
      (!bias || aligned(bias, kVecBytes))) {
    bias_act_forward_vec_kernel<A, T4><<<blocks_for(n / 4), kThreads, 0, stream>>>(
        reinterpret_cast<const float4*>(x), reinterpret_cast<const T4*>(bias), n / 4, cols / 4,
        reinterpret_cast<T4*>(z), reinterpret_cast<T4*>(y));
  } else {
    bias_act_forward_kernel<A, T><<<blocks_for(n), kThreads, 0, stream>>>(x, bias, n, cols, z, y);
  }
}

// ---- act_backward -----------------------------------------------------------------------

// dx may be dy.
template <Act A>
static __global__ void act_backward_kernel(const float* dy, const float* saved, int64_t n, float* dx) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dx[i] = dy[i] * act_derivative<A>(saved[i]);
}

template <Act A>
static __global__ void act_backward_vec_kernel(const float4* dy, const float4* saved, int64_t n4, float4* dx) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n4;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float4 g = dy[i];
    const float4 s = saved[i];
    dx[i] = make_float4(g.x * act_derivative<A>(s.x), g.y * act_derivative<A>(s.y), g.z * act_derivative<A>(s.z),
                        g.w * act_derivative<A>(s.w));
  }
}

template <Act A>
void act_backward_launch(const float* dy, const float* saved, int64_t n, float* dx, cudaStream_t stream) {
  if (n % 4 == 0 && aligned16(dy) && aligned16(saved) && aligned16(dx)) {
    act_backward_vec_kernel<A><<<blocks_for(n / 4), kThreads, 0, stream>>>(reinterpret_cast<const float4*>(dy),
                                                                           reinterpret_cast<const float4*>(saved),
                                                                           n / 4, reinterpret_cast<float4*>(dx));
  } else {
    act_backward_kernel<A><<<blocks_for(n), kThreads, 0, stream>>>(dy, saved, n, dx);
  }
}

// ---- act_backward_transposed ------------------------------------------------------------

constexpr int kTile = 32;     // a 32 x 32 tile of the rows x cols matrix per block
constexpr int kTileRows = 8;  // threads per tile column: each handles 4 rows

// dx = dy * act'(saved) as act_backward, and dxt = dx transposed ([cols, rows]). A tile
// goes through shared memory (one padding column against bank conflicts), so both the
// row-major reads and writes and the transposed writes are coalesced. dx may be null (not
// written). With col_part, the tile's column sums over its 32 rows (in row order) go to
// col_part[tile row][column], for the bias gradient (finished by bias_grad_finish).
template <Act A>
static __global__ void act_backward_transposed_kernel(const float* dy, const float* saved, int64_t rows, int64_t cols,
                                                      float* dx, float* dxt, float* col_part) {
  __shared__ float tile[kTile][kTile + 1];
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTile, c0 = static_cast<int64_t>(blockIdx.x) * kTile;
  for (int i = threadIdx.y; i < kTile; i += kTileRows) {
    const int64_t r = r0 + i, c = c0 + threadIdx.x;
    if (r < rows && c < cols) {
      const int64_t at = r * cols + c;
      const float g = dy[at] * act_derivative<A>(saved[at]);
      if (dx) dx[at] = g;
      tile[i][threadIdx.x] = g;
    }
  }
  __syncthreads();
  for (int i = threadIdx.y; i < kTile; i += kTileRows) {
    const int64_t c = c0 + i, r = r0 + threadIdx.x;
    if (r < rows && c < cols) dxt[c * rows + r] = tile[threadIdx.x][i];
  }
  if (col_part && threadIdx.y == 0 && c0 + threadIdx.x < cols) {
    const int n = static_cast<int>(rows - r0 < kTile ? rows - r0 : kTile);
    float s = 0.f;
    for (int i = 0; i < n; ++i) s += tile[i][threadIdx.x];
    col_part[blockIdx.y * cols + c0 + threadIdx.x] = s;
  }
}

// ---- bias_grad --------------------------------------------------------------------------

constexpr int kGradCols = 32;  // columns per block, one per lane: a warp reads 128 B of a row
constexpr int kGradRows = 32;  // warps per block, each striding over the rows

// db[c] = beta * db[c] + sum_r dy[r][c]. Thread (tx, ty) sums rows ty, ty + 32, ... of
// column c0 + tx; the 32 partial sums of a column are then added in a fixed order, so the
// result does not depend on scheduling.
template <typename T>
static __global__ void bias_grad_kernel(const T* dy, int64_t rows, int64_t cols, float beta, float* db) {
  __shared__ float part[kGradRows][kGradCols + 1];  // +1: the column reads below hit 32 banks
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t c = blockIdx.x * static_cast<int64_t>(kGradCols) + tx;
  float s = 0.f;
  if (c < cols) {
    // Unrolled so that several loads are in flight; the adds stay in row order.
#pragma unroll 4
    for (int64_t r = ty; r < rows; r += kGradRows) s += as_float(dy[r * cols + c]);
  }
  part[ty][tx] = s;
  __syncthreads();
  // Warp 0 finishes: lane tx adds up column tx's partials in order.
  if (ty == 0 && c < cols) {
    float t = 0.f;
#pragma unroll
    for (int k = 0; k < kGradRows; ++k) t += part[k][tx];
    // beta == 0 never reads db (it may hold garbage).
    db[c] = beta != 0.f ? beta * db[c] + t : t;
  }
}

// ---- act_bias_backward -------------------------------------------------------------------

// dz = dy * act'(saved) and db = beta db + the column sums of dz in one pass over dy, in
// two deterministic stages. A block of kBgX x kBgY threads owns kBgX * V columns of a
// chunk of rows: thread (tx, ty) reads V adjacent columns (one 16-byte access when V > 1)
// of rows ty, ty + kBgY, ... of the chunk and sums them in row order; then one thread per
// column adds the block's kBgY partials in order and writes part[chunk][column]; then
// bias_grad_finish adds the chunks in a fixed order. With one chunk the block writes db
// itself (one kernel: the seed workload's 64-row batch). The sums are of the stored dz,
// rounded to T, as the CPU twin's. Act::none leaves dy as it is (dz is not written).
// 8 x V columns per block (128 bytes of a row per 8 threads), 32 rows at a time, 256-row
// chunks: 8 rows per thread.
constexpr int kBgX = 8, kBgY = 32;
constexpr int64_t kBgChunkRows = 256;

template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

template <typename T, int V, Act A>
static __global__ void act_bias_backward_kernel(const T* dy, const T* saved, int64_t rows, int64_t cols,
                                                int64_t chunk_rows, T* dz, float beta, float* db, float* part) {
  DPT_WAIT_PREVIOUS_GRID();
  __shared__ float sums[kBgY][kBgX * V + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * kBgX * V, c0 = col0 + tx * V;
  const int64_t r_begin = static_cast<int64_t>(blockIdx.y) * chunk_rows;
  const int64_t r_end = rows - r_begin < chunk_rows ? rows : r_begin + chunk_rows;
  float s[V] = {};
  if (c0 < cols) {
#pragma unroll 4
    for (int64_t r = r_begin + ty; r < r_end; r += kBgY) {
      const int64_t at = (r * cols + c0) / V;  // in packs (V divides cols and c0)
      Pack<T, V> g = reinterpret_cast<const Pack<T, V>*>(dy)[at];
      if constexpr (A != Act::none) {
        const Pack<T, V> sv = reinterpret_cast<const Pack<T, V>*>(saved)[at];
        // __fmul_rn: the product is rounded before it is stored and summed (no FMA into the sum).
#pragma unroll
        for (int e = 0; e < V; ++e) store(&g.v[e], __fmul_rn(as_float(g.v[e]), act_derivative<A>(as_float(sv.v[e]))));
        reinterpret_cast<Pack<T, V>*>(dz)[at] = g;
      }
#pragma unroll
      for (int e = 0; e < V; ++e) s[e] += as_float(g.v[e]);
    }
  }
#pragma unroll
  for (int e = 0; e < V; ++e) sums[ty][tx * V + e] = s[e];
  __syncthreads();
  const int t = ty * kBgX + tx;  // one thread per column of the block
  const int64_t c = col0 + t;
  if (t >= kBgX * V || c >= cols) return;
  float total = 0.f;
#pragma unroll
  for (int k = 0; k < kBgY; ++k) total += sums[k][t];
  if (gridDim.y > 1) part[blockIdx.y * cols + c] = total;
  else db[c] = beta != 0.f ? beta * db[c] + total : total;  // beta == 0 never reads db
}

// out[c] = beta out[c] + the sum over k < chunks of part[k][c], for sums[blockIdx.y]: thread
// (tx, ty) of a block adds its run of chunks in order (four loads in flight at a time), then
// the column's kFinY runs are added in order. A fixed order, so the same bits every run.
// 32 runs a column: a GPT-2 LayerNorm's 512 chunks take 4 rounds of loads a thread, where 8
// runs took 16 (7.4 µs a launch, the loads' latency).
constexpr int kFinX = 32, kFinY = 32;
static __global__ void bias_grad_finish_kernel(ColumnSum first, ColumnSum second, int64_t chunks, int64_t cols) {
  DPT_WAIT_PREVIOUS_GRID();
  __shared__ float runs[kFinY][kFinX + 1];
  const ColumnSum sum = blockIdx.y == 0 ? first : second;
  const float* part = sum.part;
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kFinX + tx;
  const int64_t per = (chunks + kFinY - 1) / kFinY, k_begin = ty * per;
  const int64_t k_end = chunks - k_begin < per ? chunks : k_begin + per;
  float t = 0.f;
  if (c < cols) {
    int64_t k = k_begin;
    for (; k + 4 <= k_end; k += 4) {
      const float a = part[k * cols + c], b = part[(k + 1) * cols + c], d = part[(k + 2) * cols + c],
                  e = part[(k + 3) * cols + c];
      t += a;
      t += b;
      t += d;
      t += e;
    }
    for (; k < k_end; ++k) t += part[k * cols + c];
  }
  runs[ty][tx] = t;
  __syncthreads();
  if (ty != 0 || c >= cols) return;
  float total = 0.f;
#pragma unroll
  for (int k = 0; k < kFinY; ++k) total += runs[k][tx];
  sum.out[c] = sum.beta != 0.f ? sum.beta * sum.out[c] + total : total;  // beta 0 never reads out
}

// The wanted ones of `first` and `second` (out not null) in one launch.
void finish_column_sums(ColumnSum first, ColumnSum second, int64_t chunks, int64_t cols, cudaStream_t stream) {
  if (!first.out) std::swap(first, second);
  if (!first.out) return;
  const int64_t blocks = (cols + kFinX - 1) / kFinX;
  DPT_CHECK(blocks <= 0x7fffffff, "bias gradient: too many columns");
  const dim3 grid(static_cast<unsigned>(blocks), second.out ? 2 : 1);
  launch_after_previous(bias_grad_finish_kernel, grid, dim3(kFinX, kFinY), stream, first, second, chunks, cols);
}

void bias_grad_finish(const float* part, int64_t chunks, int64_t cols, float beta, float* db, cudaStream_t stream) {
  finish_column_sums({part, beta, db}, {}, chunks, cols, stream);
}

// Rows per chunk: kBgChunkRows, more when the chunks would not fit the grid's y limit.
int64_t bg_chunk_rows(int64_t rows) {
  const int64_t need = (rows + 65534) / 65535;
  return need <= kBgChunkRows ? kBgChunkRows : (need + kBgY - 1) / kBgY * kBgY;
}

template <typename T, int V>
void act_bias_backward_launch(const T* dy, const T* saved, Act act, int64_t rows, int64_t cols, T* dz, float beta,
                              float* db, float* part, cudaStream_t stream) {
  const int64_t chunk_rows = bg_chunk_rows(rows), chunks = (rows + chunk_rows - 1) / chunk_rows;
  const int64_t bx = (cols + kBgX * V - 1) / (kBgX * V);
  DPT_CHECK(bx <= 0x7fffffff, "act_bias_backward: too many columns");
  const dim3 grid(static_cast<unsigned>(bx), static_cast<unsigned>(chunks)), block(kBgX, kBgY);
  const auto kernel =
      dispatch_act(act, "act_bias_backward", [](auto a) { return act_bias_backward_kernel<T, V, decltype(a)::value>; });
  launch_after_previous(kernel, grid, block, stream, dy, saved, rows, cols, chunk_rows, dz, beta, db, part);
  if (chunks > 1) bias_grad_finish(part, chunks, cols, beta, db, stream);
}

// Checks, then the vector kernel when the rows are whole vectors and the pointers aligned.
template <typename T, int V>
void act_bias_backward_checked(const char* name, const T* dy, const T* saved, Act act, int64_t rows, int64_t cols,
                               T* dz, float beta, float* db, float* part, cudaStream_t stream) {
  DPT_CHECK(rows >= 0 && cols >= 0, std::string(name) + ": negative shape");
  if (cols == 0) return;
  DPT_CHECK(db != nullptr, std::string(name) + ": null bias gradient");
  if (rows == 0) {  // db = beta db
    bias_grad_finish(nullptr, 0, cols, beta, db, stream);
    DPT_CUDA_CHECK_LAUNCH();
    return;
  }
  DPT_CHECK(dy != nullptr && (act == Act::none || (saved != nullptr && dz != nullptr)),
            std::string(name) + ": null pointer");
  DPT_CHECK(act_bias_backward_work(rows, cols) == 0 || part != nullptr, std::string(name) + ": null work space");
  constexpr size_t kPackBytes = sizeof(T) * V;
  if (cols % V == 0 && aligned(dy, kPackBytes) &&
      (act == Act::none || (aligned(saved, kPackBytes) && aligned(dz, kPackBytes))))
    act_bias_backward_launch<T, V>(dy, saved, act, rows, cols, dz, beta, db, part, stream);
  else act_bias_backward_launch<T, 1>(dy, saved, act, rows, cols, dz, beta, db, part, stream);
  DPT_CUDA_CHECK_LAUNCH();
}

// ---- bf16 twins --------------------------------------------------------------------------

// 8 bf16 values, one 16-byte access.
struct alignas(16) Bf16x8 {
  uint16_t v[8];
};

// One bf16 element of the activation's forward, y = act(x), or of its backward,
// dx = dy * act'(saved) (x is then dy).
template <Act A, bool Backward>
__device__ __forceinline__ uint16_t act_bf16_element(uint16_t x, uint16_t saved) {
  if constexpr (Backward) return bf16_round(bf16_float(x) * act_derivative<A>(bf16_float(saved)));
  return bf16_round(act_forward<A>(bf16_float(x)));
}

// act_bf16_element over n elements, bf16 to bf16 (saved: the backward's only; y may be x);
// the first 8 * n8 elements in vectors when Vec.
template <Act A, bool Backward, bool Vec>
static __global__ void act_bf16_kernel(const uint16_t* x, const uint16_t* saved, int64_t n, uint16_t* y) {
  int64_t done = 0;
  if constexpr (Vec) {
    const int64_t n8 = n / 8;
    for (int64_t i = global_tid(); i < n8; i += grid_stride()) {
      Bf16x8 v = reinterpret_cast<const Bf16x8*>(x)[i];
      const Bf16x8 s = Backward ? reinterpret_cast<const Bf16x8*>(saved)[i] : Bf16x8{};
#pragma unroll
      for (int e = 0; e < 8; ++e) v.v[e] = act_bf16_element<A, Backward>(v.v[e], s.v[e]);
      reinterpret_cast<Bf16x8*>(y)[i] = v;
    }
    done = 8 * n8;
  }
  for (int64_t i = done + global_tid(); i < n; i += grid_stride())
    y[i] = act_bf16_element<A, Backward>(x[i], Backward ? saved[i] : uint16_t(0));
}

template <Act A, bool Backward>
void act_bf16_launch(const uint16_t* x, const uint16_t* saved, int64_t n, uint16_t* y, cudaStream_t stream) {
  if (aligned16(x) && aligned16(y) && (!Backward || aligned16(saved)))
    act_bf16_kernel<A, Backward, true><<<blocks_for(n / 8 + 1), kThreads, 0, stream>>>(x, saved, n, y);
  else act_bf16_kernel<A, Backward, false><<<blocks_for(n), kThreads, 0, stream>>>(x, saved, n, y);
}

// ones_column_split: a block a row of t, four floats an access where in, ld and both
// pointers allow it.
template <int Four>
__global__ void ones_column_split_kernel(const float* t, int64_t in, int64_t ld, float beta_w, float* dW, float beta_b,
                                         float* db) {
  using V = std::conditional_t<Four == 4, float4, float>;
  const int64_t o = blockIdx.x;
  const float* row = t + o * ld;
  if (dW)
    for (int64_t c = threadIdx.x; c < in / Four; c += blockDim.x) {
      V v = reinterpret_cast<const V*>(row)[c];
      V& w = reinterpret_cast<V*>(dW + o * in)[c];
      if (beta_w != 0.f) {
        const V old = w;
        const float* op = reinterpret_cast<const float*>(&old);
        float* vp = reinterpret_cast<float*>(&v);
        for (int e = 0; e < Four; ++e) vp[e] = beta_w * op[e] + vp[e];
      }
      w = v;
    }
  if (db && threadIdx.x == 0) db[o] = beta_b != 0.f ? beta_b * db[o] + row[in] : row[in];
}

}  // namespace

void bias_act_forward(const float* x, const float* bias, Act act, int64_t rows, int64_t cols, float* z, float* y,
                      cudaStream_t stream) {
  DPT_CHECK(rows >= 0 && cols >= 0, "bias_act_forward: negative shape");
  if (rows == 0 || cols == 0) return;
  DPT_CHECK(x != nullptr && y != nullptr, "bias_act_forward: null x or y");
  dispatch_act(act, "bias_act_forward", [&](auto a) {
    bias_act_forward_launch<decltype(a)::value, float, float4>(x, bias, rows, cols, z, y, stream);
  });
  DPT_CUDA_CHECK_LAUNCH();
}

void act_backward(const float* dy, const float* saved, Act act, int64_t n, float* dx, cudaStream_t stream) {
  DPT_CHECK(n >= 0, "act_backward: negative size");
  if (n == 0) return;
  DPT_CHECK(dy != nullptr && saved != nullptr && dx != nullptr, "act_backward: null pointer");
  dispatch_act(act, "act_backward", [&](auto a) { act_backward_launch<decltype(a)::value>(dy, saved, n, dx, stream); });
  DPT_CUDA_CHECK_LAUNCH();
}

void act_backward_transposed(const float* dy, const float* saved, Act act, int64_t rows, int64_t cols, float* dx,
                             float* dxt, float beta, float* db, float* work, cudaStream_t stream) {
  DPT_CHECK(rows >= 0 && cols >= 0, "act_backward_transposed: negative shape");
  if (rows == 0 || cols == 0) {
    if (db && cols > 0) bias_grad_finish(nullptr, 0, cols, beta, db, stream);  // db = beta db
    DPT_CUDA_CHECK_LAUNCH();
    return;
  }
  DPT_CHECK(dy != nullptr && saved != nullptr && dxt != nullptr, "act_backward_transposed: null pointer");
  DPT_CHECK(!db || work != nullptr, "act_backward_transposed: a bias gradient needs the work space");
  const int64_t bx = (cols + kTile - 1) / kTile, by = (rows + kTile - 1) / kTile;
  DPT_CHECK(bx <= 0x7fffffff && by <= 65535, "act_backward_transposed: too large");
  const dim3 grid(static_cast<unsigned>(bx), static_cast<unsigned>(by)), block(kTile, kTileRows);
  float* part = db ? work : nullptr;
  dispatch_act(act, "act_backward_transposed", [&](auto a) {
    act_backward_transposed_kernel<decltype(a)::value>
        <<<grid, block, 0, stream>>>(dy, saved, rows, cols, dx, dxt, part);
  });
  if (db) bias_grad_finish(part, by, cols, beta, db, stream);
  DPT_CUDA_CHECK_LAUNCH();
}

int64_t act_backward_transposed_work(int64_t rows, int64_t cols) { return (rows + kTile - 1) / kTile * cols; }

int64_t act_bias_backward_work(int64_t rows, int64_t cols) {
  const int64_t chunk_rows = bg_chunk_rows(rows), chunks = (rows + chunk_rows - 1) / chunk_rows;
  return chunks > 1 ? chunks * cols : 0;
}

void act_bias_backward(const float* dy, const float* saved, Act act, int64_t rows, int64_t cols, float* dz, float beta,
                       float* db, float* work, cudaStream_t stream) {
  act_bias_backward_checked<float, 4>("act_bias_backward", dy, saved, act, rows, cols, dz, beta, db, work, stream);
}

void act_bias_backward_bf16(const uint16_t* dy, const uint16_t* saved, Act act, int64_t rows, int64_t cols,
                            uint16_t* dz, float beta, float* db, float* work, cudaStream_t stream) {
  act_bias_backward_checked<uint16_t, 8>("act_bias_backward_bf16", dy, saved, act, rows, cols, dz, beta, db, work,
                                         stream);
}

void ones_column_split(const float* t, int64_t out, int64_t in, int64_t ld, float beta_w, float* dW, float beta_b,
                       float* db, cudaStream_t stream) {
  DPT_CHECK(out >= 0 && in >= 0 && ld > in && out <= 0x7fffffff, "ones_column_split: bad shape");
  if (out == 0 || (!dW && !db)) return;
  const bool four = in % 4 == 0 && ld % 4 == 0 && reinterpret_cast<uintptr_t>(t) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(dW) % 16 == 0;
  if (four)
    ones_column_split_kernel<4><<<static_cast<unsigned>(out), 192, 0, stream>>>(t, in, ld, beta_w, dW, beta_b, db);
  else
    ones_column_split_kernel<1><<<static_cast<unsigned>(out), kThreads, 0, stream>>>(t, in, ld, beta_w, dW, beta_b, db);
  DPT_CUDA_CHECK_LAUNCH();
}

void bias_grad(const float* dy, int64_t rows, int64_t cols, float beta, float* db, cudaStream_t stream) {
  DPT_CHECK(rows >= 0 && cols >= 0, "bias_grad: negative shape");
  if (cols == 0) return;
  DPT_CHECK(db != nullptr && (rows == 0 || dy != nullptr), "bias_grad: null pointer");
  const int64_t blocks = (cols + kGradCols - 1) / kGradCols;
  DPT_CHECK(blocks <= 0x7fffffff, "bias_grad: too many columns");
  // rows == 0 still runs: db = beta * db + 0.
  bias_grad_kernel<<<static_cast<unsigned>(blocks), dim3(kGradCols, kGradRows), 0, stream>>>(dy, rows, cols, beta, db);
  DPT_CUDA_CHECK_LAUNCH();
}

void bias_act_forward_bf16(const float* x, const uint16_t* bias, Act act, int64_t rows, int64_t cols, uint16_t* z,
                           uint16_t* y, cudaStream_t stream) {
  DPT_CHECK(rows >= 0 && cols >= 0, "bias_act_forward_bf16: negative shape");
  if (rows == 0 || cols == 0) return;
  DPT_CHECK(x != nullptr && y != nullptr, "bias_act_forward_bf16: null x or y");
  dispatch_act(act, "bias_act_forward_bf16", [&](auto a) {
    bias_act_forward_launch<decltype(a)::value, uint16_t, ushort4>(x, bias, rows, cols, z, y, stream);
  });
  DPT_CUDA_CHECK_LAUNCH();
}

void act_forward_bf16(const uint16_t* x, Act act, int64_t n, uint16_t* y, cudaStream_t stream) {
  DPT_CHECK(n >= 0, "act_forward_bf16: negative size");
  if (n == 0) return;
  DPT_CHECK(x != nullptr && y != nullptr, "act_forward_bf16: null pointer");
  dispatch_act(act, "act_forward_bf16",
               [&](auto a) { act_bf16_launch<decltype(a)::value, false>(x, nullptr, n, y, stream); });
  DPT_CUDA_CHECK_LAUNCH();
}

void act_backward_bf16(const uint16_t* dy, const uint16_t* saved, Act act, int64_t n, uint16_t* dx,
                       cudaStream_t stream) {
  DPT_CHECK(n >= 0, "act_backward_bf16: negative size");
  if (n == 0) return;
  DPT_CHECK(dy != nullptr && saved != nullptr && dx != nullptr, "act_backward_bf16: null pointer");
  dispatch_act(act, "act_backward_bf16",
               [&](auto a) { act_bf16_launch<decltype(a)::value, true>(dy, saved, n, dx, stream); });
  DPT_CUDA_CHECK_LAUNCH();
}

void column_sums_finish(ColumnSum first, ColumnSum second, int64_t chunks, int64_t cols, cudaStream_t stream) {
  finish_column_sums(first, second, chunks, cols, stream);
  DPT_CUDA_CHECK_LAUNCH();
}

}  // namespace dpt::cuda
