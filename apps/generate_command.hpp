// `dptrain generate`: a trained GPT's continuation of a prompt, given as token ids
// (--prompt-tokens) or as text (--prompt) that GPT-2's tokenizer (--tokenizer DIR)
// encodes; with a tokenizer the continuation prints as text while it comes, else as ids.
#pragma once
#include <string>

#include <CLI/CLI.hpp>

#include <dptrain/train/generate.hpp>

namespace dpt::app {

struct GenerateFlags {
  GenerateConfig cfg;
  std::string prompt_tokens, prompt_text, tokenizer, device;
  CLI::App* command = nullptr;  // what add_generate_command made, for which flags were given
};

// The subcommand and its flags, which fill `flags`.
CLI::App* add_generate_command(CLI::App& app, GenerateFlags& flags);

// Prints the continuation on stdout (a line); UsageError for a prompt given twice or not at
// all, text without a tokenizer, and a tokenizer of more tokens than the model's vocabulary.
int generate_continuation(GenerateFlags& flags);

}  // namespace dpt::app
