// gemm_small.cu — hand-written strict-fp32 GEMMs for the shapes a Linear layer with a
// small batch makes, where cuBLAS's general kernels leave the GPU mostly idle:
//
// - skinny: C = act(alpha A B^T + beta C + bias), A [m, k] with m <= kSkinnyRows (the
//   batch), B [n, k] (the weight): the forward. cuBLAS ran the seed workload's
//   64 x 1000 x 1000 as two kernels (a split-k GEMM), then our bias pass, and the default
//   job's 256 x 128 x 16 as three. Here: blocks of 64 rows x 64 columns (up to four tiles of
//   rows), each over one slice of k (split k, so that ~256 blocks run),
//   writing partial products; then one pass adds the slices in order and applies alpha,
//   beta, the bias and the activation. Deterministic: the split depends on the shape alone.
//   With one slice, one kernel does both. The same kernel with B [k, n] (read along n)
//   is a tiny layer's input gradient dz W (gemm_skinny_nn).
// - short k: C = alpha A^T B + beta C, A [k, m], B [k, n] with k small (the batch): the
//   weight gradient. Both operands are read along their rows (m and n are contiguous), so
//   no transpose. It can also sum A's columns (a Linear layer's bias gradient when A is the
//   output gradient), which saves that layer its separate bias-gradient kernel. When the
//   tiles are few (a tiny layer at a batch past 64), k is split over a cluster of blocks
//   that add their partial tiles through each other's shared memory.
//
// All are FFMA only (no tensor cores), as cuBLAS's fp32 path, and the CPU's gemm is their
// oracle. Edges: loads outside the matrices read zeros, stores are predicated.
#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>

#include <cooperative_groups.h>

#include "check.hpp"
#include "common.cuh"
#include "cuda.hpp"

