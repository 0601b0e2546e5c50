// GPT-2 through the Trainer: specs, the model's names and sizes, the same steps on one
// device and on three, resume bit for bit, token files with validation perplexity, the
// batch in tokens, the refusals, and activation recomputation (the same bits in less
// memory; on the GPU too). (Logits, loss and gradients against transformers'
// GPT2LMHeadModel: tests/gpt_interop.py; generating text: tests/test_generate.cpp.)
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <dptrain/data/tokens.hpp>
#include <dptrain/layers/gpt.hpp>
#include <dptrain/layers/layers.hpp>
#include <dptrain/layers/model_spec.hpp>
#include <dptrain/optim/adamw.hpp>
#include <dptrain/optim/sgd.hpp>
#include <dptrain/runtime/memory.hpp>
#include <dptrain/runtime/ops.hpp>
#include <dptrain/train/trainer.hpp>
#include "catch.hpp"
#include "common.hpp"
#include "data_common.hpp"
#include "train_common.hpp"
#if defined(DPT_GPU_TESTS) && DPT_WITH_CUDNN_FRONTEND
#include "kernels/cuda/sdpa.hpp"
#endif

using namespace dpt;

namespace {

// One forward and backward of a GPT (`spec`, `batch` sequences of its whole context) on `d`
// in `compute` with recomputation `r`: the loss's and every gradient's bits, and the most
// the device's allocator held above what it held before (the model, its gradient buffer and
// the tokens).
struct RecomputeStep {
  std::vector<uint32_t> loss, grads;
  int64_t peak = 0;
};

std::vector<float> floats_of(const std::vector<uint32_t>& bits) {
  std::vector<float> out(bits.size());
  std::memcpy(out.data(), bits.data(), bits.size() * sizeof(float));
  return out;
}

std::vector<uint32_t> bits_of(const Tensor& t) {
  const std::vector<float> v = t.to_host();
  std::vector<uint32_t> out(v.size());
  std::memcpy(out.data(), v.data(), v.size() * sizeof(float));
  return out;
}

// A fixed batch of `batch` sequences for g: tokens and next-token targets, on d.
std::pair<Tensor, Tensor> gpt_batch(const nn::GptConfig& g, int64_t batch, const Device& d) {
  std::vector<int32_t> tokens(static_cast<size_t>(batch * g.context)), targets(tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = static_cast<int32_t>((i * 7 + i / 5) % static_cast<size_t>(g.vocab));
    targets[i] = static_cast<int32_t>((i * 3 + 1) % static_cast<size_t>(g.vocab));
  }
  return {Tensor::from_host_i32(tokens, {batch, g.context}, d), Tensor::from_host_i32(targets, {batch, g.context}, d)};
}

RecomputeStep recompute_step(const std::string& spec, int64_t batch, const Device& d, DType compute, nn::Recompute r) {
  const nn::GptConfig g = nn::parse_gpt_spec(spec);
  auto model = nn::gpt(g);
  model->set_compute_dtype(compute);
  model->to(d, 1);
  model->set_recompute(r);
  const auto [in, out] = gpt_batch(g, batch, d);
  model->zero_grad();
  context(d).synchronize();
  reset_peak_memory(d);
  const auto held = static_cast<int64_t>(memory_stats(d).allocated);
  Tensor loss = nn::lm_loss(model->forward(in), out, g.vocab);
  loss.backward();
  model->settle_grads();
  context(d).synchronize();
  return {bits_of(loss), bits_of(model->flat_grads()), static_cast<int64_t>(memory_stats(d).peak_allocated) - held};
}

}  // namespace

#ifndef DPT_GPU_TESTS  // ---- the CPU cases (dpt_tests) ----

namespace {

const char* const kSpec = "gpt:L2-H2-C32-T16-V60";

TrainConfig gpt_config(int64_t batch = 6) {
  TrainConfig c = test::quiet_config(kSpec, "adamw", batch);
  c.steps = 6;
  c.seq = 8;
  c.weight_decay = 0.1f;  // on the matrices and embeddings alone
  return c;
}

}  // namespace

