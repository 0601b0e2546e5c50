// elementwise.cu — fill, copy, axpy, the sum of squares (gradient norms), fp32 <-> bf16 casts,
// row argmax, the Philox random fills and synthetic tokens; twins of kernels/cpu elementwise.cpp.
// Also a recorded graph's small memsets as kernels (replace_small_memset_nodes).
//
// Memory-bound loops use float4 where the pointers are aligned, with a scalar tail.
// sum_squares is deterministic: a grid sized by n alone writes one partial per block to
// `work`, then one block adds them in order, in double. The random fills use the same
// philox functions as the CPU, element by element, so uniform streams agree bit for bit
// and normal ones up to the last bits of logf/sinf/cosf.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "../philox.hpp"
#include "check.hpp"
#include "common.cuh"
#include "cuda.hpp"
#include "loops.cuh"

namespace dpt::cuda {
namespace {

// ---- fill, axpy -------------------------------------------------------------------------

// The float4 part covers [0, 4 * (n / 4)) when Vec; the rest is scalar (vec4_loop).
template <bool Vec>
static __global__ void fill_kernel(float* x, int64_t n, float value) {
  DPT_WAIT_PREVIOUS_GRID();
  const float4 v = make_float4(value, value, value, value);
  vec4_loop<Vec>(
      n, [&](int64_t q) { store_four(x + 4 * q, v); }, [&](int64_t i) { x[i] = value; });
}

template <bool Vec>
static __global__ void axpy_kernel(int64_t n, float alpha, const float* x, float* y) {
  vec4_loop<Vec>(
      n,
      [&](int64_t q) {
        const float4 a = load_four(x + 4 * q);
        float4 b = load_four(y + 4 * q);
        b.x += alpha * a.x;
        b.y += alpha * a.y;
        b.z += alpha * a.z;
        b.w += alpha * a.w;
        store_four(y + 4 * q, b);
      },
      [&](int64_t i) { y[i] += alpha * x[i]; });
}

// ---- copy -----------------------------------------------------------------------------

// Copies within one device by the SMs: cudaMemcpyAsync device to device costs the host an
// ioctl (a driver RPC) a call on this driver, several times a kernel launch, and a step
// that copies its inputs (a CUDA graph's) pays it every step. Up to kMaxCopyPieces pieces
// in one launch; each piece in 16-byte chunks where both its ends allow, its tail bytewise.
static __global__ void copy_kernel(CopyPieces c) {
  DPT_WAIT_PREVIOUS_GRID();
  for (int k = 0; k < c.count; ++k) {
    unsigned char* dst = static_cast<unsigned char*>(c.piece[k].dst);
    const unsigned char* src = static_cast<const unsigned char*>(c.piece[k].src);
    const int64_t bytes = c.piece[k].bytes;
    int64_t done = 0;
    if (aligned16(dst) && aligned16(src)) {
      // Four loads in flight a thread before its stores (a step's inputs, 32 MB in the mlp
      // model, are copied beside its update: docs/performance-log.md).
      const int4* s4 = reinterpret_cast<const int4*>(src);
      int4* d4 = reinterpret_cast<int4*>(dst);
      four_in_flight(
          bytes / 16, [&](int64_t i) { return s4[i]; }, [&](int4 v, int64_t i) { d4[i] = v; });
      done = bytes / 16 * 16;
    }
    for (int64_t i = done + global_tid(); i < bytes; i += grid_stride()) dst[i] = src[i];
  }
}

// ---- sum_squares ------------------------------------------------------------------------

template <bool Vec>
static __global__ void sum_squares_partial_kernel(const float* x, int64_t n, float* part) {
  float s = 0.f;
  vec4_loop<Vec>(
      n,
      [&](int64_t q) {
        const float4 a = load_four(x + 4 * q);
        s += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w;
      },
      [&](int64_t i) { s += x[i] * x[i]; });
  s = block_sum(s);
  if (threadIdx.x == 0) part[blockIdx.x] = s;
}

static __global__ void finish_sum_kernel(const float* part, int64_t count, float* out) {
  double s = 0;
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) s += part[i];
  s = block_sum(s);
  if (threadIdx.x == 0) *out = static_cast<float>(s);
}

// ---- casts ------------------------------------------------------------------------------

// y = x, or y += x with Add; From and To each float or bf16, read as floats and each store
// rounded once (round to nearest even; a NaN stays a quiet NaN, the sign and top payload
// bits kept: the functions of bf16.hpp, which the CPU twin uses too). Vec: 4 elements a
// step (a float4, or 8 bytes of bf16).
template <typename From, typename To, bool Add, bool Vec>
static __global__ void convert_kernel(const From* x, To* y, int64_t n) {
  vec4_loop<Vec>(
      n,
      [&](int64_t q) {
        float4 a = load_four(x + 4 * q);
        if constexpr (Add) {
          const float4 b = load_four(y + 4 * q);
          a = make_float4(b.x + a.x, b.y + a.y, b.z + a.z, b.w + a.w);
        }
        store_four(y + 4 * q, a);
      },
      [&](int64_t i) { store(y + i, Add ? as_float(y[i]) + as_float(x[i]) : as_float(x[i])); });
}

// ---- argmax_rows ------------------------------------------------------------------------

// One warp per row. The CPU scans left to right keeping the first strict maximum, starting
// from element 0; so NaNs never win, except a NaN at element 0, which nothing beats. Each
// lane keeps the first maximum of its columns (NaNs skipped), and the warp merges by
// (larger value, then smaller index), which is the same answer in any merge order.
static __global__ void argmax_rows_kernel(const float* x, int64_t rows, int64_t cols, int32_t* out) {
  on_warp_row(x, rows, cols, [&](int64_t r, int lane, const float* row) {
    float best = -INFINITY;
    int idx = -1;  // none yet; cols fits int (checked by the launcher)
    for (int c = lane; c < cols; c += 32) {
      const float v = row[c];
      if (v > best || (idx < 0 && v == best)) {  // the second term admits a leading -inf
        best = v;
        idx = c;
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, best, o);
      const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
      if (oi >= 0 && (idx < 0 || ov > best || (ov == best && oi < idx))) {
        best = ov;
        idx = oi;
      }
    }
    if (lane == 0) out[r] = isnan(row[0]) || idx < 0 ? 0 : idx;
  });
}

// ---- random fills -----------------------------------------------------------------------

// Element c of row r is value (sample of row r) * width + c of the stream: the rows of a
// RowMap get the values their samples have in a contiguous fill (normal). The product is
// rounded before the add (no fused multiply-add), as on the CPU. A block a row at a time:
// no division per element.
template <bool Add>
static __global__ void normal_rows_kernel(float* out, int64_t rows, int64_t width, uint64_t seed, uint64_t stream_id,
                                          RowMap map, float std) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const auto base = static_cast<uint64_t>(row_sample(map, r) * width);
    float* o = out + r * width;
    for (int64_t c = threadIdx.x; c < width; c += blockDim.x) {
      const float v = __fmul_rn(std, philox::normal(seed, stream_id, base + static_cast<uint64_t>(c)));
      o[c] = Add ? o[c] + v : v;
    }
  }
}