namespace dpt::cuda {
namespace {

constexpr int kTileThreads = 256;  // a block of every GEMM kernel here (its tile's layout depends on it)

// Every kernel: a 64 x 64 tile of C per block, thread (tx, ty) owning the 4 x 4 register
// tile at rows 4ty.., columns 4tx..; k in chunks of 64 held whole in shared memory, k-major
// ([k][m] and [k][n]; rows padded to 68 floats, still 16-byte aligned for float4 reads).
// A chunk is loaded in one go, so a block waits for global memory once per chunk: the
// seed workload's k is one chunk per block.
constexpr int kTile = 64;
constexpr int kChunk = 64;
constexpr int kPitch = kTile + 4;
constexpr int kBlocksWanted = 256;  // the split aims at about two blocks per SM
constexpr int kMaxSplit = 16;
constexpr int kMaxCluster = 8;  // blocks of a thread-block cluster that every Hopper GPU runs (portable)
constexpr int kLoads = kTile * kChunk / 4 / kTileThreads;  // float4 loads per thread per operand and chunk

// Four consecutive elements of `row` (when row_ok) at columns [c, c + 4) clipped to c_end;
// zeros elsewhere. Vec: one float4 when all four are inside (16-byte aligned by the caller).
template <bool Vec>
__device__ __forceinline__ float4 load4(const float* row, bool row_ok, int c, int c_end) {
  if (Vec && row_ok && c + 4 <= c_end) return *reinterpret_cast<const float4*>(row + c);
  float v[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) v[j] = row_ok && c + j < c_end ? row[c + j] : 0.f;
  return make_float4(v[0], v[1], v[2], v[3]);
}

// A Linear layer's dz = dy act'(saved), made as a GEMM loads dy (its A) instead of by a
// pass of its own: v times act'(s), s from `saved` at the same place (zeros outside give
// zeros). The products are act_bias_backward's, so the GEMM multiplies the same dz.
__device__ __forceinline__ float times_derivative(float v, float s, Act act) {
  return act == Act::none ? v : __fmul_rn(v, act_derivative(act, s));
}
__device__ __forceinline__ float4 times_derivative(float4 v, float4 s, Act act) {
  return make_float4(times_derivative(v.x, s.x, act), times_derivative(v.y, s.y, act), times_derivative(v.z, s.z, act),
                     times_derivative(v.w, s.w, act));
}

// Stores v to row[c, c + 4) clipped to n. vec (n % 4 == 0 and the row 16-byte aligned, so
// c < n means c + 4 <= n): one 16-byte store. Scalar stores of a 64 x 64 tile took a large
// share of the short-k kernel's time (the seed workload's shape, in a CUDA graph).
__device__ __forceinline__ void store4(float* row, int c, int n, float4 v, bool vec) {
  if (vec) {
    if (c < n) *reinterpret_cast<float4*>(row + c) = v;
    return;
  }
  const float e[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int j = 0; j < 4; ++j)
    if (c + j < n) row[c + j] = e[j];
}

// Thread t's place in the 16 x 16 grid of 4 x 4 tiles: a warp covers 8 x 4 of them, so
// per k its reads of A's column are 4 float4s (64 bytes) and of B's row 8 (128 bytes), one
// shared-memory wavefront each (a 16 x 2 warp would need three).
__device__ __forceinline__ int tile_col(int t) { return (t / 32) % 2 * 8 + t % 8; }
__device__ __forceinline__ int tile_row(int t) { return (t / 32) / 2 * 4 + t % 32 / 8; }

// acc += the chunk's products (zeros past the matrices add nothing).
__device__ __forceinline__ void multiply_chunk(const float (*As)[kPitch], const float (*Bs)[kPitch], int tx, int ty,
                                               float acc[4][4]) {
#pragma unroll 16
  for (int q = 0; q < kChunk; ++q) {
    const float4 av = *reinterpret_cast<const float4*>(&As[q][4 * ty]);
    const float4 bv = *reinterpret_cast<const float4*>(&Bs[q][4 * tx]);
    const float ar[4] = {av.x, av.y, av.z, av.w}, br[4] = {bv.x, bv.y, bv.z, bv.w};
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][j] += ar[i] * br[j];
  }
}

// ---- skinny ------------------------------------------------------------------------------

// Where load l of thread t goes in a 64 x 64 chunk read along k: lanes 0-15 of a warp take
// 16 rows at one k quad and lanes 16-31 the same rows at the next quad (32 contiguous bytes
// a row), so the transposing stores As[kk + j][r] fall in 32 different banks
// ((16 * quad + r) mod 32 with the pitch of 68; one row per lane put 16 lanes in 2 banks).
struct ChunkSlot {
  int r, kk;
};
__device__ __forceinline__ ChunkSlot chunk_slot(int t, int l) {
  const int idx = t + l * kTileThreads, lane = idx % 32, w = idx / 32;
  return {lane % 16 + 16 * (w % 4), 4 * (lane / 16 + 2 * (w / 4))};
}

// acc += the block's tile of rows [m0, m0 + 64) x columns [n0, n0 + 64) of A B^T over
// k in [k_begin, k_end): A [m, k] is k-contiguous, each float4 transposed on its way into
// shared memory; B is [n, k] as A (BAlongK), or [k, n] (n-contiguous rows copied straight
// in, as short_k's: the input gradient dz W).
template <bool Vec, bool BAlongK, bool Deriv = false>
__device__ __forceinline__ void skinny_tile(int m, int n, int k, int k_begin, int k_end, const float* A, const float* B,
                                            int m0, int n0, float (*As)[kPitch], float (*Bs)[kPitch], float acc[4][4],
                                            const float* saved = nullptr, Act act = Act::none) {
  const int t = threadIdx.x, tx = tile_col(t), ty = tile_row(t);
  for (int k0 = k_begin; k0 < k_end; k0 += kChunk) {
    // 64 rows x 64 k of each operand: every load issued before the first store, so the
    // block waits for global memory once.
    float4 a[kLoads], b[kLoads];
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      const auto [r, kk] = chunk_slot(t, l);
      const bool row_ok = m0 + r < m;
      const int64_t a_row = static_cast<int64_t>(row_ok ? m0 + r : 0) * k;
      a[l] = load4<Vec>(A + a_row, row_ok, k0 + kk, k_end);
      if constexpr (Deriv) a[l] = times_derivative(a[l], load4<Vec>(saved + a_row, row_ok, k0 + kk, k_end), act);
      if constexpr (BAlongK) {
        b[l] = load4<Vec>(B + static_cast<int64_t>(n0 + r < n ? n0 + r : 0) * k, n0 + r < n, k0 + kk, k_end);
      } else {
        const int idx = t + l * kTileThreads, kr = idx / 16, c4 = (idx % 16) * 4;
        const bool k_ok = k0 + kr < k_end;
        b[l] = load4<Vec>(B + static_cast<int64_t>(k_ok ? k0 + kr : 0) * n, k_ok, n0 + c4, n);
      }
    }
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      const auto [r, kk] = chunk_slot(t, l);
      As[kk][r] = a[l].x, As[kk + 1][r] = a[l].y, As[kk + 2][r] = a[l].z, As[kk + 3][r] = a[l].w;
      if constexpr (BAlongK) {
        Bs[kk][r] = b[l].x, Bs[kk + 1][r] = b[l].y, Bs[kk + 2][r] = b[l].z, Bs[kk + 3][r] = b[l].w;
      } else {
        const int idx = t + l * kTileThreads;
        *reinterpret_cast<float4*>(&Bs[idx / 16][(idx % 16) * 4]) = b[l];
      }
    }
    __syncthreads();
    multiply_chunk(As, Bs, tx, ty, acc);
    __syncthreads();
  }
}

