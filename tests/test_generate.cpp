// Generating text: the decoding ops (attention_decode, embedding_at) against the training
// ones over the whole sequence, GPT::forward_cached against GPT::forward, and `generate`
// with its key-value cache against generate without it (the same tokens, past the
// context too), the greedy continuation of a learnt pattern and the refusals. On the GPU:
// the CUDA decoding ops against their CPU twins and a GPU's greedy tokens against the CPU's.
#include <cstdint>
#include <string>
#include <vector>

#include <dptrain/error.hpp>
#include <dptrain/layers/gpt.hpp>
#include <dptrain/runtime/autograd.hpp>
#include <dptrain/runtime/ops.hpp>
#include <dptrain/train/generate.hpp>
#include <dptrain/train/trainer.hpp>
#include "catch.hpp"
#include "common.hpp"
#include "data_common.hpp"
#include "train_common.hpp"

using namespace dpt;
using namespace dpt::test;

namespace {

const char* const kSpec = "gpt:L2-H2-C32-T16-V60";  // a context of 16

// A GPT of kSpec trained on the sequence (3 i) mod 60 (sequences of 8), saved in `dir`.
std::string trained_gpt(const TempDir& dir) {
  std::vector<uint32_t> tokens(4000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint32_t>((3 * i) % 60);
  test_data::write_shard(dir.file("pattern.bin"), tokens, false);
  TrainConfig c = quiet_config(kSpec, "adamw", 8);
  c.devices = cpus(1);
  c.steps = 150;
  c.seq = 8;
  c.lr = 0.01f;
  c.weight_decay = 0.0f;
  c.data = dir.file("pattern.bin");
  c.save = dir.file("gpt.safetensors");
  Trainer(c).run();
  return c.save;
}

GenerateConfig greedy_config(const std::string& checkpoint, std::vector<int32_t> prompt, int64_t new_tokens,
                             const Device& d) {
  GenerateConfig g;
  g.checkpoint = checkpoint;
  g.prompt = std::move(prompt);
  g.max_new_tokens = new_tokens;
  g.temperature = 0.0f;
  g.device = d;
  return g;
}

// qkv [B*T, 3C] of heads of hs columns, and the rows of positions [from, from + n) of each
// sequence, as a decoding step takes them: [B*n, 3C] (cols = 3C, or C for y).
std::vector<float> positions(const std::vector<float>& all, int64_t B, int64_t T, int64_t cols, int64_t from,
                             int64_t n) {
  std::vector<float> out;
  for (int64_t b = 0; b < B; ++b)
    out.insert(out.end(), all.begin() + (b * T + from) * cols, all.begin() + (b * T + from + n) * cols);
  return out;
}

struct DecodeCase {
  int64_t B, T, heads, hs;
  std::vector<int64_t> steps;  // the new positions of each step, summing to T: a prompt, then tokens
};

// attention_decode over the steps of c on device d, in `type`: each step's y (as f32), then
// the caches.
std::vector<Tensor> decode_steps(const DecodeCase& c, const std::vector<float>& qkv, DType type, const Device& d) {
  NoGradGuard no_grad;
  const int64_t C = c.heads * c.hs;
  const Shape cache{c.B, c.heads, c.T + 2, c.hs};  // room to spare: the capacity is not the sequence
  Tensor k = Tensor::zeros(cache, type, d), v = Tensor::zeros(cache, type, d);
  std::vector<Tensor> out;
  int64_t start = 0;
  for (int64_t n : c.steps) {
    const Tensor step = cast(on(d, positions(qkv, c.B, c.T, 3 * C, start, n), {c.B * n, 3 * C}), type);
    out.push_back(cast(attention_decode(step, k, v, start), DType::f32));
    start += n;
  }
  out.push_back(cast(k, DType::f32));
  out.push_back(cast(v, DType::f32));
  return out;
}

const std::vector<DecodeCase> kDecodeCases = {
    {2, 11, 3, 5, {4, 1, 1, 5}},  // a prompt of 4, two tokens, then 5 at once
    {1, 40, 1, 64, {1, 38, 1}},   // one head of 64, a prompt of one
    {3, 6, 2, 8, {6}},            // everything at once
};

}  // namespace

#ifndef DPT_GPU_TESTS  // ---- the CPU cases (dpt_tests) ----

TEST_CASE("attention_decode gives causal_attention's rows, step by step, f32 and bf16", "[generate][attention]") {
  for (const DecodeCase& c : kDecodeCases)
    for (DType type : {DType::f32, DType::bf16}) {
      INFO("B " << c.B << " T " << c.T << " heads " << c.heads << " hs " << c.hs << " bf16 " << (type == DType::bf16));
      const int64_t C = c.heads * c.hs;
      const std::vector<float> qkv = bf16_values(randn(c.B * c.T * 3 * C, 51));  // alike in both types
      const std::vector<float> full =
          cast(causal_attention(cast(on(host, qkv, {c.B * c.T, 3 * C}), type), c.T, c.heads), DType::f32).to_host();
      const std::vector<Tensor> got = decode_steps(c, qkv, type, host);
      int64_t start = 0;
      for (size_t s = 0; s < c.steps.size(); ++s) {
        // The same function computes each row on the CPU: the same bits.
        CHECK(got[s].to_host() == positions(full, c.B, c.T, C, start, c.steps[s]));
        start += c.steps[s];
      }
      // The caches hold every position's k and v, head by head.
      const std::vector<float> k = got[c.steps.size()].to_host(), v = got[c.steps.size() + 1].to_host();
      bool held = true;
      for (int64_t b = 0; b < c.B; ++b)
        for (int64_t h = 0; h < c.heads; ++h)
          for (int64_t t = 0; t < c.T; ++t)
            for (int64_t i = 0; i < c.hs; ++i) {
              const auto at = static_cast<size_t>(((b * c.heads + h) * (c.T + 2) + t) * c.hs + i);
              const auto row = static_cast<size_t>((b * c.T + t) * 3 * C + h * c.hs + i);
              held =
                  held && k[at] == qkv[row + static_cast<size_t>(C)] && v[at] == qkv[row + 2 * static_cast<size_t>(C)];
            }
      CHECK(held);
    }
}

TEST_CASE("attention_decode refuses what does not fit its caches, and gradients", "[generate][attention]") {
  const Tensor k = Tensor::zeros({1, 2, 4, 3}, DType::f32, host), v = Tensor::zeros({1, 2, 4, 3}, DType::f32, host);
  const Tensor qkv = Tensor::zeros({2, 18}, DType::f32, host);  // 2 new positions of one sequence, C 6
  CHECK_THROWS_AS(attention_decode(randn_tensor({2, 18}, 1, host).set_requires_grad(true), k, v, 0), Error);
  NoGradGuard no_grad;
  CHECK_NOTHROW(attention_decode(qkv, k, v, 2));
  CHECK_THROWS_AS(attention_decode(qkv, k, v, 3), Error);  // past the capacity
  CHECK_THROWS_AS(attention_decode(qkv, k, v, -1), Error);
  CHECK_THROWS_AS(attention_decode(Tensor::zeros({2, 15}, DType::f32, host), k, v, 0), Error);  // not 3C
  CHECK_THROWS_AS(attention_decode(qkv, k, Tensor::zeros({1, 2, 5, 3}, DType::f32, host), 0), Error);
  CHECK_THROWS_AS(attention_decode(cast(qkv, DType::bf16), k, v, 0), Error);  // the caches' type is qkv's
  const Tensor two = Tensor::zeros({2, 2, 4, 3}, DType::f32, host);           // two sequences
  CHECK_NOTHROW(attention_decode(qkv, two, two.detach(), 0));
  CHECK_THROWS_AS(attention_decode(Tensor::zeros({3, 18}, DType::f32, host), two, two, 0), Error);
}

TEST_CASE("embedding_at adds the positions from its offset on, as embedding over the whole sequence",
          "[generate][transformer]") {
  const std::vector<int32_t> tokens{1, 3, 3, 0, 5, 1, 4, 3, 0, 0}, last3{3, 0, 5, 3, 0, 0};  // 2 sequences of 5
  const Tensor wte = randn_tensor({7, 6}, 1, host), wpe = randn_tensor({8, 6}, 2, host);
  const Tensor new_tokens = Tensor::from_host_i32(last3, {2, 3}, host);
  CHECK_THROWS_AS(embedding_at(new_tokens, wte.detach().set_requires_grad(true), wpe, 2), Error);
  NoGradGuard no_grad;
  for (DType type : {DType::f32, DType::bf16}) {
    const auto full = embedding(Tensor::from_host_i32(tokens, {2, 5}, host), wte, wpe, type).to_host();
    CHECK(embedding_at(new_tokens, wte, wpe, 2, type).to_host() == positions(full, 2, 5, 6, 2, 3));
  }
  CHECK_NOTHROW(embedding_at(new_tokens, wte, wpe, 5));  // the last of wpe's 8 rows
  CHECK_THROWS_AS(embedding_at(new_tokens, wte, wpe, 6), Error);
}

TEST_CASE("GPT::forward_cached gives forward's logits, step by step, f32 and bf16", "[generate][gpt]") {
  auto model = nn::gpt(nn::parse_gpt_spec(kSpec));
  model->to(host, 1);
  const int64_t B = 2, T = 16, V = model->config().padded_vocab();
  std::vector<int32_t> ids(static_cast<size_t>(B * T));
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>((i * 37 + 11) % 60);
  auto columns = [&](int64_t from, int64_t n) {  // positions [from, from + n) of each sequence
    std::vector<int32_t> out;
    for (int64_t b = 0; b < B; ++b) out.insert(out.end(), ids.begin() + b * T + from, ids.begin() + b * T + from + n);
    return Tensor::from_host_i32(out, {B, n}, host);
  };
  for (DType type : {DType::f32, DType::bf16}) {
    INFO("bf16 " << (type == DType::bf16));
    model->set_compute_dtype(type);
    const double tol = type == DType::bf16 ? 1e-2 : 1e-5;
    std::vector<float> full;
    {
      NoGradGuard no_grad;
      full = cast(model->forward(columns(0, T)), DType::f32).to_host();
    }
    nn::KvCache cache = model->kv_cache(B);
    int64_t start = 0;
    for (int64_t n : {5, 1, 1, 9}) {
      const Tensor logits = model->forward_cached(columns(start, n), cache);
      CHECK(!logits.requires_grad());  // no NoGradGuard here: forward_cached keeps none
      CHECK(rel_error(cast(logits, DType::f32).to_host(), positions(full, B, T, V, start, n)) < tol);
      start += n;
      CHECK(cache.length == start);
    }
    CHECK(test::usage_error([&] { model->forward_cached(columns(0, 1), cache); }) ==
          "GPT: 1 new tokens after the 16 in the key-value cache; the model's context is 16");
    // Only each sequence's last position: the prompt at once.
    nn::KvCache fresh = model->kv_cache(B);
    const Tensor last = model->forward_cached(columns(0, T), fresh, true);
    REQUIRE(last.shape() == Shape{B, V});
    std::vector<float> want = positions(full, B, T, V, T - 1, 1);
    CHECK(rel_error(cast(last, DType::f32).to_host(), want) < tol);
    CHECK_THROWS_AS(model->forward_cached(Tensor::from_host_i32({1}, {1, 1}, host), fresh), Error);  // 2 sequences
  }
}

TEST_CASE("generate with the key-value cache gives the tokens of generate without it, past the context",
          "[generate][gpt]") {
  TempDir dir;
  const std::string checkpoint = trained_gpt(dir);
  std::vector<int32_t> long_prompt;  // longer than the context of 16: the cache starts from its last 16
  for (int32_t i = 0; i < 21; ++i) long_prompt.push_back((7 * i) % 60);
  for (const std::vector<int32_t>& prompt : {std::vector<int32_t>{0, 3, 6}, long_prompt}) {
    GenerateConfig g = greedy_config(checkpoint, prompt, 40, host);  // the window slides 20 times and more
    const std::vector<int32_t> cached = generate(g);
    g.kv_cache = false;
    CHECK(generate(g) == cached);
    // Draws too: on the CPU the cached path's logits are the uncached ones.
    g.temperature = 1.5f;
    g.seed = 3;
    const std::vector<int32_t> drawn = generate(g);
    g.kv_cache = true;
    CHECK(generate(g) == drawn);
  }
}

TEST_CASE("generate: the greedy continuation of a learnt pattern, seeded draws, and the refusals", "[gpt][generate]") {
  TempDir dir;
  GenerateConfig g = greedy_config(trained_gpt(dir), {0, 3, 6}, 12, host);
  std::vector<int32_t> streamed;
  const std::vector<int32_t> greedy = generate(g, [&](int32_t t) { streamed.push_back(t); });
  CHECK(greedy == std::vector<int32_t>{9, 12, 15, 18, 21, 24, 27, 30, 33, 36, 39, 42});
  CHECK(streamed == greedy);
  g.temperature = 1.0f;
  g.top_k = 5;
  g.seed = 7;
  const std::vector<int32_t> drawn = generate(g);
  CHECK(drawn.size() == 12);
  CHECK(generate(g) == drawn);  // the same seed, the same draws
  g.prompt = {0, 60};
  CHECK(test::usage_error([&] { generate(g); }) ==
        "generate: prompt token 1 is 60, outside the model's vocabulary [0, 60)");
  g.prompt = {1};
  g.temperature = -1.0f;
  CHECK(test::usage_error([&] { generate(g); }).find("generate: the temperature must be a finite number >= 0") == 0);
  TrainConfig mlp = quiet_config("4-8-2", "sgd", 4);
  mlp.steps = 1;
  mlp.devices = cpus(1);
  mlp.save = dir.file("mlp.safetensors");
  Trainer(mlp).run();
  g.checkpoint = mlp.save;
  CHECK(test::usage_error([&] { generate(g); }) == "checkpoint '" + mlp.save + "' holds no GPT (its model is '4-8-2')");
}

#else  // ---- CUDA against the CPU (dpt_gpu_tests: where there is a GPU) ----

TEST_CASE("CUDA attention_decode matches the CPU, f32 and bf16, the same bits twice", "[gpu][generate][attention]") {
  for (const DecodeCase& c : kDecodeCases)
    for (DType type : {DType::f32, DType::bf16}) {
      INFO("B " << c.B << " T " << c.T << " heads " << c.heads << " hs " << c.hs << " bf16 " << (type == DType::bf16));
      const std::vector<float> qkv = randn(c.B * c.T * 3 * c.heads * c.hs, 52);
      compare([&](const Device& d) { return decode_steps(c, qkv, type, d); }, type == DType::bf16 ? 1e-2 : 1e-5);
      const auto a = decode_steps(c, qkv, type, gpu), b = decode_steps(c, qkv, type, gpu);
      for (size_t i = 0; i < a.size(); ++i) CHECK(a[i].to_host() == b[i].to_host());
    }
}

TEST_CASE("CUDA embedding_at matches the CPU", "[gpu][generate][transformer]") {
  const std::vector<float> wte = randn(7 * 6, 1), wpe = randn(8 * 6, 2);
  for (DType type : {DType::f32, DType::bf16})
    compare([&](const Device& d) {
      NoGradGuard no_grad;
      return std::vector<Tensor>{cast(embedding_at(Tensor::from_host_i32({3, 0, 5, 3, 0, 6}, {2, 3}, d),
                                                   on(d, wte, {7, 6}), on(d, wpe, {8, 6}), 4, type),
                                      DType::f32)};
    });
}

TEST_CASE("a GPU's cached greedy tokens are the CPU's (fp32), past the context", "[gpu][generate][gpt]") {
  TempDir dir;
  const std::string checkpoint = trained_gpt(dir);
  GenerateConfig g = greedy_config(checkpoint, {0, 3, 6}, 40, host);
  const std::vector<int32_t> on_cpu = generate(g);
  g.device = gpu;
  CHECK(generate(g) == on_cpu);
}

#endif  // DPT_GPU_TESTS
