// A model as dptrain's spec strings describe it, parsed and checked once: an MLP's widths
// ("1024-4096x3-1024"; presets seed and mlp), a CNN's layers ("cnn:3x32x32-c32k3-p2-f10";
// presets cnn-small and cnn) or a GPT's sizes ("gpt:L4-H4-C128-T256-V512"; presets gpt2,
// gpt2-medium, ...). The grammars are in layers.hpp, conv.hpp and gpt.hpp.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include <dptrain/layers/conv.hpp>
#include <dptrain/layers/gpt.hpp>
#include <dptrain/layers/layers.hpp>

namespace dpt::nn {

struct ModelSpec {
  std::string text;  // as given (a preset keeps its name)
  bool is_cnn = false;
  bool is_gpt = false;
  std::vector<int64_t> widths;  // an MLP's layer widths, its input first
  CnnSpec cnn;                  // a CNN's input and layers
  GptConfig gpt;                // a GPT's sizes
  // The last width, the classes, or a GPT's vocabulary; UsageError for a spec with none.
  int64_t outputs() const;
  // The shape of one input row: {features}, {C, H, W} for a CNN, {context} tokens for a GPT
  // (a shorter sequence may be trained on).
  Shape input_shape() const;
};

// Throws UsageError with one line naming the problem.
ModelSpec parse_model_spec(const std::string& text);

// The model of a spec, `act` after every hidden layer (and every convolution); a GPT's
// activation is its own (tanh-GELU).
std::shared_ptr<Module> make_model(const ModelSpec& spec, Act act);

}  // namespace dpt::nn