// part[split][r][c] = sum over this split's k of A[r][k] B[c][k] for the block's tile of
// rows (blockIdx.z).
template <bool Vec>
static __global__ void __launch_bounds__(kTileThreads)
    skinny_partial_kernel(int m, int n, int k, int k_per_split, const float* A, const float* B, float* part) {
  DPT_WAIT_PREVIOUS_GRID();
  __shared__ __align__(16) float As[kChunk][kPitch];
  __shared__ __align__(16) float Bs[kChunk][kPitch];
  const int t = threadIdx.x, tx = tile_col(t), ty = tile_row(t);
  const int n0 = blockIdx.x * kTile, split = blockIdx.y, m0 = blockIdx.z * kTile;
  const int k_begin = split * k_per_split, k_end = min(k, k_begin + k_per_split);
  float acc[4][4] = {};
  skinny_tile<Vec, true>(m, n, k, k_begin, k_end, A, B, m0, n0, As, Bs, acc);
  const bool vec = n % 4 == 0;  // part is the allocator's, 16-byte aligned
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = m0 + 4 * ty + i;
    if (r < m)
      store4(part + (static_cast<int64_t>(split) * m + r) * n, n0 + 4 * tx, n,
             make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]), vec);
  }
}

// C[i] = act(alpha * s + beta C[i] + bias), z[i] (z may be null) = the pre-activation.
// beta == 0 never reads C.
template <Act A>
__device__ __forceinline__ void skinny_finish(float s, int64_t i, int n, float alpha, float beta, float* C,
                                              const float* bias, float* z) {
  float v = alpha * s;
  if (beta != 0.f) v += beta * C[i];
  if (bias) v += bias[i % n];
  if (z) z[i] = v;
  C[i] = act_forward<A>(v);
}

// C = act(alpha * (part[0] + part[1] + ...) + beta C + bias), the slices added in order.
// Vec (n % 4 == 0): four outputs a thread, every slice's load issued before the first add
// (a loop of dependent loads waited on the memory once per slice).
template <Act A, bool Vec>
static __global__ void skinny_epilogue_kernel(const float* part, int splits, int64_t mn, int n, float alpha, float beta,
                                              float* C, const float* bias, float* z) {
  DPT_WAIT_PREVIOUS_GRID();
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  if constexpr (Vec) {
    const float4* part4 = reinterpret_cast<const float4*>(part);
    const int64_t mn4 = mn / 4;
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < mn4; i += stride) {
      float4 v[kMaxSplit];
#pragma unroll
      for (int p = 0; p < kMaxSplit; ++p)
        if (p < splits) v[p] = part4[p * mn4 + i];
      float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int p = 0; p < kMaxSplit; ++p)
        if (p < splits) s[0] += v[p].x, s[1] += v[p].y, s[2] += v[p].z, s[3] += v[p].w;
#pragma unroll
      for (int e = 0; e < 4; ++e) skinny_finish<A>(s[e], 4 * i + e, n, alpha, beta, C, bias, z);
    }
  } else {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < mn; i += stride) {
      float s = 0.f;
      for (int p = 0; p < splits; ++p) s += part[p * mn + i];
      skinny_finish<A>(s, i, n, alpha, beta, C, bias, z);
    }
  }
}

