// A run of Linear layers computed as one (cuda/mlp.cu, and its CPU twins in cpu/gemm.cpp):
// layer l makes y_l = act_l(x_l W_l^T + b_l) from x_0, the input, and x_{l+1} = y_l, for a
// small batch of narrow layers (a tiny MLP's forward), where one kernel a layer spends
// most of its time starting and waiting.
#pragma once
#include <cstdint>

#include <dptrain/types.hpp>

#include "hd.hpp"

namespace dpt {

constexpr int kMlpMaxLayers = 8;
constexpr int kMlpMaxWidth = 256;  // every layer's in and out
constexpr int kMlpBlockRows = 8;   // rows of the batch a block of the kernels takes

struct MlpLayer {
  const float* W = nullptr;  // [out, in], row-major
  const float* b = nullptr;  // [out], or null: no bias
  float* y = nullptr;        // [rows, out]: the layer's output
  float* z = nullptr;        // [rows, out]: its pre-activation (GELU's backward reads it), or null
  int in = 0, out = 0;
  Act act = Act::none;
};

struct MlpLayers {
  MlpLayer layer[kMlpMaxLayers];
  int count = 0;
};

// Where backward's weight and bias gradients go, layer by layer (null: not wanted), each
// written as sum + beta * what is there (beta 0 or 1; 0 never reads it).
struct MlpGrads {
  float* dW[kMlpMaxLayers] = {};
  float* db[kMlpMaxLayers] = {};
  float beta_W[kMlpMaxLayers] = {};
  float beta_b[kMlpMaxLayers] = {};
};

// The kernels' blocks for `rows` rows of the batch.
DPT_HD int64_t mlp_blocks(int64_t rows) { return (rows + kMlpBlockRows - 1) / kMlpBlockRows; }

// Backward's parts (cuda::mlp_backward, cpu::mlp_backward): for each block of
// kMlpBlockRows rows, every layer's part (its weight gradient, then its bias gradient),
// layer after layer; mlp_part_floats the floats of one block's parts.
DPT_HD int64_t mlp_part_of(const MlpLayer& L) { return int64_t{L.out} * (L.in + 1); }
inline int64_t mlp_part_floats(const MlpLayers& layers) {
  int64_t n = 0;
  for (int l = 0; l < layers.count; ++l) n += mlp_part_of(layers.layer[l]);
  return n;
}
inline int64_t mlp_backward_work(int64_t rows, const MlpLayers& layers) {
  return mlp_blocks(rows) * mlp_part_floats(layers);
}

}  // namespace dpt
