// CNNs on the CPU: specs (good ones build the layers asked for, bad ones are refused with
// one line naming the layer and the shapes), torch's names for parameters and buffers,
// train/eval modes, replicas of buffers, and image data that is a pure function of the
// sample index.
// On the GPU: CNN training on CUDA, on logical replicas and as a CUDA graph, against the CPU.

#include <climits>
#include <cmath>
#include <cstring>
#include <set>
#include <tuple>
#include <utility>

#include <dptrain/data/synthetic.hpp>
#include <dptrain/error.hpp>
#include <dptrain/layers/conv.hpp>
#include <dptrain/runtime/memory.hpp>
#include <dptrain/train/trainer.hpp>
#include "kernels/cpu/cpu.hpp"
#include "runtime/allocator.hpp"

#if DPT_WITH_CUDA
#include "kernels/cuda/cuda.hpp"
#endif

#include "catch.hpp"
#include "common.hpp"
#include "parallel_common.hpp"

using namespace dpt;
using namespace dpt::test;

#ifndef DPT_GPU_TESTS  // ---- the CPU cases (dpt_tests) ----

namespace {
std::vector<std::string> names(const std::vector<std::pair<std::string, nn::Parameter*>>& v) {
  std::vector<std::string> out;
  for (auto& [n, p] : v) out.push_back(n + " " + shape_str(p->shape));
  return out;
}
}  // namespace

TEST_CASE("CNN specs build the layers they describe", "[cnn]") {
  struct Case {
    std::string spec, layers;
    Shape input;
    int64_t classes;
  };
  const std::vector<Case> cases = {
      {"cnn-small",
       "Sequential(Conv2d(3, 16, 3, padding 1, relu), MaxPool2d(2), Conv2d(16, 32, 3, padding 1, relu), MaxPool2d(2), "
       "Flatten, Linear(512, 10))",
       {3, 16, 16},
       10},
      {"cnn:1x9x7-c4k3s2p0-a3s1p1-f6-f2",
       "Sequential(Conv2d(1, 4, 3, stride 2, relu), AvgPool2d(3, stride 1, padding 1), Flatten, Linear(48, 6, relu), "
       "Linear(6, 2))",
       {1, 9, 7},
       2},
      {"cnn:3x8x8-c4k3-bn-p2-c6k3d2-g-f5",
       "Sequential(Conv2d(3, 4, 3, padding 1), BatchNorm2d(4, relu), MaxPool2d(2), Conv2d(4, 6, 3, padding 2, "
       "dilation 2, relu), AdaptiveAvgPool2d(1), Flatten, Linear(6, 5))",
       {3, 8, 8},
       5},
      {"cnn:2x5x5-bn-c3k1-f4",
       "Sequential(BatchNorm2d(2), Conv2d(2, 3, 1, relu), Flatten, Linear(75, 4))",
       {2, 5, 5},
       4},
      {"cnn",  // the benchmark workload of BENCHMARKS.md and torch_bench.py
       "Sequential(Conv2d(3, 64, 3, padding 1), BatchNorm2d(64, relu), MaxPool2d(2), Conv2d(64, 128, 3, padding 1), "
       "BatchNorm2d(128, relu), MaxPool2d(2), Conv2d(128, 256, 3, padding 1), BatchNorm2d(256, relu), MaxPool2d(2), "
       "AdaptiveAvgPool2d(1), Flatten, Linear(256, 10))",
       {3, 32, 32},
       10},
  };
  for (const Case& c : cases) {
    INFO(c.spec);
    CHECK(nn::is_cnn_spec(c.spec));
    const nn::CnnSpec s = nn::parse_cnn_spec(c.spec);
    CHECK(s.input == c.input);
    CHECK(s.classes == c.classes);
    auto model = nn::cnn(c.spec);
    CHECK(model->describe() == c.layers);
    // The shapes inferred at build time are the shapes the layers produce.
    model->to(host, 1);
    Shape in{2};
    for (int64_t d : c.input) in.push_back(d);
    NoGradGuard g;
    CHECK(model->forward(test::randn_tensor(in, 3, host)).shape() == Shape{2, c.classes});
  }
  CHECK_FALSE(nn::is_cnn_spec("16-128x2-4"));
}