TEST_CASE("GPT specs: presets, any size, and one line for a spec that does not fit", "[gpt]") {
  CHECK(nn::parse_gpt_spec("gpt2") == nn::GptConfig{12, 12, 768, 1024, 50257});
  CHECK(nn::parse_gpt_spec("gpt2-medium") == nn::GptConfig{24, 16, 1024, 1024, 50257});
  CHECK(nn::parse_gpt_spec("gpt:L4-H4-C128-T256-V512") == nn::GptConfig{4, 4, 128, 256, 512});
  CHECK(nn::GptConfig{}.padded_vocab() == 50304);
  CHECK(nn::gpt_spec_str(nn::parse_gpt_spec("gpt2")) == "gpt:L12-H12-C768-T1024-V50257");
  const nn::ModelSpec m = nn::parse_model_spec(kSpec);
  CHECK((m.is_gpt && !m.is_cnn && m.outputs() == 60 && m.input_shape() == Shape{16}));
  for (const auto& [spec, why] : std::vector<std::pair<std::string, std::string>>{
           {"gpt:L4-H4-C130-T256-V512", "the width 130 is not a multiple of the heads 4"},
           {"gpt:L4-H1-C256-T256-V512", "a head of 256 channels (width / heads); at most 128"},
           {"gpt:L4-H4-C128-T256", "expected '-' before V"},
           {"gpt:L4-H4-C128-T0-V512", "context 0 outside [1, 1048576]"},
           {"gpt:L4-H4-C128-T256-V512x", "unexpected 'x' at the end"},
           {"gpt:H4-L4-C128-T256-V512", "expected L"}}) {
    const std::string e = test::usage_error([&] { nn::parse_gpt_spec(spec); });
    INFO(e);
    CHECK(e.find("model spec '" + spec + "': " + why) == 0);
  }
}

TEST_CASE("a GPT's parameters: nanoGPT's names, GPT-2's initialization, the tied embedding", "[gpt]") {
  auto model = nn::gpt(nn::parse_gpt_spec(kSpec));
  model->to(test::host, 1);
  const auto named = model->named_parameters();
  std::vector<std::string> names;
  for (const auto& [name, p] : named) names.push_back(name);
  CHECK(names.front() == "transformer.wte.weight");
  CHECK(names[1] == "transformer.wpe.weight");
  CHECK(names[2] == "transformer.h.0.ln_1.weight");
  CHECK(names[4] == "transformer.h.0.attn.c_attn.weight");
  CHECK(names[10] == "transformer.h.0.mlp.c_fc.weight");
  CHECK(names.back() == "transformer.ln_f.bias");
  CHECK(named.front().second->shape == Shape{64, 32});  // the vocabulary padded to 64 rows
  CHECK(named.front().second->uses == 2);
  // 64*32 + 16*32 + 2 blocks * (12 C^2 + 13 C) + 2 C
  CHECK(model->num_parameters() == 64 * 32 + 16 * 32 + 2 * (12 * 32 * 32 + 13 * 32) + 2 * 32);
  auto stddev = [&](const std::string& name) {
    for (const auto& [n, p] : named)
      if (n == name) {
        const std::vector<float> v = p->value.to_host();
        double s = 0;
        for (float x : v) s += static_cast<double>(x) * x;
        return std::sqrt(s / static_cast<double>(v.size()));
      }
    return -1.0;
  };
  CHECK(std::fabs(stddev("transformer.h.0.attn.c_attn.weight") - 0.02) < 0.002);
  CHECK(std::fabs(stddev("transformer.h.0.mlp.c_proj.weight") - 0.02 / std::sqrt(4.0)) < 0.001);
  CHECK(stddev("transformer.h.0.attn.c_attn.bias") == 0.0);
  CHECK(stddev("transformer.h.1.ln_2.weight") == 1.0);
  CHECK(test::usage_error([&] {
          model->forward(Tensor::zeros({2, 17}, DType::i32, test::host));
        }) == "GPT: a sequence of 17 tokens; the model's context is 16");
}