// The same when rows are whole Philox blocks (width a multiple of 4, rows 16-byte
// aligned): a thread makes four values from one block and stores them as a float4.
template <bool Add>
static __global__ void normal_rows4_kernel(float* out, int64_t rows, int64_t width, uint64_t seed, uint64_t stream_id,
                                           RowMap map, float std) {
  const int64_t quads = width / 4;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const auto first_block = static_cast<uint64_t>(row_sample(map, r) * quads);
    float4* o = reinterpret_cast<float4*>(out + r * width);
    for (int64_t q = threadIdx.x; q < quads; q += blockDim.x) {
      float v[4];
      philox::normal4(seed, stream_id, first_block + static_cast<uint64_t>(q), v);
      float4 w = Add ? o[q] : make_float4(0.f, 0.f, 0.f, 0.f);
      w.x = Add ? w.x + __fmul_rn(std, v[0]) : __fmul_rn(std, v[0]);
      w.y = Add ? w.y + __fmul_rn(std, v[1]) : __fmul_rn(std, v[1]);
      w.z = Add ? w.z + __fmul_rn(std, v[2]) : __fmul_rn(std, v[2]);
      w.w = Add ? w.w + __fmul_rn(std, v[3]) : __fmul_rn(std, v[3]);
      o[q] = w;
    }
  }
}

