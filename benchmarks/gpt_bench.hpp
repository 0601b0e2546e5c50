// The GPT workload that step_bench and dpbench time, as torch_gpt_bench.py (its PyTorch
// twin) defines it: a fixed batch of random tokens (i32 [B, T] inputs and next-token
// targets, the synthetic tokens dptrain trains on without data), the next-token loss,
// nanoGPT's AdamW (lr 6e-4, betas 0.9 and 0.95, weight decay 0.1 on the matrices and
// embeddings: nn::Parameter::decay), and the model flops utilization of a step.
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>

#include <dptrain/data/synthetic.hpp>
#include <dptrain/error.hpp>
#include <dptrain/layers/gpt.hpp>
#include <dptrain/types.hpp>

namespace dpt::bench {

// The dense bf16 peak of an H100 or H200 SXM, TFLOPS: MFU's default denominator
// (--peak-tflops), as torch_gpt_bench.py's.
constexpr double kDefaultPeakTflops = 989.0;
constexpr AdamHyperparams kGptAdamW{.lr = 6e-4f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f};
constexpr uint64_t kGptDataSeed = 1;

// The sequence length of a run: `asked` (0: the model's context), at most the context.
inline int64_t gpt_seq(const nn::GptConfig& c, int64_t asked) {
  const int64_t seq = asked == 0 ? c.context : asked;
  if (seq < 1 || seq > c.context)
    throw UsageError("--seq must be 1 to the model's context (" + std::to_string(c.context) + "), got " +
                     std::to_string(asked));
  return seq;
}

// Sequences first .. first + count - 1 of the random tokens on `device`: each a function of
// its index alone, so a strong-scaling batch is the same tokens however it is split.
inline data::Batch gpt_tokens(const nn::GptConfig& c, int64_t seq, int64_t first, int64_t count, const Device& device) {
  const data::Synthetic tokens({.task = data::Task::language_model, .in = seq, .out = c.vocab, .seed = kGptDataSeed},
                               device);
  return tokens.batch(first, count);
}

// A training step's flops a token, as llm.c and PaLM count them: 6N (forward and backward
// of every weight) + 6LCT (attention's scores and mix), N the parameters without the
// position embedding (a lookup, no multiply; llm.c counts it too, 0.6% more at GPT-2 124M).
inline double gpt_flops_per_token(const nn::GptConfig& c, int64_t parameters, int64_t seq) {
  const auto n = static_cast<double>(parameters - c.context * c.width);
  return 6.0 * n + 6.0 * static_cast<double>(c.layers * c.width * seq);
}

// --peak-tflops, checked: a GPT's alone (an MLP's line has no MFU), a device's dense peak
// from a thousandth of a TFLOPS to a million (1e-50 printed an MFU of 1e+49 %).
inline double checked_peak_tflops(double peak_tflops, bool given, bool is_gpt) {
  if (given && !is_gpt)
    throw UsageError("--peak-tflops is the peak a GPT's MFU is measured against; --model is no GPT");
  if (!(peak_tflops >= 1e-3 && peak_tflops <= 1e6)) {
    char got[32];
    std::snprintf(got, sizeof got, "%g", peak_tflops);
    throw UsageError(std::string("--peak-tflops must be a device's peak in TFLOPS, 0.001 to 1000000, got ") + got);
  }
  return peak_tflops;
}

// --attention-backward, checked as dptrain checks it: a name of nn::kAttentionBackwardNames,
// and fast for a GPT alone (the deterministic default is accepted for any model).
inline nn::AttentionBackward checked_attention_backward(const std::string& text, bool is_gpt) {
  const auto a = nn::kAttentionBackwardNames.find(text);
  if (!a)
    throw UsageError("unknown --attention-backward " + quote_value(text) + ": expected " +
                     nn::kAttentionBackwardNames.choices());
  if (*a != nn::AttentionBackward::deterministic && !is_gpt)
    throw UsageError("--attention-backward applies to GPT models; --model is not a GPT");
  return *a;
}

// Model flops utilization, in percent of `peak_tflops` a device.
inline double mfu_percent(double flops_per_token, double tokens_per_s, double peak_tflops, int64_t devices = 1) {
  return 100.0 * flops_per_token * tokens_per_s / (peak_tflops * 1e12 * static_cast<double>(devices));
}

}  // namespace dpt::bench