TEST_CASE("AdamW decays a GPT's matrices and embeddings, not its biases and LayerNorms", "[gpt][optim]") {
  auto model = nn::gpt(nn::parse_gpt_spec(kSpec));
  model->to(test::host, 1);
  const std::vector<float> before = model->flat_params().to_host();
  optim::AdamW opt(*model, {0.1f, 0.9f, 0.95f, 1e-8f, 0.5f});
  model->zero_grad();
  model->settle_grads();  // zero gradients: the step is the decay alone
  opt.step();
  const std::vector<float> after = model->flat_params().to_host();
  int64_t total = 0;
  const auto offsets = model->layout(&total);
  const auto params = model->parameters();
  for (size_t k = 0; k < params.size(); ++k) {
    const float wd = params[k]->shape.size() >= 2 ? 0.5f : 0.0f;
    INFO(model->named_parameters()[k].first);
    CHECK(params[k]->decay == (params[k]->shape.size() >= 2));
    bool all = true;
    for (int64_t i = offsets[k]; i < offsets[k] + numel(params[k]->shape); ++i) {
      const float p = before[static_cast<size_t>(i)];
      all = all && after[static_cast<size_t>(i)] == p - 0.1f * wd * p;  // as the update computes it
    }
    CHECK(all);
  }
}

TEST_CASE("a GPT trains the same on one device and on three (each its part of the batch), ZeRO 1 too", "[gpt][train]") {
  TrainConfig one = gpt_config();
  one.devices = test::cpus(1);
  TrainConfig three = one;
  three.devices = test::cpus(3);
  const std::vector<float> a = test::final_params(one), b = test::final_params(three);
  REQUIRE(a.size() == b.size());
  CHECK(test::rel_error(b, a) < 1e-5);  // AdamW's steps carry the sums' last bits
  // ZeRO 1: each device updates its part of the buffer (the decay's flags at its offsets).
  three.parallel.zero = 1;
  CHECK(test::rel_error(test::final_params(three), a) < 1e-5);
  // The same steps again: the same bits.
  CHECK(test::final_params(one) == a);
}

TEST_CASE("a GPT trains under ZeRO 2 as under ZeRO 1, its tied embedding's gradient in a slot of its own",
          "[gpt][train][zero]") {
  // The token embedding is written first (as the output projection) and last (as the
  // embedding): its bucket keeps a slot through backward while the others take turns. In
  // bf16, c_attn's and c_fc's bias gradients come out of their weight gradients' GEMMs
  // (the LayerNorms' ones column) and are handed over with them.
  for (auto [bucket_mb, accum, precision] : {std::tuple<double, int, Precision>{0.002, 1, Precision::fp32},
                                             {0.002, 2, Precision::fp32},
                                             {1000.0, 1, Precision::fp32},
                                             {0.002, 1, Precision::bf16},
                                             {0.002, 2, Precision::bf16}}) {
    INFO("buckets of " << bucket_mb << " MB, " << accum << " micro-batches, " << precision_name(precision));
    TrainConfig c = gpt_config();
    c.parallel.precision = precision;
    c.devices = test::cpus(3);
    c.parallel.bucket_mb = bucket_mb;
    c.parallel.grad_accum = accum;
    c.parallel.zero = 1;
    const std::vector<float> one = test::final_params(c);
    c.parallel.zero = 2;
    Trainer two(c);
    for (int64_t s = 0; s < c.steps; ++s) {
      two.step(s);
      REQUIRE(two.parallel().replicas_identical());
    }
    const std::vector<float> got = two.model().flat_params().to_host();
    // The same sums in the same order without micro-batches; with them stage 2 adds each
    // micro-batch's sum to the shard.
    if (accum == 1) CHECK(got == one);
    else CHECK(test::rel_error(got, one) <= 1e-6);
    // Each replica holds its shard, the tied bucket and (with several buckets) two turns.
    int64_t wte = 0, largest_other = static_cast<int64_t>(bucket_mb * 1024 * 1024 / 4);
    for (const auto& [name, p] : two.model().named_parameters())
      if (name == "transformer.wte.weight") wte = numel(p->shape);
      else largest_other = std::max(largest_other, numel(p->shape));
    int64_t total = 0;
    const std::vector<int64_t> offsets = two.model().layout(&total);
    const int64_t params_end = offsets.back() + numel(two.model().parameters().back()->shape);
    const auto shards = two.parallel().zero_partitions();
    const auto bytes = two.parallel().model_state_bytes();
    for (size_t r = 0; r < bytes.size(); ++r) {
      INFO("replica " << r);
      if (bucket_mb > 1.0) {  // one bucket: every parameter, tied
        CHECK(bytes[r].gradients == 4 * (shards[r].count + params_end));
      } else {
        CHECK(bytes[r].gradients >= 4 * (shards[r].count + wte));
        CHECK(bytes[r].gradients <= 4 * (shards[r].count + wte + 2 * largest_other));
      }
    }
  }
}