static __global__ void normal_kernel(float* out, int64_t n, uint64_t seed, uint64_t stream_id, uint64_t offset,
                                     float std) {
  for (int64_t i = global_tid(); i < n; i += grid_stride())
    out[i] = std * philox::normal(seed, stream_id, offset + static_cast<uint64_t>(i));
}

// philox::uniform pins its rounding on the device, so both streams agree bit for bit.
static __global__ void uniform_kernel(float* out, int64_t n, uint64_t seed, uint64_t stream_id, uint64_t offset,
                                      float lo, float hi) {
  for (int64_t i = global_tid(); i < n; i += grid_stride())
    out[i] = philox::uniform(seed, stream_id, offset + static_cast<uint64_t>(i), lo, hi);
}

// The launchers' checks of a size and its pointers (`pointers_set`, all not null): false
// when there are no elements, so nothing to launch.
bool has_work(const char* who, int64_t n, bool pointers_set) {
  DPT_CHECK(n >= 0, std::string(who) + ": negative size");
  if (n == 0) return false;
  DPT_CHECK(pointers_set, std::string(who) + ": null pointer");
  return true;
}

template <typename From, typename To, bool Add>
void convert(const char* who, const From* x, To* y, int64_t n, cudaStream_t stream) {
  if (!has_work(who, n, x != nullptr && y != nullptr)) return;
  if (aligned(x, 4 * sizeof(From)) && aligned(y, 4 * sizeof(To)))
    convert_kernel<From, To, Add, true><<<blocks_for(n / 4), kThreads, 0, stream>>>(x, y, n);
  else convert_kernel<From, To, Add, false><<<blocks_for(n), kThreads, 0, stream>>>(x, y, n);
  DPT_CUDA_CHECK_LAUNCH();
}

}  // namespace

void fill(float* x, int64_t n, float value, cudaStream_t stream) {
  if (!has_work("fill", n, x != nullptr)) return;
  if (aligned16(x)) launch_after_previous(fill_kernel<true>, blocks_for(n / 4), kThreads, stream, x, n, value);
  else launch_after_previous(fill_kernel<false>, blocks_for(n), kThreads, stream, x, n, value);
}

void copy_device(const CopyPieces& pieces, cudaStream_t stream) {
  DPT_CHECK(pieces.count >= 0 && pieces.count <= kMaxCopyPieces, "copy_device: too many pieces");
  int64_t largest = 0;
  bool vectors = true;  // every piece in 16-byte chunks, four a thread a round
  for (int k = 0; k < pieces.count; ++k) {
    const CopyPiece& p = pieces.piece[k];
    DPT_CHECK(p.bytes >= 0 && (p.bytes == 0 || (p.dst != nullptr && p.src != nullptr)), "copy_device: a bad piece");
    largest = std::max(largest, p.bytes);
    vectors = vectors && aligned16(p.dst) && aligned16(p.src);
  }
  if (largest == 0) return;
  launch_after_previous(copy_kernel, blocks_for(largest / (vectors ? 64 : 16) + 1), kThreads, stream, pieces);
}

namespace {
// Whether two copies write the same bytes (and, with `sources`, read the same).
bool same_copy(const CopyPieces& a, const CopyPieces& b, bool sources) {
  if (a.count != b.count) return false;
  for (int k = 0; k < a.count; ++k)
    if (a.piece[k].dst != b.piece[k].dst || a.piece[k].bytes != b.piece[k].bytes ||
        (sources && a.piece[k].src != b.piece[k].src))
      return false;
  return true;
}
}  // namespace

