// step_bench: times dptrain's training step on one device for a reference workload of
// BENCHMARKS.md (seed, mlp, cnn, or any MLP or CNN spec), with a fixed random batch so
// only the step is timed (forward, loss, backward, SGD), as the PyTorch twin
// (torch_bench.py) does.
// Prints one line: workload, precision, gemm, ms/step (median of timed blocks),
// samples/s, peak memory, the loss before and after as a sanity check, and the mean of
// the blocks (a run's summary is a mean: loop_vs_step.sh compares with it). bf16 trains
// with bf16 storage (Module::set_compute_dtype), as dptrain --precision bf16 does.
// --check makes the update the one dptrain's loop makes: it also checks the gradients
// (a non-finite step is skipped on the device) and records each check in a ring of host
// memory, with twin buffers where DataParallel takes them (a GPU, kTwinsFromParams
// parameters or more; then a graph is recorded for each parity, as the loop records it),
// so that the loop can be compared with the step it runs as well as with the plain step.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include <dptrain/data/synthetic.hpp>
#include <dptrain/layers/conv.hpp>
#include <dptrain/layers/layers.hpp>
#include <dptrain/layers/loss.hpp>
#include <dptrain/optim/optim.hpp>
#include <dptrain/parallel/data_parallel.hpp>
#include <dptrain/runtime/context.hpp>
#include <dptrain/runtime/memory.hpp>
#include <dptrain/runtime/ops.hpp>

using namespace dpt;

