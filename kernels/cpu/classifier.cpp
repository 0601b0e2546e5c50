// The language model's classifier on the CPU: softmax cross-entropy of each row over its
// first `vocab` columns, mean over the rows, in double; the gradient, when wanted, written
// over the logits (the padding columns' as 0).
#include <cmath>
#include <vector>

#include "../bf16.hpp"
#include "bf16_io.hpp"
#include "cpu.hpp"

namespace dpt::cpu {

// A target outside [0, vocab) gives NaN (as on a GPU), so a bad target shows in the loss.
void classifier_forward(float* logits, const int32_t* targets, int64_t rows, int64_t cols, int64_t vocab, float* loss,
                        bool write_grad) {
  double total = 0.0;
  for (int64_t r = 0; r < rows; ++r) {
    float* row = logits + r * cols;
    float mx = row[0];
    for (int64_t c = 1; c < vocab; ++c) mx = std::fmax(mx, row[c]);
    double sum = 0.0;
    for (int64_t c = 0; c < vocab; ++c) sum += std::exp(static_cast<double>(row[c]) - mx);
    const double lse = mx + std::log(sum);
    const int32_t target = targets[r];
    const bool valid = target >= 0 && target < vocab;
    total += valid ? lse - row[target] : std::nan("");
    if (!write_grad) continue;
    for (int64_t c = 0; c < cols; ++c) {
      const double p = c < vocab ? std::exp(static_cast<double>(row[c]) - lse) : 0.0;
      row[c] = static_cast<float>((p - (c == target ? 1.0 : 0.0)) / static_cast<double>(rows));
    }
  }
  *loss = static_cast<float>(total / static_cast<double>(rows));
}

void classifier_forward_bf16(uint16_t* logits, const int32_t* targets, int64_t rows, int64_t cols, int64_t vocab,
                             float* loss, bool write_grad) {
  auto v = widen(logits, rows * cols);
  classifier_forward(v.data(), targets, rows, cols, vocab, loss, write_grad);
  if (write_grad) narrow(v, logits);
}

void classifier_grad_scale(float* g, int64_t n, const float* dloss, float scale) {
  const float f = scale * (dloss ? *dloss : 1.0f);
  for (int64_t i = 0; i < n; ++i) g[i] *= f;
}

void classifier_grad_scale_bf16(uint16_t* g, int64_t n, const float* dloss, float scale) {
  const float f = scale * (dloss ? *dloss : 1.0f);
  for (int64_t i = 0; i < n; ++i) g[i] = bf16_round(bf16_float(g[i]) * f);
}

}  // namespace dpt::cpu
