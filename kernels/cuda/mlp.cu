// mlp.cu — a run of narrow Linear layers at a small batch in one kernel (mlp.hpp).
//
// The default job (16-128x2-4, batch 256) ran its forward as a kernel a layer, each a
// few microseconds of mostly waiting: for its first loads, for the layer before, for
// the tail of its blocks. Here each block takes kMlpRows rows of the batch through every
// layer: it loads every layer's weights into shared memory at once (all loads in flight
// together), then computes layer after layer from its rows' activations in shared memory,
// writing each layer's output (and GELU's pre-activation) for backward as it goes. Rows
// are independent, so no block waits for another.
//
// Strict fp32 FFMA, each output the sum over k in order, then the bias, then the
// activation (act_forward): the CPU twin (cpu::mlp_forward: the per-layer GEMM and
// bias_act_forward) is its oracle within rounding.
#include <array>
#include <atomic>

#include "../mlp.hpp"
#include "check.hpp"
#include "common.cuh"
#include "cuda.hpp"

namespace dpt::cuda {
namespace {

constexpr int kMlpThreads = 256;
constexpr int kMlpRows = kMlpBlockRows;  // a block's rows of the batch (the default job's 256: 32 blocks)
constexpr int kLoadBatch = 16;           // weight loads a thread has in flight
// Activations: two buffers of kMlpRows rows (a layer reads one, writes the other), rows
// padded to a multiple of 4 floats (float4 reads) that spreads rows over the banks.
constexpr int kActPitch = kMlpMaxWidth + 4;

// A weight matrix's row pitch in shared memory: in rounded up to 4, plus 4 (float4 reads
// by consecutive columns fall in distinct banks); the padding holds zeros.
__host__ __device__ inline int weight_pitch(int in) { return (in + 3) / 4 * 4 + 4; }

// One layer for the block's rows: from the activations `a` into `next` (and the layer's
// outputs). R > 1: width = 32 R columns, a thread owns column j of rows g, g + G, ...
// (G = 8 / R groups of rows). R == 1: width <= 32 columns, and each output (r, j) has
// 32 / width consecutive lanes of a warp, which take every (32 / width)-th group of 4 k and
// add their sums by shuffles (in the same order every run). Each sum runs in two halves
// (even and odd k) for a shorter dependency chain, added at the end, then the bias and the
// activation.
template <int R>
__device__ __forceinline__ void mlp_layer(const MlpLayer& L, const float* w, int pitch, int width, const float* a,
                                          float* next, int64_t row0, int here) {
  const int t = threadIdx.x;
  const int split = R == 1 ? 32 / width : 1;  // threads an output
  const int s = t % split, o = t / split;
  const int j = o % width, g = o / width;
  const int groups = kMlpRows / R;
  const bool active = j < L.out && g < groups;
  float lo[R], hi[R];
#pragma unroll
  for (int i = 0; i < R; ++i) lo[i] = hi[i] = 0.f;
  if (active) {
    const float* wj = w + j * pitch;
    for (int k = 4 * s; k < L.in; k += 4 * split) {
      const float4 wv = *reinterpret_cast<const float4*>(wj + k);
#pragma unroll
      for (int i = 0; i < R; ++i) {
        const float4 av = *reinterpret_cast<const float4*>(a + (g + i * groups) * kActPitch + k);
        lo[i] = fmaf(av.x, wv.x, lo[i]);
        hi[i] = fmaf(av.y, wv.y, hi[i]);
        lo[i] = fmaf(av.z, wv.z, lo[i]);
        hi[i] = fmaf(av.w, wv.w, hi[i]);
      }
    }
  }
  if (R == 1)  // every lane takes part (a whole warp's shuffle); inactive ones add zeros
    for (int m = split / 2; m >= 1; m /= 2) {
      lo[0] += __shfl_xor_sync(0xffffffffu, lo[0], m);
      hi[0] += __shfl_xor_sync(0xffffffffu, hi[0], m);
    }
  if (!active || s != 0) return;
  const float bias = L.b ? L.b[j] : 0.f;
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int r = g + i * groups;
    const float v = lo[i] + hi[i] + bias;
    const float y = act_forward(L.act, v);
    next[r * kActPitch + j] = y;
    if (r < here) {
      L.y[(row0 + r) * L.out + j] = y;
      if (L.z) L.z[(row0 + r) * L.out + j] = v;
    }
  }
}

// Every layer's weights into shared memory (row j of layer l at its offset, pitch
// weight_pitch(in)), the rows' padding zeroed: kLoadBatch loads a thread in flight at once
// (read-only loads, which the compiler may issue before the shared stores), float4s where
// rows allow. The caller synchronizes the block after.
__device__ void load_weights(const MlpLayers& layers, float* weights) {
  const int t = threadIdx.x;
  for (int l = 0, off = 0; l < layers.count; ++l) {
    const MlpLayer& L = layers.layer[l];
    const int pitch = weight_pitch(L.in), pad = pitch - L.in;
    for (int e = t; e < L.out * pad; e += kMlpThreads) weights[off + (e / pad) * pitch + L.in + e % pad] = 0.f;
    off += L.out * pitch;
  }
  for (int l = 0, off = 0; l < layers.count; ++l) {
    const MlpLayer& L = layers.layer[l];
    const int pitch = weight_pitch(L.in);
    if (L.in % 4 == 0 && aligned16(L.W)) {
      const int n4 = L.out * L.in / 4;
      const float4* W4 = reinterpret_cast<const float4*>(L.W);
      for (int base = t; base < n4; base += kMlpThreads * kLoadBatch) {
        float4 v[kLoadBatch];
#pragma unroll
        for (int u = 0; u < kLoadBatch; ++u) {
          const int e = base + u * kMlpThreads;
          v[u] = e < n4 ? __ldg(W4 + e) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int u = 0; u < kLoadBatch; ++u) {
          const int e = (base + u * kMlpThreads) * 4;
          if (e >= L.out * L.in) break;
          const int j = e / L.in;
          *reinterpret_cast<float4*>(weights + off + j * pitch + (e - j * L.in)) = v[u];
        }
      }
    } else {
      const int n = L.out * L.in;
      for (int base = t; base < n; base += kMlpThreads * kLoadBatch) {
        float v[kLoadBatch];
#pragma unroll
        for (int u = 0; u < kLoadBatch; ++u) {
          const int e = base + u * kMlpThreads;
          v[u] = e < n ? __ldg(L.W + e) : 0.f;
        }
#pragma unroll
        for (int u = 0; u < kLoadBatch; ++u) {
          const int e = base + u * kMlpThreads;
          if (e >= n) break;
          const int j = e / L.in;
          weights[off + j * pitch + (e - j * L.in)] = v[u];
        }
      }
    }
    off += L.out * pitch;
  }
}

// The start both kernels share: dynamic shared memory as `planes` planes of kMlpRows x
// kActPitch floats, zeroed (the activations' padding reads as zeros: it meets zero
// weights, but garbage could be a NaN), then the weights after them (load_weights); the
// block's first row of the batch and how many it has (fewer in the last block). The block
// is synchronized on return: the zeros and the weights are in place before the rows.
struct MlpBlock {
  float* planes;
  float* weights;
  int64_t row0;
  int here;
};
__device__ __forceinline__ MlpBlock mlp_block_start(int64_t rows, const MlpLayers& layers, int planes) {
  extern __shared__ float4 smem4[];
  float* smem = reinterpret_cast<float*>(smem4);
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kMlpRows;
  const int here = static_cast<int>(rows - row0 < kMlpRows ? rows - row0 : kMlpRows);
  for (int e = threadIdx.x; e < planes * kMlpRows * kActPitch; e += kMlpThreads) smem[e] = 0.f;
  float* weights = smem + planes * kMlpRows * kActPitch;
  load_weights(layers, weights);
  __syncthreads();
  return {smem, weights, row0, here};
}

__global__ void __launch_bounds__(kMlpThreads)
    mlp_forward_kernel(int64_t rows, const float* __restrict__ x, MlpLayers layers) {
  DPT_WAIT_PREVIOUS_GRID();  // the weights were written by the last step's update
  const auto [planes, weights, row0, here] = mlp_block_start(rows, layers, 2);
  float* act[2] = {planes, planes + kMlpRows * kActPitch};
  const int t = threadIdx.x;
  const int in0 = layers.layer[0].in;
  for (int e = t; e < here * in0; e += kMlpThreads) {
    const int r = e / in0;
    act[0][r * kActPitch + (e - r * in0)] = x[(row0 + r) * in0 + (e - r * in0)];
  }
  __syncthreads();
  int cur = 0;
  for (int l = 0, off = 0; l < layers.count; ++l) {
    const MlpLayer& L = layers.layer[l];
    // Threads in `width` columns (a power of two >= out): at 64 and more, groups of rows,
    // a thread owning column j of R rows; narrower, every output gets 32 / width threads
    // that split k between them.
    int width = 1;
    while (width < L.out) width *= 2;
    const float* w = weights + off;
    const int pitch = weight_pitch(L.in);
    // The output's padding to a multiple of 4 columns reads as zeros in the next layer,
    // not as what a wider layer left there.
    if (const int tail = (L.out + 3) / 4 * 4 - L.out; t < kMlpRows * tail)
      act[cur ^ 1][(t / tail) * kActPitch + L.out + t % tail] = 0.f;
    if (width >= 256) mlp_layer<8>(L, w, pitch, width, act[cur], act[cur ^ 1], row0, here);
    else if (width == 128) mlp_layer<4>(L, w, pitch, width, act[cur], act[cur ^ 1], row0, here);
    else if (width == 64) mlp_layer<2>(L, w, pitch, width, act[cur], act[cur ^ 1], row0, here);
    else mlp_layer<1>(L, w, pitch, width, act[cur], act[cur ^ 1], row0, here);
    __syncthreads();
    cur ^= 1;
    off += L.out * pitch;
  }
}

// One layer's input gradient for the block's rows: dH[r][k] = sum_j D[r][j] W[j][k] (D the
// layer's output gradient, times its activation's derivative), then for a layer before it
// dH act'(saved) into `next` (saved: its output, which is this layer's input `xs`, or
// GELU's pre-activation z_prev), or for the first layer dH itself into dx. mlp_layer's
// mapping with k in the place of j: R rows a thread in columns of width >= in, or 32 /
// width lanes that split j.
template <int R>
__device__ __forceinline__ void mlp_input_grad(const float* w, int pitch, int out, int in, int width, const float* D,
                                               float* next, const float* xs, const float* z_prev, Act act_prev,
                                               float* dx, int64_t row0, int here) {
  const int t = threadIdx.x;
  const int split = R == 1 ? 32 / width : 1;
  const int s = t % split, o = t / split;
  const int k = o % width, g = o / width;
  const int groups = kMlpRows / R;
  const bool active = k < in && g < groups;
  float lo[R], hi[R];
#pragma unroll
  for (int i = 0; i < R; ++i) lo[i] = hi[i] = 0.f;
  if (active) {
    for (int j = 4 * s; j < out; j += 4 * split) {
      const float w0 = w[j * pitch + k];
      const float w1 = j + 1 < out ? w[(j + 1) * pitch + k] : 0.f;
      const float w2 = j + 2 < out ? w[(j + 2) * pitch + k] : 0.f;
      const float w3 = j + 3 < out ? w[(j + 3) * pitch + k] : 0.f;
#pragma unroll
      for (int i = 0; i < R; ++i) {
        const float4 dv = *reinterpret_cast<const float4*>(D + (g + i * groups) * kActPitch + j);
        lo[i] = fmaf(dv.x, w0, lo[i]);
        hi[i] = fmaf(dv.y, w1, hi[i]);
        lo[i] = fmaf(dv.z, w2, lo[i]);
        hi[i] = fmaf(dv.w, w3, hi[i]);
      }
    }
  }
  if (R == 1)  // every lane takes part; inactive ones add zeros
    for (int m = split / 2; m >= 1; m /= 2) {
      lo[0] += __shfl_xor_sync(0xffffffffu, lo[0], m);
      hi[0] += __shfl_xor_sync(0xffffffffu, hi[0], m);
    }
  if (!active || s != 0) return;
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int r = g + i * groups;
    const float v = lo[i] + hi[i];
    if (dx) {
      if (r < here) dx[(row0 + r) * in + k] = v;
    } else {
      const float saved = z_prev ? (r < here ? z_prev[(row0 + r) * in + k] : 0.f) : xs[r * kActPitch + k];
      next[r * kActPitch + k] = v * act_derivative(act_prev, saved);
    }
  }
}