void* recorded_copy_node(const CopyPieces& pieces, cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaGraphNode_t* last = nullptr;
  size_t count = 0;
  DPT_CUDA_CHECK(cudaStreamGetCaptureInfo(stream, &status, nullptr, nullptr, &last, nullptr, &count));
  cudaGraphNodeType type = cudaGraphNodeTypeEmpty;
  if (status == cudaStreamCaptureStatusActive && count == 1) DPT_CUDA_CHECK(cudaGraphNodeGetType(last[0], &type));
  cudaKernelNodeParams p{};
  if (type == cudaGraphNodeTypeKernel) DPT_CUDA_CHECK(cudaGraphKernelNodeGetParams(last[0], &p));
  DPT_CHECK(p.kernelParams && same_copy(*static_cast<const CopyPieces*>(p.kernelParams[0]), pieces, true),
            "recorded_copy_node: the last work recorded on the stream is not this copy");
  return last[0];
}

void set_copy_node_sources(void* exec, void* node, const CopyPieces& pieces) {
  cudaKernelNodeParams p{};
  DPT_CUDA_CHECK(cudaGraphKernelNodeGetParams(static_cast<cudaGraphNode_t>(node), &p));
  DPT_CHECK(same_copy(*static_cast<const CopyPieces*>(p.kernelParams[0]), pieces, false),
            "set_copy_node_sources: the destinations or sizes differ from the recorded copy's");
  CopyPieces now = pieces;
  void* args[] = {&now};
  p.kernelParams = args;
  p.extra = nullptr;
  DPT_CUDA_CHECK(
      cudaGraphExecKernelNodeSetParams(static_cast<cudaGraphExec_t>(exec), static_cast<cudaGraphNode_t>(node), &p));
}

void set_copy_node_enabled(void* exec, void* node, bool enabled) {
  DPT_CUDA_CHECK(cudaGraphNodeSetEnabled(static_cast<cudaGraphExec_t>(exec), static_cast<cudaGraphNode_t>(node),
                                         enabled ? 1u : 0u));
}

namespace {
// A memset node's work (cudaMemsetParams: height rows of width elements of 1, 2 or 4
// bytes, pitch bytes apart), one block.
__global__ void memset_node_kernel(cudaMemsetParams m) {
  const size_t count = m.width * m.height;
  for (size_t i = threadIdx.x; i < count; i += blockDim.x) {
    unsigned char* p = static_cast<unsigned char*>(m.dst) + (i / m.width) * m.pitch + (i % m.width) * m.elementSize;
    if (m.elementSize == 1) *p = static_cast<unsigned char>(m.value);
    else if (m.elementSize == 2) *reinterpret_cast<uint16_t*>(p) = static_cast<uint16_t>(m.value);
    else *reinterpret_cast<uint32_t*>(p) = m.value;
  }
}

// The memsets replace_small_memset_nodes makes kernels of: one block's work.
constexpr size_t kSmallMemsetBytes = 4096;

// A node's dependencies (incoming) or dependents (outgoing).
std::vector<cudaGraphNode_t> graph_edges(cudaGraphNode_t node, bool incoming) {
  auto get = [&](cudaGraphNode_t* nodes, size_t* n) {
#if CUDART_VERSION >= 13000
    return incoming ? cudaGraphNodeGetDependencies(node, nodes, nullptr, n)
                    : cudaGraphNodeGetDependentNodes(node, nodes, nullptr, n);
#else
    return incoming ? cudaGraphNodeGetDependencies(node, nodes, n) : cudaGraphNodeGetDependentNodes(node, nodes, n);
#endif
  };
  size_t n = 0;
  DPT_CUDA_CHECK(get(nullptr, &n));
  std::vector<cudaGraphNode_t> nodes(n);
  if (n > 0) DPT_CUDA_CHECK(get(nodes.data(), &n));
  return nodes;
}
}  // namespace

