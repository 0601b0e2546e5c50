#include <dptrain/train/generate.hpp>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include <dptrain/error.hpp>
#include <dptrain/runtime/autograd.hpp>
#include <dptrain/train/hf.hpp>

namespace dpt {

namespace {

void check(const GenerateConfig& cfg, const nn::GptConfig& g) {
  if (cfg.prompt.empty()) throw UsageError("generate: an empty prompt; give at least one token");
  for (size_t i = 0; i < cfg.prompt.size(); ++i)
    if (cfg.prompt[i] < 0 || cfg.prompt[i] >= g.vocab)
      throw UsageError("generate: prompt token " + std::to_string(i) + " is " + std::to_string(cfg.prompt[i]) +
                       ", outside the model's vocabulary [0, " + std::to_string(g.vocab) + ")");
  if (!(cfg.temperature >= 0.0f && std::isfinite(cfg.temperature)))
    throw UsageError("generate: the temperature must be a finite number >= 0, got " + std::to_string(cfg.temperature));
  if (cfg.top_k < 0) throw UsageError("generate: top_k must be >= 0, got " + std::to_string(cfg.top_k));
  if (cfg.max_new_tokens < 0)
    throw UsageError("generate: max_new_tokens must be >= 0, got " + std::to_string(cfg.max_new_tokens));
}

// The next token from one row of logits (the vocabulary's columns).
int32_t draw(const std::vector<float>& logits, const GenerateConfig& cfg, std::mt19937_64& rng) {
  const auto V = static_cast<int64_t>(logits.size());
  std::vector<int32_t> order(static_cast<size_t>(V));
  std::iota(order.begin(), order.end(), 0);
  // Likeliest first; equal logits keep the lower id first, so a draw never depends on the sort.
  const int64_t k = cfg.top_k > 0 ? std::min(cfg.top_k, V) : V;
  std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t b) {
    return logits[static_cast<size_t>(a)] > logits[static_cast<size_t>(b)] ||
           (logits[static_cast<size_t>(a)] == logits[static_cast<size_t>(b)] && a < b);
  });
  if (cfg.temperature == 0.0f) return order[0];
  std::vector<double> p(static_cast<size_t>(k));
  const double top = logits[static_cast<size_t>(order[0])];
  for (int64_t i = 0; i < k; ++i)
    p[static_cast<size_t>(i)] = std::exp((logits[static_cast<size_t>(order[static_cast<size_t>(i)])] - top) /
                                         static_cast<double>(cfg.temperature));
  std::discrete_distribution<int64_t> pick(p.begin(), p.end());
  return order[static_cast<size_t>(pick(rng))];
}

// The model's logits for the token after a growing list of tokens, from their last
// `context` (the window), as the model saw sequences in training.
//
// With the key-value cache, only the tokens that are not in the cache yet run through the
// model (GPT::forward_cached): the prompt once, then one position a token. Once the window
// is full it slides, and since the positions are learnt embeddings (not relative ones),
// every key and value in the window changes with it: the cache is emptied and rebuilt from
// the whole window, so past the context each token costs a forward over the window, as
// without the cache. That keeps the logits the uncached forward's (and so the tokens the
// same); rebuilding from half a window would be cheaper but would condition on fewer tokens.
class NextLogits {
 public:
  NextLogits(nn::GPT& model, const Device& device, bool cached)
      : model_(model), device_(device), cached_(cached), cache_(cached ? model.kv_cache() : nn::KvCache{}) {}

  std::vector<float> after(const std::vector<int32_t>& tokens) {
    const nn::GptConfig& g = model_.config();
    const auto total = static_cast<int64_t>(tokens.size());
    const int64_t window = std::min(total, g.context);
    if (!cached_) {
      const Tensor logits = model_.forward(rows(tokens, total - window, total));
      return logits.view((window - 1) * g.padded_vocab(), {g.vocab}).to_host();
    }
    if (total - first_ > g.context) {  // the window slid: rebuild the cache from it
      first_ = total - window;
      cache_.length = 0;
    }
    const Tensor logits = model_.forward_cached(rows(tokens, first_ + cache_.length, total), cache_, true);
    return logits.view(0, {g.vocab}).to_host();
  }

 private:
  // tokens[from, to) as a batch of one on the model's device.
  Tensor rows(const std::vector<int32_t>& tokens, int64_t from, int64_t to) const {
    return Tensor::from_host_i32(std::vector<int32_t>(tokens.begin() + from, tokens.begin() + to), {1, to - from},
                                 device_);
  }
  nn::GPT& model_;
  Device device_;
  bool cached_;
  nn::KvCache cache_;
  int64_t first_ = 0;  // the index in tokens of the cache's position 0
};

}  // namespace

std::vector<int32_t> generate(const GenerateConfig& cfg, const std::function<void(int32_t)>& on_token) {
  check_device(cfg.device);  // a GPU that is not there: one line, before the checkpoint is read onto it
  const std::shared_ptr<nn::GPT> model = hf::load_gpt2_checkpoint(cfg.checkpoint, cfg.device);
  const nn::GptConfig& g = model->config();
  check(cfg, g);
  model->eval();
  NoGradGuard no_grad;
  std::mt19937_64 rng(cfg.seed);
  NextLogits model_logits(*model, cfg.device, cfg.kv_cache);
  std::vector<int32_t> tokens = cfg.prompt, out;
  for (int64_t n = 0; n < cfg.max_new_tokens; ++n) {
    const int32_t next = draw(model_logits.after(tokens), cfg, rng);
    tokens.push_back(next);
    out.push_back(next);
    if (on_token) on_token(next);
  }
  return out;
}

}  // namespace dpt
