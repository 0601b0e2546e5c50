#include "generate_command.hpp"

#include <cstdint>
#include <cstdio>
#include <map>
#include <optional>
#include <vector>

#include <dptrain/data/bpe.hpp>
#include <dptrain/error.hpp>
#include <dptrain/layers/gpt.hpp>
#include <dptrain/train/checkpoint.hpp>

#include "cli.hpp"

namespace dpt::app {
namespace {

// GPT-2's tokenizer in `dir`, refused when it has more tokens than the model in `checkpoint`
// knows (a checkpoint that holds no GPT is generate's to refuse).
data::Bpe tokenizer_for(const std::string& dir, const std::string& checkpoint) {
  data::Bpe bpe = data::Bpe::load(dir);
  std::map<std::string, std::string> meta;
  try {
    meta = ckpt::read_metadata(checkpoint);
  } catch (const Error&) {
  }
  const auto spec = meta.find("model");
  if (spec == meta.end() || !nn::is_gpt_spec(spec->second)) return bpe;
  if (const int64_t vocab = nn::parse_gpt_spec(spec->second).vocab; vocab < bpe.vocab_size())
    throw UsageError("--tokenizer '" + dir + "' has " + std::to_string(bpe.vocab_size()) +
                     " tokens, more than the model's vocabulary of " + std::to_string(vocab) + " (" + spec->second +
                     " in '" + checkpoint + "'): it is not this model's tokenizer");
  return bpe;
}

void print(const std::string& s) {
  std::fwrite(s.data(), 1, s.size(), stdout);
  std::fflush(stdout);
}

}  // namespace

CLI::App* add_generate_command(CLI::App& app, GenerateFlags& g) {
  CLI::App* sub = app.add_subcommand(
      "generate", "Print a trained GPT's continuation of a prompt: token ids, or text with --tokenizer");
  sub->add_option("--resume", g.cfg.checkpoint, "The GPT's checkpoint")->required();
  sub->add_option("--prompt-tokens", g.prompt_tokens, "The prompt: token ids separated by commas");
  sub->add_option("--prompt", g.prompt_text, "The prompt as text, which --tokenizer encodes");
  sub->add_option("--tokenizer", g.tokenizer,
                  "GPT-2's tokenizer: a folder with encoder.json and vocab.bpe; the continuation prints as text");
  // Read as the training flags are (decimal, never clamped or wrapped: --seed -1 was 2^64 - 1).
  add_integer(*sub, "--max-new-tokens", g.cfg.max_new_tokens, "Tokens to add")->capture_default_str();
  add_float(*sub, "--temperature", g.cfg.temperature, "0: the likeliest token each time")->capture_default_str();
  add_integer(*sub, "--top-k", g.cfg.top_k, "Draw among the k likeliest tokens (0: all)")->capture_default_str();
  add_integer(*sub, "--seed", g.cfg.seed, "Seed of the draws")->capture_default_str();
  sub->add_option("--device", g.device, "Where the model runs (default: the first GPU, else the CPU)");
  g.command = sub;
  return sub;
}

int generate_continuation(GenerateFlags& g) {
  const bool has_text = g.command->count("--prompt") > 0, has_tokens = g.command->count("--prompt-tokens") > 0,
             has_tokenizer = g.command->count("--tokenizer") > 0;
  if (has_tokens == has_text)
    throw UsageError(has_text ? "generate takes one prompt: --prompt (text) or --prompt-tokens (ids), not both"
                              : "generate needs a prompt: --prompt TEXT (with --tokenizer) or --prompt-tokens IDS");
  if (has_text && !has_tokenizer)
    throw UsageError(
        "--prompt is text, which needs --tokenizer DIR (GPT-2's encoder.json and vocab.bpe) to encode "
        "it; or give token ids with --prompt-tokens");
  g.cfg.device = g.device.empty() ? default_devices().front() : parse_device(g.device);
  std::optional<data::Bpe> bpe;
  if (has_tokenizer) bpe = tokenizer_for(g.tokenizer, g.cfg.checkpoint);
  g.cfg.prompt = has_text ? bpe->encode(g.prompt_text) : parse_token_list(g.prompt_tokens);
  std::optional<data::BpeTextStream> text;  // with a tokenizer, the tokens print as text
  if (bpe) {
    text.emplace(*bpe);
    for (const int32_t t : g.cfg.prompt) (void)text->push(t);  // a character the prompt ends inside prints whole
  }
  const char* sep = "";
  generate(g.cfg, [&](int32_t t) {
    print(text ? text->push(t) : sep + std::to_string(t));
    sep = ",";
  });
  print((text ? text->finish() : std::string()) + "\n");
  return 0;
}

}  // namespace dpt::app
