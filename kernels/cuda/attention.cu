// attention.cu — causal self-attention (../attention.hpp), forward and backward; the twin
// of cpu/attention.cpp. A straightforward kernel of ours: a warp a softmax row, no [T, T]
// matrix anywhere, no atomics (every output element is written by one lane, its sums in
// a fixed order), so the same inputs give the same bits on every run.
//
// A lane holds the head's columns lane, lane + 32, ... (K = ceil(head_size / 32) of them,
// at most 4): a row of y, dq, dk or dv is accumulated in registers. The vector a warp
// compares every other row with (q_t in the forward and dq, k_j and v_j in dk/dv) sits in
// shared memory; lane l takes the l-th row of each tile of 32 (keys or queries), computes
// its score from the whole head (a dot product of its own), and the tile's weights are
// then broadcast to every lane, one row at a time, in row order.
//
// The backward: D_t = dy_t . y_t a row first, then one launch whose warps take their rows
// as queries (dq) or as keys (dk, dv). Scores are (q_i * scale) k_i summed over i in order,
// the same expression in the forward and in both, so the backward's recomputed
// probabilities exp(s - lse) are the forward's.
#include <cmath>
#include <cstdint>
#include <string>

#include "../attention.hpp"
#include "check.hpp"
#include "common.cuh"
#include "cuda.hpp"

namespace dpt::cuda {
namespace {

constexpr int kAttentionWarps = 4;  // rows a block: one a warp
constexpr unsigned kFull = 0xffffffffu;

// The softmax row a warp takes, (b, h, t) = lse's index, and where its head's rows are:
// q of position t' of sequence b's head h at qkv + r.qkv + t' * r.stride, k C further, v 2C;
// y and dy rows at r.out + t' * C.
struct Row {
  bool valid;  // false past the last row
  int warp, lane;
  int64_t row, t, first;  // first: the softmax row of position 0 of (b, h)
  int64_t qkv, out;
  int64_t hs, C, stride;
  float scale;  // 1 / sqrt(hs)
};

__device__ __forceinline__ Row warp_row(const AttentionShape& s) {
  Row r;
  r.warp = static_cast<int>(threadIdx.x / 32);
  r.lane = static_cast<int>(threadIdx.x % 32);
  r.row = blockIdx.x * static_cast<int64_t>(kAttentionWarps) + r.warp;
  r.valid = r.row < s.softmax_rows();
  r.t = r.row % s.T;
  r.first = r.row - r.t;
  const int64_t h = (r.row / s.T) % s.heads, b = r.row / (s.T * s.heads);
  r.hs = s.head_size;
  r.C = s.channels();
  r.stride = 3 * r.C;
  r.qkv = b * s.T * r.stride + h * r.hs;
  r.out = b * s.T * r.C + h * r.hs;
  r.scale = 1.f / sqrtf(static_cast<float>(r.hs));
  return r;
}

// The score (q * scale) . k over the head's columns, in column order.
template <typename A, typename B>
__device__ __forceinline__ float score(const A* q, const B* k, int64_t hs, float scale) {
  float d = 0.f;
  for (int64_t i = 0; i < hs; ++i) d += (as_float(q[i]) * scale) * as_float(k[i]);
  return d;
}

template <int K, typename T>
__device__ __forceinline__ void to_shared(const T* row, int64_t hs, int lane, float* sh) {
#pragma unroll
  for (int k = 0; k < K; ++k)
    if (lane + 32 * k < hs) sh[lane + 32 * k] = as_float(row[lane + 32 * k]);
}

// Two rows of the head that a warp's lanes all read (q_t and dy_t, or k_j and v_j), kept in
// shared memory: keep() copies them there and points a and b at the warp's copies.
template <int K>
struct SharedPair {
  float first[kAttentionWarps][32 * K], second[kAttentionWarps][32 * K];
};

template <int K, typename T>
__device__ __forceinline__ void keep(SharedPair<K>& sh, const Row& r, const T* row_a, const T* row_b, float*& a,
                                     float*& b) {
  a = sh.first[r.warp];
  b = sh.second[r.warp];
  to_shared<K>(row_a, r.hs, r.lane, a);
  to_shared<K>(row_b, r.hs, r.lane, b);
  __syncwarp();
}

// acc[k] += w * row[lane + 32 k] over the lane's columns.
template <int K, typename T>
__device__ __forceinline__ void add_scaled(float (&acc)[K], float w, const T* row, int64_t hs, int lane) {
#pragma unroll
  for (int k = 0; k < K; ++k)
    if (lane + 32 * k < hs) acc[k] += w * as_float(row[lane + 32 * k]);
}

template <int K, typename T>
__device__ __forceinline__ void store_row(T* row, const float (&v)[K], float f, int64_t hs, int lane) {
#pragma unroll
  for (int k = 0; k < K; ++k)
    if (lane + 32 * k < hs) store(row + lane + 32 * k, v[k] * f);
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, o));
  return v;
}

