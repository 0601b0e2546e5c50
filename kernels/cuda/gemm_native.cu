// gemm_native.cu — hand-written SGEMM, strict fp32 (FFMA only, no tensor cores), row-major
// and contiguous: C = alpha * op(A) * op(B) + beta * C, the twin of cpu::gemm.
//
// The classic recipe (as in CUTLASS's SIMT kernels and the well-known "how to optimize
// SGEMM" write-ups): a 128x128 tile of C per block of 256 threads, k in slabs of kBK,
// each thread owning an 8x8 register tile split into four 4x4 quads so that its shared
// reads are float4 and a warp's reads hit distinct banks or broadcast. Both operands are
// kept k-major in shared memory ([k][m] and [k][n]); a transpose of the input happens
// once, while the slab is stored, never in the inner loop. Shared memory is double
// buffered and the next slab is prefetched into registers while the current one is
// multiplied, so there is one barrier per slab and the global latency hides behind
// 8 * 64 FFMAs per thread. 128 registers, no spills: two blocks (16 warps) per SM.
//
// On large problems it comes close to cuBLAS's fp32 GEMM (benchmarks/sgemm_bench.cu
// measures both). Problems with few 128x128 tiles leave most SMs idle (64x1000x1000 is 8
// blocks on a GPU of 132 SMs) and run far slower than cuBLAS, which splits k there; this
// kernel does not.
//
// Edges: every global load is bounds-checked (zeros outside) and every store predicated,
// so any m, n, k works with the same kernel; only the load width changes. Vec = float4
// loads, valid when both operands are 16-byte aligned and their leading dimensions are
// multiples of 4 (then a float4 never straddles a matrix edge); otherwise scalar loads.
#include <climits>
#include <cstdint>

#include "check.hpp"
#include "common.cuh"
#include "cuda.hpp"

namespace dpt::cuda {
namespace {

constexpr int kBM = 128;           // rows of C per block
constexpr int kBN = 128;           // columns of C per block
constexpr int kBK = 8;             // k per shared-memory slab (16 measured slower: 128-reg cap)
constexpr int kTileThreads = 256;  // a block: the 8 warps of the thread layout below
// Row pitch of a slab in shared memory. The +4 makes the transposing store (4 scalar
// stores per float4, rows 4 apart) land the two halves of a warp on different banks,
// and keeps every row 16-byte aligned for the float4 reads.
constexpr int kPitch = kBM + 4;
constexpr int kLoads = kBK * kBM / 4 / kTileThreads;  // float4 loads per thread per operand
static_assert(kBM == kBN, "one slab loader serves both operands");
static_assert(kLoads >= 1 && kBK * kBM == 4 * kTileThreads * kLoads, "slab must split evenly");

// Loads one operand's kBK x 128 slab from global memory into registers and stores it
// k-major into shared memory. KMajor operands are stored [mn][k] in global memory (A
// without transpose, B with), so each float4 runs along k and is transposed on the way
// into shared memory; the others are stored [k][mn] and copied straight.
template <bool KMajor, bool Vec>
struct SlabLoader {
  static constexpr int kVecPerRow = KMajor ? kBK / 4 : kBM / 4;
  const float* p[kLoads];  // this thread's next four floats of global memory
  int kk[kLoads];          // their k offset in the slab (the first of four if KMajor)
  unsigned mn_ok[kLoads];  // bit j: element j lies inside the matrix along m (or n)
  int s_off[kLoads];       // where the first of them goes in the shared slab
  int64_t step;            // distance from one slab to the next in global memory

  __device__ __forceinline__ SlabLoader(const float* base, int64_t ld, int mn0, int mn_size, int tid)
      : step(KMajor ? kBK : kBK * ld) {
    const int mn_left = mn_size - mn0;
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      const int idx = tid + l * kTileThreads;
      const int r = idx / kVecPerRow;  // [mn][k] if KMajor, else [k][mn]
      const int c = (idx % kVecPerRow) * 4;
      if constexpr (KMajor) {
        kk[l] = c;
        mn_ok[l] = r < mn_left ? 0xFu : 0u;
        s_off[l] = c * kPitch + r;
        // A row past the edge is never read; point it at row 0 rather than past the end.
        p[l] = base + static_cast<int64_t>(r < mn_left ? mn0 + r : 0) * ld + c;
      } else {
        kk[l] = r;
        mn_ok[l] = 0u;
#pragma unroll
        for (int j = 0; j < 4; ++j) mn_ok[l] |= (c + j < mn_left ? 1u : 0u) << j;
        s_off[l] = r * kPitch + c;
        p[l] = base + static_cast<int64_t>(r) * ld + mn0 + c;
      }
    }
  }