TEST_CASE("bad CNN specs are refused with one line naming the layer and the shapes", "[cnn]") {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"cnn:3x8x8-c16k9p0-f10", "layer 1 'c16k9p0': kernel 9 does not fit the input 3x8x8 with padding 0"},
      {"cnn:3x8x8-c4k5d3p0-f10",
       "layer 1 'c4k5d3p0': kernel 5 (dilation 3) does not fit the input 3x8x8 with padding 0"},
      {"cnn:3x4x4-p2-p2-p2-f10", "layer 3 'p2': window 2 does not fit the input 3x1x1"},
      {"cnn:3x6x6-a7-f2", "layer 1 'a7': window 7 does not fit the input 3x6x6"},
      {"cnn:3x6x6-p2p2-f2", "layer 1 'p2p2': padding 2 is more than half the window 2"},
      {"cnn:3x8x8-f10-bn-f5",
       "layer 2 'bn': batch norm needs an image [C, H, W], but after a linear layer the input "
       "is 10 features"},
      {"cnn:3x8x8-f10-c3k3-f4", "layer 2 'c3k3': a convolution needs an image"},
      {"cnn:3x8x8-f10-g-f4", "layer 2 'g': global pooling needs an image"},
      {"cnn:3x8x8-c16q3-f10", "layer 1 'c16q3': 'c16q3' is not a layer (expected cNkK[sS][pP][dD], bn"},
      {"cnn:3x8x8-c16k3k3-f10", "'c16k3k3' is not a layer"},
      {"cnn:3x8x8-c16-f10", "layer 1 'c16': a convolution needs its kernel size"},
      {"cnn:3x8x8-c8k-f2", "expected a number for the kernel size in 'c8k'"},
      {"cnn:3x8x8-c0k3-f2", "the number of channels must be 1..65536"},
      {"cnn:3x8x8-c99999999999999999999k3-f2", "the number of channels must be 1..65536"},
      {"cnn:3x8x8-f10x", "layer 1 'f10x': 'f10x' is not a layer"},
      {"cnn:3x8x8--f2", "layer 1 '': '' is not a layer"},
      {"cnn:3x8x8-c4k3", "the last layer must be fN, the number of classes (got 'c4k3')"},
      {"cnn:3x8x8", "no layers after the input 3x8x8"},
      {"cnn:3x8-f2", "input '3x8': expected CxHxW"},
      {"cnn:3x8x8x2-f2", "input '3x8x8x2': expected CxHxW"},
      {"cnn:0x8x8-f2", "input '0x8x8': the channels must be 1..65536"},
      {"cnn:", "input '': expected a number for the channels"},
      {"cnn-big", "unknown CNN preset (expected cnn-small, cnn, or cnn:CxHxW-LAYER-...-fN"},
  };
  for (const auto& [spec, problem] : cases) {
    INFO(spec);
    check_one_line(usage_error([&] { nn::parse_cnn_spec(spec); }), "invalid model spec '" + spec + "': ", problem);
  }
}

TEST_CASE("CNN parameters and buffers carry torch.nn.Sequential's names and shapes", "[cnn]") {
  auto model = nn::cnn("cnn:3x8x8-c4k3-bn-p2-c6k3-g-f5");
  // 0 Conv2d, 1 BatchNorm2d, 2 ReLU, 3 MaxPool2d, 4 Conv2d, 5 ReLU, 6 AdaptiveAvgPool2d,
  // 7 Flatten, 8 Linear
  CHECK(names(model->named_parameters()) ==
        std::vector<std::string>{"0.weight [4, 3, 3, 3]", "0.bias [4]", "1.weight [4]", "1.bias [4]",
                                 "4.weight [6, 4, 3, 3]", "4.bias [6]", "8.weight [5, 6]", "8.bias [5]"});
  std::vector<std::string> buffers;
  for (auto& [n, b] : model->named_buffers()) buffers.push_back(n + " " + shape_str(b->shape));
  CHECK(buffers == std::vector<std::string>{"1.running_mean [4]", "1.running_var [4]"});
  // Batch norm starts as the identity: weight 1, bias 0, running mean 0 and variance 1.
  model->to(host, 5);
  auto params = model->named_parameters();
  CHECK(params[2].second->value.to_host() == std::vector<float>(4, 1.0f));
  CHECK(params[3].second->value.to_host() == std::vector<float>(4, 0.0f));
  CHECK(model->named_buffers()[0].second->value.to_host() == std::vector<float>(4, 0.0f));
  CHECK(model->named_buffers()[1].second->value.to_host() == std::vector<float>(4, 1.0f));
  CHECK(model->flat_grads().numel() == model->flat_params().numel());  // buffers have no gradients
}