TEST_CASE("a GPT's run resumed from its checkpoint ends as the run straight through", "[gpt][train]") {
  test::TempDir dir;
  TrainConfig c = gpt_config();
  c.devices = test::cpus(2);
  c.parallel.zero = 1;
  const std::vector<float> straight = test::final_params(c);
  TrainConfig first = c;
  first.steps = 3;
  first.save = dir.file("gpt.safetensors");
  test::final_params(first);
  TrainConfig rest = c;
  rest.resume = first.save;
  CHECK(test::final_params(rest) == straight);
  // The checkpoint holds the sequence length: another is refused.
  rest.seq = 4;
  CHECK(test::usage_error([&] { Trainer t(rest); }).find("was made with TrainConfig::seq '8', this run has 4") !=
        std::string::npos);
}

TEST_CASE("a GPT learns from token files and validates with perplexity", "[gpt][train][tokens]") {
  test::TempDir dir;
  // A sequence the model can learn: token i is (3 i) mod 60.
  std::vector<uint32_t> tokens(2000), val(300);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint32_t>((3 * i) % 60);
  for (size_t i = 0; i < val.size(); ++i) val[i] = static_cast<uint32_t>((3 * i + 30) % 60);
  test_data::write_shard(dir.file("train.bin"), tokens, false);
  test_data::write_shard(dir.file("val.bin"), val, false);
  TrainConfig c = gpt_config(8);
  c.devices = test::cpus(1);
  c.steps = 60;
  c.lr = 0.01f;
  c.data = dir.file("train*.bin");
  c.val_data = dir.file("val.bin");
  c.eval_every = 60;
  Trainer t(c);
  const TrainResult r = t.run();
  CHECK(r.final_loss < 0.5f * r.first_loss);
  CHECK(r.val.rows == (300 - 1) / 8);
  CHECK(std::fabs(r.val.perplexity - std::exp(r.val.loss)) < 1e-9 * r.val.perplexity);
  CHECK(r.val.perplexity < 20.0);
}

TEST_CASE("a GPT's batch in tokens, and what a GPT run refuses", "[gpt][train]") {
  TrainConfig c = gpt_config(2);
  c.devices = test::cpus(2);
  c.batch_tokens = 64;  // 2 sequences of 8 on each of 2 devices: 32 tokens a micro-step
  TrainConfig v = c;
  validate(v);
  CHECK((v.batch == 8 && v.parallel.grad_accum == 2 && v.task == data::Task::language_model));
  c.batch_tokens = 48;
  CHECK(test::usage_error([&] { validate(c); }) ==
        "TrainConfig::batch_tokens of 48 is not a multiple of a micro-step's 32 tokens (TrainConfig::batch 2 x "
        "TrainConfig::seq 8 x 2 device(s))");
  c = gpt_config();
  c.seq = 17;
  CHECK(test::usage_error([&] { validate(c); }) ==
        "TrainConfig::seq of 17 tokens is longer than the model's context of 16 (" + std::string(kSpec) + ")");
  c = test::quiet_config("16-32-4", "sgd", 8);
  c.seq = 8;
  CHECK(test::usage_error([&] { validate(c); }) ==
        "TrainConfig::seq is a GPT's sequence length; TrainConfig::model is not a GPT");
}

TEST_CASE("a GPT's non-finite step is never applied: stop names it, skip-step goes on", "[gpt][train]") {
  TrainConfig c = gpt_config();
  c.devices = test::cpus(1);
  c.optimizer = "sgd";
  c.lr = 1e30f;  // the weights overflow within a few steps
  c.steps = 12;
  c.log_every = 1;
  std::string stopped;
  try {
    Trainer(c).run();
  } catch (const NonFiniteError& e) {
    stopped = e.what();
  }
  INFO(stopped);
  CHECK(stopped.find("is not finite; the update was not applied") != std::string::npos);
  c.on_nonfinite = "skip-step";
  Trainer t(c);
  const TrainResult r = t.run();
  CHECK(r.steps == 12);
  CHECK(r.skipped > 0);
}