  // k_left: how many k remain in the matrix from this slab's first k.
  __device__ __forceinline__ void load(float4 (&v)[kLoads], int k_left) const {
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      if constexpr (Vec) {  // the leading dimension is a multiple of 4: all four or none
        const bool ok = (mn_ok[l] & 1u) && kk[l] < k_left;
        v[l] = ok ? __ldg(reinterpret_cast<const float4*>(p[l])) : make_float4(0.f, 0.f, 0.f, 0.f);
      } else {
        float e[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const bool ok = ((mn_ok[l] >> j) & 1u) && (KMajor ? kk[l] + j : kk[l]) < k_left;
          e[j] = ok ? __ldg(p[l] + j) : 0.f;
        }
        v[l] = make_float4(e[0], e[1], e[2], e[3]);
      }
    }
  }

  __device__ __forceinline__ void advance() {
#pragma unroll
    for (int l = 0; l < kLoads; ++l) p[l] += step;
  }

  __device__ __forceinline__ void store(float* s, const float4 (&v)[kLoads]) const {
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      if constexpr (KMajor) {
        s[s_off[l] + 0 * kPitch] = v[l].x;
        s[s_off[l] + 1 * kPitch] = v[l].y;
        s[s_off[l] + 2 * kPitch] = v[l].z;
        s[s_off[l] + 3 * kPitch] = v[l].w;
      } else {
        *reinterpret_cast<float4*>(s + s_off[l]) = v[l];
      }
    }
  }
};

// Thread layout: 8 warps as 4 (m) x 2 (n), each warp a 32x64 tile of C; lanes as 4 (m) x
// 8 (n), each lane owning the quads at rows {0, 16} + 4*lm and columns {0, 32} + 4*ln of
// its warp tile. A quarter-warp (8 lanes) then reads one A float4 (a broadcast) and 8
// consecutive B float4s (all 32 banks once) per k.
template <bool TA, bool TB, bool Vec>
static __global__ void __launch_bounds__(kTileThreads, 2)
    gemm_native_kernel(int M, int N, int K, float alpha, const float* A, const float* B, float beta, float* C,
                       bool vec_c) {
  __shared__ __align__(16) float As[2][kBK * kPitch];
  __shared__ __align__(16) float Bs[2][kBK * kPitch];

  const int tid = threadIdx.x;
  const int m0 = blockIdx.y * kBM;
  const int n0 = blockIdx.x * kBN;

  // A is k-major (stored m x k) unless transposed; B is k-major only when transposed.
  SlabLoader<!TA, Vec> la(A, TA ? M : K, m0, M, tid);
  SlabLoader<TB, Vec> lb(B, TB ? K : N, n0, N, tid);

  const int warp = tid / 32, lane = tid % 32;
  const int a_off = (warp / 2) * 32 + (lane / 8) * 4;
  const int b_off = (warp % 2) * 64 + (lane % 8) * 4;

  float acc[8][8];
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[i][j] = 0.f;

  const int tiles = (K + kBK - 1) / kBK;
  float4 ra[kLoads], rb[kLoads];
  if (tiles > 0) {
    la.load(ra, K);
    lb.load(rb, K);
    la.store(As[0], ra);
    lb.store(Bs[0], rb);
  }
  __syncthreads();

  for (int t = 0; t < tiles; ++t) {
    const int cur = t & 1;
    // Prefetch the next slab now and store it after the FFMAs below, so its latency hides
    // behind them. After the last slab k_left <= 0 predicates every load off; keeping the
    // loop body free of branches is what lets the compiler issue the loads this early
    // (under an `if` it sinks them to the stores, exposing the latency every slab).
    la.advance();
    lb.advance();
    const int k_left = K - (t + 1) * kBK;
    la.load(ra, k_left);
    lb.load(rb, k_left);
    const float* as = As[cur];
    const float* bs = Bs[cur];
#pragma unroll
    for (int kk = 0; kk < kBK; ++kk) {
      const float4 a0 = *reinterpret_cast<const float4*>(as + kk * kPitch + a_off);
      const float4 a1 = *reinterpret_cast<const float4*>(as + kk * kPitch + a_off + 16);
      const float4 b0 = *reinterpret_cast<const float4*>(bs + kk * kPitch + b_off);
      const float4 b1 = *reinterpret_cast<const float4*>(bs + kk * kPitch + b_off + 32);
      const float a[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
      const float b[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
    // The other buffer was last read before the previous barrier, so it is free.
    la.store(As[cur ^ 1], ra);
    lb.store(Bs[cur ^ 1], rb);
    __syncthreads();
  }

  // beta == 0 never reads C: it may hold garbage (NaN) on entry.
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int row = m0 + a_off + (i < 4 ? i : 12 + i);
    if (row >= M) continue;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int col = n0 + b_off + 32 * h;
      if (col >= N) continue;
      float* cp = C + static_cast<int64_t>(row) * N + col;
      float v[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) v[j] = alpha * acc[i][4 * h + j];
      if (vec_c) {  // N % 4 == 0, so col < N puts all four columns inside
        if (beta != 0.f) {
          const float4 old = *reinterpret_cast<const float4*>(cp);
          v[0] = fmaf(beta, old.x, v[0]);
          v[1] = fmaf(beta, old.y, v[1]);
          v[2] = fmaf(beta, old.z, v[2]);
          v[3] = fmaf(beta, old.w, v[3]);
        }
        *reinterpret_cast<float4*>(cp) = make_float4(v[0], v[1], v[2], v[3]);
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          if (col + j < N) cp[j] = beta != 0.f ? fmaf(beta, cp[j], v[j]) : v[j];
        }
      }
    }
  }
}

