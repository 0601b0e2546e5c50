// A run of Linear layers computed as one (cuda/mlp.cu, and the forward's CPU twin in
// cpu/gemm.cpp):
// layer l makes y_l = act_l(x_l W_l^T + b_l) from x_0, the input, and x_{l+1} = y_l, for a
// small batch of narrow layers (a tiny MLP's forward), where one kernel a layer spends
// most of its time starting and waiting.
#pragma once
#include <cstdint>

#include <dptrain/types.hpp>

namespace dpt {

constexpr int kMlpMaxLayers = 8;
constexpr int kMlpMaxWidth = 256;  // every layer's in and out

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

}  // namespace dpt