int main(int argc, char** argv) {
  CLI::App app{"step_bench: time one training step of dptrain"};
  std::string model = "seed", precision = "fp32", gemm = "cublas", device = "cuda:0";
  int64_t batch = 64, warmup = 20, blocks = 7, per_block = 20, graph_steps = 1;
  bool graph = false, check = false;
  app.add_option("--model", model, "seed, mlp, cnn, an MLP spec or cnn:SPEC");
  app.add_option("--batch", batch, "Batch size");
  app.add_option("--precision", precision, "fp32, tf32, bf16");
  app.add_option("--gemm", gemm, "cublas or native");
  app.add_option("--devices", device, "Device");
  app.add_option("--warmup", warmup, "Untimed steps");
  app.add_option("--blocks", blocks, "Timed blocks (the median is reported)");
  app.add_option("--steps", per_block, "Steps per timed block");
  app.add_flag("--cuda-graph", graph, "Record the step as a CUDA graph after warm-up and time its replays");
  app.add_flag("--check", check,
               "Check the gradients in the update and record the check in host memory, as dptrain's loop does");
  app.add_option("--graph-steps", graph_steps, "With --cuda-graph: steps recorded in one graph (one replay runs them)")
      ->check(CLI::Range(1, 64));
  CLI11_PARSE(app, argc, argv);
  try {
    const Device d = parse_devices(device).front();
    Context& ctx = context(d);
    ctx.precision = parse_precision(precision);
    ctx.gemm = parse_gemm(gemm);
    // An MLP regresses random targets (MSE); a CNN classifies random images (cross-entropy
    // against labels drawn from the same generator).
    const bool is_cnn = nn::is_cnn_spec(model);
    std::shared_ptr<nn::Module> net;
    Tensor x, y;
    if (is_cnn) {
      const nn::CnnSpec spec = nn::parse_cnn_spec(model);
      net = nn::cnn(model, Act::relu);
      x = Tensor::empty({batch, spec.input[0], spec.input[1], spec.input[2]}, DType::f32, d);
      y = data::random_labels(batch, spec.classes, 1, 2, 0, d);
    } else {
      const auto widths = nn::parse_mlp_spec(model);
      net = nn::mlp(model, Act::relu);
      x = Tensor::empty({batch, widths.front()}, DType::f32, d);
      y = Tensor::empty({batch, widths.back()}, DType::f32, d);
      normal_(y, 1, 2, 0);
    }
    normal_(x, 1, 1, 0);
    // bf16 is bf16 storage, as in training: activations and weight copies in bf16, fp32
    // master weights, gradients and optimizer state (the input is cast in the first layer).
    net->set_compute_dtype(ctx.precision == Precision::bf16 ? DType::bf16 : DType::f32);
    net->to(d, 1);
    optim::SGD opt(*net, {.lr = 0.01f});
    const bool twins = check && d.is_cuda() && net->flat_params().numel() >= kTwinsFromParams;
    opt.set_twin_buffers(twins);
    // The loop's ring: kSlots records in mapped host memory (train/nonfinite_watch.hpp's
    // kLag), read by no one here.
    constexpr int64_t kSlots = 8;
    PinnedBuffer records(sizeof(CheckRecord) * kSlots, d, /*mapped=*/true);
    const CheckRing ring{static_cast<CheckRecord*>(records.device_data()), kSlots, Tensor::zeros({2}, DType::i32, d)};
    auto step = [&] {
      net->zero_grad();
      Tensor out = net->forward(x);
      Tensor loss = is_cnn ? cross_entropy(out, y) : nn::MSELoss()(out, y);
      loss.backward();
      if (check) opt.checked_step(0.0f, ring);
      else opt.step();
      return loss;
    };
    const float first = step().item();
    for (int64_t i = 1; i < warmup; ++i) step();
    ctx.synchronize();
    // With a graph, the timed "step" is one replay of a recorded step; its loss tensor
    // is the one the graph writes. With twins a step's forward reads the copy its parity
    // names: a recording for each parity (of an odd number of steps), replayed in turn.
    std::vector<std::unique_ptr<Graph>> recorded;
    std::vector<Tensor> graph_loss;  // each recording's
    if (graph)
      for (int parity = 0; parity < (twins && graph_steps % 2 == 1 ? 2 : 1); ++parity) {
        recorded.push_back(std::make_unique<Graph>(ctx, recorded.empty() ? nullptr : recorded.front().get()));
        recorded.back()->begin();
        graph_loss.emplace_back();
        for (int64_t i = 0; i < graph_steps; ++i) graph_loss.back() = step();
        recorded.back()->end();
      }
    // A replay of a graph of several steps counts as that many steps.
    const int64_t per_call = recorded.empty() ? 1 : graph_steps;
    size_t replays = 0;
    auto timed_step = [&] {
      if (recorded.empty()) return step();
      const size_t k = replays++ % recorded.size();
      recorded[k]->launch();
      return graph_loss[k];
    };
    std::vector<double> ms;
    Tensor loss;
    for (int64_t b = 0; b < blocks; ++b) {
      const auto t0 = std::chrono::steady_clock::now();
      int64_t done = 0;
      for (; done < per_block; done += per_call) loss = timed_step();
      ctx.synchronize();
      const auto t1 = std::chrono::steady_clock::now();
      ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count() / static_cast<double>(done));
    }
    // The median block, robust to a slow one; and the mean, the statistic of a run's
    // summary (dptrain's ms/step is its time over its steps), for comparing with one.
    double mean = 0;
    for (double v : ms) mean += v / static_cast<double>(ms.size());
    std::sort(ms.begin(), ms.end());
    const double med = ms[ms.size() / 2];
    const auto st = memory_stats(d);
    std::printf(
        "dptrain %s batch %lld %s %s%s%s: %.4f ms/step, %.4g samples/s, peak %.1f MiB, loss %.5g -> %.5g; mean %.4f "
        "ms/step\n",
        model.c_str(), static_cast<long long>(batch), precision.c_str(), gemm.c_str(), graph ? "-graph" : "",
        check ? "-checked" : "", med, 1e3 * static_cast<double>(batch) / med,
        static_cast<double>(st.peak_allocated) / (1 << 20), first, loss.item(), mean);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "step_bench: error: %s\n", e.what());
    return 1;
  }
}
