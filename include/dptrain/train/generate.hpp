// Text generation from a trained GPT (`dptrain generate`): the prompt's tokens, then one
// token at a time, each drawn from the model's next-token distribution (greedy at
// temperature 0; else softmax(logits / temperature), over the top_k likeliest when top_k >
// 0). Each token is drawn from the model's logits over the last `context` tokens, without
// gradients. A key-value cache (GPT::forward_cached) keeps every layer's keys and values, so
// the prompt runs through the model once and each new token costs one position, not the
// whole window. Past the context the window slides, which moves every position (GPT-2's
// positions are learnt embeddings): the cache is rebuilt from the window then, and a token
// costs a forward over the window, as without the cache; the tokens are the uncached ones.
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
  bool kv_cache = true;      // false: each token a forward over the whole window (the reference for tests)
};

// The new tokens, each also handed to `on_token` as soon as it is drawn. UsageError with one
// line for a checkpoint that is not a GPT's, an empty prompt, a token outside the
// vocabulary, a temperature < 0 or a top_k < 0.
std::vector<int32_t> generate(const GenerateConfig& cfg, const std::function<void(int32_t)>& on_token = {});

}  // namespace dpt