template <bool TA, bool TB>
void launch(dim3 grid, cudaStream_t stream, bool vec, int m, int n, int k, float alpha, const float* A, const float* B,
            float beta, float* C, bool vec_c) {
  if (vec) gemm_native_kernel<TA, TB, true><<<grid, kTileThreads, 0, stream>>>(m, n, k, alpha, A, B, beta, C, vec_c);
  else gemm_native_kernel<TA, TB, false><<<grid, kTileThreads, 0, stream>>>(m, n, k, alpha, A, B, beta, C, vec_c);
}

}  // namespace

void gemm_native(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* A, const float* B,
                 float beta, float* C, cudaStream_t stream) {
  DPT_CHECK(m >= 0 && n >= 0 && k >= 0, "gemm_native: negative size");
  if (m == 0 || n == 0) return;
  // The kernel indexes tiles and edges in int; element offsets are 64-bit.
  DPT_CHECK(m <= INT_MAX - kBM && n <= INT_MAX - kBN && k <= INT_MAX - kBK,
            "gemm_native: a dimension does not fit in int");
  DPT_CHECK(C != nullptr && (k == 0 || (A != nullptr && B != nullptr)), "gemm_native: null matrix");
  const dim3 grid(static_cast<unsigned>((n + kBN - 1) / kBN), static_cast<unsigned>((m + kBM - 1) / kBM));
  DPT_CHECK(grid.y <= 65535u, "gemm_native: m too large for the grid");
  const int64_t lda = ta ? m : k;
  const int64_t ldb = tb ? k : n;
  const bool vec = aligned16(A) && aligned16(B) && lda % 4 == 0 && ldb % 4 == 0;
  const bool vec_c = aligned16(C) && n % 4 == 0;
  const int M = static_cast<int>(m), N = static_cast<int>(n), K = static_cast<int>(k);
  if (!ta && !tb) launch<false, false>(grid, stream, vec, M, N, K, alpha, A, B, beta, C, vec_c);
  if (!ta && tb) launch<false, true>(grid, stream, vec, M, N, K, alpha, A, B, beta, C, vec_c);
  if (ta && !tb) launch<true, false>(grid, stream, vec, M, N, K, alpha, A, B, beta, C, vec_c);
  if (ta && tb) launch<true, true>(grid, stream, vec, M, N, K, alpha, A, B, beta, C, vec_c);
  DPT_CUDA_CHECK_LAUNCH();
}

}  // namespace dpt::cuda