// The skinny GEMM in one kernel where k is not split (one slice: k up to a chunk, or tiles
// enough): the block's whole sum, then skinny_finish. What the partial and epilogue
// kernels compute with one slice, in one launch instead of two. B as skinny_tile's
// BAlongK; Deriv: A times act'(saved) as it is loaded (the input gradient of a layer with
// an activation).
template <Act A, bool Vec, bool BAlongK, bool Deriv = false>
static __global__ void __launch_bounds__(kTileThreads)
    skinny_whole_kernel(int m, int n, int k, float alpha, const float* Am, const float* B, float beta, float* C,
                        const float* bias, float* z, const float* saved, Act deriv_act) {
  DPT_WAIT_PREVIOUS_GRID();
  __shared__ __align__(16) float As[kChunk][kPitch];
  __shared__ __align__(16) float Bs[kChunk][kPitch];
  const int t = threadIdx.x, tx = tile_col(t), ty = tile_row(t);
  const int n0 = blockIdx.x * kTile, m0 = blockIdx.z * kTile;
  float acc[4][4] = {};
  skinny_tile<Vec, BAlongK, Deriv>(m, n, k, 0, k, Am, B, m0, n0, As, Bs, acc, saved, deriv_act);
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int r = m0 + 4 * ty + i, c = n0 + 4 * tx + j;
      if (r < m && c < n) skinny_finish<A>(acc[i][j], static_cast<int64_t>(r) * n + c, n, alpha, beta, C, bias, z);
    }
}

struct SkinnySplit {
  int per_split, splits;
};

// How k is cut: about kBlocksWanted blocks in all, slices of whole chunks. Shape only.
SkinnySplit skinny_split(int64_t m, int64_t n, int64_t k) {
  const int64_t tiles = std::max<int64_t>(1, (n + kTile - 1) / kTile) * std::max<int64_t>(1, (m + kTile - 1) / kTile);
  const int64_t want = std::clamp<int64_t>(kBlocksWanted / tiles, 1, kMaxSplit);
  const int64_t chunks = (k + kChunk - 1) / kChunk;
  const int64_t per_split = std::max<int64_t>(1, (chunks + want - 1) / want) * kChunk;
  return {static_cast<int>(per_split), static_cast<int>(std::max<int64_t>(1, (k + per_split - 1) / per_split))};
}

// ---- short k ----------------------------------------------------------------------------

// C = alpha A^T B + beta C, A [k, m] and B [k, n]: rows of both are slices of C's tile
// along m and n, copied straight into shared memory. With colsum, the blocks of the first
// column of tiles also write colsum = alpha * (A's column sums) + colsum_beta * colsum from
// the tiles of A they hold anyway: four threads a column, each summing its quarter of every
// chunk's rows, then the quarters added in order (a fixed order: the same bits every run).
//
// Split k (gridDim.z > 1, a power of two up to 8): the blocks of a tile are one thread-block
// cluster, block z taking k from z * k_per_split. Each leaves its partial tile (and column
// quarters) in its shared memory, and block z then adds every block's rows
// [z * 64 / splits, (z + 1) * 64 / splits) in block order through distributed shared memory
// (Hopper): no workspace, no second kernel, and the same bits every run. Four blocks of a
// 64 x 64 tile over k = 256 each waited for four chunks one after another (the default
// job's weight gradients took 11 us each on four SMs). Split is a kernel of its own, so
// that the unsplit one keeps its registers (the seed workload's weight gradient took 8.0
// us instead of 6.0 with both in one).
template <bool Vec, bool Split, bool Deriv>
static __global__ void __launch_bounds__(kTileThreads)
    short_k_kernel(int m, int n, int k, int k_per_split, float alpha, const float* A, const float* B, float beta,
                   float* C, float* colsum, float colsum_beta, const float* saved, Act deriv_act) {
  DPT_WAIT_PREVIOUS_GRID();
  __shared__ __align__(16) float As[kChunk][kPitch];
  __shared__ __align__(16) float Bs[kChunk][kPitch];
  const int t = threadIdx.x, tx = tile_col(t), ty = tile_row(t);
  const int m0 = blockIdx.y * kTile, n0 = blockIdx.x * kTile;
  const int split = blockIdx.z;
  const int k_begin = split * k_per_split, k_end = min(k, k_begin + k_per_split);
  static_assert(kTileThreads == 4 * kTile && kChunk % 4 == 0, "column sums: four threads a column");
  const bool sums = colsum && blockIdx.x == 0;  // the same for the whole block (and cluster)
  const int sum_col = t % kTile, quarter = t / kTile;
  float acc[4][4] = {}, col = 0.f;
  for (int k0 = k_begin; k0 < k_end; k0 += kChunk) {
    float4 a[kLoads], b[kLoads];
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      const int idx = t + l * kTileThreads, kk = idx / 16, c4 = (idx % 16) * 4;
      const bool row_ok = k0 + kk < k_end;
      const int64_t row = row_ok ? k0 + kk : 0;
      a[l] = load4<Vec>(A + row * m, row_ok, m0 + c4, m);
      if constexpr (Deriv) a[l] = times_derivative(a[l], load4<Vec>(saved + row * m, row_ok, m0 + c4, m), deriv_act);
      b[l] = load4<Vec>(B + row * n, row_ok, n0 + c4, n);
    }
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      const int idx = t + l * kTileThreads, kk = idx / 16, c4 = (idx % 16) * 4;
      *reinterpret_cast<float4*>(&As[kk][c4]) = a[l];
      *reinterpret_cast<float4*>(&Bs[kk][c4]) = b[l];
    }
    __syncthreads();
    if (sums)  // rows past k hold zeros