// y_t and lse_t for one softmax row a warp, over the keys in tiles of 32 with an online
// softmax: the running max m, the sum l of exp(s - m) and acc = sum exp(s - m) v, rescaled
// when a tile raises m.
template <int K, typename T>
static __global__ void attention_forward_kernel(AttentionShape s, const T* qkv, T* y, float* lse) {
  __shared__ float q_sh[kAttentionWarps][32 * K];
  const Row r = warp_row(s);
  if (!r.valid) return;
  const T* base = qkv + r.qkv;
  float* q = q_sh[r.warp];
  to_shared<K>(base + r.t * r.stride, r.hs, r.lane, q);
  __syncwarp();
  float acc[K] = {}, m = -INFINITY, l = 0.f;
  for (int64_t j0 = 0; j0 <= r.t; j0 += 32) {
    const int64_t j = j0 + r.lane;
    const float sc = j <= r.t ? score(q, base + j * r.stride + r.C, r.hs, r.scale) : -INFINITY;
    const float m_new = fmaxf(m, warp_max(sc));  // finite: key j0 <= t is in every tile
    const float corr = expf(m - m_new);          // 0 at the first tile (m = -inf)
    const float p = j <= r.t ? expf(sc - m_new) : 0.f;
    l = l * corr + warp_sum(p);
#pragma unroll
    for (int k = 0; k < K; ++k) acc[k] *= corr;
    const int count = static_cast<int>(r.t - j0 + 1 < 32 ? r.t - j0 + 1 : 32);
    for (int jj = 0; jj < count; ++jj)
      add_scaled(acc, __shfl_sync(kFull, p, jj), base + (j0 + jj) * r.stride + 2 * r.C, r.hs, r.lane);
    m = m_new;
  }
  store_row(y + r.out + r.t * r.C, acc, 1.f / l, r.hs, r.lane);
  if (r.lane == 0) lse[r.row] = m + logf(l);
}

// D_t = dy_t . y_t for every softmax row (a warp a row).
template <int K, typename T>
static __global__ void attention_d_kernel(AttentionShape s, const T* y, const T* dy, float* d) {
  const Row r = warp_row(s);
  if (!r.valid) return;
  const int64_t off = r.out + r.t * r.C;
  float v = 0.f;
#pragma unroll
  for (int k = 0; k < K; ++k)
    if (r.lane + 32 * k < r.hs) v += as_float(dy[off + r.lane + 32 * k]) * as_float(y[off + r.lane + 32 * k]);
  v = warp_sum(v);
  if (r.lane == 0) d[r.row] = v;
}

// dq_t = scale sum_{j <= t} ds_tj k_j, ds_tj = p_tj (dy_t . v_j - D_t), for the query row r.t.
template <int K, typename T>
__device__ void query_grad(const Row& r, SharedPair<K>& sh, const T* qkv, const T* dy, const float* lse, const float* d,
                           T* dqkv) {
  const T* base = qkv + r.qkv;
  float *q, *dyt;
  keep(sh, r, base + r.t * r.stride, dy + r.out + r.t * r.C, q, dyt);
  const float lse_t = lse[r.row], d_t = d[r.row];
  float dq[K] = {};
  for (int64_t j0 = 0; j0 <= r.t; j0 += 32) {
    const int64_t j = j0 + r.lane;
    float ds = 0.f;
    if (j <= r.t) {
      const float p = expf(score(q, base + j * r.stride + r.C, r.hs, r.scale) - lse_t);
      ds = p * (score(dyt, base + j * r.stride + 2 * r.C, r.hs, 1.f) - d_t);
    }
    const int count = static_cast<int>(r.t - j0 + 1 < 32 ? r.t - j0 + 1 : 32);
    for (int jj = 0; jj < count; ++jj)
      add_scaled(dq, __shfl_sync(kFull, ds, jj), base + (j0 + jj) * r.stride + r.C, r.hs, r.lane);
  }
  store_row(dqkv + r.qkv + r.t * r.stride, dq, r.scale, r.hs, r.lane);
}

// dk_j = scale sum_{t >= j} ds_tj q_t and dv_j = sum_{t >= j} p_tj dy_t, for the key row
// j = r.t.
template <int K, typename T>
__device__ void key_value_grad(const AttentionShape& s, const Row& r, SharedPair<K>& sh, const T* qkv, const T* dy,
                               const float* lse, const float* d, T* dqkv) {
  const T* base = qkv + r.qkv;
  float *kj, *vj;
  keep(sh, r, base + r.t * r.stride + r.C, base + r.t * r.stride + 2 * r.C, kj, vj);
  float dk[K] = {}, dv[K] = {};
  for (int64_t t0 = r.t; t0 < s.T; t0 += 32) {
    const int64_t t = t0 + r.lane;
    float p = 0.f, ds = 0.f;
    if (t < s.T) {
      p = expf(score(base + t * r.stride, kj, r.hs, r.scale) - lse[r.first + t]);
      ds = p * (score(dy + r.out + t * r.C, vj, r.hs, 1.f) - d[r.first + t]);
    }
    const int count = static_cast<int>(s.T - t0 < 32 ? s.T - t0 : 32);
    for (int tt = 0; tt < count; ++tt) {
      add_scaled(dv, __shfl_sync(kFull, p, tt), dy + r.out + (t0 + tt) * r.C, r.hs, r.lane);
      add_scaled(dk, __shfl_sync(kFull, ds, tt), base + (t0 + tt) * r.stride, r.hs, r.lane);
    }
  }
  store_row(dqkv + r.qkv + r.t * r.stride + r.C, dk, r.scale, r.hs, r.lane);
  store_row(dqkv + r.qkv + r.t * r.stride + 2 * r.C, dv, 1.f, r.hs, r.lane);
}

