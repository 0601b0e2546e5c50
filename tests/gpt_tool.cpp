// The helper of tests/gpt_interop.py, on the CPU in fp32:
//   gpt_tool forward SPEC WEIGHTS TOKENS TARGETS B T OUT
//     loads WEIGHTS (a Hugging Face GPT-2 model.safetensors) into a GPT of SPEC, runs it on
//     TOKENS (B*T int32, raw), writes the logits of the vocabulary (B*T x V float32, raw) to
//     OUT.logits, prints the mean next-token loss against TARGETS, and writes the gradients
//     of that loss, in the Hugging Face layout, as OUT.grads/model.safetensors.
//   gpt_tool export SPEC SEED DIR
//     writes a GPT of SPEC initialized from SEED as a Hugging Face folder.
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <dptrain/error.hpp>
#include <dptrain/layers/gpt.hpp>
#include <dptrain/runtime/ops.hpp>
#include <dptrain/train/hf.hpp>

namespace {

std::vector<int32_t> read_ints(const std::string& path, size_t n) {
  std::vector<int32_t> v(n);
  std::ifstream f(path, std::ios::binary);
  if (!f.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(n * sizeof(int32_t))))
    throw dpt::Error("cannot read " + std::to_string(n) + " int32 from '" + path + "'");
  return v;
}

void write_floats(const std::string& path, const std::vector<float>& v) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(float)));
  if (!f) throw dpt::Error("cannot write '" + path + "'");
}

int forward(char** argv) {
  const dpt::nn::GptConfig cfg = dpt::nn::parse_gpt_spec(argv[2]);
  const int64_t B = std::stoll(argv[6]), T = std::stoll(argv[7]);
  const std::string out = argv[8];
  auto model = dpt::nn::gpt(cfg);
  model->to(dpt::Device{}, 0);
  dpt::hf::load_gpt2(*model, argv[3]);
  const auto n = static_cast<size_t>(B * T);
  const dpt::Tensor tokens = dpt::Tensor::from_host_i32(read_ints(argv[4], n), {B, T}, dpt::Device{});
  const dpt::Tensor targets = dpt::Tensor::from_host_i32(read_ints(argv[5], n), {B * T}, dpt::Device{});
  model->zero_grad();
  const dpt::Tensor logits = model->forward(tokens);
  // The vocabulary's columns of each row (the padding columns are the model's own).
  const std::vector<float> all = logits.to_host();
  const int64_t V = cfg.vocab, Vp = cfg.padded_vocab();
  std::vector<float> rows;
  for (int64_t r = 0; r < B * T; ++r) rows.insert(rows.end(), all.begin() + r * Vp, all.begin() + r * Vp + V);
  write_floats(out + ".logits", rows);
  const dpt::Tensor loss = dpt::nn::lm_loss(logits, targets, V);
  loss.backward();
  model->settle_grads();
  std::printf("%.9g\n", static_cast<double>(loss.item()));
  // The gradients in the weights' places, exported as the weights are.
  for (dpt::nn::Parameter* p : model->parameters()) dpt::copy(p->value, p->value.grad());
  dpt::hf::export_gpt2(*model, out + ".grads");
  return 0;
}

int export_model(char** argv) {
  auto model = dpt::nn::gpt(dpt::nn::parse_gpt_spec(argv[2]));
  model->to(dpt::Device{}, std::stoull(argv[3]));
  dpt::hf::export_gpt2(*model, argv[4]);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string cmd = argc > 1 ? argv[1] : "";
  int (*run)(char**) = cmd == "forward" && argc == 9 ? forward : cmd == "export" && argc == 5 ? export_model : nullptr;
  if (!run) {
    std::fprintf(stderr,
                 "usage: gpt_tool forward SPEC WEIGHTS TOKENS TARGETS B T OUT | gpt_tool export SPEC SEED DIR\n");
    return 2;
  }
  try {
    return run(argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpt_tool: %s\n", e.what());
    return 1;
  }
}