#pragma unroll
      for (int q = 0; q < kChunk / 4; ++q) col += As[quarter * (kChunk / 4) + q][sum_col];
    multiply_chunk(As, Bs, tx, ty, acc);
    __syncthreads();
  }
  // Stores row r of the tile (its four columns from c) given its sums in v.
  const bool vec = n % 4 == 0 && aligned16(C);
  auto store_row = [&](int r, int c, float v0, float v1, float v2, float v3) {
    if (r >= m) return;
    float* out = C + static_cast<int64_t>(r) * n;
    float v[4] = {alpha * v0, alpha * v1, alpha * v2, alpha * v3};
    if (beta != 0.f) {
      const float4 o = vec ? load4<true>(out, true, c, n) : load4<false>(out, true, c, n);
      v[0] = alpha * v0 + beta * o.x, v[1] = alpha * v1 + beta * o.y;
      v[2] = alpha * v2 + beta * o.z, v[3] = alpha * v3 + beta * o.w;
    }
    store4(out, c, n, make_float4(v[0], v[1], v[2], v[3]), vec);
  };
  auto store_colsum = [&](int i, float total) {
    colsum[i] = colsum_beta != 0.f ? alpha * total + colsum_beta * colsum[i] : alpha * total;
  };
  if constexpr (!Split) {
#pragma unroll
    for (int i = 0; i < 4; ++i) store_row(m0 + 4 * ty + i, n0 + 4 * tx, acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
    if (sums) {  // As is free: the loop ended with a barrier
      As[quarter][sum_col] = col;
      __syncthreads();
      if (t < kTile && m0 + t < m) store_colsum(m0 + t, ((As[0][t] + As[1][t]) + As[2][t]) + As[3][t]);
    }
  } else {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    // The partial tile in As (rows of the tile, as C), the column quarters in Bs; both free.
#pragma unroll
    for (int i = 0; i < 4; ++i)
      *reinterpret_cast<float4*>(&As[4 * ty + i][4 * tx]) = make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
    if (sums) Bs[quarter][sum_col] = col;
    namespace cg = cooperative_groups;
    cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();  // every block's partials written
    const int splits = static_cast<int>(gridDim.z), rows = kTile / splits;
    for (int idx = t; idx < rows * (kTile / 4); idx += kTileThreads) {
      const int r = split * rows + idx / (kTile / 4), c = (idx % (kTile / 4)) * 4;
      float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
      for (int q = 0; q < splits; ++q) {
        const float4 p = *reinterpret_cast<const float4*>(cluster.map_shared_rank(&As[r][c], q));
        s.x += p.x, s.y += p.y, s.z += p.z, s.w += p.w;
      }
      store_row(m0 + r, n0 + c, s.x, s.y, s.z, s.w);
    }
    if (sums && split == 0 && t < kTile && m0 + t < m) {
      float total = 0.f;
      for (int q = 0; q < splits; ++q) {
        const float* quarters = cluster.map_shared_rank(&Bs[0][0], q);
        total += ((quarters[t] + quarters[kPitch + t]) + quarters[2 * kPitch + t]) + quarters[3 * kPitch + t];
      }
      store_colsum(m0 + t, total);
    }
    cluster.sync();  // no block leaves while another still reads its shared memory
#else
    __trap();  // the launcher splits only where every architecture built has clusters
#endif
  }
}