TEST_CASE("recomputation gives the same loss and gradients bit for bit, in less memory", "[gpt][recompute]") {
  // gpt:L2-H2-C64-T32-V128, 8 sequences: 256 rows. gelu frees each layer's GELU output
  // [256, 256]; gelu+ln each layer's two LayerNorm outputs [256, 64] too. Backward rebuilds
  // them one at a time, so the peak drops by the layers' tensors less one rebuilt (at most).
  const char* spec = "gpt:L2-H2-C64-T32-V128";
  for (DType compute : {DType::f32, DType::bf16}) {
    const int64_t elem = compute == DType::f32 ? 4 : 2, layers = 2, rows = 8 * 32, C = 64;
    const int64_t gelu_out = rows * 4 * C * elem, ln_out = rows * C * elem;
    const RecomputeStep none = recompute_step(spec, 8, test::host, compute, nn::Recompute::none);
    const RecomputeStep gelu = recompute_step(spec, 8, test::host, compute, nn::Recompute::gelu);
    const RecomputeStep both = recompute_step(spec, 8, test::host, compute, nn::Recompute::gelu_ln);
    INFO(dtype_name(compute) << ": peak none " << none.peak << " B, gelu " << gelu.peak << " B, gelu+ln " << both.peak
                             << " B");
    // In bf16 `none` applies the GELU to the fp32 sum (rounding once, as cuBLASLt's epilogue
    // does), the recomputing modes to the rounded pre-activation they rebuild from: within
    // bf16's rounding of each other. gelu and gelu+ln agree to the bit in both types.
    if (compute == DType::f32) {
      CHECK(gelu.loss == none.loss);
      CHECK(gelu.grads == none.grads);
    } else {
      CHECK(test::rel_error(floats_of(gelu.loss), floats_of(none.loss)) < 1e-2);
      CHECK(test::rel_error(floats_of(gelu.grads), floats_of(none.grads)) < 5e-2);
    }
    CHECK(both.loss == gelu.loss);
    CHECK(both.grads == gelu.grads);
    CHECK(none.peak - gelu.peak >= (layers - 1) * gelu_out);
    CHECK(none.peak - gelu.peak <= layers * gelu_out);
    CHECK(gelu.peak - both.peak >= (layers - 1) * 2 * ln_out);
    CHECK(gelu.peak - both.peak <= layers * 2 * ln_out);
  }
}

TEST_CASE(
    "recomputation and the attention backward are a GPT's settings: replicas carry them, another model "
    "refuses them",
    "[gpt][recompute]") {
  auto model = nn::gpt(nn::parse_gpt_spec(kSpec));
  CHECK(model->attention_backward() == nn::AttentionBackward::deterministic);
  model->set_recompute(nn::Recompute::gelu_ln);
  model->set_attention_backward(nn::AttentionBackward::fast);
  const auto copy = std::static_pointer_cast<nn::GPT>(model->clone());
  CHECK(copy->recompute() == nn::Recompute::gelu_ln);
  CHECK(copy->attention_backward() == nn::AttentionBackward::fast);
  TrainConfig c = test::quiet_config("16-32-4", "sgd", 8);
  c.recompute = nn::Recompute::gelu;
  CHECK(test::usage_error([&] { validate(c); }) ==
        "TrainConfig::recompute applies to GPT models; TrainConfig::model is not a GPT");
  c.recompute = nn::Recompute::none;
  c.attention_backward = nn::AttentionBackward::fast;
  CHECK(test::usage_error([&] { validate(c); }) ==
        "TrainConfig::attention_backward applies to GPT models; TrainConfig::model is not a GPT");
  // An op refuses a saved input that cannot rebuild its x (another shape, another type).
  Tensor W = test::randn_tensor({3, 8}, 2, test::host);
  W.set_requires_grad(true);
  const Tensor x = test::randn_tensor({4, 8}, 1, test::host), g = test::randn_tensor({8}, 3, test::host);
  CHECK_THROWS_AS(linear_pre(x, W, Tensor(), Act::none, act_of(test::randn_tensor({4, 9}, 4, test::host), Act::relu)),
                  Error);
  CHECK_THROWS_AS(linear_pre(x, W, Tensor(), Act::none, layer_norm_of(cast(x, DType::bf16), g, g)), Error);
  CHECK_THROWS_AS(linear_pre(x, W, Tensor(), Act::none, layer_norm_of(x, g, Tensor())), Error);
  // Through the Trainer, on three devices: the same weights as without. Only cuDNN's
  // attention backward has a faster order, so on the CPU fast gives the same weights too.
  TrainConfig one = gpt_config();
  one.devices = test::cpus(3);
  TrainConfig re = one, fast = one;
  re.recompute = nn::Recompute::gelu_ln;
  fast.attention_backward = nn::AttentionBackward::fast;
  const std::vector<float> straight = test::final_params(one);
  CHECK(test::final_params(re) == straight);
  CHECK(test::final_params(fast) == straight);
}