// Backward of the block's rows, last layer first: the output gradient times the last
// activation's derivative; then for each layer its weight and bias gradients over the
// block's rows (in row order) into the block's part of `work`, and its input's gradient
// (times the layer before's derivative), all from shared memory.
__global__ void __launch_bounds__(kMlpThreads)
    mlp_backward_kernel(int64_t rows, const float* __restrict__ x, const float* __restrict__ dy, float* dx,
                        MlpLayers layers, float* __restrict__ work, int64_t per_block) {
  DPT_WAIT_PREVIOUS_GRID();
  const auto [planes, weights, row0, here] = mlp_block_start(rows, layers, 3);
  float* d[2] = {planes, planes + kMlpRows * kActPitch};
  float* xs = planes + 2 * kMlpRows * kActPitch;
  const int t = threadIdx.x;
  const MlpLayer& last = layers.layer[layers.count - 1];
  for (int e = t; e < here * last.out; e += kMlpThreads) {
    const int r = e / last.out, j = e - r * last.out;
    const int64_t at = (row0 + r) * last.out + j;
    d[0][r * kActPitch + j] = dy[at] * act_derivative(last.act, act_saves_input(last.act) ? last.z[at] : last.y[at]);
  }
  int weight_at[kMlpMaxLayers];
  int64_t part_at[kMlpMaxLayers];
  int64_t po = 0;
  for (int l = 0, wo = 0; l < layers.count; ++l) {
    weight_at[l] = wo;
    part_at[l] = po;
    wo += layers.layer[l].out * weight_pitch(layers.layer[l].in);
    po += mlp_part_of(layers.layer[l]);
  }
  float* part = work + blockIdx.x * per_block;
  int cur = 0;
  for (int l = layers.count - 1; l >= 0; --l) {
    const MlpLayer& L = layers.layer[l];
    const float* X = l == 0 ? x : layers.layer[l - 1].y;
    for (int e = t; e < kMlpRows * L.in; e += kMlpThreads) {
      const int r = e / L.in, k = e - r * L.in;
      xs[r * kActPitch + k] = r < here ? X[(row0 + r) * L.in + k] : 0.f;
    }
    // The next output gradient's padding to 4 columns reads as zeros.
    if (const int tail = (L.in + 3) / 4 * 4 - L.in; t < kMlpRows * tail)
      d[cur ^ 1][(t / tail) * kActPitch + L.in + t % tail] = 0.f;
    __syncthreads();
    const float* D = d[cur];
    for (int e = t; e < L.out * L.in; e += kMlpThreads) {
      const int j = e / L.in, k = e - j * L.in;
      float acc = 0.f;
#pragma unroll
      for (int r = 0; r < kMlpRows; ++r) acc = fmaf(D[r * kActPitch + j], xs[r * kActPitch + k], acc);
      part[part_at[l] + e] = acc;
    }
    for (int j = t; j < L.out; j += kMlpThreads) {
      float acc = 0.f;
#pragma unroll
      for (int r = 0; r < kMlpRows; ++r) acc += D[r * kActPitch + j];
      part[part_at[l] + L.out * L.in + j] = acc;
    }
    if (l > 0 || dx) {
      int width = 1;
      while (width < L.in) width *= 2;
      const float* w = weights + weight_at[l];
      const int pitch = weight_pitch(L.in);
      const Act act_prev = l > 0 ? layers.layer[l - 1].act : Act::none;
      const float* z_prev = act_saves_input(act_prev) ? layers.layer[l - 1].z : nullptr;
      float* into_dx = l == 0 ? dx : nullptr;
      if (width >= 256)
        mlp_input_grad<8>(w, pitch, L.out, L.in, width, D, d[cur ^ 1], xs, z_prev, act_prev, into_dx, row0, here);
      else if (width == 128)
        mlp_input_grad<4>(w, pitch, L.out, L.in, width, D, d[cur ^ 1], xs, z_prev, act_prev, into_dx, row0, here);
      else if (width == 64)
        mlp_input_grad<2>(w, pitch, L.out, L.in, width, D, d[cur ^ 1], xs, z_prev, act_prev, into_dx, row0, here);
      else mlp_input_grad<1>(w, pitch, L.out, L.in, width, D, d[cur ^ 1], xs, z_prev, act_prev, into_dx, row0, here);
    }
    __syncthreads();
    cur ^= 1;
  }
}