struct ShortKSplit {
  int per_split, splits;
};

// How k is cut: into a power of two of slices of whole chunks, at most kMaxCluster and
// at most the chunks, while the blocks stay about one per SM (kBlocksWanted / 2); none
// without clusters. Shape only, so the same bits every run (of one build: a build for
// architectures without clusters splits nothing, and its sums differ in the last bits).
ShortKSplit short_k_split(int64_t tiles, int64_t k) {
  const int64_t chunks = std::max<int64_t>(1, (k + kChunk - 1) / kChunk);
  int splits = 1;
  while (DPT_SM90 && splits * 2 <= kMaxCluster && splits * 2 <= chunks && tiles * splits * 2 <= kBlocksWanted / 2)
    splits *= 2;
  const int64_t per_split = (chunks + splits - 1) / splits * kChunk;
  return {static_cast<int>(per_split), splits};
}

}  // namespace

int64_t gemm_skinny_work(int64_t m, int64_t n, int64_t k) {
  const int splits = skinny_split(m, n, k).splits;
  return k > 0 && splits > 1 ? splits * m * n : 0;  // one slice (or none): no partial products
}

void gemm_skinny(int64_t m, int64_t n, int64_t k, float alpha, const float* A, const float* B, float beta, float* C,
                 const float* bias, Act act, float* z, float* work, cudaStream_t stream) {
  DPT_CHECK(m >= 0 && n >= 0 && k >= 0, "gemm_skinny: negative size");
  DPT_CHECK(m <= kSkinnyRows, "gemm_skinny: more than 256 rows");
  // k / 2: a split's end (its start plus its length) is computed in int.
  DPT_CHECK(n <= INT_MAX - kTile && k <= INT_MAX / 2, "gemm_skinny: a dimension does not fit in int");
  if (m == 0 || n == 0) return;
  DPT_CHECK(C != nullptr && (k == 0 || (A != nullptr && B != nullptr)), "gemm_skinny: null pointer");
  const SkinnySplit sp = skinny_split(m, n, k);
  DPT_CHECK(sp.splits <= kMaxSplit, "gemm_skinny: more slices than the epilogue adds");
  if (k > 0 && sp.splits > 1)  // the partial products' 16-byte accesses
    DPT_CHECK(work != nullptr && aligned16(work), "gemm_skinny: work must be 16-byte aligned, not null");
  const int M = static_cast<int>(m), N = static_cast<int>(n), K = static_cast<int>(k);
  const bool vec_loads = k % 4 == 0 && aligned16(A) && aligned16(B);
  if (k > 0 && sp.splits == 1) {  // one kernel
    const auto kernel = dispatch_act(act, "gemm_skinny", [vec_loads](auto a) {
      return vec_loads ? skinny_whole_kernel<decltype(a)::value, true, true>
                       : skinny_whole_kernel<decltype(a)::value, false, true>;
    });
    launch_after_previous(
        kernel, dim3(static_cast<unsigned>((n + kTile - 1) / kTile), 1, static_cast<unsigned>((m + kTile - 1) / kTile)),
        kTileThreads, stream, M, N, K, alpha, A, B, beta, C, bias, z, static_cast<const float*>(nullptr), Act::none);
    return;
  }
  const dim3 grid(static_cast<unsigned>((n + kTile - 1) / kTile), static_cast<unsigned>(sp.splits),
                  static_cast<unsigned>((m + kTile - 1) / kTile));
  if (k > 0)
    launch_after_previous(vec_loads ? skinny_partial_kernel<true> : skinny_partial_kernel<false>, grid, kTileThreads,
                          stream, M, N, K, sp.per_split, A, B, work);
  const int splits = k > 0 ? sp.splits : 0;  // k == 0: C = act(beta C + bias)
  const int64_t mn = m * n;
  const bool vec = n % 4 == 0;
  const int64_t items = vec ? mn / 4 : mn;
  const unsigned blocks = blocks_for(items, 4096);
  const auto epilogue = dispatch_act(act, "gemm_skinny", [vec](auto a) {
    return vec ? skinny_epilogue_kernel<decltype(a)::value, true> : skinny_epilogue_kernel<decltype(a)::value, false>;
  });
  const float* const_work = work;
  launch_after_previous(epilogue, blocks, kThreads, stream, const_work, splits, mn, N, alpha, beta, C, bias, z);
}

