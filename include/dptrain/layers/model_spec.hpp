// A model as dptrain's spec strings describe it, parsed and checked once: an MLP's widths
// ("1024-4096x3-1024"; presets seed and mlp) or a CNN's layers ("cnn:3x32x32-c32k3-p2-f10";
// presets cnn-small and cnn). The grammars are in layers.hpp and conv.hpp.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include <dptrain/layers/conv.hpp>
#include <dptrain/layers/layers.hpp>

namespace dpt::nn {

struct ModelSpec {
  std::string text;  // as given (a preset keeps its name)
  bool is_cnn = false;
  std::vector<int64_t> widths;  // an MLP's layer widths, its input first
  CnnSpec cnn;                  // a CNN's input and layers
  // The last width, or the classes; UsageError for a spec with neither.
  int64_t outputs() const;
  // The shape of one input row: {features}, or {C, H, W} for a CNN.
  Shape input_shape() const;
};

// Throws UsageError with one line naming the problem.
ModelSpec parse_model_spec(const std::string& text);

// The model of a spec, `act` after every hidden layer (and every convolution).
std::shared_ptr<Sequential> make_model(const ModelSpec& spec, Act act);

}  // namespace dpt::nn