// The blocks' parts of layers [first, last) added in block order into their gradients.
__global__ void mlp_grad_sum_kernel(const float* __restrict__ work, int64_t per_block, int blocks, MlpLayers layers,
                                    MlpGrads out, int first, int last) {
  DPT_WAIT_PREVIOUS_GRID();
  int64_t begin = 0, end = 0;
  for (int l = 0, at = 0; l < last; ++l) {
    if (l == first) begin = at;
    at += mlp_part_of(layers.layer[l]);
    end = at;
  }
  for (int64_t e = begin + global_tid(); e < end; e += grid_stride()) {
    int l = first;
    int64_t at = begin;  // where layer l's part starts
    for (int64_t size = mlp_part_of(layers.layer[l]); e >= at + size; size = mlp_part_of(layers.layer[l])) {
      at += size;
      ++l;
    }
    const int64_t i = e - at, weights = static_cast<int64_t>(layers.layer[l].out) * layers.layer[l].in;
    float* into = i < weights ? out.dW[l] : out.db[l];
    if (!into) continue;
    float s = 0.f;
#pragma unroll 8
    for (int b = 0; b < blocks; ++b) s += work[b * per_block + e];
    const int64_t at_i = i < weights ? i : i - weights;
    const float beta = i < weights ? out.beta_W[l] : out.beta_b[l];
    into[at_i] = beta == 0.f ? s : beta * into[at_i] + s;
  }
}