TEST_CASE("train() and eval() reach every layer; evaluation uses and keeps the running statistics", "[cnn]") {
  auto model = nn::cnn("cnn:2x6x6-c4k3-bn-f3");
  model->to(host, 7);
  Tensor x = test::randn_tensor({8, 2, 6, 6}, 8, host, 2.0f);
  const Tensor& buffers = model->flat_buffers();
  const auto initial = buffers.to_host();
  {
    NoGradGuard g;  // training mode moves the running statistics, gradients or not
    model->forward(x);
  }
  const auto moved = buffers.to_host();
  CHECK(moved != initial);
  model->eval();
  auto r = model->replicate({DeviceType::cpu, 1});
  CHECK_FALSE(r->training());
  CHECK(r->flat_buffers().to_host() == moved);  // replicas start with the buffers
  NoGradGuard g;
  const auto whole = model->forward(x).to_host();
  CHECK(buffers.to_host() == moved);
  // In evaluation a sample's output does not depend on the batch around it.
  const auto part = model->forward(x.view(3 * 72, {2, 2, 6, 6})).to_host();
  CHECK(std::vector<float>(whole.begin() + 9, whole.begin() + 15) == part);
  model->train();
  const auto again = model->forward(x.view(3 * 72, {2, 2, 6, 6})).to_host();
  CHECK(again != part);  // training mode: the batch's own statistics
}

TEST_CASE("synthetic images and their labels are a pure function of (seed, sample index)", "[cnn][data]") {
  data::Synthetic d({.task = data::Task::classification, .out = 10, .image = {3, 8, 8}, .seed = 4}, host);
  const data::Batch all = d.batch(0, 200), part = d.batch(37, 5);
  CHECK(all.x.shape() == Shape{200, 3, 8, 8});
  const auto xa = all.x.to_host(), xp = part.x.to_host();
  CHECK(std::vector<float>(xa.begin() + 37 * 192, xa.begin() + 42 * 192) == xp);
  const auto ya = all.y.to_host_i32(), yp = part.y.to_host_i32();
  CHECK(std::vector<int32_t>(ya.begin() + 37, ya.begin() + 42) == yp);
  // The teacher is not degenerate: most classes occur.
  CHECK(std::set<int32_t>(ya.begin(), ya.end()).size() >= 6);
}

#else  // ---- CUDA against the CPU (dpt_gpu_tests: where there is a GPU) ----

// ---- Convolutional networks on the GPU --------------------------------------------------

#if DPT_WITH_CUDNN
namespace {
TrainConfig cnn_config(const std::string& spec, const std::string& opt = "sgd") {
  TrainConfig c = quiet_config(spec, opt, 10);  // batch 10: uneven on 3 and 4 replicas
  c.task = data::Task::classification;
  c.steps = 30;
  return c;
}
}  // namespace

TEST_CASE("30 CNN training steps on CUDA match the same run on the CPU", "[gpu][conv][train]") {
  for (std::string spec : {"cnn:3x9x9-c6k3-p2-c8k3s2-a2-f5", "cnn:3x8x8-c6k3-bn-p2-c8k1-g-f4"}) {
    for (std::string opt : {"sgd", "adamw"}) {
      // Batch norm cancels the gradient of the convolution bias before it (its true value
      // is 0), leaving rounding noise that differs between CPU and GPU; AdamW divides by
      // its size and turns the noise into full steps, so only SGD is compared there.
      if (spec.find("bn") != std::string::npos && opt == "adamw") continue;
      INFO(spec << " " << opt);
      run_on_cpu_and_gpu(
          cnn_config(spec, opt), [](Trainer& a, const TrainResult& ra, Trainer& b, const TrainResult& rb) {
            const double err = params_error(a, b);
            const bool has_buffers = a.model().flat_buffers().defined();  // batch norm's running statistics
            const double err_buf =
                has_buffers ? rel_error(b.model().flat_buffers().to_host(), a.model().flat_buffers().to_host()) : 0.0;
            INFO("weights relative error " << err << ", buffers " << err_buf << ", loss " << ra.final_loss << " vs "
                                           << rb.final_loss);
            CHECK(err < 1e-4);
            CHECK(err_buf < 1e-4);
            CHECK(std::fabs(ra.final_loss - rb.final_loss) <= 1e-3 * std::fabs(ra.final_loss));
          });
    }
  }
}

