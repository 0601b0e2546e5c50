// Text generation from a trained GPT (`dptrain generate`): the prompt's tokens, then one
// token at a time, each drawn from the model's next-token distribution (greedy at
// temperature 0; else softmax(logits / temperature), over the top_k likeliest when top_k >
// 0). Each step runs the model over the last `context` tokens without gradients; there is
// no key-value cache yet, so a new token costs a forward over the whole window.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <dptrain/runtime/device.hpp>

namespace dpt {

struct GenerateConfig {
  std::string checkpoint;       // a GPT's checkpoint (Trainer::save's)
  std::vector<int32_t> prompt;  // token ids, at least one
  int64_t max_new_tokens = 64;
  float temperature = 1.0f;  // 0: the likeliest token every time
  int64_t top_k = 0;         // > 0: draw among the k likeliest only
  uint64_t seed = 1;         // of the draws: the same seed, the same tokens
  Device device;             // where the model runs
};

// The new tokens, each also handed to `on_token` as soon as it is drawn. UsageError with one
// line for a checkpoint that is not a GPT's, an empty prompt, a token outside the
// vocabulary, a temperature < 0 or a top_k < 0.
std::vector<int32_t> generate(const GenerateConfig& cfg, const std::function<void(int32_t)>& on_token = {});

}  // namespace dpt