void gemm_skinny_nn(int64_t m, int64_t n, int64_t k, float alpha, const float* A, const float* B, float beta, float* C,
                    cudaStream_t stream, const float* deriv_of, Act act) {
  DPT_CHECK(m >= 0 && n >= 0 && k >= 0, "gemm_skinny_nn: negative size");
  DPT_CHECK(m <= kSkinnyRows && k <= kSkinnyNnK, "gemm_skinny_nn: more than " + std::to_string(kSkinnyRows) +
                                                     " rows or " + std::to_string(kSkinnyNnK) + " columns of A");
  DPT_CHECK(n <= INT_MAX - kTile, "gemm_skinny_nn: a dimension does not fit in int");
  if (m == 0 || n == 0) return;
  DPT_CHECK(C != nullptr && (k == 0 || (A != nullptr && B != nullptr)), "gemm_skinny_nn: null pointer");
  const bool deriv = deriv_of != nullptr && act != Act::none;
  const bool vec = k % 4 == 0 && n % 4 == 0 && aligned16(A) && aligned16(B) && (!deriv || aligned16(deriv_of));
  const auto kernel =
      deriv ? (vec ? skinny_whole_kernel<Act::none, true, false, true>
                   : skinny_whole_kernel<Act::none, false, false, true>)
            : (vec ? skinny_whole_kernel<Act::none, true, false> : skinny_whole_kernel<Act::none, false, false>);
  launch_after_previous(
      kernel, dim3(static_cast<unsigned>((n + kTile - 1) / kTile), 1, static_cast<unsigned>((m + kTile - 1) / kTile)),
      kTileThreads, stream, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), alpha, A, B, beta, C,
      static_cast<const float*>(nullptr), static_cast<float*>(nullptr),
      deriv ? deriv_of : static_cast<const float*>(nullptr), act);
}

void gemm_short_k(int64_t m, int64_t n, int64_t k, float alpha, const float* A, const float* B, float beta, float* C,
                  cudaStream_t stream, float* colsum_A, float colsum_beta, const float* deriv_of, Act act) {
  DPT_CHECK(m >= 0 && n >= 0 && k >= 0, "gemm_short_k: negative size");
  // k: a slice's start plus its length (up to k plus a chunk a slice) is computed in int.
  DPT_CHECK(m <= INT_MAX - kTile && n <= INT_MAX - kTile && k <= INT_MAX - kMaxCluster * kChunk,
            "gemm_short_k: a dimension does not fit in int");
  if (m == 0) return;
  DPT_CHECK(n > 0 || colsum_A == nullptr, "gemm_short_k: column sums need at least one column of B");
  if (n == 0) return;
  DPT_CHECK(C != nullptr && (k == 0 || (A != nullptr && B != nullptr)), "gemm_short_k: null pointer");
  const int64_t by = (m + kTile - 1) / kTile, bx = (n + kTile - 1) / kTile;
  DPT_CHECK(by <= 65535, "gemm_short_k: m too large for the grid");
  const ShortKSplit sp = short_k_split(bx * by, k);
  const dim3 grid(static_cast<unsigned>(bx), static_cast<unsigned>(by), static_cast<unsigned>(sp.splits));
  const int M = static_cast<int>(m), N = static_cast<int>(n), K = static_cast<int>(k);
  const bool deriv = deriv_of != nullptr && act != Act::none;
  const bool vec = m % 4 == 0 && n % 4 == 0 && aligned16(A) && aligned16(B) && (!deriv || aligned16(deriv_of));
  const auto pick = [vec](auto split, auto with_deriv) {
    constexpr bool S = decltype(split)::value, D = decltype(with_deriv)::value;
    return vec ? short_k_kernel<true, S, D> : short_k_kernel<false, S, D>;
  };
  using yes = std::true_type;
  using no = std::false_type;
  const auto kernel =
      sp.splits > 1 ? (deriv ? pick(yes{}, yes{}) : pick(yes{}, no{})) : (deriv ? pick(no{}, yes{}) : pick(no{}, no{}));
  launch_after_previous_in_clusters(dim3(1, 1, static_cast<unsigned>(sp.splits)), kernel, grid, kTileThreads, stream, M,
                                    N, K, sp.per_split, alpha, A, B, beta, C, colsum_A, colsum_beta,
                                    deriv ? deriv_of : static_cast<const float*>(nullptr), act);
}

}  // namespace dpt::cuda