TEST_CASE("a CNN on logical replicas of one GPU equals one-GPU training, with no cudaMalloc after the first step",
          "[gpu][conv][parallel][allocator]") {
  // Without batch norm N replicas are exactly one device; with it each replica normalizes
  // its own shard (as nn.DataParallel), so only the replicas' agreement is checked.
  const TrainConfig c = cnn_config("cnn:3x9x9-c6k3-p2-c8k3-g-f5");
  const auto want = train_dp(c, {gpu}, Reduce::automatic);
  for (int n : {2, 3}) {
    INFO(n << " replicas");
    const auto got = train_dp(c, std::vector<Device>(static_cast<size_t>(n), gpu), Reduce::p2p);
    const double err = rel_error(got, want);
    INFO("relative error " << err);
    CHECK(err < 1e-5);
  }
  TrainConfig bn = cnn_config("cnn:3x8x8-c6k3-bn-p2-f4");
  train_dp(bn, {gpu, gpu, gpu}, Reduce::p2p);  // asserts the replicas (buffers too) stay identical
  bn.devices = {gpu, gpu};
  bn.parallel.reduce = Reduce::p2p;
  Trainer t(bn);
  check_no_allocs_after_first(t, {gpu});
}

TEST_CASE("a CNN step recorded as a CUDA graph trains exactly like the eager step", "[gpu][conv][graph]") {
  TrainConfig c = cnn_config("cnn:3x8x8-c6k3-bn-p2-c8k3-g-f4");
  c.batch = 16;
  c.devices = {gpu};
  // Each run's memory from an empty cache: the graph reuses within the recording what the
  // step frees, so it holds about one eager step's memory, not every temporary.
  allocator(gpu).empty_cache();
  allocator(gpu).reset_peak();
  const size_t eager_base = allocator(gpu).stats().reserved;  // what earlier tests still hold
  Trainer eager(c);
  eager.run();
  const size_t eager_peak = allocator(gpu).stats().peak_reserved - eager_base;
  c.parallel.cuda_graph = true;
  allocator(gpu).empty_cache();
  allocator(gpu).reset_peak();
  const size_t base = allocator(gpu).stats().reserved;  // eager's model and optimizer, still alive
  Trainer graphed(c);
  graphed.run();
  const size_t graph_peak = allocator(gpu).stats().peak_reserved - base;
  INFO("peak reserved: eager " << eager_peak << " B, graph " << graph_peak << " B");
  CHECK(graph_peak <= eager_peak + eager_peak / 4);
  CHECK(rel_error(graphed.model().flat_params().to_host(), eager.model().flat_params().to_host()) <= 1e-6);
  CHECK(rel_error(graphed.model().flat_buffers().to_host(), eager.model().flat_buffers().to_host()) <= 1e-6);
  // Batch norm on 2 logical replicas with 2 micro-batches: the running statistics are
  // copied from the master to the other replica inside the graph too.
  c.devices = {gpu, gpu};
  c.parallel.grad_accum = 2;
  c.parallel.cuda_graph = false;
  run_and_rerun(
      c, [](TrainConfig& graph) { graph.parallel.cuda_graph = true; },
      [](Trainer& eager2, Trainer& graphed2) {
        CHECK(graphed2.model().flat_params().to_host() == eager2.model().flat_params().to_host());
        CHECK(graphed2.model().flat_buffers().to_host() == eager2.model().flat_buffers().to_host());
      });
}
#endif

#endif  // DPT_GPU_TESTS