int replace_small_memset_nodes(void* graph) {
  const auto g = static_cast<cudaGraph_t>(graph);
  size_t n = 0;
  DPT_CUDA_CHECK(cudaGraphGetNodes(g, nullptr, &n));
  std::vector<cudaGraphNode_t> nodes(n);
  if (n > 0) DPT_CUDA_CHECK(cudaGraphGetNodes(g, nodes.data(), &n));
  int replaced = 0, device = 0;
  DPT_CUDA_CHECK(cudaGetDevice(&device));
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType type = cudaGraphNodeTypeEmpty;
    DPT_CUDA_CHECK(cudaGraphNodeGetType(node, &type));
    if (type != cudaGraphNodeTypeMemset) continue;
    cudaMemsetParams m{};
    DPT_CUDA_CHECK(cudaGraphMemsetNodeGetParams(node, &m));
    if (m.width * m.height * m.elementSize > kSmallMemsetBytes) continue;
    // The kernel runs on the device current when its node is added: the memory's (a graph
    // may record the streams of several GPUs). Memory whose device is not known stays a
    // memset.
    cudaPointerAttributes where{};
    if (cudaPointerGetAttributes(&where, m.dst) != cudaSuccess) {
      (void)cudaGetLastError();
      continue;
    }
    if (where.type != cudaMemoryTypeDevice) continue;
    set_device(where.device);
    const std::vector<cudaGraphNode_t> before = graph_edges(node, true), after = graph_edges(node, false);
    void* args[] = {&m};
    cudaKernelNodeParams k{};
    k.func = reinterpret_cast<void*>(memset_node_kernel);
    k.gridDim = dim3(1);
    k.blockDim = dim3(256);
    k.kernelParams = args;
    cudaGraphNode_t fill = nullptr;
    DPT_CUDA_CHECK(cudaGraphAddKernelNode(&fill, g, before.data(), before.size(), &k));
    for (cudaGraphNode_t next : after) {
#if CUDART_VERSION >= 13000
      DPT_CUDA_CHECK(cudaGraphAddDependencies(g, &fill, &next, nullptr, 1));
#else
      DPT_CUDA_CHECK(cudaGraphAddDependencies(g, &fill, &next, 1));
#endif
    }
    DPT_CUDA_CHECK(cudaGraphDestroyNode(node));  // and its edges
    ++replaced;
  }
  set_device(device);
  return replaced;
}

void axpy(int64_t n, float alpha, const float* x, float* y, cudaStream_t stream) {
  if (!has_work("axpy", n, x != nullptr && y != nullptr)) return;
  if (aligned16(x) && aligned16(y)) axpy_kernel<true><<<blocks_for(n / 4), kThreads, 0, stream>>>(n, alpha, x, y);
  else axpy_kernel<false><<<blocks_for(n), kThreads, 0, stream>>>(n, alpha, x, y);
  DPT_CUDA_CHECK_LAUNCH();
}

void sum_squares(const float* x, int64_t n, float* out, float* work, cudaStream_t stream) {
  DPT_CHECK(n >= 0, "sum_squares: negative size");
  DPT_CHECK(out != nullptr && work != nullptr && (n == 0 || x != nullptr), "sum_squares: null pointer");
  if (n == 0) {  // the empty sum: finish with no partials writes 0
    finish_sum_kernel<<<1, kFinishThreads, 0, stream>>>(work, 0, out);
    DPT_CUDA_CHECK_LAUNCH();
    return;
  }
  const unsigned blocks = reduce_blocks(n, 16);  // about 16 elements a thread
  if (aligned16(x)) sum_squares_partial_kernel<true><<<blocks, kThreads, 0, stream>>>(x, n, work);
  else sum_squares_partial_kernel<false><<<blocks, kThreads, 0, stream>>>(x, n, work);
  DPT_CUDA_CHECK_LAUNCH();
  finish_sum_kernel<<<1, kFinishThreads, 0, stream>>>(work, blocks, out);
  DPT_CUDA_CHECK_LAUNCH();
}

void cast_f32_bf16(const float* x, uint16_t* y, int64_t n, cudaStream_t stream) {
  convert<float, uint16_t, false>("cast_f32_bf16", x, y, n, stream);
}

void add_bf16(const uint16_t* x, float* y, int64_t n, cudaStream_t stream) {
  convert<uint16_t, float, true>("add_bf16", x, y, n, stream);
}

void cast_bf16_f32(const uint16_t* x, float* y, int64_t n, cudaStream_t stream) {
  convert<uint16_t, float, false>("cast_bf16_f32", x, y, n, stream);
}

