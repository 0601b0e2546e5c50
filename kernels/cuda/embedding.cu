// embedding.cu — the token and position embedding (GPT's wte and wpe); twin of
// kernels/cpu/embedding.cpp.
//
// The forward is a gather. The backward is deterministic without float atomics: a stable
// radix sort (CUB) orders the positions by token, keeping each token's positions in
// increasing order; then for each run of one token and each channel one thread adds dy
// over the run's positions in that order (the CPU twin's order). The position gradient
// is a thread per (position, channel) adding dy over the batch in order.
//
// A token outside [0, vocab) cannot be refused here without a wait for the device (the
// CPU twin throws; the data loader checks tokens before they reach the model): the
// forward skips its wte row (the output row is wpe's alone) and the backward gives it no
// gradient, so no kernel reads or writes outside wte.
#include <cub/device/device_radix_sort.cuh>

#include <climits>
#include <cstdint>
#include <string>

#include "check.hpp"
#include "common.cuh"
#include "cuda.hpp"

namespace dpt::cuda {
namespace {

__device__ __forceinline__ bool token_ok(int32_t token, int64_t vocab) { return token >= 0 && token < vocab; }

template <typename T>
__global__ void embedding_forward_kernel(const int32_t* tokens, int64_t rows, int64_t seq, const float* wte,
                                         int64_t vocab, const float* wpe, int64_t C, T* y) {
  for (int64_t i = global_tid(); i < rows * C; i += grid_stride()) {
    const int64_t n = i / C, c = i - n * C;
    const int32_t token = tokens[n];
    const float e = token_ok(token, vocab) ? wte[token * C + c] : 0.f;
    store(&y[i], e + wpe[(n % seq) * C + c]);
  }
}

// The sort's input: each position's token (vocab for one outside the vocabulary, which
// sorts last and is skipped) and the position itself.
__global__ void embedding_keys_kernel(const int32_t* tokens, int64_t rows, int64_t vocab, int32_t* keys,
                                      int32_t* positions) {
  for (int64_t i = global_tid(); i < rows; i += grid_stride()) {
    keys[i] = token_ok(tokens[i], vocab) ? tokens[i] : static_cast<int32_t>(vocab);
    positions[i] = static_cast<int32_t>(i);
  }
}

// Block (k, column chunk): where sorted entry k starts a run of one token, its threads add
// dy over the run's positions (increasing) for their columns. beta 0 never reads dwte.
template <typename T>
__global__ void embedding_wte_grad_kernel(const int32_t* keys, const int32_t* positions, int64_t rows, const T* dy,
                                          int64_t vocab, int64_t C, float beta, float* dwte) {
  const int64_t k = blockIdx.x, c = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  const int32_t v = keys[k];
  if (c >= C || v >= vocab || (k > 0 && keys[k - 1] == v)) return;
  float s = 0.f;
  for (int64_t j = k; j < rows && keys[j] == v; ++j) s += as_float(dy[positions[j] * C + c]);
  float* g = dwte + v * C + c;
  *g = beta != 0.f ? beta * *g + s : s;
}

// dwpe[t, c] = beta dwpe[t, c] + the sum over b of dy[b * seq + t, c] (t < seq; 0 beyond).
template <typename T>
__global__ void embedding_wpe_grad_kernel(const T* dy, int64_t rows, int64_t seq, int64_t positions, int64_t C,
                                          float beta, float* dwpe) {
  for (int64_t i = global_tid(); i < positions * C; i += grid_stride()) {
    const int64_t t = i / C, c = i - t * C;
    float s = 0.f;
    if (t < seq)
      for (int64_t row = t; row < rows; row += seq) s += as_float(dy[row * C + c]);
    dwpe[i] = beta != 0.f ? beta * dwpe[i] + s : s;
  }
}

// Bits of the sort's keys: enough for 0 .. vocab.
int key_bits(int64_t vocab) {
  int bits = 1;
  while ((int64_t(1) << bits) <= vocab) ++bits;
  return bits;
}

// The work space: keys and positions, sorted and not (4 x rows int32), then CUB's own.
constexpr size_t kAlign = 256;
size_t round_up(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }
size_t sort_bytes(int64_t rows, int64_t vocab) {
  size_t bytes = 0;
  DPT_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const int32_t*>(nullptr),
                                                 static_cast<int32_t*>(nullptr), static_cast<const int32_t*>(nullptr),
                                                 static_cast<int32_t*>(nullptr), static_cast<int>(rows), 0,
                                                 key_bits(vocab)));
  return bytes;
}