#endif  // DPT_GPU_TESTS

#ifdef DPT_GPU_TESTS  // ---- the GPU cases (dpt_gpu_tests) ----

TEST_CASE("recomputation gives the same bits on the GPU in bf16 (gelu and gelu+ln), in less memory",
          "[gpu][gpt][recompute]") {
  // A small GPT (our kernels after the GEMMs) and one whose MLP GEMMs reach cuBLASLt's
  // epilogues (4096 rows x 1024 x 256: 2^30 multiply-adds).
  for (const auto& [spec, batch] : {std::pair<const char*, int64_t>{"gpt:L2-H2-C64-T32-V128", 8},
                                    std::pair<const char*, int64_t>{"gpt:L2-H4-C256-T256-V512", 16}}) {
    INFO(spec);
    const RecomputeStep none = recompute_step(spec, batch, test::gpu, DType::bf16, nn::Recompute::none);
    const RecomputeStep gelu = recompute_step(spec, batch, test::gpu, DType::bf16, nn::Recompute::gelu);
    const RecomputeStep both = recompute_step(spec, batch, test::gpu, DType::bf16, nn::Recompute::gelu_ln);
    INFO("peak none " << none.peak << " B, gelu " << gelu.peak << " B, gelu+ln " << both.peak << " B");
    // none's GELU reads the fp32 sum (cuBLASLt's epilogue): within bf16 rounding (the CPU case says why).
    CHECK(test::rel_error(floats_of(gelu.loss), floats_of(none.loss)) < 1e-2);
    CHECK(test::rel_error(floats_of(gelu.grads), floats_of(none.grads)) < 5e-2);
    CHECK(both.loss == gelu.loss);
    CHECK(both.grads == gelu.grads);
    CHECK(gelu.peak < none.peak);
    CHECK(both.peak < gelu.peak);
  }
}

#if DPT_WITH_CUDNN_FRONTEND
TEST_CASE("the fast attention backward reaches cuDNN's on every replica, within rounding of the deterministic",
          "[gpu][gpt]") {
  // Head size 64 in bf16: cuDNN's attention. Two replicas of the GPU, 4 steps, 2 layers: 16
  // backwards each way.
  TrainConfig deterministic = test::quiet_config("gpt:L2-H2-C128-T64-V128", "adamw", 8);
  deterministic.steps = 4;
  deterministic.devices = {test::gpu, test::gpu};
  deterministic.parallel.precision = Precision::bf16;
  TrainConfig fast = deterministic;
  fast.attention_backward = nn::AttentionBackward::fast;
  const cuda::SdpaBackwardCalls before = cuda::sdpa_backward_calls();
  const std::vector<float> a = test::final_params(deterministic);
  const cuda::SdpaBackwardCalls between = cuda::sdpa_backward_calls();
  const std::vector<float> b = test::final_params(fast);
  const cuda::SdpaBackwardCalls after = cuda::sdpa_backward_calls();
  CHECK(between.deterministic - before.deterministic == 16);
  CHECK(between.fast == before.fast);
  CHECK(after.fast - between.fast == 16);
  CHECK(after.deterministic == between.deterministic);
  CHECK(test::rel_error(b, a) < 1e-2);
}
#endif

#endif  // DPT_GPU_TESTS