void argmax_rows(const float* x, int64_t rows, int64_t cols, int32_t* out, cudaStream_t stream) {
  DPT_CHECK(rows >= 0 && cols >= 0, "argmax_rows: negative shape");
  if (rows == 0) return;
  DPT_CHECK(cols > 0, "argmax_rows: rows with no columns");
  DPT_CHECK(cols <= 0x7fffffff, "argmax_rows: column index does not fit int32");
  DPT_CHECK(x != nullptr && out != nullptr, "argmax_rows: null pointer");
  argmax_rows_kernel<<<warp_row_blocks("argmax_rows", rows), kThreads, 0, stream>>>(x, rows, cols, out);
  DPT_CUDA_CHECK_LAUNCH();
}

void normal_rows(float* out, int64_t rows, int64_t width, uint64_t seed, uint64_t stream_id, const RowMap& map,
                 float std, bool add, cudaStream_t stream) {
  DPT_CHECK(rows >= 0 && width > 0 && map.per_group > 0, "normal_rows: bad shape");
  if (rows == 0) return;
  DPT_CHECK(out != nullptr, "normal_rows: null pointer");
  const auto blocks = static_cast<unsigned>(rows < kMaxBlocks ? rows : kMaxBlocks);
  if (width % 4 == 0 && aligned16(out)) {
    if (add) normal_rows4_kernel<true><<<blocks, kThreads, 0, stream>>>(out, rows, width, seed, stream_id, map, std);
    else normal_rows4_kernel<false><<<blocks, kThreads, 0, stream>>>(out, rows, width, seed, stream_id, map, std);
  } else if (add) {
    normal_rows_kernel<true><<<blocks, kThreads, 0, stream>>>(out, rows, width, seed, stream_id, map, std);
  } else {
    normal_rows_kernel<false><<<blocks, kThreads, 0, stream>>>(out, rows, width, seed, stream_id, map, std);
  }
  DPT_CUDA_CHECK_LAUNCH();
}

void normal(float* out, int64_t n, uint64_t seed, uint64_t stream_id, uint64_t offset, float std, cudaStream_t stream) {
  if (!has_work("normal", n, out != nullptr)) return;
  normal_kernel<<<blocks_for(n), kThreads, 0, stream>>>(out, n, seed, stream_id, offset, std);
  DPT_CUDA_CHECK_LAUNCH();
}

void uniform(float* out, int64_t n, uint64_t seed, uint64_t stream_id, uint64_t offset, float lo, float hi,
             cudaStream_t stream) {
  if (!has_work("uniform", n, out != nullptr)) return;
  uniform_kernel<<<blocks_for(n), kThreads, 0, stream>>>(out, n, seed, stream_id, offset, lo, hi);
  DPT_CUDA_CHECK_LAUNCH();
}

// ---- synthetic tokens ---------------------------------------------------------------------

namespace {
// A block a row at a time (no division per element); each thread makes a token of the
// row's seq + 1 and stores it as an input, a target (the token before's next), or both.
__global__ void random_tokens_kernel(int32_t* x, int32_t* y, int64_t rows, int64_t seq, int64_t vocab, uint64_t seed,
                                     uint64_t stream_id, RowMap map) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const auto base = static_cast<uint64_t>(row_sample(map, r) * seq);
    for (int64_t t = threadIdx.x; t <= seq; t += blockDim.x) {
      const int32_t token = philox::uniform_token(seed, stream_id, base + static_cast<uint64_t>(t), vocab);
      if (t < seq) x[r * seq + t] = token;
      if (t > 0) y[r * seq + t - 1] = token;
    }
  }
}
}  // namespace

void random_tokens(int32_t* x, int32_t* y, int64_t rows, int64_t seq, int64_t vocab, uint64_t seed, uint64_t stream_id,
                   const RowMap& map, cudaStream_t stream) {
  DPT_CHECK(rows >= 0 && seq > 0 && vocab > 0 && map.per_group > 0, "random_tokens: bad shape");
  if (rows == 0) return;
  DPT_CHECK(x != nullptr && y != nullptr, "random_tokens: null pointer");
  const auto blocks = static_cast<unsigned>(rows < kMaxBlocks ? rows : kMaxBlocks);
  random_tokens_kernel<<<blocks, kThreads, 0, stream>>>(x, y, rows, seq, vocab, seed, stream_id, map);
  DPT_CUDA_CHECK_LAUNCH();
}

}  // namespace dpt::cuda
