// The token and position embedding (GPT's wte and wpe) on the CPU: the gather forward and
// its deterministic backward, a sum per token over the positions that hold it, in order.
#include <string>
#include <vector>

#include <dptrain/error.hpp>

#include "bf16_io.hpp"
#include "cpu.hpp"

namespace dpt::cpu {

namespace {

void check_tokens(const int32_t* tokens, int64_t rows, int64_t vocab) {
  for (int64_t n = 0; n < rows; ++n)
    if (tokens[n] < 0 || tokens[n] >= vocab)
      throw Error("embedding: token " + std::to_string(tokens[n]) + " at position " + std::to_string(n) +
                  " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
}

template <typename T>
void forward(const int32_t* tokens, int64_t rows, int64_t seq, const float* wte, int64_t vocab, const float* wpe,
             int64_t C, T* y) {
  check_tokens(tokens, rows, vocab);
  for (int64_t n = 0; n < rows; ++n) {
    const float* e = wte + tokens[n] * C;
    const float* p = wpe + (n % seq) * C;
    for (int64_t c = 0; c < C; ++c) store(&y[n * C + c], e[c] + p[c]);
  }
}

// g = beta g + s, where beta 0 never reads g.
void finish(float beta, float* g, float s) { *g = beta != 0.0f ? beta * *g + s : s; }

template <typename T>
void backward(const int32_t* tokens, int64_t rows, int64_t seq, const T* dy, int64_t vocab, int64_t positions,
              int64_t C, float beta_wte, float* dwte, float beta_wpe, float* dwpe) {
  check_tokens(tokens, rows, vocab);
  if (dwte) {
    // Each token's positions in increasing order (a counting sort), so that its sum adds
    // them in that order, as the CUDA kernel does.
    std::vector<int64_t> start(static_cast<size_t>(vocab) + 1, 0), order(static_cast<size_t>(rows));
    for (int64_t n = 0; n < rows; ++n) ++start[static_cast<size_t>(tokens[n]) + 1];
    for (int64_t v = 0; v < vocab; ++v) start[v + 1] += start[v];
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    for (int64_t n = 0; n < rows; ++n) order[static_cast<size_t>(next[static_cast<size_t>(tokens[n])]++)] = n;
    for (int64_t v = 0; v < vocab; ++v) {
      if (start[v] == start[v + 1] && beta_wte != 0.0f) continue;  // nothing to add
      for (int64_t c = 0; c < C; ++c) {
        float s = 0.0f;
        for (int64_t k = start[v]; k < start[v + 1]; ++k) s += as_float(dy[order[k] * C + c]);
        finish(beta_wte, &dwte[v * C + c], s);
      }
    }
  }
  if (dwpe) {
    const int64_t batch = seq > 0 ? rows / seq : 0;
    for (int64_t t = 0; t < positions; ++t)
      for (int64_t c = 0; c < C; ++c) {
        float s = 0.0f;
        for (int64_t b = 0; t < seq && b < batch; ++b) s += as_float(dy[(b * seq + t) * C + c]);
        finish(beta_wpe, &dwpe[t * C + c], s);
      }
  }
}

}  // namespace

void embedding_forward(const int32_t* tokens, int64_t rows, int64_t T, const float* wte, int64_t vocab,
                       const float* wpe, int64_t C, float* y) {
  forward(tokens, rows, T, wte, vocab, wpe, C, y);
}
void embedding_forward_bf16(const int32_t* tokens, int64_t rows, int64_t T, const float* wte, int64_t vocab,
                            const float* wpe, int64_t C, uint16_t* y) {
  forward(tokens, rows, T, wte, vocab, wpe, C, y);
}
void embedding_backward(const int32_t* tokens, int64_t rows, int64_t T, const float* dy, int64_t vocab,
                        int64_t positions, int64_t C, float beta_wte, float* dwte, float beta_wpe, float* dwpe) {
  backward(tokens, rows, T, dy, vocab, positions, C, beta_wte, dwte, beta_wpe, dwpe);
}
void embedding_backward_bf16(const int32_t* tokens, int64_t rows, int64_t T, const uint16_t* dy, int64_t vocab,
                             int64_t positions, int64_t C, float beta_wte, float* dwte, float beta_wpe, float* dwpe) {
  backward(tokens, rows, T, dy, vocab, positions, C, beta_wte, dwte, beta_wpe, dwpe);
}

}  // namespace dpt::cpu