void check_shape(int64_t rows, int64_t seq, int64_t vocab, int64_t C, const char* who) {
  DPT_CHECK(rows >= 0 && seq > 0 && rows % seq == 0 && vocab > 0 && C >= 0 && rows <= INT32_MAX && vocab < INT32_MAX &&
                C <= 65535 * int64_t(kThreads),
            std::string(who) + ": bad shape");
}

template <typename T>
void forward(const int32_t* tokens, int64_t rows, int64_t seq, const float* wte, int64_t vocab, const float* wpe,
             int64_t C, T* y, cudaStream_t stream) {
  check_shape(rows, seq, vocab, C, "embedding_forward");
  if (rows == 0 || C == 0) return;
  embedding_forward_kernel<T><<<blocks_for(rows * C), kThreads, 0, stream>>>(tokens, rows, seq, wte, vocab, wpe, C, y);
  DPT_CUDA_CHECK_LAUNCH();
}

template <typename T>
void backward(const int32_t* tokens, int64_t rows, int64_t seq, const T* dy, int64_t vocab, int64_t positions,
              int64_t C, float beta_wte, float* dwte, float beta_wpe, float* dwpe, void* work, cudaStream_t stream) {
  check_shape(rows, seq, vocab, C, "embedding_backward");
  if (C == 0) return;
  if (dwpe && positions > 0) {
    embedding_wpe_grad_kernel<T>
        <<<blocks_for(positions * C), kThreads, 0, stream>>>(dy, rows, seq, positions, C, beta_wpe, dwpe);
    DPT_CUDA_CHECK_LAUNCH();
  }
  if (!dwte) return;
  // Tokens held nowhere get no sum: with beta 0 their gradient is 0.
  if (beta_wte == 0.f) DPT_CUDA_CHECK(cudaMemsetAsync(dwte, 0, static_cast<size_t>(vocab * C) * sizeof(float), stream));
  if (rows == 0) return;
  DPT_CHECK(work != nullptr, "embedding_backward: null work space");
  auto* ints = static_cast<int32_t*>(work);
  int32_t *keys = ints, *pos = ints + rows, *sorted_keys = ints + 2 * rows, *sorted_pos = ints + 3 * rows;
  void* temp = static_cast<char*>(work) + round_up(4 * static_cast<size_t>(rows) * sizeof(int32_t));
  size_t temp_bytes = sort_bytes(rows, vocab);
  embedding_keys_kernel<<<blocks_for(rows), kThreads, 0, stream>>>(tokens, rows, vocab, keys, pos);
  DPT_CUDA_CHECK_LAUNCH();
  DPT_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys, sorted_keys, pos, sorted_pos,
                                                 static_cast<int>(rows), 0, key_bits(vocab), stream));
  const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>((C + kThreads - 1) / kThreads));
  embedding_wte_grad_kernel<T>
      <<<grid, kThreads, 0, stream>>>(sorted_keys, sorted_pos, rows, dy, vocab, C, beta_wte, dwte);
  DPT_CUDA_CHECK_LAUNCH();
}

}  // namespace

size_t embedding_backward_work_bytes(int64_t rows, int64_t vocab) {
  if (rows <= 0) return 0;
  return round_up(4 * static_cast<size_t>(rows) * sizeof(int32_t)) + sort_bytes(rows, vocab);
}

void embedding_forward(const int32_t* tokens, int64_t rows, int64_t seq, const float* wte, int64_t vocab,
                       const float* wpe, int64_t C, float* y, cudaStream_t stream) {
  forward(tokens, rows, seq, wte, vocab, wpe, C, y, stream);
}
void embedding_forward_bf16(const int32_t* tokens, int64_t rows, int64_t seq, const float* wte, int64_t vocab,
                            const float* wpe, int64_t C, uint16_t* y, cudaStream_t stream) {
  forward(tokens, rows, seq, wte, vocab, wpe, C, y, stream);
}
void embedding_backward(const int32_t* tokens, int64_t rows, int64_t seq, const float* dy, int64_t vocab,
                        int64_t positions, int64_t C, float beta_wte, float* dwte, float beta_wpe, float* dwpe,
                        void* work, cudaStream_t stream) {
  backward(tokens, rows, seq, dy, vocab, positions, C, beta_wte, dwte, beta_wpe, dwpe, work, stream);
}
void embedding_backward_bf16(const int32_t* tokens, int64_t rows, int64_t seq, const uint16_t* dy, int64_t vocab,
                             int64_t positions, int64_t C, float beta_wte, float* dwte, float beta_wpe, float* dwpe,
                             void* work, cudaStream_t stream) {
  backward(tokens, rows, seq, dy, vocab, positions, C, beta_wte, dwte, beta_wpe, dwpe, work, stream);
}

}  // namespace dpt::cuda
