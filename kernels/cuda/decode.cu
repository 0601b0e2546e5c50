// decode.cu — attention with a key-value cache (../decode.hpp), for generating text; the
// twin of cpu::attention_decode. Simple and correct rather than fast: what makes decoding
// cheap is the cache itself (a new token costs one query row over the cached positions,
// not the whole window again).
//
// Two launches: the new rows' keys and values are copied into the cache, then a block of
// kDecodeThreads takes one (new row, head). It keeps its query (scaled) in shared memory
// and goes over the cached positions in tiles of kKeyTile: a warp a key scores it (lanes
// over the head's columns, warp_sum), every thread reads the tile's scores from shared
// memory in order for the running max and sum of the online softmax, and thread c adds
// the weighted values of column c. fp32 math; no atomics, every sum in a fixed order, so
// the same inputs give the same bits on every run.
#include <cmath>
#include <cstdint>
#include <string>

#include "../decode.hpp"
#include "check.hpp"
#include "common.cuh"
#include "cuda.hpp"

namespace dpt::cuda {
namespace {

constexpr int kDecodeThreads = 128;  // >= the largest head: thread c owns column c of y
constexpr int kDecodeWarps = kDecodeThreads / 32;
constexpr int kKeyTile = 256;  // scores a block holds in shared memory at a time
static_assert(kDecodeThreads >= kAttentionMaxHeadSize, "a thread a column of the head");

// k_cache and v_cache at positions start + i of each sequence = the k and v of qkv's row
// b * n + i (a thread an element of the new rows' C columns).
template <typename T>
__global__ void decode_append_kernel(DecodeShape s, const T* qkv, T* k_cache, T* v_cache) {
  const int64_t C = s.channels();
  for (int64_t e = global_tid(); e < s.rows() * C; e += grid_stride()) {
    const int64_t r = e / C, c = e - r * C;
    const int64_t b = r / s.n, i = r - b * s.n, h = c / s.head_size, d = c - h * s.head_size;
    const int64_t at = s.cache_at(b, h, s.start + i) + d;
    k_cache[at] = qkv[r * 3 * C + C + c];
    v_cache[at] = qkv[r * 3 * C + 2 * C + c];
  }
}

// y for block (row r, head h): query r over the positions 0 .. start + i of its sequence.
template <typename T>
__global__ void decode_attention_kernel(DecodeShape s, const T* qkv, const T* k_cache, const T* v_cache, T* y) {
  __shared__ float q[kAttentionMaxHeadSize];
  __shared__ float p[kKeyTile];
  const int64_t r = blockIdx.x / s.heads, h = blockIdx.x % s.heads;
  const int64_t b = r / s.n, i = r - b * s.n;
  const int64_t hs = s.head_size, C = s.channels(), count = s.start + i + 1;
  const int tid = static_cast<int>(threadIdx.x), lane = tid % 32, warp = tid / 32;
  const float scale = 1.f / sqrtf(static_cast<float>(hs));
  for (int64_t c = tid; c < hs; c += kDecodeThreads) q[c] = as_float(qkv[r * 3 * C + h * hs + c]) * scale;
  __syncthreads();
  const T* keys = k_cache + s.cache_at(b, h, 0);
  const T* values = v_cache + s.cache_at(b, h, 0);
  float m = -INFINITY, l = 0.f, acc = 0.f;
  for (int64_t j0 = 0; j0 < count; j0 += kKeyTile) {
    const int tile = static_cast<int>(count - j0 < kKeyTile ? count - j0 : kKeyTile);
    for (int jj = warp; jj < tile; jj += kDecodeWarps) {
      const T* k = keys + (j0 + jj) * hs;
      float d = 0.f;
      for (int64_t c = lane; c < hs; c += 32) d += q[c] * as_float(k[c]);
      d = warp_sum(d);
      if (lane == 0) p[jj] = d;
    }
    __syncthreads();
    float tile_max = -INFINITY;
    for (int jj = 0; jj < tile; ++jj) tile_max = fmaxf(tile_max, p[jj]);
    const float m_new = fmaxf(m, tile_max);  // finite: every tile has a key
    const float corr = expf(m - m_new);      // 0 at the first tile (m = -inf)
    __syncthreads();                         // every thread has read the scores
    for (int jj = tid; jj < tile; jj += kDecodeThreads) p[jj] = expf(p[jj] - m_new);
    __syncthreads();
    float tile_sum = 0.f, tile_acc = 0.f;
    for (int jj = 0; jj < tile; ++jj) {
      tile_sum += p[jj];
      if (tid < hs) tile_acc += p[jj] * as_float(values[(j0 + jj) * hs + tid]);
    }
    l = l * corr + tile_sum;
    acc = acc * corr + tile_acc;
    m = m_new;
    __syncthreads();  // the next tile's scores overwrite p
  }
  if (tid < hs) store(y + r * C + h * hs + tid, acc / l);
}

template <typename T>
void decode_launch(const char* who, const DecodeShape& s, const T* qkv, T* k_cache, T* v_cache, T* y,
                   cudaStream_t stream) {
  DPT_CHECK(s.batch > 0 && s.n > 0 && s.heads > 0 && s.head_size > 0 && s.start >= 0 && s.start + s.n <= s.capacity,
            std::string(who) + ": bad shape");
  DPT_CHECK(s.head_size <= kAttentionMaxHeadSize, std::string(who) + ": head size " + std::to_string(s.head_size) +
                                                      " is above " + std::to_string(kAttentionMaxHeadSize));
  DPT_CHECK(s.rows() * s.heads <= 0x7fffffff, std::string(who) + ": too many rows");
  DPT_CHECK(qkv && k_cache && v_cache && y, std::string(who) + ": null pointer");
  decode_append_kernel<T><<<blocks_for(s.rows() * s.channels()), kThreads, 0, stream>>>(s, qkv, k_cache, v_cache);
  DPT_CUDA_CHECK_LAUNCH();
  decode_attention_kernel<T>
      <<<static_cast<unsigned>(s.rows() * s.heads), kDecodeThreads, 0, stream>>>(s, qkv, k_cache, v_cache, y);
  DPT_CUDA_CHECK_LAUNCH();
}

}  // namespace

void attention_decode(const DecodeShape& s, const float* qkv, float* k_cache, float* v_cache, float* y,
                      cudaStream_t stream) {
  decode_launch("attention_decode", s, qkv, k_cache, v_cache, y, stream);
}
void attention_decode_bf16(const DecodeShape& s, const uint16_t* qkv, uint16_t* k_cache, uint16_t* v_cache, uint16_t* y,
                           cudaStream_t stream) {
  decode_launch("attention_decode_bf16", s, qkv, k_cache, v_cache, y, stream);
}

}  // namespace dpt::cuda