// The shared memory a block may have on `device` (its opt-in maximum), asked once; the
// kernel is allowed all of it there on the first ask (a per-device attribute).
int smem_allowed(int device) {
  constexpr int kDevices = 64;
  static std::array<std::atomic<int>, kDevices> known{};  // 0: not asked yet
  DPT_CHECK(device >= 0 && device < kDevices, "mlp_forward: device index");
  if (const int v = known[static_cast<size_t>(device)].load(); v > 0) return v;
  int optin = 0, current = 0;
  DPT_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  DPT_CUDA_CHECK(cudaGetDevice(&current));
  DPT_CUDA_CHECK(cudaSetDevice(device));
  DPT_CUDA_CHECK(cudaFuncSetAttribute(mlp_forward_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, optin));
  DPT_CUDA_CHECK(cudaFuncSetAttribute(mlp_backward_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, optin));
  DPT_CUDA_CHECK(cudaSetDevice(current));
  known[static_cast<size_t>(device)].store(optin);
  return optin;
}

// A block's shared memory: `buffers` of activations (or gradients) and every layer's weights.
size_t mlp_smem(const MlpLayers& layers, int buffers) {
  size_t floats = static_cast<size_t>(buffers) * kMlpRows * kActPitch;
  for (int l = 0; l < layers.count; ++l)
    floats += static_cast<size_t>(layers.layer[l].out) * static_cast<size_t>(weight_pitch(layers.layer[l].in));
  return floats * sizeof(float);
}

}  // namespace