// dqkv in one launch after attention_d_kernel: blocks of grid row 0 take their softmax rows
// as queries (dq), those of row 1 as keys (dk, dv); a long query row (late t) and a long key
// row (early j) share the GPU.
template <int K, typename T>
static __global__ void attention_backward_kernel(AttentionShape s, const T* qkv, const T* dy, const float* lse,
                                                 const float* d, T* dqkv) {
  __shared__ SharedPair<K> sh;
  const Row r = warp_row(s);
  if (!r.valid) return;
  if (blockIdx.y == 0) query_grad<K>(r, sh, qkv, dy, lse, d, dqkv);
  else key_value_grad<K>(s, r, sh, qkv, dy, lse, d, dqkv);
}

void check_shape(const AttentionShape& s, const char* who) {
  DPT_CHECK(s.batch > 0 && s.T > 0 && s.heads > 0 && s.head_size > 0, std::string(who) + ": empty shape");
  DPT_CHECK(s.head_size <= kAttentionMaxHeadSize, std::string(who) + ": head size " + std::to_string(s.head_size) +
                                                      " is above " + std::to_string(kAttentionMaxHeadSize));
  DPT_CHECK((s.softmax_rows() + kAttentionWarps - 1) / kAttentionWarps <= 0x7fffffff,
            std::string(who) + ": too many rows");
}

unsigned attention_blocks(const AttentionShape& s) {
  return static_cast<unsigned>((s.softmax_rows() + kAttentionWarps - 1) / kAttentionWarps);
}

// Calls f(std::integral_constant<int, K>{}) for the head size's K = ceil(head_size / 32).
template <typename F>
void dispatch_k(int64_t head_size, F&& f) {
  switch ((head_size + 31) / 32) {
    case 1:
      return f(std::integral_constant<int, 1>{});
    case 2:
      return f(std::integral_constant<int, 2>{});
    case 3:
      return f(std::integral_constant<int, 3>{});
    default:
      return f(std::integral_constant<int, 4>{});
  }
}

template <typename T>
void forward_launch(const char* who, const AttentionShape& s, const T* qkv, T* y, float* lse, cudaStream_t stream) {
  check_shape(s, who);
  DPT_CHECK(qkv != nullptr && y != nullptr && lse != nullptr, std::string(who) + ": null pointer");
  dispatch_k(s.head_size, [&](auto k) {
    attention_forward_kernel<decltype(k)::value>
        <<<attention_blocks(s), kAttentionWarps * 32, 0, stream>>>(s, qkv, y, lse);
  });
  DPT_CUDA_CHECK_LAUNCH();
}

template <typename T>
void backward_launch(const char* who, const AttentionShape& s, const T* qkv, const T* y, const T* dy, const float* lse,
                     T* dqkv, float* work, cudaStream_t stream) {
  check_shape(s, who);
  DPT_CHECK(qkv && y && dy && lse && dqkv && work, std::string(who) + ": null pointer");
  const unsigned blocks = attention_blocks(s);
  const int threads = kAttentionWarps * 32;
  dispatch_k(s.head_size, [&](auto k) {
    constexpr int K = decltype(k)::value;
    attention_d_kernel<K><<<blocks, threads, 0, stream>>>(s, y, dy, work);
    DPT_CUDA_CHECK_LAUNCH();
    attention_backward_kernel<K><<<dim3(blocks, 2), threads, 0, stream>>>(s, qkv, dy, lse, work, dqkv);
  });
  DPT_CUDA_CHECK_LAUNCH();
}

}  // namespace

void attention_forward(const AttentionShape& s, const float* qkv, float* y, float* lse, cudaStream_t stream) {
  forward_launch("attention_forward", s, qkv, y, lse, stream);
}
void attention_forward_bf16(const AttentionShape& s, const uint16_t* qkv, uint16_t* y, float* lse,
                            cudaStream_t stream) {
  forward_launch("attention_forward_bf16", s, qkv, y, lse, stream);
}
void attention_backward(const AttentionShape& s, const float* qkv, const float* y, const float* dy, const float* lse,
                        float* dqkv, float* work, cudaStream_t stream) {
  backward_launch("attention_backward", s, qkv, y, dy, lse, dqkv, work, stream);
}
void attention_backward_bf16(const AttentionShape& s, const uint16_t* qkv, const uint16_t* y, const uint16_t* dy,
                             const float* lse, uint16_t* dqkv, float* work, cudaStream_t stream) {
  backward_launch("attention_backward_bf16", s, qkv, y, dy, lse, dqkv, work, stream);
}

}  // namespace dpt::cuda