bool mlp_fits(const MlpLayers& layers, int device) {
  if (layers.count < 1 || layers.count > kMlpMaxLayers) return false;
  for (int l = 0; l < layers.count; ++l) {
    const MlpLayer& L = layers.layer[l];
    if (L.in < 1 || L.out < 1 || L.in > kMlpMaxWidth || L.out > kMlpMaxWidth) return false;
    if (l > 0 && L.in != layers.layer[l - 1].out) return false;
  }
  return mlp_smem(layers, 3) <= static_cast<size_t>(smem_allowed(device));  // backward's three buffers
}

void mlp_forward(int64_t rows, const float* x, const MlpLayers& layers, cudaStream_t stream) {
  DPT_CHECK(rows >= 1 && layers.count >= 1, "mlp_forward: rows and layers");
  const size_t smem = mlp_smem(layers, 2);
  int device = 0;
  DPT_CUDA_CHECK(cudaGetDevice(&device));
  DPT_CHECK(smem <= static_cast<size_t>(smem_allowed(device)), "mlp_forward: the layers do not fit (mlp_fits)");
  launch_after_previous_smem(mlp_forward_kernel, dim3(static_cast<unsigned>(mlp_blocks(rows))), dim3(kMlpThreads), smem,
                             stream, rows, x, layers);
}

void mlp_backward(int64_t rows, const float* x, const float* dy, float* dx, const MlpLayers& layers, float* work,
                  cudaStream_t stream) {
  DPT_CHECK(rows >= 1 && layers.count >= 1, "mlp_backward: rows and layers");
  const size_t smem = mlp_smem(layers, 3);
  int device = 0;
  DPT_CUDA_CHECK(cudaGetDevice(&device));
  DPT_CHECK(smem <= static_cast<size_t>(smem_allowed(device)), "mlp_backward: the layers do not fit (mlp_fits)");
  launch_after_previous_smem(mlp_backward_kernel, dim3(static_cast<unsigned>(mlp_blocks(rows))), dim3(kMlpThreads),
                             smem, stream, rows, x, dy, dx, layers, work, mlp_part_floats(layers));
}

void mlp_grad_sum(int64_t rows, const MlpLayers& layers, const float* work, const MlpGrads& out, int first, int last,
                  cudaStream_t stream) {
  DPT_CHECK(0 <= first && first < last && last <= layers.count, "mlp_grad_sum: a range of layers");
  int64_t n = 0;
  for (int l = first; l < last; ++l) n += mlp_part_of(layers.layer[l]);
  launch_after_previous(mlp_grad_sum_kernel, dim3(blocks_for(n)), dim3(kThreads), stream, work, mlp_part_floats(layers),
                        static_cast<int>(mlp_blocks(rows)), layers, out, first, last);
}

}  // namespace dpt::cuda
